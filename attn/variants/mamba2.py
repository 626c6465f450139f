"""mamba2: the Mamba-2 mixer, state-space duality (SSD; Dao & Gu 2024), as a head variant.

Each of H heads keeps a state of N × P (state size × head width) and, per token,

  h_t = exp(Δ_t·A_h)·h_{t−1} + Δ_t·B_t·x_tᵀ,   y_t = h_tᵀ·C_t + D_h·x_t

with Δ_t = softplus(x·W_dt + dt_bias) and A_h = −exp(A_log_h) one scalar per head: the core's
plain (non-delta) recurrence with a per-head decay (attn.variants.linear.core: q = C, k = B,
v = x, g = Δ·A, β = Δ). As transformers' mamba2 defines the layer (Mamba2Mixer, its torch path):
x, B and C pass one short causal convolution of width cfg.conv_width (depthwise, with a bias)
and SiLU; B and C have n_groups heads, head h reading group h // (H/n_groups); the output is
RMSNorm(y ⊙ SiLU(z)) over each group's (H/n_groups)·P dims, times its scale, then W^O.

HeadConfig, as for every fixed-state head (attn.variants.gated_deltanet's docstring): num_heads
is Mamba-2's num_heads, d_v its head_dim P, d_k its state_size N (refused at 0 by HeadConfig's
own rule, naming d_k), num_kv_heads its n_groups; conv_width and chunk are HeadConfig fields.
use_bias is Mamba-2's use_bias (in_proj's and out_proj's biases); the convolution always has
its bias (use_conv_bias, true in every released Mamba-2). The norm's epsilon is Mamba2Config's
layer_norm_epsilon default, 1e-5. time_step_limit is transformers' default (0, ∞): no clamp.

Parameters: w_v, w_z (D,H,V), w_k (B), w_q (C) (D,G,K), w_dt (D,H); conv_v (W,H,V), conv_k, conv_q
(W,G,K) and their biases conv_v_bias (H,V), conv_k_bias, conv_q_bias (G,K); a_log, dt_bias,
d_skip (H,); norm (H,V); w_o (H,V,D); with use_bias b_v, b_z (H,V), b_k, b_q (G,K), b_dt (H,),
b_o (D,).

Params: D·(2HV + 2GK + H) + (W + 1)·(HV + 2GK) + 3H + HV + HVD [+ 2HV + 2GK + H + D].
State per sequence: H·K·V (float32) + (W − 1)·(HV + 2GK). Score weights (what the implied
mixing depends on: B, C and Δ): D·(2GK + H) + W·2GK + 2H.
FLOPs per token: the projections 2D·(2HV + 2GK + H) + 2HVD, the convolution with its bias and
SiLU over HV + 2GK channels, Δ and Δ·A (softplus and two more: 8H), the skip D·x (2HV) and the
gated norm (SiLU(z), product, rms, scale: 9HV); plus the chunked plain recurrence with a
per-head decay (attn.variants.linear.core.chunked_flops).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attn.config import HeadConfig
from attn.variants.base import (Options, Params, Variant, add_bias, bias, dense, normal,
                                project_heads, project_out, zeros)
from attn.variants.linear import core, parts

NAME = "mamba2"
NORM_EPS = 1e-5  # Mamba2Config.layer_norm_epsilon


def check(cfg: HeadConfig) -> None:
  parts.check(cfg, NAME)


def init(key, cfg: HeadConfig, dtype=jnp.float32) -> Params:
  D, H, G, K, V, W = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_k, cfg.d_v, cfg.conv_width
  ks = jax.random.split(key, 10)
  params = {
      "w_v": normal(ks[0], (D, H, V), D, dtype), "w_z": normal(ks[1], (D, H, V), D, dtype),
      "w_k": normal(ks[2], (D, G, K), D, dtype), "w_q": normal(ks[3], (D, G, K), D, dtype),
      "w_dt": normal(ks[4], (D, H), D, dtype),
      "conv_v": normal(ks[5], (W, H, V), W, dtype), "conv_k": normal(ks[6], (W, G, K), W, dtype),
      "conv_q": normal(ks[7], (W, G, K), W, dtype),
      "conv_v_bias": zeros((H, V), dtype), "conv_k_bias": zeros((G, K), dtype),
      "conv_q_bias": zeros((G, K), dtype),
      "d_skip": jnp.ones((H,), dtype), "norm": jnp.ones((H, V), dtype),
      "w_o": normal(ks[8], (H, V, D), H * V, dtype),
  }
  a_log, dt_bias = parts.init_decay(ks[9], H, dtype)
  params.update(a_log=a_log, dt_bias=dt_bias)
  return add_bias(params, cfg, {"b_v": (H, V), "b_z": (H, V), "b_k": (G, K), "b_q": (G, K),
                                "b_dt": (H,), "b_o": (D,)}, dtype)


def forward(params: Params, x_BTD, state, *, cfg: HeadConfig, opts: Options):
  """(y, the state after x's tokens) from `state` (None: a fresh sequence)."""
  B_, T, _ = x_BTD.shape
  H, G, K, V = cfg.num_heads, cfg.num_kv_heads, cfg.d_k, cfg.d_v
  x_in = parts.zero_padding(x_BTD, opts.kv_lengths)
  names = ("v", "k", "q")
  proj = [project_heads(x_in, params[f"w_{n}"], bias(params, f"b_{n}")).reshape(B_, T, -1)
          for n in names]
  w_WC = jnp.concatenate([params[f"conv_{n}"].reshape(cfg.conv_width, -1) for n in names], -1)
  b_C = jnp.concatenate([params[f"conv_{n}_bias"].reshape(-1) for n in names])
  y_BTC, conv_state = parts.causal_conv(jnp.concatenate(proj, -1), w_WC, b_C,
                                        None if state is None else state["conv"])
  y_BTC = jax.nn.silu(y_BTC)
  x_BTHV = y_BTC[..., :H * V].reshape(B_, T, H, V)
  k_BTGK = y_BTC[..., H * V:H * V + G * K].reshape(B_, T, G, K)
  q_BTGK = y_BTC[..., H * V + G * K:].reshape(B_, T, G, K)
  dt_BTH = jax.nn.softplus((dense(x_in, params["w_dt"], bias(params, "b_dt"))
                            + params["dt_bias"]).astype(jnp.float32))
  g_BTH = -jnp.exp(params["a_log"].astype(jnp.float32)) * dt_BTH
  kw = dict(g=g_BTH, beta_BTH=dt_BTH, state_BHKV=None if state is None else state["ssm"],
            kv_lengths=opts.kv_lengths)
  if state is not None and T == 1:
    o_BTHV, ssm = core.recurrent(q_BTGK, k_BTGK, x_BTHV, **kw)
  else:
    o_BTHV, ssm = core.chunked(q_BTGK, k_BTGK, x_BTHV, chunk=cfg.chunk, **kw)
  o_BTHV = o_BTHV + params["d_skip"].astype(jnp.float32)[:, None] * x_BTHV.astype(jnp.float32)
  z_BTHV = project_heads(x_in, params["w_z"], bias(params, "b_z")).astype(jnp.float32)
  o_BTGF = (o_BTHV * jax.nn.silu(z_BTHV)).reshape(B_, T, G, -1)  # each group's heads together
  o_BTHV = parts.rms(o_BTGF, NORM_EPS).reshape(B_, T, H, V) * params["norm"].astype(jnp.float32)
  y_BTD = project_out(params, x_in, o_BTHV.astype(x_BTD.dtype), cfg=cfg, opts=opts)
  return y_BTD, {"conv": conv_state, "ssm": ssm}


def state_shapes(cfg: HeadConfig) -> dict[str, tuple[int, ...]]:
  H, G, K, V = cfg.num_heads, cfg.num_kv_heads, cfg.d_k, cfg.d_v
  return {"conv": (cfg.conv_width - 1, H * V + 2 * G * K), "ssm": (H, K, V)}


def param_count(cfg: HeadConfig) -> int:
  D, H, G, K, V, W = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_k, cfg.d_v, cfg.conv_width
  biases = 2 * H * V + 2 * G * K + H + D if cfg.use_bias else 0
  return (D * (2 * H * V + 2 * G * K + H) + (W + 1) * (H * V + 2 * G * K) + 3 * H + H * V
          + H * V * D + biases)


def score_weights(cfg: HeadConfig) -> int:
  D, H, G, K, W = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_k, cfg.conv_width
  return D * (2 * G * K + H) + W * 2 * G * K + 2 * H


def flops(cfg: HeadConfig, T: int, S: int) -> int:
  """Forward FLOPs of T tokens (S = T), as the module docstring derives."""
  del S
  D, H, G, K, V, W = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_k, cfg.d_v, cfg.conv_width
  per_token = (2 * D * (2 * H * V + 2 * G * K + H) + 2 * H * V * D
               + parts.conv_flops(W, H * V + 2 * G * K, bias=True) + (parts.SOFTPLUS + 2) * H
               + (2 + parts.SILU + 1 + parts.NORM + 1) * H * V)
  return T * per_token + core.chunked_flops(T, cfg.chunk, H, K, V, delta=False, decay="head")


VARIANT = Variant(
    name=NAME,
    sharding={"w_v": "DHV", "w_z": "DHV", "w_k": "DGK", "w_q": "DGK", "w_dt": "DH",
              "conv_v": "WHV", "conv_k": "WGK", "conv_q": "WGK", "conv_v_bias": "HV",
              "conv_k_bias": "GK", "conv_q_bias": "GK", "a_log": "H", "dt_bias": "H",
              "d_skip": "H", "norm": "HV", "b_v": "HV", "b_z": "HV", "b_k": "GK", "b_q": "GK",
              "b_dt": "H"},
    init=init,
    param_count=param_count,
    score_weights=score_weights,
    flops=flops,
    check=check,
    **parts.state_record(NAME, forward, state_shapes),
)
