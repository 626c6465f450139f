"""fused: one packed matrix computes Q, K and V of every head in a single matmul.

w_qkv (D, H·K + G·K + G·V) holds the per-head matrices as column blocks
[Q heads | K heads | V heads], so it is the per_head layer reshaped (seed
question 1: the same function; only speed differs). w_o is (H·V, D).
For cross-attention the query columns read x and the key/value columns read
the context: two matmuls instead of one.

Params (analytic = stored): D·(H·K + G·K + G·V) + H·V·D [+ H·K + G·K + G·V + D].
"""

from __future__ import annotations

import einops
import jax
import jax.numpy as jnp

from attn import kernel
from attn.config import HeadConfig
from attn.variants.base import (Params, Variant, add_bias, bias, dense,
                                factored_effective_param_count, normal,
                                standard_flops, standard_param_count)


def init(key, cfg: HeadConfig, dtype=jnp.float32) -> Params:
  D, H, G, K, V = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_k, cfg.d_v
  kqkv, ko = jax.random.split(key)
  params = {
      "w_qkv": normal(kqkv, (D, H * K + G * K + G * V), D, dtype),
      "w_o": normal(ko, (H * V, D), H * V, dtype),
  }
  return add_bias(params, cfg, {"b_qkv": (H * K + G * K + G * V,), "b_o": (D,)}, dtype)


def project_qkv(params: Params, x_BTD, context_BSD, cfg: HeadConfig):
  """q (B,T,H,K), k (B,S,G,K), v (B,S,G,V) from the packed matrix."""
  H, G, K = cfg.num_heads, cfg.num_kv_heads, cfg.d_k
  n_q = H * K
  w, b = params["w_qkv"], bias(params, "b_qkv")
  if context_BSD is None:
    qkv = dense(x_BTD, w, b)
    q, kv = qkv[..., :n_q], qkv[..., n_q:]
  else:
    b_q, b_kv = (b[:n_q], b[n_q:]) if cfg.use_bias else (0.0, 0.0)
    q = dense(x_BTD, w[:, :n_q], b_q)
    kv = dense(context_BSD, w[:, n_q:], b_kv)
  q_BTHK = einops.rearrange(q, "B T (H K) -> B T H K", H=H)
  k_BSGK = einops.rearrange(kv[..., :G * K], "B S (G K) -> B S G K", G=G)
  v_BSGV = einops.rearrange(kv[..., G * K:], "B S (G V) -> B S G V", G=G)
  return q_BTHK, k_BSGK, v_BSGV


# The attention core behind the projections: "auto" (the default) picks
# kernel.best_impl for the inputs, i.e. the einsum kernel on CPU and cuDNN
# flash attention on a GPU where it applies. Set this, or pass impl= to
# apply, to force "einsum", "xla" or "cudnn" (jax.nn.dot_product_attention).
DEFAULT_IMPL = "auto"


def apply(params: Params, x_BTD, context_BSD=None, *, cfg: HeadConfig, mask=None,
          return_weights: bool = False, impl: str | None = None):
  q_BTHK, k_BSGK, v_BSGV = project_qkv(params, x_BTD, context_BSD, cfg)
  out = kernel.attention(q_BTHK, k_BSGK, v_BSGV, mask, scale=cfg.score_scale,
                         return_weights=return_weights,
                         impl=DEFAULT_IMPL if impl is None else impl)
  out_BTHV, w_BHTS = out if return_weights else (out, None)
  out = einops.rearrange(out_BTHV, "B T H V -> B T (H V)")
  y_BTD = dense(out, params["w_o"], bias(params, "b_o"))
  return y_BTD.astype(x_BTD.dtype), w_BHTS


VARIANT = Variant(
    name="fused",
    doc="one packed QKV matrix, heads are column blocks",
    init=init,
    apply=apply,
    param_count=standard_param_count,
    effective_param_count=factored_effective_param_count,
    flops=standard_flops,
)
