"""differential: each head's weights are the difference of two softmaxes (Ye et al. 2024).

Differential Transformer (arXiv:2410.05258). Query head h has two queries
Q_1,h, Q_2,h and reads two keys K_1,g, K_2,g of its kv head g = h // R (each
d_k wide) and one value V_g (d_v wide):

  A_i,h = softmax(scale·Q_i,h K_i,gᵀ)  (i = 1, 2),   o_h = (A_1,h − λ·A_2,h)·V_g,
  λ = exp(λ_q1·λ_k1) − exp(λ_q2·λ_k2) + λ_init,  λ_init = 0.8 − 0.6·exp(−0.3·(l − 1)),

λ_q1, λ_k1, λ_q2, λ_k2 learned d_k-vectors shared by the heads (as in the
paper's reference code; init N(0, 0.1²)), l = cfg.layer, the layer's 1-based
index (the models set it). Each o_h is then RMS-normalised over its d_v dims
(eps 1e-5, a learned scale `norm` shared by the heads: the reference code's
subln) and multiplied by (1 − λ_init), before the head gates and W^O. A fully
masked row has o_h = 0, which the norm keeps at 0.

Layout: w_q (D,2,H,K) and w_k (D,2,G,K), [:, 0] the first query/key pair and
[:, 1] the second; w_v (D,G,V), w_o (H,V,D), lambda_q1, lambda_k1, lambda_q2,
lambda_k2 (K,), norm (V,); b_q (2,H,K), b_k (2,G,K), b_v (G,V), b_o (D,). RoPE
rotates both pairs; both softmaxes take the call's masks (base.core twice). With
cfg.probability "sigmoid" or "relu" (attn.kernel.probability) each A_i is that map instead,
A_1 − λ·A_2 a difference of two unnormalised maps (defined, not in the paper; its
effective count is then measured, as for every variant under that option).
return_weights gives the difference map A_1 − λ·A_2 (B,H,T,S): signed, its
unmasked rows sum to 1 − λ, not 1 (Variant.signed_weights).

Params: D·(2·H·K + 2·G·K + G·V) + H·V·D + 4·K + V [+ 2·H·K + 2·G·K + G·V + D].
FLOPs: 2·D·(2·T·H·K + 2·S·G·K + S·G·V) + 2·2·T·S·H·(K + V) + 2·T·H·V·D.
Effective: 2·factored_score_dof(D, D) − [qk_norm]·(K + rope_dim/2) + 1
  + G·((D + b)·v − v(v − 1)/2 + R·D·v − [b = 1 and V ≥ D + 1]) + b·D,
  v = min(V, D + b). Each softmax has per_head's score count
  (base.factored_score_dof); with QK-norm each pair's scores forget its
  maps' scales there, but the q_norm/k_norm products (K + rope_dim/2) are
  shared by the pairs, so counted once. λ's four vectors give one number
  (+1), the norm's scale folds into W^O. The norm keeps only W_V,g's
  orthogonal gauge: per kv group the map depends on Σ_g = M_g M_gᵀ and
  M_g·[W_O,h]_{h in g}, M_g = [W_V,g; b_v,g] ((D + b)×V), so with
  v = min(V, D + b): (D + b)·v − v(v − 1)/2 + R·D·v; b_v no longer folds
  into b_o. The norm's eps breaks the scale gauge (the function sees
  ‖u‖² + eps), except when V ≥ D + 1 with biases: the bias row's ‖·‖² term
  absorbs eps (−1 per group). An elementwise gate (after the norm) leaves of
  that gauge only diagonal maps, which the norm does not commute with (the
  subln scale, diagonal, still folds into W^O): per group M_g and the W_O,h
  are all free, (D + b)·V + R·D·V, eps unabsorbed. A headwise gate keeps it.
  Sinks are shared by the two softmaxes (one per head, mechanisms). Plus b·D.
KV cache: G·(2·K + V) per token (both keys of each kv head, and its value).
Score weights: 2·D·(H + G)·K + 4·K.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from attn.config import HeadConfig, invalid
from attn.variants.base import (Options, Params, Variant, add_bias, bias, cached_kv, core,
                                factored_score_dof, no_circuits, normal, project_heads,
                                project_out, queries_and_keys)

NORM_EPS = 1e-5  # the reference code's subln RMSNorm


def lambda_init(layer: int) -> float:
  """λ_init = 0.8 − 0.6·exp(−0.3·(l − 1)) at the 1-based layer l (the paper's schedule)."""
  return 0.8 - 0.6 * math.exp(-0.3 * (layer - 1))


def check(cfg: HeadConfig) -> None:
  if cfg.qk_norm == "whole":
    raise invalid("qk_norm", "whole", "False or True for differential: its pairs of score maps share per-head QK-norm scales (shared_score_dof); a norm over the whole projection is not counted")


def init(key, cfg: HeadConfig, dtype=jnp.float32) -> Params:
  D, H, G, K, V = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_k, cfg.d_v
  kq, kk, kv, ko, kl = jax.random.split(key, 5)
  params = {
      "w_q": normal(kq, (D, 2, H, K), D, dtype),
      "w_k": normal(kk, (D, 2, G, K), D, dtype),
      "w_v": normal(kv, (D, G, V), D, dtype),
      "w_o": normal(ko, (H, V, D), H * V, dtype),
      "norm": jnp.ones((V,), dtype),
  }
  for name, k in zip(("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"), jax.random.split(kl, 4)):
    params[name] = (0.1 * jax.random.normal(k, (K,), jnp.float32)).astype(dtype)
  biases = {"b_q": (2, H, K), "b_k": (2, G, K), "b_v": (G, V), "b_o": (D,)}
  return add_bias(params, cfg, biases, dtype)


def lambda_(params: Params, cfg: HeadConfig) -> jax.Array:
  """λ = exp(λ_q1·λ_k1) − exp(λ_q2·λ_k2) + λ_init, a float32 scalar shared by the heads."""
  dot = lambda a, b: jnp.sum(params[a].astype(jnp.float32) * params[b].astype(jnp.float32))
  return (jnp.exp(dot("lambda_q1", "lambda_k1")) - jnp.exp(dot("lambda_q2", "lambda_k2"))
          + lambda_init(cfg.layer))


def apply(params: Params, x_BTD, context_BSD=None, *, cfg: HeadConfig,
          opts: Options = Options()):
  """Two query/key pairs per head, two softmaxes over one value, their difference normalised."""
  c_BSD = x_BTD if context_BSD is None else context_BSD
  D, H, G, K = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_k
  # Both pairs as 2H query heads and 2G key heads (pair i, head h at i·H + h): RoPE and the
  # cache treat them as heads of their own.
  q_BTIK = project_heads(x_BTD, params["w_q"].reshape(D, 2 * H, K), bias(params, "b_q"))
  k_BSJK = project_heads(c_BSD, params["w_k"].reshape(D, 2 * G, K), bias(params, "b_k"))
  v_BSGV = project_heads(c_BSD, params["w_v"], bias(params, "b_v"))
  q_BTIK, k_BSJK = queries_and_keys(params, q_BTIK, k_BSJK, cfg=cfg, opts=opts)
  k_BSJK, v_BSGV = cached_kv(k_BSJK, v_BSGV)
  o1_BTHV, w1_BHTS = core(params, q_BTIK[:, :, :H], k_BSJK[:, :, :G], v_BSGV, cfg=cfg, opts=opts, x_BTD=x_BTD)
  o2_BTHV, w2_BHTS = core(params, q_BTIK[:, :, H:], k_BSJK[:, :, G:], v_BSGV, cfg=cfg, opts=opts, x_BTD=x_BTD)
  lam = lambda_(params, cfg)
  o_BTHV = o1_BTHV.astype(jnp.float32) - lam * o2_BTHV.astype(jnp.float32)
  o_BTHV = o_BTHV * jax.lax.rsqrt(jnp.mean(o_BTHV ** 2, axis=-1, keepdims=True) + NORM_EPS)
  o_BTHV = o_BTHV * params["norm"].astype(jnp.float32) * (1.0 - lambda_init(cfg.layer))
  y_BTD = project_out(params, x_BTD, o_BTHV.astype(x_BTD.dtype), cfg=cfg, opts=opts)
  return y_BTD, (w1_BHTS - lam * w2_BHTS if opts.return_weights else None)


def param_count(cfg: HeadConfig) -> int:
  D, H, G, K, V = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_k, cfg.d_v
  weights = D * (2 * H * K + 2 * G * K + G * V) + H * V * D + 4 * K + V
  biases = 2 * H * K + 2 * G * K + G * V + D
  return weights + (biases if cfg.use_bias else 0)


def value_dof(cfg: HeadConfig) -> int:
  """One kv group's value-output map through the per-head RMSNorm (module docstring)."""
  D, R, V = cfg.d_model, cfg.group_size, cfg.d_v
  b = 1 if cfg.use_bias else 0
  if cfg.gate == "elementwise":  # no gauge left: M_g and the W_O,h all free
    return (D + b) * V + R * D * V
  v = min(V, D + b)
  eps_absorbed = 1 if b and V >= D + b else 0
  return (D + b) * v - v * (v - 1) // 2 + R * D * v - eps_absorbed


def shared_score_dof(cfg: HeadConfig) -> int:
  """QK-norm's scales, which both pairs share: counted once, not once per pair (docstring)."""
  return cfg.d_k + cfg.rope_dim // 2 if cfg.qk_norm and cfg.qk_norm != "fixed" else 0  # "fixed": none


def effective_param_count(cfg: HeadConfig) -> int:
  D = cfg.d_model
  b = 1 if cfg.use_bias else 0
  scores = 2 * factored_score_dof(cfg, D, D) - shared_score_dof(cfg)
  return scores + 1 + cfg.num_kv_heads * value_dof(cfg) + b * D


def flops(cfg: HeadConfig, T: int, S: int) -> int:
  D, H, G, K, V = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_k, cfg.d_v
  proj = 2 * D * (2 * T * H * K + 2 * S * G * K + S * G * V) + 2 * T * H * V * D
  return proj + 2 * 2 * T * S * H * (K + V)


def kv_cache_width(cfg: HeadConfig) -> int:
  return cfg.num_kv_heads * (2 * cfg.d_k + cfg.d_v)


def score_weights(cfg: HeadConfig) -> int:
  return 2 * cfg.d_model * (cfg.num_heads + cfg.num_kv_heads) * cfg.d_k + 4 * cfg.d_k


VARIANT = Variant(
    name="differential",
    check=check,
    lacks={"qkv_heads": "differential computes its two maps itself, not through attend_and_project",
           "one_map": "differential has two softmax maps per head, which would each run the mechanism: "
                      "the paper does not define that and the counts do not cover it"},
    sharding={"w_q": "DXHK", "w_k": "DXGK", "b_q": "XHK", "b_k": "XGK", "lambda_q1": None,
              "lambda_k1": None, "lambda_q2": None, "lambda_k2": None, "norm": None},  # X: the two query/key pairs
    init=init,
    apply=apply,
    param_count=param_count,
    effective_param_count=effective_param_count,
    flops=flops,
    kv_cache_width=kv_cache_width,
    score_weights=score_weights,
    circuits=no_circuits(
        "differential",
        "a variant with one bilinear score form per head: differential's weights "
        "softmax(x W_Q1,h W_K1,gᵀ cᵀ) − λ·softmax(x W_Q2,h W_K2,gᵀ cᵀ) are a difference of "
        "two softmaxes, which no single W_QK,h gives (read the two pairs' products apart)"),
    signed_weights=True,
)
