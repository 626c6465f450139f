"""The process of the `attn` command: its allocator, its exception hooks, fault injection, what its children get.

`import attn` does none of this: it defines names. A process of the `attn`
command calls `setup()` once, first, before jax starts: the console script and
`python -m attn` (attn.cli.main), the local workers
(attn.experiments.running.workers), a trial's processes
(attn.experiments.running.processes), Slurm tasks
(attn.experiments.running.slurm) and `attn bench --account`'s children. In order:

1. ATTN_HOST_MALLOC is checked: keep (default), mallopt or default; any other
   value is refused by name (a ConfigError) before anything runs.
2. XLA_FLAGS is checked (`check_xla_flags`, below).
3. The allocator (why, below): with keep and mimalloc installed the process
   re-executes itself once with mimalloc in LD_PRELOAD and
   MIMALLOC_PURGE_DELAY=-1; where mimalloc is missing (or the preload did not
   take) and with mallopt, glibc's mallopt settings; with default, nothing.
   `in_force()` says which, for the run record and the benchmarks.
4. The environment is put back as it was before attn preloaded anything, so
   no child inherits attn's allocator by accident: the C++ compiler that
   builds the oneDNN handlers, git, sbatch, srun and every other program run
   under glibc as the user's environment has it; attn's own children call
   setup() themselves and so re-execute with the preload found on their own
   machine (one more interpreter start each). `clean_env()` is that
   environment for a child of any process (one started by `attn python`, whose
   environment holds the preload).
5. attn.process.faults: `quiet()` (Orbax's logged copies of a
   fault dropped; sys.unraisablehook and threading.excepthook wrapped) and
   `arm_from_env()` (ATTN_FAULT, fault injection for the tests).

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

XLA_FLAGS. XLA aborts the process (a fatal log line, SIGABRT) when a backend
first starts and XLA_FLAGS holds a flag it does not know, or a value whose
first token lacks `--` and names no file (XLA reads such a value as a file of
flags); a later token without `--` it ignores silently (`--flag 2`: the 2 is
lost). Decided here: a token without `--` is refused at once; whether XLA
knows each flag is asked of XLA itself, in a child `python -c "import jax;
jax.devices()"` with the same XLA_FLAGS (and no preload), whose fatal line
"Unknown flag in XLA_FLAGS: --NAME" names the flag. A list of known flags kept
here would go stale with every jaxlib (flags come and go each release); the
probe cannot. It costs one jax start (about 0.5 s on CPU, more where a GPU
starts), once per command, nothing when XLA_FLAGS is unset, and nothing in
attn's own children: ATTN_XLA_FLAGS_CHECKED carries the value already checked.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import platform
import re
import subprocess
import sys

ENV = "ATTN_HOST_MALLOC"
MODES = ("keep", "mallopt", "default")
PRELOADED = "ATTN_HOST_MALLOC_PRELOADED"  # set by the re-execution: the variables as they were before it
XLA_CHECKED = "ATTN_XLA_FLAGS_CHECKED"  # the XLA_FLAGS value check_xla_flags() has accepted
PURGE_DELAY = "-1"  # MIMALLOC_PURGE_DELAY: keep freed memory for reuse
KEEP_BYTES = 1 << 30
# mallopt parameter numbers from glibc's malloc.h, and the same settings as glibc tunables
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
_TUNABLES = f"glibc.malloc.mmap_max=0:glibc.malloc.arena_max=1:glibc.malloc.trim_threshold={KEEP_BYTES}"
_XLA_PROBE = "import jax; jax.devices()"
_UNKNOWN_FLAG = re.compile(r"Unknown flags? in XLA_FLAGS: (.*)")

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


# --- environments: a process with the command's allocator, and a child without it -----------------------------

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


# --- XLA_FLAGS ----------------------------------------------------------------------------------------------------

def check_xla_flags() -> None:
  """Refuses, by name, XLA_FLAGS that XLA would abort on (module docstring); once per value, none when unset."""
  flags = os.environ.get("XLA_FLAGS", "")
  if not flags.strip() or os.environ.get(XLA_CHECKED) == flags:
    return
  from_file = len(flags.split()) == 1 and not flags.strip().startswith("-") and os.path.isfile(flags.strip())
  bare = [] if from_file else [t for t in flags.split() if not t.startswith("--")]
  if bare:
    from attn.config import invalid
    raise invalid("XLA_FLAGS", flags, f"flags --NAME=VALUE separated by spaces, or the path of a file of them "
                  f"({bare[0]!r} does not start with --: XLA "
                  f"{'ignores it' if flags.split()[0].startswith('--') else 'reads it as a file name and aborts'})")
  try:
    probe = subprocess.run([sys.executable, "-c", _XLA_PROBE], env={**clean_env(), "XLA_FLAGS": flags},
                           capture_output=True, text=True, timeout=300)
  except (OSError, subprocess.TimeoutExpired):
    return  # no verdict: the command meets XLA's own message if the flags are wrong
  unknown = _UNKNOWN_FLAG.search(probe.stderr)
  fatal = [line for line in probe.stderr.splitlines() if line.startswith("F") and "XLA_FLAGS" in line]
  if probe.returncode != 0 and (unknown or fatal):
    from attn.config import invalid
    why = (f"{unknown.group(1).strip()} is not a flag this jaxlib's XLA knows" if unknown
           else f"XLA aborts on it: {fatal[-1].split('] ', 1)[-1]}")
    raise invalid("XLA_FLAGS", flags, f"flags XLA knows ({why}; `python -c 'import jax; jax.devices()'` "
                  "with these XLA_FLAGS shows XLA's own message)")
  if probe.returncode == 0:
    os.environ[XLA_CHECKED] = flags


# --- setup: what the command does to its process -----------------------------------------------------------------

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


def _allocator(chosen: str) -> str:
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


def setup() -> str:
  """Sets up this process as one of the `attn` command's (module docstring), once; returns the allocator in force.

  Call it first, before jax starts: it may re-execute the process.
  """
  if "allocator" in _state:
    return _state["allocator"]
  chosen = mode()
  check_xla_flags()
  _state["allocator"] = _allocator(chosen)
  clean = clean_env()  # os.environ put back as before the re-execution: it is what every child gets
  for key in set(os.environ) - set(clean):
    del os.environ[key]
  os.environ.update({k: v for k, v in clean.items() if os.environ.get(k) != v})
  from attn.process import faults  # stdlib only: no jax (imported here, not at the top: setup() re-executes first)
  faults.quiet()
  faults.arm_from_env()
  return _state["allocator"]


def in_force() -> str:
  """The allocator of this process: what setup() chose, or what its environment preloaded."""
  if "allocator" in _state:
    return _state["allocator"]
  if mimalloc_loaded():
    return "mimalloc (preloaded by this process's environment: attn python, or LD_PRELOAD)"
  return "glibc default (not a process of the attn command: process.setup() not called)"


# --- attn python: the command's allocator for a library user's process ----------------------------------------------

def python(args: list[str]) -> int:
  """`attn python [ARGS]`: execs `python ARGS` with the command's allocator; `--print-env` prints its variables."""
  chosen = mode()
  if args[:1] == ["--print-env"]:
    env, base = allocator_env(chosen), clean_env()
    for key in sorted(k for k in env if k != PRELOADED and env[k] != base.get(k)):
      print(f"{key}={env[key]}")
    return 0
  check_xla_flags()  # before allocator_env: the script's own attn commands need not probe again
  env = allocator_env(chosen)
  sys.stdout.flush()
  sys.stderr.flush()
  os.execve(sys.executable, [sys.executable, *args], env)
  return 1  # not reached
