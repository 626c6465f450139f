"""split_input: query head h sees only its slice of the embedding, x[..., h·D/H:(h+1)·D/H].

Seed question 3: the input is duplicated to every head in the Transformer, not
split. Here it is split, a strictly smaller model: converted to per_head it is
block-diagonal (convert split_input -> per_head is exact; the reverse does
not exist). Grouped heads: kv head g sees the slice of width D/G of the
context, which covers exactly the slices of its R = H/G query heads.
Requires num_heads to divide d_model. The output projection w_o is full.

Params: D·K + D·K + D·V + H·V·D [+ H·K + G·K + G·V + D]  (H·(D/H)·K = D·K).
FLOPs: 2·T·D·K + 2·S·D·(K + V) + 2·T·H·V·D + 2·T·S·H·(K + V).
Effective: Σ_g lowrank(R·(D/H + b), D/G; K) + Σ_g lowrank(D/G, R·D; V) + b·D
  (lowrank and the gauge as in base.py; the block structure is kept).
KV cache: G·(K + V) per token. Score weights: H·(D/H)·K + G·(D/G)·K = 2·D·K.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attn.config import HeadConfig, invalid
from attn.variants.base import (Options, Params, Variant, add_bias, attend_and_project, bias,
                                core_flops, factored_score_dof, normal, standard_kv_cache_width,
                                value_output_dof)


def check(cfg: HeadConfig) -> None:
  if cfg.d_model % cfg.num_heads:
    raise invalid("num_heads", cfg.num_heads,
                  f"a divisor of d_model={cfg.d_model}: split_input gives each head "
                  "d_model/num_heads input features")


def init(key, cfg: HeadConfig, dtype=jnp.float32) -> Params:
  D, H, G, K, V = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_k, cfg.d_v
  kq, kk, kv, ko = jax.random.split(key, 4)
  params = {
      "w_q": normal(kq, (H, D // H, K), D // H, dtype),
      "w_k": normal(kk, (G, D // G, K), D // G, dtype),
      "w_v": normal(kv, (G, D // G, V), D // G, dtype),
      "w_o": normal(ko, (H, V, D), H * V, dtype),
  }
  return add_bias(params, cfg, {"b_q": (H, K), "b_k": (G, K), "b_v": (G, V), "b_o": (D,)}, dtype)


def apply(params: Params, x_BTD, context_BSD=None, *, cfg: HeadConfig,
          opts: Options = Options()):
  c_BSD = x_BTD if context_BSD is None else context_BSD
  B, T, D = x_BTD.shape
  S = c_BSD.shape[1]
  H, G = cfg.num_heads, cfg.num_kv_heads
  x_BTHE = x_BTD.reshape(B, T, H, D // H)
  c_BSGE = c_BSD.reshape(B, S, G, D // G)
  q_BTHK = jnp.einsum("BTHE,HEK->BTHK", x_BTHE, params["w_q"]) + bias(params, "b_q")
  k_BSGK = jnp.einsum("BSGE,GEK->BSGK", c_BSGE, params["w_k"]) + bias(params, "b_k")
  v_BSGV = jnp.einsum("BSGE,GEV->BSGV", c_BSGE, params["w_v"]) + bias(params, "b_v")
  return attend_and_project(params, x_BTD, q_BTHK, k_BSGK, v_BSGV, cfg=cfg, opts=opts,
                            inputs=(x_BTD, c_BSD, c_BSD))


def param_count(cfg: HeadConfig) -> int:
  D, H, G, K, V = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_k, cfg.d_v
  biases = H * K + G * K + G * V + D
  return D * (2 * K + V) + H * V * D + (biases if cfg.use_bias else 0)


def effective_param_count(cfg: HeadConfig) -> int:
  D, H, G = cfg.d_model, cfg.num_heads, cfg.num_kv_heads
  return factored_score_dof(cfg, D // H, D // G) + value_output_dof(cfg, D // G)


def flops(cfg: HeadConfig, T: int, S: int) -> int:
  D, H, K, V = cfg.d_model, cfg.num_heads, cfg.d_k, cfg.d_v
  proj = 2 * T * D * K + 2 * S * D * (K + V) + 2 * T * H * V * D
  return proj + core_flops(cfg, T, S)


def score_weights(cfg: HeadConfig) -> int:
  return 2 * cfg.d_model * cfg.d_k


VARIANT = Variant(
    name="split_input",
    sharding={"w_q": "HEK", "w_k": "GEK", "w_v": "GEV"},
    init=init,
    apply=apply,
    param_count=param_count,
    effective_param_count=effective_param_count,
    flops=flops,
    kv_cache_width=standard_kv_cache_width,
    score_weights=score_weights,
    check=check,
    offers=("projection_inputs",),  # attend_and_project gets inputs= (qkv_conv_dynamic reads them)
)
