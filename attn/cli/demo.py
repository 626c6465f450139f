"""`attn demo`: the seed questions answered for one config, in one screen (the work: attn.demo.report)."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("--d-model", type=int, default=512)
  p.add_argument("--num-heads", type=int, default=8)
  p.add_argument("--d-k", type=int, default=None)
  p.add_argument("--d-v", type=int, default=None)
  p.add_argument("--num-kv-heads", type=int, default=None)
  p.add_argument("--no-bias", action="store_true")


def run(args: argparse.Namespace) -> int:
  import jax
  from attn import demo
  from attn.config import HeadConfig
  cfg = HeadConfig(d_model=args.d_model, num_heads=args.num_heads, d_k=args.d_k, d_v=args.d_v,
                   num_kv_heads=args.num_kv_heads, use_bias=not args.no_bias)
  jax.config.update("jax_default_matmul_precision", "highest")  # put back by attn.cli.main from Python
  print(demo.report(cfg))
  return 0
