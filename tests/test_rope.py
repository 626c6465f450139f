"""RoPE at the head level: the rotation against numpy, positions, seed 004's fit, refusals, models.

The contract's offsets test (test_contract.py) and the exact converters under RoPE
(test_convert.py) cover every variant; this file checks the pieces against second
implementations written here.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attn
from attn import ConfigError, HeadConfig, count
from attn.nn import models
from attn.nn.config import ModelConfig
from attn.variants import rope
from conftest import ROPE_CONFIGS, fresh_params, randn


def numpy_rotate(x, pos, rope_dim, theta):
  """Half-split RoPE as complex multiplication: z_i = x_i + i·x_{i+r/2} times e^{i·p·θ^(-2i/r)}."""
  x = np.asarray(x, np.float64)
  half = rope_dim // 2
  omega = theta ** (-2.0 * np.arange(half) / rope_dim)
  pos = np.asarray(pos, np.float64)
  pos = pos[None] if pos.ndim == 1 else pos
  turn = np.exp(1j * pos[..., None] * omega)
  if x.ndim == 4:
    turn = turn[:, :, None]
  z = (x[..., :half] + 1j * x[..., half:rope_dim]) * turn
  return np.concatenate([z.real, z.imag, x[..., rope_dim:]], axis=-1)


@pytest.mark.parametrize("shape, rope_dim, per_example", [
    ((2, 3, 3, 7), 4, True), pytest.param((2, 5, 6), 6, False, marks=pytest.mark.slow)])
def test_rotate_is_complex_multiplication(shape, rope_dim, per_example):
  rng = np.random.default_rng(0)
  x = rng.standard_normal(shape).astype(np.float32)
  pos = rng.integers(-20, 500, shape[:2] if per_example else shape[1:2])
  cfg = HeadConfig(d_model=shape[-1], num_heads=1, rope_dim=rope_dim, rope_theta=50.0)
  got = jax.jit(rope.rotate, static_argnums=2)(jnp.asarray(x), jnp.asarray(pos), cfg)  # one program
  np.testing.assert_allclose(got, numpy_rotate(x, pos, rope_dim, 50.0), atol=2e-5)
  assert got.dtype == jnp.float32
  np.testing.assert_array_equal(got[..., rope_dim:], x[..., rope_dim:])


def test_per_head_with_rope_against_numpy_attention():
  """Self-attention with given positions and cross-attention with keys at 0..S−1, in float64."""
  cfg = ROPE_CONFIGS["rope_gqa"]
  p = fresh_params("per_head", cfg, 1)
  B, T, S = 2, 4, 6
  x, c = randn(2, (B, T, cfg.d_model)), randn(3, (B, S, cfg.d_model))
  pos = np.array([[5, 9, 2, 40], [0, 1, 2, 3]])
  f = jax.jit(lambda p, x, c, pos: attn.apply("per_head", p, x, c, cfg=cfg, positions=pos,
                                              return_weights=True))
  P = {k: np.asarray(a, np.float64) for k, a in p.items()}
  R = cfg.group_size
  for ctx, k_pos in ((None, pos), (c, np.arange(S))):
    _, w = f(p, x, ctx, jnp.asarray(pos))
    src = np.asarray(x if ctx is None else ctx, np.float64)
    q = np.einsum("BTD,DHK->BTHK", np.asarray(x, np.float64), P["w_q"]) + P["b_q"]
    k = np.einsum("BSD,DGK->BSGK", src, P["w_k"]) + P["b_k"]
    q = numpy_rotate(q, pos, cfg.rope_dim, cfg.rope_theta)
    k = numpy_rotate(k, np.broadcast_to(k_pos, src.shape[:2]), cfg.rope_dim, cfg.rope_theta)
    logits = np.einsum("BTHK,BSHK->BHTS", q, np.repeat(k, R, axis=2)) / np.sqrt(cfg.d_k)
    want = np.exp(logits - logits.max(-1, keepdims=True))
    np.testing.assert_allclose(w, want / want.sum(-1, keepdims=True), atol=2e-5)


def test_position_free_fit_is_the_least_squares_solution():
  """Against a brute-force fit: every causal pair's matrix from numpy rotations, lstsq of one W."""
  cfg = HeadConfig(d_model=5, num_heads=2, d_k=4, d_v=3, num_kv_heads=1, rope_dim=4,
                   rope_theta=3.0)
  rng = np.random.default_rng(4)
  w_q, w_k = rng.standard_normal((5, 2, 4)), rng.standard_normal((5, 1, 4))
  L = 6
  W, err = rope.position_free_fit(w_q, w_k, cfg, L)
  lost = total = 0.0
  rot = lambda m_DK, p: numpy_rotate(m_DK[None], np.full((1, len(m_DK)), p), 4, 3.0)[0]
  for h in range(2):
    # M(t, s)[i, j]: query e_i at t against key e_j at s, through rotated projections.
    mats = np.stack([rot(w_q[:, h], t) @ rot(w_k[:, 0], s).T
                     for t in range(L) for s in range(t + 1)])
    fit = np.linalg.lstsq(np.ones((len(mats), 1)), mats.reshape(len(mats), -1), rcond=None)[0]
    fit = fit.reshape(5, 5)
    np.testing.assert_allclose(W[h], fit, atol=1e-10)
    lost += ((mats - fit) ** 2).sum()
    total += (mats ** 2).sum()
  np.testing.assert_allclose(err, np.sqrt(lost / total), rtol=1e-10)
  assert 0.1 < err < 1.0
  _, none = rope.position_free_fit(w_q, w_k, cfg.replace(rope_dim=0), L)
  assert none == 0.0


@pytest.mark.parametrize("changes, field", [
    (dict(rope_dim=3), "rope_dim=3"), (dict(rope_dim=10), "rope_dim=10"),
    (dict(rope_dim=-2), "rope_dim=-2"), (dict(rope_theta=0.0), "rope_theta=0.0"),
    (dict(latent_dim=0), "latent_dim=0"), (dict(latent_dim=-4), "latent_dim=-4"),
    (dict(q_latent_dim=0), "q_latent_dim=0")])
def test_bad_rope_and_latent_fields_are_named(changes, field):
  with pytest.raises(ConfigError, match=re.escape(field) + " is not allowed"):
    HeadConfig(d_model=16, num_heads=2, d_k=8, **changes)


def test_bad_positions_are_refused_before_tracing():
  cfg = ROPE_CONFIGS["rope_mqa_nobias"]
  params = fresh_params("per_head", cfg)
  x = jnp.zeros((2, 3, cfg.d_model))
  for bad, field in ((jnp.arange(4), r"positions.shape=\(4,\)"),
                     (jnp.zeros((3, 3), jnp.int32), r"positions.shape=\(3, 3\)"),
                     (jnp.arange(3.0), "positions.dtype='float32'")):
    with pytest.raises(ConfigError, match=field):
      attn.apply("per_head", params, x, cfg=cfg, positions=bad)


def test_merging_is_refused_under_rope():
  cfg = ROPE_CONFIGS["rope_gqa"]
  p = fresh_params("per_head", cfg)
  with pytest.raises(ConfigError, match="rope_dim=4.*no position-free W_h exists"):
    attn.convert(p, "per_head", "merged", cfg)
  with pytest.raises(ConfigError, match="rope_dim=4.*collaborative"):
    attn.convert(p, "per_head", "collaborative", cfg)


def test_model_config_rope():
  small = dict(vocab_size=11, d_model=8, num_layers=1, num_heads=2, d_ff=8)
  with pytest.raises(ConfigError, match="rope_dim=0 is not allowed.*positional='rope'"):
    ModelConfig(**small, positional="rope")
  with pytest.raises(ConfigError, match="positional='learned' is not allowed.*'rope'"):
    ModelConfig(**small, rope_dim=2)
  cfg = ModelConfig(**small, positional="rope", rope_dim=2, rope_theta=500.0)
  assert cfg.head.rope_dim == 2 and cfg.head.rope_theta == 500.0
  model = nnx.eval_shape(lambda: models.DecoderLM(cfg, rngs=nnx.Rngs(0)))
  assert model.embed.position is None
  parts = count.model_param_breakdown(cfg, "decoder_lm")
  assert parts["position_embeddings"] == 0
  assert count.model_param_count(cfg, "decoder_lm") == sum(
      a.size for a in jax.tree.leaves(nnx.state(model, nnx.Param)))


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["fused", "mla"])
def test_rope_models_are_causal_and_know_positions(variant):
  """DecoderLM with positional='rope' and no position table: causal, and rotating in its layers."""
  cfg = ModelConfig(vocab_size=13, d_model=16, num_layers=2, num_heads=4, d_k=6, d_ff=24,
                           num_kv_heads=2, variant=variant, positional="rope", rope_dim=4,
                           rope_theta=100.0)
  model = models.DecoderLM(cfg, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, 13, (2, 7)))
  changed = tokens.at[:, 4:].set(jnp.asarray(rng.integers(0, 13, (2, 3))))
  a, b = model(tokens), model(changed)
  np.testing.assert_allclose(a[:, :4], b[:, :4], atol=1e-5)
  assert float(jnp.abs(a[:, 4:] - b[:, 4:]).max()) > 1e-4
  # The same weights (RoPE has none) with another rope_theta: position 0 (no offsets but 0)
  # agrees, later ones do not, so every layer rotates.
  other = models.DecoderLM(cfg.replace(rope_theta=7.0), rngs=nnx.Rngs(0))
  assert jax.tree.all(jax.tree.map(jnp.array_equal, nnx.state(model, nnx.Param),
                                   nnx.state(other, nnx.Param)))
  c = other(tokens)
  np.testing.assert_allclose(c[:, 0], a[:, 0], atol=1e-5)
  assert float(jnp.abs(c[:, 1:] - a[:, 1:]).max()) > 1e-4
