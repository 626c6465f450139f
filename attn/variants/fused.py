"""fused: one packed matrix computes Q, K and V of every head in a single matmul.

w_qkv (D, H·K + G·K + G·V) holds the per-head matrices as column blocks
[Q heads | K heads | V heads], so it is the per_head layer reshaped (seed
question 1: the same function; only speed differs). w_o is (H·V, D).
For cross-attention the query columns read x and the key/value columns read
the context: two matmuls instead of one. The attention core, head gates and
w_o (read as (H,V,D), a free reshape) are the shared base.attend_and_project.

Params (analytic = stored): D·(H·K + G·K + G·V) + H·V·D [+ H·K + G·K + G·V + D].
"""

from __future__ import annotations

import einops
import jax
import jax.numpy as jnp

from attn import kernel
from attn.config import HeadConfig
from attn.variants.base import (Options, Params, Variant, add_bias, attend_and_project, bias,
                                dense, factored_effective_param_count, normal, standard_flops,
                                standard_kv_cache_width, standard_param_count,
                                standard_score_weights)


def init(key, cfg: HeadConfig, dtype=jnp.float32) -> Params:
  D, H, G, K, V = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_k, cfg.d_v
  kqkv, ko = jax.random.split(key)
  params = {
      "w_qkv": normal(kqkv, (D, H * K + G * K + G * V), D, dtype),
      "w_o": normal(ko, (H * V, D), H * V, dtype),
  }
  return add_bias(params, cfg, {"b_qkv": (H * K + G * K + G * V,), "b_o": (D,)}, dtype)


def project_qkv(params: Params, x_BTD, context_BSD, cfg: HeadConfig, *, split: bool = False):
  """q (B,T,H,K), k (B,S,G,K), v (B,S,G,V) from the packed matrix.

  Self-attention takes one matmul and slices its product. With split (long
  sequences, see apply) or a context, each of Q, K and V is its own matmul
  over its column block of w_qkv: the same numbers, but no packed product
  whose slices the blocked kernel would hold as copies through the backward
  pass (90 MB more at T = 16384, D = 512; experiments/performance.md).
  """
  H, G, K = cfg.num_heads, cfg.num_kv_heads, cfg.d_k
  cols = (H * K, (H + G) * K)  # where the Q, K and V column blocks start
  w, b = params["w_qkv"], bias(params, "b_qkv")
  if context_BSD is None and not split:
    q, k, v = jnp.split(dense(x_BTD, w, b), cols, axis=-1)
  else:
    src_BSD = x_BTD if context_BSD is None else context_BSD
    w_q, w_k, w_v = jnp.split(w, cols, axis=1)
    b_q, b_k, b_v = jnp.split(b, cols) if cfg.use_bias else (0.0, 0.0, 0.0)
    q, k, v = dense(x_BTD, w_q, b_q), dense(src_BSD, w_k, b_k), dense(src_BSD, w_v, b_v)
  q_BTHK = einops.rearrange(q, "B T (H K) -> B T H K", H=H)
  k_BSGK = einops.rearrange(k, "B S (G K) -> B S G K", G=G)
  v_BSGV = einops.rearrange(v, "B S (G V) -> B S G V", G=G)
  return q_BTHK, k_BSGK, v_BSGV


# The attention core behind the projections: "auto" (the default) picks
# kernel.best_impl for the inputs: on CPU the einsum kernel, or the blocked
# one for long sequences; cuDNN flash attention on a GPU where it applies.
# Set this, or pass Options(impl=...) to apply, to force "einsum", "blocked",
# "xla" or "cudnn" (jax.nn.dot_product_attention), or "onednn" (attn.kernel.onednn).
DEFAULT_IMPL = "auto"


def apply(params: Params, x_BTD, context_BSD=None, *, cfg: HeadConfig,
          opts: Options = Options()):
  impl = DEFAULT_IMPL if opts.impl is None else opts.impl
  S = x_BTD.shape[1] if context_BSD is None else context_BSD.shape[1]
  long = impl == "blocked" or (impl in ("auto", "onednn") and kernel.is_long(x_BTD.shape[1], S))
  q_BTHK, k_BSGK, v_BSGV = project_qkv(params, x_BTD, context_BSD, cfg, split=long)
  c_BSD = x_BTD if context_BSD is None else context_BSD
  return attend_and_project(params, x_BTD, q_BTHK, k_BSGK, v_BSGV, cfg=cfg,
                            opts=opts.replace(impl=impl), inputs=(x_BTD, c_BSD, c_BSD))


VARIANT = Variant(
    name="fused",
    sharding={"w_qkv": "DP", "b_qkv": "P", "w_o": "HD"},  # w_o (H·V, D): H-major rows
    init=init,
    apply=apply,
    param_count=standard_param_count,
    effective_param_count=factored_effective_param_count,
    flops=standard_flops,
    kv_cache_width=standard_kv_cache_width,
    score_weights=standard_score_weights,
    offers=("projection_inputs",),  # attend_and_project gets inputs= (qkv_conv_dynamic reads them)
)
