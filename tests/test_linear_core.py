"""The linear-attention core (attn.variants.linear.core) against a per-token loop written here.

naive() below is the recurrence as the papers write it, one token at a time in a Python loop
(Gated DeltaNet, Yang et al. 2024, eq. 10; Kimi Linear's KDA with a decay per key channel;
Mamba-2's SSD and causal linear attention without the delta rule), with grouped value heads by
repeating each query/key head and padding by holding an example's state past its length. The
chunked and recurrent forms must give its outputs, final states and gradients to float32
round-off, at lengths that are not a multiple of the chunk, with d_v ≠ d_k, G < H and batches of
different lengths.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn import ConfigError
from attn.variants.linear import core


def naive(q, k, v, g, beta, delta, state=None, lengths=None):
  """(o (B,T,H,V), S (B,H,K,V)): the per-token recurrence, token by token, every example and head at once."""
  B, T, G, K = q.shape
  H, V = v.shape[2:]
  q, k = (jnp.repeat(a, H // G, axis=2) for a in (q, k))  # value head h reads query/key head h // (H/G)
  S = jnp.zeros((B, H, K, V)) if state is None else state
  n = np.full(B, T) if lengths is None else np.asarray(lengths)
  o = []
  for t in range(T):
    decay = jnp.ones((B, H, 1)) if g is None else jnp.exp(g[:, t] if g.ndim == 4 else g[:, t, :, None])  # (B, H, K or 1)
    S_t = decay[..., None] * S
    kt = k[:, t]
    bt = 1.0 if beta is None else beta[:, t, :, None]
    written = v[:, t] - jnp.einsum("BHK,BHKV->BHV", kt, S_t) if delta else v[:, t]
    S_t = S_t + jnp.einsum("BHK,BHV->BHKV", kt, bt * written)
    S = jnp.where(jnp.asarray(t < n)[:, None, None, None], S_t, S)  # past its length an example keeps its state
    o.append(jnp.einsum("BHK,BHKV->BHV", q[:, t], S))
  return jnp.stack(o, 1), S


def inputs(seed, B=2, T=11, G=2, H=4, K=3, V=5, per_channel=False, decay=True):
  r = np.random.default_rng(seed)
  f = lambda *s: jnp.asarray(r.standard_normal(s).astype(np.float32))
  q, k, v = f(B, T, G, K), f(B, T, G, K), f(B, T, H, V)
  k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)  # the delta rule is stable for |β·k|² < 2
  g = None
  if decay:
    shape = (B, T, H, K) if per_channel else (B, T, H)
    g = -jnp.asarray(r.uniform(0.01, 1.5, shape).astype(np.float32))
  beta = jnp.asarray(r.uniform(0.1, 1.0, (B, T, H)).astype(np.float32))
  state = f(B, H, K, V)
  return q, k, v, g, beta, state


# (delta rule, decay per key channel, decay at all): Gated DeltaNet, KDA, SSD/GLA, linear.
KINDS = {"gated_delta": (True, False, True), "kda": (True, True, True),
         "ssd": (False, False, True), "gla": (False, True, True), "linear": (False, False, False)}


# At chunk 4 (11 tokens: not a multiple of it) the fast tier runs kda (the delta rule, a decay per
# key channel), ssd (no delta rule, one decay per head) and linear (no decay); gated_delta (the delta
# rule, one decay per head: also test_clip_and_neg_eigval's chunked rule against a float64 recurrence,
# and gated_deltanet's kit in test_contract) and gla (a decay per channel without the delta rule: also
# test_gla) in the slow tier, with chunks of 1 and past T. The recurrent form takes no chunk: checked
# once per kind, at chunk 4.
FAST_KINDS = ("kda", "linear", "ssd")


@pytest.mark.parametrize("kind, chunk", [
    pytest.param(kind, c, marks=() if c == 4 and kind in FAST_KINDS else pytest.mark.slow, id=f"{c}-{kind}")
    for c in (1, 4, 16) for kind in KINDS])
def test_chunked_and_recurrent_equal_the_loop(kind, chunk):
  delta, per_channel, decay = KINDS[kind]
  q, k, v, g, beta, state = inputs(hash((kind, chunk)) % 1000, per_channel=per_channel, decay=decay)
  lengths = jnp.array([11, 6])
  want_o, want_S = naive(q, k, v, g, beta, delta, state, lengths)
  kw = dict(g=g, beta_BTH=beta, delta=delta, state_BHKV=state, kv_lengths=lengths)
  forms = jax.jit(lambda *a: [core.chunked(*a, chunk=chunk, **kw)]
                  + ([core.recurrent(*a, **kw)] if chunk == 4 else []))  # one program
  for o, S in forms(q, k, v):
    np.testing.assert_allclose(o, want_o, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(S, want_S, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["gated_delta", "kda", "ssd"])
@pytest.mark.slow
def test_gradients_agree(kind):
  """∂ of a random projection of (o, S) by q, k, v, g, β and the initial state: all three forms."""
  delta, per_channel, _ = KINDS[kind]
  q, k, v, g, beta, state = inputs(7, B=2, T=7, G=1, H=2, K=3, V=2, per_channel=per_channel)
  lengths = jnp.array([7, 4])
  r = np.random.default_rng(1)
  wo, ws = (jnp.asarray(r.standard_normal(s).astype(np.float32)) for s in ((2, 7, 2, 2), (2, 2, 3, 2)))

  def loss(form):
    def f(q, k, v, g, beta, state):
      if form == "naive":
        o, S = naive(q, k, v, g, beta, delta, state, lengths)
      else:
        extra = {"chunk": 3} if form == "chunked" else {}
        o, S = getattr(core, form)(q, k, v, g=g, beta_BTH=beta, delta=delta, state_BHKV=state,
                                   kv_lengths=lengths, **extra)
      return (o * wo).sum() + (S * ws).sum()
    return jax.grad(f, argnums=tuple(range(6)))(q, k, v, g, beta, state)

  want = loss("naive")
  for form in ("chunked", "recurrent"):
    for got, ref in zip(jax.jit(lambda: loss(form))(), want):
      np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-4)


def test_strong_decay_stays_finite():
  """A chunk whose decays sum far below float32's exp range (−100 a token) is still exact."""
  q, k, v, g, beta, _ = inputs(3, T=9, per_channel=True)
  g = g * 100.0
  o, S = jax.jit(lambda *a: core.chunked(*a[:3], g=a[3], beta_BTH=a[4], delta=True, chunk=9))(q, k, v, g, beta)
  want_o, want_S = naive(q, k, v, g, beta, True)
  assert np.all(np.isfinite(o)) and np.all(np.isfinite(S))
  np.testing.assert_allclose(o, want_o, rtol=1e-4, atol=1e-5)


def test_chunks_continue_from_a_state():
  """Two calls, the second from the first's state, equal one call over the whole sequence."""
  q, k, v, g, beta, _ = inputs(5, T=10)
  kw = dict(delta=True, chunk=4)

  @jax.jit  # the three calls in one program
  def calls(q, k, v, g, beta):
    whole = core.chunked(q, k, v, g=g, beta_BTH=beta, **kw)
    o1, S1 = core.chunked(q[:, :3], k[:, :3], v[:, :3], g=g[:, :3], beta_BTH=beta[:, :3], **kw)
    return whole, o1, core.recurrent(q[:, 3:], k[:, 3:], v[:, 3:], g=g[:, 3:], beta_BTH=beta[:, 3:],
                                     delta=True, state_BHKV=S1)

  (o, S), o1, (o2, S2) = calls(q, k, v, g, beta)
  np.testing.assert_allclose(jnp.concatenate([o1, o2], 1), o, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(S2, S, rtol=1e-5, atol=1e-5)


def test_bfloat16_inputs_accumulate_in_float32():
  q, k, v, g, beta, _ = inputs(9, T=12)
  bf = lambda a: a.astype(jnp.bfloat16)
  o, S = jax.jit(lambda *a: core.chunked(*a[:3], g=a[3], beta_BTH=a[4], delta=True, chunk=5))(
      bf(q), bf(k), bf(v), g, beta)
  want, _ = naive(*(bf(a).astype(jnp.float32) for a in (q, k, v)), g, beta, True)
  assert o.dtype == jnp.float32 and S.dtype == jnp.float32
  np.testing.assert_allclose(o, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("chunk", [0, -2, 2.5, True])
def test_bad_chunk_refused_by_name(chunk):
  q, k, v, *_ = inputs(0, T=3)
  with pytest.raises(ConfigError, match=r"chunk=.* is not allowed: a positive integer"):
    core.chunked(q, k, v, chunk=chunk)


def test_value_heads_not_a_multiple_refused():
  q, k, v, *_ = inputs(0, T=3, G=2, H=3)
  with pytest.raises(ConfigError, match="a multiple of G=2"):
    core.chunked(q, k, v)
