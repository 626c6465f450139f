"""attn.host_memory: XLA's per-call buffers come back without page faults (mimalloc preloaded)."""

import json
import os
import platform
import subprocess
import sys

import pytest

from attn import host_memory
from attn.config import ConfigError

PAGES = 40 * 2**20 // 4096  # a 40 MB result: over glibc's largest mmap threshold (32 MB)

# Faults per call of a jitted x * 2 on 40 MB, in a fresh process that sets the allocator first.
_PROBE = f"""
import json, resource
from attn import host_memory
from attn.config import ConfigError
host_memory.use_kept_allocator()
setting = host_memory.keep_freed_memory()
import jax, jax.numpy as jnp
f = jax.jit(lambda x: x * 2.0)
x = jnp.ones({PAGES * 1024}, jnp.float32)
faults = []
for i in range(11):
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  y = jax.block_until_ready(f(x))
  faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
  assert float(y[-1]) == 2.0
  y.delete()
print(json.dumps({{"setting": setting, "faults": faults[3:]}}))
"""

needs_mimalloc = pytest.mark.skipif(
    platform.system() != "Linux" or platform.machine() != "x86_64" or platform.libc_ver()[0] != "glibc",
    reason="cmeel-mimalloc is a dependency on Linux x86-64 (glibc) only")


def _probe(mode: str) -> dict:
  env = dict(os.environ, **{host_memory.ENV: mode})
  env.pop(host_memory.PRELOADED, None)
  env.pop("LD_PRELOAD", None)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
  out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True,
                       timeout=300, cwd=root)
  assert out.returncode == 0, out.stderr[-2000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@needs_mimalloc
def test_kept_allocator_serves_each_call_without_page_faults():
  assert host_memory.mimalloc_path(), "cmeel-mimalloc is not installed (a dependency on Linux x86-64)"
  kept = _probe("keep")
  assert kept["setting"].startswith("mimalloc"), kept
  # glibc's heap (mallopt) faulted 4,111-8,207 of the 10,240 pages per call; a fresh mapping all of them
  assert max(kept["faults"]) < PAGES // 10, kept
  untouched = _probe("default")  # the probe counts what it should: glibc maps the block afresh
  assert untouched["setting"].startswith("glibc default"), untouched
  assert min(untouched["faults"]) > PAGES * 0.9, untouched


def test_the_attn_command_is_recognised(monkeypatch):
  monkeypatch.setattr(sys, "orig_argv", ["python", "-m", "attn", "sweep", "x.toml"])
  assert host_memory.is_attn_command()
  monkeypatch.setattr(sys, "orig_argv", ["/venv/bin/python", "/venv/bin/attn", "bench"])
  assert host_memory.is_attn_command()
  monkeypatch.setattr(sys, "orig_argv", ["python", "-m", "pytest", "tests"])
  assert not host_memory.is_attn_command()
  monkeypatch.setattr(sys, "orig_argv", ["python", "scripts/attn_helper.py"])
  assert not host_memory.is_attn_command()


def test_no_reexec_outside_keep_or_twice(monkeypatch):
  calls = []
  monkeypatch.setattr(os, "execve", lambda *a: calls.append(a))
  monkeypatch.setenv(host_memory.ENV, "mallopt")
  host_memory.use_kept_allocator()
  monkeypatch.setenv(host_memory.ENV, "keep")
  monkeypatch.setenv(host_memory.PRELOADED, "/some/libmimalloc.so")
  host_memory.use_kept_allocator()
  assert calls == []
  monkeypatch.delenv(host_memory.PRELOADED)
  monkeypatch.setattr(host_memory, "mimalloc_path", lambda: "/lib/libmimalloc.so")
  monkeypatch.setattr(host_memory, "_glibc_linux", lambda: True)
  monkeypatch.setenv("LD_PRELOAD", "/other.so")
  host_memory.use_kept_allocator()
  (exe, argv, env), = calls
  assert exe == sys.executable and argv == sys.orig_argv
  assert env["LD_PRELOAD"] == "/lib/libmimalloc.so:/other.so" and env[host_memory.PRELOADED]


def test_host_memory_mode_is_checked(monkeypatch):
  monkeypatch.setenv(host_memory.ENV, "never")
  with pytest.raises(ConfigError, match="ATTN_HOST_MALLOC='never'"):
    host_memory.mode()
  monkeypatch.setenv(host_memory.ENV, "default")
  assert host_memory.mode() == "default"
  monkeypatch.setenv(host_memory.ENV, "mallopt")
  assert host_memory.mode() == "mallopt"


def test_an_accelerator_run_leaves_the_allocator_alone(monkeypatch):
  calls = []
  monkeypatch.setattr(os, "execve", lambda *a: calls.append(a))
  monkeypatch.setenv(host_memory.ENV, "keep")
  monkeypatch.delenv(host_memory.PRELOADED, raising=False)
  monkeypatch.setattr(host_memory, "mimalloc_path", lambda: "/lib/libmimalloc.so")
  monkeypatch.setattr(host_memory, "_glibc_linux", lambda: True)
  monkeypatch.setattr(host_memory, "accelerator_plugin", lambda: "jax_cuda12_plugin")
  host_memory.use_kept_allocator()
  assert calls == []
  monkeypatch.setattr(host_memory, "_state", {})
  monkeypatch.setattr(host_memory, "mimalloc_loaded", lambda: False)
  assert "accelerator run: jax_cuda12_plugin" in host_memory.keep_freed_memory()


def test_jax_platforms_cpu_is_not_an_accelerator_run(monkeypatch):
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  assert host_memory.accelerator_plugin() is None
