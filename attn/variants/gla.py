"""gla: Gated Linear Attention (Yang et al. 2024), a decay per key channel and no delta rule.

Each of the H value heads keeps a state S of d_k × d_v and, per token (attn.variants.linear.core,
plain recurrence with g per key channel),

  S_t = diag(α_t)·S_{t−1} + k_t·v_tᵀ,   o_t = S_tᵀ·q_t,   log α_t = logsigmoid(x·W_ga·W_gb + b_g) / 16

as fla's GatedLinearAttention defines the layer (its defaults: no short convolution, a rank-16
decay projection with a bias on its second factor, gate_logit_normalizer 16, q scaled by
1/sqrt(d_k), and the output gate fused with the norm): o ← RMSNorm(o)·norm ⊙ SiLU(x·W_Z), then W^O.
The heads map onto HeadConfig as every fixed-state head's (attn.variants.gated_deltanet):
num_heads the value heads, num_kv_heads the query/key heads, chunk the scan's step (a decay per
key channel makes each chunk hold a (C, C, d_k) tensor per head: keep it small, 16 to 64);
conv_width is not read. The decay's rank is RANK (fla's gate_low_rank_dim), min(RANK, d_model).

Params: D·(2GK + 2HV) + D·R + R·H·K + H·K + V + HVD [+ 2GK + HV + D], R = min(16, D).
State per sequence: H·K·V (float32). Score weights (what the implied mixing depends on: q, k and
the decay): D·2GK + D·R + R·H·K + H·K.
FLOPs per token: the projections 2D·(2GK + 2HV) + 2HVD, the decay's 2·(DR + RHK) with its bias,
log-sigmoid and 1/16 (5HK), q's scale (GK), the gated norm (rms, scale, SiLU, product: 9HV); plus
the chunked plain recurrence with a decay per key channel (core.chunked_flops).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from attn.config import HeadConfig
from attn.variants.base import (Options, Params, Variant, add_bias, bias, dense, normal,
                                project_heads, project_out, zeros)
from attn.variants.linear import core, parts

NAME = "gla"
RANK = 16  # fla's gate_low_rank_dim
NORMALIZER = 16.0  # fla's gate_logit_normalizer
NORM_EPS = 1e-5  # fla's GLA norm_eps


def check(cfg: HeadConfig) -> None:
  parts.check(cfg, NAME)


def rank(cfg: HeadConfig) -> int:
  return min(RANK, cfg.d_model)


def init(key, cfg: HeadConfig, dtype=jnp.float32) -> Params:
  D, H, G, K, V, R = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_k, cfg.d_v, rank(cfg)
  ks = jax.random.split(key, 7)
  params = {
      "w_q": normal(ks[0], (D, G, K), D, dtype), "w_k": normal(ks[1], (D, G, K), D, dtype),
      "w_v": normal(ks[2], (D, H, V), D, dtype), "w_z": normal(ks[3], (D, H, V), D, dtype),
      "w_ga": normal(ks[4], (D, R), D, dtype), "w_gb": normal(ks[5], (R, H, K), R, dtype),
      "b_g": zeros((H, K), dtype), "norm": jnp.ones((V,), dtype),
      "w_o": normal(ks[6], (H, V, D), H * V, dtype),
  }
  return add_bias(params, cfg, {"b_q": (G, K), "b_k": (G, K), "b_v": (H, V), "b_o": (D,)}, dtype)


def channel_decay(params: Params, x_BTD) -> jax.Array:
  """g = logsigmoid(x·W_ga·W_gb + b_g) / 16: (B,T,H,K), float32, ≤ 0."""
  f_BTR = dense(x_BTD, params["w_ga"], 0)
  f_BTHK = jnp.einsum("BTR,RHK->BTHK", f_BTR, params["w_gb"]).astype(jnp.float32)
  return jax.nn.log_sigmoid(f_BTHK + params["b_g"].astype(jnp.float32)) / NORMALIZER


def forward(params: Params, x_BTD, state, *, cfg: HeadConfig, opts: Options):
  """(y, the state after x's tokens) from `state` (None: a fresh sequence)."""
  x_in = parts.zero_padding(x_BTD, opts.kv_lengths)
  q_BTGK = project_heads(x_in, params["w_q"], bias(params, "b_q")).astype(jnp.float32)
  q_BTGK = q_BTGK / math.sqrt(cfg.d_k)
  k_BTGK = project_heads(x_in, params["w_k"], bias(params, "b_k"))
  v_BTHV = project_heads(x_in, params["w_v"], bias(params, "b_v"))
  kw = dict(g=channel_decay(params, x_in), state_BHKV=None if state is None else state["ssm"],
            kv_lengths=opts.kv_lengths)
  if state is not None and x_BTD.shape[1] == 1:
    o_BTHV, ssm = core.recurrent(q_BTGK, k_BTGK, v_BTHV, **kw)
  else:
    o_BTHV, ssm = core.chunked(q_BTGK, k_BTGK, v_BTHV, chunk=cfg.chunk, **kw)
  z_BTHV = project_heads(x_in, params["w_z"], 0).astype(jnp.float32)
  o_BTHV = parts.rms(o_BTHV, NORM_EPS) * params["norm"].astype(jnp.float32) * jax.nn.silu(z_BTHV)
  y_BTD = project_out(params, x_in, o_BTHV.astype(x_BTD.dtype), cfg=cfg, opts=opts)
  return y_BTD, {"ssm": ssm}


def state_shapes(cfg: HeadConfig) -> dict[str, tuple[int, ...]]:
  return {"ssm": (cfg.num_heads, cfg.d_k, cfg.d_v)}


def param_count(cfg: HeadConfig) -> int:
  D, H, G, K, V, R = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_k, cfg.d_v, rank(cfg)
  biases = 2 * G * K + H * V + D if cfg.use_bias else 0
  return D * (2 * G * K + 2 * H * V) + D * R + R * H * K + H * K + V + H * V * D + biases


def score_weights(cfg: HeadConfig) -> int:
  D, H, G, K, R = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_k, rank(cfg)
  return D * 2 * G * K + D * R + R * H * K + H * K


def flops(cfg: HeadConfig, T: int, S: int) -> int:
  """Forward FLOPs of T tokens (S = T), as the module docstring derives."""
  del S
  D, H, G, K, V, R = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_k, cfg.d_v, rank(cfg)
  per_token = (2 * D * (2 * G * K + 2 * H * V) + 2 * H * V * D + 2 * (D * R + R * H * K)
               + 5 * H * K + G * K + (parts.NORM + 2 + parts.SILU) * H * V)
  return T * per_token + core.chunked_flops(T, cfg.chunk, H, K, V, delta=False, decay="channel")


VARIANT = Variant(
    name=NAME,
    sharding={"w_q": "DGK", "w_k": "DGK", "b_q": "GK", "b_k": "GK", "w_z": "DHV", "w_ga": "DF",
              "w_gb": "FHK", "b_g": "HK", "norm": "V"},
    init=init,
    param_count=param_count,
    score_weights=score_weights,
    flops=flops,
    check=check,
    **parts.state_record(NAME, forward, state_shapes),
)
