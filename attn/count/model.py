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
(kv_sharing.dropped: params less them, as in the model's tree). A layer that reuses an earlier layer's
indexer choice (ModelConfig.indexer_types, attn.nn.index_sharing) has a head of its own (no index weights,
FLOPs or keys cached): each layer's figures are summed from its own head.

A stack is read from its ModelConfig once (`_stack_of`: each block's layer type, sublayers,
experts, key-value source and its attention checked once into an attn.count.layer.Layer); the
counts are sums over those records.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from attn.config import invalid
from attn.count.layer import DTYPE, Layer, check_layer, check_length, kv_cache_bytes_per_token, state_bytes
from attn.nn import attn_res, hyper, kv_sharing, layer_types, short_conv

if TYPE_CHECKING:
  from attn.nn.config import ModelConfig


# Which Flax module in attn.nn.models a count describes.
MODEL_KINDS = ("encoder", "decoder_lm", "classifier", "encoder_decoder")


# Whole models: the pieces of attn/nn/models.py. nnx.LayerNorm has a scale and
# a bias (2·D) whatever use_bias says, an RMSNorm a scale only (D); the BERT
# pooler and the MLM head's transform always have a bias.


def _layer_norm(m: ModelConfig, place: str = "pre") -> int:
  """A norm over D at `place` (attn.nn.norms: a weightless form "none" holds nothing)."""
  if not m.layernorm:
    return 0
  if m.norm_type == "layernorm":
    return 2 * m.d_model
  return 0 if (m.norm_forms or {}).get(place) == "none" else m.d_model  # norm_type's forms all hold D


@dataclasses.dataclass(frozen=True)
class _Block:
  """Block `index` of a stack as counting reads it from its ModelConfig, once (_stack_of)."""

  index: int
  type: str  # its self-attention's layer type (attn.nn.layer_types)
  attention: Layer | None  # its self-attention, checked once; None in an MLP-only block (block_kinds)
  mlp: bool
  moe: bool
  reads_other: bool  # its keys and values are another layer's (kv_source)


@dataclasses.dataclass(frozen=True)
class _Stack:
  """A stack of blocks as counting reads it from its ModelConfig, once (_stack_of)."""

  blocks: tuple[_Block, ...]
  dense_bias: bool  # the MLPs (and an untied output layer) have biases: ModelConfig.has_dense_bias


def _stack_of(m: ModelConfig, n: int, cross: bool = False) -> _Stack:
  """Blocks 0..n-1 of a stack (a decoder's with cross-attention: every block has both sublayers)."""
  dense_bias, blocks = m.has_dense_bias, []
  for i in range(n):
    attends, mlp, moe = cross or m.has_attention(i), cross or m.has_mlp(i), m.is_moe_layer(i)
    attention = check_layer(m.layer_variant(i), m.layer_head(i)) if attends else None
    blocks.append(_Block(index=i, type=layer_types.layer_type(m, i), attention=attention, mlp=mlp, moe=moe,
                         reads_other=kv_sharing.source(m, i) != i))
  return _Stack(tuple(blocks), dense_bias)


def _mlp(m: ModelConfig, b: _Block, dense_bias: bool, cross: bool = False) -> int:
  if b.moe:  # + ZAYA's router_states_scale (R,) in every expert layer but the first (moe_router_carry)
    return expert_params(m, dense_bias)["total"] + (m.moe_router_mlp if m.router_carried(b.index) else 0)
  n = 2 if m.mlp == "plain" else 3  # gated (and moe's dense layers): gate, up and down
  F = 2 * m.d_ff if m.double_wide_mlp and not cross and b.reads_other else m.d_ff
  return n * m.d_model * F + (((n - 1) * F + m.d_model) if dense_bias else 0)


def _per_layer_inputs(m: ModelConfig, n: int) -> int:
  """Gemma 4's per-layer inputs (attn.nn.models.PerLayerInputs): the table, the projection and its
  norm over P, and in each of the n blocks a gate D·P, an output P·D and a norm over D."""
  P = m.per_layer_dim
  if not P:
    return 0
  norm_P = (2 * P if m.norm_type == "layernorm" else P) if m.layernorm else 0
  return (m.per_layer_vocab or m.vocab_size) * n * P + m.d_model * n * P + norm_P + n * (
      2 * m.d_model * P + _layer_norm(m))


def expert_params(m: ModelConfig, dense_bias: bool | None = None) -> dict[str, int]:
  """One mixture-of-experts layer (attn.nn.moe): "total" parameters, and "active" per token.

  Each expert 3·D·F + b·(2F + D), F = moe_d_ff (3·W·F at moe_pool_width W, plus 2·D·W + 2·W once); the
  router D·C + b·C over C = E (+ 1 with moe_skip_expert) classes, or with moe_router_mlp R ZAYA's network
  D·R + R (down) + R (norm) + 2·(R² + R) (two layers) + R·C, no b (each carried layer's s (R,) is the
  caller's: it is not in the first expert layer); shared experts
  one gated MLP of width S·F (or moe_shared_d_ff), + D with moe_shared_gate. Active: the router,
  k experts and the shared ones. dense_bias: m.has_dense_bias, where the caller has read it.
  """
  D, F, W = m.d_model, m.moe_d_ff or m.d_ff, m.moe_pool_width
  b = m.has_dense_bias if dense_bias is None else dense_bias
  expert = 3 * (W or D) * F + ((2 * F + D) if b else 0)
  SF = (m.moe_shared_d_ff or m.moe_shared_experts * F) if m.moe_shared_experts else 0
  C, R = m.moe_experts + (1 if m.moe_skip_expert else 0), m.moe_router_mlp
  router = D * C + (C if b else 0) if R is None else D * R + 2 * R + 2 * (R * R + R) + R * C
  fixed = router + (
      3 * D * SF + ((2 * SF + D) if b else 0) if SF else 0) + (D if m.moe_shared_gate else 0)
  fixed += 2 * D * W + 2 * W if W else 0  # Muse Spark's pooled experts: D -> W, W -> D and a norm each side
  return {"total": m.moe_experts * expert + fixed, "active": m.moe_top_k * expert + fixed}


def _attention(b: _Block, cross: bool = False) -> int:
  """Block b's attention: its type's (mla without RoPE: no W^KR), less the key-side weights a
  layer reading another's keys and values does not hold (kv_sharing.dropped)."""
  layer = b.attention
  shared = not cross and b.reads_other
  return layer.analytic_params() - (kv_sharing.dropped_count(layer.name, layer.cfg) if shared else 0)


def shared_flops_saved(m: ModelConfig, layer: int, length: int) -> int:
  """FLOPs a layer reading another layer's keys and values (kv_source) does not spend on a forward
  pass over `length` tokens: its key and value projections, 2·length·D·n for each key-side matrix
  (D, n...) it does not hold (kv_sharing.dropped: per_head 2·S·D·G·(K + V), k_eq_v 2·S·D·G·K)."""
  if kv_sharing.source(m, layer) == layer:
    return 0
  return _flops_saved(m.layer_variant(layer), m.layer_head(layer), length)


def _flops_saved(variant: str, head, length: int) -> int:
  total = 0
  for name, s in kv_sharing.dropped(variant, head).items():
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
  parts["layernorm"] += _layer_norm(m, "embed") if m.embed_norm else 0
  if m.residual_scale and token:  # ZAYA's embedding scale and bias (one model has one)
    parts["residual_scales"] = parts.get("residual_scales", 0) + 2 * m.d_model


def _blocks(m: ModelConfig, parts: dict[str, int], stack: _Stack, *, cross: bool = False) -> None:
  """A stack of blocks (decoder blocks: + cross-attention + LN), then its final LN."""
  attn = [b for b in stack.blocks if b.attention is not None]  # block_kinds: single-sublayer blocks
  mlp = [b for b in stack.blocks if b.mlp]
  parts["attention"] += sum(_attention(b) + (_attention(b, cross=True) if cross else 0) for b in attn)
  parts["mlp"] += sum(_mlp(m, b, stack.dense_bias, cross) for b in mlp)
  if m.short_conv is not None:  # the convolution before each self-attention (attn.nn.short_conv)
    parts["short_conv"] = parts.get("short_conv", 0) + len(attn) * short_conv.param_count(m.short_conv, m.d_model)
  if m.attn_res_block is not None:  # block attention residuals' queries, the split layers' k and v input norms
    parts["attn_res"] = attn_res.param_count(m, [b.type for b in stack.blocks])
    parts["layernorm"] += 2 * _layer_norm(m) * sum(b.type in m.attn_res_kv_types for b in stack.blocks)
  if m.residual_conv is not None:  # Inkling-2's convolution on each attention's and MLP's output
    parts["residual_conv"] = (len(attn) + len(mlp)) * short_conv.residual_param_count(m.residual_conv, m.d_model)
  pre = m.norm != "after"  # sandwich: a norm before and after; after: after only; pre, post: one
  post = m.norm in ("sandwich", "after")
  n_attn = len(attn) + (len(stack.blocks) if cross else 0)  # a cross-attention's post norm is attn_post's
  parts["layernorm"] += ((n_attn + len(mlp)) * _layer_norm(m) if pre else 0) + (
      n_attn * _layer_norm(m, "attn_post") + len(mlp) * _layer_norm(m, "mlp_post") if post else 0) + (
      _layer_norm(m, "final") if m.final_norm else 0)
  if m.residual_gate is not None:  # Muse Spark's residual gates: g (D,) per sublayer (attn.nn.norms)
    parts["residual_gates"] = parts.get("residual_gates", 0) + (len(attn) + len(mlp)) * m.d_model
  if m.residual_scale:  # ZAYA's residual scaling: 4 (D,) per sublayer, and the embeddings' 2 (attn.nn.models)
    parts["residual_scales"] = parts.get("residual_scales", 0) + (len(attn) + len(mlp)) * 4 * m.d_model


def _output(m: ModelConfig, dense_bias: bool) -> int:
  return 0 if m.tie_embeddings else m.d_model * m.output_rows + (m.output_rows if dense_bias else 0)


def model_param_breakdown(m: ModelConfig, kind: str = "decoder_lm") -> dict[str, int]:
  """Parameters of a whole model (attn.nn ModelConfig m) by component, summed over stacks."""
  if kind not in MODEL_KINDS:
    raise invalid("kind", kind, f"one of {list(MODEL_KINDS)}")
  if kind != "decoder_lm":  # counts only what attn.nn builds: an encoder refuses causal-only heads
    layer_types.check_bidirectional(m, f"a {kind}'s encoder")
  names = ("token_embeddings", "position_embeddings", "segment_embeddings", "attention", "mlp",
           "layernorm", "pooler", "classifier", "output", "mlm_head", "per_layer_inputs")
  parts = dict.fromkeys(names, 0)
  stack = _stack_of(m, m.num_layers)
  _embeddings(m, parts, segments=kind != "decoder_lm")
  parts["per_layer_inputs"] = _per_layer_inputs(m, m.num_layers)
  _blocks(m, parts, stack)
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
    _blocks(m, parts, _stack_of(m, m.num_decoder_layers, cross=True), cross=True)
  if kind in ("decoder_lm", "encoder_decoder"):
    parts["output"] = _output(m, stack.dense_bias)
  if m.hc_mult > 1:  # DecoderLM's hyper-connections (attn.nn.hyper): two mixes a block and the head
    parts["hyper_connections"] = hyper.param_count(m.hc_mult, m.d_model, m.num_layers, form=m.hc_form,
                                                   head=m.hc_head)
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
  return type_table(m, kind, length, dtype)[0]


def type_table(m: ModelConfig, kind: str, length: int, dtype: Any = DTYPE, also_at: tuple[int, ...] = ()
               ) -> tuple[list[dict[str, Any]], dict[str, Layer]]:
  """layer_type_table's rows, and the checked Layer of each type's first layer (what its per-layer
  figures are of), for a caller that derives more figures from the same layers (attn.count.hf).
  also_at: more cache lengths; each row then has "kv_bytes_at" {L: its layers' cache at L} for length
  and these, summed layer by layer in the same walk (a type's layers may cache differently)."""
  check_length("length", length)
  lengths = tuple(dict.fromkeys((length, *also_at)))
  rows: dict[str, dict[str, Any]] = {}
  first: dict[str, Layer] = {}
  encoder_decoder = kind == "encoder_decoder"
  for b in _stack_of(m, _stack(m, kind), cross=encoder_decoder).blocks:
    if b.attention is None:  # an MLP-only block (block_kinds)
      continue
    layer, name = b.attention, b.type
    shared = kind == "decoder_lm" and b.reads_other  # not _caches(m, kind, b.index)
    if name not in rows:
      first[name], head = layer, layer.cfg
      rows[name] = {"type": name, "variant": layer.name, "layers": 0, "kv_shared_layers": 0, "window": head.window,
                    "rope_theta": head.rope_theta if head.rope_dim else None,
                    "params_per_layer": layer.analytic_params(),
                    "flops_fwd_per_layer": layer.flops(length),
                    "kv_bytes_per_token_per_layer": layer.kv_cache_bytes_per_token(dtype),
                    "kv_bytes_at_L_per_layer": layer.kv_cache_bytes(length, dtype),
                    "params": 0, "flops_fwd": 0, "kv_bytes_at_L": 0}
    row = rows[name]
    row["layers"] += 1
    row["kv_shared_layers"] += shared
    # A sharing layer: no key-side weights, no key and value projections, no cache of its own.
    row["params"] += _attention(b)
    # Each layer's own figures: a layer of the type may differ from its first (a shared indexer layer,
    # ModelConfig.indexer_types, has no index weights, FLOPs or keys cached).
    same = layer.cfg.replace(layer=1) == first[name].cfg.replace(layer=1)
    flops = row["flops_fwd_per_layer"] if same else layer.flops(length)
    row["flops_fwd"] += flops - (_flops_saved(layer.name, layer.cfg, length) if shared else 0)
    own = row["kv_bytes_at_L_per_layer"] if same else layer.kv_cache_bytes(length, dtype)
    row["kv_bytes_at_L"] += 0 if shared else own
    if also_at:
      at = row.setdefault("kv_bytes_at", dict.fromkeys(lengths, 0))
      for L in lengths:
        at[L] += 0 if shared else own if L == length else layer.kv_cache_bytes(L, dtype)
  out = list(rows.values())
  total = {"type": "total", "layers": sum(r["layers"] for r in out)}
  for key in ("params", "flops_fwd", "kv_bytes_at_L"):
    total[key] = sum(r[key] for r in out)
  return out + [total], first


def model_kv_cache_bytes(m: ModelConfig, kind: str, length: int, dtype: Any = DTYPE) -> int:
  """Bytes the decoding stack caches after `length` tokens, each layer by its own type."""
  if kind not in ("decoder_lm", "encoder_decoder"):
    raise invalid("kind", kind, "decoder_lm or encoder_decoder: only decoders keep a KV cache")
  return layer_type_table(m, kind, length, dtype)[-1]["kv_bytes_at_L"]


def active_param_count(m: ModelConfig, kind: str = "decoder_lm", breakdown: dict[str, int] | None = None) -> int:
  """Parameters one token uses: the whole model less the experts its router does not keep
  (breakdown: model_param_breakdown(m, kind), where the caller has it)."""
  total = sum((model_param_breakdown(m, kind) if breakdown is None else breakdown).values())
  if m.mlp != "moe":
    return total
  experts = expert_params(m)
  stacks = [m.num_layers] + ([m.num_decoder_layers] if kind == "encoder_decoder" else [])
  moe_layers = sum(m.is_moe_layer(i) and (j > 0 or m.has_mlp(i)) for j, n in enumerate(stacks) for i in range(n))
  return total - moe_layers * (experts["total"] - experts["active"])
