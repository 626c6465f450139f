"""Attention sinks, value drains and massive activations, per layer and head, of a causal model on one batch.

Reads, per layer, the attention weights w (B,H,T,T) under a causal mask, the
values v (B,T,G,V) the weights average and the residual stream h (B,T,D)
after the block:

  first_mass (H,)      w_t0, the weight on the first position, averaged over
                       examples and the queries that see it and one other key
                       (t >= 1, and t < window with a sliding window)
  sink_heads           the fraction of the layer's heads whose first_mass
                       exceeds the threshold (Gu et al. 2024, "When Attention
                       Sink Emerges in Language Models": 0.3)
  value_drain (G,)     ||v_0|| averaged over examples / the median ||v_s|| over
                       every example and position: a first token whose value
                       is small ("value-state drain", Guo et al. 2024) gives << 1
  residual_first       ||h_0|| averaged over examples / the median ||h_t|| over
                       every example and position ("residual-state peak")
  residual_massive     max |h| / median |h| over every entry: Sun et al. 2024's
                       "massive activations" are thousands of times the median
With a domain (B,T) per query (bigram_backcopy: the input is a trigger):
  first_mass_trigger, first_mass_other (H,): first_mass over the queries in
                       the domain and over the rest (NaN where a batch has none)
  active_dormant       the fraction of heads dormant on the other queries
                       (first_mass_other > threshold) and active on the
                       domain's (first_mass_trigger <= threshold): Guo et
                       al.'s active-dormant heads, judged by the attention on
                       [BOS] alone
The weights are whatever the layer returns: softmax rows sum to 1, rows with
a learned sink to less, sigmoid or ReLU rows (HeadConfig.probability) to
anything, and differential attention's are signed. first_mass is the weight
itself in every case, so the threshold reads as "most of the row" only under
softmax.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import jax
import jax.numpy as jnp

from attn.variants import base

Array = jax.Array


@contextlib.contextmanager
def record_values() -> Iterator[list]:
  """Yields a list; each attention layer run inside appends the values it attends to, (B,S,G,V).

  Works at trace time (under jit), through the hook every variant's keys and
  values pass (attn.variants.base.cached_kv), which it leaves unchanged.
  """
  seen: list = []

  def hook(k_BSGK, v_BSGV):
    seen.append(v_BSGV)
    return k_BSGK, v_BSGV

  token = base.KV_HOOK.set(hook)
  try:
    yield seen
  finally:
    base.KV_HOOK.reset(token)


def first_rows(T: int, window: int | None = None) -> Array:
  """(T,) True for the queries that see the first position and at least one other key."""
  t = jnp.arange(T)
  return (t >= 1) & (t < window) if window else t >= 1


def _mean_over(x_BHT: Array, rows_BT: Array) -> Array:
  """(H,) mean of x over the (b, t) where rows holds; NaN where none does."""
  rows = rows_BT[:, None, :].astype(jnp.float32)
  return (x_BHT * rows).sum((0, 2)) / rows.sum((0, 2))


def _norm_ratio(x_BTE: Array) -> Array:
  """Mean over examples of the first position's L2 norm / the median norm over every (b, t); per trailing group."""
  n = jnp.linalg.norm(x_BTE.astype(jnp.float32), axis=-1)
  return n[:, 0].mean(0) / jnp.median(n.reshape(-1, *n.shape[2:]), axis=0)


def layer_stats(w_BHTT: Array, v_BSGV: Array | None, h_BTD: Array, threshold: float,
                window: int | None = None, domain_BT: Array | None = None) -> dict[str, Array]:
  """The module docstring's statistics of one layer."""
  B, H, T, _ = w_BHTT.shape
  rows_BT = jnp.broadcast_to(first_rows(T, window), (B, T))
  w0_BHT = w_BHTT[..., 0].astype(jnp.float32)
  first = _mean_over(w0_BHT, rows_BT)
  a = jnp.abs(h_BTD.astype(jnp.float32))
  out = {"first_mass": first,
         "value_drain": jnp.full((1,), jnp.nan) if v_BSGV is None else _norm_ratio(v_BSGV),
         "residual_first": _norm_ratio(h_BTD), "residual_massive": a.max() / jnp.median(a)}
  if domain_BT is not None:
    out.update(first_mass_trigger=_mean_over(w0_BHT, rows_BT & domain_BT),
               first_mass_other=_mean_over(w0_BHT, rows_BT & ~domain_BT))
  return {**out, **head_fractions(out, threshold)}


def head_fractions(stats: dict[str, Array], threshold: float) -> dict[str, Array]:
  """sink_heads (and active_dormant) of a layer from its masses per head (first_mass, first_mass_trigger/other)."""
  out = {"sink_heads": (jnp.asarray(stats["first_mass"]) > threshold).mean()}
  if "first_mass_trigger" in stats:
    trig, other = jnp.asarray(stats["first_mass_trigger"]), jnp.asarray(stats["first_mass_other"])
    out["active_dormant"] = ((other > threshold) & (trig <= threshold)).mean()
  return out


def sink_stats(weights: list[Array], values: list[Array | None], residuals: list[Array], threshold: float,
               windows: list[int | None] | None = None, domain_BT: Array | None = None) -> list[dict[str, Array]]:
  """layer_stats of every layer: weights, values and residuals per layer, in order."""
  windows = windows or [None] * len(weights)
  return [layer_stats(w, v, h, threshold, win, domain_BT)
          for w, v, h, win in zip(weights, values, residuals, windows)]


def summary(layers: list[dict[str, Array]]) -> dict[str, Array]:
  """Over layers and heads: mean first_mass, fraction of sink heads (and of active-dormant ones), mean
  value_drain, largest residual_first and residual_massive."""
  cat = lambda key: jnp.concatenate([jnp.ravel(lay[key]) for lay in layers])
  heads = jnp.array([lay["first_mass"].size for lay in layers], jnp.float32)
  share = lambda key: (jnp.stack([lay[key] for lay in layers]) * heads).sum() / heads.sum()
  out = {"first_mass": jnp.nanmean(cat("first_mass")), "sink_heads": share("sink_heads"),
         "value_drain": jnp.nanmean(cat("value_drain")),
         "residual_first": jnp.max(cat("residual_first")), "residual_massive": jnp.max(cat("residual_massive"))}
  if "active_dormant" in layers[0]:
    out["active_dormant"] = share("active_dormant")
  return out
