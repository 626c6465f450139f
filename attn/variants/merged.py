"""merged: per query head one D×D bilinear matrix W_h = W_Q,h·W_K,g(h)ᵀ, trained directly.

logits[h,t,s] = scale·(x_t W_h c_sᵀ + b_kc,h·c_s) (seed question 4). b_kc is
the key-side content term a query bias turns into; the key bias and the
b_q·b_k product are constant along s and drop out of the softmax, so merged
has neither. Values and output are per_head's: w_v (D,G,V), w_o (H,V,D).
Grouped heads: W_h is per query head (merging erases the sharing of W_K);
only the values are shared, query head h reading value head h // R.

Params: H·D² + D·G·V + H·V·D [+ H·D + G·V + D].
FLOPs: 2·T·H·D² (x W_h) + 2·S·D·G·V + 2·T·H·V·D + 2·T·S·H·(D + V).
Effective: H·(D + b)·D scores (b = 1 with biases: the b_kc row)
  + Σ_g lowrank(D, R·D; V) for the W_V,g·[W_O,h]_h∈g products + D for b_o
  (b_v folds into b_o when no query row is fully masked).
The factored count (per_head, fused, two_stage) lives in base.py:
  Σ_g lowrank(R·(D + b), D; K) + Σ_g lowrank(D, R·D; V) + b·D, where
  lowrank(m, n; k) = r·(m + n − r), r = min(k, m, n), is the dimension of m×n
  matrices of rank ≤ k. The gauge W_Q,h → W_Q,h A, W_K,g → W_K,g A⁻ᵀ is one
  A per kv group, so a group's R stacked query matrices (each with its b_q,h
  row) times W_K,gᵀ is one (R·(D+b))×D matrix of rank ≤ K.
KV cache: the raw context c_s (D) that x_t·W_h is scored against, plus the
G·V values: D + G·V per token. Score weights: H·D².
No RoPE (rope_dim > 0 is refused): rotations by t − s sit between W_Q,h and
W_K,hᵀ, so no single W_h exists.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attn.config import HeadConfig, invalid
from attn.variants.base import (Options, Params, Variant, add_bias, attend_and_project, bias,
                                normal, value_output_dof)


def check(cfg: HeadConfig) -> None:
  if cfg.rope_dim:
    raise invalid("rope_dim", cfg.rope_dim,
                  "0 for merged: with RoPE the score is x W_Q,h R(t − s) W_K,hᵀ c, so no "
                  "position-free W_h exists (attn.variants.rope.position_free_fit gives the "
                  "best one and its error)")


def init(key, cfg: HeadConfig, dtype=jnp.float32) -> Params:
  D, H, G, V = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_v
  kqk, kv, ko = jax.random.split(key, 3)
  params = {
      # Var of x W_h c is D·Var(W) with unit inputs; 1/D² keeps it O(1/D) like D·K/D².
      "w_qk": normal(kqk, (H, D, D), D * D, dtype) * jnp.sqrt(jnp.asarray(cfg.d_k, dtype)),
      "w_v": normal(kv, (D, G, V), D, dtype),
      "w_o": normal(ko, (H, V, D), H * V, dtype),
  }
  return add_bias(params, cfg, {"b_kc": (H, D), "b_v": (G, V), "b_o": (D,)}, dtype)


def apply(params: Params, x_BTD, context_BSD=None, *, cfg: HeadConfig,
          opts: Options = Options()):
  """Scores as (x W_h + b_kc,h)·c: a D-wide query per head against the raw context."""
  c_BSD = x_BTD if context_BSD is None else context_BSD
  qm_BTHD = jnp.einsum("BTD,HDE->BTHE", x_BTD, params["w_qk"]) + bias(params, "b_kc")
  # Every kv group compares against the same raw context: one key head, shared (and cached once).
  c_BS1D = c_BSD[:, :, None]
  v_BSGV = jnp.einsum("BSD,DGV->BSGV", c_BSD, params["w_v"]) + bias(params, "b_v")
  return attend_and_project(params, x_BTD, qm_BTHD, c_BS1D, v_BSGV, cfg=cfg, opts=opts)


def param_count(cfg: HeadConfig) -> int:
  D, H, G, V = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_v
  biases = H * D + G * V + D
  return H * D * D + D * G * V + H * V * D + (biases if cfg.use_bias else 0)


def effective_param_count(cfg: HeadConfig) -> int:
  D, H = cfg.d_model, cfg.num_heads
  b = 1 if cfg.use_bias else 0
  return H * (D + b) * D + value_output_dof(cfg, D)


def flops(cfg: HeadConfig, T: int, S: int) -> int:
  D, H, G, V = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_v
  proj = 2 * T * H * D * D + 2 * S * D * G * V + 2 * T * H * V * D
  return proj + 2 * T * S * H * (D + V)


def kv_cache_width(cfg: HeadConfig) -> int:
  return cfg.d_model + cfg.num_kv_heads * cfg.d_v


def score_weights(cfg: HeadConfig) -> int:
  return cfg.num_heads * cfg.d_model ** 2


VARIANT = Variant(
    name="merged",
    sharding={"w_qk": "HDD", "b_kc": "HD"},
    init=init,
    apply=apply,
    param_count=param_count,
    effective_param_count=effective_param_count,
    flops=flops,
    kv_cache_width=kv_cache_width,
    score_weights=score_weights,
    check=check,
    lacks={"qkv_heads": "merged has no key or value heads of its own, only x·W_h against the raw context",
           "qk_heads": "merged has no separate queries and keys, only x·W_h against the raw context",
           "key_heads": "merged has no d_k-wide keys, only x·W_h against the raw context"},
)
