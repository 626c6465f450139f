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

The work: attn.experiments.running.launch (train, then finish with the analysis and report).
"""

from __future__ import annotations

import argparse

from attn.experiments.running import launch, leases
from attn.experiments.running import processes as processes_lib
from attn.experiments.running import ray_executor
from attn.experiments.running.launch import slurm


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


def run(args: argparse.Namespace) -> int:
  trained = launch.train(args)
  if trained.code is not None:
    return trained.code

  def read(out: str) -> None:
    if args.analyze or trained.sweep.analyze:
      from attn.experiments.reading import analyze
      analyze.analyze_sweep(out)
    if not args.no_report:
      from attn.experiments.reading import report
      print(f"report: {report.write_report(out)}")
  return launch.finish(trained, read)
