"""Host memory: serve each call's XLA buffers from memory the process already touched.

XLA:CPU allocates a call's temporaries (and its outputs) as blocks from
posix_memalign(64, n) and frees them when the call ends. With glibc's defaults
a block over the mmap threshold (at most 32 MB) is a fresh mmap, unmapped on
free, so every call faults the whole block in again, page by page (the kernel
zeroes each 4 KB page): the merged h = 4 model of configs/quick.toml has a
35 MB block, 8,600 page faults per training step, 1.5x its step time
(experiments/performance.md, "The sweep's 1.5x swing").

Keeping freed memory in glibc's heap (mallopt: no mmap, one arena, no trim) is
not enough: glibc 2.36's memalign asks its heap for n + alignment + 32 bytes,
so the n-byte hole a freed block leaves between live small chunks never fits
the next call's block of the same size, and the heap grows into fresh pages
instead (4,111-8,207 of a 40 MB block's 10,240 pages faulted per call). Whether
neighbouring holes had merged decided the speed.

So the `attn` command, before jax is imported, re-executes itself once with
mimalloc (the cmeel-mimalloc wheel, a dependency on Linux x86-64) in LD_PRELOAD
and MIMALLOC_PURGE_DELAY=-1 (freed memory is reused, never handed back to the
OS while the process runs): aligned blocks come back from its free lists
whatever their neighbours, 0 faults per call. Where mimalloc is missing, or in
a process that is not the `attn` command (a library user, pytest), the glibc
mallopt settings above are the fallback. ATTN_HOST_MALLOC: keep (default: the
best of the two), mallopt (glibc's settings only), default (glibc untouched).

All of this is for XLA:CPU's buffers. Where jax will run on a GPU or TPU (an
accelerator plugin is installed and JAX_PLATFORMS does not say cpu) glibc is
left as it is, and keep_freed_memory() says so for the records.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import sys

ENV = "ATTN_HOST_MALLOC"
MODES = ("keep", "mallopt", "default")
PRELOADED = "ATTN_HOST_MALLOC_PRELOADED"  # set in the re-executed process: never exec twice
PURGE_DELAY = "-1"  # MIMALLOC_PURGE_DELAY: keep freed memory for reuse
KEEP_BYTES = 1 << 30
# mallopt parameter numbers from glibc's malloc.h
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8

_state: dict[str, str] = {}


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


# jax's accelerator plugins by module: CUDA, ROCm and TPU (libtpu).
ACCELERATOR_PLUGINS = ("jax_cuda13_plugin", "jax_cuda12_plugin", "jax_rocm7_plugin", "jax_rocm60_plugin",
                       "libtpu")


def accelerator_plugin() -> str | None:
  """The accelerator plugin jax will use here, or None (none installed, or JAX_PLATFORMS=cpu)."""
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


def is_attn_command() -> bool:
  """Whether this process is the `attn` command (`attn ...` or `python -m attn ...`)."""
  argv = getattr(sys, "orig_argv", [])
  return argv[1:3] == ["-m", "attn"] or (len(argv) > 1 and os.path.basename(argv[1]) == "attn")


def use_kept_allocator() -> None:
  """Re-executes this process once with mimalloc preloaded (module docstring); returns if it cannot.

  Call it before jax starts its threads; it returns without doing anything
  when the mode is not keep, when already re-executed, or without mimalloc.
  """
  try:
    if mode() != "keep":
      return
  except Exception:  # a bad value is reported as a ConfigError by keep_freed_memory()
    return
  if os.environ.get(PRELOADED) or not _glibc_linux() or not getattr(sys, "orig_argv", None):
    return
  if accelerator_plugin() is not None:
    return
  lib = mimalloc_path()
  if lib is None:
    return
  env = dict(os.environ)
  env[PRELOADED] = lib
  env["LD_PRELOAD"] = lib + (":" + env["LD_PRELOAD"] if env.get("LD_PRELOAD") else "")
  env.setdefault("MIMALLOC_PURGE_DELAY", PURGE_DELAY)
  sys.stdout.flush()
  sys.stderr.flush()
  try:
    os.execve(sys.executable, sys.orig_argv, env)
  except OSError:  # the process goes on as it is: keep_freed_memory() falls back to mallopt
    return


def _mallopt() -> str:
  libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
  options = ((_M_MMAP_MAX, 0, "M_MMAP_MAX=0"), (_M_ARENA_MAX, 1, "M_ARENA_MAX=1"),
             (_M_TRIM_THRESHOLD, KEEP_BYTES, f"M_TRIM_THRESHOLD={KEEP_BYTES}"))
  failed = [name for number, value, name in options if libc.mallopt(number, value) != 1]
  if failed:  # named, not swallowed: glibc refused a setting
    raise RuntimeError(f"{ENV}: glibc's mallopt refused {', '.join(failed)}")
  return "glibc mallopt " + ", ".join(name for *_, name in options)


def keep_freed_memory() -> str:
  """Applies the mode in this process once (module docstring); returns what is in force, for records."""
  if "setting" in _state:
    return _state["setting"]
  chosen = mode()
  plugin = accelerator_plugin()
  if chosen == "default":
    setting = f"glibc default ({ENV}=default)"
  elif plugin is not None and not mimalloc_loaded():
    setting = f"glibc default (an accelerator run: {plugin} is installed; the settings are for XLA:CPU)"
  elif chosen == "keep" and mimalloc_loaded():
    setting = f"mimalloc (LD_PRELOAD, MIMALLOC_PURGE_DELAY={os.environ.get('MIMALLOC_PURGE_DELAY', '')})"
  elif not _glibc_linux():
    setting = f"not glibc ({platform.system()} {platform.libc_ver()[0] or 'libc'}): unchanged"
  else:
    why = "" if chosen == "mallopt" else (
        " (mimalloc not preloaded: not the attn command)" if mimalloc_path() else
        " (mimalloc not installed: pip install cmeel-mimalloc)")
    setting = _mallopt() + why
  _state["setting"] = setting
  return setting


def in_force() -> str:
  """What keep_freed_memory() set in this process, or that it was not called."""
  return _state.get("setting", "glibc default (keep_freed_memory not called)")
