"""Per-head circuit factors of the canonical layout (per_head's parameters).

The readers that attn.analysis.circuits and a variant's own `circuits`
(talking_heads mixes per_head's) share: qk = (W_Q,h, W_K,g(h)) and
ov = (W_V,g(h), W_O,hᵀ) as (H, D, width) pairs, and the bias terms kept apart
(attn.analysis.circuits' docstring has the formulas). They live here, below
both, so that no variant imports attn.analysis.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attn.config import HeadConfig
from attn.variants.base import Params

Array = jax.Array


def einsum(spec: str, *arrays) -> Array:
  """jnp.einsum at the highest precision: circuits are read, not trained."""
  return jnp.einsum(spec, *arrays, precision=jax.lax.Precision.HIGHEST)


def per_query_head(a_GX, cfg: HeadConfig, axis: int) -> Array:
  """A kv-head array repeated so that index h holds kv head g(h) = h // R."""
  return jnp.repeat(a_GX, cfg.group_size, axis=axis)


def values(p: Params, cfg: HeadConfig) -> dict:
  """ov factors (W_V,g(h), W_O,hᵀ) and its bias terms, from w_v (D,G,V), w_o (H,V,D), b_v, b_o."""
  w_v_HDV = per_query_head(p["w_v"], cfg, 1).transpose(1, 0, 2)
  w_o_HVD = p["w_o"]
  out = {"ov": (w_v_HDV, w_o_HVD.transpose(0, 2, 1))}
  if cfg.use_bias:
    out["ov_bias"] = einsum("HV,HVD->HD", per_query_head(p["b_v"], cfg, 0), w_o_HVD)
    out["b_o"] = p["b_o"]
  return out


def from_per_head(p: Params, cfg: HeadConfig) -> dict:
  """qk and ov factors and the bias terms of per_head's parameters."""
  w_q_HDK = p["w_q"].transpose(1, 0, 2)
  w_k_HDK = per_query_head(p["w_k"], cfg, 1).transpose(1, 0, 2)
  out = {"qk": (w_q_HDK, w_k_HDK), **values(p, cfg)}
  if cfg.use_bias:
    b_k_HK = per_query_head(p["b_k"], cfg, 0)
    out.update(qk_key_bias=einsum("HDK,HK->HD", w_k_HDK, p["b_q"]),
               qk_query_bias=einsum("HDK,HK->HD", w_q_HDK, b_k_HK),
               qk_const=jnp.sum(p["b_q"] * b_k_HK, axis=-1))
  return out
