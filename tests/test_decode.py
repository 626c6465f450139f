"""KV-cache decoding: every variant's cached decode equals its full forward pass.

Iterates attn.VARIANTS, so a new variant is covered with no further work: what
it caches per token must be its kv_cache_width (what `attn count` reports),
and token-by-token decoding, and a chunked prefill followed by single tokens,
must give the full causal forward pass's outputs at every position.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import CONFIGS, ROPE_CONFIGS, fresh_params, randn
from flax import nnx

import attn
from attn.config import ConfigError
from attn.nn import DecoderLM, ModelConfig
from attn.variants import cache as kv_cache
from attn.variants.base import Options

ALL = sorted(attn.VARIANTS)


def _accepted(variant: str, names) -> list:
  """The configs of `names` the variant accepts (mla with a latent narrower than G·(K + V))."""
  out = []
  for name in names:
    cfg = {**CONFIGS, **ROPE_CONFIGS}[name]
    if variant == "mla":
      cfg = dataclasses.replace(cfg, latent_dim=cfg.d_k + 1)
    try:
      attn.VARIANTS[variant].check(cfg)
    except ConfigError:
      continue
    out.append((name, cfg))
  assert out, f"{variant} accepts none of {names}"
  return out


@pytest.mark.parametrize("variant", ALL)
def test_cache_holds_kv_cache_width_per_token(variant):
  var = attn.VARIANTS[variant]
  for _, cfg in _accepted(variant, ("gqa", "mqa_nobias", "rope_gqa", "h_not_dividing_D")):
    params = jax.eval_shape(lambda: var.init(jax.random.PRNGKey(0), cfg))
    shapes = jax.eval_shape(lambda p: kv_cache.init(var, p, cfg, 3, 5), params)
    for a in shapes.values():
      assert a.shape[:2] == (3, 5)
    assert kv_cache.width(shapes) == var.kv_cache_width(cfg)


def _decode_in_chunks(var, params, x_BTD, cfg, chunks, head_mask=None):
  cache = kv_cache.init(var, params, cfg, x_BTD.shape[0], x_BTD.shape[1] + 2)
  ys, i = [], 0
  for T in chunks:
    y, cache = kv_cache.decode_step(var, params, x_BTD[:, i:i + T], cache, i, cfg=cfg,
                                    head_mask=head_mask)
    ys.append(y)
    i += T
  return jnp.concatenate(ys, axis=1)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ALL)
def test_decode_step_equals_the_causal_forward_pass(variant):
  var = attn.VARIANTS[variant]
  # GQA (with RoPE where the variant has it), then MQA without biases.
  cases = _accepted(variant, ("rope_gqa", "gqa"))[:1] + _accepted(variant, ("rope_mqa_nobias",
                                                                             "mqa_nobias"))[:1]
  for name, cfg in cases:
    params = fresh_params(variant, cfg, seed=1)
    x_BTD = randn(2, (2, 7, cfg.d_model))
    full, _ = var.apply(params, x_BTD, cfg=cfg, opts=Options(is_causal=True))
    got = _decode_in_chunks(var, params, x_BTD, cfg, (1,) * 7)
    np.testing.assert_allclose(got, full, atol=2e-5, rtol=2e-5, err_msg=f"{name} one at a time")
    gates = jnp.asarray(np.random.default_rng(3).uniform(size=(2, cfg.num_heads)), jnp.float32)
    gated, _ = var.apply(params, x_BTD, cfg=cfg, opts=Options(is_causal=True, head_mask=gates))
    got = _decode_in_chunks(var, params, x_BTD, cfg, (4, 1, 2), head_mask=gates)
    np.testing.assert_allclose(got, gated, atol=2e-5, rtol=2e-5, err_msg=f"{name} chunked, gated")


def _model(variant: str, num_layers: int = 2, **kw) -> DecoderLM:
  rope = kw.pop("rope", True)
  cfg = ModelConfig(vocab_size=13, d_model=12, num_layers=num_layers, num_heads=4, d_ff=16, d_k=4, d_v=3,
                    num_kv_heads=2, variant=variant, max_len=12, **kw)
  if rope:
    try:
      attn.VARIANTS[variant].check(dataclasses.replace(cfg.head, rope_dim=2))
      cfg = cfg.replace(positional="rope", rope_dim=2, rope_theta=100.0)
    except ConfigError:
      pass
  return DecoderLM(cfg, rngs=nnx.Rngs(0))


def _tokens(seed: int, shape) -> jax.Array:
  return jnp.asarray(np.random.default_rng(seed).integers(0, 13, shape), jnp.int32)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ALL)
def test_model_decoding_gives_the_full_forward_logits(variant):
  model = _model(variant, num_layers=1)
  tokens_BT = _tokens(4, (2, 6))
  full = model(tokens_BT)
  for chunks in ((1,) * 6, (3, 1, 2)):
    model.init_cache(2, 8)
    outs, i = [], 0
    for T in chunks:
      outs.append(model(tokens_BT[:, i:i + T], decode=True))
      i += T
    np.testing.assert_allclose(jnp.concatenate(outs, 1), full, atol=2e-5, rtol=2e-5,
                               err_msg=str(chunks))


@pytest.mark.slow
def test_greedy_generate_is_argmax_of_the_full_forward_pass():
  # Sinusoidal positions: the decode path must offset them by the cache fill.
  model = _model("fused", num_layers=1, positional="sinusoidal", rope=False)
  prompt_BT = _tokens(5, (3, 4))
  got = model.generate(prompt_BT, 3)
  want = prompt_BT
  for _ in range(3):
    next_B = jnp.argmax(model(want)[:, -1], axis=-1)
    want = jnp.concatenate([want, next_B[:, None].astype(want.dtype)], axis=1)
  np.testing.assert_array_equal(got, want)
  sampled = model.generate(prompt_BT, 3, temperature=1.0, key=jax.random.PRNGKey(0))
  np.testing.assert_array_equal(sampled[:, :4], prompt_BT)
  assert sampled.shape == (3, 7) and int(sampled.min()) >= 0 and int(sampled.max()) < 13


def test_bad_decoding_input_is_refused_naming_the_field():
  model = _model("per_head", num_layers=1, rope=False)
  tokens_BT = _tokens(6, (2, 3))
  with pytest.raises(ConfigError, match="decode.*init_cache"):
    model(tokens_BT, decode=True)
  with pytest.raises(ConfigError, match="max_len"):
    model.init_cache(2, 13)
  model.init_cache(2, 4)
  with pytest.raises(ConfigError, match=r"tokens.shape\[1\].*beyond the cache"):
    model(_tokens(6, (2, 5)), decode=True)
  with pytest.raises(ConfigError, match=r"tokens.shape\[0\]"):
    model(_tokens(6, (3, 1)), decode=True)
  with pytest.raises(ConfigError, match=r"prompt.shape\[1\].*max_len=12"):
    model.generate(_tokens(6, (1, 13)), 1)
  with pytest.raises(ConfigError, match="steps.*at most"):
    model.generate(_tokens(6, (1, 10)), 3)
  with pytest.raises(ConfigError, match="key"):
    model.generate(tokens_BT, 2, temperature=0.5)
  with pytest.raises(ConfigError, match="temperature"):
    model.generate(tokens_BT, 2, temperature=-1.0)


@pytest.mark.slow
def test_decode_bench_table_smoke():
  from attn.bench import decode as bench_decode, layer as bench
  cfg = attn.HeadConfig(d_model=16, num_heads=4, d_k=4, d_v=4)
  r = bench_decode.run_decode(["per_head", "mla"], 1, (8, 16), cfg=cfg, torch_peer=False,
                              round_robin=bench._round_robin, log=lambda _: None)
  # per_head at G=4, 2, 1 caches 2·G·4 floats per token; mla its latent d_c = 4·d_k.
  assert r["bytes_per_token"] == {"per_head": 128, "per_head G=2 (GQA)": 64,
                                  "per_head G=1 (MQA)": 32, "mla": 64}
  table = bench_decode.markdown(r)
  for label in ("per_head G=1 (MQA)", "mla", "fused, full recompute"):
    assert f"| {label} |" in table
  assert all(t > 0 for L in (8, 16) for t in r["ms"][L].values())
