"""The reference-shape fused layer in a plain python, under `attn python`, and in the `attn` command, alternated.

  python scripts/bench_process.py [ROUNDS] [REPEATS]     # default 3 rounds of 20 repeats

Each round runs the three, in a rotated order, as fresh processes timing the
same thing (attn.bench.layer.bench_shape: B 8, T 256, D 512, H 8, float32, the
fused variant, forward and forward+backward, round robin with the matmul and
impl="onednn" cases): `python THIS --child` (a library user's process, glibc),
`attn python THIS --child` (the launcher: mimalloc preloaded) and `attn bench
--shapes reference --variants fused --no-peers` (the command, set up by
attn.process). Prints each run's forward+backward median and fastest call (ms) and its
allocator, and the median of each way over the rounds.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile


def child(repeats: int) -> None:
  from attn import process
  from attn.bench import layer
  r = layer.bench_shape("reference", layer.SHAPES["reference"], ["fused"], "float32", repeats, False,
                        log=lambda text: None)
  row = {x["name"]: x for x in r["rows"]}["fused"]
  print(json.dumps({"fb_ms": row["fb"]["ms"], "fb_min_ms": row["fb"]["min_ms"], "fwd_ms": row["fwd"]["ms"],
                    "allocator": process.in_force()}))


def run(way: str, repeats: int) -> dict:
  from attn import process
  env = process.clean_env()
  if way == "attn bench":
    with tempfile.TemporaryDirectory() as d:
      out = os.path.join(d, "bench.json")
      subprocess.run(["attn", "bench", "--shapes", "reference", "--variants", "fused", "--no-peers", "--repeats",
                      str(repeats), "--out", out], env=env, check=True, capture_output=True)
      with open(out) as f:
        report = json.load(f)
    row = {x["name"]: x for x in report["shapes"]["reference"]["rows"]}["fused"]
    return {"fb_ms": row["fb"]["ms"], "fb_min_ms": row["fb"]["min_ms"], "fwd_ms": row["fwd"]["ms"],
            "allocator": report["machine"]["host_malloc"]}
  cmd = ([sys.executable] if way == "python" else ["attn", "python"]) + [__file__, "--child", str(repeats)]
  p = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
  return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> int:
  if argv[:1] == ["--child"]:
    child(int(argv[1]))
    return 0
  rounds, repeats = (int(argv[0]) if argv else 3), (int(argv[1]) if len(argv) > 1 else 20)
  ways = ["python", "attn python", "attn bench"]
  got: dict[str, list[float]] = {w: [] for w in ways}
  fastest: dict[str, list[float]] = {w: [] for w in ways}
  print(f"load average at start {os.getloadavg()}", flush=True)
  for k in range(rounds):
    for way in ways[k % 3:] + ways[:k % 3]:
      r = run(way, repeats)
      got[way].append(r["fb_ms"])
      fastest[way].append(r["fb_min_ms"])
      print(f"round {k + 1} {way:12s} fwd+bwd {r['fb_ms']:7.1f} ms (fastest {r['fb_min_ms']:6.1f})  "
            f"fwd {r['fwd_ms']:6.1f} ms  {r['allocator']}", flush=True)
  print(f"load average at end {os.getloadavg()}")
  for way in ways:
    each = ", ".join(f"{t:.1f}" for t in got[way])
    print(f"{way:12s} fwd+bwd median {statistics.median(got[way]):7.1f} ms ({each}); fastest call, median over "
          f"rounds {statistics.median(fastest[way]):7.1f} ms")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
