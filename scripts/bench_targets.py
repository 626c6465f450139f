"""The CPU performance targets of the performance issues, checked against an `attn bench --out` JSON.

  attn bench --shapes reference --out bench.json && python scripts/bench_targets.py bench.json
  attn bench --shapes long --repeats 3 --out long.json && python scripts/bench_targets.py long.json

Targets (reference shape, float32, forward+backward): fused ≤ 1.0× torch's time,
≤ 0.7× flax's, ≥ 75% of the matmul rate measured in the same run, and per_head
≤ 1.2× fused's time. Long sequences (float32, forward+backward): at T = 4096 the
fused layer ≤ 1.0× torch SDPA's time behind the same projections, causal ≤ 0.6×
non-causal, and at T = 16384 XLA's peak buffers ≤ 256 MB. Exits 0 whatever the
outcome: a measurement, not a test.
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


def long_targets(shapes: dict) -> list[tuple[str, float, str, bool]]:
  """(target, measured, goal, met) for the long-sequence shapes the run has."""
  def fused(name):
    rows = {r["name"]: r for r in shapes.get(name, {}).get("rows", [])}
    return rows.get("fused")
  out = []
  for suffix in ("", "-causal"):
    f = fused(f"long-4096{suffix}")
    ratio = None if f is None else f["ratios"].get("torch_sdpa", {}).get("fb")
    if ratio is not None:
      out.append((f"T=4096{suffix} fused time / torch SDPA", ratio, "<= 1.0", ratio <= 1.0))
  for T in (1024, 4096, 16384):
    plain, causal = fused(f"long-{T}"), fused(f"long-{T}-causal")
    if plain and causal:
      ratio = causal["fb"]["ms"] / plain["fb"]["ms"]
      out.append((f"T={T} causal time / non-causal", ratio, "<= 0.6", ratio <= 0.6))
  for suffix in ("", "-causal"):
    f = fused(f"long-16384{suffix}")
    if f is not None and f["peak_bytes"] is not None:
      mb = f["peak_bytes"] / 2**20
      out.append((f"T=16384{suffix} peak MB", mb, "<= 256", mb <= 256))
  return out


def main(argv: list[str]) -> int:
  if len(argv) != 1:
    print(__doc__, file=sys.stderr)
    return 2
  with open(argv[0], encoding="utf-8") as f:
    report = json.load(f)
  shapes = report.get("shapes", {})
  found = (targets(shapes["reference"]) if "reference" in shapes else []) + long_targets(shapes)
  if not found or report.get("dtype") != "float32":
    print(f"bench_targets: error: FILE={argv[0]!r}: a float32 run with the reference or long "
          "shapes (attn bench --shapes reference,long --out FILE)", file=sys.stderr)
    return 2
  for what, value, goal, met in found:
    print(f"- {what}: {value:.2f} (target {goal}): {'met' if met else 'MISSED'}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
