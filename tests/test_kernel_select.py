"""Key selection: MoBA and the lightning indexer as pure functions, and the blocked kernel that honours them.

Each selection is checked against a second implementation that counts, per candidate, the rivals
that beat it (attn.kernel.select's *_reference); the blocked kernel over the selected blocks
(attn.kernel.sparse) against the einsum kernel with the selection's dense mask, values and gradients.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn import kernel
from attn.kernel import select, sparse


def _whole(fn):
  """fn compiled whole for one call (its arguments constants): op by op, each small op compiles on its own."""
  return lambda *a, **kw: jax.jit(functools.partial(fn, *a, **kw))()


def _randn(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


# (B, T, S, H, G, K, V): lengths not multiples of any block, GQA, MQA, d_v ≠ d_k, S < T and S > T.
SHAPES = [(2, 37, 45, 4, 2, 5, 7), (2, 45, 37, 3, 1, 6, 4), (1, 50, 50, 2, 2, 8, 8)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("is_causal", [True, False])
@pytest.mark.slow
def test_moba_blocks_equal_counting_reference(shape, is_causal):
  B, T, S, H, G, K, V = shape
  q, k = _randn(0, (B, T, H, K)), _randn(1, (B, S, G, K))
  kv_lengths = jnp.array([S, 11][:B])
  for top_k in (1, 3):
    got = _whole(select.moba_blocks)(q, k, block=8, top_k=top_k, is_causal=is_causal, kv_lengths=kv_lengths)
    want = select.moba_blocks_reference(q, k, block=8, top_k=top_k, is_causal=is_causal,
                                        kv_lengths=kv_lengths)
    np.testing.assert_array_equal(got, want)
    assert int(got.sum(-1).max()) <= top_k


def test_moba_causal_rule():
  """The own block is always in, no later block ever, and a query sees at most top_k blocks."""
  B, T, H, K, block = 1, 40, 2, 4, 8
  q, k = _randn(2, (B, T, H, K)), _randn(3, (B, T, H, K))
  sel = np.asarray(_whole(select.moba_blocks)(q, k, block=block, top_k=2, is_causal=True))
  for t in range(T):
    own = t // block
    assert sel[0, :, t, own].all()
    assert not sel[0, :, t, own + 1:].any()
    assert (sel[0, :, t].sum(-1) == min(2, own + 1)).all()


def test_moba_ties_take_the_lower_block():
  """Equal mean keys: the earliest blocks win, in both implementations."""
  B, T, H, K, block = 1, 32, 1, 2, 4
  q = jnp.ones((B, T, H, K))
  k = jnp.ones((B, T, H, K))
  sel = _whole(select.moba_blocks)(q, k, block=block, top_k=3, is_causal=True)
  ref = select.moba_blocks_reference(q, k, block=block, top_k=3, is_causal=True)
  np.testing.assert_array_equal(sel, ref)
  last = np.asarray(sel[0, 0, -1])
  assert list(np.flatnonzero(last)) == [0, 1, 7]


def test_moba_under_a_dense_causal_mask_is_the_causal_choice():
  """A KV cache decodes under a dense mask; the choice equals is_causal's (the same rule)."""
  B, T, H, G, K = 2, 29, 4, 2, 5
  q, k = _randn(4, (B, T, H, K)), _randn(5, (B, T, G, K))
  a, b = jax.jit(lambda q, k: (  # one program for both
      select.moba_blocks(q, k, block=4, top_k=3, is_causal=True),
      select.moba_blocks(q, k, block=4, top_k=3, is_causal=False, mask=kernel.masks.causal_mask(T))))(q, k)
  np.testing.assert_array_equal(a, b)


# The fast case takes each top_k (and chunk) once, with and without the mask in turn; the slow ones every pair.
@pytest.mark.parametrize("is_causal, every_pair", [(True, False), pytest.param(True, True, marks=pytest.mark.slow),
                                                   pytest.param(False, True, marks=pytest.mark.slow)])
def test_indexer_tokens_equal_counting_reference(is_causal, every_pair):
  B, T, S, J, I = 2, 37, 45, 3, 4
  qi, ki, w = _randn(6, (B, T, J, I)), _randn(7, (B, S, I)), _randn(8, (B, T, J))
  kv_lengths = jnp.array([45, 9])
  mask = jnp.asarray(np.random.default_rng(9).uniform(size=(B, 1, T, S)) < 0.7)
  cases = [(top_k, chunk, m) for i, (top_k, chunk) in enumerate(((1, None), (6, 8), (100, 16)))
           for m in ((None, mask) if every_pair else ((mask, None)[i % 2],))]
  # every case's choice and the visibility in one program (each its own: one compile a case)
  gots, vis = jax.jit(lambda qi, ki, w, n, mask: (
      [select.indexer_tokens(qi, ki, w, top_k=top_k, is_causal=is_causal, kv_lengths=n,
                             mask=None if m is None else mask, chunk=chunk) for top_k, chunk, m in cases],
      select.visible(T, S, is_causal, n, B)))(qi, ki, w, kv_lengths, mask)
  for got, (top_k, _, m) in zip(gots, cases):
    want = select.indexer_tokens_reference(qi, ki, w, top_k=top_k, is_causal=is_causal,
                                           kv_lengths=kv_lengths, mask=m)
    np.testing.assert_array_equal(got, want)
  # With top_k past what a row sees, it keeps exactly what it sees.
  np.testing.assert_array_equal(got, vis & mask[:, 0])


def test_indexer_ties_take_the_lower_key():
  B, T, J, I = 1, 20, 2, 3
  qi = jnp.ones((B, T, J, I))
  ki = jnp.ones((B, T, I))
  w = jnp.ones((B, T, J))
  got = _whole(select.indexer_tokens)(qi, ki, w, top_k=4, is_causal=True, chunk=7)
  np.testing.assert_array_equal(got, _whole(select.indexer_tokens_reference)(qi, ki, w, top_k=4, is_causal=True))
  assert list(np.flatnonzero(got[0, -1])) == [0, 1, 2, 3]


def test_bits_round_trip():
  m = jnp.asarray(np.random.default_rng(10).uniform(size=(2, 5, 77)) < 0.4)
  s_pos = jnp.broadcast_to(jnp.arange(77), (2, 77))
  qi, ki, w = _randn(1, (2, 40, 2, 3)), _randn(2, (2, 77, 3)), _randn(3, (2, 40, 2))

  @jax.jit  # one program (eager, each small op compiles on its own)
  def run(m, s_pos, qi, ki, w):
    bits = select.pack_bits(m)
    return (bits, select.bits_at(bits, s_pos), select.indexer_bits(qi, ki, w, top_k=5, is_causal=False, chunk=16),
            select.pack_bits(select.indexer_tokens(qi, ki, w, top_k=5, is_causal=False)))
  bits, back, from_indexer, packed = run(m, s_pos, qi, ki, w)
  assert bits.shape == (2, 5, 3) and bits.dtype == jnp.uint32
  np.testing.assert_array_equal(back, m)
  np.testing.assert_array_equal(from_indexer, packed)


def _both(q, k, v, blocks, mask, *, block_k, is_causal, kv_lengths, bits=None, softcap=None):
  """(sparse, dense) of the same selection: values and gradients of a fixed random projection."""
  K = q.shape[-1]
  co = _randn(99, (*q.shape[:3], v.shape[-1]))
  sp = lambda q, k, v: sparse.attention(q, k, v, blocks, block_k=block_k, scale=K ** -0.5,
                                         is_causal=is_causal, kv_lengths=kv_lengths, bits_BTW=bits,
                                         block_q=16, softcap=softcap)
  de = lambda q, k, v: kernel.attention(q, k, v, mask, is_causal=is_causal, kv_lengths=kv_lengths,
                                        softcap=softcap)
  def value_and_vjp(f):  # one program for the values and the gradients (a jitted vjp compiles two)
    def run(q, k, v):
      y, vjp = jax.vjp(f, q, k, v)
      return y, vjp(co)
    return jax.jit(run)(q, k, v)
  return [value_and_vjp(f) for f in (sp, de)]


# The first shape (T < S, G < H, d_v != d_k) in the fast tier; the other two (T > S, one kv head; T = S) slow.
# The fast case: causal with a soft-cap; the slow ones causal without it and bidirectional with it.
CAUSAL_SOFTCAP = ((True, None), (False, 3.0))


@pytest.mark.parametrize("shape, cases", [(SHAPES[0], ((True, 3.0),))] + [
    pytest.param(s, CAUSAL_SOFTCAP, marks=pytest.mark.slow) for s in SHAPES])
def test_sparse_kernel_equals_dense_moba(shape, cases):
  B, T, S, H, G, K, V = shape
  q, k, v = _randn(11, (B, T, H, K)), _randn(12, (B, S, G, K)), _randn(13, (B, S, G, V))
  kv_lengths = jnp.array([S, 0][:B])  # example 1 sees nothing: rows with nothing selected
  for is_causal, softcap in cases:
    blocks = _whole(select.moba_blocks)(q, k, block=8, top_k=2, is_causal=is_causal, kv_lengths=kv_lengths)
    mask = _whole(select.blocks_to_mask)(blocks, 8, S)
    (y, g), (y_ref, g_ref) = _both(q, k, v, blocks, mask, block_k=8, is_causal=is_causal,
                                   kv_lengths=kv_lengths, softcap=softcap)
    np.testing.assert_allclose(y, y_ref, atol=2e-6)
    for a, b in zip(g, g_ref):
      np.testing.assert_allclose(a, b, atol=2e-5)
    if B > 1:
      assert not np.any(y[1]) and not np.any(g[0][1])


@pytest.mark.parametrize("shape", [SHAPES[0], pytest.param(SHAPES[1], marks=pytest.mark.slow)])  # one fast
def test_sparse_kernel_equals_dense_indexer(shape):
  B, T, S, H, G, K, V = shape
  q, k, v = _randn(14, (B, T, H, K)), _randn(15, (B, S, G, K)), _randn(16, (B, S, G, V))
  qi, ki, w = _randn(17, (B, T, 2, 3)), _randn(18, (B, S, 3)), _randn(19, (B, T, 2))
  kv_lengths = jnp.array([S - 3, 5][:B])
  tokens = _whole(select.indexer_tokens)(qi, ki, w, top_k=7, is_causal=True, kv_lengths=kv_lengths)
  bits = _whole(select.pack_bits)(tokens)
  blocks = _whole(select.token_blocks)(bits, 32, S)
  (y, g), (y_ref, g_ref) = _both(q, k, v, blocks, tokens[:, None], block_k=32, is_causal=True,
                                 kv_lengths=kv_lengths, bits=bits)
  np.testing.assert_allclose(y, y_ref, atol=2e-6)
  for a, b in zip(g, g_ref):
    np.testing.assert_allclose(a, b, atol=2e-5)


def test_selecting_every_block_is_full_causal_attention_exactly():
  B, T, H, G, K, V = 2, 45, 4, 2, 5, 7
  q, k, v = _randn(20, (B, T, H, K)), _randn(21, (B, T, G, K)), _randn(22, (B, T, G, V))
  qi, ki, w = _randn(23, (B, T, 2, 3)), _randn(24, (B, T, 3)), _randn(25, (B, T, 2))

  @jax.jit  # one program (eager, each small op compiles on its own)
  def run(q, k, v, qi, ki, w):
    full = kernel.attention(q, k, v, is_causal=True)
    blocks = select.moba_blocks(q, k, block=8, top_k=6, is_causal=True)  # 6 blocks of 8 cover 45
    by_blocks = kernel.attention(q, k, v, select.blocks_to_mask(blocks, 8, T), is_causal=True)
    tokens = select.indexer_tokens(qi, ki, w, top_k=T, is_causal=True)
    by_tokens = kernel.attention(q, k, v, tokens[:, None], is_causal=True)
    return full, by_blocks, by_tokens, sparse.attention(q, k, v, blocks, block_k=8, scale=K ** -0.5, is_causal=True,
                                                        block_q=16)
  full, by_blocks, by_tokens, y = run(q, k, v, qi, ki, w)
  np.testing.assert_array_equal(by_blocks, full)
  np.testing.assert_array_equal(by_tokens, full)
  np.testing.assert_allclose(y, full, atol=2e-6)


def test_sparse_kernel_visits_only_selected_blocks():
  """Causal MoBA with top_k = 2 of blocks of 64 at T = 1024: each query block of 64 visits at most
  its own block and one chosen per row, far fewer than the causal triangle's 136."""
  B, T, H, K = 1, 1024, 1, 4
  q, k = _randn(26, (B, T, H, K)), _randn(27, (B, T, H, K))
  blocks = _whole(select.moba_blocks)(q, k, block=64, top_k=2, is_causal=True)
  n = sparse.visits(blocks, T, block_q=64)
  assert n <= 16 * 2 * 64 and n < 136


@pytest.mark.parametrize("shape", SHAPES[:2])
@pytest.mark.slow
def test_gathered_kernel_equals_dense_moba(shape):
  """MoBA's pairs gathered per key block (attn.kernel.gathered) against the einsum kernel with the
  same choice as a dense mask: values and gradients, GQA/MQA, d_v ≠ d_k, a batch element seeing nothing,
  chunks smaller than a block's rows (several chunks a block, padding between blocks)."""
  from attn.kernel import gathered
  B, T, S, H, G, K, V = shape
  q, k, v = _randn(30, (B, T, H, K)), _randn(31, (B, S, G, K)), _randn(32, (B, S, G, V))
  kv_lengths = jnp.array([S, 0][:B])
  co = _randn(33, (B, T, H, V))
  for is_causal, softcap in ((True, None), (False, 2.0)):
    idx, chosen = select.moba_top(q, k, block=8, top_k=2, is_causal=is_causal, kv_lengths=kv_lengths)
    mask = select.moba_mask(q, k, block=8, top_k=2, is_causal=is_causal, kv_lengths=kv_lengths)
    np.testing.assert_array_equal(  # the indices name the same set as moba_blocks
        jnp.zeros(mask.shape[:3] + (select.num_blocks(S, 8),), bool).at[
            jnp.arange(B)[:, None, None, None], jnp.arange(H)[None, :, None, None],
            jnp.arange(T)[None, None, :, None], idx].max(chosen),
        _whole(select.moba_blocks)(q, k, block=8, top_k=2, is_causal=is_causal, kv_lengths=kv_lengths))
    ga = lambda q, k, v: gathered.attention(q, k, v, idx, chosen, block=8, scale=K ** -0.5,
                                            is_causal=is_causal, kv_lengths=kv_lengths, softcap=softcap,
                                            chunk=16)
    de = lambda q, k, v: kernel.attention(q, k, v, mask, is_causal=is_causal, kv_lengths=kv_lengths,
                                          softcap=softcap)
    (y, vjp), (y_ref, vjp_ref) = jax.vjp(jax.jit(ga), q, k, v), jax.vjp(de, q, k, v)
    np.testing.assert_allclose(y, y_ref, atol=2e-6)
    for a, b in zip(vjp(co), vjp_ref(co)):
      np.testing.assert_allclose(a, b, atol=2e-5)
    assert not np.any(y[1])
