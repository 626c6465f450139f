"""The process of the `attn` command: its allocator, XLA_FLAGS, hooks, fault injection, signals, what its children get.

`import attn` does none of this: it defines names. A process of the `attn`
command calls `setup()` once, first, before jax starts: the console script and
`python -m attn` (attn.cli.main), the local workers
(attn.experiments.running.workers), a trial's processes
(attn.experiments.running.processes), Slurm tasks
(attn.experiments.running.slurm) and `attn bench --account`'s children.
`attn.cli.main(argv)` called from Python sets nothing up and puts back what
the command changed (`kept`).

  allocator  ATTN_HOST_MALLOC: mimalloc preloaded (a re-execution), glibc's mallopt, or
             untouched; why, and `clean_env` for a child that is not attn's
  xla_flags  XLA_FLAGS refused by name where XLA would abort on them
  hooks      exception hooks: one message per fault of the machine
  faults     a fault of the machine told apart from a trial's error; fault injection (ATTN_FAULT)
  signals    the command's signal handlers, set and put back in one place
  command    setup(), in_force(), `attn python`
  state      kept(): what a command may change in its process, put back
"""

from attn.process import faults, signals
from attn.process.allocator import (ACCELERATOR_PLUGINS, ENV, KEEP_BYTES, MODES, PRELOADED, PURGE_DELAY,
                                    accelerator_plugin, allocator_env, clean_env, mimalloc_loaded,
                                    mimalloc_path, mode)
from attn.process.command import in_force, python, setup
from attn.process.hooks import quiet
from attn.process.state import kept
from attn.process.xla_flags import XLA_CHECKED, check_xla_flags

__all__ = [
    "ACCELERATOR_PLUGINS", "ENV", "KEEP_BYTES", "MODES", "PRELOADED", "PURGE_DELAY", "XLA_CHECKED",
    "accelerator_plugin", "allocator_env", "check_xla_flags", "clean_env", "faults", "in_force", "kept",
    "mimalloc_loaded", "mimalloc_path", "mode", "python", "quiet", "setup", "signals",
]
