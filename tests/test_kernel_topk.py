"""The exact top-k by bisection over the float bits (attn.kernel.topk) and the blockwise indexer
selector (attn.kernel.select.indexer_top) against lax.top_k and the counting reference.

The tie rule is attn.kernel.select's: of equal scores the lower index wins; -inf is never chosen.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from attn.kernel import select, topk


def _whole(fn):
  """fn compiled whole for one call (its arguments constants): op by op, each small op compiles on its own."""
  return lambda *a, **kw: jax.jit(functools.partial(fn, *a, **kw))()


def _top_k_set(x, k):
  """lax.top_k's choice as a boolean row mask (its equal values keep the lower index first)."""
  vals, idx = lax.top_k(x, k)
  out = np.zeros(x.shape, bool)
  for r in range(x.shape[0]):
    out[r, np.asarray(idx[r])[np.asarray(vals[r]) > -np.inf]] = True
  return out


def _rows(rng):
  R, S = 9, 53
  x = rng.standard_normal((R, S)).astype(np.float32)
  x[1] = np.round(x[1])  # many ties
  x[2] = 0.0
  x[2, ::3] = -0.0  # -0 below +0 (lax.top_k's total order)
  x[3, 10:] = -np.inf  # fewer finite than k
  x[4] = -np.inf  # nothing to choose
  x[5, [4, 9]] = np.inf
  x[6] = rng.choice([-1e30, 1e-38, 1e-45, -1e-45, 3.0], S)  # extremes, denormals
  x[7] = -np.abs(x[7])  # all negative
  x[8, :] = 2.5  # one value
  return jnp.asarray(x)


@pytest.mark.parametrize("k", [1, *(pytest.param(k, marks=pytest.mark.slow) for k in (7, 16, 53)), 60])  # k=1, k>S fast
def test_topk_mask_and_indices_equal_lax_top_k(k):
  x = _rows(np.random.default_rng(k))
  want = _top_k_set(x, min(k, x.shape[1]))
  mask, idx = jax.jit(lambda x: (topk.mask(x, k), topk.indices(x, k)))(x)  # one program for both
  np.testing.assert_array_equal(mask, want)
  idx = np.asarray(idx)
  assert idx.shape == (x.shape[0], k)
  for r in range(x.shape[0]):
    n = int(want[r].sum())
    np.testing.assert_array_equal(idx[r, :n], np.flatnonzero(want[r]))  # ascending
    assert (idx[r, n:] == -1).all()


def test_topk_agrees_with_the_counting_reference():
  """A second check on ties: select._rank_select counts, per entry, the rivals that beat it."""
  x = jnp.asarray(np.random.default_rng(3).integers(-3, 3, (6, 40)).astype(np.float32))
  x = x.at[0, :5].set(-jnp.inf)
  np.testing.assert_array_equal(_whole(topk.mask)(x, 11), _whole(select._rank_select)(x, 11))


# (B, T, S, J, I, top_k): S != T both ways, top_k past S, rows not a multiple of the tile.
CASES = [(2, 37, 45, 2, 3, 5), (1, 45, 37, 3, 4, 9), (2, 20, 20, 2, 2, 30)]


@pytest.mark.parametrize("case,is_causal", [
    pytest.param(c, causal, marks=() if (i, causal) in ((1, True), (2, False)) else pytest.mark.slow)
    for i, c in enumerate(CASES) for causal in (True, False)])  # T > S causal; top_k past S with padding
def test_indexer_top_equals_indexer_tokens(case, is_causal):
  B, T, S, J, I, top_k = case
  rng = np.random.default_rng(sum(case) + is_causal)
  r = lambda *s: jnp.asarray(rng.standard_normal(s).astype(np.float32))  # noqa: E731
  qi, ki, w = r(B, T, J, I), r(B, S, I), r(B, T, J)
  kv_lengths = jnp.array([S, S // 2][:B])

  @jax.jit  # the choice, the reference and both as bits in one program (eager, each small op compiles alone)
  def run(qi, ki, w, n):
    idx = select.indexer_top(qi, ki, w, top_k=top_k, is_causal=is_causal, kv_lengths=n, rows=8, buckets=3)
    want = select.indexer_tokens_reference(qi, ki, w, top_k=top_k, is_causal=is_causal, kv_lengths=n)
    return idx, want, select.indices_to_bits(idx, S), select.pack_bits(want)
  idx, want, bits, want_bits = (np.asarray(a) for a in run(qi, ki, w, kv_lengths))
  assert idx.shape == (B, T, min(top_k, S))
  got = np.zeros_like(want)
  for b in range(B):
    for t in range(T):
      chosen = idx[b, t][idx[b, t] >= 0]
      assert (np.diff(chosen) > 0).all()
      got[b, t, chosen] = True
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(bits, want_bits)
