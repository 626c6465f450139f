"""The contract every registered variant keeps: attn.testing.check_variant on every built-in.

The kit is the contract (shapes, jit, masks, causality, finite gradients, bf16,
head gates, RoPE, every mechanism, decoding, counts against the tree, the
cache, XLA and the Jacobian); a plugin's tests call the same function. The
fast tier runs its fast mode on KIT_FAST's variants, the slow tier the fast mode
on the others and thorough=True on every one.
Below it: what only attn's own layout can say (W^O's rows per head) and bad
input.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attn
from attn import ConfigError, testing
from conftest import CONFIGS, ROPE_CONFIGS, randn, random_params, variant_params

B, T, S = 2, 5, 7


# The fast tier runs the kit on per_head (the softmax core, every mechanism at once) and talking_heads (heads
# mixed across the scores: no other fast test mixes them with anything but the identity). The others run it
# in the slow tier; each keeps fast identities of its own: the contract matrix and counts (fused, merged,
# collaborative, split_input, two_stage: conftest.FAST_VARIANTS; merged also the exact per_head -> merged
# conversion, test_convert), mla its exact conversion to per_head under RoPE with G < H and d_v != d_k
# (outputs, weights and gradients, test_convert), a naive loop or a second form (differential and tpa:
# test_new_variants; compressed: test_compressed; compressed_shared: test_compressed_shared; k_eq_v and
# grouped_lowrank: test_head_layouts; gla: test_gla), the fixed-state heads their chunked and recurrent forms
# against the loop and a chunk continued from a state (kda, gated_deltanet, linear, mamba2: test_linear_core,
# test_linear_variants) and a prompt then tokens decoded from the state equal to the full pass (gated_deltanet:
# test_linear_variants).
KIT_FAST = ("per_head", "talking_heads")


@pytest.mark.parametrize("variant", [pytest.param(v, marks=() if v in KIT_FAST else pytest.mark.slow)
                                     for v in sorted(attn.VARIANTS)])
def test_the_kit_passes_on_every_builtin_variant(variant):
  testing.check_variant(variant)


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(attn.VARIANTS))
def test_the_kit_passes_thoroughly_on_every_builtin_variant(variant):
  testing.check_variant(variant, thorough=True)


# The head_mask cases' configs, most awkward first; each variant runs the first two it accepts (the
# kit's thorough mode, above, runs its head-gate checks on every awkward config).
ORDER = ("gqa", "mqa_nobias", "h_not_dividing_D", "dv_ne_dk", "single_head", "base")


def cases():
  """(variant, config name): the first two configs of ORDER each variant accepts (slow tier)."""
  out = []
  for name, variant in sorted(attn.VARIANTS.items()):
    accepted = []
    for cname in ORDER + tuple(sorted(set(CONFIGS) - set(ORDER))):
      try:
        variant.check(CONFIGS[cname])
      except ConfigError:
        continue
      accepted.append(cname)
    out += [pytest.param(name, c, id=f"{name}-{c}", marks=pytest.mark.slow) for c in accepted[:2]]
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


@pytest.mark.parametrize("variant", variant_params(fast=("per_head",)))  # attn.init's; every variant slow
def test_init_is_deterministic(variant):
  cfg = CONFIGS["gqa" if variant not in ("k_eq_v", "compressed_shared") else "mqa_nobias"]  # d_v = d_k
  p1 = attn.init(variant, jax.random.PRNGKey(1), cfg)
  p2 = attn.init(variant, jax.random.PRNGKey(1), cfg)
  assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), p1, p2))
  assert ("b_o" in p1) == cfg.use_bias


def own_tokens(variant, ctx):
  """(mask or is_causal, context and its flag) of the head-mask cases: a head with a fixed-size
  state reads only its own tokens, causally (attn.variants.linear), so it runs causal self-attention."""
  if attn.VARIANTS[variant].init_state is not None:
    return dict(is_causal=True), None, dict(is_causal=True)
  return dict(mask=attn.causal_mask(T)), ctx, {}


def scale_w_o(params, cfg, xi_H):
  """The same params with head h's rows of W^O (w_o[h], however w_o is stored) times xi_H[h]."""
  if "w_oa" in params:  # grouped_lowrank: head h's rows of its group's A (W^O = blockdiag(A)·B)
    w_oa = np.asarray(params["w_oa"], np.float64)
    g = w_oa.shape[0]
    w = w_oa.reshape(g, cfg.num_heads // g, cfg.d_v, -1) * np.asarray(xi_H).reshape(g, -1)[:, :, None, None]
    return {**params, "w_oa": jnp.asarray(w.reshape(w_oa.shape), params["w_oa"].dtype)}
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
  masked, c, cross_kw = own_tokens(variant, ctx)

  @jax.jit
  def outputs(params, scaled, xi_H, xi_BH):  # one compilation for every comparison
    causal = lambda p, xi: attn.apply(variant, p, x, cfg=cfg, head_mask=xi, **masked)
    cross = lambda p, xi: attn.apply(variant, p, x, c, cfg=cfg, head_mask=xi, **cross_kw)
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
  _, c, cross_kw = own_tokens(variant, ctx)
  f = lambda xi: (attn.apply(variant, params, x, c, cfg=cfg, head_mask=xi, **cross_kw) * r_BTD).sum()
  grad_H = jax.jit(jax.grad(f))(jnp.ones(H))
  f_H = jax.jit(jax.vmap(f))(jnp.concatenate([jnp.eye(H), jnp.zeros((1, H))]))
  np.testing.assert_allclose(grad_H, f_H[:H] - f_H[H], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("variant", variant_params(fast=("per_head",)))  # attn.apply's checks; the rest slow
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


@pytest.mark.parametrize("variant", ["merged", "collaborative"])
def test_rope_is_refused_with_the_reason(variant):
  with pytest.raises(ConfigError, match="rope_dim=4 is not allowed: 0 for " + variant):
    attn.init(variant, jax.random.PRNGKey(0), ROPE_CONFIGS["rope_gqa"])
