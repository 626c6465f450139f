"""ModelConfig: one transformer's sizes, attention variant and architecture switches.

Every HeadConfig field is also a ModelConfig field, declared once in HeadConfig
(with_head_fields); the TOML schema and the validation follow from there. What
each switch builds, and the parameters it adds, is in attn.nn.models' docstring.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from attn import api, kernel
from attn.config import PER_LAYER_FIELDS, FrozenDict, HeadConfig, invalid
from attn.nn import attn_res, hyper, index_sharing, kv_sharing, layer_heads, layer_types, moe, norms, short_conv

_CHOICES = {
    "positional": ("learned", "sinusoidal", "none", "rope"),
    "norm": ("pre", "post", "sandwich", "after"),
    "norm_type": ("layernorm", "rmsnorm", "rmsnorm_plus_one"),
    "mlp": ("plain", "gated", "moe"),
    "activation": ("gelu", "gelu_exact", "relu", "silu", "relu2"),
    "pooling": ("cls", "mean"),
    "dtype": ("float32", "bfloat16"),
    "param_dtype": ("float32", "bfloat16"),
}
# ModelConfig.block_kinds: what each block holds. "attention_mlp": attention then MLP, each a residual
# sublayer (every block when block_kinds is None); "attention": the attention sublayer alone; "mlp":
# the MLP (or experts) sublayer alone (NemotronH's single-mixer layers, attn.nn.hf.nemotron_h).
BLOCK_KINDS = ("attention_mlp", "attention", "mlp")
_BOOLS = ("embed_norm", "final_norm", "use_bias", "layernorm", "tie_embeddings", "pooler",
          "share_src_tgt_embeddings", "embed_scale", "mlm_head", "layer_scalar", "double_wide_mlp")
def with_head_fields(cls):
  """cls as a frozen dataclass that also has every field of HeadConfig it does not declare.

  A head field (d_k, num_kv_heads, rope_dim, ...) is declared once, in
  HeadConfig, with its type and default; ModelConfig, the TOML schema
  ([model] keys, typed by the annotation) and the validation (HeadConfig's)
  follow from there.
  """
  own = cls.__dict__.get("__annotations__", {})
  annotations = dict(own)
  for f in dataclasses.fields(HeadConfig):
    if f.name not in own and f.name not in PER_LAYER_FIELDS:
      annotations[f.name] = f.type
      setattr(cls, f.name, f.default)
  cls.__annotations__ = annotations
  return dataclasses.dataclass(frozen=True)(cls)


@with_head_fields
class ModelConfig:
  """One transformer: sizes, attention variant and the architecture switches (module docstring).

  Every HeadConfig field but d_model and num_heads (declared here) is also a
  field, with HeadConfig's default: `ModelConfig.head` is the layers' HeadConfig.
  """

  vocab_size: int
  d_model: int
  num_layers: int
  num_heads: int
  d_ff: int
  variant: str = "fused"
  max_len: int = 512
  positional: str = "learned"
  num_segments: int = 0
  embed_norm: bool = False
  norm: str = "pre"
  final_norm: bool = True
  layernorm: bool = True
  activation: str = "gelu"
  tie_embeddings: bool = True
  embed_init_std: float = 0.02
  norm_eps: float = 1e-5
  pooler: bool = False
  num_decoder_layers: int = 0
  share_src_tgt_embeddings: bool = True
  num_classes: int = 0
  pooling: str = "cls"
  dtype: str = "float32"
  param_dtype: str = "float32"
  global_every: int = 0  # with HeadConfig.window: every k-th layer global, the rest local
  norm_type: str = "layernorm"  # or "rmsnorm" (Llama), "rmsnorm_plus_one" (Gemma: scale 1 + w)
  mlp: str = "plain"  # or "gated": down(act(gate(x)) * up(x)) (SwiGLU with silu, GeGLU with gelu)
  dense_bias: bool | None = None  # biases of the MLP and an untied output layer; None: use_bias
  embed_scale: bool = False  # token embeddings times sqrt(d_model) (Gemma)
  logit_softcap: float | None = None  # output logits -> c·tanh(logits/c) (Gemma 2)
  # Granite's multipliers (attn.nn.hf.granite_swa), 1.0 each by default: no parameters, no FLOPs counted.
  embed_multiplier: float = 1.0  # token embeddings times this (embedding_multiplier)
  residual_multiplier: float = 1.0  # each sublayer's output times this before the residual add
  logit_divisor: float = 1.0  # output logits divided by this, before logit_softcap (logits_scaling)
  mlm_head: bool = False  # Encoder: BERT's masked-LM head (dense, activation, norm, tied decoder + bias)
  layer_types: tuple[str, ...] | None = None  # one type per layer (attn.nn.layer_types); None: global_every
  sliding_rope_theta: float | None = None  # sliding layers' own RoPE base, unscaled (Gemma 3's local base)
  layer_rope_theta: tuple[float, ...] | None = None  # per layer, its RoPE base; 0: NoPE (attn.nn.layer_types)
  layer_num_heads: tuple[int, ...] | None = None  # per layer, its query heads (Laguna; attn.nn.layer_types)
  linear_variant: str = "gated_deltanet"  # the variant of layer_types' "linear_attention" layers
  linear_head: dict | None = None  # their HeadConfig fields over the model's (attn.nn.layer_types)
  linear_norm: str | None = None  # linear_attention blocks' norm placement, "pre" or "after"; None: norm's (OLMo-Hybrid)
  layer_heads: dict | None = None  # {layer type: {d_k, d_v, num_kv_heads, rope_dim, value_norm_eps, variant}} (attn.nn.layer_heads; Gemma 4)
  kv_source: tuple[int, ...] | None = None  # per layer, whose keys and values it reads (attn.nn.kv_sharing)
  indexer_types: tuple[str, ...] | None = None  # per layer "full" or "shared": reuse the last full layer's indexer choice (attn.nn.index_sharing)
  block_kinds: tuple[str, ...] | None = None  # per layer: one of BLOCK_KINDS; None: all "attention_mlp"
  # mlp "moe": a mixture of experts, computed densely (attn.nn.moe has the meaning of each).
  moe_experts: int = 0  # E
  moe_top_k: int = 0  # experts kept per token
  moe_d_ff: int | None = None  # each expert's width (None: d_ff)
  moe_router: str = "softmax"  # or "sigmoid" (DeepSeek-V3, with a correction bias), "sqrtsoftplus" (V4)
  moe_norm_topk: bool = True  # renormalise the kept weights to sum 1
  moe_groups: int = 1  # sigmoid: expert groups (n_group)
  moe_topk_groups: int = 1  # sigmoid: groups kept (topk_group)
  moe_routed_scaling: float = 1.0  # the weights' multiplier (routed_scaling_factor)
  moe_shared_experts: int = 0  # a gated MLP of width moe_shared_experts·moe_d_ff on every token
  moe_dense_first: int = 0  # the first layers keep the dense MLP (first_k_dense_replace)
  moe_swiglu_limit: float | None = None  # gpt-oss's clamped SwiGLU (swiglu_limit)
  moe_shared_d_ff: int | None = None  # the shared experts' width (None: moe_shared_experts·moe_d_ff; Qwen3-Next)
  moe_shared_gate: bool = False  # σ(x·w) scales the shared experts' output (Qwen3-Next's shared_expert_gate)
  moe_swiglu_form: str = "gpt_oss"  # with moe_swiglu_limit: "gpt_oss", "clamp" (DeepSeek-V4's, shared experts too), "clamp_routed" (HY-V4's), "clamp_after(_routed)" (Ling-3's)
  moe_hash_first: int = 0  # the first expert layers pick experts by the token id (DeepSeek-V4's hash_moe, tid2eid)
  moe_layer_types: tuple[str, ...] | None = None  # per layer "dense" or "sparse" (Muse Spark); None: moe_dense_first's
  moe_pool_width: int | None = None  # M: experts at width M between D->M (a norm) and M->D, outputs normed (Muse Spark)
  moe_router_scale: float = 1.0  # the router's logits times this before scoring (Muse Spark's output_multiplier)
  # ZAYA1's router and residuals (attn.nn.moe, attn.nn.models; attn.nn.hf.zaya), each off by default:
  moe_router_mlp: int | None = None  # R: the router a network of its own, D -> R -> (RMSNorm, 2 GELU layers) -> classes
  moe_router_carry: bool = False  # EDA: each expert layer's router state r adds the previous one's times s (R,)
  moe_skip_expert: bool = False  # one more routing class that computes nothing (ZAYA's skip expert)
  residual_scale: bool = False  # each residual x + y becomes (y + b)·s + (x + b')·s', the embeddings (e + b)·s
  moe_gate_softcap: float | None = None  # routed experts: cap(gate)·σ(gate)·up, cap c·tanh(·/c) (Inkling-2's mlp_gate_softcap)
  moe_up_softcap: float | None = None  # routed experts: up capped to c·tanh(up/c) (Inkling-2's mlp_up_softcap)
  # Gemma 4 (attn.nn.models' docstring has what each builds and adds):
  per_layer_dim: int = 0  # P: per-layer input embeddings of width P, one slice per layer (0: none)
  per_layer_vocab: int = 0  # rows of their token table (0: vocab_size)
  layer_scalar: bool = False  # each block's output times a stored scalar (a buffer, not trained)
  double_wide_mlp: bool = False  # layers reading another's keys and values (kv_source) have MLPs 2·d_ff wide
  impl: str = "auto"  # every attention layer's core (attn.kernel.IMPLS); "auto" picks per call
  hc_mult: int = 1  # residual streams (attn.nn.hyper: DeepSeek-V4's hyper-connections); 1: plain residual
  hc_sinkhorn_iters: int = 20  # with hc_mult > 1: Sinkhorn-Knopp passes on each mix
  hc_eps: float = 1e-6  # with hc_mult > 1: the floor added to pre, comb and Sinkhorn's sums
  hc_form: str = "mhc"  # with hc_mult > 1: "mhc" (DeepSeek-V4's, comb by Sinkhorn) or "independent" (HY-V4's iHC: no comb)
  hc_magnitude: float = 2.0  # with hc_mult > 1: post = hc_magnitude·σ(·) (HY-V4's hc_magnitude; V4's is 2)
  hc_head: str = "learned"  # with hc_mult > 1: the final collapse, "learned" (V4's) or "mean" (GLM-5.3-Flash's)
  short_conv: int | None = None  # the width of a causal depthwise convolution before each attention (attn.nn.short_conv)
  attn_res_block: int | None = None  # n: block attention residuals over every n layers' blocks (Inkling-2; attn.nn.attn_res)
  attn_res_kv_types: tuple[str, ...] = ()  # layer types whose queries, keys and values read three mixes, three norms (Inkling-2's hybrid layers)
  output_vocab: int | None = None  # an untied output layer's rows: logits over ids < output_vocab (Inkling-2's unpadded_vocab_size); None: vocab_size
  residual_conv: int | None = None  # W: each attention's and MLP's output y -> (conv(y) + y)/sqrt(W + 1) (Inkling-2; attn.nn.short_conv)
  # Muse Spark's text model (attn.nn.norms; attn.nn.hf.muse_spark), each off by default:
  residual_gate: float | None = None  # τ: each residual x + y becomes α⊙x + β⊙y, g (D,) learned (attn.nn.norms)
  norm_forms: dict | None = None  # {place: form}: a place's RMSNorm form (attn.nn.norms); others follow norm_type
  post_norm_eps: float | None = None  # the epsilon of the norms after each sublayer and pooled experts (None: norm_eps)

  def __post_init__(self):
    object.__setattr__(self, "layer_types", layer_types.normalize(self.layer_types))
    object.__setattr__(self, "layer_rope_theta", layer_types.normalize_thetas(self.layer_rope_theta))
    object.__setattr__(self, "layer_num_heads", layer_types.normalize(self.layer_num_heads))
    object.__setattr__(self, "layer_heads", layer_heads.normalize(self.layer_heads))
    object.__setattr__(self, "kv_source", kv_sharing.normalize(self.kv_source))
    object.__setattr__(self, "indexer_types", index_sharing.normalize(self.indexer_types))
    if isinstance(self.block_kinds, list):
      object.__setattr__(self, "block_kinds", tuple(self.block_kinds))
    if isinstance(self.attn_res_kv_types, list):
      object.__setattr__(self, "attn_res_kv_types", tuple(self.attn_res_kv_types))
    if isinstance(self.moe_layer_types, list):
      object.__setattr__(self, "moe_layer_types", tuple(self.moe_layer_types))
    for name in ("vocab_size", "d_model", "num_layers", "num_heads", "d_ff", "max_len"):
      _check_int(name, getattr(self, name), minimum=1)
    for name in ("num_segments", "num_decoder_layers", "num_classes", "per_layer_dim", "per_layer_vocab"):
      _check_int(name, getattr(self, name), minimum=0)
    for name in _BOOLS:
      if not isinstance(getattr(self, name), bool):
        raise invalid(name, getattr(self, name), "True or False")
    for name, allowed in _CHOICES.items():
      if getattr(self, name) not in allowed:
        raise invalid(name, getattr(self, name), f"one of {list(allowed)}")
    std = self.embed_init_std
    if isinstance(std, bool) or not isinstance(std, (int, float)) or not 0 < std < float("inf"):
      raise invalid("embed_init_std", std, "a positive finite number")
    eps = self.norm_eps
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < float("inf"):
      raise invalid("norm_eps", eps, "a positive finite number (LayerNorm epsilon)")
    if self.dense_bias not in (None, True, False):
      raise invalid("dense_bias", self.dense_bias, "None (follow use_bias), True or False")
    c = self.logit_softcap
    if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float))
                          or not 0 < c < float("inf")):
      raise invalid("logit_softcap", c, "None or a positive finite number: logits -> c·tanh(logits/c)")
    for name in ("embed_multiplier", "residual_multiplier", "logit_divisor"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise invalid(name, value, "a positive finite number (1.0: off; Granite's multipliers)")
    api.check_config(self.variant, self.head)  # d_k, d_v, num_kv_heads, collab_width, variant
    object.__setattr__(self, "extra", self.head.extra)  # frozen, so the config stays hashable
    if self.positional == "rope" and not self.rope_dim:
      raise invalid("rope_dim", self.rope_dim,
                    f"an even integer in [2, d_k={self.head.d_k}] with positional='rope'")
    if self.rope_dim and self.positional != "rope":
      raise invalid("positional", self.positional,
                    f"'rope' when rope_dim={self.rope_dim}: rotary positions replace additive ones")
    _check_int("global_every", self.global_every, minimum=0)
    if self.global_every and self.window is None:
      raise invalid("global_every", self.global_every,
                    "0 without a window: it makes every k-th layer global and the rest local")
    if self.impl not in kernel.IMPLS:  # whether it runs here is checked where the model is built
      raise invalid("impl", self.impl, f"one of {list(kernel.IMPLS)}; "
                    f"available on this machine: {kernel.available_impls()}")
    if self.linear_head is not None:
      if not isinstance(self.linear_head, dict):
        raise invalid("linear_head", self.linear_head, "None or a table of HeadConfig fields")
      object.__setattr__(self, "linear_head", FrozenDict(self.linear_head))
    layer_types.check(self)
    layer_types.check_linear_fields(self)
    self._check_linear_norm()
    kv_sharing.check(self)
    index_sharing.check(self)
    moe.check(self)
    if self.per_layer_vocab and not self.per_layer_dim:
      raise invalid("per_layer_vocab", self.per_layer_vocab, "0 when per_layer_dim is 0: there is no "
                    "per-layer table to size")
    if self.double_wide_mlp and self.kv_source is None:
      raise invalid("double_wide_mlp", True, "False without kv_source: it widens the MLPs of the layers "
                    "reading another layer's keys and values, and there are none")
    self._check_hyper()
    self._check_block_kinds()
    short_conv.check_width(self.short_conv)
    short_conv.check_residual_width(self.residual_conv)
    self._check_output_vocab()
    attn_res.check(self)
    self._check_norms()

  def _check_output_vocab(self) -> None:
    """output_vocab: None, or 1..vocab_size rows of an untied output layer."""
    n = self.output_vocab
    if n is None:
      return
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= self.vocab_size or self.tie_embeddings:
      raise invalid("output_vocab", n, f"None, or an integer in [1, vocab_size={self.vocab_size}] with "
                    f"tie_embeddings=False (tie_embeddings={self.tie_embeddings}): the rows of an untied output "
                    "layer, logits over the first output_vocab ids")

  @property
  def output_rows(self) -> int:
    """The output layer's rows: output_vocab, else vocab_size."""
    return self.vocab_size if self.output_vocab is None else self.output_vocab

  def _check_norms(self) -> None:
    """norm_forms, post_norm_eps and residual_gate (attn.nn.norms): off by default, each refused where the
    model has nothing for it to act on."""
    forms = self.norm_forms
    if forms is not None:
      if not isinstance(forms, dict) or not forms:
        raise invalid("norm_forms", forms, f"None or a table {{place: form}}, places {list(norms.NORM_PLACES)}, "
                      f"forms {list(norms.NORM_FORMS)}")
      if self.norm_type == "layernorm" or not self.layernorm:
        raise invalid("norm_forms", dict(forms), f"None with norm_type={self.norm_type!r}, layernorm="
                      f"{self.layernorm}: the forms are RMSNorm's ('rmsnorm' or 'rmsnorm_plus_one')")
      has = {"embed": self.embed_norm, "attn_post": self.norm in ("sandwich", "after"),
             "mlp_post": self.norm in ("sandwich", "after"), "final": self.final_norm}
      for place, form in forms.items():
        if place not in norms.NORM_PLACES:
          raise invalid("norm_forms", place, f"a place among {list(norms.NORM_PLACES)}")
        if form not in norms.NORM_FORMS:
          raise invalid(f"norm_forms.{place}", form, f"one of {list(norms.NORM_FORMS)}")
        if not has[place]:
          raise invalid(f"norm_forms.{place}", form, "absent: the model has no norm there (embed: embed_norm; "
                        "attn_post, mlp_post: norm 'sandwich' or 'after'; final: final_norm)")
      object.__setattr__(self, "norm_forms", FrozenDict(forms))
    eps = self.post_norm_eps
    if eps is not None:
      if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < float("inf"):
        raise invalid("post_norm_eps", eps, "None (norm_eps) or a positive finite number")
      if self.norm not in ("sandwich", "after") and not self.moe_pool_width:
        raise invalid("post_norm_eps", eps, f"None with norm={self.norm!r} and no moe_pool_width: it is the "
                      "epsilon of the norms after each sublayer (norm 'sandwich' or 'after') and of pooled "
                      "experts' outputs")
    if not isinstance(self.residual_scale, bool):
      raise invalid("residual_scale", self.residual_scale, "True or False")
    if self.residual_scale and (self.norm == "post" or self.hc_mult > 1 or self.num_decoder_layers
                                or self.residual_gate is not None or self.attn_res_block is not None):
      raise invalid("residual_scale", True, f"False with norm={self.norm!r}, hc_mult={self.hc_mult}, "
                    f"num_decoder_layers={self.num_decoder_layers}, residual_gate={self.residual_gate}, "
                    f"attn_res_block={self.attn_res_block}: it rescales "
                    "one residual stream around pre-normed self-attention and MLP sublayers (ZAYA's)")
    tau = self.residual_gate
    if tau is not None:
      if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not 0 < tau < float("inf"):
        raise invalid("residual_gate", tau, "None (x + y) or a positive finite temperature τ (Muse Spark's "
                      "residual_gate_temperature, 0.3)")
      if self.norm == "post" or self.hc_mult > 1 or self.num_decoder_layers:
        raise invalid("residual_gate", tau, f"None with norm={self.norm!r}, hc_mult={self.hc_mult}, "
                      f"num_decoder_layers={self.num_decoder_layers}: it mixes one residual stream around "
                      "pre-normed self-attention and MLP sublayers (norm 'pre', 'sandwich' or 'after')")

  def norm_eps_at(self, place: str) -> float:
    """The epsilon of the norm at `place`: post_norm_eps after a sublayer (when set), else norm_eps."""
    if place in ("attn_post", "mlp_post") and self.post_norm_eps is not None:
      return self.post_norm_eps
    return self.norm_eps

  def _check_linear_norm(self) -> None:
    """linear_norm: None, or "pre" / "after" where the model's norm is the other of the two (one norm per
    sublayer either way, so the counts stay per layer) and some layer is linear_attention."""
    n = self.linear_norm
    if n is None:
      return
    if n not in ("pre", "after"):
      raise invalid("linear_norm", n, "None (the model's norm) or one of ['pre', 'after']: where the "
                    "linear_attention layers' blocks put their norms (OLMo-Hybrid: pre, its softmax layers after)")
    if self.norm not in ("pre", "after"):
      raise invalid("linear_norm", n, f"None with norm={self.norm!r}: a block's norms may differ by layer "
                    "type only between 'pre' and 'after' (one norm per sublayer)")
    if not any(layer_types.layer_type(self, i) == "linear_attention" for i in range(self.num_layers)):
      raise invalid("linear_norm", n, "None without linear_attention layers: it sets only their norms")
    if self.hc_mult > 1 and n != "pre":
      raise invalid("linear_norm", n, f'"pre" or None with hc_mult={self.hc_mult}: the hyper-connections '
                    "mix the streams around pre-normed sublayers")

  def block_norm(self, index: int) -> str:
    """The norm placement of block `index`: linear_norm for a linear_attention layer (when set), else norm."""
    if self.linear_norm is not None and layer_types.layer_type(self, index) == "linear_attention":
      return self.linear_norm
    return self.norm

  def _check_block_kinds(self) -> None:
    """block_kinds: None, or one of BLOCK_KINDS per layer; single-sublayer blocks only where every block is a
    plain pre-norm residual around one mixer (no cross-attention, KV sharing, per-layer inputs,
    hyper-connections)."""
    kinds = self.block_kinds
    if kinds is None:
      return
    if not isinstance(kinds, tuple) or len(kinds) != self.num_layers:
      raise invalid("block_kinds", kinds, f"None or a list of {self.num_layers} entries (num_layers), each one "
                    f"of {list(BLOCK_KINDS)}")
    for i, k in enumerate(kinds):
      if k not in BLOCK_KINDS:
        raise invalid(f"block_kinds[{i}]", k, f"one of {list(BLOCK_KINDS)}")
    others = {"num_decoder_layers": 0, "kv_source": None, "per_layer_dim": 0, "layer_scalar": False,
              "hc_mult": 1, "double_wide_mlp": False}
    for name, want in others.items():
      if getattr(self, name) != want:
        raise invalid(name, getattr(self, name), f"{want!r} with block_kinds (single-mixer blocks are a "
                      "decoder's or encoder's own stack, one residual each)")
    for i, k in enumerate(kinds):
      if k == "mlp" and layer_types.layer_type(self, i) != "full_attention":
        raise invalid(f"layer_types[{i}]", layer_types.layer_type(self, i), f"'full_attention' (unread) where "
                      f"block_kinds[{i}]='mlp': the block has no attention")

  def has_attention(self, index: int) -> bool:
    """Whether block `index` of the stack has an attention sublayer (block_kinds)."""
    return self.block_kinds is None or self.block_kinds[index] != "mlp"

  def has_mlp(self, index: int) -> bool:
    """Whether block `index` of the stack has an MLP (or experts) sublayer (block_kinds)."""
    return self.block_kinds is None or self.block_kinds[index] != "attention"

  def _check_hyper(self) -> None:
    _check_int("hc_mult", self.hc_mult, minimum=1)
    _check_int("hc_sinkhorn_iters", self.hc_sinkhorn_iters, minimum=1)
    eps = self.hc_eps
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < float("inf"):
      raise invalid("hc_eps", eps, "a positive finite number (the hyper-connections' floor)")
    if self.hc_form not in hyper.FORMS:
      raise invalid("hc_form", self.hc_form, f"one of {list(hyper.FORMS)}")
    if self.hc_head not in hyper.HEADS or (self.hc_head != "learned" and self.hc_mult == 1):
      raise invalid("hc_head", self.hc_head, f"one of {list(hyper.HEADS)}, and \"learned\" (the default) with "
                    "hc_mult=1: the final collapse of the hyper-connections' streams")
    m = self.hc_magnitude
    if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 < m < float("inf"):
      raise invalid("hc_magnitude", m, "a positive finite number (the post gates' scale)")
    if self.hc_mult > 1 and self.norm != "pre":
      raise invalid("norm", self.norm, f'"pre" with hc_mult={self.hc_mult}: the hyper-connections '
                    "mix the streams around pre-normed sublayers (DeepSeek-V4's layout)")
    if self.hc_mult > 1 and (self.per_layer_dim or self.layer_scalar):
      raise invalid("hc_mult", self.hc_mult, "1 with per_layer_dim or layer_scalar (Gemma 4's per-layer "
                    "inputs and block scalars act on one residual stream; no model combines them with "
                    "hyper-connections)")

  @property
  def head(self) -> HeadConfig:
    """The HeadConfig of every attention layer in the model."""
    return HeadConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(HeadConfig)
                         if f.name not in PER_LAYER_FIELDS})

  def layer_head(self, index: int) -> HeadConfig:
    """The HeadConfig of self-attention layer `index` (0-based) of a stack, with layer = index + 1.

    Its type (layer_types[index], or global_every's rule) sets its window and RoPE; layer_rope_theta[index],
    if set, its RoPE base (0: none); layer_num_heads[index], if set, its query heads.
    """
    head = self.head.replace(layer=index + 1)  # differential's λ_init reads it
    head = layer_heads.per_layer(self, index, layer_types.head_for(self, layer_types.layer_type(self, index), head))
    if self.indexer_types is None:  # no shared indexer layers (the default)
      return head
    return index_sharing.mark(self, index, head)  # indexer_types: a shared layer's indexer reuses a choice

  def layer_variant(self, index: int) -> str:
    """The variant of self-attention layer `index`: linear_variant for a linear_attention layer."""
    return layer_types.variant_for(self, layer_types.layer_type(self, index))

  def is_moe_layer(self, index: int) -> bool:
    """Whether layer `index` (0-based) of a stack has experts (mlp "moe", past moe_dense_first, or
    "sparse" in moe_layer_types)."""
    if self.moe_layer_types is not None:
      return self.mlp == "moe" and self.moe_layer_types[index] == "sparse"
    return self.mlp == "moe" and index >= self.moe_dense_first

  def router_carried(self, index: int) -> bool:
    """Whether expert layer `index` adds the previous expert layer's router state (moe_router_carry: every
    expert layer of the stack but the first)."""
    experts = lambda i: self.is_moe_layer(i) and self.has_mlp(i)  # noqa: E731
    return self.moe_router_carry and experts(index) and any(experts(j) for j in range(index))

  def is_hash_layer(self, index: int) -> bool:
    """Whether layer `index`'s experts are chosen by the token id (the first moe_hash_first expert layers)."""
    return self.is_moe_layer(index) and index < self.moe_dense_first + self.moe_hash_first

  @property
  def has_dense_bias(self) -> bool:
    """Whether the MLP and an untied output layer have biases (dense_bias, else use_bias)."""
    return self.use_bias if self.dense_bias is None else self.dense_bias

  @property
  def compute_dtype(self) -> jnp.dtype:
    """The dtype activations and matmuls run in (Flax's `dtype`); softmax and the loss stay float32."""
    return jnp.dtype(self.dtype)

  @property
  def weight_dtype(self) -> jnp.dtype:
    """The dtype parameters are stored, updated and checkpointed in (Flax's `param_dtype`)."""
    return jnp.dtype(self.param_dtype)

  def replace(self, **changes) -> ModelConfig:
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


def _check_int(name: str, value: Any, minimum: int) -> None:
  if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
    raise invalid(name, value, f"an integer >= {minimum}")
