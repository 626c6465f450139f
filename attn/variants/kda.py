"""kda: Kimi Delta Attention, the gated delta rule with a decay per key channel (Kimi Linear, 2025).

gated_deltanet's layer (attn.variants.gated_deltanet: the same projections, short convolution,
l2-normed q and k, β = σ(x·W_b) or with linear_allow_neg_eigval 2σ(x·W_b), delta rule and gated
RMSNorm) with two changes, as
transformers' kimi_linear defines them (KimiLinearDeltaAttention):

  the decay is per key channel, through a low-rank projection:
    g = −exp(A_log_h)·softplus(x·W_fa·W_fb + dt_bias) ∈ R^{H×K}, W_fa (D, K), W_fb (K, H, K),
    so each of the d_k rows of a head's state fades at its own rate (core.chunked with g (B,T,H,K));
  the output gate is low-rank and a sigmoid: o ← RMSNorm(o)·norm ⊙ σ(x·W_ga·W_gb), W_ga (D, V),
    W_gb (V, H, V).

The low-rank widths are d_k (decay) and d_v (gate): Kimi Linear's f_a_proj and g_a_proj map to
head_dim, its d_k = d_v. Two options (HeadConfig fields only kda reads) give Ling-3's layer
(transformers' bailing_hybrid, BailingHybridDeltaAttention):

  kda_full_rank: the decay and the gate through full-rank projections, W_f (D, H, K) and
    W_g (D, H, V) in place of W_fa·W_fb and W_ga·W_gb (Ling-3's f_proj and g_proj);
  kda_lower_bound b < 0 (None: the softplus decay above): the bounded ("safe") decay
    g = b·σ(exp(A_log_h)·(x·W_f + dt_bias)) ∈ (b, 0), so no channel forgets faster than e^b per
    token whatever the weights (Ling-3's kda_safe_gate with kda_lower_bound, −5 by default).

The heads map onto HeadConfig as gated_deltanet's do (num_heads the value heads, num_kv_heads the
query/key heads: Kimi Linear has as many of each); chunk and conv_width are the HeadConfig fields. A per-key-channel
decay makes each chunk of the scan hold a (C, C, d_k) tensor per head (attn.variants.linear.core):
keep chunk small (16 or 32).

Params: D·(2GK + HV + H) + W·(2GK + HV) + D·K + K·H·K + H·K + H + D·V + V·H·V + V + HVD
  [+ 2GK + HV + D]; with kda_full_rank D·H·K and D·H·V in place of D·K + K·H·K and D·V + V·H·V.
State per sequence: H·K·V + (W − 1)·(2GK + HV), as gated_deltanet.
Score weights: D·2GK + W·2GK + D·H + D·K + K·H·K + H·K + H (kda_full_rank: D·H·K for the decay's).
FLOPs per token: gated_deltanet's without W_Z, W_A, their SiLU and scalar decay, plus the low-rank
decay 2·(DK + KHK) with its softplus per channel (8HK) and the low-rank gate 2·(DV + VHV) with
its sigmoid (the gated norm: 8HV); with kda_full_rank 2DHK and 2DHV instead, and the bounded decay
its σ and three products (6HK) where the softplus form has 8HK; the chunked delta rule with a decay
per key channel, whose (C,C,K) decay per chunk and head costs 4C²K per score matrix (core.chunked_flops).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attn.config import HeadConfig
from attn.variants import gated_deltanet as gdn
from attn.variants.base import Params, Variant, dense, normal, project_heads
from attn.variants.linear import core, parts

NAME = "kda"


def check(cfg: HeadConfig) -> None:
  parts.check(cfg, NAME)


def init(key, cfg: HeadConfig, dtype=jnp.float32) -> Params:
  D, H, K, V = cfg.d_model, cfg.num_heads, cfg.d_k, cfg.d_v
  keys = jax.random.split(key, 13)
  params = gdn.init_common(keys[:8], cfg, dtype)
  if cfg.kda_full_rank:
    params.update({"w_f": normal(keys[8], (D, H, K), D, dtype), "w_g": normal(keys[10], (D, H, V), D, dtype)})
  else:
    params.update({
        "w_fa": normal(keys[8], (D, K), D, dtype), "w_fb": normal(keys[9], (K, H, K), K, dtype),
        "w_ga": normal(keys[10], (D, V), D, dtype), "w_gb": normal(keys[11], (V, H, V), V, dtype),
    })
  params["a_log"], params["dt_bias"] = parts.init_decay(keys[12], H, dtype, (H, K))
  return params


def _decay_input(params: Params, x_BTD) -> jax.Array:
  """x·W_f (or x·W_fa·W_fb) + dt_bias: (B,T,H,K), float32."""
  if "w_f" in params:
    f_BTHK = project_heads(x_BTD, params["w_f"], 0).astype(jnp.float32)
  else:
    f_BTHK = jnp.einsum("BTF,FHK->BTHK", dense(x_BTD, params["w_fa"], 0), params["w_fb"]).astype(jnp.float32)
  return f_BTHK + params["dt_bias"].astype(jnp.float32)


def channel_decay(params: Params, x_BTD) -> jax.Array:
  """g = −exp(A_log)·softplus(x·W_fa·W_fb + dt_bias): (B,T,H,K), float32."""
  a_H11 = jnp.exp(params["a_log"].astype(jnp.float32))[:, None]
  return -a_H11 * jax.nn.softplus(_decay_input(params, x_BTD))


def bounded_decay(lower_bound: float):
  """The decay g = b·σ(exp(A_log)·(x·W_f + dt_bias)) in (b, 0), b = lower_bound (Ling-3's safe gate)."""

  def decay(params: Params, x_BTD) -> jax.Array:
    a_H11 = jnp.exp(params["a_log"].astype(jnp.float32))[:, None]
    return lower_bound * jax.nn.sigmoid(a_H11 * _decay_input(params, x_BTD))
  return decay


def sigmoid_gate(params: Params, x_BTD) -> jax.Array:
  """σ(x·W_ga·W_gb), or σ(x·W_g) full rank: (B,T,H,V), float32."""
  if "w_g" in params:
    return jax.nn.sigmoid(project_heads(x_BTD, params["w_g"], 0).astype(jnp.float32))
  g_BTF = dense(x_BTD, params["w_ga"], 0)
  return jax.nn.sigmoid(jnp.einsum("BTF,FHV->BTHV", g_BTF, params["w_gb"]).astype(jnp.float32))


def forward(params: Params, x_BTD, state, *, cfg: HeadConfig, opts):
  decay = channel_decay if cfg.kda_lower_bound is None else bounded_decay(float(cfg.kda_lower_bound))
  return gdn.forward(params, x_BTD, state, cfg=cfg, opts=opts, decay=decay, gate=sigmoid_gate)


def param_count(cfg: HeadConfig) -> int:
  D, H, G, K, V, W = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_k, cfg.d_v, cfg.conv_width
  biases = 2 * G * K + H * V + D if cfg.use_bias else 0
  decay = _decay_weights(cfg) + H * K + H
  gate = D * H * V if cfg.kda_full_rank else D * V + V * H * V
  return (D * (2 * G * K + H * V + H) + W * (2 * G * K + H * V) + decay + gate + V + H * V * D
          + biases)


def _decay_weights(cfg: HeadConfig) -> int:
  """The decay projection's weights: D·H·K full rank, else D·K + K·H·K."""
  D, H, K = cfg.d_model, cfg.num_heads, cfg.d_k
  return D * H * K if cfg.kda_full_rank else D * K + K * H * K


def score_weights(cfg: HeadConfig) -> int:
  D, H, G, K, W = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_k, cfg.conv_width
  return D * 2 * G * K + W * 2 * G * K + D * H + _decay_weights(cfg) + H * K + H


def flops(cfg: HeadConfig, T: int, S: int) -> int:
  """Forward FLOPs of T tokens (S = T), as the module docstring derives."""
  del S
  D, H, G, K, V, W = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_k, cfg.d_v, cfg.conv_width
  gate = D * H * V if cfg.kda_full_rank else D * V + V * H * V
  proj = 2 * D * (2 * G * K + H * V + H) + 2 * _decay_weights(cfg) + 2 * gate
  decay = parts.SOFTPLUS + 2 if cfg.kda_lower_bound is None else parts.SIGMOID + 3
  per_token = (proj + 2 * H * V * D + parts.conv_flops(W, 2 * G * K + H * V)
               + (2 * parts.NORM + 1) * G * K + parts.SIGMOID * H + decay * H * K
               + (parts.NORM + 2 + parts.SIGMOID) * H * V + gdn.neg_eigval_flops(cfg) * H)
  return T * per_token + core.chunked_flops(T, cfg.chunk, H, K, V, delta=True, decay="channel")


VARIANT = Variant(
    name=NAME,
    sharding={**gdn.SHARDING, "w_fa": "DF", "w_fb": "FHK", "w_ga": "DF", "w_gb": "FHV",
              "w_f": "DHK", "w_g": "DHV", "a_log": "H", "dt_bias": "HK"},
    init=init,
    param_count=param_count,
    score_weights=score_weights,
    flops=flops,
    check=check,
    fields=("linear_allow_neg_eigval", "kda_full_rank", "kda_lower_bound"),
    **parts.state_record(NAME, forward, gdn.state_shapes),
)
