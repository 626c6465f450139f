"""`attn sweep`'s work: a config's trials trained into its store by one executor, one way for every executor.

The options are `attn sweep`'s (attn/cli/sweep.py: the flags and what they do). Every
executor goes one way: `check` checks the executor's options against each other; `train`
checks the config and the machine, claims the store (sweep.prepare: room on the
filesystem, the trials' configs, --retry-failed), writes the run record's start line
(run_record), trains (EXECUTORS, slurm, ray_executor) and lets the supervisor say how it
ended; `finish` runs what reads the trained store (the command's analysis and report)
and writes the end line. A fault of the machine (attn.process.faults) outside the trials
is one message and exit status 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
from typing import Any, Callable

from attn.experiments.running import config as config_lib
from attn.experiments.running import processes as processes_lib
from attn.experiments.running import ray_executor
from attn.experiments.running import run_record
from attn.experiments.running import tb_writer
from attn.experiments.running import workers as workers_lib
from attn.process import faults

workers_lib.import_submitit()  # first, without its logging setup (see there); slurm imports it too
from attn.experiments.running import slurm  # noqa: E402


def _here(out: str, args: argparse.Namespace, lease_timeout: float) -> tuple[int, str | None]:
  """--workers 1: the trials train in this process, in a thread a signal can stop after a step."""
  from attn.experiments.training import preempt
  from attn.experiments.running import sweep as sweep_lib  # lazy: jax
  preempt.install_handlers()
  try:
    counts = sweep_lib.run_trials(out, lease_timeout=lease_timeout, wait=True, tensorboard=args.tensorboard)
  except KeyboardInterrupt:
    print("\n" + preempt.message("interrupted"), file=sys.stderr)
    return signal.SIGINT, None
  return 0, counts.get("fault")


def _workers(out: str, args: argparse.Namespace, lease_timeout: float) -> tuple[int, str | None]:
  per_device = args.trials_per_device if args.trials_per_device > 1 else None
  return workers_lib.run_workers(out, args.workers, lease_timeout, tensorboard=args.tensorboard,
                                 per_device=per_device)


def _processes(out: str, args: argparse.Namespace, lease_timeout: float) -> tuple[int, str | None]:
  return processes_lib.run_group(out, args.processes_per_trial, lease_timeout, args.coordinator_timeout,
                                 tensorboard=args.tensorboard)


# How the trials of a claimed store run here: each returns (the signal that stopped it or 0, the machine's fault).
EXECUTORS = {"here": _here, "workers": _workers, "processes": _processes}


def check(args: argparse.Namespace) -> str:
  """Checks the executor's options against each other; the EXECUTORS key (or "slurm" or "ray")."""
  from attn.config import invalid
  workers = args.workers = workers_lib.check_workers(1 if args.workers is None else args.workers)
  per_device = args.trials_per_device = workers_lib.check_per_device(args.trials_per_device)
  if args.executor == "ray":  # --trials-per-device maps onto the tasks' resources (ray_executor.resources)
    for flag, n in (("--workers", workers), ("--processes-per-trial", args.processes_per_trial)):
      if n != 1:
        raise invalid(flag, n, "left out with --executor ray (one Ray task per trial; size it with "
                      "--ray-cpus-per-trial and --ray-gpus-per-trial)")
    return "ray"
  if per_device > 1:
    if args.workers != 1 or args.executor == "slurm" or args.processes_per_trial != 1:
      raise invalid("--trials-per-device", per_device, "1 with --workers, --executor slurm or "
                    "--processes-per-trial: it sets the local workers itself (K per device)")
    # The parent looks at the devices; it must not take their memory from the workers.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    return "workers"
  processes = processes_lib.check_processes(args.processes_per_trial)
  processes_lib.check_timeout(args.coordinator_timeout)
  if args.executor == "slurm" and workers != 1:
    raise invalid("--workers", workers, "left out with --executor slurm (one array task per trial)")
  if args.executor == "slurm" and processes != 1:
    raise invalid("--processes-per-trial", processes, "left out with --executor slurm: give --slurm-nodes N "
                  "--slurm-tasks-per-node T (one process per Slurm task, N·T per trial)")
  if processes > 1 and workers != 1:
    raise invalid("--workers", workers, f"1 with --processes-per-trial {processes}: the {processes} processes of "
                  "each trial already share this machine's CPUs; to train trials side by side, start another "
                  "`attn sweep` on the same --out (the store's leases keep them apart)")
  return "slurm" if args.executor == "slurm" else "processes" if processes > 1 else \
      "workers" if workers > 1 else "here"


@dataclasses.dataclass
class Trained:
  """What `train` left: an exit code where the command ends there (submitted, stopped, a fault), else the
  finished store (out), the run record's start line and the loaded sweep."""

  code: int | None
  out: str = ""
  start: dict[str, Any] = dataclasses.field(default_factory=dict)
  sweep: Any = None


def train(args: argparse.Namespace) -> Trained:
  """Checks everything, claims the store and trains its trials by the chosen executor (module docstring)."""
  from attn.experiments.running import supervisor
  from attn.experiments.running import sweep as sweep_lib  # lazy: jax
  kind = check(args)
  lease_timeout = sweep_lib.check_lease_timeout(args.lease_timeout)
  slurm_params = slurm.check_args(args)  # --slurm-* options: refused without --executor slurm, checked before the store
  ray_params = ray_executor.check_args(args)  # --ray-* options: refused without --executor ray
  if args.tensorboard is not None:  # tensorboardX is there, LOGDIR is no file; absolute for workers and tasks
    args.tensorboard = tb_writer.check(args.tensorboard)
    print(f"live curves: tensorboard --logdir {args.tensorboard}", file=sys.stderr)
  sweep = config_lib.load(args.config, args.overrides)  # every check happens before any training
  if kind == "ray":  # Ray's nodes may have other devices: each task checks there
    ray_plan = ray_executor.connect(ray_params)  # the cluster answers and can hold a task, before the store
  elif kind != "slurm":  # a Slurm node may have other devices: its tasks check there
    config_lib.check_devices(sweep.trials, sweep.vmap_seeds, args.processes_per_trial, sweep.pack)
    processes_lib.check_platform(args.processes_per_trial)
  else:
    config_lib.check_processes(sweep.trials, slurm.processes(slurm_params))
  out = args.out or os.path.join("runs", os.path.splitext(os.path.basename(args.config))[0])
  with open(args.config, encoding="utf-8") as f:
    text = f.read()
  sweep_lib.prepare(sweep, out, text, args.overrides, retry_failed=args.retry_failed)  # the one resume path
  try:
    start = run_record.start_line()
    run_record.append(out, start)
  except OSError as e:
    return Trained(_stopped(e, "before any training"))
  if kind == "slurm":
    code = slurm.submit(sweep, out, args, text)
    return Trained(_end(out, start, "submitted to Slurm", code))
  if kind == "ray":
    stopped_by, fault = ray_executor.run(out, sweep, ray_plan, lease_timeout, args.tensorboard)
  else:
    stopped_by, fault = EXECUTORS[kind](out, args, lease_timeout)
  if stopped_by:
    return Trained(_end(out, start, f"stopped by {signal.Signals(stopped_by).name}", 128 + stopped_by))
  if supervisor.finish(out, lease_timeout, fault=fault):
    return Trained(_end(out, start, f"stopped: {fault}" if fault else "trials left unfinished", 1))
  return Trained(None, out, start, sweep)


def finish(trained: Trained, read: Callable[[str], None]) -> int:
  """read(out) (the analysis and report of the finished store), then the run record's end line -> exit code."""
  out = trained.out
  try:
    read(out)
    run_record.append(out, run_record.end_line(trained.start, "finished", out))
  except OSError as e:  # a full disk under the report, its plots or the record: the trials are safe in the store
    return _stopped(e, f"every trial is finished; `attn report {out}` writes the report alone")
  return 0


def _stopped(e: OSError, note: str) -> int:
  """One message for a fault of the machine outside the trials; any other error goes on up."""
  fault = faults.classify(e)
  if fault is None:
    raise e
  print(f"attn sweep: stopped: {fault.message} ({note})", file=sys.stderr)
  return 1


def _end(out: str, start: dict, outcome: str, code: int) -> int:
  """Appends the run record's end line (skipped when the disk does not take it: the outcome was said) -> code."""
  try:
    run_record.append(out, run_record.end_line(start, outcome, out))
  except OSError:
    pass
  return code
