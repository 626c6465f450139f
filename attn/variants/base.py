"""The variant contract, and the pieces every variant shares.

A variant is a parameterization of one multi-head attention layer over a plain
dict of arrays. Its `apply(params, x_BTD, context_BSD, *, cfg, mask,
return_weights, head_mask, is_causal, kv_lengths, qk_positions)` returns
`(y_BTD, weights_BHTS or None)`; `context_BSD` is None for self-attention;
`head_mask` (H,) or (B,H) gates each query head's output before W^O (Michel
et al. 2019), None meaning all ones; `is_causal` and `kv_lengths` are
kernel.attention's structured masks, passed through to attend_and_project;
`qk_positions` is None or (query positions, key positions) for RoPE
(cfg.rope_dim > 0; None: 0..T−1 and 0..S−1), also passed through. A variant
that cannot have RoPE refuses rope_dim > 0 in its `check`, with the reason.
Counts are per layer; FLOPs count a multiply-add as 2 and are per batch
element, forward only, for T queries and S keys. The KV-cache width is the
elements cached per decoded token; the score weights are the weights the
attention logits depend on, biases excluded. `decode_apply`, when a variant
has one, computes the same function as `apply` the way a decoder would, its
kernel reading only the kv_cache_width columns a cache holds (mla: queries
absorbed into the latent); None means `apply` already does.

Decoding with a KV cache (attn.variants.cache; DecoderLM.init_cache) caches,
per token, exactly kv_cache_width(cfg) numbers. By default these are the keys
(rotated once, at their own positions) and values that `apply` hands to
attend_and_project: every variant that projects its keys and values and then
calls attend_and_project (or calls `cached_kv` itself, as talking_heads does)
decodes with nothing more. A key shared by all kv heads (merged's raw context,
collaborative's D̃-wide key) is passed with one head, so it is cached once.
A variant that caches something else sets both `cache_entries(params, x_BTD,
*, cfg, positions)` -> dict of (B,T,...) arrays per token, and
`attend_cached(params, x_BTD, cache, *, cfg, positions, mask, head_mask)` ->
y_BTD, cache holding the same names over the cache length (mla: the latent
and the rotated RoPE key).

attn.analysis.circuits reads a variant through its exact converter to per_head.
A variant without one sets `circuits(params, cfg)` -> the same dict of factors
as attn.analysis.circuits' readers ({"qk": (a, b), "ov": (a, b), biases}),
e.g. talking_heads, which mixes per_head's.
"""

from __future__ import annotations

import contextvars
import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from attn import kernel
from attn.config import HeadConfig
from attn.variants import rope

Array = jax.Array
Params = dict[str, Array]


def _no_constraint(cfg: HeadConfig) -> None:
  del cfg


@dataclasses.dataclass(frozen=True)
class Variant:
  """One head parameterization: init / apply / counts / FLOPs / KV-cache width / score weights."""

  name: str
  init: Callable[[Array, HeadConfig, Any], Params]
  apply: Callable[..., tuple[Array, Array | None]]
  param_count: Callable[[HeadConfig], int]
  effective_param_count: Callable[[HeadConfig], int]
  flops: Callable[[HeadConfig, int, int], int]
  kv_cache_width: Callable[[HeadConfig], int]
  score_weights: Callable[[HeadConfig], int]
  check: Callable[[HeadConfig], None] = _no_constraint
  decode_apply: Callable[..., tuple[Array, Array | None]] | None = None
  cache_entries: Callable[..., dict[str, Array]] | None = None
  attend_cached: Callable[..., Array] | None = None
  circuits: Callable[..., dict[str, Any]] | None = None


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


def attend_and_project(params: Params, q_BTHK: Array, k_BSGK: Array, v_BSGV: Array, *,
                       cfg: HeadConfig, mask, return_weights: bool, dtype, head_mask=None,
                       is_causal: bool = False, kv_lengths=None, impl: str = "auto",
                       qk_positions=None):
  """The shared tail of every variant: RoPE, attention, head gates, then w_o (as (H,V,D)) and b_o.

  k_BSGK may have one head (a key shared by every kv head); while decoding,
  the keys and values are the cache's (cached_kv).

  RoPE (cfg.rope_dim > 0) rotates the first rope_dim dims of every query and
  key head (attn.variants.rope). impl "auto" (kernel.best_impl) is the einsum
  kernel for short sequences on CPU and the blocked one for long
  (T·S >= kernel.BLOCKED_MIN_SCORES) without weights out.
  """
  q_BTHK, k_BSGK = rope.rotate_qk(q_BTHK, k_BSGK, cfg, qk_positions)
  k_BSGK, v_BSGV = cached_kv(k_BSGK, v_BSGV)
  if k_BSGK.shape[2] != v_BSGV.shape[2]:  # one key shared by all kv heads
    k_BSGK = jnp.broadcast_to(k_BSGK, (*k_BSGK.shape[:2], v_BSGV.shape[2], k_BSGK.shape[3]))
  out = kernel.attention(q_BTHK, k_BSGK, v_BSGV, mask, is_causal=is_causal,
                         kv_lengths=kv_lengths, scale=cfg.score_scale,
                         return_weights=return_weights, impl=impl)
  out_BTHV, w_BHTS = out if return_weights else (out, None)
  w_o_HVD = params["w_o"].reshape(cfg.num_heads, cfg.d_v, cfg.d_model)
  y_BTD = output_projection(gate_heads(out_BTHV, head_mask), w_o_HVD, bias(params, "b_o"))
  return y_BTD.astype(dtype), w_BHTS


# Set by attn.variants.cache while decoding: (k_BSGK, v_BSGV) -> the keys and values to attend to.
KV_HOOK: contextvars.ContextVar = contextvars.ContextVar("attn_kv_hook", default=None)


def cached_kv(k_BSGK: Array, v_BSGV: Array) -> tuple[Array, Array]:
  """The keys and values attention reads: these, or while decoding the cache's, with these written."""
  hook = KV_HOOK.get()
  return (k_BSGK, v_BSGV) if hook is None else hook(k_BSGK, v_BSGV)


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
  """W_V,g·[W_O,h]_{h in g} per kv group (rank ≤ V), plus b_o; b_v folds into b_o."""
  G, R, V, D = cfg.num_kv_heads, cfg.group_size, cfg.d_v, cfg.d_model
  return G * lowrank_dof(d_in, R * D, V) + (D if cfg.use_bias else 0)


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
  kv group's rotated dims add rope_score_dof.
  """
  b = 1 if cfg.use_bias else 0
  n_q = cfg.group_size * (d_q + b)
  return cfg.num_kv_heads * (lowrank_dof(n_q, d_kv, cfg.d_k - cfg.rope_dim)
                             + rope_score_dof(cfg, n_q, d_kv))


def score_space_dim(cfg: HeadConfig, d_q: int, d_kv: int) -> int:
  """Dimension of all H score functions: per head (d_q + b)·d_kv, + rope_dim·(d_q + b)·(d_kv + b)."""
  b = 1 if cfg.use_bias else 0
  return cfg.num_heads * (d_q + b) * (d_kv + cfg.rope_dim * (d_kv + b))


def factored_effective_param_count(cfg: HeadConfig) -> int:
  """Effective count of a layer with factored W_Q·W_Kᵀ and W_V·W_O (per_head, fused, two_stage)."""
  D = cfg.d_model
  return factored_score_dof(cfg, D, D) + value_output_dof(cfg, D)
