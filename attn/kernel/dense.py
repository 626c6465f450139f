"""The einsum kernel: the whole (B,H,T,S) logits, masks, float32 softmax, weighted sum.

Every option of the core applies here (weights out, logits_bias, sinks, softcap,
the probability functions); it is the reference the other implementations
equal, and what "auto" picks for short sequences and on CPU. Its two products
come from a Products object (attn.kernel.products): XLA's dots or oneDNN's.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from attn.kernel import masks, probability as prob
from attn.kernel.products import XLA, Products, scores, weighted_sum

Array = jax.Array


def masked_softmax(logits_BHTS: Array, mask: Array | None = None,
                   sinks: Array | None = None) -> Array:
  """Softmax over S in float32; masked entries and fully masked rows get weight 0.

  sinks (H,), if given, join every row's denominator as one more logit per
  query head with no value: the weights then sum to 1 - the sink's share.
  """
  logits_BHTS = logits_BHTS.astype(jnp.float32)
  if sinks is not None:
    return _softmax_with_sinks(logits_BHTS, mask, sinks)
  if mask is None:
    return jax.nn.softmax(logits_BHTS, axis=-1)
  mask = jnp.broadcast_to(mask, logits_BHTS.shape)
  # A finite fill (not -inf) keeps a fully masked row finite: its softmax is
  # uniform, and the final where() zeroes it, in value and in gradient.
  logits_BHTS = jnp.where(mask, logits_BHTS, jnp.finfo(jnp.float32).min)
  return jnp.where(mask, jax.nn.softmax(logits_BHTS, axis=-1), 0.0)


def masked_probabilities(logits_BHTS: Array, mask: Array | None = None, sinks: Array | None = None,
                         probability: str = "softmax") -> Array:
  """The weights of the logits under a dense mask: masked_softmax, or attn.kernel.probability's sigmoid/relu."""
  if probability == "softmax":
    return masked_softmax(logits_BHTS, mask, sinks)
  return prob.weights(logits_BHTS, mask, probability)


def _softmax_with_sinks(logits_BHTS: Array, mask: Array | None, sinks: Array) -> Array:
  """exp(l_ts) / (exp(sink_h) + Σ_s' exp(l_ts')); a fully masked row is all zeros."""
  sink_1H11 = sinks.astype(jnp.float32).reshape(1, -1, 1, 1)
  if mask is not None:
    mask = jnp.broadcast_to(mask, logits_BHTS.shape)
    logits_BHTS = jnp.where(mask, logits_BHTS, jnp.finfo(jnp.float32).min)
  # The sink bounds the max from below, so a fully masked row's exps underflow to 0.
  m_BHT1 = lax.stop_gradient(jnp.maximum(logits_BHTS.max(-1, keepdims=True), sink_1H11))
  e_BHTS = jnp.exp(logits_BHTS - m_BHT1)
  if mask is not None:
    e_BHTS = jnp.where(mask, e_BHTS, 0.0)
  return e_BHTS / (jnp.exp(sink_1H11 - m_BHT1) + e_BHTS.sum(-1, keepdims=True))


def structured_mask(T: int, S: int, is_causal: bool = False, kv_lengths: Array | None = None,
                    window: int | None = None) -> Array | None:
  """The dense mask of is_causal (bottom-right aligned), kv_lengths and window: (1|B,1,T|1,S)."""
  causal = masks.causal_mask(T, S) if is_causal else None
  padding = None if kv_lengths is None else masks.padding_mask(kv_lengths, S)
  local = None if window is None else masks.window_mask(T, S, window)
  return masks.combine_masks(causal, padding, local)


def attention(q_BTHK: Array, k_BSGK: Array, v_BSGV: Array, mask: Array | None, *, is_causal: bool,
              kv_lengths: Array | None, scale: float, logits_bias: Array | None, return_weights: bool,
              window: int | None, sinks: Array | None, softcap: float | None, probability: str,
              products: Products = XLA) -> Array | tuple[Array, Array]:
  """kernel.attention's function with the (B,H,T,S) logits materialised; inputs already checked."""
  T, S = q_BTHK.shape[1], k_BSGK.shape[1]
  mask = masks.combine_masks(mask, structured_mask(T, S, is_causal, kv_lengths, window))
  if q_BTHK.dtype == jnp.float32 or products.float32_only:
    # Scaling q (T·K values) rather than the logits (T·S) is the same product
    # up to rounding, and keeps XLA's CPU matmul fusion from materialising a
    # (B,H,T,S) array of the scale (experiments/performance.md). In half precision
    # the scale stays on the float32 logits so q loses no bits.
    logits_BHTS = products.scores(q_BTHK * jnp.float32(scale), k_BSGK)
  else:
    logits_BHTS = products.scores(q_BTHK, k_BSGK) * scale
  if softcap is not None:
    logits_BHTS = softcap * jnp.tanh(logits_BHTS / softcap)
  if logits_bias is not None:
    logits_BHTS = logits_BHTS + logits_bias.astype(jnp.float32)
  probs_BHTS = masked_probabilities(logits_BHTS, mask, sinks, probability)
  out_BTHV = products.mix(probs_BHTS, v_BSGV).astype(q_BTHK.dtype)
  return (out_BTHV, probs_BHTS) if return_weights else out_BTHV


def reference_attention(q_BTHK, k_BSGK, v_BSGV, mask=None, *, scale=None):
  """A second, deliberately naive implementation (repeat kv heads, one head at a time) for tests."""
  B, T, H, K = q_BTHK.shape
  k_BSHK = jnp.repeat(k_BSGK, H // k_BSGK.shape[2], axis=2)
  v_BSHV = jnp.repeat(v_BSGV, H // v_BSGV.shape[2], axis=2)
  scale = 1.0 / math.sqrt(K) if scale is None else scale
  outs = []
  for h in range(H):
    logits_BTS = jnp.einsum("btk,bsk->bts", q_BTHK[:, :, h].astype(jnp.float32),
                            k_BSHK[:, :, h].astype(jnp.float32)) * scale
    if mask is not None:
      m = jnp.broadcast_to(mask, (B, H) + logits_BTS.shape[1:])[:, h]
      logits_BTS = jnp.where(m, logits_BTS, -jnp.inf)
      p = jnp.exp(logits_BTS - jnp.max(jnp.where(m, logits_BTS, -1e30), -1, keepdims=True))
      p = jnp.where(m, p, 0.0)
      denom = p.sum(-1, keepdims=True)
      p = jnp.where(denom > 0, p / jnp.where(denom > 0, denom, 1.0), 0.0)
    else:
      p = jax.nn.softmax(logits_BTS, axis=-1)
    outs.append(jnp.einsum("bts,bsv->btv", p, v_BSHV[:, :, h].astype(jnp.float32)))
  return jnp.stack(outs, axis=2)
