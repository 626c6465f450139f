"""RoPE layouts (half, interleaved) at partial widths, and YaRN: against numpy and transformers.

The rotation is checked against complex multiplication written here, for both
pairings and a rotary width below d_k; YaRN's frequencies against a loop over
the paper's three bands written here and, when installed, against
transformers' own _compute_yarn_parameters and rotary modules.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attn
from attn import ConfigError, HeadConfig
from attn.variants import rope
from conftest import randn

YARN = dict(rope_scaling="yarn", rope_factor=4.0, rope_original_max_len=64, rope_beta_fast=16.0,
            rope_beta_slow=2.0)


def numpy_rotate(x, pos, rope_dim, omega, layout, factor=1.0):
  """Pairs (i, i + r/2) or (2i, 2i + 1) as complex numbers times factor·e^{i·p·ω_i}; the rest kept."""
  x = np.asarray(x, np.float64)
  half = rope_dim // 2
  first, second = (np.arange(half), np.arange(half) + half) if layout == "half" else \
      (np.arange(0, rope_dim, 2), np.arange(1, rope_dim, 2))
  turn = factor * np.exp(1j * np.asarray(pos, np.float64)[:, None] * omega)[None, :, None]
  z = (x[..., first] + 1j * x[..., second]) * turn
  out = x.copy()
  out[..., first], out[..., second] = z.real, z.imag
  return out


rotate = jax.jit(rope.rotate, static_argnums=2)  # one compile per config, not op by op


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_partial_rotation_in_both_layouts_against_numpy(layout):
  """d_k = 7 with 4 rotated dims: the pairs turn, the other 3 dims are position-free."""
  rng = np.random.default_rng(0)
  x = rng.standard_normal((2, 5, 3, 7)).astype(np.float32)
  pos = rng.integers(0, 300, 5)
  cfg = HeadConfig(d_model=7, num_heads=1, rope_dim=4, rope_theta=30.0, rope_layout=layout, **YARN)
  got = np.asarray(rotate(jnp.asarray(x), jnp.asarray(pos), cfg))
  want = numpy_rotate(x, pos, 4, rope.frequencies(cfg), layout, rope.attention_factor(cfg))
  np.testing.assert_allclose(got, want, atol=3e-5)
  np.testing.assert_array_equal(got[..., 4:], x[..., 4:])


def test_layout_none_turns_nothing():
  """rope_layout "none" (Kimi Linear's MLA): every ω_i is 0, rotate gives x back bit for bit, and
  R(δ) is the identity at every offset."""
  cfg = HeadConfig(d_model=12, num_heads=2, d_k=10, rope_dim=6, rope_theta=50.0, rope_layout="none")
  x = randn(3, (2, 4, 2, 10))
  np.testing.assert_array_equal(rope.frequencies(cfg), np.zeros(3))
  np.testing.assert_array_equal(rotate(x, jnp.array([0, 5, 9, 300]), cfg), x)
  np.testing.assert_array_equal(rope.rotation_matrices([0, 7, -40], cfg), np.tile(np.eye(10), (3, 1, 1)))


def test_interleaved_is_half_on_permuted_dims_and_scores_depend_on_offsets():
  """interleaved(x) = P⁻¹ half(P x) with P the de-interleaving permutation; q·k reads only t − s."""
  cfg = HeadConfig(d_model=12, num_heads=2, d_k=10, rope_dim=6, rope_theta=50.0)
  inter = cfg.replace(rope_layout="interleaved")
  perm = np.r_[0:6:2, 1:6:2, 6:10]
  x = randn(0, (1, 4, 2, 10))
  pos = jnp.array([3, 7, 11, 40])
  np.testing.assert_allclose(rotate(x, pos, inter)[..., perm], rotate(x[..., perm], pos, cfg),
                             atol=1e-5)
  q, k = randn(1, (1, 1, 10)), randn(2, (1, 1, 10))
  for layout in (cfg, inter):
    s1 = jnp.sum(rotate(q, jnp.array([9]), layout) * rotate(k, jnp.array([4]), layout))
    s2 = jnp.sum(rotate(q, jnp.array([105]), layout) * rotate(k, jnp.array([100]), layout))
    np.testing.assert_allclose(s1, s2, rtol=1e-4)
  R = rope.rotation_matrices([5], inter)[0]
  np.testing.assert_allclose(np.asarray(q[0]) @ R, rotate(q, jnp.array([5]), inter)[0], atol=1e-5)


def paper_yarn(theta, r, factor, L, alpha, beta, truncate):
  """YaRN pair by pair (Peng et al. 2023, eq. 17-18 with transformers' dim-space ramp)."""
  def dim(turns):
    return r * math.log(L / (turns * 2 * math.pi)) / (2 * math.log(theta))
  lo, hi = dim(beta), dim(alpha)
  if truncate:
    lo, hi = math.floor(lo), math.ceil(hi)
  lo, hi = max(lo, 0), min(hi, r - 1)
  out = []
  for i in range(r // 2):
    w = theta ** (-2 * i / r)
    ramp = min(max((i - lo) / (hi - lo if hi != lo else 0.001), 0.0), 1.0)  # 0: kept, 1: divided
    out.append(w / factor if ramp == 1 else w if ramp == 0 else (1 - ramp) * w + ramp * w / factor)
  return np.array(out)


@pytest.mark.parametrize("truncate", [True, False])
def test_yarn_frequencies_against_the_paper_loop(truncate):
  cfg = HeadConfig(d_model=32, num_heads=1, rope_dim=32, rope_theta=500.0, rope_truncate=truncate, **YARN)
  want = paper_yarn(500.0, 32, 4.0, 64, 2.0, 16.0, truncate)
  np.testing.assert_allclose(rope.frequencies(cfg), want, rtol=1e-12)
  omega = rope.frequencies(HeadConfig(d_model=32, num_heads=1, rope_dim=32, rope_theta=500.0))
  kept, divided = np.isclose(want, omega), np.isclose(want, omega / 4)
  assert kept.any() and divided.any() and not (kept | divided).all()  # all three bands occur
  assert rope.attention_factor(cfg) == pytest.approx(0.1 * math.log(4.0) + 1)
  assert rope.attention_factor(cfg.replace(rope_attention_factor=0.7)) == 0.7


def test_yarn_scales_the_rotated_part_of_every_score():
  """An attention factor f multiplies the rotated part of q·k by f², leaves the rest; scaled layers decode."""
  cfg = HeadConfig(d_model=16, num_heads=2, d_k=8, rope_dim=4, rope_theta=100.0, **YARN)
  q, k = randn(3, (1, 1, 8)), randn(4, (1, 1, 8))
  @functools.partial(jax.jit, static_argnums=0)  # one program per config
  def score(c):  # the rotated part's, the rest's
    qk = rope.rotate(q, jnp.array([6]), c) * rope.rotate(k, jnp.array([2]), c)
    return jnp.sum(qk[..., :4]), jnp.sum(qk[..., 4:])
  one, two = cfg.replace(rope_attention_factor=1.0), cfg.replace(rope_attention_factor=2.0)
  (two_rotated, two_rest), (one_rotated, one_rest) = score(two), score(one)
  np.testing.assert_allclose(two_rotated, 4 * one_rotated, rtol=1e-5)
  np.testing.assert_allclose(two_rest, one_rest, rtol=1e-6)


@pytest.mark.parametrize("changes, match", [
    (dict(rope_dim=5), r"rope_dim=5 is not allowed: an even integer in \[0, d_k=8\]"),
    (dict(rope_dim=10), r"rope_dim=10 is not allowed: an even integer in \[0, d_k=8\]"),
    (dict(rope_layout="pairs"), r"rope_layout='pairs' is not allowed: one of \['half', 'interleaved', 'none'\]"),
    (dict(YARN, rope_layout="none"), r"rope_scaling='yarn' is not allowed: None with rope_layout='none'"),
    (dict(YARN, rope_factor=0.0), r"rope_factor=0.0 is not allowed: a positive finite number"),
    (dict(YARN, rope_factor=-2.0), r"rope_factor=-2.0 is not allowed: a positive finite number"),
    (dict(YARN, rope_attention_factor=0.0), r"rope_attention_factor=0.0 is not allowed"),
    (dict(YARN, rope_beta_slow=0.0), r"rope_beta_slow=0.0 is not allowed"),
    (dict(rope_scaling="linear", rope_factor=2.0, rope_beta_fast=8.0),
     r"rope_beta_fast=8.0 is not allowed: 32.0 when rope_scaling='linear': only rope_scaling 'yarn'"),
    (dict(rope_truncate=False), r"rope_truncate=False is not allowed: True when rope_scaling=None"),
    (dict(rope_scaling="longrope"), r"rope_scaling='longrope' is not allowed"),
])
def test_bad_rope_fields_are_named(changes, match):
  with pytest.raises(ConfigError, match=match):
    HeadConfig(**(dict(d_model=16, num_heads=2, rope_dim=4) | changes))


@pytest.mark.slow
@pytest.mark.parametrize("truncate, attention_factor, partial", [
    (True, None, 1.0), (False, 1.3, 0.5)])
def test_yarn_against_transformers(truncate, attention_factor, partial):
  """Frequencies, attention factor and the rotated q, k of transformers' Llama rotary path."""
  pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  if int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip("transformers 4 spells rope_scaling differently; the families' loader tests cover it")
  import torch
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
  from transformers.models.llama import modeling_llama
  params = {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "original_max_position_embeddings": 64,
            "beta_fast": 16, "beta_slow": 2, "truncate": truncate, "partial_rotary_factor": partial}
  if attention_factor is not None:
    params["attention_factor"] = attention_factor
  c = transformers.LlamaConfig(hidden_size=24, num_attention_heads=2, head_dim=12, max_position_embeddings=256,
                               rope_parameters=params)
  inv_freq, scale = ROPE_INIT_FUNCTIONS["yarn"](c, "cpu")
  r = int(12 * partial)
  cfg = HeadConfig(d_model=24, num_heads=2, d_k=12, rope_dim=r, rope_theta=500.0, rope_truncate=truncate,
                   rope_attention_factor=attention_factor, **YARN)
  np.testing.assert_allclose(rope.frequencies(cfg), inv_freq.numpy(), rtol=1e-6)
  assert rope.attention_factor(cfg) == pytest.approx(scale)
  x = np.random.default_rng(5).standard_normal((1, 2, 6, 12)).astype(np.float32)  # (B, H, T, K)
  pos = torch.tensor([[0, 3, 17, 63, 64, 200]])
  cos, sin = modeling_llama.LlamaRotaryEmbedding(c)(torch.from_numpy(x), pos)
  xt = torch.from_numpy(x)
  q_rot, _ = modeling_llama.apply_rotary_pos_emb(xt[..., :r], xt[..., :r], cos, sin)
  want = torch.cat([q_rot, xt[..., r:]], dim=-1).numpy().transpose(0, 2, 1, 3)
  got = rope.rotate(jnp.asarray(x.transpose(0, 2, 1, 3)), jnp.asarray(pos[0].numpy()), cfg)
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.slow
def test_interleaved_against_deepseek():
  """DeepSeek-V3's apply_rotary_pos_emb_interleave returns the pairs de-interleaved: attn's, permuted."""
  pytest.importorskip("torch")
  pytest.importorskip("transformers")
  import torch
  from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds
  cfg = HeadConfig(d_model=16, num_heads=2, d_k=8, rope_dim=8, rope_theta=40.0, rope_layout="interleaved")
  x = np.random.default_rng(6).standard_normal((1, 2, 5, 8)).astype(np.float32)
  pos = np.array([0, 1, 4, 9, 30])
  angle = pos[:, None] * rope.frequencies(cfg)[None]
  emb = torch.from_numpy(np.concatenate([angle, angle], -1)[None].astype(np.float32))
  q, _ = ds.apply_rotary_pos_emb_interleave(torch.from_numpy(x), torch.from_numpy(x), emb.cos(), emb.sin())
  got = np.asarray(rope.rotate(jnp.asarray(x.transpose(0, 2, 1, 3)), jnp.asarray(pos), cfg))
  np.testing.assert_allclose(got[..., np.r_[0:8:2, 1:8:2]], q.numpy().transpose(0, 2, 1, 3), atol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["per_head", "mla"])
def test_variants_take_interleaved_yarn(variant):
  """A variant with interleaved yarn RoPE equals the half layout on de-interleaved weights.

  (A whole model with interleaved yarn decodes in the fast tier: test_layer_types.py.)
  """
  cfg = HeadConfig(d_model=16, num_heads=2, d_k=6, d_v=5, num_kv_heads=1, rope_dim=4, rope_theta=50.0,
                   **YARN)
  p = attn.init(variant, jax.random.PRNGKey(0), cfg.replace(rope_layout="interleaved"))
  x = randn(7, (2, 5, 16))
  y = attn.apply(variant, p, x, cfg=cfg.replace(rope_layout="interleaved"), is_causal=True)
  assert np.isfinite(np.asarray(y)).all()
  if variant == "per_head":
    perm = np.r_[0:4:2, 1:4:2, 4:6]
    q = {"w_q": p["w_q"][..., perm], "b_q": p["b_q"][..., perm], "w_k": p["w_k"][..., perm],
         "b_k": p["b_k"][..., perm]}
    np.testing.assert_allclose(attn.apply(variant, p | q, x, cfg=cfg, is_causal=True), y, atol=2e-5)
