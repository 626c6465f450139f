"""`attn count`: parameter counts (analytic, stored, effective), FLOPs and KV cache per variant.

  attn count                                  # one layer, d_model=512, h=8, d_k=d_v=64
  attn count --d-model 512 --num-heads 8 --num-kv-heads 2 --format csv
  attn count --preset bert-base               # whole model + its layer, every variant
  attn count --preset vaswani-table3          # Table 3 params column, paper vs ours
  attn count --preset bert-gpt2               # BERT and GPT-2 totals, published vs ours
  attn count --variant mla --latent-dim 128 --rope-dim 32   # MLA's cache: d_c + rope_dim
  attn count --mechanisms --seq-len 4096 --window 512  # what gates, sinks, QK-norm, windows add
  attn count --preset gpt2 --window 512 --global-every 4 --seq-len 8192  # per layer type at L
  attn count --preset gpt2 --kv-source 0,1,2,3,4,5,6,7,8,9,9,9 --seq-len 8192  # the last 3 layers share
  attn count --hf ./my-checkpoint --format json  # a checkpoint's config.json by component (no weights read)
  attn count --hf gpt-oss-20b                    # a stored published config (attn/count/hf_configs)
  attn count configs/quick.toml                  # the models a sweep's trials train, as `attn sweep` resolves them
  attn count CONFIG --case hybrid --set model.d_model=128   # one case of it, with the sweep's --set

Byte counts are in float32 unless --dtype says otherwise (count.model.DTYPE, the whole counting API's default:
what attn's models train and decode in, and what reports count in).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import io
import json
import sys
import tomllib
from typing import Any

from attn.count import (hf as count_hf, layer as count_layer, measured, model as count_model, presets,
                        selectors)
from attn.api import get_variant
from attn.config import ConfigError, HeadConfig
from attn.variants import mechanisms
from attn.variants.mechanisms import MECHANISMS

# Every HeadConfig field is a flag: --d-k 64, --rope-theta 1e6, --no-use-bias (a field true by
# default), --sinks (false by default); typed by its annotation, checked by HeadConfig.
_HEAD_FIELDS = {f.name: f for f in dataclasses.fields(HeadConfig)}
_ARG_TYPES = {"int": int, "float": float, "str": str, "dict": lambda text: _toml_table(text)}
_LAYER_COLUMNS = [
    ("variant", "variant"), ("analytic", "params (analytic)"), ("stored", "params (stored)"),
    ("effective", "params (effective)"), ("score_weights", "W_Q·W_Kᵀ weights"),
    ("score_weights_per_head", "W_Q·W_Kᵀ weights/head"), ("flops_fwd", "FLOPs fwd"),
    ("flops_fwd_bwd", "FLOPs fwd+bwd"), ("kv_bytes_per_token", "KV cache B/token"),
    ("kv_bytes_at_T", "KV cache B at T"), ("state_bytes", "state B/sequence"),
    ("state_crossover_T", "KV cache = state at T")]
_STATE_KEYS = ("state_bytes", "state_crossover_T")
_MECHANISM_COLUMNS = [
    ("mechanism", "mechanism"), ("params_formula", "adds params"), ("params", "="),
    ("flops_formula", "adds FLOPs fwd"), ("flops_fwd", "="), ("kv_cache_bytes", "KV cache B at T")]
_SELECTION_COLUMNS = [
    ("selector", "selector"), ("params", "params"), ("selector_flops", "selector FLOPs fwd"),
    ("keys_per_query", "keys/query"), ("core_flops", "core FLOPs fwd"),
    ("full_core_flops", "full causal core"), ("core_vs_full", "× full")]
_TABLE3_COLUMNS = [
    ("row", "row"), ("num_layers", "N"), ("d_model", "d_model"), ("d_ff", "d_ff"),
    ("num_heads", "h"), ("d_k", "d_k"), ("d_v", "d_v"), ("paper_millions", "paper (×10⁶)"),
    ("ours", "ours"), ("ours_millions", "ours (×10⁶)"), ("match", "match")]

_LAYER_TYPE_COLUMNS = [
    ("type", "layer type"), ("variant", "variant"), ("layers", "layers"),
    ("kv_shared_layers", "reading another's KV"), ("window", "window"), ("rope_theta", "RoPE base"),
    ("params", "params"), ("flops_fwd", "FLOPs fwd at L"), ("kv_bytes_per_token_per_layer", "KV B/token/layer"),
    ("kv_bytes_at_L", "KV cache B at L")]
# Model settings of a preset that a flag changes: the layer schedule (attn.nn.layer_types).
_MODEL_FLAGS = {"positional": str, "global_every": int, "sliding_rope_theta": float,
                "layer_types": lambda text: tuple(t.strip() for t in text.split(",")),
                "kv_source": lambda text: tuple(int(t) for t in text.split(","))}

_PUBLISHED_COLUMNS = [
    ("row", "preset"), ("kind", "model"), ("num_layers", "layers"), ("d_model", "d_model"),
    ("num_heads", "h"), ("d_ff", "d_ff"), ("vocab_size", "vocab"), ("published", "published"),
    ("ours", "ours"), ("match", "match")]


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("config", nargs="?", default=None, metavar="CONFIG",
                      help="a sweep config (TOML): count the model each of its trials trains, resolved as "
                      "`attn sweep` resolves it (derived d_k, d_v, d_ff and defaults included)")
  parser.add_argument("--case", action="append", default=None, metavar="NAME",
                      help="with CONFIG: only this case of its sweep.cases (repeatable)")
  parser.add_argument("--set", metavar="KEY=VALUE", action="append", default=[], dest="overrides",
                      help="with CONFIG: override a config key as `attn sweep --set` does (repeatable)")
  parser.add_argument("--preset", help="a whole model: " + ", ".join(
      sorted(presets.PRESETS) + sorted(presets.GROUPS)))
  for name, f in _HEAD_FIELDS.items():
    flag = name.replace("_", "-")
    kind = [n.strip() for n in str(f.type).split("|") if n.strip() != "None"][0]
    if name == "qk_norm":  # --qk-norm: per head; whole: over the whole projection (OLMo 2); fixed: no scale
      parser.add_argument("--qk-norm", dest=name, nargs="?", const=True, default=None, metavar="whole|fixed")
    elif name == "extra":  # an outside head mechanism's options, as [model.extra.NAME] in a config
      outside = sorted(n for n, m in MECHANISMS.items() if not m.fields)
      parser.add_argument("--extra", dest=name, type=_ARG_TYPES["dict"], default=None, metavar="TABLE",
                          help="options of outside head mechanisms as a TOML inline table, e.g. "
                          "'{NAME = {OPTION = VALUE}}' (installed: " + (", ".join(outside) or "none") + ")")
    elif kind == "bool":
      parser.add_argument(f"--no-{flag}" if f.default else f"--{flag}", dest=name,
                          action="store_const", const=not f.default, default=None)
    else:
      parser.add_argument(f"--{flag}", dest=name, type=_ARG_TYPES[kind], default=None)
  parser.add_argument("--no-bias", dest="use_bias", action="store_const", const=False,
                      help="layers without biases (--no-use-bias)")
  for name, kind in _MODEL_FLAGS.items():
    parser.add_argument("--" + name.replace("_", "-"), dest=name, type=kind, default=None,
                        help="with --preset: the model's " + name + (" (comma-separated, one per layer)"
                                                                     if name in ("layer_types", "kv_source") else ""))
  parser.add_argument("--hf", metavar="DIR", default=None,
                      help="a Hugging Face checkpoint directory (config.json only is enough) or a stored "
                      "published config (" + ", ".join(count_hf.stored_configs()) + "): parameters by "
                      "component, active per token, KV cache per layer type at 8k, 128k and --seq-len "
                      "(those within the model's max_position_embeddings; past it, at that context)")
  parser.add_argument("--seq-len", type=int, default=128, help="query length T for FLOPs (L for KV caches)")
  parser.add_argument("--kv-len", type=int, default=None, help="key length S (default T)")
  parser.add_argument("--dtype", default=count_model.DTYPE, help=f"dtype of KV-cache and state bytes (default {count_model.DTYPE})")
  parser.add_argument("--variant", action="append", default=None,
                      help="only this variant (repeatable; default all)")
  parser.add_argument("--mechanisms", action="store_true",
                      help="also what each head mechanism adds: " + "; ".join(
                          m.help or m.name for m in MECHANISMS.values()))
  parser.add_argument("--format", choices=("markdown", "csv", "json"), default="markdown")


def _toml_table(text: str) -> dict[str, Any]:
  """--extra '{my_gate = {width = 3}}': a TOML inline table (HeadConfig.extra)."""
  try:
    return tomllib.loads(f"v = {text}")["v"]
  except tomllib.TOMLDecodeError as e:
    raise argparse.ArgumentTypeError(f"not a TOML inline table ({e})") from None


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
  return {n: getattr(args, n) for n in _HEAD_FIELDS if getattr(args, n) is not None}


def _model_overrides(args: argparse.Namespace) -> dict[str, Any]:
  return {n: getattr(args, n) for n in _MODEL_FLAGS if getattr(args, n, None) is not None}


NOT_DEFINED = "—"  # a figure with no value at this layer (an effective count too large to measure)


def _fmt(value: Any) -> str:
  if value is None:
    return NOT_DEFINED
  if isinstance(value, bool):
    return "yes" if value else "**no**"
  if isinstance(value, float):
    return f"{value:,.1f}"
  if isinstance(value, int):
    return f"{value:,}"
  return str(value)


def markdown(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> str:
  """A markdown table; rows with an "error" show it in place of their numbers, and the cells a row
  lists under "measured" (no closed form; attn.count) say so; a None cell (nothing measured) is —."""
  lines = ["| " + " | ".join(title for _, title in columns) + " |",
           "|---|" + "---:|" * (len(columns) - 1)]
  for row in rows:
    if "error" in row:
      cells = [row[columns[0][0]], f"n/a: {row['error']}"] + [""] * (len(columns) - 2)
    else:
      cells = [_fmt(row.get(k, "")) + (" (measured)" if k in row.get("measured", ())
                                        and row.get(k) is not None else "") for k, _ in columns]
    lines.append("| " + " | ".join(str(c) for c in cells) + " |")
  return "\n".join(lines)


def _csv(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> str:
  out = io.StringIO()
  keys = [k for k, _ in columns] + [k for k in ("error", "measured") if any(k in r for r in rows)]
  writer = csv.DictWriter(out, fieldnames=keys, extrasaction="ignore", lineterminator="\n")
  writer.writeheader()
  writer.writerows([{**r, "measured": " ".join(r["measured"])} if "measured" in r else r for r in rows])
  return out.getvalue().rstrip("\n")


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


def _group(name: str, fmt: str) -> str:
  if name == "vaswani-table3":
    return _table3(fmt)
  rows = published_report(presets.GROUPS[name])
  if fmt == "json":
    return json.dumps(rows, indent=2)
  return (_csv if fmt == "csv" else markdown)(rows, _PUBLISHED_COLUMNS)


def _table3(fmt: str) -> str:
  report = table3_report()
  if fmt == "json":
    return json.dumps(report, indent=2)
  if fmt == "csv":
    return _csv(report["rows"], _TABLE3_COLUMNS)
  lo, hi = report["consistent_vocab"]
  notes = [f"Shared source/target vocabulary with tied output, V = {report['vocab_size']:,}; "
           f"every matched row rounds to the paper for V in [{lo:,}, {hi:,}]."]
  lo, hi = report["consistent_vocab_separate_tables"]
  notes.append(f"Separate source and target tables (target tied to the output) match for "
               f"V in [{lo:,}, {hi:,}] each. With the paper's \"about 37000\" shared, base has "
               f"{report['base_at_37000']:,}.")
  for row, (a, b) in report["unmatched"].items():
    notes.append(f"Row {row!r} would need V in [{a:,}, {b:,}]: no single V matches it too.")
  return markdown(report["rows"], _TABLE3_COLUMNS) + "\n\n" + "\n".join(notes)


def _layer_report(cfg: HeadConfig, args: argparse.Namespace,
                  preset: presets.Preset | None) -> dict[str, Any]:
  variants = [get_variant(v).name for v in args.variant] if args.variant else None
  mechanisms.check(cfg)  # a mechanism's option refused by name, once, before any row
  rows = count_layer.layer_table(cfg, args.seq_len, args.kv_len, args.dtype, variants)
  failed = {r["variant"]: r["plugin_error"] for r in rows if "plugin_error" in r}
  rows = [r for r in rows if "plugin_error" not in r]
  refused = [r for r in rows if "error" in r]
  if rows and len(refused) == len(rows):  # nothing to print: the config itself is at fault
    reasons = list(dict.fromkeys(r["error"] for r in refused))
    raise ConfigError(reasons[0] if len(reasons) == 1 else "every variant refuses this layer: "
                      + "; ".join(f"{r['variant']}: {r['error']}" for r in refused))
  S = args.seq_len if args.kv_len is None else args.kv_len
  report: dict[str, Any] = {"layer": cfg.to_dict(), "T": args.seq_len, "S": S,
                            "dtype": args.dtype, "rows": rows, "plugin_errors": failed}
  ok = [r["variant"] for r in rows if "error" not in r]
  if mechanisms.selector(cfg) is not None:  # a key selection: its own cost and the core's at its keys
    report["selection"] = selectors.selection_row(cfg, args.seq_len)
  if ok and args.mechanisms:
    report["mechanisms_of"] = "per_head" if "per_head" in ok else ok[0]
    report["mechanisms"] = count_layer.mechanism_table(report["mechanisms_of"], cfg, args.seq_len,
                                                       args.dtype)
  if preset is not None:
    m, kind = preset.config, preset.kind
    report["model"] = {
        "preset": preset.name, "kind": kind, "variant": m.variant, "source": preset.source,
        "published": preset.published, "in_millions": preset.in_millions,
        "modified": bool(_overrides(args) or _model_overrides(args)),
        "count": count_model.model_param_count(m, kind),
        "active_per_token": count_model.active_param_count(m, kind),
        "breakdown": count_model.model_param_breakdown(m, kind),
        "layer_types": count_model.layer_type_table(m, kind, args.seq_len, args.dtype)}
    for row in rows:
      if "error" not in row:
        try:  # a variant the model's settings refuse (mla cannot share keys and values: kv_source) has none
          row["model_params"] = count_model.model_param_count(m.replace(variant=row["variant"]), kind)
        except ConfigError:
          row["model_params"] = None
  return report


def _layer_output(report: dict[str, Any], fmt: str) -> str:
  columns = _LAYER_COLUMNS + ([("model_params", "model params")] if "model" in report else [])
  # the state's columns only where a row has a state (a fixed-state head; attn.variants.linear)
  columns = [c for c in columns if c[0] not in _STATE_KEYS or any(c[0] in r for r in report["rows"])]
  if fmt == "json":
    return json.dumps(report, indent=2)
  if fmt == "csv":
    return _csv(report["rows"], columns)
  c = report["layer"]
  head = (f"One attention layer: d_model={c['d_model']}, h={c['num_heads']}, d_k={c['d_k']}, "
          f"d_v={c['d_v']}, kv heads={c['num_kv_heads']}, bias={c['use_bias']}; FLOPs per "
          f"sequence for T={report['T']}, S={report['S']}; KV cache in {report['dtype']}.")
  if c["rope_dim"]:
    head = head[:-1] + f"; RoPE on the first {c['rope_dim']} dims of each head."
  defaults = {f.name: f.default for f in dataclasses.fields(HeadConfig)}
  on = {f: c[f] for m in MECHANISMS.values() for f in m.fields if c.get(f) != defaults[f]}
  if on or c.get("extra"):
    options = [f"{k}={v}" for k, v in on.items()] + [
        f"{name}.{k}={v}" for name, opts in (c.get("extra") or {}).items()
        for k, v in mechanisms.options(HeadConfig(**c), name).items()] + [
        f"{name} (no options)" for name, opts in (c.get("extra") or {}).items()
        if not mechanisms.options(HeadConfig(**c), name)]
    head = head[:-1] + "; mechanisms: " + ", ".join(options) + "."
  if any(r["variant"] == "mla" and "error" not in r for r in report["rows"]):
    q = c["q_latent_dim"]
    head += (f" mla: KV latent d_c={c['latent_dim']}"
             + (f", query latent {q}" if q else "") + f"; caches d_c + rope_dim = "
             f"{c['latent_dim'] + c['rope_dim']} elements per token.")
  text = head + "\n\n" + markdown(report["rows"], columns) + _unmeasured(report)
  if "selection" in report:
    text += (f"\n\nKey selection at T={report['T']} causal queries (S = T): the selector's parameters and "
             "forward FLOPs, keys a query attends to, the attention core's FLOPs with it and with full "
             "causal attention (2·H·(K+V) a pair; attn.count.selectors):\n\n"
             + markdown([report["selection"]], _SELECTION_COLUMNS))
  if "mechanisms" in report:
    text += (f"\n\nWhat each head mechanism adds to one {report['mechanisms_of']} layer (b = 1 with "
             f"biases; T={report['T']}; a window keeps its last `window` tokens in the cache):\n\n"
             + markdown(report["mechanisms"], _MECHANISM_COLUMNS))
  if "model" in report:
    m = report["model"]
    parts = [{"component": k, "params": v} for k, v in m["breakdown"].items() if v]
    parts.append({"component": "total", "params": m["count"]})
    published = f"{m['published']}M" if m["in_millions"] else f"{m['published']:,}"
    active = f" ({m['active_per_token']:,} active per token)" if m["active_per_token"] != m["count"] else ""
    text = (f"Model {m['preset']} ({m['kind']}, {m['variant']} attention): {m['count']:,} "
            f"parameters{active}; published {published} ({m['source']})"
            + (" for the preset before the flags changed it" if m["modified"] else "") + ".\n\n"
            + markdown(parts, [("component", "component"), ("params", "params")])
            + f"\n\nAttention by layer type at L={report['T']} (KV cache in {report['dtype']}):\n\n"
            + markdown(m["layer_types"], _LAYER_TYPE_COLUMNS) + "\n\n" + text)
  return text


def _unmeasured(report: dict[str, Any]) -> str:
  """A note for effective counts left out (—): which mechanism lacks a closed form, and what to declare."""
  rows = [r for r in report["rows"] if "error" not in r and r.get("effective") is None]
  if not rows:
    return ""
  cfg = HeadConfig(**report["layer"])
  lacking = [m.name for m in mechanisms.active(cfg) if m.effective_param_count is None]
  if lacking:
    why = f"mechanism {', '.join(map(repr, lacking))} declares no effective_param_count"
    fix = "; a mechanism that adds no degree of freedom declares effective_param_count=lambda cfg: 0 (docs/extending.md)"
  else:
    why, fix = "the variant declares no closed form", ""
  return (f"\n\nparams (effective) left out (—) for {', '.join(r['variant'] for r in rows)}: {why}, and a layer of "
          f"more than {measured.JACOBIAN_MAX_PARAMS:,} parameters is too large to measure it (the Jacobian's rank)"
          + fix)


_HF_COLUMNS = [("type", "layer type"), ("variant", "variant"), ("layers", "layers"),
               ("kv_shared_layers", "reading another's KV"), ("window", "window"), ("rope_theta", "RoPE base"),
               ("params_per_layer", "params/layer"), ("params", "params"),
               ("score_weights_per_layer", "W_Q·W_Kᵀ weights/layer"),
               ("kv_bytes_per_token_per_layer", "KV B/token/layer")]


def _hf_output(report: dict[str, Any], fmt: str) -> str:
  if fmt == "json":
    return json.dumps(report, indent=2)
  rows = [{"component": k, "params": v} for k, v in report["breakdown"].items()]
  rows.append({"component": "total", "params": report["total"]})
  if fmt == "csv":
    return _csv(rows, [("component", "component"), ("params", "params")])
  lengths = list(report["kv_bytes_at"])
  layers = [{**r, **{f"kv_{L}": r["kv_bytes_at"][L] for L in lengths}} for r in report["layer_types"]]
  layers.append({"type": "total", "layers": report["num_layers"], **{f"kv_{L}": report["kv_bytes_at"][L]
                                                                      for L in lengths}})
  first = next(iter(report["layer_types"][0]["flops_fwd_at"])) if report["layer_types"] else None
  for r in layers[:-1]:
    r["flops_fwd"] = r["flops_fwd_at"][first]
  cols = _HF_COLUMNS + ([("flops_fwd", f"FLOPs fwd at {int(first):,}")] if first else []) + [
      (f"kv_{L}", f"KV cache B at {int(L):,}") for L in lengths]
  return (f"{report['source']} ({report['model_type']}, {report['variant']} attention): {report['total']:,} "
          f"parameters, {report['active_per_token']:,} active per token; attention "
          f"{report['attention_share']:.1%} of the parameters.\n\n"
          + markdown(rows, [("component", "component"), ("params", "params")])
          + f"\n\nAttention by layer type (KV cache in {report['dtype']}):\n\n" + markdown(layers, cols)
          + "".join(f"\n\nNote: {n}." for n in report["notes"]))


def _context_lengths(hf: dict[str, Any], wanted: tuple[int, ...]) -> tuple[tuple[int, ...], list[int], int | None]:
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


_CONFIG_COLUMNS = [
    ("model", "model"), ("trials", "trials"), ("params", "params"), ("attention", "attention params"),
    ("kv_bytes_per_token", "KV cache B/token"), ("state_bytes", "state B/sequence"), ("T", "T"),
    ("held_at_T", "state + KV cache B at T")]


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


def _config_output(args: argparse.Namespace) -> str:
  rows = config_rows(args.config, args.overrides, args.case, args.dtype)
  if args.format == "json":
    return json.dumps({"config": args.config, "overrides": args.overrides, "dtype": args.dtype, "rows": rows},
                      indent=2)
  if args.format == "csv":
    return _csv(rows, _CONFIG_COLUMNS)
  n = sum(r["trials"] for r in rows)
  return (f"The models the {n} trials of {args.config} train ({len(rows)} distinct; seeds share one), as "
          f"`attn sweep` resolves them; bytes in {args.dtype} over all layers, T the task's length "
          "(— : a classifier keeps no decoding cache):\n\n" + markdown(rows, _CONFIG_COLUMNS))


def run(args: argparse.Namespace) -> int:
  """Prints the table; ConfigError (unknown preset, impossible dims) exits 2 via attn.cli."""
  if args.config is not None:
    if args.preset or args.hf or _overrides(args) or _model_overrides(args) or args.variant or args.mechanisms:
      raise ConfigError(f"CONFIG={args.config!r} is not allowed with --preset, --hf, dimension, variant or "
                        "mechanism flags: it counts the models the config's trials train (change them with --set)")
    print(_config_output(args))
    return 0
  if args.case or args.overrides:
    flag = "--case" if args.case else "--set"
    raise ConfigError(f"{flag}={(args.case or args.overrides)[0]!r} is not allowed without CONFIG: it picks or "
                      "changes a sweep config's trials (attn count CONFIG --case NAME)")
  if args.hf is not None:
    if args.preset or _overrides(args) or _model_overrides(args) or args.variant or args.mechanisms:
      raise ConfigError(f"--hf={args.hf!r} is not allowed with --preset, dimension, variant or mechanism "
                        "flags: it counts the checkpoint's config as it is")
    hf, where = count_hf.read_hf_config(args.hf)
    lengths, past, context = _context_lengths(hf, (8192, 131072, args.seq_len))
    report = count_hf.hf_report(hf, where, lengths, args.dtype)
    if past:
      report["notes"] = [*report["notes"], f"KV cache at {' and '.join(f'{L:,}' for L in past)} tokens left out: "
                         f"past the model's context of {context:,} (max_position_embeddings); shown at {context:,}"]
    print(_hf_output(report, args.format))
    return 0
  if args.preset in presets.GROUPS:
    if _overrides(args) or args.variant:
      raise ConfigError(f"preset={args.preset!r} is not allowed with dimension or variant "
                        "flags: it prints the paper's fixed rows")
    print(_group(args.preset, args.format))
    return 0
  preset = presets.get_preset(args.preset) if args.preset else None
  model_changes = _model_overrides(args)
  if model_changes and preset is None:
    raise ConfigError(f"{next(iter(model_changes))} is not allowed without --preset: it sets a "
                      "whole model's layer schedule")
  if preset is not None:
    changes = _overrides(args) | model_changes
    preset = dataclasses.replace(preset, config=preset.config.replace(**changes))
    cfg = preset.config.head
  else:
    cfg = HeadConfig(**{"d_model": 512, "num_heads": 8, **_overrides(args)})
  report = _layer_report(cfg, args, preset)
  print(_layer_output(report, args.format))
  for name, why in report["plugin_errors"].items():  # the built-ins' rows stand; each failed plugin in one line
    print(f"attn count: variant {name!r} left out: {why}", file=sys.stderr)
  asked = {get_variant(v).name for v in args.variant or ()}
  return 1 if asked & set(report["plugin_errors"]) else 0

