"""Where the blocked attention core overtakes the einsum one: the rule behind impl="auto".

  python scripts/blocked_crossover.py [--lengths 256,512,...] [--rounds 5] [--batch 1]

Times the attention core alone (q, k, v already projected; H=8, K=V=64,
float32), forward+backward, einsum vs blocked, with and without a causal mask,
all candidates of a length timed round-robin. Prints the median time of each,
blocked ÷ einsum (kernel.BLOCKED_MIN_SCORES should sit where that ratio drops
below 1) and the blocked core's causal ÷ non-causal time. A measurement, not
a test: the machine's load moves it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from attn import kernel


def _fwd_bwd(impl: str, causal: bool):
  loss = lambda q, k, v, ct: jnp.sum(kernel.attention(q, k, v, is_causal=causal, impl=impl) * ct)
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def measure(T: int, B: int, rounds: int, H: int = 8, K: int = 64) -> dict[str, float]:
  """Median seconds of each (impl, causal) forward+backward at T = S."""
  rng = np.random.default_rng(0)
  q, k, v, ct = (jnp.asarray(rng.standard_normal((B, T, H, K)), jnp.float32) for _ in range(4))
  calls = {}
  for impl in ("einsum", "blocked"):
    for causal in (False, True):
      f = _fwd_bwd(impl, causal)
      jax.block_until_ready(f(q, k, v, ct))
      calls[impl, causal] = lambda f=f: jax.block_until_ready(f(q, k, v, ct))
  times = {key: [] for key in calls}
  for _ in range(rounds):
    for key, call in calls.items():
      t = time.perf_counter()
      call()
      times[key].append(time.perf_counter() - t)
  return {key: statistics.median(ts) for key, ts in times.items()}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--lengths", default="128,256,512,768,1024,1536,2048")
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--batch", type=int, default=1)
  args = parser.parse_args()
  print(f"B={args.batch}, H=8, K=V=64, float32, forward+backward, median of {args.rounds}; "
        f"kernel.BLOCKED_MIN_SCORES = {kernel.BLOCKED_MIN_SCORES}\n")
  print("| T = S | T·S | einsum ms | blocked ms | blocked ÷ einsum | causal einsum ms "
        "| causal blocked ms | causal blocked ÷ einsum | blocked causal ÷ non-causal |")
  print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
  for T in (int(t) for t in args.lengths.split(",")):
    m = measure(T, args.batch, args.rounds)
    e, b, ec, bc = (1e3 * m[key] for key in
                    (("einsum", False), ("blocked", False), ("einsum", True), ("blocked", True)))
    print(f"| {T} | {T * T:,} | {e:.1f} | {b:.1f} | {b / e:.2f} | {ec:.1f} | {bc:.1f} "
          f"| {bc / ec:.2f} | {bc / b:.2f} |", flush=True)


if __name__ == "__main__":
  main()
