"""Block attention residuals (ModelConfig.attn_res_block; Inkling-2's attention_input, mlp_input, final_input).

The residual stream is kept as blocks: every n = attn_res_block layers the stream so far is closed into a
block state (the embeddings are the first), and each sublayer reads not the stream but a mix over depth:
learned queries q (Q, D) attend over [block states..., the partial block], each source RMS-normalised
without a scale (epsilon 1e-6), logits q·s/√D, a softmax over the sources and the weighted sum of the
normalised sources, in float32 (DepthMix). Per layer l (a block boundary when l % n == 0):

  x = h if l == 0 else attention_input(states, h)          one query, or three (q, k, v: attn_res_kv_types)
  a = attention(norm(x))                                    (its output convolution, residual_conv, too)
  states, r = (states + [h], a) if boundary else (states, h + a)
  h' = r + mlp(norm(mlp_input(states, r)))                  (residual_conv on the MLP's output)

and the model's output reads final_input(states, h) before the final norm. Parameters: Q·D per attention
input (Q = 1, or 3 where keys and values read mixes of their own, which also bring their own input norms),
D per MLP input, D for the final one; the queries start at zero (a uniform mix), held in float32 as
transformers keeps them. Each position mixes its own depth only, so decoding needs no state for it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from attn.config import invalid

Array = jax.Array
EPS = 1e-6  # Inkling2BlockAttentionResidual's Inkling2UnweightedRMSNorm()


def check(cfg) -> None:
  """attn_res_block: None or an integer >= 1, on a pre-norm DecoderLM's plain residual; attn_res_kv_types:
  layer types, with it."""
  n, kinds = cfg.attn_res_block, cfg.attn_res_kv_types
  if n is None:
    if kinds:
      raise invalid("attn_res_kv_types", kinds, "() with attn_res_block=None: the three mixes are attention "
                    "residuals'")
    return
  if isinstance(n, bool) or not isinstance(n, int) or n < 1:
    raise invalid("attn_res_block", n, "None or an integer >= 1: the layers summed into one block state")
  clash = {"norm": (cfg.norm, "pre"), "hc_mult": (cfg.hc_mult, 1), "residual_gate": (cfg.residual_gate, None),
           "block_kinds": (cfg.block_kinds, None), "residual_multiplier": (cfg.residual_multiplier, 1.0),
           "per_layer_dim": (cfg.per_layer_dim, 0)}
  for name, (value, want) in clash.items():
    if value != want:
      raise invalid("attn_res_block", n, f"None with {name}={value!r}: block attention residuals replace the "
                    f"plain pre-norm residual ({name}={want!r})")
  types = cfg.layer_types or ()
  if not isinstance(kinds, tuple) or any(k not in types for k in kinds):
    raise invalid("attn_res_kv_types", kinds, f"a tuple of the model's layer types {sorted(set(types))}: those "
                  "whose keys and values read mixes of their own")
  for i, t in enumerate(types):
    if t in kinds and cfg.layer_variant(i) != "per_head":
      raise invalid("attn_res_kv_types", kinds, f"layer types whose variant is per_head (layer {i}, {t}, is "
                    f"{cfg.layer_variant(i)!r}): per_head alone projects keys and values from inputs of their own")


class DepthMix(nnx.Module):
  """Q learned queries over the normalised sources (module docstring): Q outputs (B,T,D), float32."""

  def __init__(self, d_model: int, queries: int = 1):
    self.query = nnx.Param(jnp.zeros((queries, d_model), jnp.float32))

  def __call__(self, sources: list[Array], partial_BTD: Array) -> list[Array]:
    s_BTND = jnp.stack([*sources, partial_BTD], axis=-2).astype(jnp.float32)
    s_BTND = s_BTND * jax.lax.rsqrt(jnp.mean(s_BTND * s_BTND, axis=-1, keepdims=True) + EPS)
    q_QD = self.query[...].astype(jnp.float32)
    logits_BTQN = jnp.einsum("QD,BTND->BTQN", q_QD, s_BTND) * s_BTND.shape[-1] ** -0.5
    p_BTQN = jax.nn.softmax(logits_BTQN, axis=-1)
    out_BTQD = jnp.einsum("BTQN,BTND->BTQD", p_BTQN, s_BTND)
    return [out_BTQD[:, :, i] for i in range(q_QD.shape[0])]


def param_count(cfg, layers) -> int:
  """The queries: Q·D per attention input (layers after the first), D per MLP input, D for the output."""
  if cfg.attn_res_block is None:
    return 0
  D = cfg.d_model
  return sum((3 if t in cfg.attn_res_kv_types else 1) * D * (i > 0) + D for i, t in enumerate(layers)) + D
