"""Weight interop: the same weights give the same outputs in flax.nnx and torch attention layers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attn
from attn.convert import CONVERTERS
from attn.nn import interop
from conftest import randn, random_params

TOL = dict(rtol=1e-5, atol=1e-5)

# Flax has one head width (d_k = d_v) but allows grouped heads and H not dividing D.
FLAX_CONFIGS = {
    "base": attn.HeadConfig(d_model=16, num_heads=4),
    "gqa_h_not_dividing_D": attn.HeadConfig(d_model=20, num_heads=6, d_k=4, d_v=4, num_kv_heads=3),
    "mqa_nobias": attn.HeadConfig(d_model=16, num_heads=4, d_k=6, d_v=6, num_kv_heads=1,
                                  use_bias=False),
    "single_head": attn.HeadConfig(d_model=12, num_heads=1, d_k=12, d_v=12),
}
# Variants with exact converters to and from per_head (their weights round-trip).
EXACT_VARIANTS = sorted({"per_head"} | {
    v for (src, v), c in CONVERTERS.items()
    if src == "per_head" and c.exact and (v, "per_head") in CONVERTERS
    and CONVERTERS[(v, "per_head")].exact})


def _masks(B, H, T, S, seed):
  """None, key padding (every row keeps key 0) with causal, and a random per-head mask."""
  lengths = jax.random.randint(jax.random.PRNGKey(seed), (B,), 1, S + 1)
  pad_causal = attn.combine_masks(attn.padding_mask(lengths, S), attn.causal_mask(T, S))
  per_head = jax.random.bernoulli(jax.random.PRNGKey(seed + 1), 0.6, (B, H, T, S))
  per_head = per_head.at[..., 0].set(True)
  return {"none": None, "padding_causal": pad_causal, "per_head": per_head}


def _usable_pairs(configs):
  """(config name, variant) for every exact variant that accepts the config."""
  pairs = []
  for name, cfg in sorted(configs.items()):
    for variant in EXACT_VARIANTS:
      try:
        attn.api.check_config(variant, cfg)
      except attn.ConfigError:
        continue  # e.g. a variant that needs H to divide D: nothing to compare
      pairs.append((name, variant))
  return pairs


@pytest.mark.parametrize("name", sorted(FLAX_CONFIGS))
def test_from_flax_matches_flax_outputs(name):
  cfg = FLAX_CONFIGS[name]
  mha = nnx.MultiHeadAttention(cfg.num_heads, cfg.d_model, cfg.num_heads * cfg.d_k,
                               num_kv_heads=cfg.num_kv_heads, use_bias=cfg.use_bias,
                               decode=False, rngs=nnx.Rngs(3))
  if cfg.use_bias:  # flax initialises biases at zero; give them values so they are tested
    for layer in (mha.query, mha.key, mha.value, mha.out):
      layer.bias[...] = randn(7, layer.bias.shape)
  params = interop.from_flax(mha, cfg)
  B, T, S = 2, 5, 7
  x, c = randn(0, (B, T, cfg.d_model)), randn(1, (B, S, cfg.d_model))
  for mname, mask in _masks(B, cfg.num_heads, T, S, 4).items():
    ref = mha(x, c, mask=mask)
    got = attn.apply("per_head", params, x, c, cfg=cfg, mask=mask)
    np.testing.assert_allclose(got, ref, **TOL, err_msg=mname)
  self_mask = attn.causal_mask(T)
  np.testing.assert_allclose(attn.apply("per_head", params, x, cfg=cfg, mask=self_mask),
                             mha(x, mask=self_mask), **TOL)


@pytest.mark.parametrize("name,variant", _usable_pairs(FLAX_CONFIGS))
def test_to_flax_matches_every_exact_variant(name, variant):
  cfg = FLAX_CONFIGS[name]
  per_head = random_params(attn.init("per_head", jax.random.PRNGKey(0), cfg), 1)
  params = attn.convert(per_head, "per_head", variant, cfg)
  mha = interop.to_flax(params, cfg, rngs=nnx.Rngs(0), variant=variant)
  back = interop.from_flax(mha, cfg)
  for k in per_head:
    np.testing.assert_allclose(back[k], per_head[k], rtol=1e-6, atol=1e-6, err_msg=k)
  B, T, S = 2, 4, 6
  x, c = randn(2, (B, T, cfg.d_model)), randn(3, (B, S, cfg.d_model))
  for mname, mask in _masks(B, cfg.num_heads, T, S, 5).items():
    np.testing.assert_allclose(attn.apply(variant, params, x, c, cfg=cfg, mask=mask),
                               mha(x, c, mask=mask), **TOL, err_msg=mname)


def test_flax_refuses_what_it_cannot_hold():
  cfg = attn.HeadConfig(d_model=12, num_heads=3, d_k=4, d_v=5)
  params = attn.init("per_head", jax.random.PRNGKey(0), cfg)
  with pytest.raises(attn.ConfigError, match="d_v=5"):
    interop.to_flax(params, cfg, rngs=nnx.Rngs(0))
  cfg = attn.HeadConfig(d_model=12, num_heads=3, scale=1.0)
  with pytest.raises(attn.ConfigError, match="scale=1.0"):
    interop.to_flax(attn.init("per_head", jax.random.PRNGKey(0), cfg), cfg, rngs=nnx.Rngs(0))
  mha = nnx.MultiHeadAttention(3, 12, 12, num_kv_heads=1, decode=False, rngs=nnx.Rngs(0))
  with pytest.raises(attn.ConfigError, match="num_kv_heads=1"):
    interop.from_flax(mha, attn.HeadConfig(d_model=12, num_heads=3))


# torch: batch_first, no grouped heads, head width D / H.
TORCH_CONFIGS = {
    "base": attn.HeadConfig(d_model=12, num_heads=3),
    "nobias": attn.HeadConfig(d_model=8, num_heads=2, use_bias=False),
    "single_head": attn.HeadConfig(d_model=6, num_heads=1),
}


def _torch_run(torch, m, x, c, lengths, causal):
  """m's output, with torch's masks: True means NOT allowed to attend."""
  S = c.shape[1]
  kpm = torch.from_numpy(np.arange(S)[None, :] >= np.asarray(lengths)[:, None])
  attn_mask = None
  if causal:
    attn_mask = torch.from_numpy(~np.asarray(attn.causal_mask(x.shape[1], S))[0, 0])
  m.train()  # dropout is 0; this keeps torch off its fused inference path
  y, _ = m(torch.from_numpy(np.asarray(x)), torch.from_numpy(np.asarray(c)),
           torch.from_numpy(np.asarray(c)), key_padding_mask=kpm, attn_mask=attn_mask,
           need_weights=False)
  return y.detach().numpy()


def _our_mask(lengths, T, S, causal):
  m = attn.padding_mask(jnp.asarray(lengths), S)
  return attn.combine_masks(m, attn.causal_mask(T, S)) if causal else m


@pytest.mark.parametrize("causal", [False, True], ids=["padding", "padding_causal"])
@pytest.mark.parametrize("name", sorted(TORCH_CONFIGS))
def test_from_torch_matches_torch(name, causal):
  torch = pytest.importorskip("torch")
  cfg = TORCH_CONFIGS[name]
  torch.manual_seed(0)
  m = torch.nn.MultiheadAttention(cfg.d_model, cfg.num_heads, bias=cfg.use_bias, batch_first=True)
  if cfg.use_bias:  # torch initialises biases at zero
    with torch.no_grad():
      m.in_proj_bias.normal_()
      m.out_proj.bias.normal_()
  params = interop.from_torch(m, cfg)
  B, T, S = 3, 5, 5
  x = randn(0, (B, T, cfg.d_model))
  lengths = [5, 2, 1]
  for c in (x, randn(1, (B, S, cfg.d_model))):  # self- then cross-attention
    ref = _torch_run(torch, m, x, c, lengths, causal)
    got = attn.apply("per_head", params, x, None if c is x else c, cfg=cfg,
                     mask=_our_mask(lengths, T, S, causal))
    np.testing.assert_allclose(got, ref, **TOL)


@pytest.mark.parametrize("name,variant", _usable_pairs(TORCH_CONFIGS))
def test_to_torch_matches_every_exact_variant(name, variant):
  torch = pytest.importorskip("torch")
  cfg = TORCH_CONFIGS[name]
  per_head = random_params(attn.init("per_head", jax.random.PRNGKey(0), cfg), 2)
  params = attn.convert(per_head, "per_head", variant, cfg)
  m = interop.to_torch(params, cfg, variant=variant)
  back = interop.from_torch(m, cfg)
  for k in per_head:
    np.testing.assert_allclose(back[k], per_head[k], rtol=1e-6, atol=1e-6, err_msg=k)
  B, T, S = 2, 4, 6
  x, c = randn(3, (B, T, cfg.d_model)), randn(4, (B, S, cfg.d_model))
  lengths = [6, 3]
  for causal in (False, True):
    ref = _torch_run(torch, m, x, c, lengths, causal)
    got = attn.apply(variant, params, x, c, cfg=cfg, mask=_our_mask(lengths, T, S, causal))
    np.testing.assert_allclose(got, ref, **TOL)


def test_torch_refuses_what_it_cannot_hold():
  pytest.importorskip("torch")
  for cfg, field in ((attn.HeadConfig(d_model=12, num_heads=4, num_kv_heads=2), "num_kv_heads=2"),
                     (attn.HeadConfig(d_model=12, num_heads=4, d_k=5, d_v=5), "d_k=5"),
                     (attn.HeadConfig(d_model=12, num_heads=4, d_k=3, d_v=4), "d_v=4")):
    params = attn.init("per_head", jax.random.PRNGKey(0), cfg)
    with pytest.raises(attn.ConfigError, match=field):
      interop.to_torch(params, cfg)
