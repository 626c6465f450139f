"""Exact top-k of each row by a bisection over the float bits: linear in the row, no sort.

The same set as `lax.top_k` with attn.kernel.select's tie rule (of equal scores the
lower index wins; -inf is never chosen; with fewer than k finite entries all of them).

Each float32 is mapped to a uint32 whose order is the floats' order (`order_keys`:
positives get the sign bit set, negatives are inverted; -0 below +0, as lax.top_k). The k-th
largest key τ of a row is found bit by bit from the top: a candidate bit is kept when
at least k entries are >= the candidate, counted on the keys as int32 (floats would not
do: XLA:CPU reads a denormal candidate as 0): 32 passes of compare-and-count over the
row, the work of a radix select with one bit a digit (tilelang's DSA selector counts
8-bit digits in a histogram; XLA has no cheap histogram, a comparison it has). The
chosen set is then every entry above τ and, of those equal to τ, the first
k − #(above) by index; `indices` lists them ascending (the compaction by a prefix
sum), -1 where a row has fewer than k.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

Array = jax.Array

_SIGN = 0x80000000


def order_keys(x: Array) -> Array:
  """uint32 keys in lax.top_k's order of the float32 values (a total order: -0 below +0; NaN not
  supported)."""
  b = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
  return jnp.where((b >> 31) == 1, ~b, b | jnp.uint32(_SIGN))


def kth_key(x_RS: Array, k: int) -> Array:
  """(R,) uint32: the key of each row's k-th largest entry (below -inf's key when fewer than k
  entries are finite: then every finite entry is chosen)."""
  signed = lax.bitcast_convert_type(order_keys(x_RS) ^ jnp.uint32(_SIGN), jnp.int32)  # int32 order

  def bit(i, tau):
    cand = tau | (jnp.uint32(1) << (31 - i).astype(jnp.uint32))
    c = lax.bitcast_convert_type(cand ^ jnp.uint32(_SIGN), jnp.int32)
    n = (signed >= c[..., None]).sum(-1, dtype=jnp.int32)
    return jnp.where(n >= k, cand, tau)
  return lax.fori_loop(0, 32, bit, jnp.zeros(x_RS.shape[:-1], jnp.uint32))


def mask(x_RS: Array, k: int) -> Array:
  """(R,S) bool: each row's top k (module docstring's rule)."""
  keys = order_keys(x_RS)
  tau = kth_key(x_RS, k)[..., None]
  above, tie = keys > tau, keys == tau
  need = k - above.sum(-1, keepdims=True, dtype=jnp.int32)
  first = jnp.cumsum(tie, -1, dtype=jnp.int32) <= need
  return (above | (tie & first)) & (x_RS > -jnp.inf)


def indices(x_RS: Array, k: int) -> Array:
  """(R,k) int32: each row's top k (mask) as ascending indices, -1 after the last."""
  sel = mask(x_RS, k)
  return compact(sel, k)


def compact(sel_RS: Array, k: int) -> Array:
  """(R,k) int32: the True positions of each row ascending, -1 after the last (at most k a row)."""
  R, S = sel_RS.shape
  pos = jnp.where(sel_RS, jnp.cumsum(sel_RS, -1, dtype=jnp.int32) - 1, k)
  out = jnp.full((R, k), -1, jnp.int32)
  return out.at[jnp.arange(R)[:, None], pos].set(
      jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (R, S)), mode="drop")


def compare_flops(R: int, S: int) -> int:
  """Compare-and-count operations of kth_key over R rows of S (32 passes)."""
  return 32 * R * S
