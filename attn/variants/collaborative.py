"""collaborative: heads share one query and one key projection and differ by mixing vectors.

Cordonnier, Loukas & Jaggi 2020, "Multi-Head Attention: Collaborate Instead of
Concatenate": logits_h = scale·(x W̃_Q + b̃_Q) diag(m_h) (c W̃_K + b̃_K)ᵀ with
W̃_Q, W̃_K of shape (D, D̃), D̃ = cfg.collab_width, and m (H, D̃). Concatenated
heads are the special case D̃ = H·K, m_h = indicator of block h (convert
per_head -> collaborative is exact). Grouped heads: keys have no heads here
(W̃_K is shared by all), so G only groups the values, as in per_head.

Params: 2·D·D̃ + H·D̃ + D·G·V + H·V·D [+ 2·D̃ + G·V + D].
FLOPs: 2·(T + S)·D·D̃ + T·H·D̃ (mixing) + 2·S·D·G·V + 2·T·H·V·D + 2·T·S·H·(D̃ + V).
Effective: scores are the H×(D+b)×D tensor Σ_j m_j ⊗ [w̃_Q,j; b̃_Q,j] ⊗ w̃_K,j of
  CP rank ≤ D̃: min(D̃·(H + 2D + b − 2), H·(D+b)·D) for H ≥ 2 (the expected
  dimension, assuming it is not defective; a gauge of 2 scalings per rank-one
  term), lowrank(D+b, D; D̃) for H = 1; b̃_K drops out of the softmax;
  + Σ_g lowrank(D, R·D; V) + b·D as in base.py.
KV cache: one shared key c_s·W̃_K (D̃ wide, no heads) plus the G·V values.
Score weights: 2·D·D̃ + H·D̃. No RoPE (rope_dim > 0 is refused; `check` says why).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attn.config import HeadConfig, invalid
from attn.variants.base import (Options, Params, Variant, add_bias, attend_and_project, bias,
                                kept_key_bias, lowrank_dof, normal, project_heads,
                                score_space_dim, value_output_dof)


def check(cfg: HeadConfig) -> None:
  if cfg.rope_dim:
    raise invalid("rope_dim", cfg.rope_dim,
                  "0 for collaborative: its heads are one shared D̃-wide query/key scaled per "
                  "dimension by m_h, which does not commute with RoPE's pair rotations; rotating "
                  "the shared dims cannot express per_head's per-head rotations, so the variant "
                  "would no longer contain per_head (per_head -> collaborative exact)")


def init(key, cfg: HeadConfig, dtype=jnp.float32) -> Params:
  D, H, G, V, J = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_v, cfg.collab_width
  kq, kk, km, kv, ko = jax.random.split(key, 5)
  params = {
      "w_q": normal(kq, (D, J), D, dtype),
      "w_k": normal(kk, (D, J), D, dtype),
      # Σ_j m_hj² ≈ K, as for the block indicator of concatenated heads.
      "m": normal(km, (H, J), J, dtype) * jnp.sqrt(jnp.asarray(cfg.d_k, dtype)),
      "w_v": normal(kv, (D, G, V), D, dtype),
      "w_o": normal(ko, (H, V, D), H * V, dtype),
  }
  return add_bias(params, cfg, {"b_q": (J,), "b_k": (J,), "b_v": (G, V), "b_o": (D,)}, dtype)


def apply(params: Params, x_BTD, context_BSD=None, *, cfg: HeadConfig,
          opts: Options = Options()):
  c_BSD = x_BTD if context_BSD is None else context_BSD
  q_BTJ = x_BTD @ params["w_q"] + bias(params, "b_q")
  k_BSJ = c_BSD @ params["w_k"] + bias(params, "b_k")
  q_BTHJ = q_BTJ[:, :, None, :] * params["m"]
  # The shared keys serve every kv group: one key head (attend_and_project broadcasts it).
  k_BS1J = k_BSJ[:, :, None]
  v_BSGV = project_heads(c_BSD, params["w_v"], bias(params, "b_v"))
  return attend_and_project(params, x_BTD, q_BTHJ, k_BS1J, v_BSGV, cfg=cfg, opts=opts)


def param_count(cfg: HeadConfig) -> int:
  D, H, G, V, J = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_v, cfg.collab_width
  biases = 2 * J + G * V + D
  return 2 * D * J + H * J + D * G * V + H * V * D + (biases if cfg.use_bias else 0)


def effective_param_count(cfg: HeadConfig) -> int:
  D, H, J = cfg.d_model, cfg.num_heads, cfg.collab_width
  b, o = (1 if cfg.use_bias else 0), kept_key_bias(cfg)  # o: b̃_K stays (sinks, softcap)
  if H == 1:
    scores = lowrank_dof(D + b, D + o, J)
  else:
    scores = min(J * (H + 2 * D + b + o - 2), score_space_dim(cfg, D, D))
  return scores + value_output_dof(cfg, D)


def flops(cfg: HeadConfig, T: int, S: int) -> int:
  D, H, G, V, J = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_v, cfg.collab_width
  proj = 2 * (T + S) * D * J + T * H * J + 2 * S * D * G * V + 2 * T * H * V * D
  return proj + 2 * T * S * H * (J + V)


def kv_cache_width(cfg: HeadConfig) -> int:
  return cfg.collab_width + cfg.num_kv_heads * cfg.d_v


def score_weights(cfg: HeadConfig) -> int:
  return 2 * cfg.d_model * cfg.collab_width + cfg.num_heads * cfg.collab_width


VARIANT = Variant(
    name="collaborative",
    sharding={"w_q": "DJ", "w_k": "DJ", "b_q": "J", "b_k": "J", "m": "HJ"},
    init=init,
    apply=apply,
    param_count=param_count,
    effective_param_count=effective_param_count,
    flops=flops,
    kv_cache_width=kv_cache_width,
    score_weights=score_weights,
    check=check,
    lacks={"qkv_heads": "collaborative's key is one shared D̃-wide projection, not per-head keys",
           "qk_heads": "collaborative's heads are one shared D̃-wide query scaled by m_h against one shared "
                       "key: no d_k-wide query and key heads",
           "key_heads": "collaborative's heads share one D̃-wide key"},
)
