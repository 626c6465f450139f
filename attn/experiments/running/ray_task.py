"""A task of `attn sweep --executor ray`, on a Ray worker: checks, then the trial process it starts.

`run` (the Ray task, see attn.experiments.running.ray_executor) checks that this node sees the
store (DIR/sweep.json at the same path) and the entry points the trials name, then starts
`python -m attn.experiments.running.ray_task SPEC`: a process of its own, because
`attn.process.setup()` may re-execute the process it runs in (a Ray worker must not), and so
that each trial starts with the environment its resources give (`child_env`: thread counts
from its CPUs; with under one GPU no preallocation and MEM_FRACTION of its share; with none no
GPU at all). That process sets itself up as the command's, pins itself to a free slot of the
node's CPUs (`_pin`: a lock file per slot, held while it lives, so tasks on one machine do not
share cores) and runs `sweep.run_trials(DIR, ids, wait=True)`. It dies with the Ray worker
(PR_SET_PDEATHSIG): a killed node leaves no trial process behind, and its lease is taken over.
ray.cancel (the driver stopped) raises KeyboardInterrupt in the task: the trial process gets
SIGTERM, saves its trial at the step it is in and exits.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

MEM_FRACTION = 0.9  # of a GPU's memory, shared by the trials on it
SLOTS = "/tmp/attn-ray-cpus-{uid}"  # a node's CPU slots (lock files), shared by every task on it


def missing_plugins(needed: list[dict[str, str]]) -> list[str]:
  """Those of `needed` this process's installed metadata lacks, in words."""
  import importlib.metadata
  missing = []
  for p in needed:
    if not any(ep.name == p["name"] for ep in importlib.metadata.entry_points(group=p["group"])):
      missing.append(f"{p['name']!r} (entry point of group {p['group']!r}, distribution {p['distribution']!r})")
  return missing


def run(spec: dict[str, Any], ids: list[str]) -> dict[str, Any]:
  """One Ray task: checks the store and the plugins, then trains `ids` in a child process (module docstring)."""
  import ray
  ctx = ray.get_runtime_context()
  assigned = ctx.get_assigned_resources()
  where = {"node_id": ctx.get_node_id(), "ip": ray.util.get_node_ip_address(), "host": socket.gethostname(),
           "cpus": float(assigned.get("CPU", 0)), "gpus": float(assigned.get("GPU", 0)),
           "gpu_ids": [str(g) for g in ray.get_gpu_ids()]}
  node = f"node {where['ip']} ({where['node_id'][:8]}, host {where['host']})"
  out = spec["out"]
  if not os.path.isfile(os.path.join(out, "sweep.json")):
    raise RuntimeError(f"the store is not visible on {node}: {os.path.join(out, 'sweep.json')} is missing there; "
                       f"--out={out} must be on a filesystem every node mounts at the same path")
  missing = missing_plugins(spec["plugins"])
  if missing:
    raise RuntimeError(f"{node} lacks {', '.join(missing)}: install that distribution on every node, or pass it "
                       "in --ray-runtime-env '{\"pip\": [...]}'")
  env = child_env(where["cpus"], where["gpus"])
  worker = f"ray {node}, {where['cpus']:g} CPU, {where['gpus']:g} GPU" + (
      f" {','.join(where['gpu_ids'])}" if where["gpu_ids"] else "")
  os.makedirs(os.path.join(out, "ray"), exist_ok=True)
  result = os.path.join(out, "ray", f".{ids[0]}.{os.getpid()}.{time.monotonic_ns()}.json")
  child = {**spec, "ids": ids, "worker": worker, "cpus": where["cpus"], "result": result}
  with open(os.path.join(out, "ray", f"{ids[0]}.log"), "a", encoding="utf-8") as log:
    log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {worker}: trials {', '.join(ids)}\n")
    log.flush()
    proc = subprocess.Popen([sys.executable, "-m", __name__, json.dumps(child)], env=env, stdout=log,
                            stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
    stopped = False
    try:
      while (code := proc.poll()) is None:  # short sleeps, not one blocking wait: ray.cancel's
        time.sleep(0.1)                       # KeyboardInterrupt arrives between Python bytecodes
    except KeyboardInterrupt:  # ray.cancel: the child saves its trial at the step it is in, then exits
      stopped = True
      proc.send_signal(signal.SIGTERM)
      code = proc.wait()
  try:
    with open(result, encoding="utf-8") as f:
      counts = json.load(f)
    os.remove(result)
  except (OSError, ValueError):
    counts = None
  if counts is None and not stopped:
    raise RuntimeError(f"the trial process on {node} ended with exit status {code} before its end: see "
                       f"{os.path.join(out, 'ray', ids[0] + '.log')}")
  return {"ids": ids, "where": where, "worker": worker, "counts": counts or {}, "stopped": stopped}


def _die_with_parent() -> None:
  """In the child: SIGKILL when the Ray worker that started it dies (its node killed, the worker lost)."""
  try:
    import ctypes
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
  except (OSError, AttributeError):
    pass


def child_env(cpus: float, gpus: float) -> dict[str, str]:
  """The trial process's environment: thread counts from its CPUs; GPU memory when trials share one."""
  env = dict(os.environ)
  threads = str(max(1, math.ceil(cpus)))
  for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    env[key] = threads
  if gpus == 0:
    env["CUDA_VISIBLE_DEVICES"] = ""  # no GPU was given to this trial: it must not take another's
  elif gpus < 1:  # trials share the device: none preallocates, each stays within its share
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{MEM_FRACTION * gpus:.3f}"
  return env


def _pin(cpus: float) -> tuple[list[int] | None, Any]:
  """Pins this process to a free slot of ceil(cpus) of the CPUs it may use; (the CPUs or None, the held lock)."""
  have = sorted(os.sched_getaffinity(0))
  n = max(1, math.ceil(cpus))
  if n >= len(have):
    return None, None
  folder = SLOTS.format(uid=os.getuid())
  os.makedirs(folder, exist_ok=True)
  for k in range(len(have) // n):
    f = open(os.path.join(folder, f"slot{k}-of-{n}"), "a")
    try:
      fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
      f.close()
      continue
    mine = have[k * n:(k + 1) * n]
    os.sched_setaffinity(0, mine)
    return mine, f
  return None, None


def _child(spec: dict[str, Any]) -> int:
  """The trial process of a Ray task: set up as the command's, pinned, then run_trials on its ids."""
  from attn import process
  allocator = process.setup()  # first: may re-execute this process with the command's allocator
  cpus, lock = _pin(spec["cpus"])
  print(f"attn: {spec['worker']}: allocator {allocator}; CPUs {cpus or 'all of this node'}; "
        f"threads {os.environ.get('OMP_NUM_THREADS')}", file=sys.stderr, flush=True)
  from attn.experiments.training import preempt
  preempt.install_handlers()
  from attn.experiments.running import sweep  # lazy: jax
  counts = sweep.run_trials(spec["out"], spec["ids"], lease_timeout=spec["lease_timeout"], wait=True,
                            worker=spec["worker"], tensorboard=spec.get("tensorboard"))
  from attn.experiments.running.store import atomic_write
  atomic_write(spec["result"], json.dumps(counts))
  del lock
  return 0


if __name__ == "__main__":
  sys.exit(_child(json.loads(sys.argv[1])))
