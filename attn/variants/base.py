"""The variant contract, and the pieces every variant shares.

A variant is a parameterization of one multi-head attention layer over a plain
dict of arrays. Its `apply(params, x_BTD, context_BSD=None, *, cfg,
opts=Options())` returns `(y_BTD, weights_BHTS or None)`; `context_BSD` is
None for self-attention. `opts` (Options, below) is everything the call asks
besides its inputs (masks, RoPE positions, head gates, weights out, kernel),
built and validated once by attn.api.options; a variant hands it whole to
attend_and_project(params, x_BTD, q_BTHK, k_BSGK, v_BSGV, *, cfg, opts) and
reads a field itself only if it uses it (fused: impl; talking_heads: impl,
return_weights). An option of the attention core or a head feature is added
here and in attn.kernel, not in variant files: a variant that computes its
own logits or attends to something else calls the pieces of the shared path
(queries_and_keys, core or full_mask + probabilities, project_out) instead of
attend_and_project. The head mechanisms (HeadConfig gate, sinks, qk_norm,
window, softcap, probability, and outside ones; attn.variants.mechanisms) live in those pieces: `init` makes
the variant's own parameters and attn.init adds the mechanisms', attn.count
adds their counts. A variant that cannot carry a HeadConfig feature (RoPE:
rope_dim > 0; qk_norm) refuses it in its `check`, with the reason.

Counts are per layer; FLOPs count a multiply-add as 2 and are per batch
element, forward only, for T queries and S keys. The KV-cache width is the
elements cached per decoded token; the score weights are the weights the
attention logits depend on, biases excluded. `decode_apply(params, x_BTD,
context_BSD, *, cfg, opts)`, when a variant has one, computes the same
function as `apply` the way a decoder would, its kernel reading only the
kv_cache_width columns a cache holds (mla: queries absorbed into the latent);
None means `apply` already does.

Decoding with a KV cache (attn.variants.cache; DecoderLM.init_cache) caches,
per token, exactly kv_cache_width(cfg) numbers. By default these are the keys
(rotated once, at their own positions) and values that `apply` hands to
attend_and_project: every variant that projects its keys and values and then
calls attend_and_project (or calls `cached_kv` itself, as talking_heads does)
decodes with nothing more. A key shared by all kv heads (merged's raw context,
collaborative's D̃-wide key) is passed with one head, so it is cached once.
A variant that caches something else sets both `cache_entries(params, x_BTD,
*, cfg, opts)` -> dict of (B,T,...) arrays per token (keys at
opts.qk_positions[1]), and `attend_cached(params, x_BTD, cache, *, cfg,
opts)` -> y_BTD, cache holding the same names over the cache length and
opts.mask saying which slots each query sees (mla: the latent and the rotated
RoPE key).

A head with a fixed-size state (attn.variants.linear: gated_deltanet, kda, mamba2, linear, gla)
decodes with that state instead of a KV cache: it sets `init_state(cfg, batch_size, dtype)` ->
dict of (B, ...) zero arrays, the state of a sequence before its first token, and `step(params,
x_BTD, state, *, cfg, opts)` -> (y_BTD, the state after x's tokens), equal to the causal `apply`
continued from that state; `state_size(cfg)` is its numbers per sequence (independent of the
length), and its kv_cache_width is 0. Such a head computes causal self-attention only: its apply
refuses context, mask, return_weights and is_causal=False (the kit checks it that way).

A variant whose cache is no per-token array (compressed: a window ring, pooled entries and the
open block) sets `init_cache(params, cfg, batch_size, max_len, dtype)` -> dict of (B, ...) arrays
and `decode_cached(params, x_BTD, cache, index, *, cfg, head_mask)` -> (y_BTD, the cache after
x's tokens at positions index..), equal to the causal apply; `kv_cache_elements(cfg, length)` is
the numbers that cache holds for one sequence of `length` tokens (attn.count reads it).

attn.analysis.circuits reads a variant through its exact converter to per_head.
A variant without one sets `circuits(params, cfg)` -> the same dict of factors
as attn.analysis.circuits' readers ({"qk": (a, b), "ov": (a, b), biases}),
e.g. talking_heads, which mixes per_head's (attn.variants.factors); one
that has no per-head W_QK sets a `circuits` that raises ConfigError saying why.

return_weights gives softmax weights (rows sum to 1, fully masked rows 0;
with cfg.probability "sigmoid" or "relu" unnormalised, attn.kernel.probability) unless `signed_weights`: then a signed map whose rows need not sum to 1
(differential's A_1 − λ·A_2).
"""

from __future__ import annotations

import contextvars
import dataclasses
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp

from attn import kernel
from attn.kernel import masks
from attn.config import HeadConfig, invalid
from attn.variants import mechanisms, rope

Array = jax.Array
Params = dict[str, Array]


@dataclasses.dataclass(frozen=True)
class Options:
  """What one call asks of a layer besides its inputs, as one record a variant forwards whole.

  Built and validated once, before tracing: attn.api.options (attn.apply, the
  NNX module) or attn.variants.cache (decoding). A pytree: the arrays are
  leaves, is_causal, return_weights and impl are static.

  mask: boolean, True where a query may attend, broadcastable to (B,H,T,S).
  is_causal, kv_lengths (B,): kernel.attention's structured masks, ANDed with mask.
  qk_positions: None, or (query positions (T,)|(B,T), key positions (S,)|(B,S))
    for RoPE (cfg.rope_dim > 0); None means 0..T−1 and 0..S−1.
  head_mask: (H,) or (B,H) gates on each query head's output before W^O
    (Michel et al. 2019); None means all ones.
  return_weights: also return the attention weights (B,H,T,S).
  impl: kernel.attention's implementation; None means the variant's default ("auto").
  index: the deepseek-form indexer's (index queries (B,T,n_I,d_I), index keys (B,S,d_I), weights
    (B,T,n_I)), set by the variant that computes them (mla; attn.variants.mechanisms.selection); None otherwise.
  key_positions: (S,) the position each key the core reads holds, set while decoding (attn.variants.cache:
    the cache's slots, a window's ring); None: qk_positions' keys, else 0..S−1. Read by the mechanisms'
    on_tokens (a relative bias by distance).
  kv_inputs: (the key projection's input, the value projection's input), each (B,S,D), where they are not
    the context (Inkling-2's hybrid layers read keys and values from mixes of their own); per_head only
    (attn.api refuses it elsewhere); None: the context, or x.
  """

  mask: Array | None = None
  is_causal: bool = False
  kv_lengths: Array | None = None
  qk_positions: tuple[Array, Array] | None = None
  head_mask: Array | None = None
  return_weights: bool = False
  impl: str | None = None
  index: tuple[Array, Array, Array] | None = None
  key_positions: Array | None = None
  kv_inputs: tuple[Array, Array] | None = None

  def replace(self, **changes) -> Options:
    return dataclasses.replace(self, **changes)


jax.tree_util.register_dataclass(
    Options, data_fields=["mask", "kv_lengths", "qk_positions", "head_mask", "index", "key_positions", "kv_inputs"],
    meta_fields=["is_causal", "return_weights", "impl"])


def no_circuits(name: str, allowed: str) -> Callable[..., dict[str, Any]]:
  """A Variant.circuits for a variant without a fixed per-head W_QK: it refuses, saying why."""
  def circuits(params: Params, cfg: HeadConfig) -> dict[str, Any]:
    del params, cfg
    raise invalid("variant", name, allowed)
  return circuits


def _no_constraint(cfg: HeadConfig) -> None:
  del cfg


@dataclasses.dataclass(frozen=True, eq=False)
class Variant:
  """One head parameterization. Only name, init and apply are required.

  init(key, cfg, dtype) -> dict of arrays; apply(params, x_BTD, context_BSD, *, cfg, opts) ->
  (y_BTD, weights_BHTS or None). Everything else is optional: a figure a variant does not
  declare in closed form (param_count, effective_param_count, flops, kv_cache_width,
  score_weights) is measured by attn.count (attn.count.measured) and labelled "measured";
  so is one whose closed form returns None at a config it does not cover.
  sharding: parameter name -> one letter per axis (attn.nn.sharding's rule) for the names
  beyond the canonical layout's; None means undeclared, and its parameters are replicated over
  the mesh's heads axis (with a warning saying so). fields: HeadConfig fields this variant
  alone reads (k_eq_v's value_norm_eps); attn.api.check_config refuses them away from what
  HeadConfig gives unset under any other variant, which would ignore them. Frozen:
  dataclasses.replace makes a variation of one; records compare by identity.
  """

  name: str
  init: Callable[[Array, HeadConfig, Any], Params]
  apply: Callable[..., tuple[Array, Array | None]]
  param_count: Callable[[HeadConfig], int] | None = None
  effective_param_count: Callable[[HeadConfig], int | None] | None = None
  flops: Callable[[HeadConfig, int, int], int] | None = None
  kv_cache_width: Callable[[HeadConfig], int] | None = None
  score_weights: Callable[[HeadConfig], int] | None = None
  check: Callable[[HeadConfig], None] = _no_constraint
  decode_apply: Callable[..., tuple[Array, Array | None]] | None = None
  cache_entries: Callable[..., dict[str, Array]] | None = None
  attend_cached: Callable[..., Array] | None = None
  circuits: Callable[..., dict[str, Any]] | None = None
  init_state: Callable[..., dict[str, Array]] | None = None
  step: Callable[..., tuple[Array, dict[str, Array]]] | None = None
  state_size: Callable[[HeadConfig], int] | None = None
  init_cache: Callable[..., dict[str, Array]] | None = None  # a cache of its own (attn.variants.cache)
  decode_cached: Callable[..., tuple[Array, dict[str, Array]]] | None = None
  kv_cache_elements: Callable[[HeadConfig, int], int] | None = None  # its own cache's size at a length
  signed_weights: bool = False
  sharding: Mapping[str, str | None] | None = None
  fields: tuple[str, ...] = ()  # HeadConfig fields only it reads: every other variant refuses them set
  lacks: Mapping[str, str] | None = None  # what of OFFERS it does not offer -> why (check_offers)
  offers: tuple[str, ...] = ()  # what of OPT_IN it offers (check_offers)

  @property
  def cache_kind(self) -> str:
    """What it decodes with, read from its hooks in this one place: "state" (init_state, a fixed-size
    state), "own" (init_cache, a cache of its own), "entries" (cache_entries, per-token arrays of its
    own) or "kv" (the keys and values attend_and_project sees)."""
    if self.init_state is not None:
      return "state"
    if self.init_cache is not None:
      return "own"
    return "entries" if self.cache_entries is not None else "kv"


# What a variant offers the mechanisms, declared once: every variant offers each of these unless its
# record's `lacks` names it with the reason; a mechanism's `needs` names what it reads
# (attn.variants.mechanisms.record), and check_offers refuses the pair once, for every variant.
OFFERS = {
    "qk_heads": "d_k-wide query and key heads as the kernel receives them, in apply and in decoding",
    "key_heads": "d_k-wide key heads for the core to read",
    "one_map": "one attention map per head",
    "qkv_heads": "per-head query, key and value projections handed to attend_and_project, with the "
                 "keys and values cached per token",
}
# What a variant offers only where its record's `offers` names it: a capability added after plugins were
# written, which a plugin's variant (calling attend_and_project as before) does not hand over.
OPT_IN = {
    "projection_inputs": "the query, key and value projections' inputs handed to attend_and_project (inputs=)",
}


def lacks_of(v: Variant) -> dict[str, str]:
  """What of OFFERS and OPT_IN v does not offer -> why."""
  return {**(v.lacks or {}), **{what: f"{v.name} does not hand them (its record's offers does not name "
                                      f"{what!r})" for what in OPT_IN if what not in v.offers}}


def check_offers(v: Variant, cfg: HeadConfig, variants=()) -> None:
  """Refuses an active mechanism that needs what v lacks: names the option, v, what the mechanism
  needs and why v lacks it, and the variants (of `variants`) that would run it."""
  lacks = lacks_of(v)
  for m in mechanisms.active(cfg):
    needs = m.needs(cfg) if callable(m.needs) else (m.needs or {})
    for what, why in needs.items():
      if what in lacks:
        option = m.fields[0] if m.fields else f"extra.{m.name}"
        value = getattr(cfg, m.fields[0]) if m.fields else dict(cfg.extra[m.name])
        off = repr(mechanisms.default_of(m.fields[0])) if m.fields else "absent"
        if what in OPT_IN:
          offering = [o.name for o in variants if what in o.offers] or ["per_head"]
          raise invalid(option, value, f"{off} for {v.name}: {m.name} needs {OPT_IN[what]} ({why}), and "
                        f"{lacks[what]}; {', '.join(offering)} offer them")
        without = [o.name for o in variants if what in lacks_of(o)] or [v.name]
        raise invalid(option, value, f"{off} for {v.name}: {m.name} needs {OFFERS[what]} ({why}), and "
                      f"{lacks[what]}; every variant but {', '.join(without)} offers them (per_head runs it)")


# The figures a Variant may give in closed form; attn.count measures the ones it does not.
CLOSED_FORMS = ("param_count", "effective_param_count", "flops", "kv_cache_width", "score_weights")


def normal(key: Array, shape: tuple[int, ...], fan_in: int, dtype=jnp.float32) -> Array:
  """Weights ~ N(0, 1/fan_in) (LeCun normal), the scale that keeps activations O(1)."""
  return (jax.random.normal(key, shape, jnp.float32) / jnp.sqrt(fan_in)).astype(dtype)


def zeros(shape: tuple[int, ...], dtype=jnp.float32) -> Array:
  return jnp.zeros(shape, dtype)


def add_bias(params: Params, cfg: HeadConfig, shapes: dict[str, tuple[int, ...]],
             dtype=jnp.float32) -> Params:
  """Adds zero biases of the given shapes when cfg.use_bias."""
  if cfg.use_bias:
    params.update({name: zeros(shape, dtype) for name, shape in shapes.items()})
  return params


def bias(params: Params, name: str):
  """The bias named, or 0 when the layer has none (use_bias=False)."""
  return params.get(name, 0.0)


def dense(x_NTD: jax.Array, w_DE: jax.Array, b_E) -> jax.Array:
  """x @ w + b as one 2-D matmul over the flattened leading axes.

  On CPU the gradient of a 3-D x @ w contracts two axes (B,T) for w's
  gradient, which XLA runs through an extra transpose; flattening first makes
  every product of the forward and backward pass a plain 2-D matmul.
  """
  lead = x_NTD.shape[:-1]
  y_NE = x_NTD.reshape(-1, x_NTD.shape[-1]) @ w_DE + b_E
  return y_NE.reshape(*lead, w_DE.shape[-1])


def project_heads(x_BTD: Array, w_DHK: Array, b_HK) -> Array:
  """Per-head projection of all heads in one matmul: (B,T,H,K)."""
  D, H, K = w_DHK.shape
  return dense(x_BTD, w_DHK.reshape(D, H * K), jnp.reshape(b_HK, -1)).reshape(
      *x_BTD.shape[:-1], H, K)


def output_projection(o_BTHV: Array, w_HVD: Array, b_D) -> Array:
  """Concatenate heads and project back to d_model: sum over h of o_h W_O,h."""
  H, V, D = w_HVD.shape
  return dense(o_BTHV.reshape(*o_BTHV.shape[:-2], H * V), w_HVD.reshape(H * V, D), b_D)


def gate_heads(out_BTHV: Array, head_mask) -> Array:
  """Each query head's output times its gate ξ_h; head_mask (H,) or (B,H), None = all ones."""
  if head_mask is None:
    return out_BTHV
  xi = jnp.asarray(head_mask)
  xi_BTHV = xi[:, None, :, None] if xi.ndim == 2 else xi[:, None]
  return out_BTHV * xi_BTHV.astype(out_BTHV.dtype)


# The shared path. attend_and_project is the tail of every variant that projects queries, keys
# and values; a variant that computes its own logits or attends to something else (talking_heads,
# mla's absorbed form) calls the pieces instead, so that an option or head feature added here
# reaches it too.

def queries_and_keys(params: Params, q_BTHK: Array, k_BSGK: Array, *, cfg: HeadConfig,
                     opts: Options) -> tuple[Array, Array]:
  """q and k as the scores read them: the mechanisms' on_qk (QK-norm), then RoPE at opts.qk_positions."""
  q_BTHK, k_BSGK = mechanisms.on_qk(params, q_BTHK, k_BSGK, cfg)
  return rope.rotate_qk(q_BTHK, k_BSGK, cfg, opts.qk_positions)


def core(params: Params, q_BTHK: Array, k_BSGK: Array, v_BSGV: Array, *, cfg: HeadConfig,
         opts: Options, x_BTD: Array | None = None) -> tuple[Array, Array | None]:
  """kernel.attention under the call's masks: (o (B,T,H,V), weights (B,H,T,S) or None).

  The mechanisms' kernel keywords (window, sinks, softcap) go with it; a
  mechanism acting on the logits that the kernel cannot take (an outside
  on_logits) makes it the explicit path: scores, probabilities, weighted sum.
  impl None or "auto" (kernel.best_impl) is the einsum kernel for short
  sequences on CPU and the blocked one for long (T·S >= kernel.BLOCKED_MIN_SCORES)
  without weights out. A mechanism that chooses keys or replaces the attention does so first,
  through one hook (mechanisms.attend). x_BTD: the layer's query-side input (a replacing
  mechanism may read it: nsa's gates).
  """
  # Mechanisms reading the query tokens and positions (token_logits): scaled queries, a logits bias.
  q_BTHK, bias = mechanisms.on_tokens(params, x_BTD, q_BTHK, k_BSGK.shape[1], cfg, opts)
  hook = LOGIT_HOOK.get()
  if hook is not None:  # attn.analysis.logits.record_logits: every allowed pair's logit, before any choice
    hook(params, q_BTHK, k_BSGK, cfg=cfg, opts=opts)
  # A mechanism that chooses keys or replaces the attention (attn.variants.mechanisms.choice).
  done, opts = mechanisms.attend(params, x_BTD, q_BTHK, k_BSGK, v_BSGV, cfg=cfg, opts=opts)
  if done is not None:
    return done
  if mechanisms.needs_explicit_logits(cfg):
    mask = full_mask(q_BTHK.shape[1], k_BSGK.shape[1], cfg=cfg, opts=opts)
    w_BHTS = probabilities(params, kernel.scores(q_BTHK, k_BSGK) * cfg.score_scale, mask, cfg=cfg, bias=bias)
    o_BTHV = kernel.weighted_sum(w_BHTS, v_BSGV)
    return o_BTHV, (w_BHTS if opts.return_weights else None)
  out = kernel.attention(q_BTHK, k_BSGK, v_BSGV, opts.mask, is_causal=opts.is_causal,
                         kv_lengths=opts.kv_lengths, scale=cfg.score_scale, logits_bias=bias,
                         return_weights=opts.return_weights, impl=opts.impl or "auto",
                         **mechanisms.kernel_args(params, cfg))
  return out if opts.return_weights else (out, None)


def full_mask(T: int, S: int, *, cfg: HeadConfig, opts: Options) -> Array | None:
  """The call's masks and the layer's window as one dense boolean array (B,H,T,S)-broadcastable."""
  return masks.combine_masks(opts.mask, kernel.structured_mask(T, S, opts.is_causal,
                                                               opts.kv_lengths, cfg.window))


def probabilities(params: Params, logits_BHTS: Array, mask, *, cfg: HeadConfig, bias: Array | None = None) -> Array:
  """Attention weights (float32) of explicit (scaled) logits under a dense mask (full_mask).

  As kernel.attention: the mechanisms' on_logits (softcap's cap), then the bias (on_tokens'), the sinks in
  every denominator, cfg.probability's function (sigmoid and relu: attn.kernel.probability) in place of
  the softmax.
  """
  logits_BHTS = mechanisms.on_logits(params, logits_BHTS.astype(jnp.float32), cfg)
  if bias is not None:
    logits_BHTS = logits_BHTS + bias
  args = mechanisms.kernel_args(params, cfg)
  return kernel.masked_probabilities(logits_BHTS, mask, args["sinks"], args["probability"])


def project_out(params: Params, x_BTD: Array, o_BTHV: Array, *, cfg: HeadConfig,
                opts: Options) -> Array:
  """o_h of each head, gated, through W^O (as (H,V,D)) plus b_o, in x's dtype.

  x_BTD is the query-side input of the layer, the tokens whose outputs o_h
  are: the mechanisms' on_output (the gate) reads it. opts.head_mask multiplies too.
  """
  o_BTHV = gate_heads(mechanisms.on_output(params, x_BTD, o_BTHV, cfg), opts.head_mask)
  w_o_HVD = params["w_o"].reshape(cfg.num_heads, cfg.d_v, cfg.d_model)
  y_BTD = output_projection(o_BTHV, w_o_HVD, bias(params, "b_o"))
  return y_BTD.astype(x_BTD.dtype)


def attend_and_project(params: Params, x_BTD: Array, q_BTHK: Array, k_BSGK: Array,
                       v_BSGV: Array, *, cfg: HeadConfig, opts: Options, inputs: tuple | None = None):
  """The shared tail of every variant: RoPE, attention, head gates, then W^O and b_o.

  x_BTD is the layer's query-side input (it sets the output dtype). k_BSGK
  may have one head (a key shared by every kv head); while decoding, the keys
  and values are the cache's (cached_kv). inputs: the query, key and value projections'
  inputs, for the mechanisms that read them (qkv_conv_dynamic). Returns (y_BTD, weights or None).
  """
  q_BTHK, k_BSGK, v_BSGV = mechanisms.on_qkv(params, q_BTHK, k_BSGK, v_BSGV, cfg, inputs)  # qkv_conv
  v_BSGV = value_norm(v_BSGV, cfg)  # after the value convolution (Inkling-2's order); per_head's value_norm_eps
  q_BTHK, k_BSGK = queries_and_keys(params, q_BTHK, k_BSGK, cfg=cfg, opts=opts)
  k_BSGK, v_BSGV = cached_kv(k_BSGK, v_BSGV)
  # A key with one head (shared by all kv heads) stays one head: kernel.attention takes it.
  o_BTHV, w_BHTS = core(params, q_BTHK, k_BSGK, v_BSGV, cfg=cfg, opts=opts, x_BTD=x_BTD)
  return project_out(params, x_BTD, o_BTHV, cfg=cfg, opts=opts), w_BHTS


# Set by attn.analysis.logits.record_logits: called by core with (params, q, k, cfg=, opts=) as the scores read them.
LOGIT_HOOK: contextvars.ContextVar = contextvars.ContextVar("attn_logit_hook", default=None)
# Set by attn.variants.cache while decoding: (k_BSGK, v_BSGV) -> the keys and values to attend to.
KV_HOOK: contextvars.ContextVar = contextvars.ContextVar("attn_kv_hook", default=None)
# Set by attn.nn.kv_sharing around a layer of a model with cross-layer KV sharing, after KV_HOOK:
# records what a source layer attends to, or gives a sharing layer its source's.
KV_SHARE: contextvars.ContextVar = contextvars.ContextVar("attn_kv_share", default=None)


def cached_kv(k_BSGK: Array, v_BSGV: Array) -> tuple[Array, Array]:
  """The keys and values attention reads: these, or while decoding the cache's, with these written
  (or, in a model sharing keys and values across layers, another layer's: KV_SHARE)."""
  hook, share = KV_HOOK.get(), KV_SHARE.get()
  k_BSGK, v_BSGV = (k_BSGK, v_BSGV) if hook is None else hook(k_BSGK, v_BSGV)
  return (k_BSGK, v_BSGV) if share is None else share(k_BSGK, v_BSGV)


def value_norm(v_BSGV: Array, cfg: HeadConfig) -> Array:
  """The values as attention reads them: v, or with cfg.value_norm_eps v RMS-normalised over each
  head's dims without a scale (Gemma 4's v_norm; per_head and k_eq_v read it), in float32 inside.
  attend_and_project applies it after qkv_conv's value convolution (Inkling-2's v_proj.norm)."""
  if cfg.value_norm_eps is None:
    return v_BSGV
  x = v_BSGV.astype(jnp.float32)
  y = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + cfg.value_norm_eps)
  return y.astype(v_BSGV.dtype)


def standard_param_count(cfg: HeadConfig) -> int:
  """D(HK + GK + GV) + HVD weights, plus HK + GK + GV + D biases."""
  D, H, G, K, V = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_k, cfg.d_v
  weights = D * (H * K + G * K + G * V) + H * V * D
  biases = H * K + G * K + G * V + D
  return weights + (biases if cfg.use_bias else 0)


def standard_kv_cache_width(cfg: HeadConfig) -> int:
  """Keys and values of the G kv heads: G·(K + V)."""
  return cfg.num_kv_heads * (cfg.d_k + cfg.d_v)


def standard_score_weights(cfg: HeadConfig) -> int:
  """W_Q (D,H,K) and W_K (D,G,K): D·(H + G)·K."""
  return cfg.d_model * (cfg.num_heads + cfg.num_kv_heads) * cfg.d_k


def core_flops(cfg: HeadConfig, T: int, S: int) -> int:
  """Scores 2·T·S·H·K plus weighted sum 2·T·S·H·V (softmax not counted)."""
  return 2 * T * S * cfg.num_heads * (cfg.d_k + cfg.d_v)


def standard_flops(cfg: HeadConfig, T: int, S: int) -> int:
  """Projections 2·D·(T·HK + S·GK + S·GV) + output 2·T·HV·D + attention core."""
  D, H, G, K, V = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_k, cfg.d_v
  proj = 2 * D * (T * H * K + S * G * K + S * G * V) + 2 * T * H * V * D
  return proj + core_flops(cfg, T, S)


# Effective parameter counts: the dimension of the function class.

def lowrank_dof(rows: int, cols: int, rank: int) -> int:
  """Dim of rows×cols matrices of rank ≤ rank: r·(rows + cols − r), r = min(rank, rows, cols)."""
  r = min(rank, rows, cols)
  return r * (rows + cols - r)


def value_output_dof(cfg: HeadConfig, d_in: int) -> int:
  """W_V,g·[W_O,h]_{h in g} per kv group (rank ≤ V), plus b_o; b_v folds into b_o.

  b_v folds into b_o because a row's weights sum to 1 (fully masked rows
  aside). With sinks they sum to less, and an output gate scales each head's
  o_h: then b_v stays, [W_V,g; b_v,g] being the (d_in + 1)-row factor. An
  elementwise gate scales each value dim apart, so the gauge W_V,g -> W_V,g·A,
  W_O,h -> A⁻¹·W_O,h shrinks from GL(V) to diagonal A: per kv group
  (d_in + b)·V + R·V·D − V.
  """
  G, R, V, D = cfg.num_kv_heads, cfg.group_size, cfg.d_v, cfg.d_model
  b = 1 if cfg.use_bias else 0
  if cfg.gate == "elementwise":
    return G * ((d_in + b) * V + R * V * D - V) + b * D
  rows = d_in + (b if cfg.gate or cfg.sinks else 0)
  return G * lowrank_dof(rows, R * D, V) + b * D


def rope_score_dof(cfg: HeadConfig, n_q: int, d_kv: int) -> int:
  """Degrees of freedom of the RoPE dims of scores whose n_q query rows (with biases) share one key.

  Pair i of the rotated dims scores Re(e^{iω_iΔ}·conj(q_i) k_i) with q_i = x̃·u,
  k_i = c̃·w complex (x̃, c̃ with a trailing 1 when biased): one complex rank-1
  n_q × (d_kv + b) matrix per pair, 2·(n_q + d_kv + b − 1) real dims. The key
  bias no longer drops out of the softmax: rotated, it varies with s.
  """
  b = 1 if cfg.use_bias else 0
  return cfg.rope_dim * (n_q + d_kv + b - 1)


def factored_score_dof(cfg: HeadConfig, d_q: int, d_kv: int) -> int:
  """Score degrees of freedom of W_Q,h·W_K,gᵀ with query heads reading d_q inputs, keys d_kv.

  With RoPE, the d_k − rope_dim unrotated dims keep the low-rank count and each
  kv group's rotated dims add rope_score_dof. The key bias's terms
  x·W_Q,h·b_k + b_q,h·b_k are constant along s, so the softmax drops them;
  with a softcap (inside the cap) or sinks (against the sink) it does not, and
  the key side gets its bias row: (d_kv + 1) columns. A sink then also
  absorbs a head's constant b_q,h·b_k where that entry can move alone
  (sink_trade). QK-norm counts apart (qk_norm_score_dof).
  """
  if cfg.qk_norm:
    return qk_norm_score_dof(cfg, d_q, d_kv)
  b = 1 if cfg.use_bias else 0
  n_q = cfg.group_size * (d_q + b)
  o = kept_key_bias(cfg)
  k = cfg.d_k - cfg.rope_dim
  unrotated = lowrank_dof(n_q, d_kv + o, k) - (sink_trade(cfg, n_q, d_kv + 1, k) if o else 0)
  return cfg.num_kv_heads * (unrotated + rope_score_dof(cfg, n_q, d_kv))


def kept_key_bias(cfg: HeadConfig) -> int:
  """1 when a key bias's terms, constant along s, still move the weights: biases with sinks or
  a softcap (factored_score_dof); else 0, the softmax dropping them."""
  return 1 if cfg.use_bias and (cfg.sinks or cfg.softcap is not None) else 0


def sink_trade(cfg: HeadConfig, n_q: int, n_k: int, rank: int) -> int:
  """Per kv group, the heads' constant score entries b_q,h·b_k that a sink absorbs.

  Shifting head h's logits by c and its sink by −c is the same layer, but
  the shift stays among the group's scores, an n_q × n_k matrix M = A·Bᵀ of
  rank ≤ r, only where the entry (h's bias row, the key-bias column) is a
  tangent direction: all R of them when B spans all n_k columns (r = n_k),
  else as many as the R bias rows' span meets A's column space,
  max(0, r + R − n_q). None under a softcap, where a shift moves the cap.
  """
  if not cfg.sinks or cfg.softcap is not None:
    return 0
  r, R = min(rank, n_q, n_k), cfg.group_size
  return R if r == n_k else max(0, r + R - n_q)


def qk_norm_score_dof(cfg: HeadConfig, d_q: int, d_kv: int) -> int:
  """Score degrees of freedom with QK-norm: every query and key head's map up to its scale.

  q̂_h = RMSNorm(x̃·[W_Q,h; b_q,h]) forgets the map's scale, and nothing else
  trades between heads (the group gauge A no longer preserves the norm):
  H·((d_q + b)·K − 1) + G·((d_kv + b)·K − 1), the key bias now inside the norm.
  The scales q_norm and k_norm enter as products: one per unrotated dim, and
  for a RoPE pair (i, i'), which the rotation mixes, the rank-one 2×2
  [γq_i; γq_i']·[γk_i, γk_i']: 3. In all, K + rope_dim/2. (Assumes d_k ≤ the
  inputs a query and a key read, d_q + b and d_kv + b: else some dims are unseen.)
  qk_norm "whole" (one RMS over all H·K query dims, one over all G·K key dims)
  forgets only the two projections' overall scales, and its scales are per head:
  a group's R query scales against its one key scale give R products per
  unrotated dim and 2R + 1 per RoPE pair, H·K + G·rope_dim/2 in all. qk_norm "fixed" has no
  scales (its qk_scale_factor is a constant, not a parameter): the maps up to their scales, less
  each kv group's rotations that keep the normalised heads' dot products (fixed_norm_gauge). (Measured
  as the Jacobian's rank only where d_k is below the inputs a head reads: at
  d_k ≥ d_q + b it over-counts, the Jacobian's rank being lower.)
  """
  b = 1 if cfg.use_bias else 0
  H, G, K = cfg.num_heads, cfg.num_kv_heads, cfg.d_k
  if cfg.qk_norm == "whole":
    return H * (d_q + b) * K - 1 + G * (d_kv + b) * K - 1 + H * K + G * (cfg.rope_dim // 2)
  maps = H * ((d_q + b) * K - 1) + G * ((d_kv + b) * K - 1)
  if cfg.qk_norm == "fixed":
    return maps - G * fixed_norm_gauge(cfg)
  return maps + K + cfg.rope_dim // 2


def fixed_norm_gauge(cfg: HeadConfig) -> int:
  """One kv group's rotations that leave qk_norm "fixed"'s scores alone: an orthogonal map of the
  query and key heads' K dims keeps their norms and dot products, and with RoPE it must commute with
  the rotation, so the unrotated dims turn freely (O(K − r)) and each RoPE pair turns within itself
  (r/2). Learned scales break this (a diagonal scale commutes with no rotation); with no scale the
  rotations are a gauge, counted out. (Measured: the Jacobian's rank at K = 2, 3, 4, r = 0, 2, 4.)"""
  free = cfg.d_k - cfg.rope_dim
  return free * (free - 1) // 2 + cfg.rope_dim // 2


def score_space_dim(cfg: HeadConfig, d_q: int, d_kv: int) -> int:
  """Dimension of all H score functions: per head (d_q + b)·(d_kv + o + rope_dim·(d_kv + b)).

  o = kept_key_bias(cfg): the key bias's column, when sinks or a softcap keep it; with
  sinks (no softcap) each head's constant score is its sink's (sink_trade): H fewer.
  """
  b = 1 if cfg.use_bias else 0
  o = kept_key_bias(cfg)
  traded = cfg.num_heads if o and cfg.sinks and cfg.softcap is None else 0
  return cfg.num_heads * (d_q + b) * (d_kv + o + cfg.rope_dim * (d_kv + b)) - traded


def factored_effective_param_count(cfg: HeadConfig) -> int:
  """Effective count of a layer with factored W_Q·W_Kᵀ and W_V·W_O (per_head, fused, two_stage)."""
  D = cfg.d_model
  return factored_score_dof(cfg, D, D) + value_output_dof(cfg, D)
