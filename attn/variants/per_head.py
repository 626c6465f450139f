"""per_head: h independent linear layers, one per head.

The seeds' "a linear layer per head". Its parameters are the canonical layout
every exact converter goes through, the shapes of Flax's DenseGeneral kernels:
w_q (D,H,K), w_k (D,G,K), w_v (D,G,V), w_o (H,V,D), b_q (H,K), b_k (G,K),
b_v (G,V), b_o (D,).

Head i's query layer is x ↦ x·w_q[:, i] + b_q[i], and so on. The h layers are
computed together: each of Q, K and V is one matmul against the (D, H·K) view
of its (D,H,K) matrix (a free reshape), as Flax's DenseGeneral does
(experiments/performance.md). tests/test_identities.py checks it against a
literal loop over heads written in numpy. The fused variant packs the same
columns into one (D, H·K + G·K + G·V) matrix instead of three.

Params (analytic = stored): D·(H·K + G·K + G·V) + H·V·D [+ H·K + G·K + G·V + D].
Effective: fewer; W_Q,i·W_K,iᵀ and W_V,i·W_O,i are low-rank products and the
key bias drops out of the softmax (base.factored_effective_param_count).
With cfg.value_norm_eps each value is RMS-normalised over its V dims without a scale (Gemma 4's
v_norm, base.value_norm; after qkv_conv's value convolution where there is one, Inkling-2's order):
no parameters, and no longer a linear map, so per_head converts to other variants only without it
(attn.convert).
KV cache: G·(K + V) per token. Score weights: D·(H + G)·K.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attn.config import HeadConfig
from attn.variants.base import (Options, Params, Variant, add_bias, attend_and_project, bias,
                                factored_effective_param_count, normal, project_heads,
                                standard_flops, standard_kv_cache_width, standard_param_count,
                                standard_score_weights)


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


def effective_param_count(cfg: HeadConfig) -> int | None:
  """base.factored_effective_param_count; None (measured) with the value norm, which no W_V·W_O holds."""
  return None if cfg.value_norm_eps is not None else factored_effective_param_count(cfg)


def apply(params: Params, x_BTD, context_BSD=None, *, cfg: HeadConfig,
          opts: Options = Options()):
  """Each head's (D,K), (D,K), (D,V) and (V,D) matrices, all heads in one matmul each; opts.kv_inputs, where
  set, are the key and value projections' own inputs (Inkling-2's hybrid layers)."""
  c_BSD = x_BTD if context_BSD is None else context_BSD
  ck_BSD, cv_BSD = (c_BSD, c_BSD) if opts.kv_inputs is None else opts.kv_inputs  # Inkling-2's hybrid layers
  q_BTHK = project_heads(x_BTD, params["w_q"], bias(params, "b_q"))
  k_BSGK = project_heads(ck_BSD, params["w_k"], bias(params, "b_k"))
  v_BSGV = project_heads(cv_BSD, params["w_v"], bias(params, "b_v"))  # normed in attend_and_project (value_norm)
  return attend_and_project(params, x_BTD, q_BTHK, k_BSGK, v_BSGV, cfg=cfg, opts=opts,
                            inputs=(x_BTD, ck_BSD, cv_BSD))


VARIANT = Variant(
    name="per_head",
    sharding={},
    init=init,
    apply=apply,
    param_count=standard_param_count,
    effective_param_count=effective_param_count,
    flops=standard_flops,
    kv_cache_width=standard_kv_cache_width,
    score_weights=standard_score_weights,
    fields=("value_norm_eps",),
    offers=("projection_inputs",),  # attend_and_project gets inputs= (qkv_conv_dynamic reads them)
)
