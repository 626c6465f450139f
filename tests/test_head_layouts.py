"""2026's head layouts (issue 43): keys equal to values (k_eq_v) and the grouped low-rank output.

Each is checked against an independent reference (a numpy loop over heads, per_head after
conversion, numpy's own SVD and block matrices), at awkward shapes: G < H, h not dividing d_model,
d_v ≠ d_k where the layout allows it.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attn
from attn import api, count
from attn.config import ConfigError, HeadConfig
from attn.conversion import LossyConversionWarning, convert
from attn.count import measured
from attn.testing import check_variant
from conftest import jit_apply

KEQV = HeadConfig(d_model=20, num_heads=6, d_k=4, d_v=4, num_kv_heads=2, rope_dim=2, rope_theta=100.0)
GROUPED = HeadConfig(d_model=20, num_heads=6, d_k=5, d_v=3, num_kv_heads=2, o_groups=3, o_rank=2,
                     rope_dim=4, rope_theta=100.0)


def _params(variant, cfg, seed):
  rng = np.random.default_rng(seed)
  return {n: jnp.asarray(rng.standard_normal(s).astype(np.float32) * (0.5 if n.startswith("b") else
                                                                     1 / np.sqrt(s[0])))
          for n, s in api.param_shapes(variant, cfg).items()}


def _x(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


# Keys equal to values.

def _keqv_numpy(p, x, cfg, causal):
  """A literal loop over heads: kv_g = x·W_KV,g + b_kv,g is the key and, normalised or not, the value."""
  p = {n: np.asarray(a, np.float64) for n, a in p.items()}
  x = np.asarray(x, np.float64)
  B, T, _ = x.shape
  R = cfg.num_heads // cfg.num_kv_heads
  y = np.zeros((B, T, cfg.d_model)) + p.get("b_o", 0.0)
  for h in range(cfg.num_heads):
    g = h // R
    q = x @ p["w_q"][:, h] + (p["b_q"][h] if "b_q" in p else 0.0)
    kv = x @ p["w_kv"][:, g] + (p["b_kv"][g] if "b_kv" in p else 0.0)
    v = kv if cfg.value_norm_eps is None else kv / np.sqrt((kv ** 2).mean(-1, keepdims=True)
                                                           + cfg.value_norm_eps)
    s = np.einsum("btk,bsk->bts", q, kv) / np.sqrt(cfg.d_k)
    if causal:
      s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    y += np.einsum("bts,bsk->btk", w, v) @ p["w_o"][h]
  return y


@pytest.mark.parametrize("norm", [None, 1e-3])
def test_k_eq_v_equals_a_loop_over_heads(norm):
  cfg = KEQV.replace(rope_dim=0, value_norm_eps=norm)
  p, x = _params("k_eq_v", cfg, 0), _x(1, (2, 5, cfg.d_model))
  y = jit_apply("k_eq_v", p, x, cfg=cfg, is_causal=True)
  np.testing.assert_allclose(y, _keqv_numpy(p, x, cfg, True), rtol=1e-4, atol=1e-4)


def test_k_eq_v_value_norm_changes_the_layer():
  cfg = KEQV.replace(num_kv_heads=1, use_bias=False)
  p, x = _params("k_eq_v", cfg, 2), _x(3, (2, 6, cfg.d_model))
  y = jit_apply("k_eq_v", p, x, cfg=cfg)
  y_norm = jit_apply("k_eq_v", p, x, cfg=cfg.replace(value_norm_eps=1e-6))
  assert float(jnp.abs(y - y_norm).max()) > 1e-2


@pytest.mark.parametrize("dst", ["per_head", pytest.param("fused", marks=pytest.mark.slow)])  # fused: through per_head
def test_k_eq_v_converts_exactly_with_rope(dst):
  """Values are the un-rotated keys: per_head, which never rotates values, computes the same."""
  p, x = _params("k_eq_v", KEQV, 4), _x(5, (2, 7, KEQV.d_model))
  with warnings.catch_warnings():
    warnings.simplefilter("error", LossyConversionWarning)
    q, err = convert(p, "k_eq_v", dst, KEQV, return_error=True)
  assert err == 0.0
  pos = jnp.asarray(np.random.default_rng(6).integers(0, 40, (2, 7)))
  y = jit_apply("k_eq_v", p, x, cfg=KEQV, is_causal=True, positions=pos)
  np.testing.assert_allclose(jit_apply(dst, q, x, cfg=KEQV, is_causal=True, positions=pos), y,
                             rtol=1e-5, atol=1e-5)
  if dst == "per_head":
    np.testing.assert_array_equal(q["w_k"], p["w_kv"])
    np.testing.assert_array_equal(q["w_v"], p["w_kv"])


def test_value_norm_converts_exactly_to_per_head_which_equals_a_loop_over_heads():
  """Gemma 4's v_norm on every layer: per_head reads value_norm_eps too, so k_eq_v with it converts
  exactly (W_K = W_V = W_KV), and per_head's normed values equal the numpy loop's."""
  cfg = KEQV.replace(rope_dim=0, value_norm_eps=1e-3)
  p, x = _params("k_eq_v", cfg, 7), _x(8, (2, 5, cfg.d_model))
  q, err = convert(p, "k_eq_v", "per_head", cfg, return_error=True)
  assert err == 0.0
  y = jit_apply("per_head", q, x, cfg=cfg, is_causal=True)
  np.testing.assert_allclose(y, _keqv_numpy(p, x, cfg, True), rtol=1e-4, atol=1e-4)
  # With W_V apart from W_K the norm acts on per_head's own values (numpy loop with w_kv -> w_v for V).
  q2 = dict(q, w_v=q["w_v"] * 3.0 + 0.5)
  y2 = jit_apply("per_head", q2, x, cfg=cfg, is_causal=True)
  assert float(jnp.abs(y2 - jit_apply("per_head", q2, x, cfg=cfg.replace(value_norm_eps=None),
                                       is_causal=True)).max()) > 1e-2


@pytest.mark.slow
def test_per_head_with_the_value_norm_passes_the_kit():
  """Gemma 4's sliding layers: per_head with the value norm, QK-norm and a window, d_v ≠ d_k, G < H."""
  check_variant("per_head", configs=(KEQV.replace(d_v=3, value_norm_eps=1e-6, qk_norm=True, window=3,
                                                  use_bias=False),))


def test_k_eq_v_refusals_name_the_field():
  with pytest.raises(ConfigError, match="d_v=5"):
    attn.init("k_eq_v", jax.random.key(0), KEQV.replace(d_v=5))
  with pytest.raises(ConfigError, match="value_norm_eps=1e-06 is not allowed: None to convert k_eq_v to fused"):
    convert(_params("k_eq_v", KEQV, 0), "k_eq_v", "fused", KEQV.replace(value_norm_eps=1e-6))
  with pytest.raises(ConfigError, match="value_norm_eps=1e-06 is not allowed: None to convert per_head to merged"):
    convert(_params("per_head", KEQV, 0), "per_head", "merged", KEQV.replace(value_norm_eps=1e-6))
  with pytest.raises(ConfigError, match="value_norm_eps"):
    HeadConfig(d_model=8, num_heads=2, value_norm_eps=-1.0)


def test_k_eq_v_caches_one_tensor_per_kv_head():
  """K numbers per token per kv head: half of per_head's G·(K + V) at V = K, in counts and bytes."""
  cfg = KEQV
  G, K = cfg.num_kv_heads, cfg.d_k
  assert measured.kv_cache_width("k_eq_v", cfg) == G * K
  assert count.kv_cache_bytes_per_token("k_eq_v", cfg, "bfloat16") == 2 * G * K
  assert 2 * count.kv_cache_bytes_per_token("k_eq_v", cfg) == count.kv_cache_bytes_per_token("per_head", cfg)
  assert count.kv_cache_bytes("k_eq_v", cfg.replace(window=3), 10, "float32") == 3 * 4 * G * K
  v = api.get_variant("k_eq_v")
  assert v.param_count(cfg) == measured.stored("k_eq_v", cfg) == measured.stored("per_head", cfg) - (
      cfg.d_model * G * K + G * K)


FLOPS = HeadConfig(d_model=48, num_heads=4, d_k=12, d_v=12, num_kv_heads=2)  # the kit's, at d_v = d_k


@pytest.mark.parametrize("cfg", [FLOPS, FLOPS.replace(value_norm_eps=1e-6, use_bias=False, num_kv_heads=1)])
def test_k_eq_v_flops_match_xla(cfg):
  want, got = count.flops("k_eq_v", cfg, 4, 12), measured.flops("k_eq_v", cfg, 4, 12)
  assert abs(got - want) <= 0.1 * want, (want, got)


@pytest.mark.slow  # ~15 s: two configs, each through every property of the kit
def test_k_eq_v_kit():
  """The contract at d_v = d_k (the kit's own configs mostly have d_v ≠ d_k, which k_eq_v refuses):
  RoPE with G < H and h not dividing d_model, then the value norm with every mechanism and a window,
  whose ring decoding rotates the cached keys at the positions their slots hold. (Not sinks here:
  the kit's score-weight check at a given config counts a sink as moving the weights, while the sinks
  record declares 0 score weights; the fast mode below runs them.)"""
  check_variant("k_eq_v")
  check_variant("k_eq_v", configs=(
      KEQV,
      KEQV.replace(value_norm_eps=1e-6, num_kv_heads=1, use_bias=False, gate="headwise",
                   qk_norm=True, window=3, softcap=30.0)))


# The grouped low-rank output projection.

def test_grouped_output_is_blockdiag_times_b():
  """grouped_lowrank -> per_head: W^O = blockdiag(A_1..A_g)·B, built here with numpy's block matrix."""
  cfg = GROUPED
  p, x = _params("grouped_lowrank", cfg, 7), _x(8, (2, 5, cfg.d_model))
  q = convert(p, "grouped_lowrank", "per_head", cfg)
  a = np.asarray(p["w_oa"], np.float64)
  g, N, r = a.shape
  block = np.zeros((g * N, g * r))
  for i in range(g):
    block[i * N:(i + 1) * N, i * r:(i + 1) * r] = a[i]
  w_o = (block @ np.asarray(p["w_ob"], np.float64)).reshape(cfg.num_heads, cfg.d_v, cfg.d_model)
  np.testing.assert_allclose(q["w_o"], w_o, rtol=1e-5, atol=1e-6)
  y = jit_apply("grouped_lowrank", p, x, cfg=cfg, is_causal=True)
  flat = api.config_for("per_head", cfg)  # the same layer with o_groups, o_rank unset (per_head refuses them)
  np.testing.assert_allclose(jit_apply("per_head", q, x, cfg=flat, is_causal=True), y, rtol=1e-5, atol=1e-5)


def test_per_head_to_grouped_is_exact_at_full_rank_and_for_low_rank_blocks():
  cfg = GROUPED
  flat = api.config_for("per_head", cfg)
  p, x = _params("per_head", flat, 9), _x(10, (2, 5, cfg.d_model))
  y = jit_apply("per_head", p, x, cfg=flat)
  full = cfg.replace(o_rank=cfg.num_heads // cfg.o_groups * cfg.d_v)  # 6 < d_model: any block fits
  with warnings.catch_warnings():
    warnings.simplefilter("error", LossyConversionWarning)
    q, err = convert(p, "per_head", "grouped_lowrank", full, return_error=True)
    assert err == 0.0
    np.testing.assert_allclose(jit_apply("grouped_lowrank", q, x, cfg=full), y, rtol=1e-5, atol=1e-5)
    # Blocks of rank ≤ o_rank, made as products here: the SVD keeps them whole.
    rng = np.random.default_rng(11)
    g, N, r = cfg.o_groups, cfg.num_heads // cfg.o_groups * cfg.d_v, cfg.o_rank
    blocks = np.einsum("gNr,grD->gND", rng.standard_normal((g, N, r)), rng.standard_normal((g, r, cfg.d_model)))
    p_low = p | {"w_o": jnp.asarray(blocks.reshape(cfg.num_heads, cfg.d_v, cfg.d_model), jnp.float32)}
    q, err = convert(p_low, "per_head", "grouped_lowrank", cfg, return_error=True)
    assert err < 1e-5
  np.testing.assert_allclose(jit_apply("grouped_lowrank", q, x, cfg=cfg),
                             jit_apply("per_head", p_low, x, cfg=flat), rtol=1e-4, atol=1e-4)


def test_per_head_to_grouped_is_lossy_below_rank_and_says_how_much():
  cfg = GROUPED
  p = _params("per_head", api.config_for("per_head", cfg), 12)
  with pytest.warns(LossyConversionWarning, match="lossy"):
    _, err = convert(p, "per_head", "grouped_lowrank", cfg, return_error=True)
  blocks = np.asarray(p["w_o"], np.float64).reshape(cfg.o_groups, -1, cfg.d_model)
  s = [np.linalg.svd(b, compute_uv=False) for b in blocks]
  want = np.sqrt(sum((si[cfg.o_rank:] ** 2).sum() for si in s) / sum((si ** 2).sum() for si in s))
  assert want > 0.1
  np.testing.assert_allclose(err, want, rtol=1e-4)


def test_grouped_refusals_name_the_field():
  with pytest.raises(ConfigError, match="o_groups=4"):
    GROUPED.replace(o_groups=4)
  # A field only another variant reads would be ignored: refused by name.
  with pytest.raises(ConfigError, match="o_groups=3 is not allowed: 1 for variant 'per_head'"):
    attn.init("per_head", jax.random.key(0), GROUPED)
  with pytest.raises(ConfigError, match=r"value_norm_eps=1e-06 is not allowed: it must be unset \(None\) for variant 'mla'"):
    attn.init("mla", jax.random.key(0), KEQV.replace(value_norm_eps=1e-6, rope_dim=0))
  with pytest.raises(ConfigError, match="o_rank=0"):
    GROUPED.replace(o_rank=0)


def test_grouped_counts():
  cfg = GROUPED
  D, H, G, K, V, g, r = 20, 6, 2, 5, 3, 3, 2
  assert api.get_variant("grouped_lowrank").param_count(cfg) == measured.stored("grouped_lowrank", cfg) == D * (H * K + G * K + G * V) + H * V * r + g * r * D + (
      H * K + G * K + G * V + D)
  assert count.kv_cache_bytes_per_token("grouped_lowrank", cfg, "float32") == 4 * G * (K + V)
  big = FLOPS.replace(d_v=20, o_groups=2, o_rank=7)
  want, got = count.flops("grouped_lowrank", big, 4, 12), measured.flops("grouped_lowrank", big, 4, 12)
  assert abs(got - want) <= 0.1 * want, (want, got)


@pytest.mark.slow  # ~20 s (test_contract runs the fast kit on both, in the slow tier too)
def test_grouped_kit():
  """The contract with groups and a rank below full: RoPE, G < H, h ∤ d_model, d_v ≠ d_k; then every
  mechanism and a window (ring decoding)."""
  check_variant("grouped_lowrank", configs=(
      GROUPED,
      GROUPED.replace(num_kv_heads=1, use_bias=False, o_groups=2, o_rank=5, gate="elementwise",
                      qk_norm=True, window=3)))


# Effective counts: the closed forms against the Jacobian's rank (attn.count.measured), where they hold.

@pytest.mark.parametrize("variant, cfg", [  # k_eq_v with and without biases fast; the MQA case slow
    pytest.param("k_eq_v", HeadConfig(d_model=6, num_heads=3, d_k=2, d_v=2, num_kv_heads=1),
                 marks=pytest.mark.slow),
    ("k_eq_v", HeadConfig(d_model=5, num_heads=4, d_k=2, d_v=2, num_kv_heads=2)),
    ("k_eq_v", HeadConfig(d_model=6, num_heads=2, d_k=3, d_v=3, num_kv_heads=2, use_bias=False)),
    ("grouped_lowrank", HeadConfig(d_model=6, num_heads=4, d_k=2, d_v=1, num_kv_heads=2, o_groups=2,
                                   o_rank=2, use_bias=False)),
])
def test_effective_count_is_the_jacobians_rank(variant, cfg):
  declared = api.get_variant(variant).effective_param_count(cfg)
  assert declared is not None and declared < measured.stored(variant, cfg)
  assert declared == measured.jacobian_rank(variant, cfg)


def test_effective_count_is_measured_where_no_closed_form_holds():
  assert api.get_variant("k_eq_v").effective_param_count(KEQV) is None  # RoPE
  assert api.get_variant("grouped_lowrank").effective_param_count(GROUPED) is None  # o_rank below full


def test_grouped_output_splits_by_whole_groups_over_a_heads_mesh():
  from attn.nn import sharding
  specs = sharding.param_specs("grouped_lowrank", GROUPED, 3)  # 3 devices, 3 groups of 2 heads
  assert specs["w_oa"] == sharding.PartitionSpec("heads", None, None)
  assert specs["w_ob"] == sharding.PartitionSpec("heads", None)
  specs = sharding.param_specs("grouped_lowrank", GROUPED, 2)  # 2 devices would split a group: A whole
  assert specs["w_oa"] == sharding.PartitionSpec(None, None, None)
