"""Converters: exact ones keep the function (y, weights, dy/dx); lossy ones say what they lose."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attn
from attn import ConfigError, HeadConfig, masks
from attn.conversion import CONVERTERS, LossyConversionWarning, convert
from conftest import CONFIGS, ROPE_CONFIGS, in_matrix, randn, PLAIN_CONFIGS, tier
from conftest import fresh_params as fresh

B, T, S = 2, 5, 7
TOL = 1e-5


def padded_causal_mask(s_len):
  """Causal and key padding, with example 1 cut to 3 queries: its last rows are fully masked."""
  return masks.combine_masks(
      masks.causal_mask(T, s_len),
      masks.padding_mask(jnp.array([s_len, 3]), s_len, jnp.array([T, 3]), T))


@functools.lru_cache(maxsize=None)
def _jitted(variant, cfg, cross):
  """One jitted function per (variant, cfg, cross): y, weights and dy/dx together."""
  mask = padded_causal_mask(S if cross else T)

  def loss(x, ctx, params, probe):
    y, w = attn.apply(variant, params, x, ctx, cfg=cfg, mask=mask, return_weights=True)
    return jnp.sum(y * probe), (y, w)

  return jax.jit(jax.value_and_grad(loss, has_aux=True))


def outputs(variant, params, cfg, cross, seed=10):
  """y, weights and dy/dx of one layer on fresh inputs, under jax.jit."""
  x = randn(seed, (B, T, cfg.d_model))
  ctx = randn(seed + 1, (B, S, cfg.d_model)) if cross else None
  probe = randn(seed + 2, (B, T, cfg.d_model))
  (_, (y, w)), dx = _jitted(variant, cfg, cross)(x, ctx, params, probe)
  return y, w, dx


def assert_same_function(src, p_src, cfg, dst, p_dst, dst_cfg=None, cross=True):
  got = outputs(dst, p_dst, dst_cfg or cfg, cross)
  want = outputs(src, p_src, cfg, cross)
  for name, a, b in zip(("y", "weights", "dy/dx"), got, want):
    err = float(jnp.max(jnp.abs(a - b)))
    assert err <= TOL, f"{src} -> {dst}: max |Δ{name}| = {err:.2e}"


def accepts(variant, cfg):
  try:
    attn.get_variant(variant).check(cfg)
  except ConfigError:
    return False
  return True


ALL_CONFIGS = {**CONFIGS, **ROPE_CONFIGS}
DIRECT = [("two_stage", "per_head"), ("per_head", "merged"), ("per_head", "collaborative"),
          ("split_input", "per_head")]
# Converters of variants outside the fast tier's (conftest.tier): every case in the slow tier.
NEWER = [("mla", "per_head"), ("per_head", "mla"), ("per_head", "talking_heads")]
COMPOSED = [("fused", "merged"), ("two_stage", "merged"), ("fused", "collaborative"),
            ("split_input", "merged"), ("two_stage", "fused")]


def exact_at(src, dst, cfg):
  """Both variants accept cfg and the conversion is exact there (a lossy one may be, at some)."""
  c = CONVERTERS.get((src, dst))
  return accepts(src, cfg) and accepts(dst, cfg) and (c is None or c.is_exact(cfg))


def _marks(s, d, c):
  return pytest.mark.slow if c in PLAIN_CONFIGS or tier(s, c) or tier(d, c) else ()


# Composed conversions (through per_head) in the fast tier: one case of each pair that carries a direct
# converter no fast case of its own runs (fused -> per_head, per_head -> collaborative, split_input ->
# per_head, two_stage -> per_head, per_head -> fused), at the most awkward config; the rest slow.
COMPOSED_FAST = {("fused", "collaborative", "gqa"), ("split_input", "merged", "gqa"),
                 ("two_stage", "fused", "gqa")}


EXACT_CASES = [pytest.param(s, d, c, id=f"{s}->{d}-{c}", marks=_marks(s, d, c))
               for s, d in DIRECT + NEWER for c in sorted(CONFIGS)
               if exact_at(s, d, CONFIGS[c]) and in_matrix(s, c) and in_matrix(d, c)]
EXACT_CASES += [pytest.param(s, d, c, id=f"{s}->{d}-{c}",
                             marks=() if (s, d, c) in COMPOSED_FAST else pytest.mark.slow)
                for s, d in COMPOSED for c in ("gqa", "mqa_nobias")]
# Under RoPE every conversion between variants that have it stays exact; fast: two_stage -> per_head and
# mla -> per_head (mla's own random latents: its one fast check of outputs, weights and gradients).
EXACT_CASES += [pytest.param(s, d, c, id=f"{s}->{d}-{c}",
                             marks=() if (s, d, c) in (("two_stage", "per_head", "rope_gqa"),
                                                       ("mla", "per_head", "rope_gqa"))
                             else pytest.mark.slow)
                for s, d in DIRECT + NEWER + COMPOSED + [("per_head", "fused"),
                                                         ("fused", "per_head")]
                for c in sorted(ROPE_CONFIGS) if exact_at(s, d, ROPE_CONFIGS[c])]


@pytest.mark.parametrize("src, dst, cname", EXACT_CASES)
def test_exact_converters_keep_the_function(src, dst, cname):
  cfg = ALL_CONFIGS[cname]
  p_src = fresh(src, cfg)
  p_dst, err = convert(p_src, src, dst, cfg, return_error=True)
  assert err == 0.0
  attn.api.check_params(dst, p_dst, cfg)
  assert_same_function(src, p_src, cfg, dst, p_dst, cross=True)


# Self-attention through the converters: per_head -> merged fast (merged scores x against itself); every
# converter's cross-attention case (above) is its fast sibling, the others slow.
@pytest.mark.parametrize("src, dst", [pytest.param(s, d, marks=() if (s, d) == ("per_head", "merged")
                                                   else pytest.mark.slow) for s, d in DIRECT])
def test_exact_converters_in_self_attention(src, dst):
  cfg = CONFIGS["gqa"]
  p_src = fresh(src, cfg, seed=3)
  assert_same_function(src, p_src, cfg, dst, convert(p_src, src, dst, cfg), cross=False)


# Fast: G = 2 -> 6 with d_v != d_k (more than one kv head, so the order of the repeats matters).
@pytest.mark.parametrize("cname, g, new_g", [("gqa", 2, 6)] + [pytest.param(*c, marks=pytest.mark.slow) for c in [
    ("mqa_nobias", 1, 2), ("mqa_nobias", 1, 4), ("base", 2, 4), ("dv_ne_dk", 1, 3), ("h_not_dividing_D", 3, 6)]])
def test_more_kv_heads_by_repeating_is_exact(cname, g, new_g):
  cfg = CONFIGS[cname].replace(num_kv_heads=g)
  dst_cfg = cfg.replace(num_kv_heads=new_g)
  p = fresh("per_head", cfg)
  with warnings.catch_warnings():
    warnings.simplefilter("error", LossyConversionWarning)
    q, err = convert(p, "per_head", "per_head", cfg, dst_cfg=dst_cfg, return_error=True)
  assert err == 0.0 and q["w_k"].shape[1] == new_g
  assert_same_function("per_head", p, cfg, "per_head", q, dst_cfg)


def test_regrouping_composes_with_other_converters():
  cfg = CONFIGS["gqa"]
  dst_cfg = cfg.replace(num_kv_heads=6)
  p = fresh("fused", cfg)
  q = convert(p, "fused", "merged", cfg, dst_cfg=dst_cfg)
  assert q["w_v"].shape[1] == 6
  assert_same_function("fused", p, cfg, "merged", q, dst_cfg)


def group_stack(w_qk, cfg):
  """Each kv group's R merged matrices stacked along rows: (G, R·D, D)."""
  D, G = cfg.d_model, cfg.num_kv_heads
  return np.asarray(w_qk).reshape(G, cfg.group_size * D, D)


@pytest.mark.parametrize("cname", [pytest.param(c, marks=pytest.mark.slow if c in PLAIN_CONFIGS else ())
                                   for c in sorted(CONFIGS)])
def test_merged_from_factored_has_rank_at_most_dk(cname):
  cfg = CONFIGS[cname]
  m = convert(fresh("per_head", cfg), "per_head", "merged", cfg)
  tol = 1e-4 * float(np.abs(m["w_qk"]).max())
  for w in list(np.asarray(m["w_qk"])) + list(group_stack(m["w_qk"], cfg)):
    assert np.linalg.matrix_rank(w, tol=tol) <= min(cfg.d_k, cfg.d_model)
  if cfg.d_k < cfg.d_model:  # and the rank is not lower than d_k for random params
    assert np.linalg.matrix_rank(np.asarray(m["w_qk"][0]), tol=tol) == cfg.d_k


# Fast: gqa (a key bias to drop, G < H) and d_k > d_model (the rank bounded by D, not d_k).
@pytest.mark.parametrize("cname", [pytest.param(c, marks=() if c in ("gqa", "dk_above_D") else pytest.mark.slow)
                                   for c in ["base", "gqa", "h_not_dividing_D", "mqa_nobias",
                                             "single_head", "dk_above_D"]])
def test_svd_round_trip_is_exact_for_low_rank(cname):
  cfg = CONFIGS.get(cname) or HeadConfig(d_model=8, num_heads=2, d_k=10, d_v=3)
  m = convert(fresh("per_head", cfg), "per_head", "merged", cfg)
  with warnings.catch_warnings():
    warnings.simplefilter("error", LossyConversionWarning)
    p, err = convert(m, "merged", "per_head", cfg, return_error=True)
  assert err < TOL
  if cfg.use_bias:  # the key bias is not recoverable, and not needed
    assert float(jnp.max(jnp.abs(p["b_k"]))) == 0.0
  back = convert(p, "per_head", "merged", cfg)
  for name in m:
    scale = float(jnp.max(jnp.abs(m[name])))
    assert float(jnp.max(jnp.abs(back[name] - m[name]))) <= 1e-4 * scale, name
  assert_same_function("merged", m, cfg, "per_head", p)


@pytest.mark.parametrize("cname", ["gqa"] + [pytest.param(c, marks=pytest.mark.slow) for c in ("base", "dv_ne_dk")])
def test_svd_of_full_rank_merged_is_lossy_and_says_how_much(cname):
  cfg = CONFIGS[cname]
  assert cfg.d_k < cfg.d_model
  m = fresh("merged", cfg)
  with pytest.warns(LossyConversionWarning, match="relative error"):
    p, err = convert(m, "merged", "per_head", cfg, return_error=True)
  assert err > 0.1
  # The reported error is the relative distance to what per_head can represent.
  back = convert(p, "per_head", "merged", cfg)
  names = ("w_qk", "b_kc") if cfg.use_bias else ("w_qk",)
  diff = sum(float(jnp.sum((back[n] - m[n]) ** 2)) for n in names)
  total = sum(float(jnp.sum(m[n] ** 2)) for n in names)
  np.testing.assert_allclose(err, np.sqrt(diff / total), rtol=1e-3)
  y_m, _, _ = outputs("merged", m, cfg, cross=True)
  y_p, _, _ = outputs("per_head", p, cfg, cross=True)
  assert float(jnp.max(jnp.abs(y_m - y_p))) > 1e-3


def test_mean_pooling_is_exact_when_grouped_heads_are_equal():
  cfg = CONFIGS["gqa"]  # H = 6 over G = 2, d_v != d_k: the source layer compiled for the converters above
  dst_cfg = cfg.replace(num_kv_heads=1)
  p = fresh("per_head", cfg)
  for n in ("w_k", "w_v", "b_k", "b_v"):  # kv head 1 := 0
    axis = 1 if n.startswith("w_") else 0
    p[n] = jnp.asarray(np.repeat(np.take(np.asarray(p[n]), [0], axis=axis), 2, axis=axis))  # numpy: no compile
  with warnings.catch_warnings():
    warnings.simplefilter("error", LossyConversionWarning)
    q, err = convert(p, "per_head", "per_head", cfg, dst_cfg=dst_cfg, return_error=True)
  assert err < TOL
  assert_same_function("per_head", p, cfg, "per_head", q, dst_cfg)


def test_mean_pooling_distinct_heads_is_lossy():
  cfg = CONFIGS["gqa"]  # G = 2 -> 1 (multi-query)
  dst_cfg = cfg.replace(num_kv_heads=1)
  p = fresh("per_head", cfg)
  with pytest.warns(LossyConversionWarning, match="relative error"):
    q, err = convert(p, "per_head", "per_head", cfg, dst_cfg=dst_cfg, return_error=True)
  assert err > 0.1 and q["w_k"].shape[1] == 1
  np.testing.assert_allclose(q["w_v"][:, 0], (p["w_v"][:, 0] + p["w_v"][:, 1]) / 2, rtol=1e-6)


@pytest.mark.parametrize("cname, more", [("gqa", 6), ("mqa_nobias", 4), ("base", 4)])
def test_repeat_then_pool_is_identity(cname, more):
  cfg = CONFIGS[cname]
  wide = cfg.replace(num_kv_heads=more)
  p = fresh("per_head", cfg)
  back = convert(convert(p, "per_head", "per_head", cfg, dst_cfg=wide),
                 "per_head", "per_head", wide, dst_cfg=cfg)
  assert set(back) == set(p)
  for n in p:
    np.testing.assert_allclose(back[n], p[n], rtol=1e-6, atol=1e-7)


def test_unknown_conversion_lists_the_existing_ones():
  cfg = CONFIGS["base"]
  with pytest.raises(ConfigError) as e:
    convert(fresh("per_head", cfg), "per_head", "split_input", cfg)
  msg = str(e.value)
  assert "per_head -> split_input" in msg
  for listed in ("per_head -> merged (exact)", "merged -> per_head (lossy)",
                 "split_input -> per_head (exact)", "two_stage -> per_head (exact)",
                 "per_head -> collaborative (exact)", "with fewer kv heads (lossy)",
                 "with more kv heads (exact)"):
    assert listed in msg, listed


@pytest.mark.parametrize("change, field", [({"d_k": 4}, "dst_cfg.d_k"),
                                           ({"use_bias": False}, "dst_cfg.use_bias"),
                                           ({"num_kv_heads": 3}, "dst_cfg.num_kv_heads")])
def test_dst_cfg_may_only_regroup_kv_heads(change, field):
  cfg = CONFIGS["gqa"]  # H = 6, G = 2: G' = 3 is neither a multiple nor a divisor
  with pytest.raises(ConfigError, match=field):
    convert(fresh("per_head", cfg), "per_head", "per_head", cfg, dst_cfg=cfg.replace(**change))


def test_collaborative_needs_the_concatenated_width():
  cfg = CONFIGS["base"].replace(collab_width=7)
  with pytest.raises(ConfigError, match="collab_width=7"):
    convert(fresh("per_head", cfg), "per_head", "collaborative", cfg)
