"""attn.analysis.attention_stats against hand-computed patterns, and models' return_weights."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attn
from attn import ConfigError
from attn.analysis import attention_stats, head_js, js_divergence
from attn.nn import DecoderLM, SequenceClassifier
from attn.nn.config import ModelConfig

stats = jax.jit(attention_stats)


def softmax_rows(logits, mask):
  """Row softmax over allowed keys in numpy; rows without keys are zeros."""
  z = np.where(mask, logits, -np.inf)
  top = np.max(np.where(mask, logits, -1e30), axis=-1, keepdims=True)
  e = np.where(mask, np.exp(z - top), 0.0)
  total = e.sum(-1, keepdims=True)
  return np.where(total > 0, e / np.where(total > 0, total, 1.0), 0.0)


@pytest.mark.parametrize("S", [1, 5, pytest.param(16, marks=pytest.mark.slow)])  # one key, and several: fast
def test_uniform_attention_over_S_keys_has_entropy_log_S(S):
  w = jnp.full((3, 2, 4, S), 1.0 / S)
  out = stats(w)
  np.testing.assert_allclose(out["entropy"], [math.log(S)] * 2, atol=1e-5)
  np.testing.assert_allclose(out["max_entropy"], math.log(S), atol=1e-5)
  np.testing.assert_allclose(out["confidence"], [1.0 / S] * 2, rtol=1e-6)
  np.testing.assert_allclose(out["rank"], [1.0, 1.0])  # every query row the same


def test_uniform_causal_attention_averages_log_of_the_visible_keys():
  T = 7
  causal = np.tril(np.ones((T, T), bool))
  w = np.broadcast_to(causal / causal.sum(1, keepdims=True), (2, 3, T, T))
  out = stats(jnp.asarray(w, jnp.float32), jnp.asarray(causal))
  want_entropy = np.mean([math.log(t + 1) for t in range(T)])
  want_distance = np.mean([np.mean(np.arange(t + 1)) for t in range(T)])  # mean of t - s over s <= t
  np.testing.assert_allclose(out["entropy"], [want_entropy] * 3, rtol=1e-5)
  np.testing.assert_allclose(out["distance"], [want_distance] * 3, rtol=1e-5)
  np.testing.assert_allclose(out["confidence"], [np.mean([1 / (t + 1) for t in range(T)])] * 3, rtol=1e-5)
  np.testing.assert_allclose(out["rank"], [T] * 3)  # triangular, σ_min/σ_max ≈ 0.1 at T=7


def test_one_hot_heads_read_their_key_distance_with_zero_entropy():
  T = 6
  prev = np.eye(T, k=-1)
  prev[0, 0] = 1.0  # query t reads t-1 (query 0 itself)
  first = np.zeros((T, T))
  first[:, 0] = 1.0  # every query reads key 0
  w = jnp.asarray(np.stack([prev, first])[None], jnp.float32)
  out = stats(w, jnp.asarray(np.tril(np.ones((T, T), bool))))
  np.testing.assert_allclose(out["entropy"], [0.0, 0.0], atol=1e-6)
  np.testing.assert_allclose(out["confidence"], [1.0, 1.0])
  np.testing.assert_allclose(out["distance"], [(T - 1) / T, np.mean(np.arange(T))], rtol=1e-6)
  np.testing.assert_allclose(out["rank"], [T - 1, 1])  # rows 0 and 1 of prev are both e_0


def test_rows_without_keys_are_left_out():
  T, S = 4, 5
  mask = np.ones((1, 1, T, S), bool)
  mask[..., 2:, :] = False  # queries 2 and 3 are padding: no keys
  one_hot = np.zeros((1, 1, T, S))
  one_hot[..., :2, 1] = 1.0
  out = stats(jnp.asarray(one_hot, jnp.float32), jnp.asarray(mask))
  np.testing.assert_allclose(out["confidence"], [1.0])  # a mean over all four rows would give 0.5
  np.testing.assert_allclose(out["entropy"], [0.0], atol=1e-6)
  np.testing.assert_allclose(out["max_entropy"], math.log(S), rtol=1e-6)


def test_js_of_identical_heads_is_0_and_of_disjoint_one_hot_heads_log_2():
  T, S = 5, 6
  rng = np.random.default_rng(0)
  same = softmax_rows(rng.standard_normal((2, 1, T, S)), np.ones((T, S), bool))
  w = jnp.asarray(np.concatenate([same, same], axis=1), jnp.float32)
  np.testing.assert_allclose(stats(w)["diversity"], 0.0, atol=1e-6)
  a, b = np.zeros((T, S)), np.zeros((T, S))
  a[:, 0], b[:, 3] = 1.0, 1.0
  js = jax.jit(head_js)(jnp.asarray(np.stack([a, b, a])[None], jnp.float32))  # whole: op by op compiles each op
  want = np.array([[0, 1, 0], [1, 0, 1], [0, 1, 0]]) * math.log(2)
  np.testing.assert_allclose(js, want, atol=1e-6)
  np.testing.assert_allclose(stats(jnp.asarray(np.stack([a, b])[None], jnp.float32))["diversity"],
                             math.log(2), rtol=1e-6)


def test_js_divergence_matches_a_numpy_formula():
  rng = np.random.default_rng(1)
  p, q = rng.dirichlet(np.ones(7), 4), rng.dirichlet(np.ones(7), 4)
  m = (p + q) / 2
  want = 0.5 * (p * np.log(p / m)).sum(-1) + 0.5 * (q * np.log(q / m)).sum(-1)
  np.testing.assert_allclose(jax.jit(js_divergence)(jnp.asarray(p), jnp.asarray(q)), want, rtol=1e-5)
  assert np.all(want > 0) and np.all(want < math.log(2))


def test_one_head_has_no_diversity():
  assert np.isnan(stats(jnp.full((1, 1, 3, 3), 1 / 3))["diversity"])


def test_bad_inputs_are_refused():
  with pytest.raises(ConfigError, match=r"weights\.shape"):
    attention_stats(jnp.ones((2, 3, 4)))
  with pytest.raises(ConfigError, match=r"mask\.shape"):
    attention_stats(jnp.ones((2, 3, 4, 5)), jnp.ones((3, 5), bool))
  with pytest.raises(ConfigError, match=r"mask\.dtype"):
    attention_stats(jnp.ones((2, 3, 4, 5)), jnp.ones((4, 5)))


CFG = ModelConfig(vocab_size=13, d_model=16, num_layers=2, num_heads=4, d_ff=24, max_len=12,
                  variant="per_head")


@pytest.mark.slow
def test_decoder_weights_are_causal_softmax_rows_and_leave_logits_unchanged():
  model = DecoderLM(CFG, rngs=nnx.Rngs(0))
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, 13, (3, 9)), jnp.int32)
  graphdef, state = nnx.split(model)
  run = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t, return_weights=True))
  logits, weights = run(state, tokens)
  np.testing.assert_allclose(logits, model(tokens), atol=1e-6)
  assert len(weights) == 2
  for w in weights:
    assert w.shape == (3, 4, 9, 9)
    np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-5)
    assert float(jnp.abs(jnp.triu(w, 1)).max()) == 0.0


@pytest.mark.slow
def test_classifier_weights_cover_cls_and_mask_padding():
  model = SequenceClassifier(CFG.replace(num_classes=3, variant="fused"), rngs=nnx.Rngs(1))
  tokens = jnp.asarray(np.random.default_rng(3).integers(0, 13, (2, 7)), jnp.int32)
  lengths = jnp.asarray([7, 4])
  logits, weights = model(tokens, lengths, return_weights=True)
  np.testing.assert_allclose(logits, model(tokens, lengths), atol=1e-6)
  w = weights[1]
  assert w.shape == (2, 4, 8, 8)  # [CLS] + 7 positions
  assert float(jnp.abs(w[1, :, :, 5:]).max()) == 0.0  # example 1 has [CLS] + 4 real keys
  np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-5)


@pytest.mark.slow  # two trained-size layers through the whole statistics pass
def test_per_head_and_fused_carrying_one_function_give_equal_statistics():
  a = DecoderLM(CFG, rngs=nnx.Rngs(4))
  b = DecoderLM(CFG.replace(variant="fused"), rngs=nnx.Rngs(5))
  for src, dst in zip(a.blocks, b.blocks):
    dst.attn.load_params(attn.convert(src.attn.params_dict(), "per_head", "fused", CFG.head))
  rest = lambda m: nnx.state(m, nnx.Not(nnx.PathContains("attn")))
  nnx.update(b, rest(a))  # everything but attention copied; attention converted
  tokens = jnp.asarray(np.random.default_rng(6).integers(0, 13, (4, 10)), jnp.int32)
  (la, wa), (lb, wb) = a(tokens, return_weights=True), b(tokens, return_weights=True)
  np.testing.assert_allclose(la, lb, atol=1e-5)
  assert float(jnp.abs(a(tokens) - DecoderLM(CFG, rngs=nnx.Rngs(5))(tokens)).max()) > 1e-3
  causal = jnp.tril(jnp.ones((10, 10), bool))
  for x, y in zip(wa, wb):
    sa, sb = stats(x, causal), stats(y, causal)
    for key in sa:
      np.testing.assert_allclose(sa[key], sb[key], atol=1e-5, rtol=1e-5, err_msg=key)
    assert float(sa["diversity"]) > 0.0


def test_first_mass_and_sink_mass_against_hand_computed_rows():
  T = 6
  causal = np.tril(np.ones((T, T), bool))
  first = np.zeros((T, T))
  first[:, 0] = 1.0  # head 0: every query on key 0
  uniform = causal / causal.sum(1, keepdims=True)  # head 1: uniform over the visible keys
  sinky = 0.5 * uniform  # head 2: a learned sink takes half of every row
  w = jnp.asarray(np.stack([first, uniform, sinky])[None], jnp.float32)
  out = stats(w, jnp.asarray(causal))
  rows = range(1, T)  # row 0 sees one key only: no choice, not counted for first_mass
  np.testing.assert_allclose(out["first_mass"], [1.0, np.mean([1 / (t + 1) for t in rows]),
                                                 0.5 * np.mean([1 / (t + 1) for t in rows])], rtol=1e-5)
  np.testing.assert_allclose(out["sink_mass"], [0.0, 0.0, 0.5], atol=1e-6)
  np.testing.assert_allclose(out["row_sum"], [1.0, 1.0, 0.5], atol=1e-6)


@pytest.mark.parametrize("probability, signed", [("softmax", False), ("sigmoid", False), ("relu", False),
                                                 ("softmax", True)])
def test_summary_keeps_entropy_and_sink_mass_only_for_rows_that_are_distributions(probability, signed):
  from attn.experiments.reading.analyze import summarize
  rng = np.random.default_rng(7)
  T = 5
  causal = np.tril(np.ones((T, T), bool))
  w = rng.uniform(0.0, 0.4, (2, 3, T, T)) * causal  # rows summing to anything, as sigmoid's do
  attention = {k: np.asarray(v).tolist() for k, v in stats(jnp.asarray(w, jnp.float32), jnp.asarray(causal)).items()}
  layer = {"attention": {**attention, "residual_max": 3.0, "residual_median": 1.0},
           "qk": {"effective_rank": [1.0] * 3, "rank": [1] * 3}, "ov": {"effective_rank": [1.0] * 3, "rank": [1] * 3}}
  out = summarize([layer], {"prunable_fraction": 0.0}, signed, probability)
  np.testing.assert_allclose(out["row_sum"], w.sum(-1).mean(), rtol=1e-5)  # every causal row has a key
  distributions = probability == "softmax" and not signed
  for key in ("attention_entropy", "head_diversity", "sink_mass"):
    assert (out[key] is not None) == distributions, key
