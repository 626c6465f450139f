"""k_eq_v: keys equal to values, one projection serving as both (Gemma 4's attention_k_eq_v).

Each kv head has one map w_kv (D,G,K): its output kv_g = c·W_KV,g + b_kv,g is
the key (after the head mechanisms' on_qk, QK-norm, and RoPE, as every
variant's key) and, un-rotated, the value. With cfg.value_norm_eps the value
is RMSNorm(kv_g) without a scale (Gemma 4's v_norm, with_scale=False), over
each head's K dims. The value width is the key width: d_v ≠ d_k is refused.

The seeds ask whether K and V need their own projections; this is the layout
that answers "no" in a 2026 model. Without the value norm it is per_head with
W_K = W_V (convert: k_eq_v -> per_head is exact); with it the values are no
linear map of the input, so per_head cannot hold them and that conversion is
refused.

In a model sharing keys and values across layers (ModelConfig.kv_source) its keys (rotated) and
values (normed) pass base.cached_kv, so a k_eq_v layer shares with another k_eq_v layer of the same
head. Decoding caches kv itself, un-rotated and un-normalised: K numbers per token
per kv head, not 2·K (cache_entries / attend_cached), rotating the cached keys
at their slots' positions (attn.variants.cache) when it attends.

Params: D·H·K + D·G·K + H·K·D [+ H·K + G·K + D].
FLOPs: 2·D·(T·H·K + S·G·K) + 2·T·H·K·D + the core 2·T·S·H·(K + K).
KV cache: G·K per token. Score weights: D·(H + G)·K (w_q and w_kv).
Effective, in closed form for the plain layer only (no RoPE, value norm or head mechanism;
d_k ≤ d_model and d_k ≤ R·d_model): stored − G·K² − G·K·b. Per kv group, W_KV → W_KV·A with
W_Q,h → W_Q,h·A⁻ᵀ and W_O,h → A⁻¹·W_O,h (GL(K)) is the same layer, and b_kv is free to move: its
score terms are constant along s (the softmax drops them) and its value term, a row's weights
summing to 1, is a constant b_kv·W_O,h that b_o absorbs. Elsewhere measured (the Jacobian's rank).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attn.config import HeadConfig, invalid
from attn.variants import mechanisms
from attn.variants.base import (Options, Params, Variant, add_bias, bias, cached_kv, core, normal,
                                project_heads, project_out, queries_and_keys, value_norm)


def check(cfg: HeadConfig) -> None:
  if cfg.d_v != cfg.d_k:
    raise invalid("d_v", cfg.d_v, f"equal to d_k={cfg.d_k} for k_eq_v: each head's value is its "
                  "key, one projection serving as both")


def init(key, cfg: HeadConfig, dtype=jnp.float32) -> Params:
  D, H, G, K = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_k
  kq, kkv, ko = jax.random.split(key, 3)
  params = {
      "w_q": normal(kq, (D, H, K), D, dtype),
      "w_kv": normal(kkv, (D, G, K), D, dtype),
      "w_o": normal(ko, (H, K, D), H * K, dtype),
  }
  return add_bias(params, cfg, {"b_q": (H, K), "b_kv": (G, K), "b_o": (D,)}, dtype)


def values(kv_BSGK, cfg: HeadConfig):
  """The values of kv: kv itself, or RMS-normalised over each head's K dims without a scale."""
  return value_norm(kv_BSGK, cfg)


def _attend(params: Params, x_BTD, kv_BSGK, *, cfg: HeadConfig, opts: Options):
  """x's queries against keys kv (on_qk, then rotated at opts' key positions) and values(kv)."""
  q_BTHK = project_heads(x_BTD, params["w_q"], bias(params, "b_q"))
  q_BTHK, k_BSGK = queries_and_keys(params, q_BTHK, kv_BSGK, cfg=cfg, opts=opts)
  # Through cached_kv's sharing hook (attn.nn.kv_sharing): a source layer records its rotated keys
  # and normed values, a sharing layer attends to its source's. Its own cache is cache_entries'.
  k_BSGK, v_BSGK = cached_kv(k_BSGK, values(kv_BSGK, cfg))
  o_BTHV, w_BHTS = core(params, q_BTHK, k_BSGK, v_BSGK, cfg=cfg, opts=opts, x_BTD=x_BTD)
  return project_out(params, x_BTD, o_BTHV, cfg=cfg, opts=opts), w_BHTS


def apply(params: Params, x_BTD, context_BSD=None, *, cfg: HeadConfig,
          opts: Options = Options()):
  """One projection per kv head, its output the key and (un-rotated) the value."""
  c_BSD = x_BTD if context_BSD is None else context_BSD
  kv_BSGK = project_heads(c_BSD, params["w_kv"], bias(params, "b_kv"))
  return _attend(params, x_BTD, kv_BSGK, cfg=cfg, opts=opts)


def cache_entries(params: Params, x_BTD, *, cfg: HeadConfig, opts: Options) -> dict:
  """Per token kv (B,T,G,K), un-rotated: the key and the value are both read from it."""
  del opts
  return {"kv": project_heads(x_BTD, params["w_kv"], bias(params, "b_kv"))}


def attend_cached(params: Params, x_BTD, cache: dict, *, cfg: HeadConfig, opts: Options):
  """x's queries against the cached kv, its keys rotated at the positions its slots hold."""
  y_BTD, _ = _attend(params, x_BTD, cache["kv"], cfg=cfg, opts=opts)
  return y_BTD


def param_count(cfg: HeadConfig) -> int:
  D, H, G, K = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_k
  return D * H * K + D * G * K + H * K * D + ((H * K + G * K + D) if cfg.use_bias else 0)


def effective_param_count(cfg: HeadConfig) -> int | None:
  """stored − G·K² − G·K·b for the plain layer (module docstring); None (measured) elsewhere."""
  D, G, K = cfg.d_model, cfg.num_kv_heads, cfg.d_k
  if cfg.rope_dim or cfg.value_norm_eps is not None or mechanisms.active(cfg) or K > D \
      or K > cfg.group_size * D:
    return None
  return param_count(cfg) - G * K * K - (G * K if cfg.use_bias else 0)


def flops(cfg: HeadConfig, T: int, S: int) -> int:
  D, H, G, K = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_k
  return 2 * D * (T * H * K + S * G * K) + 2 * T * H * K * D + 2 * T * S * H * 2 * K


def kv_cache_width(cfg: HeadConfig) -> int:
  """One tensor per token per kv head: G·K (per_head caches G·(K + V))."""
  return cfg.num_kv_heads * cfg.d_k


def score_weights(cfg: HeadConfig) -> int:
  return cfg.d_model * (cfg.num_heads + cfg.num_kv_heads) * cfg.d_k


VARIANT = Variant(
    name="k_eq_v",
    lacks={"qkv_heads": "k_eq_v caches one tensor for keys and values and computes its scores itself"},
    sharding={"w_kv": "DGK", "b_kv": "GK"},
    init=init,
    apply=apply,
    param_count=param_count,
    effective_param_count=effective_param_count,
    flops=flops,
    kv_cache_width=kv_cache_width,
    score_weights=score_weights,
    check=check,
    cache_entries=cache_entries,
    attend_cached=attend_cached,
    fields=("value_norm_eps",),
)
