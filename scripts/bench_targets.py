"""The CPU performance targets of the first performance issue, checked against an `attn bench --out` JSON.

  attn bench --shapes reference --out bench.json && python scripts/bench_targets.py bench.json

Targets (reference shape, float32, forward+backward): fused ≤ 1.0× torch's time,
≤ 0.7× flax's, ≥ 75% of the matmul rate measured in the same run, and per_head
≤ 1.2× fused's time. Exits 0 whatever the outcome: a measurement, not a test.
"""

from __future__ import annotations

import json
import sys


def targets(reference: dict) -> list[tuple[str, float, str, bool]]:
  """(target, measured, goal, met) for each target the run has the numbers for."""
  rows = {r["name"]: r for r in reference["rows"]}
  if "fused" not in rows:
    return []
  f, out = rows["fused"], []

  def check(what, value, op, limit):
    if value is not None:
      out.append((what, value, f"{op} {limit}", value <= limit if op == "<=" else value >= limit))

  check("fused time / torch", f["ratios"].get("torch", {}).get("fb"), "<=", 1.0)
  check("fused time / flax", f["ratios"].get("flax", {}).get("fb"), "<=", 0.7)
  check("fused % of matmul rate", f["fb"]["pct_matmul"], ">=", 75.0)
  if "per_head" in rows:
    check("per_head time / fused", rows["per_head"]["fb"]["ms"] / f["fb"]["ms"], "<=", 1.2)
  return out


def main(argv: list[str]) -> int:
  if len(argv) != 1:
    print(__doc__, file=sys.stderr)
    return 2
  with open(argv[0], encoding="utf-8") as f:
    report = json.load(f)
  ref = report.get("shapes", {}).get("reference")
  if ref is None or report.get("dtype") != "float32":
    print(f"bench_targets: error: FILE={argv[0]!r}: a float32 run with the reference shape "
          "(attn bench --shapes reference --out FILE)", file=sys.stderr)
    return 2
  for what, value, goal, met in targets(ref):
    print(f"- {what}: {value:.2f} (target {goal}): {'met' if met else 'MISSED'}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
