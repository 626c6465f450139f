"""Per-head circuits: the bilinear W_QK,h and the linear W_OV,h of every query head.

Elhage et al. 2021's reading of one attention layer, for any registered
variant. With g(h) = h // (H/G) the kv head that query head h reads:

  logits[h,t,s] = scale·(x_t qk[h] c_sᵀ + qk_key_bias[h]·c_s
                         + x_t·qk_query_bias[h] + qk_const[h])
  y_t = Σ_h Σ_s weights[h,t,s]·(c_s ov[h] + ov_bias[h]) + b_o

qk[h] = W_Q,h·W_K,g(h)ᵀ (D×D, unscaled) and ov[h] = W_V,g(h)·W_O,h (D×D).
The bias terms stay apart instead of being folded in: qk_key_bias[h] =
W_K,g(h)·b_q,h (the query bias, a key-side content term: it moves the
softmax), qk_query_bias[h] = W_Q,h·b_k,g(h) and qk_const[h] = b_q,h·b_k,g(h)
(the key bias: constant along s, so the softmax drops both), ov_bias[h] =
b_v,g(h)·W_O,h (added once per query whose row is not fully masked) and b_o.
Without biases they are zeros of the same shapes.

Per variant: anything with an exact converter to per_head (fused, two_stage,
split_input: its product sits in its input block, zeros elsewhere) is read
through it; merged is read as trained (W_h, b_kc: no exact converter);
collaborative is W̃_Q·diag(m_h)·W̃_Kᵀ; any other variant reads itself through
Variant.circuits (talking_heads mixes per_head's circuits). With RoPE, qk is
the score at t = s (the rotation R(t − s) sits between the factors). Head
mechanisms (attn.variants.mechanisms) are left out: ov is each head's circuit
before its output gate, sinks, a window and a softcap change the weights, not
the circuits; QK-norm, which has no bilinear W_QK, is refused (over the whole projection,
saying that it couples the heads). Pure
functions of the params: they work under jax.jit with variant and cfg static.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attn.api import check_config, check_params
from attn.config import HeadConfig, invalid
from attn.conversion import CONVERTERS
from attn.variants import factors
from attn.variants.base import Params

Array = jax.Array


def _from_merged(p: Params, cfg: HeadConfig) -> dict:
  """W_h as trained, the identity as its second factor; b_kc is the key-side term."""
  H, D = cfg.num_heads, cfg.d_model
  eye_HDD = jnp.broadcast_to(jnp.eye(D, dtype=p["w_qk"].dtype), (H, D, D))
  out = {"qk": (p["w_qk"], eye_HDD), **factors.values(p, cfg)}
  if cfg.use_bias:
    out["qk_key_bias"] = p["b_kc"]
  return out


def _from_collaborative(p: Params, cfg: HeadConfig) -> dict:
  """W̃_Q·diag(m_h)·W̃_Kᵀ: factors W̃_Q·diag(m_h) and W̃_K, of width D̃."""
  H = cfg.num_heads
  a_HDJ = p["w_q"][None] * p["m"][:, None, :]
  b_HDJ = jnp.broadcast_to(p["w_k"], (H,) + p["w_k"].shape)
  out = {"qk": (a_HDJ, b_HDJ), **factors.values(p, cfg)}
  if cfg.use_bias:
    out.update(qk_key_bias=factors.einsum("DJ,HJ->HD", p["w_k"], p["m"] * p["b_q"]),
               qk_query_bias=factors.einsum("DJ,HJ->HD", p["w_q"], p["m"] * p["b_k"]),
               qk_const=factors.einsum("HJ,J->H", p["m"], p["b_q"] * p["b_k"]))
  return out


_OWN_LAYOUT = {"per_head": factors.from_per_head, "merged": _from_merged,
               "collaborative": _from_collaborative}


def _read(variant: str, params: Params, cfg: HeadConfig) -> dict:
  v = check_config(variant, cfg)
  check_params(v.name, params, cfg)
  if cfg.qk_norm == "whole":  # the report's per-head circuits say this in their place
    raise invalid("qk_norm", "whole", "False for circuits: QK-norm over the whole projection couples "
                  "the heads (one RMS over all H·K query dims): no head's score is its own W_QK,h")
  if cfg.qk_norm:
    raise invalid("qk_norm", cfg.qk_norm, "False for circuits: RMS-normalised queries and keys score "
                  "through no fixed bilinear W_QK")
  if v.name in _OWN_LAYOUT:
    return _OWN_LAYOUT[v.name](params, cfg)
  if v.circuits is not None:
    return v.circuits(params, cfg)
  step = CONVERTERS.get((v.name, "per_head"))
  if step is None or not step.exact:
    raise invalid("variant", v.name, f"one of {sorted(_OWN_LAYOUT)}, one with an exact converter "
                  "to per_head (attn.convert) or one with Variant.circuits")
  step.check(cfg)
  return factors.from_per_head(step.fn(params, cfg)[0], cfg)


def circuit_factors(variant: str, params: Params,
                    cfg: HeadConfig) -> dict[str, tuple[Array, Array]]:
  """{"qk": (a, b), "ov": (a, b)} with circuit[h] = a[h]·b[h]ᵀ, a and b (H, D, width).

  The width is d_k (qk) or d_v (ov) for factored variants, D̃ for
  collaborative's qk and D for merged's (b = identity). Pass a pair to
  attn.analysis.spectrum_of_product for the singular values without the D×D SVD.
  """
  read = _read(variant, params, cfg)
  return {"qk": read["qk"], "ov": read["ov"]}


def circuits(variant: str, params: Params, cfg: HeadConfig) -> dict[str, Array]:
  """qk (H,D,D) = W_Q,h·W_K,g(h)ᵀ, ov (H,D,D) = W_V,g(h)·W_O,h and the bias terms apart.

  Bias terms (module docstring): qk_key_bias (H,D), qk_query_bias (H,D),
  qk_const (H,), ov_bias (H,D), b_o (D,); zeros without biases.
  """
  read = _read(variant, params, cfg)
  H, D = cfg.num_heads, cfg.d_model
  dtype = read["ov"][0].dtype
  zeros = {"qk_key_bias": (H, D), "qk_query_bias": (H, D), "qk_const": (H,), "ov_bias": (H, D),
           "b_o": (D,)}
  out = {name: factors.einsum("HDW,HEW->HDE", *read[name]) for name in ("qk", "ov")}
  out.update({name: read.get(name, jnp.zeros(shape, dtype)) for name, shape in zeros.items()})
  return out
