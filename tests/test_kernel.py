"""The kernel against a naive second implementation, masks, numerics, transforms."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn import ConfigError, kernel, masks
from conftest import randn

SHAPES = [  # B, T, S, H, G, K, V
    (2, 5, 5, 4, 4, 8, 8),
    (1, 7, 3, 6, 2, 5, 9),   # cross-attention, grouped, d_v != d_k
    (3, 4, 11, 3, 1, 2, 4),  # multi-query
    (2, 1, 6, 2, 2, 3, 3),   # single query
]


def qkv(seed, B, T, S, H, G, K, V, dtype=jnp.float32):
  return (randn(seed, (B, T, H, K), dtype), randn(seed + 1, (B, S, G, K), dtype),
          randn(seed + 2, (B, S, G, V), dtype))


def random_mask(seed, B, H, T, S, p=0.6):
  return jax.random.bernoulli(jax.random.PRNGKey(seed), p, (B, H, T, S))


# The reference compiled whole: eagerly, each of its small ops compiles on its own.
reference = jax.jit(kernel.reference_attention)


# Jitted at the grouped cross-attention (d_v != d_k) and multi-query shapes; eager (op by op, slow to
# compile: the kernel runs eagerly in the fast tier in test_weights_are_a_distribution_and_blank_rows_are_zero
# and test_scale_and_logits_bias), the single query and the plain shape in the slow tier.
@pytest.mark.parametrize("shape, use_jit", [
    pytest.param(shape, use_jit, id=f"{use_jit}-shape{i}",
                 marks=pytest.mark.slow if not use_jit or i in (0, 3) else ())
    for use_jit in (False, True) for i, shape in enumerate(SHAPES)])
def test_matches_reference(shape, use_jit):
  B, T, S, H, G, K, V = shape
  q, k, v = qkv(0, *shape)
  mask = random_mask(3, B, H, T, S)
  mask = mask.at[:, :, 0].set(False)  # blank a whole row of every head
  ms = (None, mask, mask[:, :1], masks.causal_mask(T, S) if T <= S else None)
  if use_jit:  # every mask's kernel and reference in one program: one compile, not eight
    got, want = jax.jit(lambda q, k, v, ms: ([kernel.attention(q, k, v, m) for m in ms],
                                             [kernel.reference_attention(q, k, v, m) for m in ms]))(q, k, v, ms)
  else:
    got, want = [kernel.attention(q, k, v, m) for m in ms], [reference(q, k, v, m) for m in ms]
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("impl", ["einsum", "blocked"])
def test_a_one_head_key_shared_by_every_kv_head_equals_it_broadcast(impl):
  # merged's raw context and collaborative's shared key: k (B,S,1,K) against v (B,S,G,V).
  B, T, S, H, G, K, V = 2, 7, 9, 6, 3, 5, 4
  q, k, v = qkv(11, B, T, S, H, 1, K, V)
  v = randn(14, (B, S, G, V))
  mask = random_mask(12, B, H, T, S).at[:, :, 2].set(False)  # a blank row in every head
  k_wide = jnp.broadcast_to(k, (B, S, G, K))
  def f(k):  # the output, its sum of squares and their gradients: one program
    def loss(q, k, v):
      y = kernel.attention(q, k, v, mask, impl=impl, block_q=4, block_k=4)
      return (y ** 2).sum(), y
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  ((got, y), (dq, dk, dv)), ((want, _), (dq_w, dk_w, dv_w)) = f(k), f(k_wide)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  np.testing.assert_allclose(y, reference(q, k, v, mask), atol=2e-6, rtol=1e-5)
  for a, b in ((dq, dq_w), (dk, dk_w.sum(2, keepdims=True)), (dv, dv_w)):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)


def test_weights_are_a_distribution_and_blank_rows_are_zero():
  B, T, S, H, G, K, V = SHAPES[1]
  q, k, v = qkv(1, *SHAPES[1])
  mask = random_mask(5, B, H, T, S).at[:, 2:4, 1].set(False)
  out, w = kernel.attention(q, k, v, mask, return_weights=True)
  assert w.shape == (B, H, T, S) and w.dtype == jnp.float32
  row_sums = w.sum(-1)
  has_key = mask.any(-1)
  np.testing.assert_allclose(row_sums, has_key.astype(jnp.float32), atol=1e-6)
  assert not np.any(np.asarray(w)[~np.asarray(mask)])
  blank = ~np.asarray(has_key).transpose(0, 2, 1)  # (B,T,H)
  assert np.all(np.asarray(out)[blank] == 0.0)


def test_fully_masked_rows_have_finite_gradients():
  shape = SHAPES[0]
  B, T, S, H, G, K, V = shape
  q, k, v = qkv(2, *shape)
  mask = jnp.zeros((B, H, T, S), bool).at[:, :, 1:].set(True)
  grads = jax.jit(jax.grad(lambda q, k, v: kernel.attention(q, k, v, mask).sum(),
                           argnums=(0, 1, 2)))(q, k, v)
  for g in grads:
    assert np.all(np.isfinite(np.asarray(g)))
  assert np.all(np.asarray(grads[0])[:, 0] == 0)  # the blank query gets no gradient


def test_gradients_match_reference():
  shape = SHAPES[1]
  B, T, S, H, G, K, V = shape
  q, k, v = qkv(4, *shape)
  mask = random_mask(9, B, H, T, S)
  g = lambda fn: jax.grad(lambda q, k, v: (fn(q, k, v, mask) ** 2).sum(), argnums=(0, 1, 2))
  got, want = jax.jit(lambda q, k, v: (g(kernel.attention)(q, k, v),  # both in one program
                                       g(kernel.reference_attention)(q, k, v)))(q, k, v)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)


def test_vmap_over_batch_equals_batched_call():
  B, T, S, H, G, K, V = SHAPES[2]
  q, k, v = qkv(6, *SHAPES[2])
  one = lambda q, k, v: kernel.attention(q[None], k[None], v[None])[0]
  np.testing.assert_allclose(jax.jit(jax.vmap(one))(q, k, v), jax.jit(kernel.attention)(q, k, v),
                             atol=1e-6)


def test_bf16_inputs_softmax_in_float32():
  shape = SHAPES[1]
  q, k, v = qkv(7, *shape, dtype=jnp.bfloat16)
  out, w = kernel.attention(q, k, v, return_weights=True)
  assert out.dtype == jnp.bfloat16 and w.dtype == jnp.float32
  ref = reference(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32))
  np.testing.assert_allclose(out.astype(jnp.float32), ref, atol=5e-2, rtol=5e-2)
  # Large logits that would overflow a bf16 softmax stay finite.
  out = kernel.attention(q * 60, k * 60, v)
  assert np.all(np.isfinite(np.asarray(out.astype(jnp.float32))))


def test_scale_and_logits_bias():
  B, T, S, H, G, K, V = SHAPES[0]
  q, k, v = qkv(8, *SHAPES[0])
  bias = randn(11, (B, H, 1, S))
  # A bias of c·(q·k) equals rescaling the scores: two routes to the same logits.
  logits = kernel.scores(q, k)
  via_bias = kernel.attention(q, k, v, scale=0.5, logits_bias=logits * 0.25)
  np.testing.assert_allclose(via_bias, kernel.attention(q, k, v, scale=0.75), atol=1e-5)
  with_bias = kernel.attention(q, k, v, logits_bias=bias)
  manual = kernel.weighted_sum(jax.nn.softmax(logits / np.sqrt(K) + bias, -1), v)
  np.testing.assert_allclose(with_bias, manual, atol=1e-6)


def test_mask_helpers_match_numpy():
  T, S = 4, 6
  m = np.asarray(masks.causal_mask(T, S))[0, 0]
  expected = np.array([[s <= t + (S - T) for s in range(S)] for t in range(T)])
  np.testing.assert_array_equal(m, expected)
  np.testing.assert_array_equal(np.asarray(masks.causal_mask(3))[0, 0], np.tril(np.ones((3, 3), bool)))
  lengths = np.array([2, 6, 0])
  pm = np.asarray(masks.padding_mask(lengths, S))
  assert pm.shape == (3, 1, 1, S)
  np.testing.assert_array_equal(pm[:, 0, 0], np.arange(S)[None] < lengths[:, None])
  both = np.asarray(masks.padding_mask(lengths, S, q_lengths=np.array([1, 4, 2]), T=T))
  assert both.shape == (3, 1, T, S) and not both[0, 0, 1:].any()
  combined = np.asarray(masks.combine_masks(masks.causal_mask(S), None, masks.padding_mask(lengths, S)))
  np.testing.assert_array_equal(combined, np.asarray(masks.causal_mask(S)) & pm)
  assert masks.combine_masks(None, None) is None


@pytest.mark.parametrize("bad, match", [
    (lambda q, k, v: (q, k[:, :, :, :-1], v, None), "k.shape"),
    (lambda q, k, v: (q, k[:, :, :3], v[:, :, :3], None), r"k.shape\[2\]"),
    (lambda q, k, v: (q, k, v[:, :-1], None), "v.shape"),
    (lambda q, k, v: (q[0], k, v, None), "q.shape"),
    (lambda q, k, v: (q, k, v, jnp.ones((2, 4, 5, 5))), "mask.dtype"),
    (lambda q, k, v: (q, k, v, jnp.ones((2, 3, 5, 5), bool)), "mask.shape"),
])
def test_bad_shapes_are_clear_errors(bad, match):
  q, k, v = qkv(0, *SHAPES[0])
  q, k, v, m = bad(q, k, v)
  with pytest.raises(ConfigError, match=match):
    kernel.attention(q, k, v, m)


def test_mask_helper_errors():
  with pytest.raises(ConfigError, match="T=0"):
    masks.causal_mask(0)
  with pytest.raises(ConfigError, match="kv_lengths.shape"):
    masks.padding_mask(np.ones((2, 2)), 4)
  with pytest.raises(ConfigError, match="T=None"):
    masks.padding_mask(np.ones(2), 4, q_lengths=np.ones(2))
