"""The shared token-level kernel (attn.kernel.tokens) against dense attention under the selection's mask.

The reference builds a boolean (B,H,T,S) mask from the indices (a key is kept when any of its
group's k entries names it, inside kv_lengths and not in the future) and runs plain float32
softmax attention, zeros for a fully masked row; values and the gradients of q, k and v compared.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn.kernel import tokens


def _randn(rng, shape):
  return jnp.asarray(rng.standard_normal(shape).astype(np.float32))


def _mask(idx_BGTk, B, H, T, S, is_causal, kv_lengths):
  Gs = idx_BGTk.shape[1]
  hit = (idx_BGTk[..., None] == jnp.arange(S)).any(-2)  # (B,Gs,T,S)
  hit = jnp.repeat(hit, H // Gs, axis=1)
  s = jnp.arange(S)
  if is_causal:
    hit = hit & (s <= jnp.arange(T)[:, None] + S - T)
  if kv_lengths is not None:
    hit = hit & (s < jnp.asarray(kv_lengths)[:, None, None, None])
  return hit


# The references (and the masks) run compiled whole: op by op, each small op compiles on its own.
def _dense(q, k, v, mask, scale, softcap=None):
  H, G = q.shape[2], k.shape[2]
  k, v = jnp.repeat(k, H // G, axis=2), jnp.repeat(v, H // G, axis=2)
  s = jnp.einsum("BTHK,BSHK->BHTS", q, k) * scale
  if softcap is not None:
    s = softcap * jnp.tanh(s / softcap)
  s = jnp.where(mask, s, -jnp.inf)
  m = jnp.max(s, -1, keepdims=True)
  p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
  l = p.sum(-1, keepdims=True)
  p = p / jnp.where(l > 0, l, 1.0)
  return jnp.einsum("BHTS,BSHV->BTHV", p, v)


# (B, T, S, H, G, K, V, groups-choose, top): GQA, MQA, d_v != d_k, T not a multiple of the tile, S != T.
CASES = [(2, 13, 13, 4, 2, 5, 7, "one", 4), (2, 11, 17, 3, 1, 6, 4, "one", 5),
         (1, 9, 9, 6, 3, 4, 4, "groups", 3), (2, 10, 14, 4, 4, 3, 5, "groups", 6)]
# The rest in the slow tier: one choice broadcast over G = 2 kv heads (CASES[0]) keeps a fast sibling in
# test_tokens_unique_indices_softcap_and_broadcast_key_head.
FAST = [(CASES[1], False), (CASES[2], True)]


@pytest.mark.parametrize("case,is_causal", [
    pytest.param(c, causal, marks=() if (c, causal) in FAST else pytest.mark.slow)
    for c in CASES for causal in (True, False)])
def test_tokens_equal_the_dense_masked_reference(case, is_causal):
  B, T, S, H, G, K, V, who, top = case
  rng = np.random.default_rng(hash((case, is_causal)) % 2**32)
  q, k, v = _randn(rng, (B, T, H, K)), _randn(rng, (B, S, G, K)), _randn(rng, (B, S, G, V))
  Gs = 1 if who == "one" else G
  # duplicates, -1, indices past S and in the future; one row fully masked
  idx = jnp.asarray(rng.integers(-1, S + 2, (B, Gs, T, top)), jnp.int32)
  idx = idx.at[:, :, 0].set(-1).at[:, :, 1, 1].set(idx[:, :, 1, 0])
  kv_lengths = jnp.array([S, max(2, S - 5)][:B])
  mask = jax.jit(_mask, static_argnums=(1, 2, 3, 4, 5))(idx, B, H, T, S, is_causal, kv_lengths)
  assert not bool(mask[:, :, 0].any())  # the fully masked row is there
  cot = _randn(rng, (B, T, H, V))

  def run(fn):  # the output and the gradients of <output, cot>: one program
    def loss(q, k, v):
      y = fn(q, k, v)
      return jnp.sum(y * cot), y
    (_, y), g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return y, g
  mine = lambda q, k, v: tokens.attention(q, k, v, idx, scale=0.3, is_causal=is_causal,  # noqa: E731
                                          kv_lengths=kv_lengths, tile=4)
  ref = lambda q, k, v: _dense(q, k, v, mask, 0.3)  # noqa: E731
  (out, got), (out_ref, want) = run(mine), run(ref)
  np.testing.assert_allclose(out, out_ref, rtol=2e-5, atol=2e-5)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5)
  assert np.all(np.asarray(out)[:, 0] == 0)


def test_tokens_unique_indices_softcap_and_broadcast_key_head():
  """unique=True (no sort) on a selection without repeats, softcap, one key head broadcast to G."""
  rng = np.random.default_rng(7)
  B, T, S, H, G, K, V, top = 1, 12, 12, 4, 2, 4, 3, 5
  q, k, v = _randn(rng, (B, T, H, K)), _randn(rng, (B, S, 1, K)), _randn(rng, (B, S, G, V))
  idx = jnp.asarray(np.stack([rng.permutation(S)[:top] for _ in range(T)])[None, None], jnp.int32)
  mask = jax.jit(_mask, static_argnums=(1, 2, 3, 4, 5, 6))(idx, B, H, T, S, True, None)
  def run(fn):  # the output and the gradient of its sum of squares by q: one program
    (_, y), g = jax.jit(jax.value_and_grad(lambda q: (jnp.sum(fn(q) ** 2), fn(q)), has_aux=True))(q)
    return y, g
  got, g = run(lambda q: tokens.attention(q, k, v, idx, scale=0.5, is_causal=True, softcap=2.0, unique=True,
                                          tile=5))
  want, w = run(lambda q: _dense(q, jnp.broadcast_to(k, (B, S, G, K)), v, mask, 0.5, softcap=2.0))
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-5)


def test_indexer_bits_run_on_the_token_kernel(monkeypatch):
  """The indexer's bits and indices handed to attn.kernel.sparse with 8 query heads a kv head run on the token
  kernel, and equal the dense attention under indexer_tokens' mask, values and gradients."""
  from attn.kernel import select, sparse
  rng = np.random.default_rng(11)
  B, T, H, G, K, V, top = 1, 21, 8, 1, 4, 6, 5
  q, k, v = _randn(rng, (B, T, H, K)), _randn(rng, (B, T, G, K)), _randn(rng, (B, T, G, V))
  qi, ki, w = _randn(rng, (B, T, 2, 3)), _randn(rng, (B, T, 3)), _randn(rng, (B, T, 2))
  calls = []
  monkeypatch.setattr(sparse.tokens, "attention", lambda *a, run=tokens.attention, **kw: calls.append(1) or run(*a, **kw))

  def mine(q, k, v):
    idx = select.indexer_top(qi, ki, w, top_k=top, is_causal=True)
    bits = select.indices_to_bits(idx, T)
    return sparse.attention(q, k, v, select.token_blocks(bits, 32, T), block_k=32, scale=0.4,
                            is_causal=True, bits_BTW=bits, idx_BTk=idx)
  mask = jax.jit(lambda: select.indexer_tokens(qi, ki, w, top_k=top, is_causal=True)[:, None])()
  ref = lambda q, k, v: _dense(q, k, v, mask & jnp.tril(jnp.ones((T, T), bool)), 0.4)  # noqa: E731
  cot = _randn(rng, (B, T, H, V))

  def run(fn):  # the output and the gradients of <output, cot>: one program
    (_, y), g = jax.jit(jax.value_and_grad(lambda *a: (jnp.sum(fn(*a) * cot), fn(*a)), argnums=(0, 1, 2),
                                           has_aux=True))(q, k, v)
    return y, g
  (out, got), (out_ref, want) = run(mine), run(ref)
  np.testing.assert_allclose(out, out_ref, rtol=2e-5, atol=2e-5)
  assert calls
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("who,is_causal", [("one", True), ("groups", False)])
def test_whole_slices_equal_their_tokens(who, is_causal):
  """unit = 4: each index names keys [4i, 4i + 4) gathered whole (pools), against the dense reference of
  the same tokens: -1, a slice past S (S not a multiple of 4), padding, the future masked inside a slice."""
  rng = np.random.default_rng(11)
  B, T, S, H, G, K, V, U = 2, 14, 18, 4, 2, 5, 3, 4
  q, k, v = _randn(rng, (B, T, H, K)), _randn(rng, (B, S, G, K)), _randn(rng, (B, S, G, V))
  Gs = 1 if who == "one" else G
  ids = np.stack([[[rng.permutation(5)[:3] for _ in range(T)] for _ in range(Gs)] for _ in range(B)])
  ids[:, :, 2, 1] = -1
  idx = jnp.asarray(ids, jnp.int32)  # (B,Gs,T,3), slice 4 holds keys 16..19: 18, 19 past S
  kv_lengths = jnp.array([S, 9])
  mask = jax.jit(_mask, static_argnums=(1, 2, 3, 4, 5))(tokens.unit_tokens(idx, U), B, H, T, S, is_causal,
                                                        kv_lengths)
  cot = _randn(rng, (B, T, H, V))
  mine = lambda q, k, v: jnp.sum(tokens.attention(q, k, v, idx, scale=0.4, is_causal=is_causal,  # noqa: E731
                                                  kv_lengths=kv_lengths, unique=True, tile=4, unit=U) * cot)
  ref = lambda q, k, v: jnp.sum(_dense(q, k, v, mask, 0.4) * cot)  # noqa: E731
  (a, ga), (b, gb) = (jax.jit(jax.value_and_grad(f, (0, 1, 2)))(q, k, v) for f in (mine, ref))
  np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)
  for x, y in zip(ga, gb):
    np.testing.assert_allclose(x, y, rtol=2e-4, atol=2e-5)
