"""linear: causal linear attention (Katharopoulos et al. 2020), the baseline of the linear heads.

The softmax's exp(q·k) is replaced by a feature map's inner product φ(q)·φ(k), φ = elu + 1 > 0,
so the weighted sum over the past becomes a running state (attn.variants.linear.core, no decay,
no delta rule):

  o_t = φ(q_t)ᵀ·S_t / φ(q_t)ᵀ·z_t,   S_t = Σ_{s≤t} φ(k_s)·v_sᵀ,   z_t = Σ_{s≤t} φ(k_s)

The normaliser z is the same recurrence over a value of ones, so the state is d_k × (d_v + 1)
per value head. The parameters are per_head's canonical layout (w_q (D,H,K) read as (D,G,K)
query/key heads, as every fixed-state head maps HeadConfig: num_heads the value heads,
num_kv_heads the query/key heads (attn.variants.gated_deltanet)); no convolution, so conv_width
is not read. chunk is the scan's step. A fully padded example (kv_lengths 0) outputs 0.

Params: D·(2GK + HV) + HVD [+ 2GK + HV + D]. State per sequence: H·K·(V + 1) (float32).
Score weights: D·2GK. FLOPs per token: the projections 2D·(2GK + HV) + 2HVD, φ on q and k (elu
and the 1: 3 per element, 2GK) and the division by the normaliser (HV); plus the chunked plain
recurrence without decay over V + 1 value columns (attn.variants.linear.core.chunked_flops).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attn.config import HeadConfig
from attn.variants.base import (Options, Params, Variant, add_bias, bias, normal, project_heads,
                                project_out)
from attn.variants.linear import core, parts

NAME = "linear"


def check(cfg: HeadConfig) -> None:
  parts.check(cfg, NAME)


def init(key, cfg: HeadConfig, dtype=jnp.float32) -> Params:
  D, H, G, K, V = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_k, cfg.d_v
  kq, kk, kv, ko = jax.random.split(key, 4)
  params = {"w_q": normal(kq, (D, G, K), D, dtype), "w_k": normal(kk, (D, G, K), D, dtype),
            "w_v": normal(kv, (D, H, V), D, dtype), "w_o": normal(ko, (H, V, D), H * V, dtype)}
  return add_bias(params, cfg, {"b_q": (G, K), "b_k": (G, K), "b_v": (H, V), "b_o": (D,)}, dtype)


def feature_map(x):
  """φ(x) = elu(x) + 1, in float32: positive, so every normaliser is."""
  return jax.nn.elu(x.astype(jnp.float32)) + 1.0


def forward(params: Params, x_BTD, state, *, cfg: HeadConfig, opts: Options):
  x_in = parts.zero_padding(x_BTD, opts.kv_lengths)
  q_BTGK = feature_map(project_heads(x_in, params["w_q"], bias(params, "b_q")))
  k_BTGK = feature_map(project_heads(x_in, params["w_k"], bias(params, "b_k")))
  v_BTHV = project_heads(x_in, params["w_v"], bias(params, "b_v")).astype(jnp.float32)
  v1_BTHW = jnp.concatenate([v_BTHV, jnp.ones(v_BTHV.shape[:-1] + (1,), jnp.float32)], -1)
  kw = dict(state_BHKV=None if state is None else state["ssm"], kv_lengths=opts.kv_lengths)
  if state is not None and x_BTD.shape[1] == 1:
    o_BTHW, ssm = core.recurrent(q_BTGK, k_BTGK, v1_BTHW, **kw)
  else:
    o_BTHW, ssm = core.chunked(q_BTGK, k_BTGK, v1_BTHW, chunk=cfg.chunk, **kw)
  den_BTH1 = o_BTHW[..., -1:]
  o_BTHV = o_BTHW[..., :-1] / jnp.where(den_BTH1 > 0, den_BTH1, 1.0)
  y_BTD = project_out(params, x_in, o_BTHV.astype(x_BTD.dtype), cfg=cfg, opts=opts)
  return y_BTD, {"ssm": ssm}


def state_shapes(cfg: HeadConfig) -> dict[str, tuple[int, ...]]:
  return {"ssm": (cfg.num_heads, cfg.d_k, cfg.d_v + 1)}


def param_count(cfg: HeadConfig) -> int:
  D, H, G, K, V = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_k, cfg.d_v
  return D * (2 * G * K + H * V) + H * V * D + ((2 * G * K + H * V + D) if cfg.use_bias else 0)


def score_weights(cfg: HeadConfig) -> int:
  return cfg.d_model * 2 * cfg.num_kv_heads * cfg.d_k


def flops(cfg: HeadConfig, T: int, S: int) -> int:
  """Forward FLOPs of T tokens (S = T), as the module docstring derives."""
  del S
  D, H, G, K, V = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_k, cfg.d_v
  per_token = 2 * D * (2 * G * K + H * V) + 2 * H * V * D + 3 * 2 * G * K + H * V
  return T * per_token + core.chunked_flops(T, cfg.chunk, H, K, V + 1, delta=False, decay=None)


VARIANT = Variant(
    name=NAME,
    sharding={"w_q": "DGK", "w_k": "DGK", "b_q": "GK", "b_k": "GK"},
    init=init,
    param_count=param_count,
    score_weights=score_weights,
    flops=flops,
    check=check,
    **parts.state_record(NAME, forward, state_shapes),
)
