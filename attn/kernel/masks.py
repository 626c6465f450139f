"""Boolean attention masks, True where a query may attend a key (JAX/Flax convention)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attn.config import invalid

Array = jax.Array


def causal_mask(T: int, S: int | None = None) -> Array:
  """(1,1,T,S): query t may attend keys s <= t + (S - T), i.e. aligned at the end.

  With S == T (self-attention) this is the lower triangle. With S > T (a
  cache of S - T earlier keys) the last query sees every key.
  """
  S = T if S is None else S
  for name, value in (("T", T), ("S", S)):
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
      raise invalid(name, value, "a positive integer")
  t = jnp.arange(T)[:, None]
  s = jnp.arange(S)[None, :]
  return (s <= t + (S - T))[None, None]


def window_mask(T: int, S: int, window: int) -> Array:
  """(1,1,T,S): query t may attend keys s with |t + (S - T) - s| < window.

  Query t sits at position t + S - T, aligned at the end as in causal_mask;
  ANDed with causal_mask the window is the `window` keys ending at the query
  itself. A window of max(T, S) or more masks nothing.
  """
  for name, value in (("T", T), ("S", S), ("window", window)):
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
      raise invalid(name, value, "a positive integer")
  window = min(window, max(T, S))  # wider is the same mask; keeps int32 iotas safe
  t = jnp.arange(T)[:, None] + (S - T)
  s = jnp.arange(S)[None, :]
  return (jnp.abs(t - s) < window)[None, None]


def padding_mask(kv_lengths: Array, S: int, q_lengths: Array | None = None,
                 T: int | None = None) -> Array:
  """Key padding (B,1,1,S) from per-example key lengths; with q_lengths, (B,1,T,S).

  Queries past their length get fully masked rows, which the kernel turns
  into zero outputs.
  """
  kv_lengths = jnp.asarray(kv_lengths)
  if kv_lengths.ndim != 1:
    raise invalid("kv_lengths.shape", kv_lengths.shape, "rank 1: one length per example")
  mask = (jnp.arange(S)[None, :] < kv_lengths[:, None])[:, None, None, :]
  if q_lengths is None:
    return mask
  if T is None:
    raise invalid("T", None, "the query length, required with q_lengths")
  q_lengths = jnp.asarray(q_lengths)
  if q_lengths.shape != kv_lengths.shape:
    raise invalid("q_lengths.shape", q_lengths.shape, f"equal to kv_lengths.shape={kv_lengths.shape}")
  q_ok = (jnp.arange(T)[None, :] < q_lengths[:, None])[:, None, :, None]
  return mask & q_ok


def combine_masks(*masks: Array | None) -> Array | None:
  """Logical AND of the masks that are not None; None if all are None."""
  present = [m for m in masks if m is not None]
  if not present:
    return None
  out = present[0]
  for m in present[1:]:
    out = jnp.logical_and(out, m)
  return out


def visible_rows(T: int, S: int, is_causal: bool, kv_lengths: Array | None,
                 window: int | None) -> Array | None:
  """(B|1, T): whether query t has a key its structured masks leave visible; None if all have."""
  t_T = jnp.arange(T) + (S - T)
  lo_T = jnp.zeros((T,), jnp.int32)
  hi_T = jnp.full((T,), S - 1)
  if window is not None:
    lo_T = jnp.maximum(lo_T, t_T - window + 1)
    hi_T = jnp.minimum(hi_T, t_T + window - 1)
  if is_causal:
    hi_T = jnp.minimum(hi_T, t_T)
  if kv_lengths is None:
    if T <= S or not (is_causal or window is not None):  # t + S - T >= 0 keeps a key in reach
      return None
    return (lo_T <= hi_T)[None]
  hi_BT = jnp.minimum(hi_T[None], kv_lengths.astype(jnp.int32)[:, None] - 1)
  return lo_T[None] <= hi_BT


def rows_with_keys(mask: Array | None, T: int, S: int, is_causal: bool, kv_lengths: Array | None,
                   window: int | None, B: int, H: int) -> Array | None:
  """(B|1,T,H|1,1): whether a query row keeps a key under a dense mask and the structured ones.

  For the wrappers of kernels that give a fully masked row something other than
  attn's zeros; None when every row keeps one. Without a dense mask no (T,S)
  array is built; with one, the masks are ANDed before asking.
  """
  if mask is None:
    rows_BT = visible_rows(T, S, is_causal, kv_lengths, window)
    return None if rows_BT is None else rows_BT[:, :, None, None]
  structured = [causal_mask(T, S) if is_causal else None,
                None if kv_lengths is None else padding_mask(kv_lengths, S),
                None if window is None else window_mask(T, S, window)]
  full = combine_masks(mask, *structured)
  return jnp.broadcast_to(full, (full.shape[0], H, T, S)).any(-1).transpose(0, 2, 1)[..., None]
