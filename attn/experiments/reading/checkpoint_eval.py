"""Held-out loss of a pretrained checkpoint, before and after converting its heads (`attn eval`).

The checkpoint is read (attn.nn.hf.from_hf), the text's held-out split scored by
the model's own objective (attn.experiments.reading.losses), and with another
variant or fewer key/value heads the same weights are converted
(attn.nn.hf.convert_model) and scored again on the same tokens. `evaluate_checkpoint`
returns the rows; `markdown` is the table `attn eval` prints.
"""

from __future__ import annotations

import math
import time
import warnings
from typing import Any

from attn.config import invalid
from attn.conversion import LossyConversionWarning
from attn.experiments.reading.losses import (check_checkpoint, describe, evaluate, held_out_batches,
                                             pair_seq_len)


def evaluate_checkpoint(path: str, text: str, variant: str = "per_head", num_kv_heads: int | None = None,
                        max_tokens: int = 4096, seq_len: int = 256, batch_size: int = 8,
                        glob: str | None = None) -> dict[str, Any]:
  """The checkpoint at `path` scored on `text`'s held-out split, and converted where asked (module docstring)."""
  for name, value in (("max_tokens", max_tokens), ("batch_size", batch_size), ("seq_len", seq_len)):
    if value < 1:
      raise invalid("--" + name.replace("_", "-"), value, "an integer >= 1")
  config = check_checkpoint(path)
  from attn.nn import hf
  hf.model_config(config, variant, num_kv_heads)  # a bad variant or G, before any weights
  t0 = time.perf_counter()
  model, cfg = hf.from_hf(path)
  seq_len = pair_seq_len(config, model, seq_len)
  objective, data, info = held_out_batches(path, text, model, config, seq_len, batch_size, max_tokens, glob)
  loss, acc = evaluate(model, data, objective)
  rows = [{"name": "original", "cfg": cfg, "error": None, "loss": loss, "accuracy": acc,
           "seconds": time.perf_counter() - t0}]
  if variant != "per_head" or num_kv_heads not in (None, cfg.num_heads):
    t0 = time.perf_counter()
    with warnings.catch_warnings():  # the table gives the error
      warnings.simplefilter("ignore", LossyConversionWarning)
      converted, ccfg, errors = hf.convert_model(model, cfg, variant, num_kv_heads)
    loss, acc = evaluate(converted, data, objective)
    rows.append({"name": "converted", "cfg": ccfg, "error": max(errors), "loss": loss, "accuracy": acc,
                 "seconds": time.perf_counter() - t0})
  return {"path": path, "config": config, "cfg": cfg, "objective": objective, "described": describe(objective, data),
          "info": info, "seq_len": seq_len, "rows": rows}


def markdown(result: dict[str, Any]) -> str:
  """The header lines and the table of `attn eval`: one row per model scored."""
  cfg, info, per = result["cfg"], result["info"], "pair" if result["objective"] == "sentence_pairs" else "token"
  scored = f"{info['windows']} pairs of window halves" if per == "pair" else \
      f"{info['tokens']:,} predicted tokens in {info['windows']} windows"
  lines = [f"{result['path']}: {result['config']['model_type']} ({result['described']}), {cfg.num_layers} layers, "
           f"{cfg.num_heads} heads, d_model {cfg.d_model}, vocab {cfg.vocab_size}",
           f"text: {info['root']} ({info['glob']}), held-out split: {info['documents']} document(s), "
           f"{info['held_out_bytes']:,} of {info['bytes']:,} bytes; scored {scored} of {result['seq_len']} tokens",
           "",
           f"| model | variant | kv heads | relative error | loss (nats/{per}) | perplexity | accuracy | seconds |",
           "|---|---|---:|---:|---:|---:|---:|---:|"]
  for r in result["rows"]:
    err = "–" if r["error"] is None else f"{r['error']:.4f}"
    ppl = f"{math.exp(r['loss']):.2f}" if per == "token" else "–"
    lines.append(f"| {r['name']} | {r['cfg'].variant} | {r['cfg'].head.num_kv_heads} | {err} | {r['loss']:.4f} | "
                 f"{ppl} | {r['accuracy']:.4f} | {r['seconds']:.1f} |")
  return "\n".join(lines)
