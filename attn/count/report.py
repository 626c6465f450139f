"""`attn count`'s reports as data: a layer (and its preset model), a preset group, a checkpoint's config;
`count` picks one from the command's options and returns it rendered (attn.count.tables). The models
of a sweep config are counted a layer up, where configs are read (attn.experiments.running.model_counts).
Every figure comes from attn.count's layer and model functions.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from attn.api import get_variant
from attn.config import ConfigError, HeadConfig
from attn.count import hf as count_hf, layer as count_layer, model as count_model, presets, selectors
from attn.variants import mechanisms

@dataclasses.dataclass(frozen=True)
class Request:
  """What `attn count` was asked: one of a sweep config, a checkpoint's config, a preset (group) or a layer.

  head: HeadConfig fields set by flags; model: a preset's layer schedule (positional, global_every,
  sliding_rope_theta, layer_types, kv_source); fmt: markdown, csv or json.
  """

  config: str | None = None
  cases: tuple[str, ...] = ()
  overrides: tuple[str, ...] = ()
  preset: str | None = None
  hf: str | None = None
  head: dict[str, Any] = dataclasses.field(default_factory=dict)
  model: dict[str, Any] = dataclasses.field(default_factory=dict)
  variants: tuple[str, ...] = ()
  mechanisms: bool = False
  seq_len: int = 128
  kv_len: int | None = None
  dtype: Any = count_model.DTYPE
  fmt: str = "markdown"


def table3_report() -> dict[str, Any]:
  """Rows of Table 3 (paper vs ours) and the vocabulary intervals that explain them."""
  rows, ranges = [], {}
  for p in presets.TABLE3:
    m = p.config
    rows.append({"row": p.label, "num_layers": m.num_layers, "d_model": m.d_model,
                 "d_ff": m.d_ff, "num_heads": m.num_heads, "d_k": m.d_k, "d_v": m.d_v,
                 "paper_millions": p.published, "ours": p.count,
                 "ours_millions": round(p.count / 1e6, 1), "match": p.matches()})
    ranges[p.label] = presets.vocab_range(p)
  matched = [p for p in presets.TABLE3 if p.matches()]
  base = presets.TABLE3[0]
  return {"rows": rows, "vocab_size": presets.VASWANI_VOCAB,
          "consistent_vocab": _common_range(matched),
          "consistent_vocab_separate_tables": _common_range([dataclasses.replace(
              p, config=p.config.replace(share_src_tgt_embeddings=False)) for p in matched]),
          "base_at_37000": count_model.model_param_count(base.config.replace(vocab_size=37_000),
                                                         base.kind),
          "unmatched": {r["row"]: list(ranges[r["row"]]) for r in rows if not r["match"]}}


def _common_range(rows: list[presets.Preset]) -> list[int]:
  ranges = [presets.vocab_range(p) for p in rows]
  return [max(lo for lo, _ in ranges), min(hi for _, hi in ranges)]


def published_report(names: list[str]) -> list[dict[str, Any]]:
  """One row per preset: its sizes, the published count and ours."""
  rows = []
  for name in names:
    p = presets.get_preset(name)
    m = p.config
    rows.append({"row": name, "kind": p.kind, "num_layers": m.num_layers, "d_model": m.d_model,
                 "num_heads": m.num_heads, "d_ff": m.d_ff, "vocab_size": m.vocab_size,
                 "published": p.published, "ours": p.count, "match": p.matches()})
  return rows


def layer_report(cfg: HeadConfig, req: Request, preset: presets.Preset | None = None) -> dict[str, Any]:
  """Every variant's figures at cfg (and a key selection's, the mechanisms', a preset's whole model)."""
  variants = [get_variant(v).name for v in req.variants] if req.variants else None
  mechanisms.check(cfg)  # a mechanism's option refused by name, once, before any row
  rows = count_layer.layer_table(cfg, req.seq_len, req.kv_len, req.dtype, variants)
  failed = {r["variant"]: r["plugin_error"] for r in rows if "plugin_error" in r}
  rows = [r for r in rows if "plugin_error" not in r]
  refused = [r for r in rows if "error" in r]
  if rows and len(refused) == len(rows):  # nothing to print: the config itself is at fault
    reasons = list(dict.fromkeys(r["error"] for r in refused))
    raise ConfigError(reasons[0] if len(reasons) == 1 else "every variant refuses this layer: "
                      + "; ".join(f"{r['variant']}: {r['error']}" for r in refused))
  S = req.seq_len if req.kv_len is None else req.kv_len
  report: dict[str, Any] = {"layer": cfg.to_dict(), "T": req.seq_len, "S": S,
                            "dtype": req.dtype, "rows": rows, "plugin_errors": failed}
  ok = [r["variant"] for r in rows if "error" not in r]
  if mechanisms.selector(cfg) is not None:  # a key selection: its own cost and the core's at its keys
    report["selection"] = selectors.selection_row(cfg, req.seq_len)
  if ok and req.mechanisms:
    report["mechanisms_of"] = "per_head" if "per_head" in ok else ok[0]
    report["mechanisms"] = count_layer.mechanism_table(report["mechanisms_of"], cfg, req.seq_len,
                                                       req.dtype)
  if preset is not None:
    m, kind = preset.config, preset.kind
    report["model"] = {
        "preset": preset.name, "kind": kind, "variant": m.variant, "source": preset.source,
        "published": preset.published, "in_millions": preset.in_millions,
        "modified": bool(req.head or req.model),
        "count": count_model.model_param_count(m, kind),
        "active_per_token": count_model.active_param_count(m, kind),
        "breakdown": count_model.model_param_breakdown(m, kind),
        "layer_types": count_model.layer_type_table(m, kind, req.seq_len, req.dtype)}
    for row in rows:
      if "error" not in row:
        try:  # a variant the model's settings refuse (mla cannot share keys and values: kv_source) has none
          row["model_params"] = count_model.model_param_count(m.replace(variant=row["variant"]), kind)
        except ConfigError:
          row["model_params"] = None
  return report


def context_lengths(hf: dict[str, Any], wanted: tuple[int, ...]) -> tuple[tuple[int, ...], list[int], int | None]:
  """(the lengths within the checkpoint's context, plus the context itself where some are past it; those
  past it; the context) for the KV-cache columns. A config naming no context keeps every length."""
  context = next((hf[k] for k in ("max_position_embeddings", "n_positions")
                  if isinstance(hf.get(k), int) and not isinstance(hf.get(k), bool)), None)
  wanted = tuple(dict.fromkeys(wanted))
  if context is None:
    return wanted, [], None
  past = [L for L in wanted if L > context]
  kept = [L for L in wanted if L <= context] + ([context] if past else [])
  return tuple(dict.fromkeys(kept)), past, context


def check_config_request(req: Request) -> None:
  """CONFIG (a sweep config) goes with --case, --set and --dtype only; --case and --set only with CONFIG."""
  if req.config is not None:
    if req.preset or req.hf or req.head or req.model or req.variants or req.mechanisms:
      raise ConfigError(f"CONFIG={req.config!r} is not allowed with --preset, --hf, dimension, variant or "
                        "mechanism flags: it counts the models the config's trials train (change them with --set)")
  elif req.cases or req.overrides:
    flag = "--case" if req.cases else "--set"
    raise ConfigError(f"{flag}={(req.cases or req.overrides)[0]!r} is not allowed without CONFIG: it picks or "
                      "changes a sweep config's trials (attn count CONFIG --case NAME)")


def count(req: Request) -> tuple[str, dict[str, str]]:
  """The report req asks for, rendered (attn.count.tables); (text, {variant: why} for plugins that failed).

  Options that do not go together are refused by name before anything is counted.
  """
  from attn.count import tables
  check_config_request(req)
  if req.config is not None:  # a sweep config's models: attn.experiments.running.model_counts (a layer above)
    raise ConfigError(f"CONFIG={req.config!r} is counted by attn.experiments.running.model_counts.config_rows")
  if req.hf is not None:
    if req.preset or req.head or req.model or req.variants or req.mechanisms:
      raise ConfigError(f"--hf={req.hf!r} is not allowed with --preset, dimension, variant or mechanism "
                        "flags: it counts the checkpoint's config as it is")
    hf, where = count_hf.read_hf_config(req.hf)
    lengths, past, context = context_lengths(hf, (8192, 131072, req.seq_len))
    report = count_hf.hf_report(hf, where, lengths, req.dtype)
    if past:
      report["notes"] = [*report["notes"], f"KV cache at {' and '.join(f'{L:,}' for L in past)} tokens left out: "
                         f"past the model's context of {context:,} (max_position_embeddings); shown at {context:,}"]
    return tables.hf_output(report, req.fmt), {}
  if req.preset in presets.GROUPS:
    if req.head or req.variants:
      raise ConfigError(f"preset={req.preset!r} is not allowed with dimension or variant "
                        "flags: it prints the paper's fixed rows")
    if req.preset == "vaswani-table3":
      return tables.table3_output(table3_report(), req.fmt), {}
    return tables.published_output(published_report(presets.GROUPS[req.preset]), req.fmt), {}
  preset = presets.get_preset(req.preset) if req.preset else None
  if req.model and preset is None:
    raise ConfigError(f"{next(iter(req.model))} is not allowed without --preset: it sets a "
                      "whole model's layer schedule")
  if preset is not None:
    preset = dataclasses.replace(preset, config=preset.config.replace(**(req.head | req.model)))
    cfg = preset.config.head
  else:
    cfg = HeadConfig(**{"d_model": 512, "num_heads": 8, **req.head})
  report = layer_report(cfg, req, preset)
  return tables.layer_output(report, req.fmt), report["plugin_errors"]
