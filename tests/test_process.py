"""attn.process: `import attn` leaves the process alone; the attn command sets up its own, first, and says so."""

import json
import os
import pathlib
import platform
import subprocess
import sys

import pytest

from attn import process
from attn.process import allocator, command
from conftest import TINY_SWEEP

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = 40 * 2**20 // 4096  # a 40 MB result: over glibc's largest mmap threshold (32 MB)

needs_mimalloc = pytest.mark.skipif(
    platform.system() != "Linux" or platform.machine() != "x86_64" or platform.libc_ver()[0] != "glibc",
    reason="cmeel-mimalloc is a dependency on Linux x86-64 (glibc) only")


def _env(**changes):
  """This environment without any allocator of attn's, attn's tree first on the path, with `changes`."""
  env = process.clean_env()
  for key in ("LD_PRELOAD", "MIMALLOC_PURGE_DELAY", process.ENV, process.XLA_CHECKED, "ATTN_FAULT", "XLA_FLAGS"):
    env.pop(key, None)
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  env.setdefault("ATTN_JAX_CACHE", os.environ.get("ATTN_TEST_JAX_CACHE") or os.path.join(
      os.path.expanduser("~"), ".cache", "attn", "jax-tests"))
  return {**env, **changes}


def _python(code, **env):
  out = subprocess.run([sys.executable, "-c", code], env=_env(**env), capture_output=True, text=True, timeout=300,
                       cwd=ROOT)
  assert out.returncode == 0, out.stderr[-2000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


# The console script beside the interpreter running the tests, not whichever attn is first on PATH.
CONSOLE = pathlib.Path(sys.executable).parent / "attn"


def _attn(*args, console=False, **env):
  cmd = [str(CONSOLE)] if console else [sys.executable, "-m", "attn"]
  return subprocess.run([*cmd, *args], env=_env(**env), capture_output=True, text=True, timeout=300, cwd=ROOT)


_STATE = """
import json, os, sys, threading
def state():
  from attn.process import faults
  return {"ld_preload": os.environ.get("LD_PRELOAD"), "purge": os.environ.get("MIMALLOC_PURGE_DELAY"),
          "mimalloc_mapped": "libmimalloc" in open("/proc/self/maps").read(),
          "hooks": [sys.unraisablehook is sys.__unraisablehook__, threading.excepthook is threading.__excepthook__],
          "armed": faults._armed["kind"], "env": dict(os.environ)}
"""


def test_import_attn_leaves_the_process_alone():
  code = _STATE + """
before = dict(os.environ)
import attn
names = [getattr(attn, n) for n in attn.__all__]  # every name, attn.nn and attn.testing included
from attn.experiments.training import checkpoints, train
from attn.process import faults
from attn import process
s = state()
print(json.dumps({**s, "env": s["env"] == before, "allocator": process.in_force()}))
"""
  got = _python(code, ATTN_FAULT="row:1:EIO")
  assert got["ld_preload"] is None and got["purge"] is None and not got["mimalloc_mapped"], got
  assert got["env"] and got["hooks"] == [True, True] and got["armed"] is None, got
  assert got["allocator"].startswith("glibc default (not a process of the attn command"), got


def test_train_group_with_checkpoints_leaves_its_callers_process_alone(tmp_path, monkeypatch):
  import threading
  from attn.experiments.running import config as config_lib
  from attn.experiments.training import train

  def refuse(*a):
    raise AssertionError("the library set up its caller's process")

  monkeypatch.setattr(allocator, "_mallopt", refuse)
  monkeypatch.setattr(process, "setup", refuse)
  hooks = (sys.unraisablehook, threading.excepthook)
  cfg = config_lib.resolve({"task": {"name": "mqar", "vocab_size": 16, "seq_len": 12, "num_pairs": 2},
                            "model": {"d_model": 16, "num_layers": 1, "num_heads": 2, "d_ff": 16},
                            "train": {"steps": 2, "batch_size": 2, "eval_batches": 1}}, [], None)
  (summary,) = train.train_group([cfg], lambda i, r: None, checkpoint_dirs=[str(tmp_path / "ckpt")])
  assert summary["status"] == "ok" and os.listdir(tmp_path / "ckpt")  # a Saver wrote
  assert (sys.unraisablehook, threading.excepthook) == hooks and "allocator" not in command._state


def test_import_attn_starts_no_jax():
  got = _python("import sys, json, attn; print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
                "('jax', 'flax', 'numpy'))))")
  assert got == []


@needs_mimalloc
def test_setup_preloads_mimalloc_installs_hooks_arms_faults_and_leaves_children_clean():
  assert process.mimalloc_path(), "cmeel-mimalloc is not installed (a dependency on Linux x86-64)"
  code = _STATE + """
from attn import process
allocator = process.setup()
import subprocess
child = subprocess.run(["sh", "-c", "echo \\"$LD_PRELOAD|$MIMALLOC_PURGE_DELAY\\""], capture_output=True, text=True)
print(json.dumps({**state(), "env": None, "allocator": allocator, "child": child.stdout.strip(),
                  "compiler": process.clean_env().get("LD_PRELOAD")}))
"""
  got = _python(code, ATTN_FAULT="row:3:EIO", LD_PRELOAD="")
  assert got["allocator"] == "mimalloc (LD_PRELOAD, MIMALLOC_PURGE_DELAY=-1)" and got["mimalloc_mapped"], got
  assert got["ld_preload"] == "" and got["purge"] is None and got["child"] == "|", got  # as the user had it
  assert got["hooks"] == [False, False] and got["armed"] == "row", got


def test_the_environment_attn_adds_is_taken_back_exactly():
  user = {"LD_PRELOAD": "/other.so", "PATH": "/bin"}
  saved = allocator.mimalloc_path, allocator._glibc_linux
  try:
    allocator.mimalloc_path, allocator._glibc_linux = (lambda: "/lib/libmimalloc.so"), (lambda: True)
    kept = process.allocator_env("keep", user)
    tuned = process.allocator_env("mallopt", user)
  finally:
    allocator.mimalloc_path, allocator._glibc_linux = saved
  assert kept["LD_PRELOAD"] == "/lib/libmimalloc.so:/other.so" and kept["MIMALLOC_PURGE_DELAY"] == "-1"
  assert process.allocator_env("keep", kept) == kept  # never twice
  assert "glibc.malloc.mmap_max=0" in tuned["GLIBC_TUNABLES"] and "LD_PRELOAD" in tuned
  assert process.clean_env(kept) == user and process.clean_env(tuned) == user
  assert process.allocator_env("default", user) == user


def test_no_reexec_outside_keep_or_twice(monkeypatch):
  calls = []
  monkeypatch.setattr(os, "execve", lambda *a: calls.append(a))
  monkeypatch.setattr(allocator, "mimalloc_path", lambda: "/lib/libmimalloc.so")
  monkeypatch.setattr(allocator, "_glibc_linux", lambda: True)
  monkeypatch.setenv(process.PRELOADED, "{}")
  allocator._reexec_with_mimalloc()
  assert calls == []
  monkeypatch.delenv(process.PRELOADED)
  allocator._reexec_with_mimalloc()
  (exe, argv, env), = calls
  assert exe == sys.executable and argv == sys.orig_argv and env["LD_PRELOAD"].startswith("/lib/libmimalloc.so")


# The console script fast; `python -m attn` slow (its refusal path is the fast XLA_FLAGS case's below).
@pytest.mark.parametrize("console", [pytest.param(False, marks=pytest.mark.slow), True])
def test_an_unknown_host_malloc_is_refused_by_name_before_anything_runs(console):
  if console and not CONSOLE.exists():
    pytest.skip(f"no attn console script beside {sys.executable}")
  p = _attn("count", console=console, ATTN_HOST_MALLOC="bogus")
  assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
  assert "ATTN_HOST_MALLOC='bogus'" in p.stderr and "['keep', 'mallopt', 'default']" in p.stderr, p.stderr
  assert p.stdout == ""


@pytest.mark.parametrize("flags, named", [  # one fast, the others slow
    ("bogus", "'bogus' does not start with --"),
    pytest.param("--xla_cpu_enable_fast_math=false 2", "'2' does not start with --", marks=pytest.mark.slow),
    pytest.param("--xla_attn_no_such_flag=1", "--xla_attn_no_such_flag=1 is not a flag", marks=pytest.mark.slow)])
def test_xla_flags_xla_would_abort_on_are_refused_by_name(flags, named):
  p = _attn("count", XLA_FLAGS=flags)
  assert p.returncode == 2 and "Traceback" not in p.stderr and "F0000" not in p.stderr, p.stderr
  assert f"XLA_FLAGS='{flags}'" in p.stderr and named in p.stderr, p.stderr


def test_attn_python_runs_a_library_users_script_with_the_commands_allocator():
  code = ("import json, os, attn; from attn import process; print(json.dumps([os.environ.get('LD_PRELOAD'), "
          "process.in_force(), process.clean_env().get('LD_PRELOAD')]))")
  p = _attn("python", "-c", code)
  assert p.returncode == 0, p.stderr
  preload, in_force, for_children = json.loads(p.stdout.strip().splitlines()[-1])
  if process.mimalloc_path():
    assert "libmimalloc" in preload and in_force.startswith("mimalloc (preloaded"), (preload, in_force)
  assert for_children is None
  printed = _attn("python", "--print-env")
  assert printed.returncode == 0 and all("=" in line for line in printed.stdout.splitlines()), printed
  if process.mimalloc_path():
    assert f"LD_PRELOAD={process.mimalloc_path()}" in printed.stdout.splitlines()


@pytest.mark.slow
def test_attn_sweep_and_python_m_attn_sweep_record_the_same_allocator(tmp_path):
  if not CONSOLE.exists():
    pytest.skip(f"no attn console script beside {sys.executable}")
  (tmp_path / "tiny.toml").write_text(TINY_SWEEP)
  allocators = []
  for console in (True, False):
    out = tmp_path / f"out-{console}"
    p = _attn("sweep", str(tmp_path / "tiny.toml"), "--out", str(out), "--no-report", console=console)
    assert p.returncode == 0, p.stderr
    start = json.loads((out / "run.jsonl").read_text().splitlines()[0])
    allocators.append(start["allocator"])
  assert allocators[0] == allocators[1], allocators
  assert allocators[0].startswith("mimalloc" if process.mimalloc_path() else "glibc mallopt"), allocators


# Faults per call of a jitted x * 2 on 40 MB, in a fresh process set up as the command's.
_PROBE = f"""
import json, resource
from attn import process
setting = process.setup()
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


@pytest.mark.slow
@needs_mimalloc
def test_kept_allocator_serves_each_call_without_page_faults():
  assert process.mimalloc_path(), "cmeel-mimalloc is not installed (a dependency on Linux x86-64)"
  kept = _python(_PROBE, ATTN_HOST_MALLOC="keep")
  assert kept["setting"].startswith("mimalloc"), kept
  # glibc's heap (mallopt) faulted 4,111-8,207 of the 10,240 pages per call; a fresh mapping all of them
  assert max(kept["faults"]) < PAGES // 10, kept
  untouched = _python(_PROBE, ATTN_HOST_MALLOC="default")  # the probe counts what it should: glibc maps afresh
  assert untouched["setting"].startswith("glibc default"), untouched
  assert min(untouched["faults"]) > PAGES * 0.9, untouched


def test_an_accelerator_run_leaves_the_allocator_alone(monkeypatch):
  calls = []
  monkeypatch.setattr(os, "execve", lambda *a: calls.append(a))
  monkeypatch.delenv(process.PRELOADED, raising=False)
  monkeypatch.setattr(allocator, "mimalloc_path", lambda: "/lib/libmimalloc.so")
  monkeypatch.setattr(allocator, "mimalloc_loaded", lambda: False)
  monkeypatch.setattr(allocator, "_glibc_linux", lambda: True)
  monkeypatch.setattr(allocator, "accelerator_plugin", lambda: "jax_cuda12_plugin")
  assert "accelerator run: jax_cuda12_plugin" in allocator.choose("keep")
  assert calls == []


def test_jax_platforms_cpu_is_not_an_accelerator_run(monkeypatch):
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  assert process.accelerator_plugin() is None
