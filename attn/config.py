"""HeadConfig: the one place where attention dimensions are validated.

Dimension letters (README): B batch, T query length, S key/value length,
D d_model, H query heads, G key/value heads, K query/key width per head,
V value width per head.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from typing import Any

import numpy as np
from jax.core import Tracer as _Tracer


class ConfigError(ValueError):
  """A configuration, shape or mask that attn refuses, with what is allowed."""


def invalid(field: str, value: Any, allowed: str) -> ConfigError:
  """The error every check raises: names the field, the value and what is allowed."""
  return ConfigError(f"{field}={value!r} is not allowed: {allowed}")


def kept_at(default: Any) -> str:
  """What a refusal allows for a setting that must stay at its default: "unset (None)" for None, else the value."""
  return "it must be unset (None)" if default is None else repr(default)


def did_you_mean(name: Any, choices: Any) -> str:
  """'did you mean 'x'? ' for the choices closest to a misspelt name (difflib), or '' when none is close."""
  if not isinstance(name, str):
    return ""
  close = difflib.get_close_matches(name, [c for c in choices if isinstance(c, str)], n=2, cutoff=0.75)
  return f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""


def _positive_int(field: str, value: Any) -> None:
  if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
    raise invalid(field, value, "a positive integer")


GATES = (None, "headwise", "elementwise")
QKV_CONVS = (None, "q", "k", "v", "qk", "qv", "kv", "qkv")
PROBABILITIES = ("softmax", "sigmoid", "relu")  # logits -> weights (attn.kernel.probability)
QK_NORMS = (False, True, "whole", "fixed")  # off, per head (Qwen3), over the whole projection (OLMo 2),
# per head without learned scales, the queries times qk_scale_factor (Muse Spark)
GATE_ACTIVATIONS = ("sigmoid", "softplus")  # the output gate's function: σ (Qiu et al. 2025), softplus (Laguna)
ROPE_SCALINGS = (None, "linear", "llama3", "yarn")  # transformers' rope_type names; the loaders map each
ROPE_SCALING_KINDS = ROPE_SCALINGS  # every kind a HeadConfig takes (the same tuple: the old name)
ROPE_LAYOUTS = ("half", "interleaved", "none")  # which dims pair: i with i + r/2 (rotate_half), 2i with 2i + 1;
# "none": the rope_dim dims are not turned (Kimi Linear's MLA keeps DeepSeek's decoupled key, unrotated)
# The fields only one or two rope_scaling kinds read; with any other kind they stay at their defaults.
_SCALING_FIELDS = {"rope_low_freq_factor": ("llama3",), "rope_high_freq_factor": ("llama3",),
                   "rope_original_max_len": ("llama3", "yarn"), "rope_beta_fast": ("yarn",),
                   "rope_beta_slow": ("yarn",), "rope_attention_factor": ("yarn",),
                   "rope_truncate": ("yarn",), "rope_mscale_all_dim": ("yarn",)}


def _positive_number(field: str, value: Any, what: str) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
      or value <= 0:
    raise invalid(field, value, f"a positive finite number ({what})")


# HeadConfig fields that a model sets for each layer itself, not model settings (ModelConfig
# leaves them out).
PER_LAYER_FIELDS = ("layer",)


@dataclasses.dataclass(frozen=True)
class HeadConfig:
  """Dimensions of one attention layer; d_k and d_v are free of d_model/num_heads.

  d_k and d_v default to d_model // num_heads when num_heads divides d_model.
  num_kv_heads (G) defaults to num_heads; H must be a multiple of G, and query
  head h reads key/value head h // (H // G). collab_width is the shared
  query/key width D̃_k of the collaborative variant (default num_heads * d_k).
  scale multiplies the scores (default 1/sqrt(d_k)).

  rope_dim (even, <= d_k; 0 = off): the first rope_dim dims of every query and
  key head rotate by position (RoPE, Su et al. 2021), pairing dim i with
  i + rope_dim/2 (the half-split convention of GPT-NeoX and Hugging Face),
  frequency ω_i = rope_theta^(-2i/rope_dim); rope_layout "interleaved" pairs
  dims 2i and 2i + 1 instead (DeepSeek's stored layout; the same scores up to a
  permutation of the rotated dims); "none" turns nothing (the rope_dim dims stay
  as they are: Kimi Linear's MLA, DeepSeek's decoupled key without positions). rope_dim < d_k is a partial rotary width
  (Phi-3's partial_rotary_factor). rope_scaling rescales the ω_i
  (attn.variants.rope.frequencies; transformers' rope_type of the same name):
  "linear" divides every ω_i by rope_factor (position interpolation, Chen et
  al. 2023: positions / factor); "llama3" (Meta's Llama 3.1 rule) divides by
  rope_factor the ω_i whose wavelength λ_i = 2π/ω_i is longer than
  rope_original_max_len / rope_low_freq_factor, keeps those shorter than
  rope_original_max_len / rope_high_freq_factor, and between the two takes
  (1 − s)·ω_i/rope_factor + s·ω_i, s = (rope_original_max_len/λ_i − low)/(high
  − low), continuous at both ends. Neither touches the score scale
  (transformers' attention_factor is 1 for both). "yarn" (Peng et al. 2023)
  ramps from ω_i/rope_factor to ω_i across the dims that turn between
  rope_beta_slow and rope_beta_fast times within rope_original_max_len
  (rope_truncate rounds that band outward to whole dims, as transformers
  does by default; gpt-oss turns it off), and multiplies the rotated dims of
  queries and keys by rope_attention_factor (None: 0.1·ln(rope_factor) + 1),
  so their scores by its square; rope_mscale_all_dim m (DeepSeek's
  mscale_all_dim, None: off) multiplies the score scale by (0.1·m·ln(rope_factor)
  + 1)², as transformers' yarn_apply_mscale does. Without "llama3" its three
  fields stay at their defaults (1, 4, 8192: Llama 3.1's), likewise yarn's, and without scaling
  rope_factor at 1: a setting that would be ignored is refused. latent_dim is
  mla's KV latent width d_c (default 4 * d_k, DeepSeek-V2's d_c = 4·d_h);
  q_latent_dim, if set, gives mla a low-rank query path through a latent of
  that width; latent_norm_eps, if set, RMS-normalises mla's latents (the KV
  latent, and the query latent with q_latent_dim) with learned scales at that
  epsilon (DeepSeek's kv_a_layernorm and q_a_layernorm).

  Head mechanisms any variant can carry (attn.variants.mechanisms; a variant
  that cannot refuses one in its check): gate None, "headwise" or
  "elementwise" multiplies each query head's output by σ(x·W_gate + b_gate)
  before W^O (Qiu et al. 2025, G1); sinks adds one learned logit per query head
  to every softmax denominator (gpt-oss); qk_norm True RMS-normalises every query
  and key head over its d_k dims, with learned scales shared by the heads,
  before RoPE (Qwen3), epsilon qk_norm_eps; qk_norm "whole" normalises the whole
  query projection over its H·d_k dims and the key projection over G·d_k, one
  scale per dim, before the split into heads (OLMo 2): it couples the heads;
  qk_norm_plus_one makes those scales w in x̂·(1 + w), initialised at 0 (Gemma 3's
  q_norm and k_norm, held as the checkpoint's w, so they are written back bit for
  bit; unused without qk_norm, like qk_norm_eps); qk_norm "fixed" RMS-normalises each query and
  key head with no learned scale and multiplies the queries by qk_scale_factor (Muse Spark: the
  logits are then at most qk_scale_factor·√d_k·scale in size, whatever the weights); gate_activation
  "softplus" puts softplus(x·W_gate + b_gate) in the gate's σ place (Laguna); value_scale
  multiplies every value by a constant (MiMo-V2-Flash's attention_value_scale, with its d_v < d_k
  heads), the same as scaling each head's output, which is where attn applies it; output_norm_eps
  RMS-normalises each head's output over its d_v dims with no learned scale, before the gate (Muse
  Spark's o_norm); window keeps the keys closer than
  `window` to the query (kernel.attention: with causal masks, the window keys
  ending at the query itself); softcap caps the scaled logits to
  softcap·tanh(logits/softcap) (Gemma 2); qk_l2_clip_threshold c scales every query and key
  head vector longer than c down to L2 norm c, q·min(1, c/(‖q‖ + 1e-6)), after QK-norm and
  before RoPE (Inkling-2's L2 clip), with qk_clip_scale the queries first times a learned scale per head
  and dim; token_sinks gives each query token its own sink logit per head, x·w_sink (Inkling-2's
  sink_proj); rel_bias_dim d > 0 adds to each logit a relative position bias mixed from the query token,
  its per-head state (x·w_rel times a learned scale, L2-clipped to rel_bias_clip) against a bank of d
  profiles over the distances 0..rel_bias_extent−1, zero beyond (Inkling-2's rel_logits_proj, wr_du);
  log_scaling_alpha α scales the queries (and those states) at position p by 1 + α·log(max((p + 1)/
  log_scaling_floor, 1)) after the clip (Inkling-2's full layers; attn.variants.mechanisms.token_logits);
  qkv_conv ("q", "k", "v", "qk", "qv", "kv" or "qkv") runs the
  named projections through a short causal convolution over time, depthwise per head and channel,
  qkv_conv_width taps, before QK-norm, value_norm_eps's norm and RoPE (Inkling-2's short convolutions on keys
  and values; decoding keeps the last width − 1 projections as a state beside the cache); qkv_conv_residual
  makes it (conv(x) + x)/sqrt(W + 1) and qkv_conv_dynamic adds per-token taps read from the projection's input
  (the same for every channel of a head), (conv(x) + dyn(x) + x)/sqrt(2W + 1) (Inkling-2's forms); cca switches on ZAYA1's
  compressed convolutional attention (attn.variants.mechanisms.cca: queries and keys through a causal
  depthwise convolution of cca_depthwise_width taps then a per-head one of cca_grouped_width taps, plus
  the q–k mean; the second half of the value channels delayed one token; queries and keys L2-normalised
  to √d_k, the keys times a learned temperature per kv head); probability turns the logits into
  weights: "softmax" (the default), "sigmoid" σ(l − log n) (Ramapuram et al.
  2024) or "relu" max(l, 0)/n (Wortsman et al. 2023), n the keys the row's
  masks leave visible (attn.kernel.probability; learned sinks need "softmax").
  q_rank and kv_rank are tpa's ranks R_q and R_kv (Zhang et al. 2025: each
  token's queries are a sum of q_rank head-by-dim outer products, its keys and
  values of kv_rank each; default 6 and 2, the paper's). conv_width and chunk are the
  fixed-state heads' (gated_deltanet, kda, mamba2, linear, gla; attn.variants.linear): the width
  of the short causal convolution over their inputs (4, Qwen3-Next's and Mamba-2's) and the
  tokens one step of the chunked scan covers (64, MaxText's and fla's); gated_norm_eps the
  epsilon of gated_deltanet's and kda's gated output RMSNorm (1e-6, Qwen3-Next's; Kimi
  Linear's is its rms_norm_eps); linear_allow_neg_eigval makes their delta rule's write strength
  β = 2σ(x·W_b) in [0, 2] instead of σ(x·W_b) (OLMo-Hybrid; Grazzi et al. 2025: the transition
  I − β·k·kᵀ then has an eigenvalue 1 − β in [−1, 1], which lets a linear RNN track state such as
  parity). kda_full_rank gives kda its decay and output gate through full-rank projections (Ling-3's
  f_proj and g_proj) instead of Kimi Linear's low-rank pairs; kda_lower_bound b < 0 makes kda's
  decay the bounded b·σ(exp(A_log)·(x·W_f + dt_bias)) (Ling-3's safe gate; None: the softplus
  form). value_norm_eps, if
  set, gives per_head's and k_eq_v's values a weightless RMSNorm over each head at that epsilon
  (Gemma 4's v_norm). o_groups and o_rank are grouped_lowrank's output
  projection (DeepSeek-V4's o_groups, o_lora_rank): the heads in o_groups
  groups, each group's H/o_groups·d_v outputs through its own rank-o_rank map
  (None: H/o_groups·d_v, full rank). compress_block and compress_overlap are
  compressed's blocks of m tokens pooled into one key and value, and whether each
  pools 2m tokens at stride m (DeepSeek-V4's compress rates 4 and 128; its CSA
  overlap). compress_index_heads, _dim and _topk (all 0: none) are compressed_shared's
  indexer over its entries (DeepSeek-V4's CSA lightning indexer: index_n_heads,
  index_head_dim, index_topk). layer is the layer's
  1-based index in its model, for differential's λ_init; set by the models.
  extra maps an outside head mechanism's name to its options ({"my_gate":
  {"width": 3}}; attn.variants.mechanisms says why one field): the mechanism's
  record validates them (attn.api.check_config); {} is None.
  """

  d_model: int
  num_heads: int
  d_k: int | None = None
  d_v: int | None = None
  num_kv_heads: int | None = None
  use_bias: bool = True
  collab_width: int | None = None
  scale: float | None = None
  rope_dim: int = 0
  rope_theta: float = 10000.0
  rope_scaling: str | None = None
  rope_factor: float = 1.0
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  rope_original_max_len: int = 8192
  rope_layout: str = "half"
  rope_beta_fast: float = 32.0
  rope_beta_slow: float = 1.0
  rope_attention_factor: float | None = None
  rope_truncate: bool = True
  rope_mscale_all_dim: float | None = None
  latent_dim: int | None = None
  q_latent_dim: int | None = None
  latent_norm_eps: float | None = None
  gate: str | None = None
  gate_activation: str = "sigmoid"  # or "softplus" (Laguna's g_proj)
  sinks: bool = False
  qk_norm: bool | str = False  # True: per head (Qwen3); "whole": over the projection (OLMo 2); "fixed" (Muse Spark)
  qk_scale_factor: float = 1.0  # qk_norm "fixed": the normalised queries times this (Muse Spark's qk_scale_factor)
  value_scale: float | None = None  # each head's values times this constant (MiMo-V2-Flash's attention_value_scale)
  output_norm_eps: float | None = None  # each head's output RMS-normalised, no scale, before the gate (Muse Spark)
  qk_norm_eps: float = 1e-6
  qk_norm_plus_one: bool = False  # the scales are w in x̂·(1 + w) (Gemma 3), initialised at 0
  window: int | None = None
  softcap: float | None = None
  qk_l2_clip_threshold: float | None = None
  qk_clip_scale: bool = False  # qk_l2_clip: the queries times a learned q_clip_scale (H,K) before the clip (Inkling-2)
  token_sinks: bool = False  # a sink logit per head computed from each query token, x·w_sink (Inkling-2's sink_proj)
  rel_bias_dim: int = 0  # d_rel > 0: a relative position bias mixed from each query token (Inkling-2's rel_logits_proj)
  rel_bias_extent: int = 0  # its distances 0..extent−1 (Inkling-2's rel_extent; the window on sliding layers)
  rel_bias_clip: float | None = None  # its per-head relative states' L2 clip (Inkling-2's rel_l2_clip_threshold)
  log_scaling_alpha: float | None = None  # queries (and relative states) times 1 + α·log(max((p+1)/floor, 1)) (Inkling-2)
  log_scaling_floor: int = 1  # that floor (Inkling-2's log_scaling_n_floor)
  qkv_conv: str | None = None
  qkv_conv_width: int = 4
  qkv_conv_residual: bool = False  # (conv(x) + x)/sqrt(W + 1): the input added back, Inkling-2's form
  qkv_conv_dynamic: bool = False  # per-token taps x_in·qkv_conv_dyn_* on top, (… + x)/sqrt(2W + 1) (Inkling-2's hybrid layers)
  cca: bool = False  # ZAYA1's compressed convolutional attention (attn.variants.mechanisms.cca)
  cca_depthwise_width: int = 2  # its depthwise convolution's taps (ZAYA's cca_time0)
  cca_grouped_width: int = 2  # its per-head grouped convolution's taps (ZAYA's cca_time1)
  probability: str = "softmax"
  q_rank: int = 6
  kv_rank: int = 2
  conv_width: int = 4
  chunk: int = 64
  gated_norm_eps: float = 1e-6
  linear_allow_neg_eigval: bool = False
  kda_full_rank: bool = False  # kda: full-rank decay and gate projections (Ling-3's f_proj, g_proj)
  kda_lower_bound: float | None = None  # kda: the bounded decay b·σ(·), b < 0 (Ling-3's kda_lower_bound)
  value_norm_eps: float | None = None
  o_groups: int = 1
  o_rank: int | None = None
  compress_block: int | None = None
  compress_overlap: bool = False
  compress_index_heads: int = 0
  compress_index_dim: int = 0
  compress_index_topk: int = 0
  layer: int = 1
  extra: dict | None = None

  def __post_init__(self):
    _positive_int("d_model", self.d_model)
    _positive_int("num_heads", self.num_heads)
    for name in ("d_k", "d_v"):
      value = getattr(self, name)
      if value is None:
        if self.d_model % self.num_heads:
          raise invalid(
              name, None,
              f"give {name} explicitly when num_heads={self.num_heads} does not "
              f"divide d_model={self.d_model}")
        object.__setattr__(self, name, self.d_model // self.num_heads)
      else:
        _positive_int(name, value)
    if self.num_kv_heads is None:
      object.__setattr__(self, "num_kv_heads", self.num_heads)
    _positive_int("num_kv_heads", self.num_kv_heads)
    if self.num_heads % self.num_kv_heads:
      raise invalid(
          "num_kv_heads", self.num_kv_heads,
          f"a divisor of num_heads={self.num_heads} (grouped heads: H = G * R)")
    if not isinstance(self.use_bias, bool):
      raise invalid("use_bias", self.use_bias, "True or False")
    if self.collab_width is None:
      object.__setattr__(self, "collab_width", self.num_heads * self.d_k)
    _positive_int("collab_width", self.collab_width)
    if self.scale is not None:
      if isinstance(self.scale, bool) or not isinstance(self.scale, (int, float)) \
          or not math.isfinite(self.scale) or self.scale <= 0:
        raise invalid("scale", self.scale, "a positive finite number or None")
    self._check_latent_and_rope()
    self._check_mechanisms()
    object.__setattr__(self, "extra", _frozen_extra(self.extra))

  def _check_latent_and_rope(self) -> None:
    r = self.rope_dim
    if isinstance(r, bool) or not isinstance(r, int) or r < 0 or r % 2 or r > self.d_k:
      raise invalid("rope_dim", r,
                    f"an even integer in [0, d_k={self.d_k}]: RoPE rotates pairs of query/key dims")
    _positive_number("rope_theta", self.rope_theta, "the RoPE base, 10000 by default")
    if self.rope_layout not in ROPE_LAYOUTS:
      raise invalid("rope_layout", self.rope_layout, f"one of {list(ROPE_LAYOUTS)}: dim i pairs with "
                    "i + rope_dim/2 (half, transformers' rotate_half) or 2i with 2i + 1 (interleaved), or "
                    "none turns (none)")
    if self.rope_layout == "none" and self.rope_scaling is not None:
      raise invalid("rope_scaling", self.rope_scaling, "None with rope_layout='none': nothing turns to rescale")
    self._check_rope_scaling()
    if self.latent_dim is None:
      object.__setattr__(self, "latent_dim", 4 * self.d_k)
    _positive_int("latent_dim", self.latent_dim)
    if self.q_latent_dim is not None:
      _positive_int("q_latent_dim", self.q_latent_dim)
    if self.latent_norm_eps is not None:
      _positive_number("latent_norm_eps", self.latent_norm_eps,
                       "the epsilon of mla's latent RMSNorms, or None for none")
    for name in ("q_rank", "kv_rank", "conv_width", "chunk", "layer"):
      _positive_int(name, getattr(self, name))
    self._check_layouts()

  def _check_cca(self) -> None:
    if not isinstance(self.cca, bool):
      raise invalid("cca", self.cca, "True or False (True: ZAYA1's compressed convolutional attention)")
    for name, what in (("cca_depthwise_width", "depthwise convolution per query and key channel (ZAYA's cca_time0)"),
                       ("cca_grouped_width", "grouped convolution within each query and key head (ZAYA's "
                        "cca_time1)")):
      w = getattr(self, name)
      if isinstance(w, bool) or not isinstance(w, int) or w < 1:
        raise invalid(name, w, f"an integer >= 1: the taps of cca's causal {what}")
      if not self.cca and w != 2:
        raise invalid(name, w, "2 (its default) when cca=False: only cca reads it")
    if self.cca and (self.num_kv_heads * self.d_v) % 2:
      raise invalid("cca", True, f"False when num_kv_heads·d_v = {self.num_kv_heads}·{self.d_v} is odd: cca "
                    "splits the G·d_v value channels into a current half and a half delayed one token")

  def _check_layouts(self) -> None:
    _positive_number("gated_norm_eps", self.gated_norm_eps,
                     "the epsilon of gated_deltanet's and kda's gated output norm, 1e-6 by default")
    if self.value_norm_eps is not None:
      _positive_number("value_norm_eps", self.value_norm_eps,
                       "the epsilon of the values' weightless RMSNorm (per_head, k_eq_v), or None for none")
    if not isinstance(self.linear_allow_neg_eigval, bool):
      raise invalid("linear_allow_neg_eigval", self.linear_allow_neg_eigval, "True or False (True: the "
                    "delta rule's β = 2σ(·) in [0, 2], gated_deltanet and kda)")
    if not isinstance(self.kda_full_rank, bool):
      raise invalid("kda_full_rank", self.kda_full_rank, "True or False (True: kda's decay and gate through "
                    "full-rank projections, Ling-3's)")
    b = self.kda_lower_bound
    if b is not None and (isinstance(b, bool) or not isinstance(b, (int, float)) or not -math.inf < b < 0):
      raise invalid("kda_lower_bound", b, "None (the softplus decay) or a negative finite number: kda's "
                    "bounded decay b·σ(·) in (b, 0), Ling-3's kda_lower_bound (-5.0)")
    _positive_int("o_groups", self.o_groups)
    if self.num_heads % self.o_groups:
      raise invalid("o_groups", self.o_groups, f"a divisor of num_heads={self.num_heads}: each output "
                    "group holds num_heads/o_groups whole heads")
    if self.o_rank is not None:
      _positive_int("o_rank", self.o_rank)
    if self.compress_block is not None:
      _positive_int("compress_block", self.compress_block)
    if not isinstance(self.compress_overlap, bool):
      raise invalid("compress_overlap", self.compress_overlap, "True or False")
    index = (self.compress_index_heads, self.compress_index_dim, self.compress_index_topk)
    for name, value in zip(("compress_index_heads", "compress_index_dim", "compress_index_topk"), index):
      if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise invalid(name, value, "a non-negative integer (0: no indexer)")
    if any(index) and not all(index):
      raise invalid("compress_index_heads, compress_index_dim, compress_index_topk", index,
                    "all positive (an indexer over the compressed entries) or all 0 (none)")

  def _check_rope_scaling(self) -> None:
    kind = self.rope_scaling
    if kind not in ROPE_SCALING_KINDS:
      raise invalid("rope_scaling", kind, f"one of {list(ROPE_SCALING_KINDS)}: how the RoPE frequencies "
                    "are scaled (transformers' rope_type; dynamic and longrope are not implemented)")
    if kind is not None and not self.rope_dim:
      raise invalid("rope_scaling", kind, "None when rope_dim=0: there are no rotated dims to scale")
    _positive_number("rope_factor", self.rope_factor, "the RoPE scaling factor")
    if kind is None and self.rope_factor != 1:
      raise invalid("rope_factor", self.rope_factor, "1.0 when rope_scaling=None: set rope_scaling "
                    "'linear', 'llama3' or 'yarn' for a factor to act")
    _positive_number("rope_low_freq_factor", self.rope_low_freq_factor, "llama3's low_freq_factor")
    _positive_number("rope_high_freq_factor", self.rope_high_freq_factor, "llama3's high_freq_factor")
    if self.rope_high_freq_factor <= self.rope_low_freq_factor:
      raise invalid("rope_high_freq_factor", self.rope_high_freq_factor,
                    f"greater than rope_low_freq_factor={self.rope_low_freq_factor}: llama3 keeps "
                    "wavelengths below rope_original_max_len / high and scales those above / low")
    _positive_int("rope_original_max_len", self.rope_original_max_len)
    _positive_number("rope_beta_fast", self.rope_beta_fast, "yarn's beta_fast")
    _positive_number("rope_beta_slow", self.rope_beta_slow, "yarn's beta_slow")
    if self.rope_attention_factor is not None:
      _positive_number("rope_attention_factor", self.rope_attention_factor,
                       "yarn's attention_factor, or None for 0.1·ln(rope_factor) + 1")
    if not isinstance(self.rope_truncate, bool):
      raise invalid("rope_truncate", self.rope_truncate, "True or False")
    if self.rope_mscale_all_dim is not None:
      _positive_number("rope_mscale_all_dim", self.rope_mscale_all_dim,
                       "DeepSeek's mscale_all_dim, or None for the plain 1/sqrt(d_k) scale")
    defaults = {f.name: f.default for f in dataclasses.fields(self)}  # Llama 3.1's and YaRN's values
    for name, readers in _SCALING_FIELDS.items():
      default = defaults[name]
      if kind not in readers and getattr(self, name) != default:
        raise invalid(name, getattr(self, name), f"{default!r} when rope_scaling={kind!r}: only "
                      f"rope_scaling {' or '.join(map(repr, readers))} reads it")

  def _check_mechanisms(self) -> None:
    if self.gate not in GATES:
      raise invalid("gate", self.gate, f"one of {list(GATES)}: the output gate of each query head")
    if self.gate_activation not in GATE_ACTIVATIONS:
      raise invalid("gate_activation", self.gate_activation, f"one of {list(GATE_ACTIVATIONS)}: the output "
                    "gate's function of x·W_gate")
    if self.gate is None and self.gate_activation != "sigmoid":
      raise invalid("gate_activation", self.gate_activation, "'sigmoid' when gate=None: there is no gate "
                    "to read it")
    if self.output_norm_eps is not None:
      _positive_number("output_norm_eps", self.output_norm_eps, "the epsilon of each head output's weightless "
                       "RMSNorm (Muse Spark's o_norm), or None for none")
    v = self.value_scale
    if v is not None:
      _positive_number("value_scale", v, "every value times it, or None; MiMo-V2-Flash's "
                       "attention_value_scale")
    if not isinstance(self.sinks, bool):
      raise invalid("sinks", self.sinks, "True or False")
    if self.qk_norm not in QK_NORMS or isinstance(self.qk_norm, (int, float)) and \
        not isinstance(self.qk_norm, bool):
      raise invalid("qk_norm", self.qk_norm, "True or False (True: each head over its d_k dims, Qwen3), "
                    "'whole' (the whole projection before the split into heads, OLMo 2) or 'fixed' (each "
                    "head without learned scales, the queries times qk_scale_factor, Muse Spark)")
    if self.qk_norm in (True, "fixed") and self.d_k < 2:
      raise invalid("qk_norm", self.qk_norm, f"False when d_k={self.d_k}: RMS-normalising one dim leaves "
                    "only its sign")
    _positive_number("qk_scale_factor", self.qk_scale_factor, "the queries' factor after qk_norm 'fixed'")
    if self.qk_norm == "fixed" and self.qk_norm_plus_one:
      raise invalid("qk_norm_plus_one", True, "False with qk_norm 'fixed': it has no learned scales")
    if self.qk_norm != "fixed" and self.qk_scale_factor != 1.0:
      raise invalid("qk_scale_factor", self.qk_scale_factor, f"1.0 when qk_norm={self.qk_norm!r}: only "
                    "qk_norm 'fixed' reads it")
    eps = self.qk_norm_eps
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) \
        or eps <= 0:
      raise invalid("qk_norm_eps", eps, "a positive finite number (the RMSNorm epsilon)")
    if not isinstance(self.qk_norm_plus_one, bool):
      raise invalid("qk_norm_plus_one", self.qk_norm_plus_one, "True or False (True: QK-norm scales "
                    "are w in x̂·(1 + w), Gemma 3)")
    w = self.window
    if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w <= 0):
      raise invalid("window", w, "None or a positive integer: keys closer than it to the query")
    c = self.softcap
    if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float))
                          or not math.isfinite(c) or c <= 0):
      raise invalid("softcap", c, "None or a positive finite number: logits -> c·tanh(logits/c)")
    if self.qkv_conv not in QKV_CONVS:
      raise invalid("qkv_conv", self.qkv_conv, f"None or one of {list(QKV_CONVS[1:])}: which of the "
                    "queries, keys and values go through a short causal convolution per head")
    w = self.qkv_conv_width
    if isinstance(w, bool) or not isinstance(w, int) or w < 1:
      raise invalid("qkv_conv_width", w, "an integer >= 1: the taps of qkv_conv's causal convolution "
                    "(1: a per-channel scale)")
    for name in ("qkv_conv_residual", "qkv_conv_dynamic"):
      on = getattr(self, name)
      if not isinstance(on, bool) or on and (self.qkv_conv is None or name == "qkv_conv_dynamic"
                                              and not self.qkv_conv_residual):
        raise invalid(name, on, "True or False, and False without qkv_conv" + (
            " and qkv_conv_residual (Inkling-2's per-token taps come with its residual form)"
            if name == "qkv_conv_dynamic" else ""))
    self._check_cca()
    c = self.qk_l2_clip_threshold
    if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float))
                          or not math.isfinite(c) or c <= 0):
      raise invalid("qk_l2_clip_threshold", c, "None or a positive finite number: each query and key "
                    "head vector longer than it is scaled down to that L2 norm")
    if not isinstance(self.qk_clip_scale, bool) or self.qk_clip_scale and c is None:
      raise invalid("qk_clip_scale", self.qk_clip_scale, "True or False, and False without qk_l2_clip_threshold: "
                    "the queries' learned scale before the clip")
    check_probability(self.probability, self.sinks)
    self._check_token_mechanisms()

  def _check_token_mechanisms(self) -> None:
    """token_sinks, rel_bias_*, log_scaling_* (attn.variants.mechanisms.token_logits): off by default."""
    if not isinstance(self.token_sinks, bool):
      raise invalid("token_sinks", self.token_sinks, "True or False")
    if self.token_sinks and (self.sinks or self.probability != "softmax"):
      raise invalid("token_sinks", True, f"False with sinks={self.sinks}, probability={self.probability!r}: a "
                    "sink per token replaces the learned sink per head, and needs the softmax's denominator")
    d, n = self.rel_bias_dim, self.rel_bias_extent
    if isinstance(d, bool) or not isinstance(d, int) or d < 0:
      raise invalid("rel_bias_dim", d, "an integer >= 0: the width d_rel of each head's relative state (0: no "
                    "relative position bias)")
    if isinstance(n, bool) or not isinstance(n, int) or (n < 1 if d else n != 0):
      raise invalid("rel_bias_extent", n, f"{'an integer >= 1' if d else '0'} with rel_bias_dim={d}: the "
                    "distances 0..extent−1 the relative bias covers")
    c = self.rel_bias_clip
    if c is not None and (not d or isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c)
                          or c <= 0):
      raise invalid("rel_bias_clip", c, f"None{', or a positive finite number' if d else ' with rel_bias_dim=0'}: "
                    "the relative states' L2 clip")
    a, floor = self.log_scaling_alpha, self.log_scaling_floor
    if a is not None:
      _positive_number("log_scaling_alpha", a, "α of the queries' 1 + α·log(max((p+1)/floor, 1)), or None")
    if isinstance(floor, bool) or not isinstance(floor, int) or floor < 1 or (a is None and floor != 1):
      raise invalid("log_scaling_floor", floor, "an integer >= 1, and 1 with log_scaling_alpha=None: the "
                    "position from which the log scaling grows")

  @property
  def group_size(self) -> int:
    """R = H // G: query heads that share one key/value head."""
    return self.num_heads // self.num_kv_heads

  @property
  def score_scale(self) -> float:
    """scale (default 1/sqrt(d_k)), times yarn's mscale(rope_factor, rope_mscale_all_dim)² if set."""
    base = float(self.scale) if self.scale is not None else 1.0 / math.sqrt(self.d_k)
    if self.rope_mscale_all_dim is None or self.rope_factor <= 1:
      return base
    return base * (0.1 * self.rope_mscale_all_dim * math.log(self.rope_factor) + 1.0) ** 2

  def replace(self, **changes) -> HeadConfig:
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


class FrozenDict(dict):
  """A dict that cannot change and hashes by its items, so a HeadConfig holding one stays hashable."""

  def _refuse(self, *args, **kwargs):
    raise TypeError("a HeadConfig's extra options cannot change: use cfg.replace(extra=...)")

  __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _refuse

  def __hash__(self) -> int:
    return hash(tuple(sorted(self.items())))

  def __reduce__(self):  # copy, deepcopy and pickle rebuild it whole, never item by item
    return (type(self), (dict(self),))


def _frozen_extra(extra: Any) -> FrozenDict | None:
  """None, or {mechanism name: {option: value}} with identifier names, frozen; {} is None."""
  if extra is None or (isinstance(extra, dict) and not extra):
    return None
  allowed = "None or a table {mechanism name: {option: value}} of an outside head mechanism's options"
  if not isinstance(extra, dict):
    raise invalid("extra", extra, allowed)
  out = {}
  for name, opts in extra.items():
    if not isinstance(name, str) or not name.isidentifier() or not isinstance(opts, dict):
      raise invalid("extra", dict(extra), allowed)
    for key, value in opts.items():
      if not isinstance(key, str) or not isinstance(value, (bool, int, float, str, type(None))):
        raise invalid(f"extra.{name}.{key}", value, "a number, a string or a boolean")
    out[name] = FrozenDict(opts)
  return FrozenDict(out)


def check_probability(probability: Any, sinks: Any) -> None:
  """probability one of PROBABILITIES; "softmax" when learned sinks are on."""
  if not isinstance(probability, str) or probability not in PROBABILITIES:
    raise invalid("probability", probability, f"one of {list(PROBABILITIES)}: the function that turns "
                  "attention logits into weights")
  if probability != "softmax" and sinks is not None and sinks is not False:
    raise invalid("probability", probability, "'softmax' with learned sinks: a sink is one more logit "
                  f"in a normalizing denominator, and {probability} has none (or sinks=False)")


def single_head(d_model: int, *, use_bias: bool = True) -> HeadConfig:
  """One head at full width: num_heads=1, d_k=d_v=d_model (seed question 5)."""
  return HeadConfig(d_model=d_model, num_heads=1, d_k=d_model, d_v=d_model,
                    use_bias=use_bias)


def vaswani_base(**changes) -> HeadConfig:
  """The base model of Vaswani et al. 2017: d_model=512, h=8, d_k=d_v=64."""
  return HeadConfig(d_model=512, num_heads=8, d_k=64, d_v=64).replace(**changes)


HEAD_PRESETS = {  # one attention layer; whole models are in attn.count.presets
    "vaswani-base": vaswani_base,
    "single-head": lambda: single_head(512),
    "mqa": lambda: vaswani_base(num_kv_heads=1),
    "gqa": lambda: vaswani_base(num_kv_heads=2),
}


def _shape(x: Any) -> tuple[int, ...]:
  shape = getattr(x, "shape", None)
  if shape is None:
    raise invalid("input", type(x).__name__, "an array")
  return tuple(shape)


def check_inputs(cfg: HeadConfig, x: Any, context: Any = None, mask: Any = None) -> None:
  """Checks x (B,T,D), context (B,S,D) and a mask broadcastable to (B,H,T,S)."""
  xs = _shape(x)
  if len(xs) != 3:
    raise invalid("x.shape", xs, "rank 3: (batch, query length, d_model)")
  if xs[-1] != cfg.d_model:
    raise invalid("x.shape", xs, f"last axis equal to d_model={cfg.d_model}")
  s_len = xs[1]
  if context is not None:
    cs = _shape(context)
    if len(cs) != 3 or cs[-1] != cfg.d_model or cs[0] != xs[0]:
      raise invalid("context.shape", cs,
                    f"(batch={xs[0]}, key length, d_model={cfg.d_model})")
    s_len = cs[1]
  if mask is not None:
    check_mask(mask, (xs[0], cfg.num_heads, xs[1], s_len))


def check_positions(positions: Any, batch: int, length: int) -> None:
  """RoPE positions: integers of shape (T,) or (B,T), one per query token."""
  if positions is None:
    return
  shape = getattr(positions, "shape", None)
  dtype = getattr(positions, "dtype", None)
  if shape is None or tuple(shape) not in ((length,), (batch, length)):
    raise invalid("positions.shape", None if shape is None else tuple(shape),
                  f"(T,)=({length},) or (B, T)=({batch}, {length}): one position per query token")
  if "int" not in str(dtype):
    raise invalid("positions.dtype", str(dtype), "an integer dtype")


def check_head_mask(head_mask: Any, batch: int, num_heads: int) -> None:
  """Head gates are floats of shape (H,) or (B,H): one per query head (and example)."""
  if head_mask is None:
    return
  shape = getattr(head_mask, "shape", None)
  allowed = f"(H,)=({num_heads},) or (B, H)=({batch}, {num_heads}): one gate per query head"
  if shape is None or tuple(shape) not in ((num_heads,), (batch, num_heads)):
    raise invalid("head_mask.shape", None if shape is None else tuple(shape), allowed)
  dtype = getattr(head_mask, "dtype", None)
  if "float" not in str(dtype):  # float16/32/64, bfloat16, float8_*
    raise invalid("head_mask.dtype", str(dtype), "a float dtype: gates are differentiable")


def check_kv_lengths(kv_lengths: Any, batch: int, length: int) -> None:
  """kv_lengths: (B,) integers (keys s >= kv_lengths[b] are masked); concrete ones in [0, S]."""
  if kv_lengths is None:
    return
  shape = getattr(kv_lengths, "shape", None)
  dtype = getattr(kv_lengths, "dtype", None)
  if shape is None or tuple(shape) != (batch,) or "int" not in str(dtype):
    raise invalid("kv_lengths.shape", None if shape is None else tuple(shape),
                  f"({batch},) integer key lengths, one per example")
  if batch and not isinstance(kv_lengths, _Tracer):  # under jit, values are not known
    values = np.asarray(kv_lengths)
    lo, hi = int(values.min()), int(values.max())
    if lo < 0 or hi > length:
      raise invalid("kv_lengths", f"lengths in [{lo}, {hi}]", f"lengths in [0, S={length}]")


def check_structured(is_causal: Any, kv_lengths: Any, batch: int, length: int) -> None:
  """is_causal is a bool and kv_lengths None or (B,) integers in [0, S]."""
  if not isinstance(is_causal, bool):
    raise invalid("is_causal", is_causal, "True or False")
  check_kv_lengths(kv_lengths, batch, length)


def check_mask(mask: Any, target_BHTS: tuple[int, int, int, int]) -> None:
  """A mask is boolean (True = may attend) and broadcastable to (B,H,T,S)."""
  ms = _shape(mask)
  dtype = getattr(mask, "dtype", None)
  if dtype is None or str(dtype) != "bool":
    raise invalid("mask.dtype", str(dtype), "bool, True where a query may attend a key")
  ok = len(ms) <= 4 and all(
      m in (1, t) for m, t in zip(reversed(ms), reversed(target_BHTS)))
  if not ok:
    raise invalid("mask.shape", ms,
                  f"broadcastable to (B,H,T,S)={target_BHTS}, e.g. (B,1,1,S) or (1,1,T,S)")


def check_ids(name: str, ids: Any, upper: int, *, rank: int = 2) -> None:
  """Integer ids (tokens, segments) of the given rank; concrete ones must lie in [0, upper)."""
  shape = getattr(ids, "shape", None)
  if shape is None or len(shape) != rank:
    raise invalid(f"{name}.shape", shape, f"rank {rank} of integer ids")
  if not np.issubdtype(np.dtype(ids.dtype), np.integer):
    raise invalid(f"{name}.dtype", str(ids.dtype), "an integer dtype")
  if not isinstance(ids, _Tracer) and ids.size:
    a = np.asarray(ids)  # host values: np.min on a jax array captured under jit would be traced
    lo, hi = int(a.min()), int(a.max())
    if lo < 0 or hi >= upper:
      raise invalid(name, f"ids in [{lo}, {hi}]", f"ids in [0, {upper})")
