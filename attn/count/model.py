"""Whole models (attn.nn.ModelConfig): parameters by component, per layer type, active per token.

Whole models are summed from the same per-layer pieces (attn.count.layer) the
Flax modules in attn/nn/models.py are built from; `model_param_count` equals
the number of elements in an instantiated model's nnx.Param tree.

A model's self-attention layers are grouped by type (full, sliding, NoPE);
each row gives one layer of the type and the sum over its layers. A sliding
layer caches min(L, window) tokens, a full one L; a NoPE layer caches what
its variant caches without RoPE (the same for most variants; mla drops its
decoupled RoPE key). The FLOPs are attn.count.layer.flops, the dense closed form: a
window's mask does not change it (the kernels skip what it masks, the count
does not). The rows cover the decoding stack of a decoder (the decoder's
self-attention of an encoder-decoder), the encoder's otherwise. A layer that reads another
layer's keys and values (ModelConfig.kv_source) caches nothing: each row counts its
kv_shared_layers and leaves them out of kv_bytes_at_L, and holds no key-side weights
(kv_sharing.dropped: params less them, as in the model's tree).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from attn.config import invalid
from attn.count.layer import (check_length, flops, kv_cache_bytes, kv_cache_bytes_per_token, param_counts,
                              state_bytes)
from attn.nn import hyper, kv_sharing, layer_types

if TYPE_CHECKING:
  from attn.nn.config import ModelConfig

# The dtype every byte count of a whole model defaults to: float32, what attn's models train and decode in and
# what reports count in, so that model_kv_cache_bytes + model_state_bytes add up to what a sequence holds.
DTYPE = "float32"

# Which Flax module in attn.nn.models a count describes.
MODEL_KINDS = ("encoder", "decoder_lm", "classifier", "encoder_decoder")


# Whole models: the pieces of attn/nn/models.py. nnx.LayerNorm has a scale and
# a bias (2·D) whatever use_bias says, an RMSNorm a scale only (D); the BERT
# pooler and the MLM head's transform always have a bias.


def _layer_norm(m: ModelConfig) -> int:
  if not m.layernorm:
    return 0
  return 2 * m.d_model if m.norm_type == "layernorm" else m.d_model


def _mlp(m: ModelConfig, layer: int = 0, cross: bool = False) -> int:
  if m.is_moe_layer(layer):
    return expert_params(m)["total"]
  n = 2 if m.mlp == "plain" else 3  # gated (and moe's dense layers): gate, up and down
  F = 2 * m.d_ff if m.double_wide_mlp and not cross and kv_sharing.source(m, layer) != layer else m.d_ff
  return n * m.d_model * F + (((n - 1) * F + m.d_model) if m.has_dense_bias else 0)


def _per_layer_inputs(m: ModelConfig, n: int) -> int:
  """Gemma 4's per-layer inputs (attn.nn.models.PerLayerInputs): the table, the projection and its
  norm over P, and in each of the n blocks a gate D·P, an output P·D and a norm over D."""
  P = m.per_layer_dim
  if not P:
    return 0
  norm_P = (2 * P if m.norm_type == "layernorm" else P) if m.layernorm else 0
  return (m.per_layer_vocab or m.vocab_size) * n * P + m.d_model * n * P + norm_P + n * (
      2 * m.d_model * P + _layer_norm(m))


def expert_params(m: ModelConfig) -> dict[str, int]:
  """One mixture-of-experts layer (attn.nn.moe): "total" parameters, and "active" per token.

  Each expert 3·D·F + b·(2F + D), F = moe_d_ff; the router D·E + b·E; shared experts
  one gated MLP of width S·F (or moe_shared_d_ff), + D with moe_shared_gate. Active: the router,
  k experts and the shared ones.
  """
  D, F, b = m.d_model, m.moe_d_ff or m.d_ff, m.has_dense_bias
  expert = 3 * D * F + ((2 * F + D) if b else 0)
  SF = (m.moe_shared_d_ff or m.moe_shared_experts * F) if m.moe_shared_experts else 0
  fixed = D * m.moe_experts + (m.moe_experts if b else 0) + (
      3 * D * SF + ((2 * SF + D) if b else 0) if SF else 0) + (D if m.moe_shared_gate else 0)
  return {"total": m.moe_experts * expert + fixed, "active": m.moe_top_k * expert + fixed}


def _attention(m: ModelConfig, layer: int = 0, cross: bool = False) -> int:
  """Layer `layer`'s attention: its type's (mla without RoPE: no W^KR), less the key-side weights a
  layer reading another's keys and values does not hold (kv_sharing.dropped)."""
  variant, head = m.layer_variant(layer), m.layer_head(layer)
  shared = not cross and kv_sharing.source(m, layer) != layer
  return param_counts(variant, head)["analytic"] - (kv_sharing.dropped_count(variant, head) if shared else 0)


def shared_flops_saved(m: ModelConfig, layer: int, length: int) -> int:
  """FLOPs a layer reading another layer's keys and values (kv_source) does not spend on a forward
  pass over `length` tokens: its key and value projections, 2·length·D·n for each key-side matrix
  (D, n...) it does not hold (kv_sharing.dropped: per_head 2·S·D·G·(K + V), k_eq_v 2·S·D·G·K)."""
  if kv_sharing.source(m, layer) == layer:
    return 0
  total = 0
  for name, s in kv_sharing.dropped(m.layer_variant(layer), m.layer_head(layer)).items():
    if name.startswith("w_"):
      n = 1
      for d in s.shape:
        n *= d
      total += 2 * length * n
  return total


def _embeddings(m: ModelConfig, parts: dict[str, int], *, token: bool = True,
                segments: bool = True) -> None:
  parts["token_embeddings"] += m.vocab_size * m.d_model if token else 0
  parts["position_embeddings"] += m.max_len * m.d_model if m.positional == "learned" else 0
  parts["segment_embeddings"] += m.num_segments * m.d_model if segments else 0
  parts["layernorm"] += _layer_norm(m) if m.embed_norm else 0


def _blocks(m: ModelConfig, parts: dict[str, int], n: int, *, cross: bool = False) -> None:
  """A stack of n blocks (decoder blocks: + cross-attention + LN), then its final LN."""
  attn = [cross or m.has_attention(i) for i in range(n)]  # block_kinds: single-sublayer blocks
  mlp = [cross or m.has_mlp(i) for i in range(n)]
  parts["attention"] += sum(_attention(m, i) + (_attention(m, i, cross=True) if cross else 0)
                            for i in range(n) if attn[i])
  parts["mlp"] += sum(_mlp(m, i, cross) for i in range(n) if mlp[i])
  per_sublayer = 2 if m.norm == "sandwich" else 1  # sandwich: a norm before and after
  sublayers = sum(attn) + sum(mlp) + (n if cross else 0)
  parts["layernorm"] += sublayers * per_sublayer * _layer_norm(m) + (_layer_norm(m) if m.final_norm else 0)


def _output(m: ModelConfig) -> int:
  return 0 if m.tie_embeddings else m.d_model * m.vocab_size + (m.vocab_size if m.has_dense_bias else 0)


def model_param_breakdown(m: ModelConfig, kind: str = "decoder_lm") -> dict[str, int]:
  """Parameters of a whole model (attn.nn ModelConfig m) by component, summed over stacks."""
  if kind not in MODEL_KINDS:
    raise invalid("kind", kind, f"one of {list(MODEL_KINDS)}")
  names = ("token_embeddings", "position_embeddings", "segment_embeddings", "attention", "mlp",
           "layernorm", "pooler", "classifier", "output", "mlm_head", "per_layer_inputs")
  parts = dict.fromkeys(names, 0)
  _embeddings(m, parts, segments=kind != "decoder_lm")
  parts["per_layer_inputs"] = _per_layer_inputs(m, m.num_layers)
  _blocks(m, parts, m.num_layers)
  if kind in ("encoder", "classifier") and m.pooler:
    parts["pooler"] = m.d_model * m.d_model + m.d_model
  if kind == "encoder" and m.mlm_head:  # transform D² + D, its norm, the decoder's bias (weights tied)
    parts["mlm_head"] = m.d_model * m.d_model + m.d_model + _layer_norm(m) + m.vocab_size
  if kind == "classifier":
    cls_vector = m.d_model if m.pooling == "cls" else 0
    parts["classifier"] = cls_vector + m.d_model * m.num_classes + (
        m.num_classes if m.use_bias else 0)
  if kind == "encoder_decoder":
    # The target side: its own positions (and embedding LN); the token table is the
    # source's when share_src_tgt_embeddings; decoder blocks add cross-attention.
    _embeddings(m, parts, token=not m.share_src_tgt_embeddings, segments=False)
    _blocks(m, parts, m.num_decoder_layers, cross=True)
  if kind in ("decoder_lm", "encoder_decoder"):
    parts["output"] = _output(m)
  if m.hc_mult > 1:  # DecoderLM's hyper-connections (attn.nn.hyper): two mixes a block and the head
    parts["hyper_connections"] = hyper.param_count(m.hc_mult, m.d_model, m.num_layers)
  return parts


def model_param_count(m: ModelConfig, kind: str = "decoder_lm") -> int:
  """Total parameters of a whole model, each shared array counted once."""
  return sum(model_param_breakdown(m, kind).values())


def model_kv_cache_bytes_per_token(m: ModelConfig, kind: str = "decoder_lm", dtype: Any = DTYPE) -> int:
  """Self-attention KV cache of the decoding stack per generated token (all layers)."""
  if kind not in ("decoder_lm", "encoder_decoder"):
    raise invalid("kind", kind, "decoder_lm or encoder_decoder: only decoders keep a KV cache")
  layers = m.num_layers if kind == "decoder_lm" else m.num_decoder_layers
  return sum(kv_cache_bytes_per_token(m.layer_variant(i), m.layer_head(i), dtype) for i in range(layers)
             if _caches(m, kind, i) and (kind != "decoder_lm" or m.has_attention(i)))


def _caches(m: ModelConfig, kind: str, index: int) -> bool:
  """Whether layer `index` of the stack holds a KV cache: not one reading another layer's keys and
  values (kv_source, attn.nn.kv_sharing: the cache holds each shared pair once)."""
  return kind != "decoder_lm" or kv_sharing.source(m, index) == index


def model_state_bytes(m: ModelConfig, kind: str = "decoder_lm", dtype: Any = DTYPE) -> int:
  """The fixed-size decoding state of the stack's linear layers per sequence (all layers)."""
  layers = m.num_layers if kind == "decoder_lm" else m.num_decoder_layers
  return sum(state_bytes(m.layer_variant(i), m.layer_head(i), dtype) for i in range(layers)
             if kind != "decoder_lm" or m.has_attention(i))


def _stack(m: ModelConfig, kind: str) -> int:
  if kind not in MODEL_KINDS:
    raise invalid("kind", kind, f"one of {list(MODEL_KINDS)}")
  return m.num_decoder_layers if kind == "encoder_decoder" else m.num_layers


def layer_type_table(m: ModelConfig, kind: str, length: int, dtype: Any = DTYPE) -> list[dict[str, Any]]:
  """One row per layer type of the stack, in order of first appearance, then a "total" row."""
  check_length("length", length)
  rows: dict[str, dict[str, Any]] = {}
  for i in range(_stack(m, kind)):
    if kind != "encoder_decoder" and not m.has_attention(i):  # an MLP-only block (block_kinds)
      continue
    name = layer_types.layer_type(m, i)
    head, variant = m.layer_head(i), m.layer_variant(i)
    shared = not _caches(m, kind, i)
    if name not in rows:
      rows[name] = {"type": name, "variant": variant, "layers": 0, "kv_shared_layers": 0, "window": head.window,
                    "rope_theta": head.rope_theta if head.rope_dim else None,
                    "params_per_layer": param_counts(variant, head)["analytic"],
                    "flops_fwd_per_layer": flops(variant, head, length),
                    "kv_bytes_per_token_per_layer": kv_cache_bytes_per_token(variant, head, dtype),
                    "kv_bytes_at_L_per_layer": kv_cache_bytes(variant, head, length, dtype),
                    "params": 0, "flops_fwd": 0, "kv_bytes_at_L": 0}
    row = rows[name]
    row["layers"] += 1
    row["kv_shared_layers"] += shared
    # A sharing layer: no key-side weights, no key and value projections, no cache of its own.
    row["params"] += _attention(m, i)
    row["flops_fwd"] += row["flops_fwd_per_layer"] - (shared_flops_saved(m, i, length) if shared else 0)
    row["kv_bytes_at_L"] += 0 if shared else row["kv_bytes_at_L_per_layer"]
  out = list(rows.values())
  total = {"type": "total", "layers": sum(r["layers"] for r in out)}
  for key in ("params", "flops_fwd", "kv_bytes_at_L"):
    total[key] = sum(r[key] for r in out)
  return out + [total]


def model_kv_cache_bytes(m: ModelConfig, kind: str, length: int, dtype: Any = DTYPE) -> int:
  """Bytes the decoding stack caches after `length` tokens, each layer by its own type."""
  if kind not in ("decoder_lm", "encoder_decoder"):
    raise invalid("kind", kind, "decoder_lm or encoder_decoder: only decoders keep a KV cache")
  return layer_type_table(m, kind, length, dtype)[-1]["kv_bytes_at_L"]


def active_param_count(m: ModelConfig, kind: str = "decoder_lm") -> int:
  """Parameters one token uses: the whole model less the experts its router does not keep."""
  total = model_param_count(m, kind)
  if m.mlp != "moe":
    return total
  experts = expert_params(m)
  stacks = [m.num_layers] + ([m.num_decoder_layers] if kind == "encoder_decoder" else [])
  moe_layers = sum(m.is_moe_layer(i) and (j > 0 or m.has_mlp(i)) for j, n in enumerate(stacks) for i in range(n))
  return total - moe_layers * (experts["total"] - experts["active"])
