"""gated_deltanet: the gated delta rule head of Qwen3-Next and Qwen3.5 (Yang et al. 2024).

Each of the H value heads keeps a state S of d_k × d_v instead of a KV cache and updates it
token by token (attn.variants.linear.core, delta rule):

  S_t = α_t·S_{t−1} + β_t·k_t·(v_t − α_t·S_{t−1}ᵀk_t)ᵀ,   o_t = S_tᵀ·q_t

as transformers' qwen3_next defines the layer (Qwen3NextGatedDeltaNet):

  q, k = x·W_Q, x·W_K (G key heads), v = x·W_V (H value heads), all through one short causal
    convolution of width cfg.conv_width (depthwise, no bias) and SiLU;
  q ← l2norm(q)/sqrt(d_k), k ← l2norm(k); value head h reads key head h // (H/G);
  β = σ(x·W_b) (2σ(x·W_b) with cfg.linear_allow_neg_eigval: OLMo-Hybrid's β in [0, 2]) and g = log α = −exp(A_log)·softplus(x·W_a + dt_bias), one each per value head;
  o ← RMSNorm(o)·norm ⊙ SiLU(x·W_Z) (the norm's epsilon cfg.gated_norm_eps), then W^O.

How a Qwen3-Next layer maps onto HeadConfig (the decision, kept for every fixed-state head):
num_heads H is the value heads (linear_num_value_heads: each owns a state, its output goes
through W^O), num_kv_heads G the query/key heads (linear_num_key_heads), d_k and d_v the key and
value head widths; HeadConfig's own rule that G divides H is "H_v a multiple of H_k", refused by
the name num_kv_heads. The variant's own options are HeadConfig fields, as mla's latent_dim and
tpa's ranks are: conv_width and chunk (the chunked scan's step; any chunk gives the same
function). use_bias adds b_q, b_k (G,K), b_v (H,V) and b_o (D,) (Qwen3-Next has none). The
output gate mechanism (cfg.gate) composes on the shared path; head_mask gates o_h before W^O.

Parameters: w_q, w_k (D,G,K), w_v, w_z (D,H,V), w_b, w_a (D,H), conv_q, conv_k (W,G,K), conv_v
(W,H,V), a_log, dt_bias (H,), norm (V,), w_o (H,V,D). kda (attn.variants.kda) is this layer with a
decay per key channel and a low-rank sigmoid gate; its record reuses forward() below.

Params: D·(2GK + 2HV + 2H) + W·(2GK + HV) + 2H + V + HVD [+ 2GK + HV + D].
State per sequence: H·K·V (float32) + (W − 1)·(2GK + HV) (the convolution's last inputs);
  no KV cache (kv_cache_width 0). Score weights (what the implied mixing of values depends on):
  D·2GK + W·2GK + 2·D·H + 2H.
FLOPs (flops below), per token: the projections 2D·(2GK + 2HV + 2H) + 2HVD, the convolution and
  SiLU over 2GK + HV channels (parts.conv_flops), l2norm of q and k and q's 1/sqrt(d_k) (7GK),
  β and the decay (σ, softplus and two more: 11H; β's doubling with linear_allow_neg_eigval: H), the gated norm (rms, scale, SiLU, product:
  9HV); plus the chunked delta rule at cfg.chunk (core.chunked_flops, per-head decay). The
  elementwise terms are what XLA's cost analysis counts, so the total is within a few percent of
  its count of the computation with its loops unrolled (tests/test_linear_flops.py).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from attn.config import HeadConfig
from attn.variants.base import (Options, Params, Variant, add_bias, bias, dense, normal,
                                project_heads, project_out)
from attn.variants.linear import core, parts

NAME = "gated_deltanet"


def check(cfg: HeadConfig) -> None:
  parts.check(cfg, NAME)


def init_common(keys, cfg: HeadConfig, dtype) -> Params:
  """The projections and convolutions a delta-rule head shares (gated_deltanet, kda)."""
  D, H, G, K, V, W = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_k, cfg.d_v, cfg.conv_width
  kq, kk, kv, kcq, kck, kcv, kb, ko = keys
  params = {
      "w_q": normal(kq, (D, G, K), D, dtype), "w_k": normal(kk, (D, G, K), D, dtype),
      "w_v": normal(kv, (D, H, V), D, dtype), "w_b": normal(kb, (D, H), D, dtype),
      "conv_q": normal(kcq, (W, G, K), W, dtype), "conv_k": normal(kck, (W, G, K), W, dtype),
      "conv_v": normal(kcv, (W, H, V), W, dtype),
      "norm": jnp.ones((V,), dtype), "w_o": normal(ko, (H, V, D), H * V, dtype),
  }
  return add_bias(params, cfg, {"b_q": (G, K), "b_k": (G, K), "b_v": (H, V), "b_o": (D,)}, dtype)


def init(key, cfg: HeadConfig, dtype=jnp.float32) -> Params:
  D, H, V = cfg.d_model, cfg.num_heads, cfg.d_v
  keys = jax.random.split(key, 11)
  params = init_common(keys[:8], cfg, dtype)
  params["w_z"] = normal(keys[8], (D, H, V), D, dtype)
  params["w_a"] = normal(keys[9], (D, H), D, dtype)
  params["a_log"], params["dt_bias"] = parts.init_decay(keys[10], H, dtype)
  return params


def qkv(params: Params, x_BTD, conv_state, cfg: HeadConfig):
  """q, k (B,T,G,K) l2-normed (q also by 1/sqrt(d_k)), v (B,T,H,V), and the convolution's state."""
  B, T, _ = x_BTD.shape
  H, G, K, V = cfg.num_heads, cfg.num_kv_heads, cfg.d_k, cfg.d_v
  q = project_heads(x_BTD, params["w_q"], bias(params, "b_q")).reshape(B, T, G * K)
  k = project_heads(x_BTD, params["w_k"], bias(params, "b_k")).reshape(B, T, G * K)
  v = project_heads(x_BTD, params["w_v"], bias(params, "b_v")).reshape(B, T, H * V)
  w_WC = jnp.concatenate([params["conv_q"].reshape(-1, G * K), params["conv_k"].reshape(-1, G * K),
                          params["conv_v"].reshape(-1, H * V)], axis=-1)
  y_BTC, conv_state = parts.causal_conv(jnp.concatenate([q, k, v], -1), w_WC, None, conv_state)
  y_BTC = jax.nn.silu(y_BTC)
  q, k, v = y_BTC[..., :G * K], y_BTC[..., G * K:2 * G * K], y_BTC[..., 2 * G * K:]
  q_BTGK = parts.l2norm(q.reshape(B, T, G, K)) / math.sqrt(K)
  k_BTGK = parts.l2norm(k.reshape(B, T, G, K))
  return q_BTGK, k_BTGK, v.reshape(B, T, H, V), conv_state


def scalar_decay(params: Params, x_BTD) -> jax.Array:
  """g = −exp(A_log)·softplus(x·W_a + dt_bias): (B,T,H), float32."""
  a_BTH = dense(x_BTD, params["w_a"], 0).astype(jnp.float32)
  return -jnp.exp(params["a_log"].astype(jnp.float32)) * jax.nn.softplus(
      a_BTH + params["dt_bias"].astype(jnp.float32))


def silu_gate(params: Params, x_BTD) -> jax.Array:
  return jax.nn.silu(project_heads(x_BTD, params["w_z"], 0).astype(jnp.float32))


def forward(params: Params, x_BTD, state, *, cfg: HeadConfig, opts: Options, decay=scalar_decay,
            gate=silu_gate):
  """(y, the state after x's tokens) of a delta-rule head from `state` (None: a fresh sequence)."""
  x_in = parts.zero_padding(x_BTD, opts.kv_lengths)
  q, k, v, conv_state = qkv(params, x_in, None if state is None else state["conv"], cfg)
  beta_BTH = jax.nn.sigmoid(dense(x_in, params["w_b"], 0).astype(jnp.float32))
  if cfg.linear_allow_neg_eigval:  # β in [0, 2]: I − β·k·kᵀ may have the eigenvalue 1 − β < 0
    beta_BTH = 2.0 * beta_BTH
  kw = dict(g=decay(params, x_in), beta_BTH=beta_BTH, delta=True,
            state_BHKV=None if state is None else state["ssm"], kv_lengths=opts.kv_lengths)
  if state is not None and x_BTD.shape[1] == 1:
    o_BTHV, ssm = core.recurrent(q, k, v, **kw)
  else:
    o_BTHV, ssm = core.chunked(q, k, v, chunk=cfg.chunk, **kw)
  o_BTHV = parts.rms(o_BTHV, cfg.gated_norm_eps) * params["norm"].astype(jnp.float32) * gate(params, x_in)
  y_BTD = project_out(params, x_in, o_BTHV.astype(x_BTD.dtype), cfg=cfg, opts=opts)
  return y_BTD, {"conv": conv_state, "ssm": ssm}


def state_shapes(cfg: HeadConfig) -> dict[str, tuple[int, ...]]:
  """Per sequence: the convolution's last W − 1 inputs and the H states of d_k × d_v."""
  H, G, K, V = cfg.num_heads, cfg.num_kv_heads, cfg.d_k, cfg.d_v
  return {"conv": (cfg.conv_width - 1, 2 * G * K + H * V), "ssm": (H, K, V)}


def param_count(cfg: HeadConfig) -> int:
  D, H, G, K, V, W = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_k, cfg.d_v, cfg.conv_width
  biases = 2 * G * K + H * V + D if cfg.use_bias else 0
  return (D * (2 * G * K + 2 * H * V + 2 * H) + W * (2 * G * K + H * V) + 2 * H + V + H * V * D
          + biases)


def score_weights(cfg: HeadConfig) -> int:
  D, H, G, K, W = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_k, cfg.conv_width
  return D * 2 * G * K + W * 2 * G * K + 2 * D * H + 2 * H


def flops(cfg: HeadConfig, T: int, S: int) -> int:
  """Forward FLOPs of T tokens (S = T: self-attention only), as the module docstring derives."""
  del S
  D, H, G, K, V, W = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_k, cfg.d_v, cfg.conv_width
  proj = 2 * D * (2 * G * K + 2 * H * V + 2 * H) + 2 * H * V * D
  per_token = (proj + parts.conv_flops(W, 2 * G * K + H * V) + (2 * parts.NORM + 1) * G * K
               + (parts.SIGMOID + parts.SOFTPLUS + 2 + neg_eigval_flops(cfg)) * H
               + (parts.NORM + 2 + parts.SILU) * H * V)
  return T * per_token + core.chunked_flops(T, cfg.chunk, H, K, V, delta=True, decay="head")


def neg_eigval_flops(cfg: HeadConfig) -> int:
  """Per value head and token: 1 for β's doubling with linear_allow_neg_eigval, else 0."""
  return 1 if cfg.linear_allow_neg_eigval else 0


SHARDING = {"w_q": "DGK", "w_k": "DGK", "b_q": "GK", "b_k": "GK", "conv_q": "WGK", "conv_k": "WGK",
            "conv_v": "WHV", "w_b": "DH", "norm": "V"}

VARIANT = Variant(
    name=NAME,
    sharding={**SHARDING, "w_z": "DHV", "w_a": "DH", "a_log": "H", "dt_bias": "H"},
    init=init,
    param_count=param_count,
    score_weights=score_weights,
    flops=flops,
    check=check,
    fields=("linear_allow_neg_eigval",),
    **parts.state_record(NAME, forward, state_shapes),
)
