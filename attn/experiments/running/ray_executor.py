"""`attn sweep --executor ray [--ray-address ADDRESS]`: one Ray task per unfinished trial (seed group, pack).

Ray is an optional extra (pip install -e ".[ray]"; tested with ray 2.60.0). The driver (the
`attn sweep` process) checks the --ray-* options, connects (`connect`: no address starts a
local cluster; `auto`, `ray://HOST:PORT` or `HOST:PORT` joins one, refused by name when it does
not answer within CONNECT_TIMEOUT_S), refuses a request no live node can hold, and then submits
one task per group of `slurm.groups` with --ray-cpus-per-trial and --ray-gpus-per-trial
(--trials-per-device K: 1/K of a GPU each on a cluster with GPUs, else 1/K of the smallest
node's CPUs). Everything else is the store's, as for local workers and Slurm tasks:

- each task (attn.experiments.running.ray_task) runs `sweep.run_trials(DIR, ids, wait=True)` in
  a trial process of its own, which calls `attn.process.setup()` first (allocator, XLA flags;
  on a GPU worker no CPU allocator preload), pins itself to its share of the node's CPUs and
  sets the thread counts to them; with under one GPU a trial does not preallocate and stays
  within its share of the GPU's memory;
- leases keep two tasks from training one trial (a task retried after its node died takes the
  lease over: at once on the same host, after --lease-timeout elsewhere), a retried task resumes
  from the trial's checkpoint, every finished trial's summary and rows are written once;
- a task first checks that it sees the store (DIR/sweep.json at the same path) and the entry
  points the trials name (`plugins`: variants, mechanisms, families of installed plugins);
  missing either, it fails naming what is missing and the node, and the sweep reports it;
  the trials stay unfinished for a re-run;
- where a trial ran (node, address, CPUs, GPUs) is its lease's and summary's worker (`attn
  status`), a line when its task ends, and one "ray" line in the run record (DIR/run.jsonl)
  with the cluster, each trial's placement and the trials per hour;
- SIGINT, SIGTERM or SIGUSR1 to the driver cancels the tasks: a running task's child saves its
  trial at the step it is in (attn.experiments.training.preempt) and exits; a queued one never
  starts. Re-running the same command finishes what is left.

Task logs: DIR/ray/<first trial id>.log (appended by retries).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import signal
import socket
import sys
import time
from typing import Any, TextIO

from attn.config import ConfigError, invalid

EXTRA = 'pip install -e ".[ray]"'
TESTED = "2.60.0"
FLAGS = ("address", "cpus_per_trial", "gpus_per_trial", "runtime_env")
CONNECT_TIMEOUT_S = 5.0
MAX_RETRIES = 3  # Ray re-runs a task whose node or worker died; each resumes from the trial's checkpoint
_ADDRESS = re.compile(r"(?:ray://)?(\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.-]+):(\d{1,5})")


def add_arguments(parser: argparse.ArgumentParser) -> None:
  """Adds the --ray-* options of `attn sweep` (used with --executor ray)."""
  g = parser.add_argument_group(f"Ray (with --executor ray; needs {EXTRA}; logs go to DIR/ray/)")
  g.add_argument("--ray-address", metavar="ADDRESS", default=None,
                 help="the cluster to join: auto, HOST:PORT (its GCS) or ray://HOST:PORT (Ray Client); "
                      "default: start a local one on this machine")
  g.add_argument("--ray-cpus-per-trial", metavar="N", default=None,
                 help="CPUs of each task (default 1; its threads follow them)")
  g.add_argument("--ray-gpus-per-trial", metavar="N", default=None,
                 help="GPUs of each task (default 0; a fraction such as 0.25 shares a GPU between trials)")
  g.add_argument("--ray-runtime-env", metavar="JSON", default=None,
                 help="Ray's runtime_env for the tasks, a JSON object or a .json file, e.g. "
                      "'{\"pip\": [\"my-attn-plugin\"]}' so that the workers have your entry points")


def _number(flag: str, value: Any, zero: bool) -> float | None:
  if value is None:
    return None
  try:
    n = float(value)
  except (TypeError, ValueError):
    n = float("nan")
  if not math.isfinite(n) or n < 0 or (n == 0 and not zero):
    raise invalid(flag, value, "a number >= 0 (fractions allowed)" if zero else "a number > 0 (fractions allowed)")
  if n > 1 and n != int(n):
    raise invalid(flag, value, "a whole number above 1, or a fraction up to 1 (Ray's rule)")
  return n


def check_address(address: str | None) -> str | None:
  """None, "auto", HOST:PORT or ray://HOST:PORT; anything else is refused by name."""
  if address is None or address == "auto":
    return address
  m = _ADDRESS.fullmatch(str(address).strip())
  if not m or not 0 < int(m.group(2)) < 65536:
    raise invalid("--ray-address", address, "auto, HOST:PORT (the head's GCS, e.g. 10.0.0.1:6379) or "
                  "ray://HOST:PORT (Ray Client, e.g. ray://head:10001); left out: a local cluster")
  return str(address).strip()


def _runtime_env(value: str | None) -> dict[str, Any] | None:
  if value is None:
    return None
  text = value
  if value.strip().endswith(".json") and not value.strip().startswith("{"):
    try:
      with open(value, encoding="utf-8") as f:
        text = f.read()
    except OSError as e:
      raise invalid("--ray-runtime-env", value, f"a JSON object or a readable .json file ({e.strerror})") from None
  try:
    env = json.loads(text)
  except json.JSONDecodeError as e:
    raise invalid("--ray-runtime-env", value, f"a JSON object ({e.msg} at char {e.pos})") from None
  if not isinstance(env, dict):
    raise invalid("--ray-runtime-env", value, "a JSON object, e.g. {\"pip\": [\"my-attn-plugin\"]}")
  return env


def check_args(args: argparse.Namespace) -> dict[str, Any]:
  """Validates the --ray-* options (refused without --executor ray) -> the plan's parameters; {} otherwise."""
  if getattr(args, "executor", "ray") != "ray":
    for f in FLAGS:
      if getattr(args, f"ray_{f}", None) is not None:
        raise invalid(f"--ray-{f.replace('_', '-')}", getattr(args, f"ray_{f}"),
                      f"only with --executor ray (this is --executor {args.executor})")
    return {}
  if importlib.util.find_spec("ray") is None:
    raise invalid("--executor", "ray", f"an install with Ray: {EXTRA} (ray {TESTED} tested)")
  cpus = _number("--ray-cpus-per-trial", getattr(args, "ray_cpus_per_trial", None), zero=False)
  gpus = _number("--ray-gpus-per-trial", getattr(args, "ray_gpus_per_trial", None), zero=True)
  per_device = getattr(args, "trials_per_device", 1) or 1
  if per_device > 1 and (gpus is not None or cpus is not None):
    raise invalid("--trials-per-device", per_device, "1 with --ray-cpus-per-trial or --ray-gpus-per-trial "
                  "(it sets them: 1/K of a GPU each, or 1/K of a node's CPUs on a cluster without GPUs)")
  return {"address": check_address(getattr(args, "ray_address", None)), "cpus": cpus, "gpus": gpus,
          "per_device": per_device, "runtime_env": _runtime_env(getattr(args, "ray_runtime_env", None))}


def _answers(address: str, timeout: float = CONNECT_TIMEOUT_S) -> None:
  """Refuses (ConfigError naming it) an address nothing listens on within `timeout` seconds."""
  host, port = _ADDRESS.fullmatch(address).groups()
  try:
    with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
      return
  except OSError as e:
    why = "no answer" if isinstance(e, TimeoutError) else (e.strerror or str(e))
  raise invalid("--ray-address", address, f"the address of a running Ray cluster: {host}:{port} gave "
                f"{why} within {timeout:g} s (start one with `ray start --head`, or leave --ray-address out "
                "for a local cluster)")


def nodes(ray: Any) -> list[dict[str, Any]]:
  """The live nodes: address, id, CPUs and GPUs each."""
  return [{"ip": n.get("NodeManagerAddress"), "node_id": n.get("NodeID"),
           "cpus": float(n.get("Resources", {}).get("CPU", 0)), "gpus": float(n.get("Resources", {}).get("GPU", 0))}
          for n in ray.nodes() if n.get("Alive")]


def resources(params: dict[str, Any], offered: list[dict[str, Any]], stream: TextIO) -> tuple[float, float]:
  """(CPUs, GPUs) per task from the options and the cluster; refused by name when no node can hold them."""
  cpus, gpus, k = params["cpus"], params["gpus"], params["per_device"]
  if k > 1 and any(n["gpus"] >= 1 for n in offered):
    cpus, gpus = 1.0, 1.0 / k
    stream.write(f"--trials-per-device {k}: each Ray task asks for {gpus:.4g} GPU\n")
  elif k > 1:
    cpus = max(min(n["cpus"] for n in offered) / k, 0.0001)
    cpus = float(int(cpus)) if cpus >= 1 else cpus
    stream.write(f"--trials-per-device {k}: no GPU in the cluster: each Ray task asks for {cpus:.4g} CPUs\n")
  cpus, gpus = cpus or 1.0, gpus or 0.0
  if not any(n["cpus"] >= cpus and n["gpus"] >= gpus for n in offered):
    have = "; ".join(f"{n['ip']} ({(n['node_id'] or '?')[:8]}): {n['cpus']:g} CPU, {n['gpus']:g} GPU"
                     for n in offered) or "no live node"
    raise ConfigError(f"--ray-cpus-per-trial={cpus:g} --ray-gpus-per-trial={gpus:g} is not allowed: resources "
                      f"one node of the cluster has (its nodes: {have}); ask for less, or add a node that has them")
  return cpus, gpus


def connect(params: dict[str, Any], stream: TextIO = sys.stderr) -> dict[str, Any]:
  """Joins (or starts) the cluster and sizes the tasks; the plan `run` uses. Nothing is trained here."""
  address = params["address"]
  if address not in (None, "auto"):
    _answers(address)
  os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
  import ray
  kwargs: dict[str, Any] = {"logging_level": "WARNING", "log_to_driver": False}
  if params.get("runtime_env"):
    kwargs["runtime_env"] = params["runtime_env"]
  try:
    if address is None:
      ray.init(include_dashboard=False, **kwargs)
    else:
      ray.init(address=address, **kwargs)
  except Exception as e:  # Ray's ConnectionError, RuntimeError, AuthenticationError, ...: the cluster's answer
    last = (str(e).strip().splitlines() or [type(e).__name__])[-1]
    raise invalid("--ray-address", address or "(none: a local cluster)",
                  f"a Ray cluster this machine can join ({last})") from None
  try:
    offered = nodes(ray)
    cpus, gpus = resources(params, offered, stream)
  except BaseException:
    ray.shutdown()
    raise
  where = "a local Ray cluster" if address is None else f"the Ray cluster at {address}"
  stream.write(f"{where}: {len(offered)} node{'s' * (len(offered) != 1)}, "
               f"{sum(n['cpus'] for n in offered):g} CPUs, {sum(n['gpus'] for n in offered):g} GPUs; "
               f"each task {cpus:g} CPU, {gpus:g} GPU\n")
  return {"address": address, "nodes": offered, "cpus": cpus, "gpus": gpus, "runtime_env": params.get("runtime_env")}


def plugins(trials: list[Any]) -> list[dict[str, str]]:
  """The entry points (group, name, distribution) of installed plugins whose records the trials' configs name."""
  from attn import registry
  names: set[str] = set()

  def walk(v: Any) -> None:
    if isinstance(v, str):
      names.add(v)
    elif isinstance(v, dict):
      for x in v.values():
        walk(x)
    elif isinstance(v, (list, tuple)):
      for x in v:
        walk(x)
  for t in trials:
    walk(t.config)
  out = []
  for reg in registry.REGISTRIES:
    for name in sorted(names):
      if name in reg and reg.source(name) not in (registry.BUILTIN, registry.RUNTIME):
        out.append({"group": reg.group, "name": name, "distribution": reg.source(name)})
  return out


def _reason(e: BaseException) -> str:
  """One line of why a task failed: the task's own error, or what Ray says (a node died, cancelled)."""
  cause = getattr(e, "cause", None) or e
  text = str(cause).strip().splitlines()
  return (text[-1] if text else type(cause).__name__)[:600]


def run(out: str, sweep: Any, plan: dict[str, Any], lease_timeout: float, tensorboard: str | None = None,
        stream: TextIO = sys.stderr) -> tuple[int, str | None]:
  """Runs the unfinished trials of a claimed store as Ray tasks until they end; (the stopping signal or 0, a failure).

  The failure (a task that failed after Ray's retries: the store not visible, a plugin missing, a
  trial process that died) leaves its trials unfinished; the caller reports them.
  """
  import ray
  from attn.experiments.running import ray_task, slurm, status as status_lib, supervisor, run_record
  from attn.experiments.running.store import Store
  try:
    store = Store(out)
    pending = [t for t in sweep.trials if not store.is_done(t.id)]
    groups = slurm.groups(sweep, pending)
    index = {t.id: i + 1 for i, t in enumerate(sweep.trials)}
    spec = {"out": os.path.abspath(out), "lease_timeout": lease_timeout, "tensorboard": tensorboard,
            "plugins": plugins(pending)}
    remote = ray.remote(ray_task.run)
    refs = [remote.options(num_cpus=plan["cpus"], num_gpus=plan["gpus"], max_retries=MAX_RETRIES,
                           retry_exceptions=False, name=f"attn trial {ids[0]}").remote(spec, ids) for ids in groups]
    from attn.experiments.running import config as config_lib
    per = "pack" if config_lib.packs(getattr(sweep, "pack", 1)) else "seed group" if sweep.vmap_seeds else "trial"
    stream.write(f"{len(refs)} Ray task{'s' * (len(refs) != 1)}, one per {per}"
                 f" ({len(sweep.trials) - len(pending)} of {len(sweep.trials)} trials already finished; "
                 f"logs: {os.path.join(out, 'ray')}/)\n")
    results: dict[int, dict[str, Any]] = {}
    errors: dict[int, str] = {}
    t0 = time.time()

    def which(ids: list[str]) -> str:
      return "trial" + "s" * (len(ids) > 1) + " " + ", ".join(f"{index[i]}/{len(index)}" for i in ids)

    def poll(k: int) -> int | None:
      if k in results or k in errors:
        return 0 if k in results else 1
      if not ray.wait([refs[k]], timeout=0)[0]:
        return None
      try:
        results[k] = ray.get(refs[k])
      except Exception as e:  # the task's error after Ray's retries, or cancelled
        if type(e).__name__ == "TaskCancelledError":  # stopped (SIGTERM, Ctrl-C) before it started
          results[k] = {"ids": groups[k], "where": None, "worker": None, "counts": {}, "stopped": True}
          stream.write(f"{which(groups[k])}: not started (the sweep was stopped)\n")
          return 0
        errors[k] = _reason(e)
        if "No module named 'attn" in errors[k]:
          errors[k] += f" (a worker without attn: install it on every node, or pass --ray-runtime-env)"
        stream.write(f"{which(groups[k])}: Ray task failed: {errors[k]}\n")
        return 1
      r = results[k]
      state = ", ".join(f"{v} {c}" for c, v in r["counts"].items() if c in ("ok", "failed", "skipped", "unfinished")
                        and v)
      if r["stopped"] and (not r["counts"] or r["counts"].get("unfinished")):
        state = "stopped, saved at the step it reached for a re-run"
      stream.write(f"{which(groups[k])} on {r['worker']}: {state or 'done'}\n")
      return 0

    children = [supervisor.Child(f"Ray task {k + 1}", lambda k=k: poll(k), lambda signum, k=k: ray.cancel(refs[k]),
                                 lambda k=k: ray.cancel(refs[k], force=True)) for k in range(len(refs))]
    stopped_by = supervisor.supervise(children, out, f"{len(refs)} Ray tasks", lease_timeout, stream,
                                      signals=(signal.SIGTERM, signal.SIGUSR1, signal.SIGINT))
    if stopped_by:  # a cancelled task's trial process may still be saving: wait for its lease
      deadline = time.monotonic() + max(60.0, lease_timeout)
      while time.monotonic() < deadline and status_lib.totals(status_lib.collect(out, lease_timeout))["running"]:
        time.sleep(0.2)
    wall = time.time() - t0
    finished = sum(r["counts"].get("ok", 0) + r["counts"].get("failed", 0) for r in results.values())
    rate = finished * 3600 / wall if wall > 0 else 0.0
    placements = {i: {**r["where"], "worker": r["worker"]} for r in results.values() if r["where"] for i in r["ids"]}
    try:
      run_record.append(out, {"event": "ray", "address": plan["address"], "nodes": plan["nodes"],
                              "task_resources": {"cpus": plan["cpus"], "gpus": plan["gpus"]},
                              "runtime_env": plan.get("runtime_env"), "placements": placements,
                              "failed_tasks": {groups[k][0]: why for k, why in errors.items()},
                              "trials_finished": finished, "wall_s": round(wall, 3),
                              "trials_per_hour": round(rate, 2)})
    except OSError:
      pass  # the disk's fault: the trials are in the store; the caller's end line says how it ended
    used = len({p["node_id"] for p in placements.values()})
    stream.write(f"Ray: {finished} trials in {wall:.0f} s on {used} node{'s' * (used != 1)}: "
                 f"{rate:.1f} trials per hour\n")
    return stopped_by, (f"{len(errors)} Ray task{'s' * (len(errors) > 1)} failed; the first: "
                        f"{next(iter(errors.values()))}") if errors else None
  finally:
    ray.shutdown()
