"""Small transformer models built on attn.nn.MultiHeadAttention, with exactly countable parameters.

ModelConfig (attn.nn.config) covers GPT-2 (pre-norm, final LayerNorm, tied embeddings), BERT
(post-norm, embedding LayerNorm, token types, pooler), the encoder-decoder of
Vaswani et al. 2017 (post-norm, sinusoidal positions, shared embeddings) and,
with the switches below, the Llama-style and Gemma-style decoders. activation
"gelu" is the tanh approximation (GPT-2's gelu_new), "gelu_exact" the erf form
(BERT's gelu); norm_eps is the LayerNorm epsilon (GPT-2 1e-5, BERT 1e-12).
attn.nn.hf loads and saves Hugging Face weights: one Family record per
checkpoint family (GPT-2, BERT, Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3,
SmolLM3, Phi-3, gpt-oss, OLMo 2, DeepSeek-V3; plugins add more), in
attn.nn.hf.FAMILIES.

Parameters, per model (LN = 2·D when layernorm; b = 1 when use_bias else 0):
  embeddings   vocab·D [+ max_len·D learned positions] [+ num_segments·D] [+ LN if embed_norm]
  attention    the variant's own count for `head` (standard: D(HK+GK+GV) + HVD [+ biases])
  MLP          2·D·d_ff + b·(d_ff + D)
  block        attention + MLP + 2 LN (decoder blocks: + cross-attention + LN)
  stack end    + LN if final_norm (each stack of an EncoderDecoder has its own)
  output       tied: 0; else D·vocab + b·vocab
  pooler       D² + D;  classifier: [CLS] vector D (pooling "cls") + D·C + b·C
Switches for Llama-style and Gemma-style models (attn.nn.hf), each off by default:
norm_type "rmsnorm" (scale D, no bias) or "rmsnorm_plus_one" (Gemma: x̂·(1 + w));
norm "sandwich" (a norm before and after each sublayer: 2 norms per sublayer),
"after" (OLMo 2: x + norm(f(x)), the norm on the sublayer's output only, 1 per sublayer);
linear_norm, with layer_types, gives the linear_attention layers "pre" or "after" of their own
(OLMo-Hybrid: its softmax layers "after", its gated DeltaNet layers "pre"; the count is the same);
mlp "gated" (down(act(gate(x))·up(x)): 3·D·d_ff + b·(2·d_ff + D); activation
"silu" makes it SwiGLU); dense_bias (the MLP's and an untied output's biases,
None following use_bias); embed_scale (tokens × √D); logit_softcap (output
logits c·tanh(z/c)); Granite's embed_multiplier, residual_multiplier (x + r·f(x)) and
logit_divisor (logits / d), no parameters; mlm_head (Encoder: BERT's masked-LM head, D² + D + norm +
vocab, its decoder tied to the token table); mlp "moe": a mixture of experts
(attn.nn.moe, the moe_* fields), computed densely, each expert on every token:
exact, and E/k times a real MoE's expert cost.
Inkling-2 (DecoderLM): residual_conv W passes each attention's and MLP's output y through
(conv(y) + y)/sqrt(W + 1) before the residual add (attn.nn.short_conv; W·D a sublayer, decoded with its
state); moe_gate_softcap, moe_up_softcap cap its experts' SwiGLU (attn.nn.moe); attn_res_block n keeps the
residual as blocks of n layers that learned queries mix over depth before each sublayer and the output
(attn.nn.attn_res: Q·D a mix), attn_res_kv_types giving a layer type three mixes and norms, for its queries,
keys and values (per_head's kv_inputs); output_vocab the untied output layer's rows.
EncoderDecoder: the target side has its own embeddings (positions, LN) and
reuses the source token table when share_src_tgt_embeddings.
Gemma 4 (attn.nn.hf.gemma4): per_layer_dim P > 0 adds per-layer inputs (PerLayerInputs: a table
(per_layer_vocab or vocab)·L·P, a projection D·L·P and a norm over P) and, in every block after
the MLP, x + norm(out(act(gate(x))·p_l)) (2·D·P + a norm over D); layer_scalar multiplies each
block's output by a stored scalar (a buffer: loaded, not trained, not counted); double_wide_mlp
gives layers reading another layer's keys and values (kv_source) MLPs of width 2·d_ff.
Muse Spark (attn.nn.hf.muse_spark; attn.nn.norms): norm_forms gives the embedding's, the
post-sublayer and the final RMSNorms a form of their own ("scale", "plus_one", "input_scaled": the
scale before normalising, or "none": no parameter, 0 counted), post_norm_eps the norms after each
sublayer their epsilon, residual_gate τ turns each residual x + y into α⊙x + β⊙y with a learned g (D,)
per sublayer (2·D a block, held in float32 as transformers keeps them); mlp "moe" with moe_pool_width W
runs the experts at width W between D·W projections with a norm each side (2·D·W + 2·W, experts
3·W·F each), moe_router_scale multiplies the router's logits and moe_layer_types says per layer
"dense" or "sparse".
ZAYA1 (attn.nn.hf.zaya): residual_scale turns each residual x + y into (y + b)·s + (x + b')·s' (ResidualScale:
4·D a sublayer) and the embeddings into (e + b)·s (2·D); mlp "moe" with moe_router_mlp R routes through a
network of its own (D·R + 2·R + 2·(R² + R) + R·C, C the classes), moe_router_carry adds the previous expert
layer's router state times s (R,) in each expert layer but the first, moe_skip_expert adds a class that
computes nothing (attn.nn.moe).
positional "rope": no position embedding; every attention layer rotates the
first rope_dim dims of its query and key heads (HeadConfig.rope_dim, no
parameters; rope_theta, and rope_scaling "linear" or "llama3" for longer
contexts), tokens at positions 0..T−1. ModelConfig has every HeadConfig
field (with_head_fields), declared once there: the head mechanisms gate, sinks,
qk_norm, qk_norm_eps, qk_norm_plus_one, window, softcap and probability among them
(attn.variants.mechanisms).
Per-layer attention types (attn.nn.layer_types): layer_types lists one of
full_attention, sliding_attention, full_attention_nope, sliding_attention_nope
per layer (transformers' names, plus NoPE), sliding_rope_theta gives sliding
layers their own RoPE base (Gemma 3); with a window, global_every = k is the
shorthand for every k-th self-attention layer of a stack global (l % k == 0,
l counted from 1) and the rest local (0: all local; ModelConfig.layer_head);
decoding keeps a local layer's cache as a ring of `window` slots.
Cross-attention has no window.
Single-mixer blocks (block_kinds, NemotronH): one entry per layer, "attention_mlp" (the block
above; every block when None), "attention" (the attention sublayer alone: its norm, its residual)
or "mlp" (the MLP or experts sublayer alone); the counts above drop the missing sublayer and its
norms. An MLP-only block has no attention, no cache and no weights to return; its row of head_mask
(rows stay one per block) is not read, and its layer_types entry must be full_attention (unread).
The least invasive form: a block is still one TransformerBlock with the other sublayer None, so
every stack, the decoding loop and the count keep their one-block-per-layer shape.

Precision (Flax's names and meaning): param_dtype, "float32" or "bfloat16",
is the dtype parameters are stored, updated and checkpointed in; dtype is the
dtype activations and matmuls compute in, parameters cast to it on use. The
attention softmax runs in float32 whatever dtype is (attn.kernel), and so do
LayerNorm statistics (Flax) and the training loss; with param_dtype "float32"
the optimiser state and the master weights are float32 too.

Letters as in the README's table, plus F for d_ff, N for the vocabulary and L
for attention layers. Token ids outside [0, vocab) (negative ones included)
never wrap: on concrete arrays they raise ConfigError; under jit they embed as
NaN, so logits and the loss turn NaN. More positions than max_len raise
ConfigError before tracing.

Head gates (Michel et al. 2019): every model takes head_mask, float (L,H) or
(B,L,H), and passes row l to the self-attention of layer l (attn.apply's
head_mask). L is the number of self-attention layers: num_layers, and for
EncoderDecoder num_layers + num_decoder_layers (encoder rows first, then the
decoder's causal self-attention); cross-attention is never gated.

Attention weights: DecoderLM, Encoder (and Encoder.hidden) and
SequenceClassifier take return_weights=True and then return (output, [w_BHTS
of each self-attention layer]), the softmax weights of attn.apply's
return_weights; attn.analysis.attention_stats reads them.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from attn import api
from attn.config import HeadConfig, check_ids, invalid
from attn.nn import attn_res, decoding, hyper, index_sharing, kv_sharing, layer_types, moe, norms, short_conv
from attn.nn.attention import MultiHeadAttention
from attn.nn.config import ModelConfig

Array = jax.Array
_EMBED_INIT = nnx.initializers.normal(0.02)  # GPT-2 / BERT embedding scale


def _require(cfg: ModelConfig, model: str, **wanted) -> None:
  """Refuses fields the model would silently ignore, so parameter counts stay honest.

  wanted maps a field to the one value the model accepts, or to "> 0".
  """
  for name, want in wanted.items():
    value = getattr(cfg, name)
    if not (value > 0 if want == "> 0" else value == want):
      raise invalid(name, value, f"{want} for {model}")


def _is_concrete(x) -> bool:
  return not isinstance(x, jax.core.Tracer)


def check_lengths(name: str, lengths: Any, batch: int, length: int) -> None:
  """(B,) integer lengths; concrete ones must lie in [0, length]."""
  shape = getattr(lengths, "shape", None)
  if shape is None or tuple(shape) != (batch,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise invalid(f"{name}.shape", shape, f"({batch},) integer lengths, one per example")
  if _is_concrete(lengths) and batch:
    a = np.asarray(lengths)
    lo, hi = int(a.min()), int(a.max())
    if lo < 0 or hi > length:
      raise invalid(name, f"lengths in [{lo}, {hi}]", f"lengths in [0, {length}]")


def layer_gates(head_mask: Any, batch: int, layers: int, heads: int) -> list:
  """Row l of an (L,H) or (B,L,H) head mask for each of the L layers; Nones without one."""
  if head_mask is None:
    return [None] * layers
  shape = getattr(head_mask, "shape", None)
  if shape is None or tuple(shape) not in ((layers, heads), (batch, layers, heads)):
    raise invalid("head_mask.shape", None if shape is None else tuple(shape),
                  f"(L, H)=({layers}, {heads}) or (B, L, H)=({batch}, {layers}, {heads}): "
                  "one gate per self-attention layer and query head")
  if "float" not in str(head_mask.dtype):
    raise invalid("head_mask.dtype", str(head_mask.dtype),
                  "a float dtype: gates are differentiable")
  return [head_mask[l] if len(shape) == 2 else head_mask[:, l] for l in range(layers)]


def lookup(table: Array, ids: Array) -> Array:
  """Rows of table; ids outside [0, rows) give NaN rows instead of wrapping or clamping."""
  ids = jnp.where(ids < 0, table.shape[0], ids)
  return jnp.take(table, ids, axis=0, mode="fill", fill_value=jnp.nan)


def sinusoidal(T: int, D: int, offset=0) -> Array:
  """Vaswani et al. 2017 §3.5: PE(p, 2i) = sin(p / 10000^(2i/D)), PE(p, 2i+1) = cos(same).

  Positions offset..offset+T−1 (offset may be traced: decoding).
  """
  p_T1 = (offset + jnp.arange(T, dtype=jnp.float32))[:, None]
  i_D = jnp.arange(D)
  angle_TD = p_T1 / jnp.power(10000.0, (2 * (i_D // 2)) / D)
  return jnp.where(i_D % 2 == 0, jnp.sin(angle_TD), jnp.cos(angle_TD))


class RMSNorm(nnx.Module):
  """x / sqrt(mean over D of x² + eps) times scale (Llama), or times 1 + scale (Gemma); float32 inside.

  place (attn.nn.norms.NORM_PLACES): where it sits, which may give it another form (cfg.norm_forms:
  Muse Spark's input-scaled and weightless norms) and epsilon (cfg.post_norm_eps).
  """

  def __init__(self, cfg: ModelConfig, dim: int | None = None, place: str = "pre"):
    self.plus_one, self.eps, self.dtype = cfg.norm_type == "rmsnorm_plus_one", cfg.norm_eps, cfg.compute_dtype
    self.form = None if cfg.norm_forms is None else cfg.norm_forms.get(place)  # None: norm_type's, as before
    self.eps = cfg.norm_eps_at(place)
    start = 0.0 if self.plus_one else 1.0
    if self.form is not None:
      start = norms.initial_scale(self.form)
    self.scale = None if start is None else nnx.Param(jnp.full((dim or cfg.d_model,), start, cfg.weight_dtype))

  def __call__(self, x_BTD: Array) -> Array:
    if self.form is not None:
      return norms.rms(x_BTD, None if self.scale is None else self.scale[...], self.eps,
                       self.form).astype(self.dtype)
    x = x_BTD.astype(jnp.float32)
    y = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
    scale = self.scale[...].astype(jnp.float32)
    return (y * (1.0 + scale if self.plus_one else scale)).astype(self.dtype)


def layer_norm(cfg: ModelConfig, rngs: nnx.Rngs, wanted: bool = True, dim: int | None = None,
               place: str = "pre") -> nnx.Module | None:
  """The norm over D (or dim) of cfg.norm_type (statistics in float32) at `place` (RMSNorm), or None
  when not wanted or cfg.layernorm is False."""
  if not (wanted and cfg.layernorm):
    return None
  if cfg.norm_type != "layernorm":
    return RMSNorm(cfg, dim, place)
  return nnx.LayerNorm(dim or cfg.d_model, epsilon=cfg.norm_eps, dtype=cfg.compute_dtype,
                       param_dtype=cfg.weight_dtype, rngs=rngs)


def linear(cfg: ModelConfig, d_in: int, d_out: int, rngs: nnx.Rngs, use_bias: bool = True) -> nnx.Linear:
  """nnx.Linear storing cfg.param_dtype, computing in cfg.dtype."""
  return nnx.Linear(d_in, d_out, use_bias=use_bias, dtype=cfg.compute_dtype,
                    param_dtype=cfg.weight_dtype, rngs=rngs)


def embedding(cfg: ModelConfig, init, key: Array, shape: tuple[int, ...]) -> nnx.Param:
  """A table drawn in float32 and stored in cfg.param_dtype (rounded once: the same start as float32)."""
  return nnx.Param(init(key, shape).astype(cfg.weight_dtype))


def _norm(norm: nnx.LayerNorm | None, x: Array) -> Array:
  return x if norm is None else norm(x)


class Embeddings(nnx.Module):
  """Token + position (+ token type) embeddings, optionally followed by a LayerNorm."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, token: nnx.Param | None = None,
               segments: bool = True):
    self.cfg = cfg
    self.token = token if token is not None else embedding(
        cfg, nnx.initializers.normal(cfg.embed_init_std), rngs.params(), (cfg.vocab_size, cfg.d_model))
    self.position = embedding(cfg, _EMBED_INIT, rngs.params(), (cfg.max_len, cfg.d_model)) \
        if cfg.positional == "learned" else None
    self.segment = embedding(cfg, _EMBED_INIT, rngs.params(), (cfg.num_segments, cfg.d_model)) \
        if segments and cfg.num_segments else None
    self.norm = layer_norm(cfg, rngs, cfg.embed_norm, place="embed")
    # ZAYA's residual_scale: the embeddings (e + b)·s, last (input_hidden_states_bias, _scale)
    self.input_bias = nnx.Param(jnp.zeros((cfg.d_model,), cfg.weight_dtype)) if cfg.residual_scale else None
    self.input_scale = nnx.Param(jnp.ones((cfg.d_model,), cfg.weight_dtype)) if cfg.residual_scale else None

  def check(self, tokens_BT: Array, segments_BT: Array | None = None, extra: int = 0) -> None:
    """Checks ids and that T + extra positions fit in max_len, before any tracing."""
    check_ids("tokens", tokens_BT, self.cfg.vocab_size)
    T = tokens_BT.shape[1] + extra
    if T > self.cfg.max_len:
      raise invalid("tokens.shape[1]", tokens_BT.shape[1],
                    f"at most max_len={self.cfg.max_len - extra} positions"
                    + (" (one is taken by [CLS])" if extra else ""))
    if segments_BT is not None:
      if self.segment is None:
        raise invalid("segments", "given", "None: this model has num_segments=0")
      check_ids("segments", segments_BT, self.cfg.num_segments)
      if segments_BT.shape != tokens_BT.shape:
        raise invalid("segments.shape", segments_BT.shape,
                      f"equal to tokens.shape={tokens_BT.shape}")

  def __call__(self, tokens_BT: Array, segments_BT: Array | None = None,
               prefix_D: Array | None = None, offset=0) -> Array:
    """(B,T,D), or (B,1+T,D) with prefix_D (a [CLS] vector) at position 0 (type 0).

    offset: the position of the first token (decoding), in range by the caller's check.
    """
    dtype = self.cfg.compute_dtype
    x_BTD = lookup(self.token[...].astype(dtype), tokens_BT)
    if self.cfg.embed_scale:
      x_BTD = x_BTD * jnp.asarray(np.sqrt(self.cfg.d_model), dtype)
    if self.cfg.embed_multiplier != 1.0:  # Granite's embedding_multiplier
      x_BTD = x_BTD * jnp.asarray(self.cfg.embed_multiplier, dtype)
    if prefix_D is not None:
      prefix_B1D = jnp.broadcast_to(prefix_D, (x_BTD.shape[0], 1, x_BTD.shape[2]))
      x_BTD = jnp.concatenate([prefix_B1D.astype(x_BTD.dtype), x_BTD], axis=1)
    T = x_BTD.shape[1]
    if self.position is not None:
      table = self.position[...]
      x_BTD = x_BTD + (table[:T] if isinstance(offset, int) and offset == 0
                       else jax.lax.dynamic_slice_in_dim(table, offset, T)).astype(dtype)
    elif self.cfg.positional == "sinusoidal":
      x_BTD = x_BTD + sinusoidal(T, self.cfg.d_model, offset).astype(dtype)
    if self.segment is not None:
      seg_BT = jnp.zeros(tokens_BT.shape, jnp.int32) if segments_BT is None else segments_BT
      if prefix_D is not None:
        seg_BT = jnp.pad(seg_BT, ((0, 0), (1, 0)))
      x_BTD = x_BTD + lookup(self.segment[...].astype(dtype), seg_BT)
    x_BTD = _norm(self.norm, x_BTD)
    if self.input_scale is not None:
      x_BTD = (x_BTD + self.input_bias[...].astype(x_BTD.dtype)) * self.input_scale[...].astype(x_BTD.dtype)
    return x_BTD


def activate(name: str, x: Array) -> Array:
  """cfg.activation: "gelu" (tanh form), "gelu_exact" (erf), "relu", "silu" or "relu2" (relu(x)²: NemotronH)."""
  if name == "relu":
    return jax.nn.relu(x)
  if name == "relu2":
    return jnp.square(jax.nn.relu(x))
  if name == "silu":
    return jax.nn.silu(x)
  return jax.nn.gelu(x, approximate=name == "gelu")


class MLP(nnx.Module):
  """D -> d_ff -> activation -> D; gated (cfg.mlp): down(act(gate(x)) * up(x)) (Shazeer 2020).

  mlp "moe" builds gated ones (its dense layers and shared experts); d_ff overrides cfg.d_ff.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, d_ff: int | None = None, shared: bool = False):
    self.activation = cfg.activation
    # DeepSeek-V4's shared experts clamp as its routed ones (moe_swiglu_form "clamp"), Ling-3's after the
    # activation ("clamp_after": its shared experts, not its dense layers' MLPs)
    form = cfg.moe_swiglu_form
    clamps = cfg.mlp == "moe" and (form == "clamp" or form == "clamp_after" and shared)
    self.limit = cfg.moe_swiglu_limit if clamps else None
    self.after = form == "clamp_after"
    bias, F = cfg.has_dense_bias, d_ff or cfg.d_ff
    self.gate = linear(cfg, cfg.d_model, F, rngs, bias) if cfg.mlp in ("gated", "moe") else None
    self.up = linear(cfg, cfg.d_model, F, rngs, bias)
    self.down = linear(cfg, F, cfg.d_model, rngs, bias)

  def __call__(self, x_BTD: Array) -> Array:
    if self.gate is None:
      return self.down(activate(self.activation, self.up(x_BTD)))
    g_BTF, u_BTF = self.gate(x_BTD), self.up(x_BTD)
    if self.limit is not None and self.after:
      h_BTF = jnp.minimum(activate(self.activation, g_BTF), self.limit) * jnp.clip(u_BTF, -self.limit, self.limit)
      return self.down(h_BTF)
    if self.limit is not None:
      g_BTF, u_BTF = jnp.minimum(g_BTF, self.limit), jnp.clip(u_BTF, -self.limit, self.limit)
    return self.down(activate(self.activation, g_BTF) * u_BTF)


def _times(f, r: float, h: Array) -> Array:
  """f(h)·r in f's output dtype (Granite's residual_multiplier)."""
  y = f(h)
  return y * jnp.asarray(r, y.dtype)


class ResidualScale(nnx.Module):
  """ZAYA's ZayaResidualScaling (ModelConfig.residual_scale): a sublayer's x + y becomes
  (y + b_y)·s_y + (x + b_x)·s_x, four learned (D,) vectors, starting at the plain sum (s = 1, b = 0)."""

  def __init__(self, cfg: ModelConfig):
    D, dt = cfg.d_model, cfg.weight_dtype
    self.out_scale, self.out_bias = nnx.Param(jnp.ones((D,), dt)), nnx.Param(jnp.zeros((D,), dt))
    self.res_scale, self.res_bias = nnx.Param(jnp.ones((D,), dt)), nnx.Param(jnp.zeros((D,), dt))

  def __call__(self, x_BTD: Array, y_BTD: Array) -> Array:
    c = lambda a: a[...].astype(x_BTD.dtype)  # noqa: E731
    y_BTD = (y_BTD.astype(x_BTD.dtype) + c(self.out_bias)) * c(self.out_scale)
    return y_BTD + (x_BTD + c(self.res_bias)) * c(self.res_scale)


class TransformerBlock(nnx.Module):
  """Self-attention (+ cross-attention) + MLP, each a residual sublayer, pre- or post-norm."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, cross: bool = False,
               head: HeadConfig | None = None, experts: bool = False, variant: str | None = None,
               d_ff: int | None = None, kind: str = "attention_mlp", hashed: bool = False,
               norm: str | None = None, carried: bool = False, index: int = 0):
    norm = cfg.norm if norm is None else norm  # this layer's (ModelConfig.block_norm)
    self.post_norm = norm == "post"
    self.residual_multiplier = float(cfg.residual_multiplier)  # Granite's: x + r·f(x)
    has_attn, has_mlp = kind != "mlp", kind != "attention"  # ModelConfig.block_kinds
    sandwich = norm in ("sandwich", "after")  # Gemma 2: x + post(f(pre(x))); OLMo 2: x + post(f(x))
    pre = norm != "after"
    head = cfg.head if head is None else head  # this layer's (ModelConfig.layer_head)
    dtypes = dict(dtype=cfg.compute_dtype, param_dtype=cfg.weight_dtype,
                  impl=None if cfg.impl == "auto" else cfg.impl)
    self.attn = MultiHeadAttention(head, variant or cfg.variant, rngs=rngs, **dtypes) if has_attn else None
    self.conv = short_conv.ShortConv(cfg.short_conv, cfg.d_model, rngs=rngs, param_dtype=cfg.weight_dtype) \
        if has_attn and cfg.short_conv is not None else None  # before the attention (attn.nn.short_conv)
    self.attn_norm = layer_norm(cfg, rngs, pre and has_attn)
    # Inkling-2: each sublayer's output through (conv(y) + y)/sqrt(W + 1) (attn.nn.short_conv.ResidualConv)
    out_conv = lambda on: short_conv.ResidualConv(cfg.residual_conv, cfg.d_model, rngs=rngs) \
        if on and cfg.residual_conv is not None else None
    self.attn_out_conv, self.mlp_out_conv = out_conv(has_attn), out_conv(has_mlp)
    # A window is about positions in one sequence: cross-attention reads the whole context.
    self.cross = MultiHeadAttention(head.replace(window=None), cfg.variant, rngs=rngs, **dtypes) \
        if cross else None
    self.cross_norm = layer_norm(cfg, rngs, pre and cross)
    self.mlp = None if not has_mlp else MLP(cfg, rngs=rngs, d_ff=d_ff) if not experts else moe.MoE(
        cfg, rngs=rngs, activation=lambda x: activate(cfg.activation, x),
        shared=MLP(cfg, rngs=rngs, d_ff=cfg.moe_shared_d_ff or (cfg.moe_d_ff or cfg.d_ff) * cfg.moe_shared_experts,
                   shared=True)
        if cfg.moe_shared_experts else None, hashed=hashed, carried=carried)
    self.mlp_norm = layer_norm(cfg, rngs, pre and has_mlp)
    self.attn_post_norm = layer_norm(cfg, rngs, sandwich and has_attn, place="attn_post")
    self.cross_post_norm = layer_norm(cfg, rngs, sandwich and cross, place="attn_post")
    self.mlp_post_norm = layer_norm(cfg, rngs, sandwich and has_mlp, place="mlp_post")
    # Muse Spark's residual gates (attn.nn.norms): α⊙x + β⊙y around each sublayer, g (D,) in float32
    gate = lambda on: nnx.Param(jnp.zeros((cfg.d_model,), jnp.float32)) if on and cfg.residual_gate else None
    self.temperature = cfg.residual_gate
    self.attn_residual_gate, self.mlp_residual_gate = gate(has_attn), gate(has_mlp)
    # ZAYA's residual scaling (ResidualScale) around each sublayer
    self.attn_scale = ResidualScale(cfg) if has_attn and cfg.residual_scale else None
    self.mlp_scale = ResidualScale(cfg) if has_mlp and cfg.residual_scale else None
    # Gemma 4: x + norm(out(act(gate(x))·p_l)), p_l this layer's per-layer input; then x·scalar.
    P = cfg.per_layer_dim
    self.activation = cfg.activation
    self.per_layer_gate = linear(cfg, cfg.d_model, P, rngs, False) if P else None
    self.per_layer_out = linear(cfg, P, cfg.d_model, rngs, False) if P else None
    self.per_layer_norm = layer_norm(cfg, rngs, bool(P))
    self.scalar = moe.Buffer(jnp.ones((1,), cfg.weight_dtype)) if cfg.layer_scalar else None
    n = cfg.hc_mult  # hyper-connections (attn.nn.hyper): one around each sublayer
    hc = lambda on: hyper.HyperConnection(n, cfg.d_model, iters=cfg.hc_sinkhorn_iters, eps=cfg.hc_eps,
                                          norm_eps=cfg.norm_eps, rngs=rngs, form=cfg.hc_form,
                                          magnitude=cfg.hc_magnitude) if on and n > 1 else None
    self.attn_hc, self.cross_hc, self.mlp_hc = hc(True), hc(cross), hc(True)
    # Block attention residuals (attn.nn.attn_res): depth mixes before the attention and the MLP
    n = cfg.attn_res_block
    split = n is not None and layer_types.layer_type(cfg, index) in cfg.attn_res_kv_types
    self.res_boundary = n is not None and index % n == 0
    self.attn_input = attn_res.DepthMix(cfg.d_model, 3 if split else 1) if n is not None and index > 0 else None
    self.mlp_input = attn_res.DepthMix(cfg.d_model) if n is not None else None
    self.attn_k_norm = layer_norm(cfg, rngs, split)  # the keys' and values' own input norms
    self.attn_v_norm = layer_norm(cfg, rngs, split)

  def _residual(self, norm, f, x_BTD: Array, post=None, hc=None, gate=None, scale=None) -> Array:
    if self.residual_multiplier != 1.0:
      f = functools.partial(_times, f, self.residual_multiplier)
    if scale is not None:  # ZAYA: (post(f(pre(x))) + b)·s + (x + b')·s'
      return scale(x_BTD, _norm(post, f(_norm(norm, x_BTD))))
    if gate is not None:  # Muse Spark: α⊙x + β⊙post(f(pre(x))) (attn.nn.norms)
      return norms.residual_gate(gate[...], self.temperature, x_BTD, _norm(post, f(_norm(norm, x_BTD))))
    if hc is not None:  # x (B,T,n,D): n streams mixed around the sublayer (pre-norm only)
      return hc(lambda h: _norm(post, f(_norm(norm, h))), x_BTD)
    # Post-norm (Vaswani, BERT): LN(x + f(x)); pre-norm (GPT-2): x + f(LN(x));
    # sandwich (Gemma 2): x + post(f(pre(x))); after (OLMo 2): x + post(f(x)).
    if self.post_norm:
      return _norm(norm, x_BTD + f(x_BTD))
    return x_BTD + _norm(post, f(_norm(norm, x_BTD)))

  def _attn_res(self, x_BTD: Array, states: list, attend, decode: bool, tokens) -> Array:
    """One layer of block attention residuals (attn.nn.attn_res); appends x to states at a boundary."""
    dtype = x_BTD.dtype
    mixes = [x_BTD] * (1 if self.attn_k_norm is None else 3) if self.attn_input is None else \
        self.attn_input(states, x_BTD)
    h_BTD = _norm(self.attn_norm, mixes[0].astype(dtype))
    kv = None if self.attn_k_norm is None else (self.attn_k_norm(mixes[1].astype(dtype)),
                                                self.attn_v_norm(mixes[2].astype(dtype)))
    a_BTD = attend(h_BTD, kv).astype(jnp.float32)
    if self.res_boundary:
      states.append(x_BTD)
      r_BTD = a_BTD
    else:
      r_BTD = x_BTD.astype(jnp.float32) + a_BTD
    m_BTD = self.mlp_input(states, r_BTD)[0]
    mlp = self.mlp if getattr(self.mlp, "tid2eid", None) is None else lambda h: self.mlp(h, tokens)
    y_BTD = mlp(_norm(self.mlp_norm, m_BTD.astype(dtype)))
    if self.mlp_out_conv is not None:
      y_BTD = self.mlp_out_conv(y_BTD, decode=decode)
    return (r_BTD + y_BTD.astype(jnp.float32)).astype(dtype)

  def __call__(self, x_BTD: Array, mask: Array | None = None, context_BSD: Array | None = None,
               context_mask: Array | None = None, head_mask: Array | None = None,
               return_weights: bool = False, is_causal: bool = False,
               kv_lengths: Array | None = None, context_kv_lengths: Array | None = None,
               decode: bool = False, per_layer_input: Array | None = None, tokens: Array | None = None,
               block_states: list | None = None):
    """x (B,T,D); with return_weights, (x, self-attention weights (B,H,T,S)).

    per_layer_input (B,T,P): this layer's slice of the per-layer inputs (cfg.per_layer_dim).
    tokens (B,T): the token ids, which a hash-routed expert layer reads (cfg.moe_hash_first).
    block_states: the block states so far (cfg.attn_res_block; attn.nn.attn_res), appended to at a boundary.

    decode=True: the self-attention reads and extends its KV cache (MultiHeadAttention).

    head_mask (H,) or (B,H) gates the heads of the self-attention only.
    is_causal and kv_lengths are the self-attention's structured masks,
    context_kv_lengths the cross-attention's (attn.apply).
    """
    seen = []

    def attend(h_BTD: Array, kv_inputs=None) -> Array:
      if self.conv is not None:
        h_BTD = self.conv(h_BTD, decode=decode)
      y = self.attn(h_BTD, mask=mask, head_mask=head_mask, return_weights=return_weights,
                    is_causal=is_causal, kv_lengths=kv_lengths, decode=decode, kv_inputs=kv_inputs)
      if return_weights:
        y, w_BHTS = y
        seen.append(w_BHTS)
      return y if self.attn_out_conv is None else self.attn_out_conv(y, decode=decode)

    if self.mlp_input is not None:  # block attention residuals (attn.nn.attn_res)
      x_BTD = self._attn_res(x_BTD, block_states, attend, decode, tokens)
      return (x_BTD, seen[0] if seen else None) if return_weights else x_BTD
    if self.attn is not None:
      x_BTD = self._residual(self.attn_norm, attend, x_BTD, self.attn_post_norm, self.attn_hc,
                             self.attn_residual_gate, self.attn_scale)
    if self.cross is not None:
      x_BTD = self._residual(
          self.cross_norm, lambda h: self.cross(h, context_BSD, mask=context_mask,
                                                kv_lengths=context_kv_lengths), x_BTD,
          self.cross_post_norm, self.cross_hc)
    if self.mlp is not None:  # a hash-routed expert layer reads the token ids (moe_hash_first)
      mlp = self.mlp if getattr(self.mlp, "tid2eid", None) is None else lambda h: self.mlp(h, tokens)
      if self.mlp_out_conv is not None:  # Inkling-2's post_mlp_convolution
        mlp = (lambda f: lambda h: self.mlp_out_conv(f(h), decode=decode))(mlp)
      x_BTD = self._residual(self.mlp_norm, mlp, x_BTD, self.mlp_post_norm, self.mlp_hc, self.mlp_residual_gate,
                             self.mlp_scale)
    if self.per_layer_gate is not None:
      g_BTP = activate(self.activation, self.per_layer_gate(x_BTD)) * per_layer_input.astype(x_BTD.dtype)
      x_BTD = x_BTD + _norm(self.per_layer_norm, self.per_layer_out(g_BTP))
    if self.scalar is not None:
      x_BTD = x_BTD * self.scalar[...].astype(x_BTD.dtype)
    return (x_BTD, seen[0] if seen else None) if return_weights else x_BTD


# Set by record_residuals: the list run_blocks appends each block's output to.
RESIDUALS: contextvars.ContextVar = contextvars.ContextVar("attn_residuals", default=None)


@contextlib.contextmanager
def record_residuals():
  """Yields a list; each model call inside appends every block's output h (B,T,D), in order.

  The residual stream after each block, as attn analyze reads it for the
  "massive activations" of Sun et al. 2024. Works under jit (at trace time).
  """
  seen: list = []
  token = RESIDUALS.set(seen)
  try:
    yield seen
  finally:
    RESIDUALS.reset(token)


def run_blocks(blocks, h_BTD: Array, gates, return_weights: bool, per_layer: Array | None = None,
               **masks_kw):
  """h through each block with its row of gates (and slice of per_layer (B,T,L,P)); (h, [w_BHTS
  per block] or [])."""
  weights, seen = [], RESIDUALS.get()
  if getattr(blocks[0], "mlp_input", None) is not None:  # block attention residuals: the states so far
    masks_kw = masks_kw | {"block_states": masks_kw.get("block_states", [])}
  # cross-layer KV sharing (ModelConfig.kv_source) and indexer choices (ModelConfig.indexer_types)
  # and the experts' router state (ModelConfig.moe_router_carry, attn.nn.moe.carrying)
  with kv_sharing.model_call(blocks), index_sharing.model_call(blocks) as chosen, moe.carrying(blocks):
    for i, (block, gate) in enumerate(zip(blocks, gates)):
      if per_layer is not None:
        masks_kw["per_layer_input"] = per_layer[:, :, i]
      with kv_sharing.layer(block.attn, i), index_sharing.layer(chosen, i):
        h_BTD = block(h_BTD, head_mask=gate, return_weights=return_weights, **masks_kw)
      if return_weights:
        h_BTD, w_BHTS = h_BTD
        if w_BHTS is not None:  # an MLP-only block (ModelConfig.block_kinds) has none
          weights.append(w_BHTS)
      if seen is not None:
        seen.append(h_BTD)
  return h_BTD, weights


def _blocks(cfg: ModelConfig, n: int, rngs: nnx.Rngs, cross: bool = False) -> nnx.List:
  wide = lambda i: 2 * cfg.d_ff if cfg.double_wide_mlp and not cross and kv_sharing.source(cfg, i) != i else None
  blocks = [TransformerBlock(cfg, rngs=rngs, cross=cross, head=cfg.layer_head(i), experts=cfg.is_moe_layer(i),
                             variant=cfg.layer_variant(i), d_ff=wide(i), hashed=cfg.is_hash_layer(i),
                             carried=not cross and cfg.router_carried(i),
                             kind="attention_mlp" if cross or cfg.block_kinds is None else cfg.block_kinds[i],
                             norm=cfg.norm if cross else cfg.block_norm(i), index=i)
            for i in range(n)]
  for i, block in enumerate(blocks):
    if not cross and kv_sharing.source(cfg, i) != i:  # reads layer kv_source[i]'s keys and values
      block.attn.kv_source = kv_sharing.source(cfg, i)
      for name in kv_sharing.dropped(block.attn.variant, block.attn.cfg):  # and holds none of its own
        del block.attn.params[name]
  return nnx.List(blocks)


class Encoder(nnx.Module):
  """Bidirectional encoder: embeddings -> blocks (-> final LN); with pooler, tanh(W h_0 + b)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    _require(cfg, "Encoder (per-layer inputs, hyper-connections, causal residual convolutions, attention "
             "residuals: DecoderLM only)", per_layer_dim=0, hc_mult=1, residual_conv=None, attn_res_block=None)
    layer_types.check_bidirectional(cfg, "an Encoder")
    self.cfg = cfg
    self.embed = Embeddings(cfg, rngs=rngs)
    self.blocks = _blocks(cfg, cfg.num_layers, rngs)
    self.final_norm = layer_norm(cfg, rngs, cfg.final_norm, place="final")
    self.pooler = linear(cfg, cfg.d_model, cfg.d_model, rngs) if cfg.pooler else None
    self.mlm = MLMHead(cfg, self.embed.token, rngs=rngs) if cfg.mlm_head else None

  def mlm_logits(self, h_BTD: Array) -> Array:
    """Masked-LM logits (B,T,vocab) of hidden states (cfg.mlm_head)."""
    if self.mlm is None:
      raise invalid("mlm_head", False, "True: this Encoder has no masked-LM head")
    return self.mlm(h_BTD)

  def hidden(self, tokens_BT: Array, segments_BT: Array | None = None,
             lengths_B: Array | None = None, prefix_D: Array | None = None,
             head_mask: Array | None = None, return_weights: bool = False):
    """Final hidden states (B,T,D) (1+T with prefix_D); keys past lengths_B are masked.

    With return_weights, (h, [self-attention weights (B,H,T,S) of each layer]).
    """
    extra = 0 if prefix_D is None else 1
    self.embed.check(tokens_BT, segments_BT, extra)
    B, T = tokens_BT.shape
    gates = layer_gates(head_mask, B, len(self.blocks), self.cfg.num_heads)
    kv_lengths = None
    if lengths_B is not None:
      check_lengths("lengths", lengths_B, B, T)
      kv_lengths = lengths_B + extra
    h_BTD = self.embed(tokens_BT, segments_BT, prefix_D)
    h_BTD, weights = run_blocks(self.blocks, h_BTD, gates, return_weights, kv_lengths=kv_lengths)
    h_BTD = _norm(self.final_norm, h_BTD)
    return (h_BTD, weights) if return_weights else h_BTD

  def pool(self, h_BD: Array) -> Array:
    """The BERT pooler, tanh(h W + b), or h unchanged without one."""
    return h_BD if self.pooler is None else jnp.tanh(self.pooler(h_BD))

  def __call__(self, tokens_BT: Array, segments_BT: Array | None = None,
               lengths_B: Array | None = None, head_mask: Array | None = None,
               return_weights: bool = False):
    """h (B,T,D); with cfg.pooler, (h, pooled (B,D) from the first position).

    With return_weights, (that, [self-attention weights (B,H,T,S) of each layer]).
    """
    h_BTD = self.hidden(tokens_BT, segments_BT, lengths_B, head_mask=head_mask,
                        return_weights=return_weights)
    h_BTD, weights = h_BTD if return_weights else (h_BTD, None)
    out = (h_BTD, self.pool(h_BTD[:, 0])) if self.pooler is not None else h_BTD
    return (out, weights) if return_weights else out


class MLMHead(nnx.Module):
  """BERT's masked-LM head: dense D->D, activation, norm, then the token table (tied) plus a bias."""

  def __init__(self, cfg: ModelConfig, token: nnx.Param, *, rngs: nnx.Rngs):
    self.activation = cfg.activation
    self.transform = linear(cfg, cfg.d_model, cfg.d_model, rngs)
    self.norm = layer_norm(cfg, rngs)
    self.tied = token
    self.bias = nnx.Param(jnp.zeros((cfg.vocab_size,), cfg.weight_dtype))

  def __call__(self, h_BTD: Array) -> Array:
    h_BTD = _norm(self.norm, activate(self.activation, self.transform(h_BTD)))
    logits_BTN = jnp.einsum("BTD,ND->BTN", h_BTD, self.tied[...].astype(h_BTD.dtype))
    return logits_BTN + self.bias[...].astype(h_BTD.dtype)


class OutputHead(nnx.Module):
  """Logits over the vocabulary: tied to a token table (hᵀE) or a separate (D, vocab) linear, or (D,
  output_vocab) (Inkling-2's unembedding of its unpadded_vocab_size rows: logits over the first ids only, so
  decoding never emits the padded ones).

  With cfg.logit_divisor d, logits / d (Granite's logits_scaling); with cfg.logit_softcap c, then
  logits -> c·tanh(logits/c) (Gemma 2's final soft-cap).
  """

  def __init__(self, cfg: ModelConfig, token: nnx.Param, *, rngs: nnx.Rngs):
    self.tied = token if cfg.tie_embeddings else None
    self.linear = None if cfg.tie_embeddings else linear(cfg, cfg.d_model, cfg.output_rows, rngs,
                                                         cfg.has_dense_bias)
    self.softcap = cfg.logit_softcap
    self.divisor = float(cfg.logit_divisor)

  def __call__(self, h_BTD: Array) -> Array:
    if self.linear is not None:
      logits_BTN = self.linear(h_BTD)
    else:
      logits_BTN = jnp.einsum("BTD,ND->BTN", h_BTD, self.tied[...].astype(h_BTD.dtype))
    if self.divisor != 1.0:  # Granite's logits_scaling
      logits_BTN = logits_BTN / jnp.asarray(self.divisor, logits_BTN.dtype)
    if self.softcap is not None:
      logits_BTN = self.softcap * jnp.tanh(logits_BTN / self.softcap)
    return logits_BTN


class PerLayerInputs(nnx.Module):
  """Gemma 4's per-layer inputs (B,T,L,P): ((norm(x·W·D^-½) + E_l[token]·√P) / √2, one slice per layer,
  x the scaled token embeddings, W (D, L·P), E (per_layer_vocab or vocab, L·P), norm over each P."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.L, self.P, self.D, self.dtype = cfg.num_layers, cfg.per_layer_dim, cfg.d_model, cfg.compute_dtype
    rows = cfg.per_layer_vocab or cfg.vocab_size
    self.token = embedding(cfg, nnx.initializers.normal(cfg.embed_init_std), rngs.params(),
                           (rows, self.L * self.P))
    self.proj = linear(cfg, cfg.d_model, self.L * self.P, rngs, False)
    self.norm = layer_norm(cfg, rngs, dim=self.P)

  def __call__(self, tokens_BT: Array, x_BTD: Array) -> Array:
    B, T = tokens_BT.shape
    t_BTLP = lookup(self.token[...].astype(self.dtype), tokens_BT).reshape(B, T, self.L, self.P)
    t_BTLP = t_BTLP * jnp.asarray(np.sqrt(self.P), self.dtype)
    p_BTLP = (self.proj(x_BTD) * jnp.asarray(self.D ** -0.5, self.dtype)).reshape(B, T, self.L, self.P)
    return (_norm(self.norm, p_BTLP) + t_BTLP) * jnp.asarray(2.0 ** -0.5, self.dtype)


class DecoderLM(nnx.Module):
  """Causal language model (GPT-2 style): tokens (B,T) -> logits (B,T,vocab)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    _require(cfg, "DecoderLM", num_segments=0, pooler=False, num_decoder_layers=0, num_classes=0,
             mlm_head=False)
    self.cfg = cfg
    self.embed = Embeddings(cfg, rngs=rngs, segments=False)
    self.per_layer = PerLayerInputs(cfg, rngs=rngs) if cfg.per_layer_dim else None
    self.blocks = _blocks(cfg, cfg.num_layers, rngs)
    self.final_norm = layer_norm(cfg, rngs, cfg.final_norm, place="final")
    self.head = OutputHead(cfg, self.embed.token, rngs=rngs)
    self.hc_head = hyper.head(cfg, rngs)
    self.final_input = attn_res.DepthMix(cfg.d_model) if cfg.attn_res_block is not None else None

  def _run(self, h_BTD: Array, gates, return_weights: bool, per_layer, **kw):
    """run_blocks, then (block attention residuals) the final depth mix over the block states."""
    if self.final_input is None:
      return run_blocks(self.blocks, h_BTD, gates, return_weights, per_layer, **kw)
    states: list = []
    h_BTD, weights = run_blocks(self.blocks, h_BTD, gates, return_weights, per_layer, block_states=states, **kw)
    return self.final_input(states, h_BTD)[0].astype(h_BTD.dtype), weights

  def _streams(self, h_BTD: Array, run) -> Array:
    """run(h) on the residual: one stream, or hc_mult streams expanded and collapsed (attn.nn.hyper)."""
    if self.hc_head is None:
      return run(h_BTD)
    h_BTnD, weights = run(hyper.expand(h_BTD, self.cfg.hc_mult))
    return self.hc_head(h_BTnD), weights

  def __call__(self, tokens_BT: Array, head_mask: Array | None = None,
               return_weights: bool = False, lengths_B: Array | None = None,
               decode: bool = False):
    """Logits (B,T,vocab); position t sees tokens up to t, so right padding needs no mask.

    lengths_B (B,) also masks the keys past each length (Hugging Face's attention_mask for
    right padding), which changes only the logits at padded positions.
    With return_weights, (logits, [self-attention weights (B,H,T,T) of each layer]).
    decode=True: tokens_BT follow the tokens already in the KV cache (init_cache first).
    """
    if decode:
      return self._decode(tokens_BT, head_mask, return_weights, lengths_B)
    self.embed.check(tokens_BT)
    B, T = tokens_BT.shape
    gates = layer_gates(head_mask, B, len(self.blocks), self.cfg.num_heads)
    if lengths_B is not None:
      check_lengths("lengths", lengths_B, B, T)
    h_BTD = self.embed(tokens_BT)
    per_layer = None if self.per_layer is None else self.per_layer(tokens_BT, h_BTD)
    h_BTD, weights = self._streams(h_BTD, lambda h: self._run(
        h, gates, return_weights, per_layer, is_causal=True, kv_lengths=lengths_B, tokens=tokens_BT))
    logits_BTN = self.head(_norm(self.final_norm, h_BTD))
    return (logits_BTN, weights) if return_weights else logits_BTN

  def _decode(self, tokens_BT: Array, head_mask, return_weights: bool, lengths_B) -> Array:
    """Logits (B,T,vocab) of tokens_BT placed after the cached tokens; the caches grow by T."""
    if return_weights:
      raise invalid("return_weights", True, "False with decode=True")
    if lengths_B is not None:
      raise invalid("lengths", "given", "None with decode=True: decoding is causal against the "
                    "cache's fill")
    check_ids("tokens", tokens_BT, self.cfg.vocab_size)
    index, B, M = decoding.cache_state(self)
    T = tokens_BT.shape[1]
    if tokens_BT.shape[0] != B:
      raise invalid("tokens.shape[0]", tokens_BT.shape[0], f"the cache's batch size {B}")
    if _is_concrete(index) and int(index) + T > M:
      raise invalid("tokens.shape[1]", T, f"at most max_len - cache_index = {M} - {int(index)} = "
                    f"{M - int(index)}: positions beyond the cache")
    gates = layer_gates(head_mask, B, len(self.blocks), self.cfg.num_heads)
    h_BTD = self.embed(tokens_BT, offset=index)
    per_layer = None if self.per_layer is None else self.per_layer(tokens_BT, h_BTD)
    h_BTD, _ = self._streams(h_BTD, lambda h: self._run(h, gates, False, per_layer, decode=True, tokens=tokens_BT))
    return self.head(_norm(self.final_norm, h_BTD))

  def init_cache(self, batch_size: int, max_len: int, dtype=jnp.float32) -> None:
    """Empty KV caches in every layer for decode=True, max_len tokens (prompt + generated)."""
    decoding.init_cache(self, batch_size, max_len, dtype)

  def generate(self, prompt_BT: Array, steps: int, *, temperature: float = 0.0,
               key: Array | None = None) -> Array:
    """(B, T + steps): the prompt then `steps` tokens, greedy (temperature 0) or sampled."""
    return decoding.generate(self, prompt_BT, steps, temperature=temperature, key=key)


class SequenceClassifier(nnx.Module):
  """Encoder + pooling ([CLS] vector or mean over real tokens) (+ pooler) + linear head."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    _require(cfg, "SequenceClassifier", hc_mult=1, num_classes="> 0", num_decoder_layers=0, mlm_head=False)
    self.cfg = cfg
    self.encoder = Encoder(cfg, rngs=rngs)
    self.cls = embedding(cfg, _EMBED_INIT, rngs.params(), (cfg.d_model,)) \
        if cfg.pooling == "cls" else None
    self.head = linear(cfg, cfg.d_model, cfg.num_classes, rngs, cfg.use_bias)

  def __call__(self, tokens_BT: Array, lengths_B: Array | None = None,
               segments_BT: Array | None = None, head_mask: Array | None = None,
               return_weights: bool = False):
    """Logits (B, num_classes); tokens past lengths_B are padding and change nothing.

    With return_weights, (logits, [self-attention weights (B,H,T',T') of each layer]), T' = 1+T
    with a [CLS] position first (pooling "cls"), else T.
    """
    prefix_D = self.cls[...] if self.cls is not None else None
    h_BTD = self.encoder.hidden(tokens_BT, segments_BT, lengths_B, prefix_D=prefix_D,
                                head_mask=head_mask, return_weights=return_weights)
    h_BTD, weights = h_BTD if return_weights else (h_BTD, None)
    if self.cls is not None:
      pooled_BD = h_BTD[:, 0]
    else:
      T = tokens_BT.shape[1]
      lengths_B = jnp.full(tokens_BT.shape[:1], T) if lengths_B is None else lengths_B
      keep_BT = jnp.arange(T)[None, :] < lengths_B[:, None]
      # where(), not a multiply, so that NaN or inf at padded positions cannot leak in.
      total_BD = jnp.where(keep_BT[..., None], h_BTD, 0.0).sum(axis=1)
      pooled_BD = total_BD / jnp.maximum(lengths_B, 1)[:, None].astype(h_BTD.dtype)
    logits_BC = self.head(self.encoder.pool(pooled_BD))
    return (logits_BC, weights) if return_weights else logits_BC


class EncoderDecoder(nnx.Module):
  """Vaswani et al. 2017: an encoder, and decoder blocks of causal self-, cross-attention, MLP."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    _require(cfg, "EncoderDecoder", hc_mult=1, num_decoder_layers="> 0", pooler=False, num_segments=0, per_layer_dim=0,
             num_classes=0, mlm_head=False)
    self.cfg = cfg
    self.encoder = Encoder(cfg, rngs=rngs)
    token = self.encoder.embed.token if cfg.share_src_tgt_embeddings else None
    self.tgt_embed = Embeddings(cfg, rngs=rngs, token=token, segments=False)
    self.decoder = _blocks(cfg, cfg.num_decoder_layers, rngs, cross=True)
    self.decoder_norm = layer_norm(cfg, rngs, cfg.final_norm, place="final")
    self.head = OutputHead(cfg, self.tgt_embed.token, rngs=rngs)

  def __call__(self, src_BS: Array, tgt_BT: Array, src_lengths: Array | None = None,
               head_mask: Array | None = None) -> Array:
    """Logits (B,T,vocab) for every target position, given the whole source.

    head_mask (L,H) or (B,L,H), L = num_layers + num_decoder_layers: encoder
    self-attention rows first, then decoder self-attention; cross-attention is not gated.
    """
    self.tgt_embed.check(tgt_BT)
    if src_BS.shape[:1] != tgt_BT.shape[:1]:
      raise invalid("tgt.shape", tgt_BT.shape, f"the batch size of src.shape={src_BS.shape}")
    n_enc = len(self.encoder.blocks)
    gates = layer_gates(head_mask, src_BS.shape[0], n_enc + len(self.decoder), self.cfg.num_heads)
    enc_mask = None if head_mask is None else (
        head_mask[:n_enc] if head_mask.ndim == 2 else head_mask[:, :n_enc])
    mem_BSD = self.encoder.hidden(src_BS, lengths_B=src_lengths, head_mask=enc_mask)
    h_BTD = self.tgt_embed(tgt_BT)
    for block, gate in zip(self.decoder, gates[n_enc:]):
      h_BTD = block(h_BTD, context_BSD=mem_BSD, head_mask=gate, is_causal=True,
                    context_kv_lengths=src_lengths)
    return self.head(_norm(self.decoder_norm, h_BTD))


# Model kind -> class. The kinds are attn.count's (count.model_param_count(cfg, kind) is the
# one way to count a model's parameters) and the experiment tasks' (task.kind).
MODELS: dict[str, type[nnx.Module]] = {"encoder": Encoder, "decoder_lm": DecoderLM,
                                       "classifier": SequenceClassifier,
                                       "encoder_decoder": EncoderDecoder}
