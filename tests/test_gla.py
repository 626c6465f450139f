"""gla (Gated Linear Attention) against a per-token loop written apart: values and gradients of the
chunked form (attn.apply), decoding token by token (the recurrent form), padding with kv_lengths
at mixed lengths; counts by hand; refusals by name. The kit runs on it in tests/test_contract.py.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attn
from attn import ConfigError, HeadConfig
from attn.variants import VARIANTS, cache, gla

# d_v != d_k, two value heads per query/key head, biases, T = 11 not a multiple of the chunk.
CFG = HeadConfig(d_model=20, num_heads=4, d_k=6, d_v=5, num_kv_heads=2, chunk=4)


def random_params(cfg, seed):
  p = attn.init("gla", jax.random.PRNGKey(seed), cfg)
  r = np.random.default_rng(seed)
  for n in ("norm", "b_g", "b_q", "b_k", "b_v", "b_o"):  # off their initial ones and zeros
    p[n] = jnp.asarray((n == "norm") + 0.3 * r.standard_normal(p[n].shape), jnp.float32)
  return p


def loop_layer(p, x, cfg, lengths=None):
  """The layer token by token: S ← diag(exp g_t)·S + k_t·v_tᵀ, o_t = S_tᵀ·q_t, a token at or past
  its example's length zeroed and leaving S as it was; then the gated norm and W^O."""
  B, T, D = x.shape
  H, G, K, V = cfg.num_heads, cfg.num_kv_heads, cfg.d_k, cfg.d_v
  valid = jnp.ones((B, T)) if lengths is None else (jnp.arange(T)[None] < jnp.asarray(lengths)[:, None])
  x = x * valid[..., None]
  lin = lambda w, b: jnp.einsum("btd,de->bte", x, w.reshape(D, -1)) + b.reshape(-1)
  q = lin(p["w_q"], p["b_q"]).reshape(B, T, G, K) / math.sqrt(K)
  k = lin(p["w_k"], p["b_k"]).reshape(B, T, G, K)
  v = lin(p["w_v"], p["b_v"]).reshape(B, T, H, V)
  z = lin(p["w_z"], jnp.zeros(H * V)).reshape(B, T, H, V)
  logit = jnp.einsum("btr,re->bte", x @ p["w_ga"], p["w_gb"].reshape(-1, H * K)) + p["b_g"].reshape(-1)
  g = -jnp.logaddexp(0.0, -logit.reshape(B, T, H, K)) / 16.0  # log σ
  k = jnp.repeat(k, H // G, axis=2)  # value head h reads query/key head h // (H/G)
  q = jnp.repeat(q, H // G, axis=2)
  S = jnp.zeros((B, H, K, V))
  outs = []
  for t in range(T):
    new = jnp.exp(g[:, t])[..., None] * S + k[:, t][..., None] * v[:, t][:, :, None]
    keep = valid[:, t][:, None, None, None]
    S = keep * new + (1 - keep) * S
    outs.append(jnp.einsum("bhkv,bhk->bhv", S, q[:, t]))
  o = jnp.stack(outs, 1)
  o = o / jnp.sqrt(jnp.mean(o * o, -1, keepdims=True) + gla.NORM_EPS) * p["norm"] * jax.nn.silu(z)
  return jnp.einsum("bthv,hvd->btd", o, p["w_o"]) + p["b_o"], S


def x_of(seed, B, T):
  return jnp.asarray(np.random.default_rng(seed).standard_normal((B, T, CFG.d_model)), jnp.float32)


@pytest.mark.slow  # the loop's gradient compiles slowly; test_chunked_form_with_padding_equals_the_loop is the fast sibling
def test_chunked_form_values_and_gradients_equal_the_loop():
  p, x = random_params(CFG, 1), x_of(1, 2, 11)
  want, _ = jax.jit(lambda p, x: loop_layer(p, x, CFG))(p, x)
  np.testing.assert_allclose(attn.apply("gla", p, x, cfg=CFG, is_causal=True), want, rtol=2e-5, atol=2e-5)
  ct = x_of(2, 2, 11)
  loss_loop = lambda p, x: jnp.sum(loop_layer(p, x, CFG)[0] * ct)
  loss_apply = lambda p, x: jnp.sum(attn.apply("gla", p, x, cfg=CFG, is_causal=True) * ct)
  g_want = jax.jit(jax.grad(loss_loop, argnums=(0, 1)))(p, x)
  g_got = jax.jit(jax.grad(loss_apply, argnums=(0, 1)))(p, x)
  for a, b in zip(jax.tree.leaves(g_got), jax.tree.leaves(g_want)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.slow  # 11 decoding steps; the chunked pass with padding is checked fast below
def test_padding_at_mixed_lengths_equals_the_loop_and_decoding_token_by_token():
  """kv_lengths 11, 6, 0 (a fully padded example): the chunked pass at the real tokens and the
  recurrent one (one token a step, cache.decode_step) equal the loop, and so does the state."""
  p, x = random_params(CFG, 3), x_of(3, 3, 11)
  lengths = jnp.array([11, 6, 0])
  want, S_want = jax.jit(lambda p, x: loop_layer(p, x, CFG, lengths))(p, x)
  full = attn.apply("gla", p, x, cfg=CFG, is_causal=True, kv_lengths=lengths)
  for b, n in enumerate((11, 6, 0)):
    np.testing.assert_allclose(full[b, :n], want[b, :n], rtol=2e-5, atol=2e-5)
  v = VARIANTS["gla"]
  _, S_chunked = gla.forward(p, x, None, cfg=CFG, opts=attn.api.Options(is_causal=True,
                                                                        kv_lengths=lengths))
  np.testing.assert_allclose(S_chunked["ssm"], S_want, rtol=2e-5, atol=2e-5)
  state = cache.init(v, p, CFG, 1, 11)
  ys = []
  for t in range(11):  # example 0 alone, its tokens one at a time: the recurrent form
    y, state = cache.decode_step(v, p, x[:1, t:t + 1], state, t, cfg=CFG)
    ys.append(y)
  np.testing.assert_allclose(jnp.concatenate(ys, 1)[0], want[0], rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(state["ssm"][0], S_want[0], rtol=2e-5, atol=2e-5)


def test_chunked_form_with_padding_equals_the_loop():
  p, x = random_params(CFG, 4), x_of(4, 3, 7)
  lengths = jnp.array([7, 5, 0])
  want, _ = jax.jit(lambda p, x: loop_layer(p, x, CFG, lengths))(p, x)
  got = jax.jit(lambda p, x: attn.apply("gla", p, x, cfg=CFG, is_causal=True, kv_lengths=lengths))(p, x)
  for b, n in enumerate((7, 5, 0)):
    np.testing.assert_allclose(got[b, :n], want[b, :n], rtol=2e-5, atol=2e-5)


def test_counts_by_hand():
  D, H, G, K, V, R = 20, 4, 2, 6, 5, 16
  want = D * (2 * G * K + 2 * H * V) + D * R + R * H * K + H * K + V + H * V * D + (2 * G * K + H * V + D)
  assert want == 2477
  assert VARIANTS["gla"].param_count(CFG) == want
  size = lambda cfg: sum(math.prod(a.shape) for a in jax.eval_shape(  # shapes only: no initialiser compiled
      lambda: attn.init("gla", jax.random.PRNGKey(0), cfg)).values())
  assert size(CFG) == want
  assert VARIANTS["gla"].state_size(CFG) == H * K * V and VARIANTS["gla"].kv_cache_width(CFG) == 0
  small = CFG.replace(d_model=8)  # the decay's rank is at most d_model
  assert VARIANTS["gla"].param_count(small) == size(small)


@pytest.mark.parametrize("change, field", [
    (dict(num_kv_heads=3), "num_kv_heads"), (dict(chunk=0), "chunk"), (dict(sinks=True), "sinks"),
    (dict(window=2), "window"), (dict(rope_dim=2), "rope_dim")])
def test_bad_config_refused_by_name(change, field):
  with pytest.raises(ConfigError, match=f"{field}=.* is not allowed"):
    attn.api.check_config("gla", CFG.replace(**change))


def test_bad_call_refused_by_name():
  p = attn.init("gla", jax.random.PRNGKey(0), CFG)
  with pytest.raises(ConfigError, match="is_causal=False is not allowed"):
    attn.apply("gla", p, jnp.ones((1, 4, 20)), cfg=CFG)
