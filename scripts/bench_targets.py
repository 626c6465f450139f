"""The CPU goals of issue 34, each printed met or MISSED with its measured ratio, the CPU and the flags.

  python scripts/bench_targets.py                  # runs the benchmarks it needs (about 5 minutes)
  python scripts/bench_targets.py bench.json ...   # or reads `attn bench --out` / `attn bench --steps --out` JSON

Without files it runs, in this process, `attn bench --shapes reference,long-4096,
long-4096-causal,long-16384-causal --repeats 3` and `attn bench --steps`. Goals
(each a ratio measured side by side in one run): reference shape, fused
forward+backward ≤ 0.7× torch's nn.MultiheadAttention, ≤ 0.7× flax's
nnx.MultiHeadAttention, ≥ 75% of the 2048³ matmul rate; T = 4096 the fused
layer with the blocked core ≤ 0.7× torch SDPA behind the same projections,
causal ≤ 0.55× full (the core alone and the layer); T = 16384 peak XLA buffers
≤ 256 MB; window 256 at T = 16384 ≤ 0.1× full causal (the core); bfloat16
reference ≤ 1.0× torch (a bfloat16 run's JSON only); the default sweep's models
pass `attn bench --steps`' checks. Exits 0 whatever the outcome: a measurement.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def _rows(shapes: dict, name: str) -> dict[str, Any]:
  return {r["name"]: r for r in shapes.get(name, {}).get("rows", [])}


def goals(report: dict[str, Any]) -> list[tuple[str, float | None, str, bool | None]]:
  """(goal, measured, limit, met) for every goal the report has numbers for; None: not measured."""
  shapes, dtype, out = report.get("shapes", {}), report.get("dtype"), []
  torch = report.get("machine", {}).get("versions", {}).get("torch")

  def add(what, value, op, limit):
    met = None if value is None else (value <= limit if op == "<=" else value >= limit)
    out.append((what, value, f"{op} {limit}", met))

  ref = _rows(shapes, "reference")
  f = ref.get("fused")
  for name, label in (("fused", "fused"), ("fused_onednn", 'fused, impl="onednn"')):
    if name in ref and dtype == "float32":
      r = ref[name]
      add(f"reference f+b: {label} / torch MHA", r["ratios"].get("torch", {}).get("fb"), "<=", 0.7)
      add(f"reference f+b: {label} / flax MHA", r["ratios"].get("flax", {}).get("fb"), "<=", 0.7)
      add(f"reference f+b: {label} % of matmul rate", r["fb"]["pct_matmul"], ">=", 75.0)
  if f is not None and dtype == "bfloat16":
    add("bfloat16 reference f+b: fused / torch MHA", f["ratios"].get("torch", {}).get("fb"), "<=", 1.0)
  full, causal = _rows(shapes, "long-4096"), _rows(shapes, "long-4096-causal")
  long16 = _rows(shapes, "long-16384-causal")
  for t, label in (("", "blocked"), ("_onednn", 'blocked, impl="onednn"')):
    if "fused" + t in full:
      add(f"T=4096 f+b: fused ({label}) / torch SDPA",
          full["fused" + t]["ratios"].get("torch_sdpa", {}).get("fb"), "<=", 0.7)
    if "fused" + t in full and "fused" + t in causal:
      add(f"T=4096 f+b: causal / full, layer ({label})",
          causal["fused" + t]["fb"]["ms"] / full["fused" + t]["fb"]["ms"], "<=", 0.55)
    if "core" + t in causal and "core_full" + t in full:
      add(f"T=4096 f+b: causal / full, core ({label})",
          causal["core" + t]["fb"]["ms"] / full["core_full" + t]["fb"]["ms"], "<=", 0.55)
    if "fused" + t in long16 and long16["fused" + t]["peak_bytes"] is not None:
      add(f"T=16384 causal: peak XLA MB, layer ({label})", long16["fused" + t]["peak_bytes"] / 2**20, "<=", 256)
    if "core" + t in long16 and long16["core" + t]["peak_bytes"] is not None:
      add(f"T=16384 causal: peak XLA MB, core ({label})", long16["core" + t]["peak_bytes"] / 2**20, "<=", 256)
    if "core_window" + t in long16:
      add(f"T=16384 f+b: window 256 / full causal, core ({label})",
          long16["core_window" + t]["fb"]["ms"] / long16["core" + t]["fb"]["ms"], "<=", 0.1)
  for what, value, met in report.get("checks", []):
    out.append((f"default sweep: {what}", None, value, met))
  if not torch and shapes:
    out.append(("torch peers", None, "torch not installed: its goals are not measured", None))
  return out


def header(report: dict[str, Any]) -> str:
  m = report.get("machine", {})
  return (f"{m.get('cpu_kind', m.get('cpu', '?'))}, {m.get('cores', '?')} cores, load average {m.get('load_average')}; "
          f"XLA_FLAGS={m.get('xla_flags', '')!r}; host memory: {m.get('host_malloc', '?')}; "
          f"jax {m.get('versions', {}).get('jax')}, torch {m.get('versions', {}).get('torch') or 'not installed'}; "
          f'impl="onednn": {m.get("onednn", "not recorded")}')


def print_goals(report: dict[str, Any]) -> None:
  print(header(report))
  for what, value, goal, met in goals(report):
    verdict = "not measured" if met is None else ("met" if met else "MISSED")
    if value is not None:
      measured = f"{value:.3f} (goal {goal})"
    else:  # a check's text holds both its value and goal; an unmeasured goal shows the goal
      measured = goal if met is not None or not goal[:2] in ("<=", ">=") else f"goal {goal}"
    print(f"- {what}: {measured}: {verdict}")


def run_benchmarks() -> list[dict[str, Any]]:
  """The shapes and the step check the goals need, measured in this process."""
  from attn import process
  from attn.bench import layer
  from attn.bench import steps as bench_steps
  process.setup()  # this script's process set up as the attn command's: re-executed with mimalloc preloaded
  info = layer.machine_info()
  log = lambda text: print(text, file=sys.stderr, flush=True)
  shapes = {}
  for name in ("reference", "long-4096", "long-4096-causal", "long-16384-causal"):
    shapes[name] = layer.bench_shape(name, layer.SHAPES[name], ["fused"], "float32", 3, True, log=log)
  step = bench_steps.measure(100, log=log)
  checks = bench_steps.checks(step, bench_steps.load_stored(info["cpu_kind"]))
  return [{"machine": info, "dtype": "float32", "shapes": shapes}, {"machine": info, "checks": checks}]


def main(argv: list[str]) -> int:
  if argv and argv[0] in ("-h", "--help"):
    print(__doc__)
    return 0
  reports = []
  for path in argv:
    try:
      with open(path, encoding="utf-8") as f:
        report = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
      print(f"bench_targets: {path}: not a readable JSON file ({e}); give files that `attn bench --out` or "
            "`attn bench --steps --out` wrote, or no argument to measure", file=sys.stderr)
      return 2
    if not isinstance(report, dict):
      print(f"bench_targets: {path}: a JSON {type(report).__name__}, not the object `attn bench --out` writes",
            file=sys.stderr)
      return 2
    reports.append(report)
  reports = reports or run_benchmarks()
  for report in reports:
    print_goals(report)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
