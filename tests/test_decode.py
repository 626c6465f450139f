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

from flax import nnx

import attn
from attn.config import ConfigError
from attn.nn import DecoderLM, decoding
from attn.nn.config import ModelConfig
from attn.variants import cache as kv_cache

ALL = sorted(attn.VARIANTS)


# A layer's cache holds kv_cache_width numbers per token, and decoding it token by token and in
# chunks equals the causal full pass, for every variant with every mechanism: attn.testing's
# check_variant (tests/test_contract.py; chunks in its thorough mode). Below: whole models.


def _model(variant: str, num_layers: int = 2, **kw) -> DecoderLM:
  rope = kw.pop("rope", True)
  d_v = 4 if variant in ("k_eq_v", "compressed_shared") else 3  # the value is the key: d_v = d_k
  cfg = ModelConfig(vocab_size=13, d_model=12, num_layers=num_layers, num_heads=4, d_ff=16, d_k=4, d_v=d_v,
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


def test_generate_is_one_program_that_keeps_the_cache_on_the_device(monkeypatch):
  """The token loop runs inside one compiled program (lax.fori_loop, the caches carried on the device):
  tracing calls the model twice (the prompt, one loop body) whatever the number of steps, a second call
  traces nothing, and no implicit transfer happens between the prefill and the tokens coming out (the
  caches' allocation, init_cache, is before it, once per call)."""
  model = _model("fused", num_layers=1)  # 2 kv heads for 4, RoPE: the cache index offsets positions
  calls = []
  original = DecoderLM.__call__
  monkeypatch.setattr(DecoderLM, "__call__", lambda self, *a, **k: (calls.append(a[0].shape), original(self, *a, **k))[1])
  run = decoding._generate

  def guarded(*a, **k):  # from the prompt's prefill to the tokens: a host round trip (int(), np.asarray) raises
    with jax.transfer_guard("disallow"):
      return run(*a, **k)
  monkeypatch.setattr(decoding, "_generate", guarded)
  prompt_BT = np.random.default_rng(3).integers(0, 13, (2, 3)).astype(np.int32)  # on the host
  key = jax.random.PRNGKey(1)
  sampled = model.generate(prompt_BT, 7, temperature=0.8, key=key)
  greedy = model.generate(prompt_BT, 7)
  assert calls == [(2, 3), (2, 1)] * 2  # prefill + one loop body per program (sampled, greedy): not 7 of them
  again = model.generate(prompt_BT, 7)
  assert len(calls) == 4  # same shapes and steps: the compiled program is reused, nothing traced
  np.testing.assert_array_equal(again, greedy)
  assert sampled.shape == greedy.shape == (2, 10)
  np.testing.assert_array_equal(greedy[:, :3], prompt_BT)
  # greedy = argmax of the full forward pass at every step: test_greedy_generate_is_argmax_of_the_full_forward_pass
  assert int(jnp.sum(greedy != sampled)) > 0  # sampling at 0.8 chose otherwise somewhere
  np.testing.assert_array_equal(sampled, model.generate(prompt_BT, 7, temperature=0.8, key=key))  # keyed


@pytest.mark.slow
@pytest.mark.parametrize("variant", ALL)
def test_generate_in_one_program_equals_one_jitted_step_per_token(variant):
  """generate's lax loop against the loop it replaced: a compiled decode step per token, on the host."""
  model = _model(variant, num_layers=1)
  prompt_BT = _tokens(5, (2, 3))
  got = model.generate(prompt_BT, 4)
  decoding.init_cache(model, 2, 7)
  logits_BTN, tokens = decoding._step(model, prompt_BT), [prompt_BT]
  for i in range(4):
    tokens.append(jnp.argmax(logits_BTN[:, -1].astype(jnp.float32), -1)[:, None].astype(prompt_BT.dtype))
    if i < 3:
      logits_BTN = decoding._step(model, tokens[-1])
  np.testing.assert_array_equal(got, jnp.concatenate(tokens, 1))


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
