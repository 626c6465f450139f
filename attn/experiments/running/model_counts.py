"""The models a sweep config's trials train, counted (`attn count CONFIG`): the runner's own resolution of the
config (attn.experiments.running.config) and attn.count's model figures."""

from __future__ import annotations

import json
from typing import Any

from attn.config import ConfigError
from attn.count import model as count_model


def config_rows(path: str, overrides: list[str] | None = None, cases: list[str] | None = None,
                dtype: Any = count_model.DTYPE) -> list[dict[str, Any]]:
  """One row per distinct model the trials of sweep config `path` train (seeds share one), in trial order:
  its label (the sweep's axes but the seed), trials, parameters, attention parameters, and, for a decoder,
  KV cache per token, state per sequence and both at the task's length T. The trials are
  attn.experiments.running.config's, the runner's own resolution, so these are the models that train."""
  from attn.experiments.data import tasks
  from attn.experiments.running import config as config_lib
  from attn.nn.config import ModelConfig
  sweep = config_lib.load(path, overrides or [])
  trials = sweep.trials
  if cases:
    names = list(dict.fromkeys(t.label.get(config_lib.CASE) for t in trials))
    if names == [None]:
      raise ConfigError(f"--case={cases[0]!r} is not allowed: {path} has no sweep.cases")
    for c in cases:
      if c not in names:
        raise ConfigError(f"--case={c!r} is not allowed: one of {names} (the cases of {path})")
    trials = [t for t in trials if t.label.get(config_lib.CASE) in cases]
  rows: dict[str, dict[str, Any]] = {}
  for t in trials:
    key = json.dumps({k: v for k, v in t.config.items() if k != "train"}, sort_keys=True, default=str)
    if key in rows:
      rows[key]["trials"] += 1
      continue
    kind = tasks.TASKS[t.config["task"]["name"]].kind
    m, T = ModelConfig(**t.config["model"]), t.config["task"].get("seq_len")
    name = ", ".join(f"{config_lib.axis_name(k)}={config_lib.show(v)}" for k, v in t.label.items()
                     if k != "train.seed") or "the base config"
    row = {"model": name, "trials": 1, "kind": kind, "params": count_model.model_param_count(m, kind),
           "attention": count_model.model_param_breakdown(m, kind)["attention"], "T": T, "dtype": str(dtype)}
    if kind in ("decoder_lm", "encoder_decoder"):
      row["kv_bytes_per_token"] = count_model.model_kv_cache_bytes_per_token(m, kind, dtype)
      row["state_bytes"] = count_model.model_state_bytes(m, kind, dtype)
      row["kv_bytes_at_T"] = count_model.model_kv_cache_bytes(m, kind, T, dtype)
      row["held_at_T"] = row["kv_bytes_at_T"] + row["state_bytes"]
    rows[key] = row
  return list(rows.values())


def count_config(req) -> str:
  """`attn count CONFIG`'s table: req (attn.count.report.Request) names the config, its cases and --set."""
  from attn.count import report, tables
  report.check_config_request(req)
  rows = config_rows(req.config, list(req.overrides), list(req.cases) or None, req.dtype)
  return tables.config_output(req.config, list(req.overrides), req.dtype, rows, req.fmt)
