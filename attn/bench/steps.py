"""attn bench --steps: the default sweep's models, step time against stored ratios to the matmul rate.

Trains seed 0 of each model of configs/quick.toml (h = 1 and 4, per_head and
merged) through the runner's train_group, in the grid's order and then
reversed, in one process, and times a 2048³ matmul before each trial. A trial's
ratio is its step time over the matmul's time: a number that a busy machine
moves far less than a time. Both are the quick end of their samples (the lower
quartile of the steps, the fastest of five matmuls): other jobs on the machine
add time to some steps and rarely take any away. Three checks, each printed met or
MISSED: every ratio within TOLERANCE of the one stored in step_ratios.json
for this CPU kind (attn.bench.machine.cpu_kind: model, family and vector ISA;
recorded with --record, with its commit; a kind with no record is said so and
not checked); the same model within
ORDER_SPREAD in both orders (the h = 4 merged step took 1.5x longer or not
depending on the trials before it: attn.process); and page faults per step
under MAX_FAULTS (a step that faults in its buffers again pays for it in time;
the count does not depend on load). A benchmark, not a test: it exits 1 when a
check is missed.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

from attn import process
from attn.config import invalid

STORED = os.path.join(os.path.dirname(__file__), "step_ratios.json")
TOLERANCE = 0.35  # a ratio may exceed the stored one by this fraction
ORDER_SPREAD = 1.25  # slower / faster step time (lower quartile) of one model between the two orders
MAX_FAULTS = 200  # minor page faults per training step
MATMUL_N = 2048
SKIP = 10  # first steps left out (compilation warm-up, first eval)


def quick_models() -> list[tuple[str, dict[str, Any]]]:
  """(label, config) of seed 0 of each model in configs/quick.toml, in the grid's order."""
  from attn.experiments.running import config as config_lib
  path = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "quick.toml")
  if not os.path.exists(path):
    raise invalid("configs/quick.toml", os.path.normpath(path), "a checkout of attn with its configs/ "
                  "(pip install -e .): the check trains the default sweep's models")
  trials = config_lib.load(path).trials
  out = {}
  for t in trials:
    label = f"h={t.config['model']['num_heads']} {t.config['model']['variant']}"
    out.setdefault(label, t.config)
  return list(out.items())


def _matmul_s(repeats: int = 5) -> float:
  a = jax.random.normal(jax.random.PRNGKey(0), (MATMUL_N, MATMUL_N), jnp.float32)
  f = jax.jit(lambda a: a @ a)
  jax.block_until_ready(f(a))
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(f(a))
    times.append(time.perf_counter() - t)
  return min(times)


def time_trial(config: dict[str, Any], steps: int) -> dict[str, float]:
  """Step time (s; median and lower quartile) after SKIP steps, and minor page faults per step, of one trial."""
  from attn.experiments.training import train
  config = json.loads(json.dumps(config))
  config["train"]["steps"] = steps
  times: list[float] = []
  faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  counted: dict[str, int] = {}

  def on_row(_, row):
    times.append(row["step_time_s"])
    if len(times) == SKIP:
      counted["from"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt

  train.train_group([config], on_row=on_row, vmap=False)
  faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - counted.get("from", faults)
  kept = sorted(times[SKIP:])
  return {"step_s": kept[len(kept) // 4], "median_s": statistics.median(kept),
          "faults_per_step": faults / max(len(times) - SKIP, 1)}


def measure(steps: int = 100, log: Callable[[str], None] = print) -> dict[str, Any]:
  """Every quick model in the grid's order, then reversed: step times, ratios, faults."""
  models = quick_models()
  out: dict[str, Any] = {"steps": steps, "matmul_n": MATMUL_N, "runs": []}
  for order, seq in (("grid", models), ("reversed", models[::-1])):
    for label, config in seq:
      mm = _matmul_s()
      r = time_trial(config, steps)
      run = {"order": order, "model": label, "matmul_s": mm, **r, "ratio": r["step_s"] / mm}
      log(f"  {order:8s} {label:14s} step {1e3 * r['step_s']:6.2f} ms  matmul {1e3 * mm:6.1f} ms  "
          f"ratio {run['ratio']:.3f}  faults/step {r['faults_per_step']:.0f}")
      out["runs"].append(run)
  return out


def checks(result: dict[str, Any], stored: dict[str, Any] | None) -> list[tuple[str, str, bool]]:
  """(check, measured against goal, met) for each model."""
  out = []
  by = {}
  for r in result["runs"]:
    by.setdefault(r["model"], {})[r["order"]] = r
  for model, runs in by.items():
    steps = [r["step_s"] for r in runs.values()]
    spread = max(steps) / min(steps)
    out.append((f"{model}: step time, slower order / faster", f"{spread:.2f} (goal <= {ORDER_SPREAD})",
                spread <= ORDER_SPREAD))
    faults = max(r["faults_per_step"] for r in runs.values())
    out.append((f"{model}: page faults per step", f"{faults:.0f} (goal <= {MAX_FAULTS})", faults <= MAX_FAULTS))
    ref = (stored or {}).get("ratios", {}).get(model)
    if ref is not None:
      ratio = max(r["ratio"] for r in runs.values())
      limit = ref * (1 + TOLERANCE)
      out.append((f"{model}: step / matmul time", f"{ratio:.3f} (stored {ref:.3f}, goal <= {limit:.3f})",
                  ratio <= limit))
  return out


def record(result: dict[str, Any], machine: dict[str, Any], path: str = STORED) -> None:
  """Stores each model's median ratio over both orders under the machine's CPU kind, with its setting.

  The other kinds' records are kept."""
  by: dict[str, list[float]] = {}
  for r in result["runs"]:
    by.setdefault(r["model"], []).append(r["ratio"])
  kind = machine.get("cpu_kind") or machine.get("cpu")
  data = {"cpu": kind, "commit": _commit(), "load_average": machine.get("load_average"),
          "host_malloc": process.in_force(), "steps": result["steps"], "matmul_n": MATMUL_N,
          "ratios": {m: round(statistics.median(v), 4) for m, v in by.items()}}
  kinds = _read(path).get("kinds", {})
  kinds[kind] = data
  with open(path, "w", encoding="utf-8") as f:
    json.dump({"kinds": dict(sorted(kinds.items()))}, f, indent=1)
    f.write("\n")


def _commit() -> str | None:
  """The checkout's short commit, when attn runs from a git checkout."""
  try:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=os.path.dirname(__file__),
                         capture_output=True, text=True, timeout=10)
  except (OSError, subprocess.SubprocessError):
    return None
  return out.stdout.strip() or None


def _read(path: str) -> dict[str, Any]:
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except FileNotFoundError:
    return {}


def load_stored(kind: str, path: str = STORED) -> dict[str, Any] | None:
  """The ratios recorded on this CPU kind (attn.bench.machine.cpu_kind), or None."""
  return _read(path).get("kinds", {}).get(kind)


def markdown(result: dict[str, Any], found: list[tuple[str, str, bool]], stored: dict[str, Any] | None) -> str:
  lines = [f"### default sweep models: step time / {MATMUL_N}³ matmul time, {result['steps']} steps each",
           "", "| order | model | step ms (lower quartile) | median | matmul ms | ratio | page faults / step |",
           "|---|---|---:|---:|---:|---:|---:|"]
  for r in result["runs"]:
    lines.append(f"| {r['order']} | {r['model']} | {1e3 * r['step_s']:.2f} | {1e3 * r['median_s']:.2f} "
                 f"| {1e3 * r['matmul_s']:.1f} "
                 f"| {r['ratio']:.3f} | {r['faults_per_step']:.0f} |")
  where = ("none for this CPU kind: the ratio check is skipped (`attn bench --steps --record` on a quiet "
           "machine stores them)") if stored is None else f"{stored.get('cpu')} at {stored.get('commit')}"
  lines += ["", f"Stored ratios: {where}; host memory: {process.in_force()}", ""]
  lines += [f"- {what}: {value}: {'met' if met else 'MISSED'}" for what, value, met in found]
  return "\n".join(lines)


def report(quick: bool, record_ratios: bool, info: dict[str, Any], out: str | None, log: Callable[[str], None]) -> int:
  """`attn bench --steps`: the header, the table with each check met or MISSED, the ratios recorded where asked,
  the JSON written to `out` where given; the exit status (1: a check missed)."""
  n = 20 + SKIP if quick else 100
  print(f"# attn bench --steps\n\n{info.get('cpu_kind', info['cpu'])}, {info['cores']} cores; load average at start "
        f"{info['load_average']}; XLA_FLAGS={info['xla_flags']!r}\n")
  result = measure(n, log=log)
  stored = load_stored(info["cpu_kind"])
  found = checks(result, stored)
  print(markdown(result, found, stored))
  if record_ratios:
    record(result, info)
    log(f"recorded {STORED}")
  if out:
    with open(out, "w") as f:
      json.dump({"machine": info, "steps": result, "checks": found}, f, indent=1)
    log(f"wrote {out}")
  return 0 if all(met for *_, met in found) else 1
