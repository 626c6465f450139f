"""`attn sweep --executor slurm`: one Slurm job array through submitit, one task per unfinished trial.

Each array task runs `sweep.run_trials(out, ids)` for one trial (or one seed group with
sweep.vmap_seeds), so the store's leases, skips and resume work as for local workers; the
command prints the job id and returns. With --slurm-nodes N --slurm-tasks-per-node T each
array task is a job of N·T tasks that train its trials as one program over N·T processes
(attn.experiments.running.processes): task 0 holds the lease and writes the store and the
checkpoints; every task gets the signals below, and they agree to save at the same step. submitit's files and the tasks' logs go to DIR/slurm/.
The pickle submitit hands to a task holds only `SlurmTask(out, lease_timeout, tensorboard)` and
the trial ids (strings): results stay in the JSON/Orbax store (with --tensorboard LOGDIR, each
task also writes its trials' events there, as local workers do).

Preemption and time limits, as submitit 1.5.4 does them (core/job_environment.py, helpers.py):
- Before calling the task, submitit's `process_job` installs `SignalHandler`: its preemption
  signal (env SUBMITIT_PREEMPT_SIGNAL, default USR2) -> `checkpoint_and_try_requeue`; SIGTERM
  and SIGCONT -> `bypass`, which only logs them.
- attn makes that signal USR1: `#SBATCH --signal=USR1@90` (Slurm sends it 90 s, or up to 60 s
  more, before the time limit, and at once on preemption where SlurmctldParameters has
  preempt_send_user_signal) and `export SUBMITIT_PREEMPT_SIGNAL=USR1` in the batch script, read
  by the task's submitit.
- On USR1 (task rank 0), submitit calls the callable's `checkpoint(*args)`; `SlurmTask.checkpoint`
  runs `preempt.save_now()` (checkpoint at the last completed step, partial rows cut to it,
  lease released) and returns the requeue, a `DelayedSubmission` of the same task and trial ids,
  which submitit writes over the task's pickle. submitit then runs `scontrol requeue JOBID_TASK`
  and `sys.exit(-1)`. Slurm holds the requeued task for AuthInfo cred_expire (120 s by default,
  10 s in scripts/slurm-local), then runs it again (same job id; `scontrol show job` counts
  Restarts): `run_trials` skips finished trials and resumes the interrupted one from its checkpoint.
  A signal counts as a time-out once the task has run min(80% of its limit, limit - 10 min)
  (always, for limits of 10 min or less); each time-out uses one of `MAX_TIMEOUTS` requeues,
  after which submitit raises UncompletedJobError instead of requeueing.
- SIGTERM (`scancel` without --signal, the time limit itself, a preemption without the user
  signal, node shutdown) is followed by SIGKILL after KillWait (30 s in scripts/slurm-local).
  submitit only logs it, so the steps since the last checkpoint would be lost; `SlurmTask`
  replaces that handler: `save_now()`, then exit 143 with no requeue (Slurm decides whether the
  job comes back; re-running the same `attn sweep` command resubmits the unfinished trials,
  which resume from the checkpoint). Saves never nest: a SIGTERM during a USR1 checkpoint is
  ignored, and a USR1 during a SIGTERM save requeues once the save is done (`SlurmTask` wraps
  submitit's handler for that). Once saved (and requeued), the task ends with os._exit: see
  `_exit`. A signal that arrives before training starts has nothing to save; the task still
  requeues (USR1) or ends (SIGTERM).
Either way rows of steps below the checkpoint are kept and later ones recomputed: none is
lost or written twice.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
from typing import Any

from attn.config import ConfigError, invalid
from attn.experiments.running.workers import import_submitit

# submitit is needed to submit and inside a task; without it the options still parse, submit() refuses.
_submitit = import_submitit()
Checkpointable = _submitit.helpers.Checkpointable if _submitit else object

SIGNAL, SIGNAL_DELAY_S = "USR1", 90
MAX_TIMEOUTS = 20  # requeues after a time limit; each resumes from a checkpoint, so progress is kept
DEFAULT_TIME_MIN = 60
FLAGS = ("partition", "time", "cpus_per_task", "gpus_per_task", "array_parallelism", "nodes", "tasks_per_node",
         "option")

# sbatch options with their own --slurm-* flag, options attn sets itself, options that break it.
DEDICATED = {"partition": "--slurm-partition", "p": "--slurm-partition", "time": "--slurm-time",
             "t": "--slurm-time", "cpus-per-task": "--slurm-cpus-per-task", "c": "--slurm-cpus-per-task",
             "gpus-per-task": "--slurm-gpus-per-task", "nodes": "--slurm-nodes",
             "ntasks-per-node": "--slurm-tasks-per-node"}
RESERVED = {"array": "the array is one task per unfinished trial", "output": "logs go to DIR/slurm/",
            "error": "logs go to DIR/slurm/", "open-mode": "submitit appends to the logs",
            "signal": f"attn sends {SIGNAL} {SIGNAL_DELAY_S} s before the limit to checkpoint",
            "no-requeue": "preemption requeues the task", "wrap": "submitit writes the batch script",
            "ntasks": "a trial's processes are --slurm-nodes × --slurm-tasks-per-node",
            "wait": "the command returns once submitted",
            "parsable": "submitit reads sbatch's output", "help": "not a job option",
            "usage": "not a job option", "version": "not a job option"}
BARE = {"exclusive", "requeue", "hold", "overcommit", "contiguous", "spread-job", "use-min-nodes",
        "no-kill", "reboot", "oversubscribe", "get-user-env", "ignore-pbs", "quiet", "verbose"}
MAIL_TYPES = {"NONE", "BEGIN", "END", "FAIL", "REQUEUE", "ALL", "INVALID_DEPEND", "STAGE_OUT",
              "TIME_LIMIT", "TIME_LIMIT_90", "TIME_LIMIT_80", "TIME_LIMIT_50", "ARRAY_TASKS"}
_MEMORY = re.compile(r"\d+([KMGT]B?)?", re.I)
_INT = re.compile(r"-?\d+")
_TIME = re.compile(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?")


def add_arguments(parser: argparse.ArgumentParser) -> None:
  """Adds the --slurm-* options of `attn sweep` (used with --executor slurm)."""
  g = parser.add_argument_group("Slurm (with --executor slurm; logs go to DIR/slurm/)")
  g.add_argument("--slurm-partition", metavar="P", default=None, help="the partition (default: the cluster's)")
  g.add_argument("--slurm-time", metavar="T", default=None,
                 help=f"time limit of each task: minutes or [D-]HH:MM[:SS] (default {DEFAULT_TIME_MIN}); "
                      f"{SIGNAL} {SIGNAL_DELAY_S} s before it checkpoints and requeues the task")
  g.add_argument("--slurm-cpus-per-task", metavar="N", default=None, help="CPUs of each task")
  g.add_argument("--slurm-gpus-per-task", metavar="N", default=None, help="GPUs of each task")
  g.add_argument("--slurm-array-parallelism", metavar="N", default=None,
                 help="at most N tasks of the array run at once")
  g.add_argument("--slurm-nodes", metavar="N", default=None,
                 help="nodes of each array task (default 1): its trial runs over N × T processes")
  g.add_argument("--slurm-tasks-per-node", metavar="T", default=None,
                 help="Slurm tasks (processes) per node of each array task (default 1)")
  g.add_argument("--slurm-option", metavar="KEY=VALUE", action="append", default=[],
                 help="any other sbatch option, e.g. --slurm-option mem=4G --slurm-option qos=low "
                      "(repeatable; a bare KEY for flags such as exclusive)")


def _positive(flag: str, value: str | None) -> int | None:
  if value is None:
    return None
  if not re.fullmatch(r"\d+", str(value)) or int(value) <= 0:
    raise invalid(flag, value, "a positive integer")
  return int(value)


def minutes(flag: str, value: str) -> int:
  """A Slurm time limit (minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS) in whole minutes, rounded up."""
  m = _TIME.fullmatch(str(value).strip())
  if not m:
    raise invalid(flag, value, "minutes (e.g. 90) or [D-]HH:MM[:SS] (e.g. 1-12:00:00)")
  days, a, b, c = (int(x) if x else None for x in m.groups())
  if days is not None:  # D-HH[:MM[:SS]]
    seconds = days * 86400 + a * 3600 + (b or 0) * 60 + (c or 0)
  elif c is not None:  # HH:MM:SS
    seconds = a * 3600 + b * 60 + c
  elif b is not None:  # MM:SS
    seconds = a * 60 + b
  else:
    seconds = a * 60
  if seconds <= 0:
    raise invalid(flag, value, "a time limit above zero")
  return -(-seconds // 60)


def _option_value(key: str, value: str | None, raw: str) -> Any:
  """Checks one --slurm-option value by its sbatch option name; True for a bare flag."""
  if value is None:
    if key not in BARE:
      raise invalid("--slurm-option", raw, f"KEY=VALUE (a bare KEY only for the flags {sorted(BARE)})")
    return True
  if not value or "\n" in value:
    raise invalid("--slurm-option", raw, "KEY=VALUE with a non-empty, one-line VALUE")
  if key in ("mem", "mem-per-cpu", "mem-per-gpu", "tmp") and not _MEMORY.fullmatch(value):
    raise invalid("--slurm-option", raw, f"{key}=SIZE: an integer with an optional K, M, G or T unit (e.g. {key}=4G)")
  if key == "mail-type" and not set(value.upper().split(",")) <= MAIL_TYPES:
    raise invalid("--slurm-option", raw, f"mail-type=a comma list of {sorted(MAIL_TYPES)}")
  if key in ("nice", "priority") and not _INT.fullmatch(value):
    raise invalid("--slurm-option", raw, f"{key}=an integer")
  if key in ("cpus-per-gpu", "mincpus"):
    _positive(f"--slurm-option {key}", value)
  if key == "time-min":
    minutes("--slurm-option time-min", value)
  return value


def parse_options(items: list[str]) -> dict[str, Any]:
  """--slurm-option KEY=VALUE items -> submitit's additional_parameters, checked by name."""
  out: dict[str, Any] = {}
  for raw in items:
    key, sep, value = raw.partition("=")
    key = key.strip().lstrip("-").replace("_", "-")
    if not re.fullmatch(r"[a-z][a-z0-9-]*", key):
      raise invalid("--slurm-option", raw, "KEY=VALUE with KEY an sbatch long option name, e.g. mem=4G")
    if key in DEDICATED:
      raise invalid("--slurm-option", raw, f"an option without a --slurm-* flag of its own: use {DEDICATED[key]}")
    if key in RESERVED:
      raise invalid("--slurm-option", raw, f"an option attn does not set itself ({key}: {RESERVED[key]})")
    if key in out:
      raise invalid("--slurm-option", raw, f"each KEY once ({key} is given twice)")
    out[key] = _option_value(key, value if sep else None, raw)
  return out


def check_args(args: argparse.Namespace) -> dict[str, Any]:
  """Validates the --slurm-* options (refused without --executor slurm) -> submitit's SlurmExecutor parameters."""
  if getattr(args, "executor", "slurm") != "slurm":
    for f in FLAGS:
      if getattr(args, f"slurm_{f}", None):
        raise invalid(f"--slurm-{f.replace('_', '-')}", getattr(args, f"slurm_{f}"),
                      f"only with --executor slurm (this is --executor {args.executor})")
    return {}
  params: dict[str, Any] = {"time": minutes("--slurm-time", args.slurm_time) if args.slurm_time
                            else DEFAULT_TIME_MIN}
  if args.slurm_partition is not None:
    if not re.fullmatch(r"[A-Za-z0-9_.-]+(,[A-Za-z0-9_.-]+)*", args.slurm_partition):
      raise invalid("--slurm-partition", args.slurm_partition, "a partition name (or a comma list), e.g. gpu")
    params["partition"] = args.slurm_partition
  for f in ("cpus_per_task", "gpus_per_task", "array_parallelism", "nodes", "tasks_per_node"):
    n = _positive(f"--slurm-{f.replace('_', '-')}", getattr(args, f"slurm_{f}", None))
    if n is not None:
      params["ntasks_per_node" if f == "tasks_per_node" else f] = n
  params["additional_parameters"] = parse_options(args.slurm_option or [])
  return params


def processes(params: dict[str, Any]) -> int:
  """The processes per trial of check_args' parameters: nodes × tasks per node."""
  return params.get("nodes", 1) * params.get("ntasks_per_node", 1)


def _sbatch_options() -> set[str]:
  """The long option names this cluster's sbatch knows, read from `sbatch --help`."""
  try:
    text = subprocess.run(["sbatch", "--help"], capture_output=True, text=True, timeout=30).stdout
  except (OSError, subprocess.TimeoutExpired):
    return set()
  return set(re.findall(r"--([a-z][a-z0-9-]*)", text))


def _check_cluster(params: dict[str, Any]) -> None:
  if shutil.which("sbatch") is None or shutil.which("srun") is None:
    raise invalid("--executor", "slurm", "a machine where Slurm's sbatch and srun are on PATH (not found "
                  "here); for a one-node cluster on this machine run: scripts/slurm-local start")
  if _submitit is None:
    raise invalid("--executor", "slurm", "an install with submitit: pip install 'submitit>=1.5'")
  known = _sbatch_options()
  for key in params["additional_parameters"]:
    if known and key not in known:
      raise invalid("--slurm-option", key, "an option `sbatch --help` lists on this cluster")


def groups(sweep: Any, pending: list[Any]) -> list[list[str]]:
  """Trial ids per array task: one trial each, one seed group each with sweep.vmap_seeds, one pack with sweep.pack."""
  from attn.experiments.running import config as config_lib
  return [[t.id for t in group] for group in config_lib.seed_groups(pending, sweep.vmap_seeds,
                                                                     getattr(sweep, "pack", 1))]


def _exit(code: int) -> None:
  # os._exit, not sys.exit: a SystemExit raised in a signal handler that interrupts a gc or
  # weakref callback is printed and ignored (seen here in JAX's _xla_gc_callback), and the task
  # would train on after its trial was saved, its lease released and its job requeued.
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)


class SlurmTask(Checkpointable):
  """One array task: runs its trials from the store; on USR1 checkpoints and requeues, on SIGTERM saves and exits."""

  def __init__(self, out: str, lease_timeout: float | None = None, tensorboard: str | None = None,
               coordinator_timeout: float | None = None):
    self.out, self.lease_timeout, self.tensorboard = out, lease_timeout, tensorboard
    self.coordinator_timeout = coordinator_timeout
    self._stopping, self._requeue_pending, self._requeue = False, False, None

  def __call__(self, trial_ids: list[str]) -> dict[str, int]:
    from attn import process
    # submitit has installed its handlers: wrap its requeue handler, replace its SIGTERM bypass.
    sig = getattr(signal, "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2"))
    handlers = {signal.SIGTERM: self._on_sigterm}
    if callable(signal.getsignal(sig)):
      self._requeue = (sig, signal.getsignal(sig))
      handlers[sig] = self._on_requeue_signal
    # first, as the command's: may re-execute the task (submitit starts it again, same pid)
    process.setup(signals=handlers)
    from attn.experiments.running import processes as processes_lib
    from attn.experiments.running import sweep as sweep_lib  # lazy: jax
    kwargs = {} if self.lease_timeout is None else {"lease_timeout": self.lease_timeout}
    tensorboard = getattr(self, "tensorboard", None)  # None in a task pickled before the option existed
    group = processes_lib.slurm_group(getattr(self, "coordinator_timeout", None) or processes_lib.DEFAULT_TIMEOUT)
    if group is not None:  # one of the job's tasks that train its trials together
      return processes_lib.run_member(self.out, group, list(trial_ids), wait=False, tensorboard=tensorboard,
                                      **kwargs)
    return sweep_lib.run_trials(self.out, list(trial_ids), tensorboard=tensorboard, **kwargs)

  def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
    """Called by submitit on its signal: saves the running trial, then returns the requeue of this task."""
    self._stopping = True
    self._save()
    task = SlurmTask(self.out, self.lease_timeout, getattr(self, "tensorboard", None),
                     getattr(self, "coordinator_timeout", None))
    return _submitit.helpers.DelayedSubmission(task, *args, **kwargs)

  def _save(self) -> None:
    from attn.experiments.training import preempt
    preempt.save_now()

  def _requeue_and_exit(self, frame: Any) -> None:
    try:  # submitit's handler: checkpoint(), `scontrol requeue`, sys.exit(-1)
      self._requeue[1](self._requeue[0], frame)
    except SystemExit:
      _exit(255)

  def _on_requeue_signal(self, signum: int, frame: Any) -> None:
    if self._stopping:  # a SIGTERM save runs below this frame: requeue once it is done
      self._requeue_pending = True
      return
    self._requeue_and_exit(frame)

  def _on_sigterm(self, signum: int, frame: Any) -> None:
    if self._stopping:  # a checkpoint-and-requeue is under way: let it complete
      print("attn: SIGTERM while saving: ignored", file=sys.stderr, flush=True)
      return
    self._stopping = True
    print("attn: SIGTERM: saving the running trial, then exiting (no requeue)", file=sys.stderr, flush=True)
    self._save()
    if self._requeue_pending and self._requeue is not None:
      self._requeue_and_exit(frame)  # checkpoint (nothing left to save), requeue, exit
    _exit(128 + signum)


def submit(sweep: Any, out: str, args: argparse.Namespace, config_text: str = "") -> int:
  """Submits one job array for the unfinished trials of a claimed store; prints the job id and returns 0."""
  params = check_args(args)
  _check_cluster(params)
  from attn.experiments.running.store import Store
  submitit = _submitit
  store = Store(out)
  pending = [t for t in sweep.trials if not store.is_done(t.id)]
  if not pending:
    print(f"nothing to submit: all {len(sweep.trials)} trials of {out} are finished")
    return 0
  tasks = groups(sweep, pending)
  folder = os.path.join(os.path.abspath(out), "slurm")
  executor = submitit.SlurmExecutor(folder=os.path.join(folder, "%j"), max_num_timeout=MAX_TIMEOUTS)
  options = params.pop("additional_parameters")
  executor.update_parameters(
      job_name=options.pop("job-name", f"attn-{os.path.basename(os.path.abspath(out))}"),
      signal_delay_s=SIGNAL_DELAY_S, setup=[f"export SUBMITIT_PREEMPT_SIGNAL={SIGNAL}"],
      additional_parameters={**options, "signal": f"{SIGNAL}@{SIGNAL_DELAY_S}"}, **params)
  task = SlurmTask(os.path.abspath(out), getattr(args, "lease_timeout", None), getattr(args, "tensorboard", None),
                   getattr(args, "coordinator_timeout", None))
  try:
    jobs = executor.map_array(task, tasks)
  except (submitit.core.utils.UncompletedJobError, submitit.core.utils.FailedSubmissionError) as e:
    raise ConfigError(f"sbatch refused the job array ({str(e).strip().splitlines()[-1]}); check the "
                      f"--slurm-* options (submission files in {folder})") from None
  job_id = jobs[0].job_id.split("_")[0]
  from attn.experiments.running import config as config_lib
  per = "pack" if config_lib.packs(getattr(sweep, "pack", 1)) else "seed group" if sweep.vmap_seeds else "trial"
  at_once = f", at most {params['array_parallelism']} at once" if "array_parallelism" in params else ""
  P = processes(params)
  each = f" of {P} processes ({params.get('nodes', 1)} node(s) × {params.get('ntasks_per_node', 1)})" if P > 1 else ""
  print(f"submitted Slurm job {job_id}: {len(tasks)} task{'s' * (len(tasks) > 1)}{each}, one per {per}{at_once} "
        f"({len(sweep.trials) - len(pending)} of {len(sweep.trials)} trials already finished)")
  print(f"logs: {folder}/{job_id}{'_<task>' if len(tasks) > 1 else ''}/")
  print(f"watch: attn status {out}")
  return 0
