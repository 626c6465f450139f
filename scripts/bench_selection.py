"""Key selection's attention core against full causal attention at long T, on this machine.

  python scripts/bench_selection.py [--T 16384] [--repeats 2]

The attention core alone (B=1, H=8, K=V=64, float32, causal), forward and
forward+backward, wall seconds (median) and XLA's peak buffer bytes of the
forward+backward: the blocked kernel (full causal), MoBA (blocks of 512, top 4: 2048
keys a query) in attn.kernel.gathered (what the layer runs) and in
attn.kernel.sparse over the union per query block, the indexer's tokens (top
2048, 4 index heads of 32, one index key) and a synthetic selection shared by
each query block (its own block and 3 earlier ones: what a selection that
clusters within a query block costs). The selection is timed apart. Prints one
markdown table with the CPU, the commit and the load.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np

from attn import kernel
from attn.bench.peers import peak_bytes
from attn.kernel import gathered, select, sparse


def _cpu() -> str:
  try:
    for line in open("/proc/cpuinfo"):
      if line.startswith("model name"):
        return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor()


def _time(f, args, repeats):
  jax.block_until_ready(f(*args))
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(f(*args))
    times.append(time.perf_counter() - t)
  return statistics.median(times)


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--T", type=int, default=16384)
  ap.add_argument("--repeats", type=int, default=2)
  args = ap.parse_args()
  T, H, K, B = args.T, 8, 64, 1
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.standard_normal((B, T, H, K)).astype(np.float32)) for _ in range(3))
  qi = jnp.asarray(rng.standard_normal((B, T, 4, 32)).astype(np.float32))
  ki = jnp.asarray(rng.standard_normal((B, T, 32)).astype(np.float32))
  wi = jnp.asarray(rng.standard_normal((B, T, 4)).astype(np.float32))
  ct = jnp.asarray(rng.standard_normal((B, T, H, K)).astype(np.float32))
  scale = K ** -0.5

  moba_sel = jax.jit(lambda q, k: select.moba_blocks(q, k, block=512, top_k=4, is_causal=True))
  index_sel = jax.jit(lambda qi, ki, wi: select.indexer_bits(qi, ki, wi, top_k=2048, is_causal=True))
  blocks_moba = moba_sel(q, k)
  idx, chosen = jax.jit(lambda q, k: select.moba_top(q, k, block=512, top_k=4, is_causal=True))(q, k)
  bits = index_sel(qi, ki, wi)
  blocks_index = select.token_blocks(bits, 128, T)
  n = T // 512  # synthetic: query block i (of 512) sees blocks i, i-1, i//2, 0
  own = np.arange(T) // 512
  syn = np.zeros((B, 1, T, n), bool)
  for c in (own, np.maximum(own - 1, 0), own // 2, np.zeros_like(own)):
    syn[0, 0, np.arange(T), c] = True
  blocks_syn = jnp.asarray(syn)

  cores = {
      "full causal (blocked)": (
          lambda q, k, v: kernel.attention(q, k, v, is_causal=True, impl="blocked"), ()),
      "moba 512×4, pairs gathered (kernel.gathered)": (
          lambda q, k, v, i, c: gathered.attention(q, k, v, i, c, block=512, scale=scale, is_causal=True),
          (idx, chosen)),
      "moba 512×4, union per query block (kernel.sparse)": (
          lambda q, k, v, b: sparse.attention(q, k, v, b, block_k=512, scale=scale, is_causal=True),
          (blocks_moba,)),
      "indexer top 2048": (lambda q, k, v, b, bits: sparse.attention(q, k, v, b, block_k=128, scale=scale,
                                                                     is_causal=True, bits_BTW=bits),
                           (blocks_index, bits)),
      "shared per query block, 4×512": (lambda q, k, v, b: sparse.attention(q, k, v, b, block_k=512,
                                                                            scale=scale, is_causal=True),
                                        (blocks_syn,)),
  }
  rows = []
  for name, (f, extra) in cores.items():
    fwd = jax.jit(f)
    fb = jax.jit(jax.grad(lambda q, k, v, ct, *e: jnp.sum(f(q, k, v, *e) * ct), argnums=(0, 1, 2)))
    peak = peak_bytes(fb.lower(q, k, v, ct, *extra).compile())
    t_f = _time(fwd, (q, k, v, *extra), args.repeats)
    t_fb = _time(fb, (q, k, v, ct, *extra), args.repeats)
    visited = ""
    if extra and extra[0].dtype == jnp.bool_:
      # Query blocks of 512; causal attention visits n(n+1)/2 · (512 / block_k) key blocks.
      bk = T // extra[0].shape[-1]
      visited = f"{sparse.visits(extra[0], T) / (n * (n + 1) // 2 * (512 // bk)):.2f}"
    rows.append((name, t_f, t_fb, peak, visited))
  t_moba = _time(moba_sel, (q, k), args.repeats)
  t_index = _time(index_sel, (qi, ki, wi), args.repeats)
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
  print(f"T={T}, B=1, H=8, K=V=64, float32, causal; {_cpu()}, {os.cpu_count()} cores; commit {commit}; "
        f"load {tuple(round(x, 2) for x in os.getloadavg())}; jax {jax.__version__}")
  print("| core | fwd s | fwd+bwd s | × full (fwd+bwd) | peak MB (fwd+bwd) "
        "| visited share of causal blocks |")
  print("|---|---|---|---|---|---|")
  base = rows[0][2]
  for name, t_f, t_fb, peak, vis in rows:
    print(f"| {name} | {t_f:.2f} | {t_fb:.2f} | {t_fb / base:.2f} | {peak / 2**20:.0f} | {vis} |")
  print(f"selection alone (forward): moba gate {t_moba:.2f} s, indexer scores + top-k {t_index:.2f} s")


if __name__ == "__main__":
  main()
