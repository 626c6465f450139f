"""two_stage: a full D×D projection W^Q, W^K, W^V before the per-head projections.

q_h = (x W^Q + b^Q) W_Q,h + b_Q,h, and likewise for keys and values on the
context (seed question 2). The product W^Q·W_Q,h is one D×K matrix, so this is
the per_head function class with more parameters and more compute
(convert two_stage -> per_head is exact). Grouped heads as per_head: the
first stage is full width, the second has G key/value heads.

Params: 3·D² [+ 3·D] + D·(H·K + G·K + G·V) + H·V·D [+ H·K + G·K + G·V + D].
FLOPs: 2·T·D² + 2·2·S·D² (first stage) + per_head's standard FLOPs.
Effective: per_head's (the first stage collapses into the second; see base.py).
KV cache: the second-stage keys and values, G·(K + V). Score weights: 2·D² + D·(H + G)·K.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attn.config import HeadConfig
from attn.variants import per_head
from attn.variants.base import (Options, Params, Variant, add_bias, attend_and_project, bias,
                                factored_effective_param_count, normal, project_heads,
                                standard_flops, standard_kv_cache_width, standard_param_count,
                                standard_score_weights)


def init(key, cfg: HeadConfig, dtype=jnp.float32) -> Params:
  D = cfg.d_model
  k1q, k1k, k1v, k2 = jax.random.split(key, 4)
  params = per_head.init(k2, cfg, dtype)
  params.update({
      "w_q1": normal(k1q, (D, D), D, dtype),
      "w_k1": normal(k1k, (D, D), D, dtype),
      "w_v1": normal(k1v, (D, D), D, dtype),
  })
  return add_bias(params, cfg, {"b_q1": (D,), "b_k1": (D,), "b_v1": (D,)}, dtype)


def apply(params: Params, x_BTD, context_BSD=None, *, cfg: HeadConfig,
          opts: Options = Options()):
  c_BSD = x_BTD if context_BSD is None else context_BSD
  xq_BTD = x_BTD @ params["w_q1"] + bias(params, "b_q1")
  ck_BSD = c_BSD @ params["w_k1"] + bias(params, "b_k1")
  cv_BSD = c_BSD @ params["w_v1"] + bias(params, "b_v1")
  q_BTHK = project_heads(xq_BTD, params["w_q"], bias(params, "b_q"))
  k_BSGK = project_heads(ck_BSD, params["w_k"], bias(params, "b_k"))
  v_BSGV = project_heads(cv_BSD, params["w_v"], bias(params, "b_v"))
  return attend_and_project(params, x_BTD, q_BTHK, k_BSGK, v_BSGV, cfg=cfg, opts=opts,
                            inputs=(x_BTD, c_BSD, c_BSD))


def param_count(cfg: HeadConfig) -> int:
  D = cfg.d_model
  return 3 * D * D + (3 * D if cfg.use_bias else 0) + standard_param_count(cfg)


def flops(cfg: HeadConfig, T: int, S: int) -> int:
  D = cfg.d_model
  return 2 * T * D * D + 4 * S * D * D + standard_flops(cfg, T, S)


def score_weights(cfg: HeadConfig) -> int:
  return 2 * cfg.d_model ** 2 + standard_score_weights(cfg)


VARIANT = Variant(
    name="two_stage",
    sharding={"w_q1": "DD", "w_k1": "DD", "w_v1": "DD", "b_q1": "D", "b_k1": "D", "b_v1": "D"},
    init=init,
    apply=apply,
    param_count=param_count,
    effective_param_count=factored_effective_param_count,
    flops=flops,
    kv_cache_width=standard_kv_cache_width,
    score_weights=score_weights,
    offers=("projection_inputs",),  # attend_and_project gets inputs= (qkv_conv_dynamic reads them)
)
