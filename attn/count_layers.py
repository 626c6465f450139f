"""Counts per layer: per layer type (attn.nn.layer_types), and a model's parameters active per token.

A model's self-attention layers are grouped by type (full, sliding, NoPE);
each row gives one layer of the type and the sum over its layers. A sliding
layer caches min(L, window) tokens, a full one L; a NoPE layer caches what
its variant caches without RoPE (the same for most variants; mla drops its
decoupled RoPE key). The FLOPs are attn.count.flops, the dense closed form: a
window's mask does not change it (the kernels skip what it masks, the count
does not). The rows cover the decoding stack of a decoder (the decoder's
self-attention of an encoder-decoder), the encoder's otherwise.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from attn import count
from attn.config import invalid
from attn.nn import layer_types

if TYPE_CHECKING:
  from attn.nn.models import ModelConfig


def _stack(m: ModelConfig, kind: str) -> int:
  if kind not in count.MODEL_KINDS:
    raise invalid("kind", kind, f"one of {list(count.MODEL_KINDS)}")
  return m.num_decoder_layers if kind == "encoder_decoder" else m.num_layers


def layer_type_table(m: ModelConfig, kind: str, length: int, dtype: Any = "bfloat16") -> list[dict[str, Any]]:
  """One row per layer type of the stack, in order of first appearance, then a "total" row."""
  count._check_length("length", length)
  rows: dict[str, dict[str, Any]] = {}
  for i in range(_stack(m, kind)):
    name = layer_types.layer_type(m, i)
    if name in rows:
      rows[name]["layers"] += 1
      continue
    head, variant = m.layer_head(i), m.layer_variant(i)
    rows[name] = {"type": name, "layers": 1, "window": head.window,
                  "rope_theta": head.rope_theta if head.rope_dim else None,
                  "params_per_layer": count.param_counts(variant, head)["analytic"],
                  "flops_fwd_per_layer": count.flops(variant, head, length),
                  "kv_bytes_per_token_per_layer": count.kv_cache_bytes_per_token(variant, head, dtype),
                  "kv_bytes_at_L_per_layer": count.kv_cache_bytes(variant, head, length, dtype)}
  out = list(rows.values())
  for row in out:
    n = row["layers"]
    row |= {"params": n * row["params_per_layer"], "flops_fwd": n * row["flops_fwd_per_layer"],
            "kv_bytes_at_L": n * row["kv_bytes_at_L_per_layer"]}
  total = {"type": "total", "layers": sum(r["layers"] for r in out)}
  for key in ("params", "flops_fwd", "kv_bytes_at_L"):
    total[key] = sum(r[key] for r in out)
  return out + [total]


def model_kv_cache_bytes(m: ModelConfig, kind: str, length: int, dtype: Any = "bfloat16") -> int:
  """Bytes the decoding stack caches after `length` tokens, each layer by its own type."""
  if kind not in ("decoder_lm", "encoder_decoder"):
    raise invalid("kind", kind, "decoder_lm or encoder_decoder: only decoders keep a KV cache")
  return layer_type_table(m, kind, length, dtype)[-1]["kv_bytes_at_L"]


def active_param_count(m: ModelConfig, kind: str) -> int:
  """Parameters one token uses: the whole model less the experts its router does not keep."""
  total = count.model_param_count(m, kind)
  if m.mlp != "moe":
    return total
  experts = count.expert_params(m)
  stacks = [m.num_layers] + ([m.num_decoder_layers] if kind == "encoder_decoder" else [])
  moe_layers = sum(m.is_moe_layer(i) for n in stacks for i in range(n))
  return total - moe_layers * (experts["total"] - experts["active"])
