"""Weight interop: the same weights give the same outputs in flax.nnx and torch attention layers."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attn
from attn.conversion import CONVERTERS
from attn.nn import interop
from conftest import randn, tier

TOL = dict(rtol=1e-5, atol=1e-5)


def random_params(variant, cfg, seed):
  """Random values (biases included) for every parameter `variant` has under cfg."""
  return {k: 0.5 * randn(seed + i, s)
          for i, (k, s) in enumerate(sorted(attn.param_shapes(variant, cfg).items()))}


# Flax has one head width (d_k = d_v) but allows grouped heads and H not dividing D.
FLAX_CONFIGS = {
    "base": attn.HeadConfig(d_model=16, num_heads=4),
    "gqa_h_not_dividing_D": attn.HeadConfig(d_model=20, num_heads=6, d_k=4, d_v=4, num_kv_heads=3),
    "mqa_nobias": attn.HeadConfig(d_model=16, num_heads=4, d_k=6, d_v=6, num_kv_heads=1,
                                  use_bias=False),
}


def _exact(src, dst):
  return (src, dst) in CONVERTERS and CONVERTERS[(src, dst)].exact


# Every variant with an exact conversion from or to per_head: its outputs must match the
# library's through the per_head weights.
OTHER_VARIANTS = sorted(v for v in attn.VARIANTS if v not in ("per_head", "fused")
                        and (_exact("per_head", v) or _exact(v, "per_head")))


def _masks(B, H, T, S, seed):
  """None, key padding (every row keeps key 0) with causal, and a random per-head mask."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, S + 1, (B,))
  pad_causal = (np.arange(S) < lengths[:, None])[:, None, None, :] & np.tri(T, S, S - T, bool)
  per_head = rng.random((B, H, T, S)) < 0.6
  per_head[..., 0] = True
  return {"none": None, "padding_causal": pad_causal, "per_head": per_head}


def _pairs(configs, fast=None):
  """per_head and fused on every config (those not in `fast`, when given, in the slow tier); the other
  variants on "base", where they accept it (those outside conftest.FAST_VARIANTS in the slow tier, as in
  the other suites over every variant)."""
  pairs = [pytest.param(name, v, marks=() if fast is None or (name, v) in fast else pytest.mark.slow)
           for name in sorted(configs) for v in ("per_head", "fused")]
  for v in OTHER_VARIANTS:
    try:
      attn.api.check_config(v, configs["base"])
    except attn.ConfigError:
      continue  # a variant that refuses the config by design: nothing to compare
    pairs.append(pytest.param("base", v, marks=tier(v) if fast is None else pytest.mark.slow))
  return pairs


def _variant_and_per_head(variant, cfg, seed):
  """Random params of `variant` and the same function in the per_head layout."""
  if _exact(variant, "per_head") or variant == "per_head":
    params = random_params(variant, cfg, seed)
    return params, attn.convert(params, variant, "per_head", cfg)
  per_head = random_params("per_head", cfg, seed)
  return attn.convert(per_head, "per_head", variant, cfg), per_head


def _handover(variant, params, per_head):
  """What to pass to to_flax / to_torch: the variant's own params when they convert exactly."""
  return (params, variant) if _exact(variant, "per_head") else (per_head, "per_head")


@nnx.jit(static_argnums=(1, 2))
def _flax_and_ours(mha, variant, cfg, params, x, c, masks):
  """{mask name: (ours, flax's)} for cross-attention under each mask, in one compiled call."""
  return {name: (attn.apply(variant, params, x, c, cfg=cfg, mask=m), mha(x, c, mask=m))
          for name, m in masks.items()}


def _assert_pairs(pairs):
  for name, (ours, theirs) in pairs.items():
    np.testing.assert_allclose(ours, theirs, **TOL, err_msg=name)


# Fast at G < H with h not dividing d_model; without biases slow (to_flax's round trip below runs it fast).
@pytest.mark.parametrize("name", ["gqa_h_not_dividing_D", pytest.param("mqa_nobias", marks=pytest.mark.slow)])
def test_from_flax_matches_flax_outputs(name):
  cfg = FLAX_CONFIGS[name]
  mha = nnx.MultiHeadAttention(cfg.num_heads, cfg.d_model, cfg.num_heads * cfg.d_k,
                               num_kv_heads=cfg.num_kv_heads, use_bias=cfg.use_bias,
                               decode=False, rngs=nnx.Rngs(3))
  if cfg.use_bias:  # flax initialises biases at zero; give them values so they are tested
    for i, layer in enumerate((mha.query, mha.key, mha.value, mha.out)):
      layer.bias[...] = randn(7 + i, layer.bias.shape)
  params = interop.from_flax(mha, cfg)
  B, T, S = 2, 5, 7
  x, c = randn(0, (B, T, cfg.d_model)), randn(1, (B, S, cfg.d_model))
  masks = _masks(B, cfg.num_heads, T, S, 4)
  _assert_pairs(_flax_and_ours(mha, "per_head", cfg, params, x, c, masks))


# Fast: per_head and fused at G < H with h not dividing d_model, per_head without biases; the plain config's
# per_head and fused, fused without biases and the other variants (each through its exact conversion to or
# from per_head, which test_convert runs fast) slow.
FLAX_FAST = {("gqa_h_not_dividing_D", "per_head"), ("gqa_h_not_dividing_D", "fused"), ("mqa_nobias", "per_head")}


@pytest.mark.parametrize("name,variant", _pairs(FLAX_CONFIGS, FLAX_FAST))
def test_to_flax_matches_variants(name, variant):
  cfg = FLAX_CONFIGS[name]
  params, per_head = _variant_and_per_head(variant, cfg, 1)
  weights, kind = _handover(variant, params, per_head)
  mha = interop.to_flax(weights, cfg, rngs=nnx.Rngs(0), variant=kind)
  back = interop.from_flax(mha, cfg)
  for k in per_head:
    np.testing.assert_allclose(back[k], per_head[k], rtol=1e-6, atol=1e-6, err_msg=k)
  B, T, S = 2, 4, 6
  x, c = randn(2, (B, T, cfg.d_model)), randn(3, (B, S, cfg.d_model))
  _assert_pairs(_flax_and_ours(mha, variant, cfg, params, x, c, _masks(B, cfg.num_heads, T, S, 5)))


def test_flax_self_attention_matches():
  cfg = FLAX_CONFIGS["gqa_h_not_dividing_D"]
  params = random_params("per_head", cfg, 3)
  mha = interop.to_flax(params, cfg, rngs=nnx.Rngs(0))
  x, mask = randn(4, (2, 5, cfg.d_model)), np.tri(5, dtype=bool)
  both = nnx.jit(lambda m, p, x: (attn.apply("per_head", p, x, cfg=cfg, mask=mask), m(x, mask=mask)))
  np.testing.assert_allclose(*both(mha, params, x), **TOL)  # one compile, not one per operation


def _zeros(variant, cfg):
  """Parameters of the right shapes without any JAX work (only shapes are checked)."""
  return {k: np.zeros(s, np.float32) for k, s in attn.param_shapes(variant, cfg).items()}


def test_flax_refuses_what_it_cannot_hold():
  cfg = attn.HeadConfig(d_model=12, num_heads=3, d_k=4, d_v=5)
  with pytest.raises(attn.ConfigError, match="d_v=5"):
    interop.to_flax(_zeros("per_head", cfg), cfg, rngs=nnx.Rngs(0))
  cfg = attn.HeadConfig(d_model=12, num_heads=3, scale=1.0)
  with pytest.raises(attn.ConfigError, match="scale=1.0"):
    interop.to_flax(_zeros("per_head", cfg), cfg, rngs=nnx.Rngs(0))
  mha = nnx.MultiHeadAttention(3, 12, 12, num_kv_heads=1, decode=False, rngs=nnx.Rngs(0))
  with pytest.raises(attn.ConfigError, match="num_kv_heads=1"):
    interop.from_flax(mha, attn.HeadConfig(d_model=12, num_heads=3))


# torch: batch_first, no grouped heads, head width D / H.
TORCH_CONFIGS = {
    "base": attn.HeadConfig(d_model=12, num_heads=3),
    "nobias": attn.HeadConfig(d_model=8, num_heads=2, use_bias=False),
}


CASES = [(cross, causal) for cross in (False, True) for causal in (False, True)]


def _torch_run(torch, m, x, c, lengths, causal):
  """m's output, with torch's masks: True means NOT allowed to attend."""
  S = c.shape[1]
  kpm = torch.from_numpy(np.arange(S)[None, :] >= np.asarray(lengths)[:, None])
  attn_mask = None
  if causal:
    attn_mask = torch.from_numpy(~np.array(attn.causal_mask(x.shape[1], S))[0, 0])
  m.train()  # dropout is 0; this keeps torch off its fused inference path
  c = torch.from_numpy(np.array(c))
  y, _ = m(torch.from_numpy(np.array(x)), c, c, key_padding_mask=kpm, attn_mask=attn_mask,
           need_weights=False)
  return y.detach().numpy()


@functools.partial(jax.jit, static_argnums=(0, 1))
def _ours(variant, cfg, params, x, c, lengths):
  """Our outputs for every (cross, causal) case of CASES, in one compiled call."""
  out = []
  for cross, causal in CASES:
    ctx = c if cross else x
    mask = attn.padding_mask(lengths, ctx.shape[1])
    if causal:
      mask = attn.combine_masks(mask, attn.causal_mask(x.shape[1], ctx.shape[1]))
    out.append(attn.apply(variant, params, x, ctx if cross else None, cfg=cfg, mask=mask))
  return out


def _assert_torch_parity(torch, m, variant, cfg, params, B, T, S, lengths):
  x, c = randn(3, (B, T, cfg.d_model)), randn(4, (B, S, cfg.d_model))
  ours = _ours(variant, cfg, params, x, c, jnp.asarray(lengths))
  for (cross, causal), got in zip(CASES, ours):
    ref = _torch_run(torch, m, x, c if cross else x, lengths, causal)
    np.testing.assert_allclose(got, ref, **TOL, err_msg=f"cross={cross} causal={causal}")


@pytest.mark.parametrize("name", sorted(TORCH_CONFIGS))
def test_from_torch_matches_torch(name):
  torch = pytest.importorskip("torch")
  cfg = TORCH_CONFIGS[name]
  torch.manual_seed(0)
  m = torch.nn.MultiheadAttention(cfg.d_model, cfg.num_heads, bias=cfg.use_bias, batch_first=True)
  if cfg.use_bias:  # torch initialises biases at zero
    with torch.no_grad():
      m.in_proj_bias.normal_()
      m.out_proj.bias.normal_()
  params = interop.from_torch(m, cfg)
  _assert_torch_parity(torch, m, "per_head", cfg, params, 3, 5, 5, [5, 2, 1])


@pytest.mark.parametrize("name,variant", _pairs(TORCH_CONFIGS))
def test_to_torch_matches_variants(name, variant):
  torch = pytest.importorskip("torch")
  cfg = TORCH_CONFIGS[name]
  params, per_head = _variant_and_per_head(variant, cfg, 2)
  weights, kind = _handover(variant, params, per_head)
  m = interop.to_torch(weights, cfg, variant=kind)
  back = interop.from_torch(m, cfg)
  for k in per_head:
    np.testing.assert_allclose(back[k], per_head[k], rtol=1e-6, atol=1e-6, err_msg=k)
  _assert_torch_parity(torch, m, variant, cfg, params, 2, 4, 4, [4, 3])


def test_torch_refuses_what_it_cannot_hold():
  pytest.importorskip("torch")
  for cfg, field in ((attn.HeadConfig(d_model=12, num_heads=4, num_kv_heads=2), "num_kv_heads=2"),
                     (attn.HeadConfig(d_model=12, num_heads=4, d_k=5, d_v=5), "d_k=5"),
                     (attn.HeadConfig(d_model=12, num_heads=4, d_k=3, d_v=4), "d_v=4")):
    with pytest.raises(attn.ConfigError, match=field):
      interop.to_torch(_zeros("per_head", cfg), cfg)
