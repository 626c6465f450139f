"""Statistics of attention weights on data, per head: what each head looks at, and how alike heads are.

Every function reads weights w (B,H,T,S), a softmax over keys as
attn.apply(..., return_weights=True) or a model's return_weights give them,
and a boolean mask broadcastable to (B,H,T,S), True where query t may attend
key s (the kernel's convention; None: every key). A query row counts only if
it has at least one key; rows without one (fully masked, or padding queries
masked out by the caller) are left out of every mean.

Per head, averaged over the counted queries of every example:
  entropy     -Σ_s w_ts log w_ts in nats: 0 for one key, log n for n keys equally
  confidence  max_s w_ts (Voita et al. 2019)
  distance    Σ_s w_ts |t - s|, in positions: Σ_s w_ts (t - s) under a causal mask
  rank        the numerical rank of the head's T×S matrix (masked entries and
              uncounted rows zeroed): singular values σ_i > RANK_RTOL·σ_max,
              averaged over examples. RANK_RTOL = 1e-2, not float eps: a causal
              softmax matrix is triangular with a positive diagonal, so at eps it
              is full rank whatever the head does; at 1e-2 uniform causal
              attention over T = 32 is still full rank (σ_min/σ_max = 0.011),
              while every query reading the same few keys gives rank a few.
  first_mass  w_t0, the weight on the first key (the "attention sink" of Xiao et
              al. 2023; Qiu et al. 2025 report it falling from ~47% to ~5% with
              output gates), over the counted rows that see key 0 and at least
              one other key (a row with one key has no choice, e.g. t = 0
              under a causal mask)
  sink_mass   1 − Σ_s w_ts: the mass a learned sink logit (HeadConfig.sinks,
              gpt-oss) takes from the keys; 0 for a plain softmax
  row_sum     Σ_s w_ts: 1 under softmax, less with a learned sink, anything
              under sigmoid or ReLU (HeadConfig.probability), whose rows are
              not distributions: there entropy, head_js and sink_mass have no
              meaning, and attn analyze's summary leaves them out
Per layer:
  head_js     (H,H): the Jensen–Shannon divergence (nats) between heads h and g,
              per query row, averaged: 0 for equal rows, log 2 for rows on disjoint keys
  diversity   the mean of head_js over pairs h ≠ g: are h heads h different
              patterns or copies? NaN for one head
  max_entropy the mean of log(number of keys): the entropy of uniform attention
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.scipy.special import xlogy

from attn.config import invalid

Array = jax.Array
RANK_RTOL = 1e-2
LOG2 = math.log(2.0)


def _check(w_BHTS, mask) -> tuple[Array, Array]:
  """(weights zeroed outside the mask, mask as a bool (B,H,T,S) array)."""
  w_BHTS = jnp.asarray(w_BHTS)
  if w_BHTS.ndim != 4:
    raise invalid("weights.shape", tuple(w_BHTS.shape), "(B, H, T, S) attention weights")
  if mask is None:
    return w_BHTS, jnp.ones(w_BHTS.shape, bool)
  mask = jnp.asarray(mask)
  if mask.dtype != jnp.bool_:
    raise invalid("mask.dtype", str(mask.dtype), "bool (True = may attend)")
  try:
    mask = jnp.broadcast_to(mask, w_BHTS.shape)
  except ValueError:
    raise invalid("mask.shape", tuple(mask.shape),
                  f"broadcastable to the weights' (B,H,T,S)={tuple(w_BHTS.shape)}") from None
  return jnp.where(mask, w_BHTS, 0.0), mask


def _row_mean(x_BHT: Array, rows_BHT: Array) -> Array:
  """Mean over examples and counted query rows: (H,)."""
  n_H = rows_BHT.sum(axis=(0, 2))
  return jnp.where(rows_BHT, x_BHT, 0.0).sum(axis=(0, 2)) / jnp.maximum(n_H, 1)


def js_divergence(p, q, axis: int = -1) -> Array:
  """Jensen–Shannon divergence in nats between distributions p and q along `axis`: in [0, log 2]."""
  p, q = jnp.asarray(p), jnp.asarray(q)
  m = 0.5 * (p + q)
  return 0.5 * (xlogy(p, p) - xlogy(p, m) + xlogy(q, q) - xlogy(q, m)).sum(axis=axis)


def head_js(w_BHTS, mask=None) -> Array:
  """(H,H) Jensen–Shannon divergence between the heads' rows, averaged over queries both heads count."""
  w_BHTS, mask = _check(w_BHTS, mask)
  rows_BHT = mask.any(-1)

  def against(one):  # one head, (B,T,S) and (B,T), against every head: (H,)
    w_BTS, rows_BT = one
    js_BHT = js_divergence(w_BTS[:, None], w_BHTS)
    return _row_mean(js_BHT, rows_BT[:, None] & rows_BHT)

  return jax.lax.map(against, (w_BHTS.swapaxes(0, 1), rows_BHT.swapaxes(0, 1)))


def attention_stats(w_BHTS, mask=None, rtol: float = RANK_RTOL) -> dict[str, Array]:
  """{"entropy", "confidence", "distance", "rank", "first_mass", "sink_mass", "row_sum"} (H,), "head_js" (H,H),
  "diversity", "max_entropy"."""
  w_BHTS, mask = _check(w_BHTS, mask)
  B, H, T, S = w_BHTS.shape
  rows_BHT = mask.any(-1)
  w_BHTS = jnp.where(rows_BHT[..., None], w_BHTS, 0.0)
  entropy_BHT = -xlogy(w_BHTS, w_BHTS).sum(-1)
  distance_TS = jnp.abs(jnp.arange(T)[:, None] - jnp.arange(S)[None, :]).astype(w_BHTS.dtype)
  sigma_BHX = jnp.linalg.svd(w_BHTS.astype(jnp.float32), compute_uv=False)
  rank_BH = (sigma_BHX > rtol * sigma_BHX[..., :1]).sum(-1) * (sigma_BHX[..., 0] > 0)
  examples_H = rows_BHT.any(-1).sum(0)
  js_HH = head_js(w_BHTS, mask)
  off = ~jnp.eye(H, dtype=bool)
  diversity = jnp.where(off, js_HH, 0.0).sum() / (H * (H - 1)) if H > 1 else jnp.float32(jnp.nan)
  n_keys_BHT = mask.sum(-1)
  chooses_BHT = mask[..., 0] & (n_keys_BHT > 1)
  return {
      "entropy": _row_mean(entropy_BHT, rows_BHT),
      "confidence": _row_mean(w_BHTS.max(-1), rows_BHT),
      "distance": _row_mean((w_BHTS * distance_TS).sum(-1), rows_BHT),
      "rank": jnp.where(rows_BHT.any(-1), rank_BH, 0).sum(0) / jnp.maximum(examples_H, 1),
      "first_mass": _row_mean(w_BHTS[..., 0], chooses_BHT),
      "sink_mass": _row_mean(1.0 - w_BHTS.sum(-1), rows_BHT),
      "row_sum": _row_mean(w_BHTS.sum(-1), rows_BHT),
      "head_js": js_HH,
      "diversity": diversity,
      "max_entropy": _row_mean(jnp.log(jnp.maximum(n_keys_BHT, 1)).astype(w_BHTS.dtype),
                               rows_BHT).mean(),
  }
