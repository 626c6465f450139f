"""The host allocator of a process of the `attn` command: mimalloc preloaded, glibc's mallopt, or glibc untouched.

ATTN_HOST_MALLOC: keep (default: mimalloc if installed, else glibc mallopt),
mallopt (glibc's settings only) or default (glibc untouched); any other value
is refused by name (a ConfigError). With keep and mimalloc installed, `choose`
re-executes the process once with mimalloc in LD_PRELOAD and
MIMALLOC_PURGE_DELAY=-1; `clean_env` is the environment as it was before, for a
child that is not attn's.

Why the allocator. XLA:CPU allocates a call's temporaries (and its outputs)
as blocks from posix_memalign(64, n) and frees them when the call ends. With
glibc's defaults a block over the mmap threshold (at most 32 MB) is a fresh
mmap, unmapped on free, so every call faults the whole block in again, page by
page (the kernel zeroes each 4 KB page): the merged h = 4 model of
configs/quick.toml has a 35 MB block, 8,600 page faults per training step,
1.5x its step time (experiments/performance.md, "The sweep's 1.5x swing").

Keeping freed memory in glibc's heap (mallopt: no mmap, one arena, no trim) is
not enough: glibc 2.36's memalign asks its heap for n + alignment + 32 bytes,
so the n-byte hole a freed block leaves between live small chunks never fits
the next call's block of the same size, and the heap grows into fresh pages
instead (4,111-8,207 of a 40 MB block's 10,240 pages faulted per call). Whether
neighbouring holes had merged decided the speed.

mimalloc (the cmeel-mimalloc wheel, a dependency on Linux x86-64) preloaded
with MIMALLOC_PURGE_DELAY=-1 (freed memory is reused, never handed back to the
OS while the process runs) serves aligned blocks from its free lists whatever
their neighbours: 0 faults per call. It must be in place before the process
starts (LD_PRELOAD), hence the re-execution. ATTN_HOST_MALLOC: keep (default:
the best of the two), mallopt (glibc's settings only), default (glibc
untouched).

A library user's process (a notebook, pytest, a script) is left as it is.
`attn python ARGS` runs `python ARGS` with the command's allocator (mimalloc
preloaded; with mallopt, the same glibc settings as GLIBC_TUNABLES), and
`attn python --print-env` prints those variables, for a Jupyter kernel spec or
a test runner's environment; that script's own children inherit them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import platform
import sys

ENV = "ATTN_HOST_MALLOC"
MODES = ("keep", "mallopt", "default")
PRELOADED = "ATTN_HOST_MALLOC_PRELOADED"  # set by the re-execution: the variables as they were before it
PURGE_DELAY = "-1"  # MIMALLOC_PURGE_DELAY: keep freed memory for reuse
KEEP_BYTES = 1 << 30
# mallopt parameter numbers from glibc's malloc.h, and the same settings as glibc tunables
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
_TUNABLES = f"glibc.malloc.mmap_max=0:glibc.malloc.arena_max=1:glibc.malloc.trim_threshold={KEEP_BYTES}"


def mode() -> str:
  """The requested mode: $ATTN_HOST_MALLOC, default "keep"; anything else is a ConfigError."""
  value = os.environ.get(ENV, "keep")
  if value not in MODES:
    from attn.config import invalid  # imports jax: only on the error path
    raise invalid(ENV, value, f"one of {list(MODES)} (keep: mimalloc if installed, else glibc mallopt; "
                  "mallopt: glibc's settings only; default: glibc's own behaviour)")
  return value


def _glibc_linux() -> bool:
  return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def mimalloc_path() -> str | None:
  """The cmeel-mimalloc wheel's shared library, or None where it is not installed."""
  import importlib.metadata as metadata
  try:
    dist = metadata.distribution("cmeel-mimalloc")
  except metadata.PackageNotFoundError:
    return None
  libs = sorted(str(f) for f in dist.files or () if os.path.basename(str(f)).startswith("libmimalloc.so"))
  path = str(dist.locate_file(libs[0])) if libs else None  # libmimalloc.so, its link to .so.3
  return path if path and os.path.exists(path) else None


def mimalloc_loaded() -> bool:
  """Whether mimalloc is mapped into this process (LD_PRELOAD took effect)."""
  try:
    with open("/proc/self/maps", encoding="utf-8") as f:
      return "libmimalloc" in f.read()
  except OSError:
    return False


def allocator_env(chosen: str | None = None, env: dict[str, str] | None = None) -> dict[str, str]:
  """env (default os.environ) for a new process with the command's allocator under mode `chosen`.

  keep with mimalloc: LD_PRELOAD and MIMALLOC_PURGE_DELAY (the user's own
  value kept); mallopt (and keep without mimalloc): GLIBC_TUNABLES with the
  mallopt settings; default: unchanged. What it changed is recorded in
  PRELOADED, so that `clean_env` can undo it.
  """
  env = dict(os.environ if env is None else env)
  chosen = chosen or mode()
  lib = mimalloc_path() if chosen == "keep" and _glibc_linux() else None
  if chosen == "default" or not _glibc_linux() or PRELOADED in env:
    return env
  changes = ({"LD_PRELOAD": lib + (":" + env["LD_PRELOAD"] if env.get("LD_PRELOAD") else ""),
              "MIMALLOC_PURGE_DELAY": env.get("MIMALLOC_PURGE_DELAY", PURGE_DELAY)} if lib else
             {"GLIBC_TUNABLES": ":".join(filter(None, [env.get("GLIBC_TUNABLES"), _TUNABLES]))})
  env[PRELOADED] = json.dumps({k: env.get(k) for k in changes})
  env.update(changes)
  return env


def clean_env(env: dict[str, str] | None = None) -> dict[str, str]:
  """env (default os.environ) as it was before attn set an allocator in it: for a child that is not attn's."""
  env = dict(os.environ if env is None else env)
  try:
    before = json.loads(env.pop(PRELOADED, "{}"))
  except ValueError:
    before = {}
  for key, value in before.items() if isinstance(before, dict) else ():
    if value is None:
      env.pop(key, None)
    else:
      env[key] = value
  return env


def _mallopt() -> str:
  libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
  options = ((_M_MMAP_MAX, 0, "M_MMAP_MAX=0"), (_M_ARENA_MAX, 1, "M_ARENA_MAX=1"),
             (_M_TRIM_THRESHOLD, KEEP_BYTES, f"M_TRIM_THRESHOLD={KEEP_BYTES}"))
  failed = [name for number, value, name in options if libc.mallopt(number, value) != 1]
  if failed:  # named, not swallowed: glibc refused a setting
    raise RuntimeError(f"{ENV}: glibc's mallopt refused {', '.join(failed)}")
  return "glibc mallopt " + ", ".join(name for *_, name in options)


# jax's accelerator plugins by module: CUDA, ROCm and TPU (libtpu).
ACCELERATOR_PLUGINS = ("jax_cuda13_plugin", "jax_cuda12_plugin", "jax_rocm7_plugin", "jax_rocm60_plugin",
                       "libtpu")


def accelerator_plugin() -> str | None:
  """The accelerator plugin jax will use here, or None (none installed, or JAX_PLATFORMS=cpu).

  The allocator settings are for XLA:CPU's buffers: an accelerator run leaves glibc as it is.
  """
  import importlib.util
  platforms = os.environ.get("JAX_PLATFORMS", "")
  if platforms and all(p.strip() == "cpu" for p in platforms.split(",")):
    return None
  for name in ACCELERATOR_PLUGINS:
    try:
      if importlib.util.find_spec(name) is not None:
        return name
    except (ImportError, ValueError):
      continue
  return None


def _reexec_with_mimalloc() -> None:
  """Re-executes this process once with mimalloc preloaded; returns where it cannot (the caller falls back)."""
  if PRELOADED in os.environ or not _glibc_linux() or not getattr(sys, "orig_argv", None) or not mimalloc_path():
    return
  sys.stdout.flush()
  sys.stderr.flush()
  try:
    os.execve(sys.executable, sys.orig_argv, allocator_env("keep"))
  except OSError:
    return


def choose(chosen: str) -> str:
  """Puts the allocator of mode `chosen` in force (re-executing with mimalloc where it can); says which."""
  plugin = accelerator_plugin() if chosen != "default" else None
  if plugin is not None and not mimalloc_loaded():
    return f"glibc default (an accelerator run: {plugin} is installed; the settings are for XLA:CPU)"
  if chosen == "keep":
    _reexec_with_mimalloc()  # returns only where it did not re-execute
  if mimalloc_loaded():  # with keep, or preloaded by whoever started this process
    delay = os.environ.get("MIMALLOC_PURGE_DELAY", "mimalloc's default")
    return f"mimalloc (LD_PRELOAD, MIMALLOC_PURGE_DELAY={delay})" + (
        "" if chosen == "keep" else f"; {ENV}={chosen} cannot unload what this process's environment preloaded")
  if chosen == "default":
    return f"glibc default ({ENV}=default)"
  if not _glibc_linux():
    return f"not glibc ({platform.system()} {platform.libc_ver()[0] or 'libc'}): unchanged"
  why = "" if chosen == "mallopt" else (
      " (mimalloc's preload did not take effect)" if PRELOADED in os.environ else
      " (mimalloc not installed: pip install cmeel-mimalloc)")
  return _mallopt() + why
