"""One trial over several processes: `attn sweep --processes-per-trial P` here, and a Slurm job's tasks.

Every process of a trial's group runs `run_member`: it joins the group
(attn.experiments.training.distributed.connect: jax.distributed, gloo on CPU,
within --coordinator-timeout or it exits naming the address it tried), then
`sweep.run_trials`: process 0 leases each trial and writes the store and the
checkpoints, the others train the trials it orders and write nothing. The
group is one worker: any number of groups and ordinary workers can share a
store, each trial leased to one of them at a time.

Here (`run_group`), the command starts the P processes with subprocess, not
submitit's LocalExecutor: they must start together, each with its own rank,
and the parent must see each one's exit to stop the rest. Each is pinned to
its share of this process's CPUs (as --workers does), sees this machine's
devices (on CPU, a host device of its own) and joins a coordinator that
listens on 127.0.0.1 only, at a port free when the command starts (CPU only: on GPUs every
local process would claim all of them; use Slurm tasks there). Logs:
DIR/local/processes-PID/process_K.log. Once a process ends with an error or
by a signal the others get GRACE_S seconds to end by themselves (a collective
with a dead peer fails at once), then SIGKILL: process 0 never outlives its
group as a writer, and whatever it leaves (the trial's rows, its last
checkpoint, a lease of a process that is gone) is what `attn sweep` resumes.
SIGTERM, SIGUSR1 or Ctrl-C to the command are passed on to every process; they
agree to save at the same step and stop, as one process does.

On Slurm (`--slurm-nodes N --slurm-tasks-per-node T`), each array task is a job
of N·T tasks, one process each, started by srun; `slurm_group` reads each one's
rank from submitit's JobEnvironment, and the coordinator is the job's first
node at port PORT_BASE + (job id mod PORT_SPAN).
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from typing import Any, TextIO

from attn import process
from attn.config import invalid
from attn.experiments.running import status as status_lib
from attn.experiments.running import supervisor
from attn.process import faults
from attn.experiments.running.workers import cpu_shares

DEFAULT_TIMEOUT = 60.0  # --coordinator-timeout: seconds for a trial's processes to connect
GRACE_S = 10.0  # after one process of a group fails, for the others to end by themselves
PORT_BASE, PORT_SPAN = 20000, 20000  # a Slurm job's coordinator port
EXIT_BROKEN = 1
EXIT_FAULT = 75  # a fault of the machine (a full disk) stopped the group: its last log line says which
FAULT_PREFIX = "attn: stopped: "


def check_processes(n: Any) -> int:
  """--processes-per-trial as an int; anything but an integer >= 1 is refused by name."""
  if isinstance(n, bool) or not isinstance(n, int) or n < 1:
    raise invalid("--processes-per-trial", n, "an integer >= 1 (1: each trial in one process; P: each trial "
                  "over P processes of this machine)")
  return n


def check_platform(processes: int) -> None:
  """Refuses P > 1 local processes on accelerators: each would claim every device of this machine."""
  import jax  # lazy: the caller has just read this machine's devices
  kind = jax.local_devices()[0].platform
  if processes > 1 and kind != "cpu":
    raise invalid("--processes-per-trial", processes,
                  f"1 on this machine's {kind} devices: each local process would claim all of them; run the "
                  "processes as Slurm tasks with --slurm-gpus-per-task, or one process with train.mesh")


def check_timeout(seconds: Any) -> float:
  """--coordinator-timeout as a float; anything but a finite number > 0 is refused by name."""
  ok = isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and math.isfinite(seconds)
  if not ok or seconds <= 0:
    raise invalid("--coordinator-timeout", seconds, f"a number of seconds > 0 (default {DEFAULT_TIMEOUT:g})")
  return float(seconds)


def run_member(out: str, group: Any, trial_ids: list[str] | None = None, *, wait: bool = True,
               lease_timeout: float | None = None, tensorboard: str | None = None,
               worker: str | None = None) -> dict[str, int]:
  """What each process of a group runs: connect, then sweep.run_trials; an error ends this process at once.

  group: a distributed.Group. On an error (a peer that died, or one of this
  process's own) the trial is left unfinished and the process exits
  EXIT_BROKEN with os._exit: jax's exit handler would wait for the dead peer.
  """
  from attn.experiments.training import distributed  # lazy: jax
  from attn.experiments.running import sweep  # lazy: jax
  distributed.connect(group)
  kwargs = {} if lease_timeout is None else {"lease_timeout": lease_timeout}
  try:
    counts = sweep.run_trials(out, trial_ids, wait=wait, tensorboard=tensorboard, worker=worker, **kwargs)
  except Exception as e:
    fault = faults.classify(e)
    if fault is not None:  # one line, no traceback; the parent reads it from the log
      sys.stderr.write(f"{FAULT_PREFIX}{fault.message}\n")
      sys.stderr.flush()
      os._exit(EXIT_FAULT)
    traceback.print_exc()
    first = (str(e).strip().splitlines() or [""])[0][:300]
    sys.stderr.write(f"attn: process {group.index} of {group.processes} stopped the group: "
                     f"{type(e).__name__}: {first}; its trial is left unfinished: re-run the same command "
                     "to resume it from its last checkpoint\n")
    sys.stderr.flush()
    os._exit(EXIT_BROKEN)
  if counts.get("fault"):
    sys.stderr.write(f"{FAULT_PREFIX}{counts['fault']}\n")
    sys.stderr.flush()
  return counts


def slurm_group(timeout: float) -> Any:
  """The distributed.Group of this Slurm task (from submitit's JobEnvironment); None for a job of one task."""
  import submitit
  from attn.experiments.training import distributed  # lazy: jax
  env = submitit.JobEnvironment()
  if env.num_tasks == 1:
    return None
  port = PORT_BASE + int(os.environ["SLURM_JOB_ID"]) % PORT_SPAN
  return distributed.Group(f"{env.hostnames[0]}:{port}", env.num_tasks, env.global_rank, timeout)


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _fault_line(path: str) -> str | None:
  """The fault a process wrote as its last words (FAULT_PREFIX), from its log."""
  try:
    with open(path, encoding="utf-8", errors="replace") as f:
      lines = [line[len(FAULT_PREFIX):].strip() for line in f if line.startswith(FAULT_PREFIX)]
  except OSError:
    return None
  return lines[-1] if lines else None


def _tail(path: str, n: int = 3) -> str:
  try:
    with open(path, encoding="utf-8", errors="replace") as f:
      lines = [line.rstrip() for line in f if line.strip(" \n^~") and not line.startswith(("I0000", "W0000"))]
  except OSError:
    return ""
  return "\n".join("  " + line for line in lines[-n:])


def run_group(out: str, processes: int, lease_timeout: float, coordinator_timeout: float,
              stream: TextIO = sys.stderr, tensorboard: str | None = None) -> tuple[int, str | None]:
  """Trains the claimed store at `out` with one group of `processes` local processes until they end.

  Returns (the signal that stopped them or 0, the machine's fault that stopped process 0 or None).
  """
  P = processes
  folder = os.path.join(os.path.abspath(out), "local", f"processes-{os.getpid()}")
  os.makedirs(folder, exist_ok=True)
  address = f"127.0.0.1:{_free_port()}"
  shares = cpu_shares(P)
  procs, logs = [], [os.path.join(folder, f"process_{k}.log") for k in range(P)]
  for k in range(P):
    spec = {"out": os.path.abspath(out), "address": address, "processes": P, "index": k, "cpus": shares[k],
            "timeout": coordinator_timeout, "lease_timeout": lease_timeout, "tensorboard": tensorboard,
            "worker": f"process 0 of a local group of {P} (parent pid {os.getpid()})"}
    with open(logs[k], "w") as log:
      procs.append(subprocess.Popen([sys.executable, "-m", __name__, json.dumps(spec)], stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True))
  stream.write(f"{P} processes per trial, coordinator {address}: "
               + "; ".join(f"process {k} pid {p.pid} on CPUs {','.join(map(str, shares[k]))}"
                           for k, p in enumerate(procs)) + f" (logs: {folder}/)\n")
  children = [supervisor.Child(f"process {k} (pid {p.pid})", p.poll, p.send_signal, p.kill)
              for k, p in enumerate(procs)]
  stopped_by = supervisor.supervise(children, out, f"{P} processes", lease_timeout, stream, grace=GRACE_S,
                                    signals=(signal.SIGTERM, signal.SIGUSR1, signal.SIGINT))
  expected = {0, 128 + stopped_by, -stopped_by} if stopped_by else {0}
  fault = None
  for k, p in enumerate(procs):
    if p.returncode == EXIT_FAULT:
      fault = fault or _fault_line(logs[k])
    elif p.returncode not in expected:
      how = f"killed by {signal.Signals(-p.returncode).name}" if p.returncode < 0 else f"exit code {p.returncode}"
      how += " (the kernel's out-of-memory killer, or kill -9)" if p.returncode == -signal.SIGKILL else ""
      stream.write(f"process {k} of {P}: {how} (log {logs[k]})\n{_tail(logs[k])}\n")
  stream.write(f"processes done: {status_lib.summary_line(status_lib.collect(out, lease_timeout))}\n")
  if stopped_by:
    stream.write(f"{signal.Signals(stopped_by).name}: the processes saved their trial and stopped; "
                 "re-run the same command to resume\n")
  return stopped_by, fault


def main(argv: list[str]) -> int:
  """`python -m attn.experiments.running.processes SPEC`: one process of run_group's group (SPEC: JSON)."""
  from attn.experiments.training import preempt  # stdlib only: no jax
  process.setup(signals=preempt.handlers())  # first, as the command's: may re-execute this process (attn.process)
  spec = json.loads(argv[0])
  os.sched_setaffinity(0, spec["cpus"])  # before jax sizes its thread pools
  from attn.experiments.training import distributed
  group = distributed.Group(spec["address"], spec["processes"], spec["index"], spec["timeout"], spec["address"])
  counts = run_member(spec["out"], group, wait=True, lease_timeout=spec["lease_timeout"],
                      tensorboard=spec["tensorboard"], worker=spec["worker"])
  return EXIT_FAULT if counts.get("fault") else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
