"""`attn bench`: time every variant against flax, jax and torch attention, as ratios; or --decode, --steps,
--account. The work: attn.bench (layer.run_layers and its parts; decode, steps, account: their `report`).
"""

from __future__ import annotations

import argparse
import os
import sys

from attn.bench.shapes import DEFAULT_SHAPES, DTYPES, GROUPS, QUICK_SHAPES, SHAPES
from attn.bench.throughput import SWEEP_CONFIG


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--shapes", default=None,
                      help=f"comma-separated, from {','.join([*SHAPES, *GROUPS])} (long: every "
                           f"long-*; linear: every linear-*, each fixed-state head's chunked form "
                           f"against the blocked softmax kernel, causal, and the T from which it "
                           f"wins; default: {','.join(DEFAULT_SHAPES)}; --quick: "
                           f"{','.join(QUICK_SHAPES)})")
  parser.add_argument("--variants", default=None,
                      help="comma-separated variant names (default: every registered variant)")
  parser.add_argument("--repeats", type=int, default=None,
                      help="timed runs per candidate; the median is reported (default 20, --quick 5)")
  parser.add_argument("--dtype", default="float32", help=f"one of {sorted(DTYPES)}")
  parser.add_argument("--out", default=None, help="also write the results as JSON to this file")
  parser.add_argument("--quick", action="store_true",
                      help="fewer shapes and repeats: a smoke run, not a measurement")
  parser.add_argument("--no-peers", action="store_true", help="skip flax, jax and torch")
  parser.add_argument("--impls", default=None,
                      help="also time the fused layer with each of these attention cores "
                           "(comma-separated from attn.kernel.IMPLS; rows fused[impl], \"auto\"'s "
                           "pick named), and torch SDPA pinned to its flash and cuDNN backends")
  parser.add_argument("--sweep", metavar="CONFIG", nargs="?", const=SWEEP_CONFIG, default=None,
                      help="also measure sweep throughput, trials per minute, sequential vs "
                           "seeds under vmap, on the first trial of CONFIG (default: a built-in "
                           "copy of the quick sweep's h=1 per_head trial, configs/bench_layer.toml)")
  parser.add_argument("--decode", action="store_true",
                      help="instead: per-token KV-cache decode time and cache bytes per variant "
                           "at contexts 256, 1024, 4096 (attn.bench.decode)")
  parser.add_argument("--steps", action="store_true",
                      help="instead: the default sweep's models, step time against stored ratios to "
                           "the matmul rate, in both trial orders, met or MISSED (attn.bench.steps)")
  parser.add_argument("--account", action="store_true",
                      help="instead: every dot of the fused layer (reference shape) and the blocked core "
                           "(T=4096), its library, time and rate, per XLA flag set (attn.bench.account)")
  parser.add_argument("--flag-sets", default=None,
                      help="with --account: comma-separated, from attn.bench.flags.FLAG_SETS (default: all)")
  parser.add_argument("--record", action="store_true",
                      help="with --steps: store this run's ratios as the reference (attn/bench/step_ratios.json)")
  parser.add_argument("--sweep-seeds", type=int, default=4, help="seeds trained for --sweep")
  parser.add_argument("--sweep-rounds", type=int, default=1,
                      help="for --sweep: rounds of sequential and vmap, alternated (order flipped each "
                           "round); medians reported")
  parser.add_argument("--sweep-steps", type=int, default=None,
                      help="training steps per trial for --sweep (default: the config's; --quick 20)")


def run(args: argparse.Namespace) -> int:
  import jax
  import attn
  from attn import kernel
  from attn.bench import layer, machine
  from attn.bench.shapes import names
  from attn.config import invalid
  if args.dtype not in DTYPES:
    raise invalid("--dtype", args.dtype, f"one of {sorted(DTYPES)}")
  shapes = names(args.shapes, SHAPES, "--shapes", QUICK_SHAPES if args.quick else DEFAULT_SHAPES, GROUPS)
  variants = names(args.variants, attn.VARIANTS, "--variants", attn.VARIANTS)
  repeats = args.repeats if args.repeats is not None else (5 if args.quick else 20)
  impls = None if args.impls is None else names(args.impls, kernel.IMPLS, "--impls", ())
  # An accelerator runs 2048³ in tens of microseconds, too short to time against the call's overhead.
  matmul_n = 2048 if jax.default_backend() == "cpu" else 8192
  if isinstance(repeats, bool) or repeats < 1:
    raise invalid("--repeats", repeats, "a positive integer")
  if args.account:  # the children's XLA_FLAGS extend this one: checked before JAX starts and reads it
    from attn.bench import flags
    flags.check_xla_flags(os.environ.get("XLA_FLAGS", ""))
  info = machine.machine_info()
  log = lambda text: print(text, file=sys.stderr, flush=True)
  if args.decode:
    from attn.bench import decode
    return decode.report(variants, repeats, args.quick, not args.no_peers, info, args.out, log)
  if args.steps:
    from attn.bench import steps
    return steps.report(args.quick, args.record, info, args.out, log)
  if args.account:
    from attn.bench import account
    return account.report(args.flag_sets, repeats, info, args.out, log)
  layer.run_layers(shapes, variants, args.dtype, repeats, not args.no_peers, impls, matmul_n, args.quick,
                   args.sweep, args.sweep_seeds,
                   args.sweep_steps if args.sweep_steps is not None else (20 if args.quick else None),
                   args.sweep_rounds, info=info, out=args.out, log=log, write=lambda text: print(text, flush=True))
  return 0
