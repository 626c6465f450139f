"""attn.analysis: per-head circuits against numpy and the layers themselves; spectra and ranks."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attn
import attn.analysis as analysis
from attn import ConfigError, HeadConfig
from conftest import CONFIGS, fresh_params, randn, tier

B, T, S = 2, 4, 5
# Compiled once per (variant, cfg): eager mode would compile every small op on its own.
circuits = jax.jit(analysis.circuits, static_argnums=(0, 2))


# Grouped heads with d_v != d_k and biases; one kv head without biases.
AWKWARD = ("gqa", "mqa_nobias")


@functools.cache  # cases() runs twice at collection, in every xdist worker
def refusal(name, cfg):
  """The ConfigError of a variant without per-head circuits (Variant.circuits says why), or None."""
  shapes = {k: jax.ShapeDtypeStruct(s, jnp.float32)
            for k, s in attn.param_shapes(name, cfg).items()}
  try:
    jax.eval_shape(lambda p: analysis.circuits(name, p, cfg), shapes)
  except ConfigError as e:
    return e
  return None


def cases(with_circuits=True):
  """(variant, config name) for every registered variant and each AWKWARD config it accepts,
  with circuits (or, with_circuits=False, refusing them)."""
  out = []
  for name, variant in sorted(attn.VARIANTS.items()):
    for cname, cfg in sorted((c, CONFIGS[c]) for c in AWKWARD):
      try:
        variant.check(cfg)
      except ConfigError:
        continue
      if (refusal(name, cfg) is None) == with_circuits:
        out.append(pytest.param(name, cname, id=f"{name}-{cname}", marks=tier(name)))
  return out


def numpy_circuits(p, cfg):
  """Every term by a literal loop over query heads in float64, from the per_head layout."""
  p = {k: np.asarray(a, np.float64) for k, a in p.items()}
  H, D, R = cfg.num_heads, cfg.d_model, cfg.num_heads // cfg.num_kv_heads
  out = {k: np.zeros(s) for k, s in [("qk", (H, D, D)), ("ov", (H, D, D)), ("qk_key_bias", (H, D)),
                                     ("qk_query_bias", (H, D)), ("qk_const", (H,)),
                                     ("ov_bias", (H, D)), ("b_o", (D,))]}
  for h in range(H):
    g = h // R
    out["qk"][h] = p["w_q"][:, h] @ p["w_k"][:, g].T
    out["ov"][h] = p["w_v"][:, g] @ p["w_o"][h]
    if cfg.use_bias:
      out["qk_key_bias"][h] = p["w_k"][:, g] @ p["b_q"][h]
      out["qk_query_bias"][h] = p["w_q"][:, h] @ p["b_k"][g]
      out["qk_const"][h] = p["b_q"][h] @ p["b_k"][g]
      out["ov_bias"][h] = p["b_v"][g] @ p["w_o"][h]
      out["b_o"] = p["b_o"]
  return out


def assert_same(got, want, keys=None, tol=1e-5):
  for k in keys or want:
    scale = max(1.0, float(np.abs(want[k]).max()))
    np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), atol=tol * scale, err_msg=k)


def test_per_head_circuits_match_a_numpy_loop(cfg):
  params = fresh_params("per_head", cfg, seed=1)
  got = circuits("per_head", params, cfg)
  assert got["qk"].shape == got["ov"].shape == (cfg.num_heads, cfg.d_model, cfg.d_model)
  assert_same(got, numpy_circuits(params, cfg))


def test_grouped_heads_read_kv_head_h_div_R():
  cfg = HeadConfig(d_model=10, num_heads=6, d_k=3, d_v=4, num_kv_heads=2)
  p = {k: np.asarray(a, np.float64) for k, a in fresh_params("per_head", cfg, seed=2).items()}
  got = circuits("per_head", p, cfg)
  for h in range(6):
    right, wrong = h // 3, h % 2  # query heads 0,1,2 read kv head 0; 3,4,5 kv head 1
    np.testing.assert_allclose(got["qk"][h], p["w_q"][:, h] @ p["w_k"][:, right].T, atol=1e-5)
    np.testing.assert_allclose(got["ov"][h], p["w_v"][:, right] @ p["w_o"][h], atol=1e-5)
    if right != wrong:
      assert not np.allclose(got["qk"][h], p["w_q"][:, h] @ p["w_k"][:, wrong].T, atol=1e-2)


def test_split_input_circuits_sit_in_their_input_blocks():
  """qk[h] is nonzero only in rows of head h's slice of x and columns of kv head g(h)'s slice of c."""
  cfg = CONFIGS["gqa"]  # D = 24, H = 6 (slices of 4), G = 2 (slices of 12)
  params = fresh_params("split_input", cfg, seed=10)
  qk = np.array(circuits("split_input", params, cfg)["qk"])
  for h in range(6):
    rows, cols = slice(4 * h, 4 * h + 4), slice(12 * (h // 3), 12 * (h // 3) + 12)
    block = qk[h][rows, cols]
    np.testing.assert_allclose(block, np.asarray(params["w_q"][h] @ params["w_k"][h // 3].T),
                               atol=1e-5)
    qk[h][rows, cols] = 0.0
    assert not np.any(qk[h])


@pytest.mark.parametrize("cname", AWKWARD)
@pytest.mark.parametrize("dst", ["fused", "merged", "collaborative"])
def test_per_head_circuits_survive_exact_conversions(cname, dst):
  cfg = CONFIGS[cname]
  params = fresh_params("per_head", cfg, seed=3)
  want = circuits("per_head", params, cfg)
  got = circuits(dst, attn.convert(params, "per_head", dst, cfg), cfg)
  # merged keeps what moves the softmax: the key bias and b_q·b_k are gone.
  keys = ["qk", "ov", "qk_key_bias", "ov_bias", "b_o"] if dst == "merged" else None
  assert_same(got, want, keys)
  if dst == "merged":
    assert not np.any(np.asarray(got["qk_query_bias"])) and not np.any(np.asarray(got["qk_const"]))


@pytest.mark.parametrize("variant, cname", cases())
def test_circuits_rebuild_each_variants_weights_and_output(variant, cname):
  """In numpy: logits = scale·(x qk cᵀ + biases), y = Σ weights·(c ov + ov_bias) + b_o; vs apply."""
  cfg = CONFIGS[cname]
  params = fresh_params(variant, cfg, seed=4)
  x, c = randn(5, (B, T, cfg.d_model)), randn(6, (B, S, cfg.d_model))

  @jax.jit
  def run(params, x, c):  # one compilation per case
    y, w_BHTS = attn.apply(variant, params, x, c, cfg=cfg, return_weights=True)
    factors = analysis.circuit_factors(variant, params, cfg)
    spectra = {n: analysis.spectrum_of_product(a, b)["singular_values"]
               for n, (a, b) in factors.items()}
    return y, w_BHTS, analysis.circuits(variant, params, cfg), spectra

  y, w_BHTS, k, spectra = run(params, x, c)
  k = {n: np.asarray(a, np.float64) for n, a in k.items()}
  x, c = np.asarray(x, np.float64), np.asarray(c, np.float64)
  logits = (np.einsum("BTD,HDE,BSE->BHTS", x, k["qk"], c)
            + np.einsum("HE,BSE->BHS", k["qk_key_bias"], c)[:, :, None, :]
            + np.einsum("BTD,HD->BHT", x, k["qk_query_bias"])[..., None]
            + k["qk_const"][None, :, None, None]) * cfg.score_scale
  weights = np.exp(logits - logits.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  np.testing.assert_allclose(w_BHTS, weights, atol=2e-5)
  values_BHSD = np.einsum("BSD,HDE->BHSE", c, k["ov"]) + k["ov_bias"][None, :, None, :]
  want = np.einsum("BHTS,BHSE->BTE", weights, values_BHSD) + k["b_o"]
  np.testing.assert_allclose(y, want, atol=1e-4 * max(1.0, np.abs(want).max()))
  # The factors give the same singular values as the D×D circuits.
  for name, s in spectra.items():
    dense = np.linalg.svd(k[name], compute_uv=False)
    np.testing.assert_allclose(s, dense, atol=1e-4 * dense.max())


@pytest.mark.parametrize("variant, cname", cases(with_circuits=False))
def test_a_variant_without_circuits_says_why(variant, cname):
  """No fixed W_QK,h (differential: two softmaxes; tpa: token-dependent head factors): refused by name."""
  e = refusal(variant, CONFIGS[cname])
  assert f"variant={variant!r} is not allowed" in str(e) and "W_QK" in str(e)


def random_orthogonal(rng, n):
  q, r = np.linalg.qr(rng.standard_normal((n, n)))
  return q * np.sign(np.diag(r))


def test_effective_rank_of_r_equal_singular_values_is_r():
  rng = np.random.default_rng(7)
  D = 9
  stack = []
  for r in range(1, D + 1):
    s = np.r_[np.full(r, 3.0), np.zeros(D - r)]
    stack.append(random_orthogonal(rng, D) @ np.diag(s) @ random_orthogonal(rng, D))
  stack = np.asarray(stack, np.float32)
  got = jax.jit(analysis.spectrum)(stack)
  np.testing.assert_allclose(got["effective_rank"], np.arange(1, D + 1), rtol=1e-4)
  np.testing.assert_array_equal(got["rank"], np.arange(1, D + 1))
  effective_rank = jax.jit(analysis.effective_rank)  # one compile for the three (D, D) calls below
  np.testing.assert_allclose(effective_rank(stack[4]), 5.0, rtol=1e-4)  # one matrix
  # Unequal singular values: strictly between 1 and the rank; σ = (2, 1): exp(H(2/3, 1/3)).
  m = np.zeros((D, D), np.float32)
  m[0, 0], m[1, 1] = 2.0, 1.0
  p = np.array([2, 1]) / 3
  np.testing.assert_allclose(effective_rank(m), np.exp(-(p * np.log(p)).sum()), rtol=1e-5)
  assert float(effective_rank(np.zeros((D, D), np.float32))) == 0.0


def test_numerical_rank_of_a_product_is_at_most_its_width():
  rng = np.random.default_rng(8)
  H, D, K = 4, 48, 5
  both = jax.jit(lambda a, b: (analysis.spectrum(jnp.einsum("HDK,HEK->HDE", a, b)),
                               analysis.spectrum_of_product(a, b)))
  a, b = rng.standard_normal((2, H, D, K)).astype(np.float32)
  # Dependent columns in the last head: a = [u, 2u, v, w, -w] has rank 3, so a·bᵀ does too.
  u, v, w = rng.standard_normal((3, D))
  a[-1] = np.stack([u, 2 * u, v, w, -w], axis=1)
  for spectrum in both(a, b):
    np.testing.assert_array_equal(spectrum["rank"], [K, K, K, 3])  # ≤ K, = K for random factors
    assert np.all(np.asarray(spectrum["effective_rank"]) <= K + 1e-3)
    assert np.all(np.asarray(spectrum["singular_values"])[:, K:] < 1e-4)


@pytest.mark.parametrize("shapes", [((3, 20, 6), (3, 15, 6)), ((2, 5, 12), (2, 8, 12)),
                                    ((7, 7), (9, 7))])
def test_spectrum_from_factors_equals_dense_svd(shapes):
  rng = np.random.default_rng(9)
  a, b = (rng.standard_normal(s) for s in shapes)
  want = np.linalg.svd(a @ np.swapaxes(b, -1, -2), compute_uv=False)  # float64 numpy
  got = jax.jit(analysis.spectrum_of_product)(a.astype(np.float32), b.astype(np.float32))
  assert got["singular_values"].shape == want.shape
  np.testing.assert_allclose(got["singular_values"], want, atol=1e-4 * want.max())
  dense = jax.jit(analysis.spectrum)((a @ np.swapaxes(b, -1, -2)).astype(np.float32))
  np.testing.assert_array_equal(got["rank"], dense["rank"])
  np.testing.assert_allclose(got["effective_rank"], dense["effective_rank"], rtol=1e-4)


def test_bad_inputs_are_clear_errors():
  with pytest.raises(ConfigError, match=r"m.shape=\(4,\)"):
    analysis.spectrum(np.ones(4))
  with pytest.raises(ConfigError, match=r"b.shape=\(5, 3\).*a.shape=\(4, 2\)"):
    analysis.spectrum_of_product(np.ones((4, 2)), np.ones((5, 3)))
  cfg = CONFIGS["base"]
  params = fresh_params("per_head", cfg)
  with pytest.raises(ConfigError, match="params"):
    analysis.circuits("fused", params, cfg)
  with pytest.raises(ConfigError, match="variant='nope'"):
    analysis.circuits("nope", params, cfg)
