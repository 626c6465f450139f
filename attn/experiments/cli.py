"""`attn sweep CONFIG [--out DIR] [--set KEY=VALUE ...] [--executor local|slurm|ray] [--workers N]
[--processes-per-trial P] [--coordinator-timeout S] [--analyze] [--tensorboard LOGDIR] [--retry-failed]`.

Runs a sweep config into its store, then writes its report. --executor local
(the default) trains in this process (--workers 1) or in N local worker
processes; --executor slurm claims the store, submits one job array
(attn.experiments.running.slurm), prints the job id and returns; --executor ray runs one Ray
task per unfinished trial on a Ray cluster (attn.experiments.running.ray_executor: joined, or
started here, before the store is touched) and waits for them. Re-running the same
command resumes; `attn status DIR` shows progress for any executor.

Every executor goes one way (EXECUTORS): `sweep.prepare` claims the store
(refusing a filesystem without room, naming --out and its space), writes the
trials' configs and, with --retry-failed, makes the trials that failed for
their own reasons new again; the run record gets its start line
(attn.experiments.running.run_record); the executor trains; the supervisor
(attn.experiments.running.supervisor) says how it ended. A fault of the
machine (a full disk, an I/O error: attn.process.faults) stops
the sweep after the trial in progress, which stays resumable, with one
message naming the path and exit status 1; the same command, once the disk
has room, finishes the sweep.

--processes-per-trial P: each trial runs as one program over P processes on
this machine, its batch shared over all their devices, process 0 writing the
store (attn.experiments.running.processes). On Slurm the same is
--slurm-nodes N --slurm-tasks-per-node T (P = N·T). A process whose group
does not connect within --coordinator-timeout seconds exits naming the
address. Not with --workers N > 1: the P processes already share this
machine's CPUs; run another `attn sweep` on the same --out to train trials
side by side.

--tensorboard LOGDIR: live curves. Whatever trains a trial (this process, each
local worker, each Slurm task) also writes its metric rows to LOGDIR, one
TensorBoard run per trial named by its settings and id
(LOGDIR/num_heads=4,seed=0-<id>), after the store has them; a resumed trial's
run is rewritten from the rows the store keeps, so no step shows twice
(attn.experiments.running.tb_writer). Needs the tensorboard extra (tensorboardX):
pip install -e ".[tensorboard]". `attn export DIR --tensorboard LOGDIR` writes
the same runs from a store afterwards. View: tensorboard --logdir LOGDIR.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from attn.experiments.running import config as config_lib
from attn.experiments.running import leases
from attn.experiments.running import processes as processes_lib
from attn.experiments.running import ray_executor
from attn.experiments.running import run_record
from attn.experiments.running import tb_writer
from attn.experiments.running import workers as workers_lib
from attn.process import faults

workers_lib.import_submitit()  # first, without its logging setup (see there); slurm imports it too
from attn.experiments.running import slurm  # noqa: E402


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("config", metavar="CONFIG", help="a sweep config, e.g. configs/quick.toml")
  parser.add_argument("--out", metavar="DIR", default=None,
                      help="the store directory (default runs/<config name>); re-running resumes")
  parser.add_argument("--set", metavar="KEY=VALUE", action="append", default=[], dest="overrides",
                      help="override a config key, e.g. --set train.steps=50 (repeatable)")
  parser.add_argument("--no-report", action="store_true", help="skip writing DIR/report.md at the end")
  parser.add_argument("--retry-failed", action="store_true",
                      help="run the trials that failed for their own reasons (non-finite loss, an error) again from "
                           "step 0; a plain re-run resumes interrupted trials and leaves failed ones")
  parser.add_argument("--analyze", action="store_true",
                      help="run `attn analyze` on the trained trials before the report "
                           "(also: [analysis] enabled = true in the config)")
  parser.add_argument("--executor", choices=("local", "slurm", "ray"), default="local",
                      help="local: this machine (default); slurm: submit one job array and return; "
                           "ray: one Ray task per trial on a Ray cluster (--ray-address)")
  parser.add_argument("--workers", metavar="N", type=int, default=None,
                      help="local worker processes (default 1: train in this process); logs in DIR/local/")
  parser.add_argument("--trials-per-device", metavar="K", type=int, default=1,
                      help="K local workers per GPU (each seeing one GPU and allowed 0.9/K of its memory: a "
                           "trial that does not fit is refused naming the memory; K is reduced where a share "
                           "would be under 2 GiB), K workers on CPU (default 1)")
  parser.add_argument("--processes-per-trial", metavar="P", type=int, default=1,
                      help="run each trial over P processes on this machine, each batch shared over all their "
                           "devices (default 1; on Slurm: --slurm-nodes and --slurm-tasks-per-node); logs in DIR/local/")
  parser.add_argument("--coordinator-timeout", metavar="SECONDS", type=float, default=processes_lib.DEFAULT_TIMEOUT,
                      help="a process of a trial whose group has not connected after this long exits, naming the "
                           f"coordinator's address (default {processes_lib.DEFAULT_TIMEOUT:g})")
  parser.add_argument("--lease-timeout", metavar="SECONDS", type=float, default=leases.DEFAULT_TIMEOUT,
                      help="a trial whose worker sent no heartbeat for this long is taken over by another "
                           f"(default {leases.DEFAULT_TIMEOUT:g})")
  parser.add_argument("--tensorboard", metavar="LOGDIR", default=None,
                      help="also write each trial's metric rows as it trains to this TensorBoard log directory, "
                           'one run per trial (needs: pip install -e ".[tensorboard]")')
  if slurm is not None:
    slurm.add_arguments(parser)
  ray_executor.add_arguments(parser)


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


def _check(args: argparse.Namespace) -> str:
  """Checks the executor's options against each other; the EXECUTORS key (or "slurm")."""
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


def run(args: argparse.Namespace) -> int:
  from attn.experiments.running import supervisor
  from attn.experiments.running import sweep as sweep_lib  # lazy: jax
  kind = _check(args)
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
    return _stopped(e, "before any training")
  if kind == "slurm":
    code = slurm.submit(sweep, out, args, text)
    return _end(out, start, "submitted to Slurm", code)
  if kind == "ray":
    stopped_by, fault = ray_executor.run(out, sweep, ray_plan, lease_timeout, args.tensorboard)
  else:
    stopped_by, fault = EXECUTORS[kind](out, args, lease_timeout)
  if stopped_by:
    return _end(out, start, f"stopped by {signal.Signals(stopped_by).name}", 128 + stopped_by)
  if supervisor.finish(out, lease_timeout, fault=fault):
    return _end(out, start, f"stopped: {fault}" if fault else "trials left unfinished", 1)
  try:
    if args.analyze or sweep.analyze:
      from attn.experiments.reading import analyze
      analyze.analyze_sweep(out)
    if not args.no_report:
      from attn.experiments.reading import report
      print(f"report: {report.write_report(out)}")
    run_record.append(out, run_record.end_line(start, "finished", out))
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
