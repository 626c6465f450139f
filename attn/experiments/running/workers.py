"""Local workers: `attn sweep --workers N` runs N processes on this machine through submitit's LocalExecutor.

Each worker runs `sweep.run_trials(DIR, wait=True)`: it leases pending trials
one at a time (seed groups member by member), waits for those other workers
hold, and takes over a trial whose worker died once its lease goes stale. The
parent claims the store, prints a status line while the workers run, and then
writes the report as one process would.

Worker k is pinned to its share of the CPUs this process may use
(os.sched_setaffinity; with more workers than CPUs, CPUs are shared round
robin): XLA sizes its CPU thread pools by the CPUs a process may run on, so N
workers on C cores run about C/N threads each, not C each. Every worker uses
the same persistent compilation cache. On GPUs, each worker sees the GPUs
this process sees (submitit's CUDA_VISIBLE_DEVICES="" is undone) and does
not preallocate memory.

Each worker calls attn.process.setup() first, as the command does: it
re-executes itself with mimalloc preloaded (nothing of the parent's
allocator is inherited), installs the hooks and arms ATTN_FAULT.

`attn sweep --trials-per-device K` runs K workers per accelerator instead: on
G GPUs K·G workers, each seeing one GPU (CUDA_VISIBLE_DEVICES) and allowed
MEM_FRACTION / K of its memory (XLA_PYTHON_CLIENT_MEM_FRACTION: its allocator's
limit, so a trial that does not fit its share is refused by name by
sweep.check_memory, never an out-of-memory error); a K whose share would be
under MIN_SHARE_BYTES is reduced, saying so. On CPU it is K workers. K is at most the CPU cores
this process may use (check_per_device: refused by name above that, before the store is touched).

Logs: DIR/local/JOBID_0_log.{out,err}, one pair per worker; submitit's own job
files (its pickle of the call: the store path, worker number, CPUs, the
--tensorboard directory) sit beside them. Results stay in the JSON/Orbax store;
with --tensorboard each worker writes the events of the trials it trains.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any, TextIO

from attn.config import invalid
from attn.experiments.training import preempt
from attn.experiments.running import status as status_lib
from attn.experiments.running import supervisor

NO_TIME_LIMIT_MIN = 60 * 24 * 365  # submitit's local jobs are killed at timeout_min (default 2)
MEM_FRACTION = 0.9  # of an accelerator's memory, shared by its --trials-per-device workers
MIN_SHARE_BYTES = 2 * 2**30  # a CUDA context and XLA's workspaces alone take about 1 GB


def import_submitit() -> Any:
  """submitit (None if not installed), imported without its logging setup.

  On import submitit calls logging.config.dictConfig, which closes every
  logging handler already installed (pytest's own, when a test runs `attn
  sweep` in-process). SUBMITIT_LOG_LEVEL=NOCONFIG skips that for this import
  only; its warnings still reach stderr, and worker processes log as usual.
  """
  if "submitit" not in sys.modules:
    previous = os.environ.get("SUBMITIT_LOG_LEVEL")
    os.environ["SUBMITIT_LOG_LEVEL"] = "NOCONFIG"
    try:
      import submitit  # noqa: F401
    except ImportError:
      return None
    finally:
      if previous is None:
        del os.environ["SUBMITIT_LOG_LEVEL"]
      else:
        os.environ["SUBMITIT_LOG_LEVEL"] = previous
  return sys.modules["submitit"]


def check_workers(n: Any, field: str = "--workers") -> int:
  """n as an int; anything but an integer >= 1 is refused by name."""
  if isinstance(n, bool) or not isinstance(n, int) or n < 1:
    raise invalid(field, n, "an integer >= 1 (1: train in this process)")
  return n


def check_per_device(k: Any) -> int:
  """--trials-per-device as an int from 1 to this process's CPU cores (each worker process needs one
  at least; on GPUs per_device_plan reduces it further to what a GPU's memory holds); refused by
  name otherwise, before the store is touched."""
  k = check_workers(k, "--trials-per-device")
  cores = len(os.sched_getaffinity(0))
  if k > cores:
    raise invalid("--trials-per-device", k, f"an integer from 1 to {cores}: this process may use {cores} CPU "
                  "cores, and each trial's worker process needs one at least")
  return k


def per_device_plan(k: int, devices: list[Any], stream: TextIO = sys.stderr) -> tuple[int, list[str | None], str | None]:
  """(trials per device, each worker's CUDA_VISIBLE_DEVICES or None, its memory fraction or None).

  devices: jax.local_devices(). On CPU, k workers on the CPU. On GPUs, k per GPU, each with
  MEM_FRACTION / k of it; k is reduced (said on stream) until a share holds MIN_SHARE_BYTES.
  """
  if devices[0].platform == "cpu":
    return k, [None] * k, None
  total = min(int((d.memory_stats() or {}).get("bytes_limit", 0)) for d in devices) or None
  if devices[0].platform == "gpu" and total:
    # bytes_limit is this process's own allocator limit; the device's memory is that over its fraction.
    total = int(total / float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75")))
  fits = k if total is None else max(1, min(k, int(MEM_FRACTION * total // MIN_SHARE_BYTES)))
  if fits < k:
    stream.write(f"--trials-per-device {k}: reduced to {fits}: {devices[0].device_kind} has "
                 f"{total / 1e9:.1f} GB, and each trial process needs at least {MIN_SHARE_BYTES / 1e9:.1f} GB "
                 f"(its CUDA context and XLA's workspaces) of the {MEM_FRACTION:.0%} shared\n")
  ids = [str(getattr(d, "local_hardware_id", i)) for i, d in enumerate(devices)]
  placement = [ids[w % len(ids)] for w in range(fits * len(ids))]
  return fits, placement, f"{MEM_FRACTION / fits:.3f}"


def cpu_shares(n: int, cpus: list[int] | None = None) -> list[list[int]]:
  """Disjoint, near-equal slices of the CPUs for n workers (round robin when n exceeds them)."""
  cpus = sorted(os.sched_getaffinity(0)) if cpus is None else cpus
  if n >= len(cpus):
    return [[cpus[k % len(cpus)]] for k in range(n)]
  return [cpus[k * len(cpus) // n:(k + 1) * len(cpus) // n] for k in range(n)]


def _worker(out: str, k: int, n: int, cpus: list[int], lease_timeout: float, cuda: str | None,
            tensorboard: str | None = None, mem_fraction: str | None = None) -> dict[str, int]:
  """What worker k of n runs, in its own process: set up as the command's (attn.process), first."""
  from attn import process
  # may re-execute this worker (submitit's job starts again, the same pid); preemption's handlers set
  allocator = process.setup(signals=preempt.handlers())
  print(f"attn: worker {k + 1}/{n}: allocator {allocator}", file=sys.stderr, flush=True)
  os.sched_setaffinity(0, cpus)
  if cuda is None:
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
  else:
    os.environ["CUDA_VISIBLE_DEVICES"] = cuda
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  if mem_fraction is not None:  # its allocator's limit: a trial that does not fit is refused by name
    os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = mem_fraction
  from attn.experiments.running import sweep  # lazy: jax
  return sweep.run_trials(out, lease_timeout=lease_timeout, wait=True, worker=f"local {k + 1}/{n}",
                          tensorboard=tensorboard)


def run_workers(out: str, n: int, lease_timeout: float, stream: TextIO = sys.stderr,
                tensorboard: str | None = None, per_device: int | None = None) -> tuple[int, str | None]:
  """Runs n local workers on the claimed store at `out` until they end.

  tensorboard: a log directory (absolute) where each worker writes the events of the trials it trains.
  per_device: instead of n, that many workers per local device (per_device_plan).

  Returns (the signal that stopped them or 0, the machine's fault that stopped a worker or None).
  SIGTERM or SIGUSR1 to this process is passed on: each worker saves its trial and exits.
  """
  submitit = import_submitit()
  if submitit is None:
    raise invalid("--workers", n, "1, or an install with submitit for local worker processes: "
                  "pip install submitit")
  folder = os.path.join(out, "local")
  executor = submitit.LocalExecutor(folder=folder)
  executor.update_parameters(timeout_min=NO_TIME_LIMIT_MIN)
  cuda = os.environ.get("CUDA_VISIBLE_DEVICES")
  placement, fraction = None, None
  if per_device is not None:
    import jax  # the parent sees the devices (without preallocating: cli sets XLA_PYTHON_CLIENT_PREALLOCATE)
    per_device, placement, fraction = per_device_plan(per_device, jax.local_devices(), stream)
    n = len(placement)
  shares = cpu_shares(n)
  jobs = [executor.submit(_worker, os.path.abspath(out), k, n, shares[k], lease_timeout,
                          cuda if placement is None or placement[k] is None else placement[k], tensorboard,
                          fraction)
          for k in range(n)]
  gpus = "" if fraction is None else (f", {per_device} per device on devices "
                                      f"{','.join(sorted(set(placement)))}, each allowed {fraction} of its memory")
  stream.write(f"{n} local workers on CPUs {'; '.join(','.join(map(str, s)) for s in shares)}{gpus} "
               f"(logs: {folder}/)\n")

  def child(k: int, job: Any) -> supervisor.Child:
    def send(signum: int) -> None:  # submitit's controller passes it on to the worker
      if job._process is not None and job._process.poll() is None:
        job._process.send_signal(signal.SIGTERM)
    return supervisor.Child(f"worker {k + 1}/{n}", lambda: 0 if job.done() else None, send,
                           lambda: job.cancel(check=False))

  stopped_by = supervisor.supervise([child(k, job) for k, job in enumerate(jobs)], out,
                                    f"{n} local workers", lease_timeout, stream)
  faults = []
  for k, job in enumerate(jobs):
    try:
      counts = job.result()
    except Exception:  # a worker that raised, was killed or was stopped by a signal
      stream.write(f"worker {k + 1}/{n} stopped before the end (killed, stopped by a signal, or an error): "
                   f"see its log {job.paths.stderr}\n")
      continue
    if counts.get("fault"):
      faults.append(counts["fault"])
  stream.write(f"workers done: {status_lib.summary_line(status_lib.collect(out, lease_timeout))}\n")
  if stopped_by:
    stream.write(f"{signal.Signals(stopped_by).name}: the workers saved their trials and stopped; "
                 "re-run the same command to resume\n")
  return stopped_by, faults[0] if faults else None
