"""cca (attn.variants.mechanisms.cca), ZAYA1's compressed convolutional attention: against numpy, decoding
against the full pass, counts in closed form, refusals by name before tracing; the kit's whole contract and a
DecoderLM generating as its full pass are the slow tests. Against transformers' ZayaAttention:
tests/test_hf_zaya.py."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import attn
from attn import api, count, testing
from attn.config import ConfigError, HeadConfig
from attn.testing.variants import AWKWARD
from attn.variants import cache, mechanisms
from attn.variants.mechanisms import cca
from conftest import fresh_params, jit_apply

CCA = AWKWARD["gqa_dv_ne_dk"].replace(cca=True, cca_depthwise_width=3, cca_grouped_width=2, rope_dim=4)  # d_v != d_k


def _params(cfg, seed=0):
  """Random parameters, every cca weight off its init (biases and temperatures too): numpy draws at the
  parameters' shapes (conftest.fresh_params; init's jax draws compile a program of ~0.6 s CPU)."""
  return fresh_params("per_head", cfg, seed)


def _numpy_cca(p, q, k, v, cfg):
  """cca's on_qkv by loops over tokens, as ZAYA writes it: padded convolutions, the q–k mean, the value shift."""
  p = {n: np.asarray(a, np.float64) for n, a in p.items()}
  B, T, H, K = q.shape
  G, R, W0, W1 = cfg.num_kv_heads, H // cfg.num_kv_heads, cfg.cca_depthwise_width, cfg.cca_grouped_width
  out = {}
  for c, x in (("q", q), ("k", k)):
    pad = np.concatenate([np.zeros((B, W0 + W1 - 2, *x.shape[2:])), x], 1)
    mid = np.stack([sum(p[f"cca_dw_{c}"][j] * pad[:, s + j] for j in range(W0)) for s in range(T + W1 - 1)], 1)
    mid += p[f"cca_dw_bias_{c}"]
    out[c] = np.stack([sum(np.einsum("bni,nio->bno", mid[:, t + i], p[f"cca_gc_{c}"][i]) for i in range(W1))
                       for t in range(T)], 1) + p[f"cca_gc_bias_{c}"]
  q_bar = (q + np.repeat(k, R, axis=2)) / 2
  k_bar = q_bar.reshape(B, T, G, R, K).mean(3)
  norm = lambda x: x * np.sqrt(K) / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
  query, key = norm(out["q"] + q_bar), norm(out["k"] + k_bar) * p["cca_temp"][:, None]
  flat = v.reshape(B, T, -1).copy()
  half = flat.shape[-1] // 2
  b_v = p.get("b_v", np.zeros(v.shape[2:])).reshape(-1)
  flat[:, 1:, half:], flat[:, 0, half:] = flat[:, :-1, half:].copy(), b_v[half:]
  return query, key, flat.reshape(v.shape)


@pytest.mark.slow  # op by op: ~2-6 s each; fast sibling: test_cca_decoding_equals_the_full_pass
@pytest.mark.parametrize("widths", [(3, 2), (1, 1), (2, 3)])
def test_cca_equals_its_definition_in_numpy(widths):
  cfg = CCA.replace(cca_depthwise_width=widths[0], cca_grouped_width=widths[1])
  p = _params(cfg, seed=widths[0])
  rng = np.random.default_rng(1)
  q, k, v = (rng.normal(size=(2, 6, n, w)).astype(np.float32) for n, w in ((6, 5), (2, 5), (2, 7)))
  got = cca.CCA.on_qkv(p, *(jnp.asarray(a) for a in (q, k, v)), cfg=cfg)
  for g, w in zip(got, _numpy_cca(p, q, k, v, cfg)):
    np.testing.assert_allclose(np.asarray(g), w, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("cfg, chunks", [
    (CCA, (3, 3)),  # one compile; the second chunk starts from a state of 3 tokens (W₀ + W₁ − 2)
    pytest.param(CCA.replace(window=3, cca_depthwise_width=1, cca_grouped_width=1, use_bias=False), (3, 1, 2, 1),
                 marks=pytest.mark.slow)], ids=["gqa", "window_width1"])
def test_cca_decoding_equals_the_full_pass(cfg, chunks):
  """Through the KV cache (and a window's ring) with the convolutions' and the delayed values' state, in uneven
  steps."""
  v = api.get_variant("per_head")
  p = _params(cfg, seed=8)
  x = jnp.asarray(np.random.default_rng(9).standard_normal((2, sum(chunks), cfg.d_model)), jnp.float32)
  full = jit_apply("per_head", p, x, cfg=cfg, is_causal=True)
  c = jax.jit(lambda p: cache.init(v, p, cfg, 2, sum(chunks)))(p)
  step = jax.jit(lambda p, x, c, i: cache.decode_step(v, p, x, c, i, cfg=cfg))
  ys, index = [], 0
  for n in chunks:
    y, c = step(p, x[:, index:index + n], c, index)
    ys.append(y)
    index += n
  np.testing.assert_allclose(np.concatenate(ys, 1), full, atol=3e-5)


def test_cca_counts_in_closed_form():
  T, S = 5, 9
  plain = CCA.replace(cca=False, cca_depthwise_width=2, cca_grouped_width=2)
  H, G, K, W0, W1 = CCA.num_heads, CCA.num_kv_heads, CCA.d_k, 3, 2
  added = (H + G) * K * (W0 + W1 * K + 2) + G
  assert count.param_counts("per_head", CCA)["stored"] - count.param_counts("per_head", plain)["stored"] == added
  assert count.param_counts("per_head", CCA)["analytic"] == count.param_counts("per_head", CCA)["stored"]
  assert count.flops("per_head", CCA, T, S) - count.flops("per_head", plain, T, S) \
      == 2 * (W0 + W1 * K) * K * (T * H + S * G)
  assert count.score_weight_count("per_head", CCA) - count.score_weight_count("per_head", plain) == added
  assert count.kv_cache_bytes_per_token("per_head", CCA) == count.kv_cache_bytes_per_token("per_head", plain)


@pytest.mark.parametrize("changes, field", [
    ({"cca_depthwise_width": 0}, "cca_depthwise_width"), ({"cca_grouped_width": -1}, "cca_grouped_width"),
    ({"cca_depthwise_width": True}, "cca_depthwise_width"), ({"cca_grouped_width": 2.0}, "cca_grouped_width"),
    ({"cca": "yes"}, "cca"), ({"num_kv_heads": 3}, "num_kv_heads"),  # 3 query-head groups of 4 heads: none
    ({"num_kv_heads": 1, "d_v": 3}, "cca")])  # G·d_v = 3 odd: no current and delayed halves
def test_cca_bad_options_refused_by_name_before_tracing(changes, field):
  with pytest.raises(ConfigError, match=f"{field}=.* is not allowed"):
    HeadConfig(d_model=8, num_heads=4, d_k=4, **({"cca": True} | changes))


def test_cca_widths_without_cca_refused():
  with pytest.raises(ConfigError, match="cca_grouped_width=3 is not allowed: 2 .* when cca=False"):
    HeadConfig(d_model=8, num_heads=2, cca_grouped_width=3)


@pytest.mark.parametrize("variant", ["mla", "talking_heads", "merged", "gated_deltanet", "compressed"])
def test_cca_refused_where_it_cannot_act(variant):
  cfg = HeadConfig(d_model=8, num_heads=2, use_bias=False, cca=True)
  with pytest.raises(ConfigError, match="cca=True is not allowed"):
    api.check_config(variant, cfg)


@pytest.mark.slow  # the kit compiles every property: ~15 s a variant; the fast tests above are its siblings
@pytest.mark.parametrize("variant", ["per_head", "fused", "two_stage", "split_input"])
def test_the_kit_passes_with_cca(variant):
  testing.check_mechanism(mechanisms.MECHANISMS["cca"], variants=[variant])


@pytest.mark.slow  # fast sibling: test_cca_decoding_equals_the_full_pass
def test_a_decoder_with_cca_generates_as_its_full_pass():
  """DecoderLM layers with cca (a window ring in one): greedy decoding equals greedy decoding by the full pass
  (tests/hf_hybrid.full_pass_check); kv_source refuses it by name."""
  from flax import nnx
  from attn.nn import DecoderLM, ModelConfig
  from attn.nn.decoding import generate
  from hf_hybrid import full_pass_check  # tests/hf_hybrid.py
  cfg = ModelConfig(vocab_size=23, d_model=16, num_layers=2, num_heads=4, num_kv_heads=2, d_k=6, d_v=6, d_ff=24,
                    positional="rope", rope_dim=4, cca=True, cca_grouped_width=3, window=4, global_every=2)
  model = DecoderLM(cfg, rngs=nnx.Rngs(0))
  prompt = np.random.default_rng(10).integers(0, 23, (2, 3))
  got = np.asarray(generate(model, jnp.asarray(prompt), 6))
  np.testing.assert_array_equal(got, full_pass_check(model, prompt, got))
  with pytest.raises(ConfigError, match="cca=True is not allowed.*kv_source"):
    cfg.replace(window=None, global_every=0, kv_source=(0, 0))
