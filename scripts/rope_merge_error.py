"""Seed question 4 under RoPE: how far is the best position-free W_h from a RoPE layer?

With RoPE the score of query t and key s is x W_Q,h R(t − s) W_K,hᵀ c: one matrix
per offset. attn.variants.rope.position_free_fit gives the W_h minimising
Σ_pairs ‖W_Q,h R(t − s) W_K,hᵀ − W_h‖²_F over the causal pairs of a sequence (the
least-squares fit of the scores for isotropic inputs) and its relative error.

  python scripts/rope_merge_error.py                      # at init: d_model=512, h=8, d_k=64
  python scripts/rope_merge_error.py --run runs/rope      # every trial of a trained sweep

Prints one row per (layer config or trained layer, sequence length).
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import numpy as np

import attn
from attn.variants import rope


def init_rows(lengths: list[int]) -> list[tuple[str, int, float]]:
  """Freshly initialised per_head layers of the seed-004 config, full and half rotary."""
  rows = []
  for rope_dim in (64, 32):
    cfg = attn.HeadConfig(d_model=512, num_heads=8, d_k=64, rope_dim=rope_dim)
    p = attn.init("per_head", jax.random.PRNGKey(0), cfg)
    for L in lengths:
      _, err = rope.position_free_fit(p["w_q"], p["w_k"], cfg, L)
      rows.append((f"init, d_model=512 h=8 d_k=64 rope_dim={rope_dim}", L, err))
  return rows


def trained_rows(run_dir: str, lengths: list[int]) -> list[tuple[str, int, float]]:
  """Every self-attention layer of every trial with RoPE in a sweep, read through per_head."""
  from attn.experiments import load_trial
  rows = []
  for trial in sorted(os.listdir(os.path.join(run_dir, "trials"))):
    model, m, _ = load_trial(run_dir, trial)
    if not m.rope_dim:
      continue
    for l, block in enumerate(model.blocks):
      p = attn.convert(block.attn.params_dict(), m.variant, "per_head", m.head)
      for L in lengths:
        _, err = rope.position_free_fit(p["w_q"], p["w_k"], m.head, L)
        rows.append((f"trial {trial} layer {l} ({m.variant}, h={m.num_heads}, d_k={m.head.d_k}, "
                     f"rope_dim={m.rope_dim})", L, err))
  return rows


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--run", help="a sweep directory whose trials use positional='rope'")
  parser.add_argument("--lengths", type=int, nargs="+", default=[32, 128, 1024])
  args = parser.parse_args(argv)
  rows = trained_rows(args.run, args.lengths) if args.run else init_rows(args.lengths)
  print("| layer | sequence length | relative error of the best position-free W_h |")
  print("|---|---:|---:|")
  for name, L, err in rows:
    print(f"| {name} | {L} | {err:.3f} |")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
