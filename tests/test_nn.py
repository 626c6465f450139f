"""The NNX shell: MultiHeadAttention over any variant, small models, their configs and counts."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import attn
from attn.nn import DecoderLM, Encoder, EncoderDecoder, MultiHeadAttention, SequenceClassifier
from attn.nn.config import ModelConfig
from conftest import CONFIGS, for_variant, tier, variant_params

TOL = dict(rtol=1e-5, atol=1e-5)
TINY = ModelConfig(vocab_size=13, d_model=16, num_layers=2, num_heads=2, d_ff=24, max_len=8)


def randn(seed, shape):
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def tokens(seed, shape, vocab=TINY.vocab_size):
  return np.random.default_rng(seed).integers(0, vocab, shape).astype(np.int32)


def param_tree(model):
  """Path -> array of every nnx.Param in the model."""
  flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
  return {"/".join(map(str, path)): v[...] for path, v in flat}


# --- MultiHeadAttention -------------------------------------------------------------------------


@nnx.jit
def run(model, *args):
  """model(*args), compiled: one compilation instead of one per operation."""
  return model(*args)


@nnx.jit(static_argnames="is_causal")
def run_layer(layer, x, is_causal=False):
  """An attention layer on x, compiled; is_causal for a fixed-state head, which is causal only."""
  return layer(x, is_causal=is_causal)


apply_jit = jax.jit(attn.apply, static_argnums=0, static_argnames=("cfg", "is_causal"))


@nnx.jit
def _module_out(m, x, c, mask):
  T = x.shape[1]
  return m(x, c, mask=mask), m(x, mask=jnp.tri(T, dtype=bool), return_weights=True)


# The module is a shell over the variant (whose matrix runs every config): fast at G < H with d_v != d_k and at
# h not dividing d_model, the rest slow.
@pytest.mark.parametrize("cname", [pytest.param(c, marks=tier("per_head", c) or (
    () if c in ("gqa", "h_not_dividing_D") else pytest.mark.slow)) for c in sorted(CONFIGS)])
def test_module_matches_per_head_apply_on_converted_params(cname):
  """A fused module against the per_head functional layer on the module's own weights."""
  cfg = CONFIGS[cname]
  m = MultiHeadAttention(cfg, "fused", rngs=nnx.Rngs(0))
  fused = {k.split("/")[-1]: a for k, a in param_tree(m).items()}
  fused = {k: a + 0.1 * randn(i, a.shape) for i, (k, a) in enumerate(sorted(fused.items()))}
  m.load_params(fused)  # nonzero biases
  per_head = attn.convert(fused, "fused", "per_head", cfg)
  B, T, S = 2, 3, 5
  x, c = randn(10, (B, T, cfg.d_model)), randn(11, (B, S, cfg.d_model))
  mask = np.random.default_rng(12).random((B, 1, T, S)) < 0.6
  mask[..., 1, :] = False  # a fully masked row gives zeros
  got, (y, w) = _module_out(m, x, c, mask)
  ref = apply_jit("per_head", per_head, x, c, cfg=cfg, mask=mask)
  np.testing.assert_allclose(got, ref, **TOL)
  assert y.shape == (B, T, cfg.d_model) and w.shape == (B, cfg.num_heads, T, T)


# The module reads any variant's record the same way: fast on merged (names and shapes furthest from the
# module's default, fused), the others slow.
@pytest.mark.parametrize("variant", variant_params(fast=("merged",)))
def test_module_params_are_exactly_the_variants(variant):
  cfg = for_variant(variant, attn.HeadConfig(d_model=12, num_heads=3, d_k=4, d_v=5, num_kv_heads=1))
  m = MultiHeadAttention(cfg, variant, rngs=nnx.Rngs(1))
  tree = param_tree(m)
  want = attn.param_shapes(variant, cfg)
  assert {k.split("/")[-1]: a.shape for k, a in tree.items()} == want
  assert count_params(m) == attn.get_variant(variant).param_count(cfg)
  plain = m.params_dict()
  assert set(plain) == set(want) and all(isinstance(a, jax.Array) for a in plain.values())
  other = attn.init(variant, jax.random.PRNGKey(5), cfg)
  m.load_params(other)
  for k in want:
    np.testing.assert_array_equal(m.params_dict()[k], other[k])
  m2 = MultiHeadAttention.from_params(cfg, variant, other)
  x = randn(0, (1, 3, cfg.d_model))
  causal = attn.get_variant(variant).init_state is not None  # a fixed-state head is causal only
  y = run_layer(m, x, is_causal=causal)
  np.testing.assert_allclose(y, apply_jit(variant, other, x, cfg=cfg, is_causal=causal), **TOL)
  np.testing.assert_array_equal(run_layer(m2, x, is_causal=causal), y)


def test_module_refuses_bad_params_and_missing_rngs():
  cfg = attn.HeadConfig(d_model=8, num_heads=2)
  m = MultiHeadAttention(cfg, "per_head", rngs=nnx.Rngs(0))
  bad = dict(m.params_dict(), w_o=np.zeros((2, 4, 9), np.float32))
  with pytest.raises(attn.ConfigError, match=r"params\['w_o'\].shape=\(2, 4, 9\)"):
    m.load_params(bad)
  with pytest.raises(attn.ConfigError, match="params="):
    MultiHeadAttention.from_params(cfg, "fused", m.params_dict())
  with pytest.raises(attn.ConfigError, match="rngs=None"):
    MultiHeadAttention(cfg, "fused")
  with pytest.raises(attn.ConfigError, match="variant='nope'"):
    MultiHeadAttention(cfg, "nope", rngs=nnx.Rngs(0))


def test_module_gradient_step_changes_params_and_lowers_loss():
  cfg = attn.HeadConfig(d_model=8, num_heads=2, num_kv_heads=1)
  m = MultiHeadAttention(cfg, "fused", rngs=nnx.Rngs(0))
  opt = nnx.Optimizer(m, optax.sgd(0.1), wrt=nnx.Param)
  x, y = randn(0, (2, 4, 8)), randn(1, (2, 4, 8))

  @nnx.jit
  def step(m, opt):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(m)
    opt.update(m, grads)
    return loss

  before = m.params_dict()
  losses = [float(step(m, opt)) for _ in range(3)]
  after = m.params_dict()
  assert all(not np.allclose(before[k], after[k]) for k in before)
  assert losses[2] < losses[0]


def test_module_bf16():
  cfg = attn.HeadConfig(d_model=8, num_heads=2)
  m = MultiHeadAttention(cfg, "fused", rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
  x = jnp.asarray(randn(0, (1, 3, 8)), jnp.bfloat16)
  y = nnx.jit(lambda m, x: m(x, mask=np.tri(3, dtype=bool)))(m, x)  # one compile, not op by op
  assert y.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(y)))


# --- ModelConfig ---------------------------------------------------------------------------------


@pytest.mark.parametrize("changes,match", [
    (dict(vocab_size=0), "vocab_size=0 .*integer >= 1"),
    (dict(num_segments=-1), "num_segments=-1"),
    (dict(positional="rotary"), "positional='rotary' .*'learned', 'sinusoidal', 'none', 'rope'"),
    (dict(positional="rope"), "rope_dim=0 .*positional='rope'"),
    (dict(norm="middle"), "norm='middle' .*'pre', 'post', 'sandwich'"),
    (dict(activation="swish"), "activation='swish'"),
    (dict(pooling="max"), "pooling='max' .*'cls', 'mean'"),
    (dict(embed_norm=1), "embed_norm=1 .*True or False"),
    (dict(num_heads=3), "d_k=None .*num_heads=3 does not divide d_model=16"),
    (dict(num_kv_heads=3, num_heads=4), "num_kv_heads=3 .*divisor of num_heads=4"),
    (dict(variant="nope"), "variant='nope'"),
])
def test_model_config_validation(changes, match):
  with pytest.raises(attn.ConfigError, match=match):
    TINY.replace(**changes)


@pytest.mark.parametrize("model,changes,match", [
    (DecoderLM, dict(pooler=True), "pooler=True .*False for DecoderLM"),
    (DecoderLM, dict(num_segments=2), "num_segments=2"),
    (SequenceClassifier, dict(), "num_classes=0 .*> 0 for SequenceClassifier"),
    (EncoderDecoder, dict(), "num_decoder_layers=0"),
])
def test_models_refuse_fields_they_would_ignore(model, changes, match):
  with pytest.raises(attn.ConfigError, match=match):
    nnx.eval_shape(lambda: model(TINY.replace(**changes), rngs=nnx.Rngs(0)))


def test_head_config_from_model_config():
  cfg = TINY.replace(d_k=3, d_v=5, num_kv_heads=1, use_bias=False)
  assert cfg.head == attn.HeadConfig(d_model=16, num_heads=2, d_k=3, d_v=5, num_kv_heads=1,
                                     use_bias=False)


# --- Parameter counts (abstract: nnx.eval_shape allocates nothing) -------------------------------

BERT_BASE = ModelConfig(vocab_size=30522, d_model=768, num_layers=12, num_heads=12, d_ff=3072,
                        num_segments=2, max_len=512, embed_norm=True, norm="post",
                        final_norm=False, pooler=True)
GPT2_SMALL = ModelConfig(vocab_size=50257, d_model=768, num_layers=12, num_heads=12, d_ff=3072,
                         max_len=1024)


def count_params(model) -> int:
  """Elements of the model's nnx.Param arrays: the tree attn.count.model_param_count predicts."""
  return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def _abstract_count(model, cfg):
  return count_params(nnx.eval_shape(lambda: model(cfg, rngs=nnx.Rngs(0))))


@pytest.mark.slow
def test_vaswani_count_in_closed_form():
  V, D, F, L = 37000, 512, 2048, 6
  cfg = ModelConfig(vocab_size=V, d_model=D, num_layers=L, num_heads=8, d_ff=F,
                    positional="sinusoidal", norm="post", final_norm=False, activation="relu",
                    num_decoder_layers=L)
  attn_layer, mlp, ln = 4 * D * D + 4 * D, 2 * D * F + F + D, 2 * D
  want = V * D + L * (attn_layer + mlp + 2 * ln) + L * (2 * attn_layer + mlp + 3 * ln)
  assert _abstract_count(EncoderDecoder, cfg) == want
  unshared = cfg.replace(share_src_tgt_embeddings=False, tie_embeddings=False, final_norm=True)
  # + target token table + output (D, V) and bias + a final LayerNorm per stack
  assert _abstract_count(EncoderDecoder, unshared) == want + V * D + (D * V + V) + 2 * ln


@pytest.mark.slow
def test_switches_change_counts_by_their_closed_form():
  V, D, F, L, ln = 50257, 768, 3072, 12, 2 * 768
  plain = GPT2_SMALL.replace(tie_embeddings=False, use_bias=False, layernorm=False)
  # per layer: attention biases 4D, MLP biases F + D, two LayerNorms; final LayerNorm; output D·V
  assert _abstract_count(DecoderLM, plain) == (124_439_808 - L * (4 * D + F + D + 2 * ln) - ln
                                               + D * V)
  for pooling, cls in (("cls", D), ("mean", 0)):
    clf = BERT_BASE.replace(num_classes=3, pooling=pooling)
    assert _abstract_count(SequenceClassifier, clf) == 109_482_240 + cls + D * 3 + 3


# --- Models: forward checks, causality, padding ---------------------------------------------------


def test_models_check_inputs_before_tracing():
  lm = DecoderLM(TINY, rngs=nnx.Rngs(0))
  with pytest.raises(attn.ConfigError, match=r"tokens='ids in \[-1, 3\]'.*\[0, 13\)"):
    lm(np.array([[1, -1, 3]], np.int32))
  with pytest.raises(attn.ConfigError, match="tokens.shape\\[1\\]=9 .*max_len=8"):
    lm(tokens(0, (1, 9)))
  with pytest.raises(attn.ConfigError, match="tokens.dtype"):
    lm(randn(0, (1, 3)))
  # Under jit the ids are not known: out-of-range ones embed as NaN instead of wrapping.
  out = run(lm, np.array([[1, 2, 13]], np.int32))
  assert bool(jnp.all(jnp.isnan(out[0, 2])))
  clf = SequenceClassifier(TINY.replace(num_classes=2), rngs=nnx.Rngs(0))
  with pytest.raises(attn.ConfigError, match="tokens.shape\\[1\\]=8 .*max_len=7 .*\\[CLS\\]"):
    clf(tokens(0, (1, 8)))
  with pytest.raises(attn.ConfigError, match="lengths='lengths in \\[2, 6\\]'"):
    clf(tokens(0, (2, 5)), np.array([2, 6]))


def test_decoder_lm_is_causal_through_gradients():
  lm = DecoderLM(TINY, rngs=nnx.Rngs(0))
  toks, t = tokens(1, (2, 6)), 2
  graphdef, state = nnx.split(lm)
  grads = jax.jit(jax.grad(lambda s: nnx.merge(graphdef, s)(toks)[:, t].sum()))(state)
  g_pos = np.abs(np.asarray(grads["embed"]["position"][...])).sum(axis=1)
  assert np.all(g_pos[:t + 1] > 0) and np.all(g_pos[t + 1:] == 0)
  changed = toks.copy()
  changed[:, t + 1:] = (changed[:, t + 1:] + 1) % TINY.vocab_size
  a, b = run(lm, toks), run(lm, changed)
  np.testing.assert_allclose(a[:, :t + 1], b[:, :t + 1], rtol=0, atol=1e-6)
  assert not np.allclose(a[:, t + 1:], b[:, t + 1:])


def test_encoder_decoder_is_causal_and_ignores_source_padding():
  cfg = TINY.replace(num_layers=1, num_decoder_layers=1, positional="sinusoidal", norm="post",
                     final_norm=False)
  model = EncoderDecoder(cfg, rngs=nnx.Rngs(0))
  assert model.tgt_embed.token is model.encoder.embed.token  # shared table
  src, tgt, lengths = tokens(2, (2, 5)), tokens(3, (2, 4)), np.array([3, 5])
  out = run(model, src, tgt, lengths)
  assert out.shape == (2, 4, cfg.vocab_size)
  tgt2 = tgt.copy()
  tgt2[:, 2:] = (tgt2[:, 2:] + 1) % cfg.vocab_size
  np.testing.assert_allclose(run(model, src, tgt2, lengths)[:, :2], out[:, :2], **TOL)
  src2 = src.copy()
  src2[0, 3:] = (src2[0, 3:] + 1) % cfg.vocab_size  # example 0 is padded after 3
  np.testing.assert_allclose(run(model, src2, tgt, lengths), out, **TOL)
  # Without lengths the change is seen.
  assert not np.allclose(run(model, src2, tgt, None), run(model, src, tgt, None))


@pytest.mark.parametrize("pooling", [pytest.param("cls", marks=pytest.mark.slow), "mean"])  # mean reads every length
def test_classifier_ignores_padding(pooling):
  cfg = TINY.replace(num_classes=3, pooling=pooling, pooler=True, num_segments=2, embed_norm=True,
                     norm="post")
  clf = SequenceClassifier(cfg, rngs=nnx.Rngs(0))
  toks, lengths = tokens(4, (2, 6)), np.array([2, 6])
  changed = toks.copy()
  changed[0, 2:] = (changed[0, 2:] + 5) % cfg.vocab_size
  a = run(clf, toks, lengths)
  assert a.shape == (2, 3)
  np.testing.assert_allclose(run(clf, changed, lengths), a, **TOL)
  # Without lengths the change is seen.
  assert not np.allclose(run(clf, changed, None)[0], run(clf, toks, None)[0])


def test_encoder_pooler_and_segments():
  cfg = TINY.replace(num_segments=2, pooler=True, norm="post", final_norm=False, embed_norm=True)
  enc = Encoder(cfg, rngs=nnx.Rngs(0))
  toks = tokens(5, (2, 4))
  segs = np.array([[0, 0, 1, 1], [0, 1, 1, 1]], np.int32)
  h, pooled = run(enc, toks, segs)
  assert h.shape == (2, 4, 16) and pooled.shape == (2, 16)
  want = np.tanh(h[:, 0] @ enc.pooler.kernel[...] + enc.pooler.bias[...])
  np.testing.assert_allclose(pooled, want, **TOL)
  assert not np.allclose(run(enc, toks, None)[0], h)  # token types matter
  with pytest.raises(attn.ConfigError, match="segments="):
    enc(toks, segs + 1)
  with pytest.raises(attn.ConfigError, match="segments="):
    Encoder(TINY, rngs=nnx.Rngs(0))(toks, segs)


# --- Head gates (head_mask): a zero gate is that layer's w_o[h] zeroed ---------------------------


GATED = TINY.replace(num_heads=4, num_kv_heads=2, d_k=3, d_v=5)  # fused, GQA, d_v != d_k


def zero_heads(module: MultiHeadAttention, heads) -> None:
  """Zeroes w_o[h] (head h's (V,D) slice of W^O, however the variant stores w_o) in place."""
  cfg = module.cfg
  w_o = np.array(module.params["w_o"][...])
  w_HVD = w_o.reshape(cfg.num_heads, cfg.d_v, cfg.d_model)
  w_HVD[list(heads)] = 0.0
  module.params["w_o"][...] = jnp.asarray(w_HVD.reshape(w_o.shape))


def test_decoder_lm_head_mask_is_zeroing_w_o():
  lm = DecoderLM(GATED, rngs=nnx.Rngs(0))
  toks = tokens(8, (2, 6))
  y = run(lm, toks)
  np.testing.assert_allclose(run(lm, toks, np.ones((2, 4), np.float32)), y, **TOL)
  xi_LH = np.ones((2, 4), np.float32)
  xi_LH[1, 2] = 0.0
  gated = run(lm, toks, xi_LH)
  assert not np.allclose(gated, y)
  ref = DecoderLM(GATED, rngs=nnx.Rngs(0))
  zero_heads(ref.blocks[1].attn, [2])
  np.testing.assert_allclose(gated, run(ref, toks), **TOL)
  xi_BLH = np.ones((2, 2, 4), np.float32)  # per example: different heads off
  xi_BLH[0, 0, 1] = xi_BLH[1, 1, 3] = xi_BLH[1, 0, 0] = 0.0
  gated = run(lm, toks, xi_BLH)
  for b in range(2):
    ref = DecoderLM(GATED, rngs=nnx.Rngs(0))
    for layer in range(2):
      zero_heads(ref.blocks[layer].attn, np.flatnonzero(xi_BLH[b, layer] == 0))
    np.testing.assert_allclose(gated[b], run(ref, toks)[b], **TOL)


@pytest.mark.slow
def test_classifier_and_encoder_decoder_head_masks():
  cfg = GATED.replace(variant="merged", num_classes=3, norm="post")
  toks, lengths = tokens(9, (2, 5)), np.array([5, 3])
  xi_LH = np.ones((2, 4), np.float32)
  xi_LH[0, 3] = 0.0
  gated = run(SequenceClassifier(cfg, rngs=nnx.Rngs(1)), toks, lengths, None, xi_LH)
  ref = SequenceClassifier(cfg, rngs=nnx.Rngs(1))
  zero_heads(ref.encoder.blocks[0].attn, [3])
  np.testing.assert_allclose(gated, run(ref, toks, lengths), **TOL)
  # EncoderDecoder: rows are the encoder's self-attention layers, then the decoder's.
  cfg = GATED.replace(variant="per_head", num_layers=1, num_decoder_layers=2)
  src, tgt = tokens(10, (2, 5)), tokens(11, (2, 4))
  xi_LH = np.ones((3, 4), np.float32)
  xi_LH[0, 1] = xi_LH[2, 0] = 0.0
  gated = run(EncoderDecoder(cfg, rngs=nnx.Rngs(2)), src, tgt, None, xi_LH)
  ref = EncoderDecoder(cfg, rngs=nnx.Rngs(2))
  zero_heads(ref.encoder.blocks[0].attn, [1])
  zero_heads(ref.decoder[1].attn, [0])
  np.testing.assert_allclose(gated, run(ref, src, tgt), **TOL)
  with pytest.raises(attn.ConfigError, match=re.escape(
      "head_mask.shape=(2, 4) is not allowed: (L, H)=(3, 4) or (B, L, H)=(2, 3, 4)")):
    EncoderDecoder(cfg, rngs=nnx.Rngs(2))(src, tgt, head_mask=np.ones((2, 4), np.float32))


def test_module_and_models_refuse_bad_head_masks():
  lm = DecoderLM(GATED, rngs=nnx.Rngs(0))
  toks = tokens(8, (2, 6))
  for shape in ((4,), (2, 3), (3, 2, 4), (2, 2, 4, 1)):
    with pytest.raises(attn.ConfigError, match=re.escape(
        f"head_mask.shape={shape} is not allowed: (L, H)=(2, 4) or (B, L, H)=(2, 2, 4)")):
      lm(toks, np.ones(shape, np.float32))
  with pytest.raises(attn.ConfigError, match="head_mask.dtype='bool'"):
    lm(toks, np.ones((2, 4), bool))
  m = lm.blocks[0].attn
  with pytest.raises(attn.ConfigError, match=re.escape("head_mask.shape=(2, 2) is not allowed: "
                                                       "(H,)=(4,) or (B, H)=(1, 4)")):
    m(randn(0, (1, 3, 16)), head_mask=np.ones((2, 2), np.float32))


# --- One real training step per model: loss finite and falling on a fixed batch ------------------


def _train(model, loss_fn, steps=4):
  opt = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)

  @nnx.jit
  def step(model, opt):
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    opt.update(model, grads)
    return loss

  return [float(step(model, opt)) for _ in range(steps)]


def _assert_learns(losses):
  assert all(math.isfinite(v) for v in losses), losses
  assert losses[-1] < losses[0], losses


# A whole-model run, in the slow tier: in the fast tier test_experiments trains it a step on every task,
# and the classifier's and the attention module's losses fall below.
@pytest.mark.slow
def test_decoder_lm_trains():
  lm = DecoderLM(TINY.replace(variant="per_head", tie_embeddings=False, num_layers=1),
                 rngs=nnx.Rngs(0))
  toks = tokens(6, (4, 8))

  def loss_fn(m):
    logits = m(toks[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, toks[:, 1:]).mean()

  _assert_learns(_train(lm, loss_fn))


@pytest.mark.parametrize("pooling", [pytest.param("cls", marks=pytest.mark.slow), "mean"])
def test_sequence_classifier_trains(pooling):
  cfg = TINY.replace(num_classes=3, pooling=pooling, norm="post", activation="relu", num_layers=1)
  clf = SequenceClassifier(cfg, rngs=nnx.Rngs(0))
  toks, lengths, labels = tokens(7, (4, 6)), np.array([6, 3, 1, 4]), np.array([0, 1, 2, 1])

  def loss_fn(m):
    return optax.softmax_cross_entropy_with_integer_labels(m(toks, lengths), labels).mean()

  _assert_learns(_train(clf, loss_fn))


def test_concrete_ids_captured_by_a_jitted_closure_are_checked_not_traced():
  lm = DecoderLM(TINY, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(lm)
  tokens = jnp.ones((2, 5), jnp.int32)  # concrete, but closed over inside jit
  out = jax.jit(lambda s: nnx.merge(graphdef, s)(tokens))(state)
  np.testing.assert_allclose(out, nnx.jit(lambda m, t: m(t))(lm, tokens), atol=1e-5)  # ids traced
