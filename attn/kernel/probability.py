"""The probability function that turns attention logits into weights: softmax, sigmoid or relu.

For the scaled (and capped) float32 logit l_ts of query t and key s:

  softmax  exp(l_ts) / Σ_s' exp(l_ts')  (the default; attn.kernel.masked_softmax)
  sigmoid  σ(l_ts + b_t), b_t = −log n_t: Ramapuram et al. 2024, "Theory, Analysis, and Best
           Practices for Sigmoid Self-Attention" (arXiv:2409.04431), whose bias is −log n for
           a sequence of n keys, so that the weights of a row start near 1/n, as softmax's
  relu     max(l_ts, 0) / n_t: Wortsman et al. 2023, "Replacing softmax with ReLU in Vision
           Transformers" (arXiv:2309.08586), ReLU divided by the sequence length; the ReLU
           attention Guo et al. 2024 ("Active-Dormant Attention Heads", arXiv:2410.13835)
           propose against attention sinks

n_t is the number of keys query t's masks leave visible: every key of an unmasked row (n = S,
the papers' sequence length), t + 1 + (S − T) under a causal mask (the keys the query can see),
a padded example's kv_length, min(w, ...) in a window w, and what a dense mask leaves. So
padding keys and a KV cache's empty slots change nothing, and a token decoded with a cache
gets the weights of the full causal forward (its n is its own visible keys, not the length
of a sequence that is not known while decoding). Neither function normalises a row: the
weights sum to anything in [0, n_t·max], which is the point (a head can attend to nothing,
so needs no sink). Masked keys get exactly 0; a fully masked row (n_t = 0) gets zeros.
Learned sinks (one more logit in a softmax denominator) have nothing to join here, so
HeadConfig and kernel.attention refuse them with sigmoid or relu (config.check_probability).

All in float32, whatever the inputs' dtype. The blocked kernel needs no online normaliser for
these (each weight is pointwise given n_t): visible_keys gives n_t from the structured masks
in closed form and from a dense mask by a prefix sum along S, never a T×S array it does not hold.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attn.config import PROBABILITIES, check_probability

__all__ = ["PROBABILITIES", "check_probability", "pointwise", "pointwise_grad", "visible_keys",
           "weights"]

Array = jax.Array


def pointwise(probability: str, logits: Array, n: Array) -> Array:
  """σ(l − log n) or max(l, 0)/n elementwise, float32; n >= 1 broadcasts against the logits."""
  logits = logits.astype(jnp.float32)
  if probability == "sigmoid":
    return jax.nn.sigmoid(logits - jnp.log(n))
  return jnp.maximum(logits, 0.0) / n


def pointwise_grad(probability: str, logits: Array, p: Array, n: Array) -> Array:
  """d weight / d logit, given the weight p = pointwise(probability, logits, n)."""
  if probability == "sigmoid":
    return p * (1.0 - p)
  return jnp.where(logits > 0, 1.0 / n, 0.0)


def weights(logits_BHTS: Array, mask: Array | None, probability: str) -> Array:
  """sigmoid or relu weights (B,H,T,S) of the logits under a dense mask (True = may attend)."""
  logits_BHTS = logits_BHTS.astype(jnp.float32)
  S = logits_BHTS.shape[-1]
  if mask is None:
    return pointwise(probability, logits_BHTS, jnp.float32(S))
  mask = jnp.broadcast_to(mask, logits_BHTS.shape)
  n_BHT1 = jnp.maximum(mask.sum(-1, keepdims=True, dtype=jnp.int32), 1).astype(jnp.float32)
  # where() on the logits too: a masked logit may be anything (inf from a cap-free overflow),
  # and its weight and gradient must be exactly 0.
  return jnp.where(mask, pointwise(probability, jnp.where(mask, logits_BHTS, 0.0), n_BHT1), 0.0)


def visible_keys(T: int, S: int, mask: Array | None = None, *, is_causal: bool = False,
                 kv_lengths: Array | None = None, window: int | None = None) -> Array:
  """n_t per row: (B|1, H|1, T) int32 keys that the masks (combined by AND) leave to query t.

  The structured masks as in kernel.attention (bottom-right aligned): with position
  p = t + S − T, is_causal keeps s <= p, window w keeps |p − s| < w, kv_lengths s < L_b; the
  dense mask is counted by a prefix sum over S at those bounds.
  """
  p_T = jnp.arange(T) + (S - T)
  lo_T, hi_T = jnp.zeros((T,), jnp.int32), jnp.full((T,), S, jnp.int32)
  if is_causal:
    hi_T = jnp.minimum(hi_T, p_T + 1)
  if window is not None:
    lo_T = jnp.maximum(lo_T, p_T - window + 1)
    hi_T = jnp.minimum(hi_T, p_T + window)
  lo_T, hi_T = jnp.clip(lo_T, 0, S), jnp.clip(hi_T, 0, S)
  hi_BT = hi_T[None]
  if kv_lengths is not None:
    hi_BT = jnp.minimum(hi_BT, jnp.asarray(kv_lengths, jnp.int32)[:, None])
  lo_BT = jnp.broadcast_to(lo_T[None], hi_BT.shape)
  hi_BT = jnp.maximum(hi_BT, lo_BT)
  if mask is None:
    return (hi_BT - lo_BT)[:, None, :]
  mask = jnp.asarray(mask)
  mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
  m_BHTS = jnp.broadcast_to(mask, (*mask.shape[:3], S))  # a key axis of 1 broadcasts over S
  c_BHTS = jnp.concatenate([jnp.zeros((*m_BHTS.shape[:3], 1), jnp.int32),
                            jnp.cumsum(m_BHTS, -1, dtype=jnp.int32)], -1)  # c[s] = keys < s kept
  at = lambda i_BT: jnp.take_along_axis(c_BHTS, i_BT[:, None, :, None], axis=-1)[..., 0]
  return at(hi_BT) - at(lo_BT)
