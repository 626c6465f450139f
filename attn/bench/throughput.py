"""Sweep throughput (`attn bench --sweep`): trials per minute of one trial over seeds, sequential and under vmap.

Without a CONFIG it measures SWEEP_FILE (configs/bench_layer.toml): the runner's model and task,
d_model 64, 2 layers, h = 1, per_head, 8-pair MQAR (the first trial of configs/quick.toml),
read from the repository whatever the current directory; it is named "builtin" in the output.
"""

from __future__ import annotations

import json
import os
import statistics
import time
import tomllib
from typing import Any

from attn.config import ConfigError, invalid

SWEEP_CONFIG = "builtin"
SWEEP_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                          "configs", "bench_layer.toml")


def builtin_text(path: str | None = None) -> str:
  """The built-in sweep's TOML (SWEEP_FILE), read and parsed here so that a missing or broken file is named."""
  path = path or SWEEP_FILE
  try:
    with open(path, encoding="utf-8") as f:
      text = f.read()
    tomllib.loads(text)
  except OSError as e:
    raise ConfigError(f"--sweep's built-in config {path!r} is not allowed: it cannot be read ({e.strerror}); "
                      "`attn bench --sweep` reads it from the repository's configs/ (or give --sweep CONFIG)") from None
  except tomllib.TOMLDecodeError as e:
    raise ConfigError(f"--sweep's built-in config {path!r} is not allowed: not valid TOML ({e})") from None
  return text


def sweep_throughput(config_path: str, seeds: int, steps: int | None, rounds: int = 1) -> dict[str, Any]:
  """Trials per minute of the config's first trial over `seeds` seeds: one by one, and under vmap.

  Both go through the runner's train_group, compile included (the runner
  compiles once per shape, so a sweep pays it once per group), with the
  persistent compilation cache the runner turns on. With rounds > 1 the two
  alternate, the order flipped each round (sequential, vmap, vmap, sequential,
  ...) so that a change of load hits both; the figures are medians over rounds.
  """
  from attn.experiments.running import config as config_lib
  from attn.experiments.training import train
  for field, value in (("--sweep-seeds", seeds), ("--sweep-steps", steps), ("--sweep-rounds", rounds)):
    if value is not None and (isinstance(value, bool) or value < 1):
      raise invalid(field, value, "a positive integer")
  if config_path == SWEEP_CONFIG:
    trial = config_lib.loads(builtin_text(), "builtin").trials[0]
  else:
    trial = config_lib.load(config_path).trials[0]
  configs = []
  for s in range(seeds):
    c = json.loads(json.dumps(trial.config))
    c["train"]["seed"] = s
    if steps is not None:
      c["train"]["steps"] = steps
    configs.append(c)
  cache = train.enable_compilation_cache()
  label = {k: v for k, v in trial.label.items() if k != "train.seed"}
  out = {"config": config_path, "trial": label, "seeds": seeds,
         "steps": configs[0]["train"]["steps"], "compilation_cache": cache, "rounds": []}
  modes = (("sequential", False), ("vmap", True))
  for r in range(rounds):
    this = {}
    for mode, vmap in modes if r % 2 == 0 else modes[::-1]:
      t0, c0 = time.perf_counter(), time.process_time()
      summaries = train.train_group(configs, on_row=lambda i, row: None, vmap=vmap)
      wall, cpu = time.perf_counter() - t0, time.process_time() - c0
      per_group = len(summaries) if vmap else 1  # under vmap every summary holds the group's times
      this[mode] = {"wall_s": wall, "cpu_s": cpu,  # cpu: user + sys of this process's threads
                    "compile_s": float(sum(s_.get("compile_s", 0.0) for s_ in summaries) / per_group),
                    "train_s": float(sum(s_.get("train_s", 0.0) for s_ in summaries) / per_group),
                    "status": sorted({s_["status"] for s_ in summaries}),
                    "loadavg": list(os.getloadavg())}
    out["rounds"].append(this)
  for mode, _ in modes:
    med = lambda key: statistics.median(r_[mode][key] for r_ in out["rounds"])
    wall, train_s = med("wall_s"), med("train_s")
    out[mode] = {"wall_s": wall, "cpu_s": med("cpu_s"), "trials_per_minute": 60 * seeds / wall,
                 "compile_s": med("compile_s"),
                 "train_s": train_s, "steady_trials_per_minute": 60 * seeds / max(train_s, 1e-9),
                 "walls_s": [r_[mode]["wall_s"] for r_ in out["rounds"]],
                 "cpus_s": [r_[mode]["cpu_s"] for r_ in out["rounds"]],
                 "status": sorted({x for r_ in out["rounds"] for x in r_[mode]["status"]})}
  out["vmap_speedup"] = out["sequential"]["wall_s"] / out["vmap"]["wall_s"]
  return out
