"""`attn count`'s tables: the counting reports (attn.count.report) as Markdown, CSV or JSON.

A cell with no value at a layer is NOT_DEFINED; a figure measured for want of a
closed form says so; a row a variant refuses shows the refusal in place of its numbers.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
from typing import Any

from attn.config import HeadConfig
from attn.count import measured
from attn.variants import mechanisms
from attn.variants.mechanisms import MECHANISMS

LAYER_COLUMNS = [
    ("variant", "variant"), ("analytic", "params (analytic)"), ("stored", "params (stored)"),
    ("effective", "params (effective)"), ("score_weights", "W_Q·W_Kᵀ weights"),
    ("score_weights_per_head", "W_Q·W_Kᵀ weights/head"), ("flops_fwd", "FLOPs fwd"),
    ("flops_fwd_bwd", "FLOPs fwd+bwd"), ("kv_bytes_per_token", "KV cache B/token"),
    ("kv_bytes_at_T", "KV cache B at T"), ("state_bytes", "state B/sequence"),
    ("state_crossover_T", "KV cache = state at T")]
STATE_KEYS = ("state_bytes", "state_crossover_T")
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
_PUBLISHED_COLUMNS = [
    ("row", "preset"), ("kind", "model"), ("num_layers", "layers"), ("d_model", "d_model"),
    ("num_heads", "h"), ("d_ff", "d_ff"), ("vocab_size", "vocab"), ("published", "published"),
    ("ours", "ours"), ("match", "match")]


_CONFIG_COLUMNS = [
    ("model", "model"), ("trials", "trials"), ("params", "params"), ("attention", "attention params"),
    ("kv_bytes_per_token", "KV cache B/token"), ("state_bytes", "state B/sequence"), ("T", "T"),
    ("held_at_T", "state + KV cache B at T")]


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


def csv_table(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> str:
  out = io.StringIO()
  keys = [k for k, _ in columns] + [k for k in ("error", "measured") if any(k in r for r in rows)]
  writer = csv.DictWriter(out, fieldnames=keys, extrasaction="ignore", lineterminator="\n")
  writer.writeheader()
  writer.writerows([{**r, "measured": " ".join(r["measured"])} if "measured" in r else r for r in rows])
  return out.getvalue().rstrip("\n")


def published_output(rows: list[dict[str, Any]], fmt: str) -> str:
  """A preset group's published totals against ours (attn.count.report.published_report)."""
  if fmt == "json":
    return json.dumps(rows, indent=2)
  return (csv_table if fmt == "csv" else markdown)(rows, _PUBLISHED_COLUMNS)


def table3_output(report: dict[str, Any], fmt: str) -> str:
  """Vaswani's Table 3, paper against ours, with the vocabulary notes (attn.count.report.table3_report)."""
  if fmt == "json":
    return json.dumps(report, indent=2)
  if fmt == "csv":
    return csv_table(report["rows"], _TABLE3_COLUMNS)
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


def layer_output(report: dict[str, Any], fmt: str) -> str:
  columns = LAYER_COLUMNS + ([("model_params", "model params")] if "model" in report else [])
  # the state's columns only where a row has a state (a fixed-state head; attn.variants.linear)
  columns = [c for c in columns if c[0] not in STATE_KEYS or any(c[0] in r for r in report["rows"])]
  if fmt == "json":
    return json.dumps(report, indent=2)
  if fmt == "csv":
    return csv_table(report["rows"], columns)
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


def hf_output(report: dict[str, Any], fmt: str) -> str:
  if fmt == "json":
    return json.dumps(report, indent=2)
  rows = [{"component": k, "params": v} for k, v in report["breakdown"].items()]
  rows.append({"component": "total", "params": report["total"]})
  if fmt == "csv":
    return csv_table(rows, [("component", "component"), ("params", "params")])
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


def config_output(path: str, overrides: list[str], dtype: Any, rows: list[dict[str, Any]], fmt: str) -> str:
  """The models a sweep config's trials train (attn.count.report.config_rows)."""
  if fmt == "json":
    return json.dumps({"config": path, "overrides": overrides, "dtype": dtype, "rows": rows}, indent=2)
  if fmt == "csv":
    return csv_table(rows, _CONFIG_COLUMNS)
  n = sum(r["trials"] for r in rows)
  return (f"The models the {n} trials of {path} train ({len(rows)} distinct; seeds share one), as "
          f"`attn sweep` resolves them; bytes in {dtype} over all layers, T the task's length "
          "(— : a classifier keeps no decoding cache):\n\n" + markdown(rows, _CONFIG_COLUMNS))
