"""setup(): what the `attn` command does to its process, in one place every entry point calls first.

In order (attn.process's docstring says who calls it):

1. ATTN_HOST_MALLOC is checked (attn.process.allocator.mode): keep, mallopt or
   default; any other value is refused by name before anything runs.
2. XLA_FLAGS is checked (attn.process.xla_flags).
3. The allocator is put in force (attn.process.allocator.choose): it may
   re-execute the process once with mimalloc preloaded.
4. The environment is put back as it was before attn preloaded anything, so
   no child inherits attn's allocator by accident (allocator.clean_env);
   attn's own children call setup() themselves.
5. The hooks (attn.process.hooks.quiet), fault injection from ATTN_FAULT
   (attn.process.faults.arm_from_env) and the command's signal handlers
   (`signals`, set through attn.process.signals so that they can be put back).

`python(args)` is `attn python`: python with the command's allocator.
"""

from __future__ import annotations

import os
import sys

from attn.process import faults, hooks, signals as signals_lib
from attn.process.allocator import PRELOADED, allocator_env, choose, clean_env, mimalloc_loaded, mode
from attn.process.xla_flags import check_xla_flags

_state: dict[str, str] = {}


def setup(signals: dict[int, signals_lib.Handler] | None = None) -> str:
  """Sets up this process as one of the `attn` command's (module docstring), once; returns the allocator in force.

  Call it first, before jax starts: it may re-execute the process. signals:
  the command's handlers (signal -> handler), set on every call.
  """
  if "allocator" not in _state:
    chosen = mode()
    check_xla_flags()
    _state["allocator"] = choose(chosen)
    clean = clean_env()  # os.environ put back as before the re-execution: it is what every child gets
    for key in set(os.environ) - set(clean):
      del os.environ[key]
    os.environ.update({k: v for k, v in clean.items() if os.environ.get(k) != v})
    hooks.quiet()
    faults.arm_from_env()
  if signals:
    signals_lib.on(signals)
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
