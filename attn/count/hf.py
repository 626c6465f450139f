"""`attn count --hf DIR`: a Hugging Face checkpoint's parameters by component, from its config.json alone.

The family's config reader (attn.nn.hf.model_config) maps config.json to a
ModelConfig without reading a weight, so a directory holding only config.json
is counted. The total is what transformers' model.parameters() holds: attn's
output layer keeps a zero bias where a family has biases (gpt-oss), which no
Hugging Face lm_head has, so it is left out. A RoPE scaling attn refuses at run
time (Phi-4-mini's longrope) changes no parameter and no cache width: the count
drops it and says so. Stored published configs (attn/count/hf_configs/NAME.json)
count by name: `attn count --hf llama-3.1-8b`.
"""

from __future__ import annotations

import json
import os
from typing import Any

from attn.config import ConfigError, invalid
from attn.count import model as count_model
from attn.nn.config import ModelConfig

CONFIGS_DIR = os.path.join(os.path.dirname(__file__), "hf_configs")
# RoPE scalings that change frequencies only: counted as plain RoPE (attn.nn.hf.rope refuses them for running).
COUNT_ONLY_ROPE = ("longrope", "dynamic")


def stored_configs() -> dict[str, str]:
  """Name -> path of each published config.json stored in attn/count/hf_configs."""
  if not os.path.isdir(CONFIGS_DIR):
    return {}
  return {f[:-5]: os.path.join(CONFIGS_DIR, f) for f in sorted(os.listdir(CONFIGS_DIR)) if f.endswith(".json")}


def _allowed() -> str:
  return ("a Hugging Face checkpoint directory holding config.json (weights are not read), or a stored "
          f"published config: {', '.join(stored_configs())}")


def read_hf_config(source: str) -> tuple[dict[str, Any], str]:
  """The config dict of `--hf source` (a directory, or a stored config's name) and where it came from."""
  stored = stored_configs()
  if os.path.isdir(source):
    where = os.path.join(source, "config.json")
    if not os.path.isfile(where):
      raise invalid("--hf", source, "a directory holding config.json; this one has none (or " + _allowed() + ")")
  elif source in stored:
    where = stored[source]
  else:
    raise invalid("--hf", source, _allowed())
  try:
    with open(where, encoding="utf-8") as f:
      hf = json.load(f)
  except (OSError, ValueError) as e:
    raise invalid("--hf", where, f"a readable JSON config.json ({e})") from None
  if not isinstance(hf, dict):
    raise invalid("--hf", where, "a config.json holding a JSON object")
  return hf, where


def _rope_kind(hf: dict[str, Any]) -> str | None:
  params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
  return params.get("rope_type", params.get("type")) if isinstance(params, dict) else None


def config_for_count(hf: dict[str, Any]) -> tuple[ModelConfig, list[str]]:
  """The ModelConfig the family's reader gives (no weights read), and notes on what counting ignored."""
  from attn.nn.hf import model_config  # the hf package imports transformers-free modules only
  notes = []
  kind = _rope_kind(hf)
  if kind in COUNT_ONLY_ROPE:
    hf = {k: v for k, v in hf.items() if k not in ("rope_scaling", "rope_parameters")}
    notes.append(f"rope_scaling type {kind!r} counted as plain RoPE: it changes frequencies, not parameters or "
                 "cache widths (attn refuses it for running)")
  try:
    return model_config(hf), notes
  except ConfigError as e:
    raise ConfigError(f"--hf: {e}") from None


def hf_breakdown(m: ModelConfig) -> dict[str, int]:
  """Parameters by component as transformers holds them: attention split per layer type."""
  return _breakdown(_as_transformers(m), count_model.model_param_breakdown(m, "decoder_lm"),
                    count_model.layer_type_table(m, "decoder_lm", 1))


def _family(hf: dict[str, Any]):
  from attn.nn.hf import family_for  # the hf package imports transformers-free modules only
  return family_for(hf)


def _held_zeros(hf: dict[str, Any], m: ModelConfig) -> int:
  """Parameters per attention layer attn holds as zeros for the family (Family.held_zeros), else 0."""
  family = _family(hf)
  return int(family.held_zeros(m)) if family.held_zeros is not None else 0


def _as_transformers(m: ModelConfig) -> tuple[int | None, str]:
  """What transformers holds otherwise than attn's breakdown: the output layer's parameters (None: tied),
  and the name of the MLP component."""
  output = None if m.tie_embeddings else m.output_rows * m.d_model  # no Hugging Face lm_head has a bias
  mlp = "mlp"
  if m.mlp == "moe":  # DeepSeek-V3's shared experts and dense first layers are in it too: say so
    extra = (["shared experts"] if m.moe_shared_experts else []) + (
        [f"{m.moe_dense_first} dense layers' mlp"] if m.moe_dense_first else [])
    mlp = f"experts (router, all experts{''.join(', ' + e for e in extra)})"
  return output, mlp


def _breakdown(names: tuple[int | None, str], parts: dict[str, int],
               table: list[dict[str, Any]]) -> dict[str, int]:
  """hf_breakdown from _as_transformers, the model's breakdown and its layer type table (any length)."""
  output, mlp = names
  parts = dict(parts) if output is None else {**parts, "output": output}
  out: dict[str, int] = {}
  for row in table[:-1]:
    out[f"attention ({row['type']})"] = row["params"]
  if sum(out.values()) != parts["attention"]:
    raise AssertionError("per-type attention does not sum to the model's")  # one closed form, two groupings
  for key, value in parts.items():
    if key != "attention" and value:
      out[mlp if key == "mlp" else key] = value
  return out


def hf_report(hf: dict[str, Any], source: str, lengths: tuple[int, ...] = (8192, 131072),
              dtype: str = count_model.DTYPE, changes: dict[str, Any] | None = None) -> dict[str, Any]:
  """Everything `attn count --hf` prints, as a JSON-ready dict; changes: ModelConfig fields set on what
  the family reads (a design undone: DeepSeek-V3's heads as per_head, keys and values cached whole)."""
  m, notes = config_for_count(hf)
  m = m.replace(**changes) if changes else m
  # Each table once: the breakdown, and the layer types at lengths[0] (their per-layer figures
  # do not depend on the length) with each type's first layer, checked once (attn.count.layer.Layer).
  zeros, family = _held_zeros(hf, m), _family(hf)  # before the tables: the walk stays in this module
  if family.left_out is not None:  # a wrapper's towers: what the count does not include
    notes = [*notes, *family.left_out(hf)]
  names = _as_transformers(m)
  model_parts = count_model.model_param_breakdown(m, "decoder_lm")
  table, first = count_model.type_table(m, "decoder_lm", lengths[0], dtype, also_at=tuple(lengths[1:]))
  parts = _breakdown(names, model_parts, table)
  if family.counted_buffers is not None and family.counted_buffers(m):
    parts[names[1]] += int(family.counted_buffers(m))
    notes.append(f"{int(family.counted_buffers(m))} buffers of the feed-forward that transformers counts as "
                 "parameters added (a correction bias)")
  if zeros:  # attn's zeros in place of a bias the checkpoint lacks: not transformers' parameters
    for row in table[:-1]:
      parts[f"attention ({row['type']})"] -= zeros * row["layers"]
    notes.append(f"{zeros} parameters per attention layer that attn holds as zeros (a bias the checkpoint "
                 "lacks) left out")
  total = sum(parts.values())
  active = count_model.active_param_count(m, "decoder_lm", model_parts) - (model_parts["output"]
                                                                          - parts.get("output", 0)) \
      - zeros * sum(row["layers"] for row in table[:-1])
  layers = []
  for row in table[:-1]:
    layer = first[row["type"]]
    layers.append({"type": row["type"], "variant": layer.name, "layers": row["layers"],
                   "kv_shared_layers": row["kv_shared_layers"], "window": row["window"],
                   "rope_theta": row["rope_theta"], "params_per_layer": row["params_per_layer"],
                   "params": row["params"], "flops_fwd_at": {str(lengths[0]): row["flops_fwd"]},
                   "score_weights_per_layer": layer.score_weights(),
                   "kv_bytes_per_token_per_layer": row["kv_bytes_per_token_per_layer"],
                   "kv_bytes_at": {str(L): row.get("kv_bytes_at", {L: row["kv_bytes_at_L"]})[L] for L in lengths},
                   "state_bytes_per_layer": layer.state_bytes()})
  return {"source": source, "model_type": hf.get("model_type"), "variant": m.variant, "dtype": dtype,
          "num_layers": m.num_layers, "d_model": m.d_model, "vocab_size": m.vocab_size,
          "tie_embeddings": m.tie_embeddings, "notes": notes, "breakdown": parts, "total": total,
          "active_per_token": active, "attention_share": sum(v for k, v in parts.items()
                                                             if k.startswith("attention")) / total,
          "layer_types": layers,
          "kv_bytes_at": {str(L): sum(r["kv_bytes_at"][str(L)] for r in layers) for L in lengths}}
