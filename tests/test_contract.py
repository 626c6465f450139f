"""The contract every registered variant keeps, with no per-variant code.

A new variant added to attn.VARIANTS is covered here automatically: shapes,
jit vs no-jit, self and cross attention, causality through gradients, finite
gradients, bf16 inputs, fully masked rows, weights, counts vs the tree, and
head gates (head_mask) against scaling the heads' slices of W^O.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attn
from attn import ConfigError
from conftest import CONFIGS, ROPE_CONFIGS, in_matrix, randn, random_params, tier, variant_params

B, T, S = 2, 5, 7


def cases():
  """(variant, config name) for every variant and every config it accepts."""
  out = []
  for name, variant in sorted(attn.VARIANTS.items()):
    for cname, cfg in sorted(CONFIGS.items()):
      try:
        variant.check(cfg)
      except ConfigError:
        continue
      if not in_matrix(name, cname):
        continue
      # The plain configs add little to the awkward ones; they run in the slow tier (tier()).
      out.append(pytest.param(name, cname, id=f"{name}-{cname}", marks=tier(name, cname)))
  return out


CASES = cases()


def setup(variant, cname, seed=0, dtype=jnp.float32):
  cfg = CONFIGS[cname]
  params = random_params(attn.init(variant, jax.random.PRNGKey(seed), cfg, dtype), seed + 1)
  x = randn(seed + 2, (B, T, cfg.d_model), dtype)
  ctx = randn(seed + 3, (B, S, cfg.d_model), dtype)
  return cfg, params, x, ctx


def test_every_variant_has_a_case_and_refuses_the_rest():
  covered = {c.values[0] for c in CASES}
  assert covered == set(attn.VARIANTS)
  for name, variant in attn.VARIANTS.items():
    for cfg in CONFIGS.values():
      try:
        variant.check(cfg)
      except ConfigError as e:  # a refusal names the field and the value
        assert "=" in str(e) and "not allowed" in str(e)
        with pytest.raises(ConfigError):
          attn.init(name, jax.random.PRNGKey(0), cfg)


@pytest.mark.parametrize("variant, cname", CASES)
def test_shapes_jit_and_weights(variant, cname):
  cfg, params, x, ctx = setup(variant, cname)
  for context, s_len in ((None, T), (ctx, S)):
    y, w = attn.apply(variant, params, x, context, cfg=cfg, return_weights=True)
    assert y.shape == (B, T, cfg.d_model) and y.dtype == x.dtype
    assert w.shape == (B, cfg.num_heads, T, s_len)
    if not attn.VARIANTS[variant].signed_weights:  # a signed map (differential's) need not sum to 1
      np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-5)
    f = jax.jit(lambda p, x, c: attn.apply(variant, p, x, c, cfg=cfg))
    np.testing.assert_allclose(f(params, x, context), y, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant, cname", CASES)
def test_causal_through_gradients(variant, cname):
  """Under a causal mask, output t does not depend on inputs after t."""
  cfg, params, x, _ = setup(variant, cname, seed=3)
  mask = attn.causal_mask(T)
  t = 2
  grad_x = jax.grad(lambda x: attn.apply(variant, params, x, cfg=cfg, mask=mask)[:, t].sum())(x)
  assert np.all(np.asarray(grad_x)[:, t + 1:] == 0.0)
  assert np.any(np.asarray(grad_x)[:, :t + 1] != 0.0)


@pytest.mark.parametrize("variant, cname", CASES)
def test_finite_gradients_with_blank_rows(variant, cname):
  """Padding plus causal masks with a fully masked query row: finite, and blank rows ignore the keys."""
  cfg, params, x, ctx = setup(variant, cname, seed=5)
  mask = attn.combine_masks(attn.padding_mask(jnp.array([S, 3]), S),
                            jnp.ones((B, 1, T, S), bool).at[:, :, 1].set(False))
  loss = lambda p, x, c: (attn.apply(variant, p, x, c, cfg=cfg, mask=mask) ** 2).sum()
  grads = jax.grad(loss, argnums=(0, 1, 2))(params, x, ctx)
  for g in jax.tree.leaves(grads):
    assert np.all(np.isfinite(np.asarray(g)))
  y1, w = attn.apply(variant, params, x, ctx, cfg=cfg, mask=mask, return_weights=True)
  y2 = attn.apply(variant, params, x, ctx * -3.0 + 1.0, cfg=cfg, mask=mask)
  assert np.all(np.asarray(w)[:, :, 1] == 0.0)
  np.testing.assert_allclose(y1[:, 1], y2[:, 1], atol=1e-5)  # the blank row sees no key
  assert np.all(np.asarray(w)[1, :, :, 3:] == 0.0)  # padded keys get no weight


@pytest.mark.parametrize("variant, cname", CASES)
def test_bf16_inputs(variant, cname):
  cfg, params, x, ctx = setup(variant, cname, seed=7)
  y32 = attn.apply(variant, params, x, ctx, cfg=cfg)
  p16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
  y16, w16 = attn.apply(variant, p16, x.astype(jnp.bfloat16), ctx.astype(jnp.bfloat16),
                        cfg=cfg, return_weights=True)
  assert y16.dtype == jnp.bfloat16 and w16.dtype == jnp.float32
  assert np.all(np.isfinite(np.asarray(y16, np.float32)))
  scale = float(jnp.abs(y32).max())
  np.testing.assert_allclose(np.asarray(y16, np.float32), y32, atol=0.1 * scale)


@pytest.mark.parametrize("variant, cname", CASES)
def test_init_is_deterministic(variant, cname):
  # Counts against the tree (analytic = stored >= effective) are test_count.py's.
  cfg = CONFIGS[cname]
  p1 = attn.init(variant, jax.random.PRNGKey(1), cfg)
  p2 = attn.init(variant, jax.random.PRNGKey(1), cfg)
  assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), p1, p2))
  assert ("b_o" in p1) == cfg.use_bias


def scale_w_o(params, cfg, xi_H):
  """The same params with head h's rows of W^O (w_o[h], however w_o is stored) times xi_H[h]."""
  w_o = np.asarray(params["w_o"], np.float64)
  w_HVD = w_o.reshape(cfg.num_heads, cfg.d_v, cfg.d_model) * np.asarray(xi_H)[:, None, None]
  return {**params, "w_o": jnp.asarray(w_HVD.reshape(w_o.shape), params["w_o"].dtype)}


@pytest.mark.parametrize("variant, cname", CASES)
def test_head_mask_gates_each_heads_output(variant, cname):
  """ξ = 1 is the layer; any ξ (zeros too) equals w_o[h] scaled by ξ_h; (B,H) per example."""
  cfg, params, x, ctx = setup(variant, cname, seed=11)
  H = cfg.num_heads
  rng = np.random.default_rng(12)
  xi_H = rng.uniform(0.5, 2.0, H) * (np.arange(H) % 2 == 0)  # odd heads off, the rest scaled
  xi_H[-1] = 0.0  # the last head off (with one head, y = b_o)
  xi_BH = rng.uniform(0.5, 2.0, (B, H)) * (rng.random((B, H)) < 0.6)
  scaled = [scale_w_o(params, cfg, xi) for xi in (xi_H, *xi_BH)]

  @jax.jit
  def outputs(params, scaled, xi_H, xi_BH):  # one compilation for every comparison
    causal = lambda p, xi: attn.apply(variant, p, x, cfg=cfg, mask=attn.causal_mask(T),
                                      head_mask=xi)
    cross = lambda p, xi: attn.apply(variant, p, x, ctx, cfg=cfg, head_mask=xi)
    return [(causal(params, jnp.ones(H)), causal(params, None)),
            (cross(params, jnp.ones((B, H))), cross(params, None)),
            (causal(params, xi_H), causal(scaled[0], None)),
            (cross(params, xi_BH),
             jnp.stack([cross(p, None)[b] for b, p in enumerate(scaled[1:])]))]

  for gated, reference in outputs(params, scaled, jnp.asarray(xi_H, jnp.float32),
                                  jnp.asarray(xi_BH, jnp.float32)):
    np.testing.assert_allclose(gated, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant, cname", CASES)
def test_head_mask_gradient_is_each_heads_contribution(variant, cname):
  """y is linear in ξ, so ∂⟨r, y⟩/∂ξ_h = f(e_h) − f(0): importance by jax.grad."""
  cfg, params, x, ctx = setup(variant, cname, seed=13)
  H = cfg.num_heads
  r_BTD = randn(14, (B, T, cfg.d_model))
  f = lambda xi: (attn.apply(variant, params, x, ctx, cfg=cfg, head_mask=xi) * r_BTD).sum()
  grad_H = jax.jit(jax.grad(f))(jnp.ones(H))
  f_H = jax.jit(jax.vmap(f))(jnp.concatenate([jnp.eye(H), jnp.zeros((1, H))]))
  np.testing.assert_allclose(grad_H, f_H[:H] - f_H[H], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("variant", variant_params())
def test_bad_inputs_are_clear_errors(variant):
  cfg = CONFIGS["base"]
  params = attn.init(variant, jax.random.PRNGKey(0), cfg)
  x = randn(0, (B, T, cfg.d_model))
  with pytest.raises(ConfigError, match=r"x.shape=\(2, 5, 31\).*d_model=32"):
    attn.apply(variant, params, x[..., :31], cfg=cfg)
  with pytest.raises(ConfigError, match="context.shape"):
    attn.apply(variant, params, x, x[:1], cfg=cfg)
  with pytest.raises(ConfigError, match="mask.shape"):
    attn.apply(variant, params, x, cfg=cfg, mask=jnp.ones((B, 3, T, T), bool))
  with pytest.raises(ConfigError, match="params"):
    attn.apply(variant, {k: a for k, a in list(params.items())[1:]}, x, cfg=cfg)
  for shape in ((3,), (4, 2), (2, 4, 1), (1, 4), ()):
    with pytest.raises(ConfigError, match=re.escape(
        f"head_mask.shape={shape!r} is not allowed: (H,)=(4,) or (B, H)=(2, 4)")):
      attn.apply(variant, params, x, cfg=cfg, head_mask=jnp.ones(shape))
  with pytest.raises(ConfigError, match="head_mask.dtype='int32'.*float"):
    attn.apply(variant, params, x, cfg=cfg, head_mask=jnp.ones(4, jnp.int32))
  other = attn.HeadConfig(d_model=32, num_heads=4, d_k=4, d_v=4)
  with pytest.raises(ConfigError, match=r"params\["):
    attn.apply(variant, attn.init(variant, jax.random.PRNGKey(0), other), x, cfg=cfg)


# RoPE: one awkward config with rotated dims; a variant that refuses it must say why.
ROPE_CFG = ROPE_CONFIGS["rope_gqa"]


def rope_cases():
  out = []
  for name, variant in sorted(attn.VARIANTS.items()):
    try:
      variant.check(ROPE_CFG)
    except ConfigError as e:
      assert "rope_dim=4 is not allowed" in str(e), (name, e)
      continue
    # per_head in the fast tier; the other variants share its RoPE code (base.attend_and_project).
    out.append(pytest.param(name, marks=() if name == "per_head" else pytest.mark.slow, id=name))
  return out


ROPE_CASES = rope_cases()


@pytest.mark.parametrize("variant", ROPE_CASES)
def test_rope_weights_depend_only_on_offsets(variant):
  """Shifting all positions by a constant keeps y and the weights; reordering them does not."""
  cfg = ROPE_CFG
  params = random_params(attn.init(variant, jax.random.PRNGKey(0), cfg), 1)
  x = randn(2, (B, T, cfg.d_model))
  pos_BT = jnp.asarray(np.random.default_rng(3).integers(0, 50, (B, T)))

  @jax.jit
  def run(params, x, pos):  # self-attention, so keys share the queries' positions
    return attn.apply(variant, params, x, cfg=cfg, positions=pos, return_weights=True)

  y, w = run(params, x, pos_BT)
  y2, w2 = run(params, x, pos_BT + 1000)
  np.testing.assert_allclose(w2, w, atol=2e-5)
  np.testing.assert_allclose(y2, y, atol=2e-4 * float(jnp.abs(y).max()))
  _, w3 = run(params, x, pos_BT[:, ::-1])
  assert float(jnp.abs(w3 - w).max()) > 1e-3  # the positions do reach the scores


@pytest.mark.parametrize("variant", ["merged", "collaborative"])
def test_rope_is_refused_with_the_reason(variant):
  assert variant not in [c.values[0] for c in ROPE_CASES]
  with pytest.raises(ConfigError, match="rope_dim=4 is not allowed: 0 for " + variant):
    attn.init(variant, jax.random.PRNGKey(0), ROPE_CFG)


DECODE_CASES = [pytest.param(n, c, marks=tier(n, c), id=f"{n}-{c}")
                for n, v in sorted(attn.VARIANTS.items()) if v.decode_apply is not None
                for c in ("gqa", "mqa_nobias", "rope")]


@pytest.mark.parametrize("variant, cname", DECODE_CASES)
def test_decode_form_equals_apply(variant, cname):
  """A variant's decode_apply (mla: queries absorbed into the latent) is apply's function."""
  cfg = ROPE_CFG if cname == "rope" else CONFIGS[cname]
  v = attn.VARIANTS[variant]
  params = random_params(attn.init(variant, jax.random.PRNGKey(0), cfg), 4)
  x, ctx = randn(5, (B, T, cfg.d_model)), randn(6, (B, S, cfg.d_model))
  mask = attn.combine_masks(attn.padding_mask(jnp.array([S, 3]), S),
                            jnp.ones((B, 1, T, S), bool).at[:, :, 1].set(False))
  xi = jnp.asarray(np.random.default_rng(7).uniform(0, 2, cfg.num_heads), jnp.float32)

  @jax.jit
  def both(params, x, ctx):
    opts = attn.api.Options(mask=mask, return_weights=True, head_mask=xi,
                            qk_positions=(jnp.arange(T) + 3, jnp.arange(S)))
    return (v.apply(params, x, ctx, cfg=cfg, opts=opts),
            v.decode_apply(params, x, ctx, cfg=cfg, opts=opts))

  (y, w), (y_dec, w_dec) = both(params, x, ctx)
  np.testing.assert_allclose(w_dec, w, atol=1e-5)
  np.testing.assert_allclose(y_dec, y, atol=1e-5 * max(1.0, float(jnp.abs(y).max())))
