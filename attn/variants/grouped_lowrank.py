"""grouped_lowrank: per_head's queries, keys and values; W^O as grouped low-rank maps (DeepSeek-V4).

The H heads fall in g = cfg.o_groups groups of H/g consecutive heads. Group
i's concatenated outputs (H/g·V numbers) go through its own rank-r map A_i
(H/g·V, r), r = cfg.o_rank, and the g·r values through one B (g·r, D):
y = [o_1·A_1 | … | o_g·A_g]·B + b_o (DeepSeek-V4's o_a_proj, a grouped linear,
and o_b_proj). Stored: w_oa (g, H/g·V, r), w_ob (g·r, D).

Its relation to W^O (seed question: what W^O does after the heads are
concatenated): W^O = blockdiag(A_1, …, A_g)·B, so group i's rows of W^O are
A_i·B_i, B_i the i-th r rows of B. grouped_lowrank -> per_head is exact (the
product); per_head -> grouped_lowrank is exact where each group's block W_i
(H/g·V, D) has rank ≤ r, which every block has at r ≥ min(H/g·V, D); elsewhere
it is each block's truncated SVD and says so (attn.convert, lossy).

A variant, not a mechanism or an output layout every variant carries: the
output projection is part of a variant's parameters (its w_o), and the shared
path's project_out reads it as (H,V,D); a layout any variant could take would
route every variant's w_o through one hook. Here the queries, keys and values
are per_head's, as in DeepSeek-V4 (where they are one shared head of 512: set
num_kv_heads=1); the attention and the head mechanisms are the shared path's,
and project_out's gate and head mask act before A, on each head's output.

Params: D·(H·K + G·K + G·V) + H·V·r + g·r·D [+ H·K + G·K + G·V + D].
FLOPs: per_head's projections and core, with the output 2·T·(H·V·r + g·r·D).
KV cache: G·(K + V) per token, per_head's. Score weights: D·(H + G)·K.
Effective: per_head's where every group's block is full rank (o_rank ≥ min(H/g·V, D)): then
W^O is any matrix and the function class is per_head's; below it, measured (the Jacobian's rank).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attn.config import HeadConfig
from attn.variants import mechanisms
from attn.variants.base import (Options, Params, Variant, add_bias, bias, cached_kv, core, dense,
                                factored_effective_param_count, gate_heads, normal, project_heads,
                                queries_and_keys, standard_kv_cache_width, standard_score_weights)


def rank(cfg: HeadConfig) -> int:
  """r: cfg.o_rank, or H/g·V (full rank: each group's map square) when None."""
  return cfg.num_heads // cfg.o_groups * cfg.d_v if cfg.o_rank is None else cfg.o_rank


def init(key, cfg: HeadConfig, dtype=jnp.float32) -> Params:
  D, H, G, K, V = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_k, cfg.d_v
  g, r = cfg.o_groups, rank(cfg)
  kq, kk, kv, ka, kb = jax.random.split(key, 5)
  params = {
      "w_q": normal(kq, (D, H, K), D, dtype),
      "w_k": normal(kk, (D, G, K), D, dtype),
      "w_v": normal(kv, (D, G, V), D, dtype),
      "w_oa": normal(ka, (g, H // g * V, r), H // g * V, dtype),
      "w_ob": normal(kb, (g * r, D), g * r, dtype),
  }
  return add_bias(params, cfg, {"b_q": (H, K), "b_k": (G, K), "b_v": (G, V), "b_o": (D,)}, dtype)


def grouped_output(params: Params, o_BTHV, b_D) -> jax.Array:
  """Each group's concatenated heads through its A_i, then all g·r values through B, plus b_o."""
  g, _, r = params["w_oa"].shape
  B, T, H, V = o_BTHV.shape
  o_BTgN = o_BTHV.reshape(B, T, g, H // g * V)
  z_BTgr = jnp.einsum("BTgN,gNr->BTgr", o_BTgN, params["w_oa"])
  return dense(z_BTgr.reshape(B, T, g * r), params["w_ob"], b_D)


def apply(params: Params, x_BTD, context_BSD=None, *, cfg: HeadConfig,
          opts: Options = Options()):
  """per_head's heads and attention, then the grouped low-rank output."""
  c_BSD = x_BTD if context_BSD is None else context_BSD
  q_BTHK = project_heads(x_BTD, params["w_q"], bias(params, "b_q"))
  k_BSGK = project_heads(c_BSD, params["w_k"], bias(params, "b_k"))
  v_BSGV = project_heads(c_BSD, params["w_v"], bias(params, "b_v"))
  q_BTHK, k_BSGK = queries_and_keys(params, q_BTHK, k_BSGK, cfg=cfg, opts=opts)
  k_BSGK, v_BSGV = cached_kv(k_BSGK, v_BSGV)
  o_BTHV, w_BHTS = core(params, q_BTHK, k_BSGK, v_BSGV, cfg=cfg, opts=opts, x_BTD=x_BTD)
  o_BTHV = gate_heads(mechanisms.on_output(params, x_BTD, o_BTHV, cfg), opts.head_mask)
  y_BTD = grouped_output(params, o_BTHV, bias(params, "b_o"))
  return y_BTD.astype(x_BTD.dtype), w_BHTS


def param_count(cfg: HeadConfig) -> int:
  D, H, G, K, V = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_k, cfg.d_v
  g, r = cfg.o_groups, rank(cfg)
  weights = D * (H * K + G * K + G * V) + H * V * r + g * r * D
  return weights + ((H * K + G * K + G * V + D) if cfg.use_bias else 0)


def effective_param_count(cfg: HeadConfig) -> int | None:
  """per_head's count where the groups' blocks are full rank (any W^O); None (measured) below."""
  if rank(cfg) < min(cfg.num_heads // cfg.o_groups * cfg.d_v, cfg.d_model):
    return None
  return factored_effective_param_count(cfg)


def flops(cfg: HeadConfig, T: int, S: int) -> int:
  D, H, G, K, V = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_k, cfg.d_v
  g, r = cfg.o_groups, rank(cfg)
  proj = 2 * D * (T * H * K + S * G * K + S * G * V)
  return proj + 2 * T * (H * V * r + g * r * D) + 2 * T * S * H * (K + V)


VARIANT = Variant(
    name="grouped_lowrank",
    lacks={"qkv_heads": "grouped_lowrank computes its attention itself, not through attend_and_project"},
    # Groups are contiguous heads: with M devices dividing o_groups, device d holds its heads' whole
    # groups (their A_i, their r rows of B); otherwise both are replicated (attn.nn.sharding's P).
    sharding={"w_oa": "PVO", "w_ob": "PD"},
    init=init,
    apply=apply,
    param_count=param_count,
    effective_param_count=effective_param_count,
    flops=flops,
    kv_cache_width=standard_kv_cache_width,
    score_weights=standard_score_weights,
    fields=("o_groups", "o_rank"),
)
