"""Times seeds trained one by one against seeds trained together under jax.vmap.

Usage: python scripts/bench_vmap_seeds.py [CONFIG] [--seeds N] [--steps S] [--set KEY=VALUE ...]
Prints the median step time per seed and the wall time (compile included) both ways.
"""

import argparse
import copy
import time

from attn.experiments import config as config_lib
from attn.experiments import train


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("config", nargs="?", default="configs/quick.toml")
  p.add_argument("--seeds", type=int, default=4)
  p.add_argument("--steps", type=int, default=100)
  p.add_argument("--set", action="append", default=[], dest="overrides")
  args = p.parse_args()
  sweep = config_lib.load(args.config, [f"train.steps={args.steps}", *args.overrides])
  base = sweep.trials[0].config
  configs = []
  for s in range(args.seeds):
    c = copy.deepcopy(base)
    c["train"]["seed"] = s
    configs.append(c)
  print(f"model {base['model']['variant']} h={base['model']['num_heads']} d_model={base['model']['d_model']}, "
        f"{args.seeds} seeds, {args.steps} steps")
  for vmap in (False, True, False, True):  # twice each: the second pass has a warm compilation cache
    t0 = time.perf_counter()
    out = train.train_group(configs, lambda i, r: None, vmap=vmap)
    wall = time.perf_counter() - t0
    per_seed_step = (out[0]["step_time_s_median"] / args.seeds if vmap
                     else sum(o["step_time_s_median"] for o in out) / args.seeds)
    print(f"vmap={vmap!s:5}  step time per seed {per_seed_step * 1e3:7.2f} ms  "
          f"train {sum({o['train_s'] for o in out}):6.2f} s  wall (with compile) {wall:6.2f} s")


if __name__ == "__main__":
  main()
