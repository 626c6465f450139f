"""per_head: h independent linear layers, one per head, applied head by head.

The seeds' "a linear layer per head". Its parameters are the canonical layout
every exact converter goes through: w_q (D,H,K), w_k (D,G,K), w_v (D,G,V),
w_o (H,V,D), b_q (H,K), b_k (G,K), b_v (G,V), b_o (D,).

Params (analytic = stored): D·(H·K + G·K + G·V) + H·V·D [+ H·K + G·K + G·V + D].
Effective: fewer; W_Q,i·W_K,iᵀ and W_V,i·W_O,i are low-rank products and the
key bias drops out of the softmax (base.factored_effective_param_count).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attn import kernel
from attn.config import HeadConfig
from attn.variants.base import (Params, Variant, add_bias, bias, dense,
                                factored_effective_param_count, head_bias, head_mask,
                                normal, standard_flops, standard_param_count)


def init(key, cfg: HeadConfig, dtype=jnp.float32) -> Params:
  D, H, G, K, V = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_k, cfg.d_v
  kq, kk, kv, ko = jax.random.split(key, 4)
  params = {
      "w_q": normal(kq, (D, H, K), D, dtype),
      "w_k": normal(kk, (D, G, K), D, dtype),
      "w_v": normal(kv, (D, G, V), D, dtype),
      "w_o": normal(ko, (H, V, D), H * V, dtype),
  }
  return add_bias(params, cfg, {"b_q": (H, K), "b_k": (G, K), "b_v": (G, V), "b_o": (D,)}, dtype)


def apply(params: Params, x_BTD, context_BSD=None, *, cfg: HeadConfig, mask=None,
          return_weights: bool = False):
  """Loops over heads: each head has its own (D,K), (D,K), (D,V) and (V,D) matrices."""
  c_BSD = x_BTD if context_BSD is None else context_BSD
  y_BTD = bias(params, "b_o")
  kv = {}
  weights = []
  for h in range(cfg.num_heads):
    g = h // cfg.group_size
    if g not in kv:
      kv[g] = (dense(c_BSD, params["w_k"][:, g], head_bias(params, "b_k", g)),
               dense(c_BSD, params["w_v"][:, g], head_bias(params, "b_v", g)))
    k_BSK, v_BSV = kv[g]
    q_BTK = dense(x_BTD, params["w_q"][:, h], head_bias(params, "b_q", h))
    out = kernel.attention(
        q_BTK[:, :, None], k_BSK[:, :, None], v_BSV[:, :, None], head_mask(mask, h),
        scale=cfg.score_scale, return_weights=return_weights)
    out_BT1V = out[0] if return_weights else out
    if return_weights:
      weights.append(out[1][:, 0])
    y_BTD = y_BTD + dense(out_BT1V[:, :, 0], params["w_o"][h], 0.0)
  w_BHTS = jnp.stack(weights, axis=1) if return_weights else None
  return y_BTD.astype(x_BTD.dtype), w_BHTS


VARIANT = Variant(
    name="per_head",
    doc="h separate linear layers, one per head (canonical layout)",
    init=init,
    apply=apply,
    param_count=standard_param_count,
    effective_param_count=factored_effective_param_count,
    flops=standard_flops,
)
