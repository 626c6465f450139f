"""Issue 53's heads: L2 clipping of query/key heads (qk_l2_clip_threshold, Inkling-2) and the delta
rule with negative eigenvalues (linear_allow_neg_eigval, OLMo-Hybrid): against a second
implementation, decoding against the full pass, counts in closed form, refusals by name.
The kit's whole contract on each: the slow tests."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import attn
from attn import api, count, testing
from attn.config import ConfigError, HeadConfig
from attn.testing.variants import AWKWARD
from attn.variants import cache, mechanisms
from attn.variants.linear import core
from conftest import fresh_params, jit_apply, randn

CLIP = AWKWARD["gqa_dv_ne_dk"].replace(qk_l2_clip_threshold=0.7, rope_dim=4)  # d_v != d_k, G < H


def _params(variant, cfg, seed=0, scale=3.0):
  """Random parameters, the projections scaled up so that most head vectors are longer than 0.7."""
  p = fresh_params(variant, cfg, seed)
  return {n: a * scale if n.startswith("w_") else a for n, a in p.items()}


def test_l2_clip_equals_numpy_and_bounds_every_logit():
  x = np.random.default_rng(0).normal(size=(2, 5, 3, 7)).astype(np.float32) * np.array([0.01, 1, 9])[:, None]
  from attn.variants.mechanisms.head_mechanisms import l2_clip
  norm = np.linalg.norm(x, axis=-1, keepdims=True)
  np.testing.assert_allclose(l2_clip(jnp.asarray(x), 0.7), x * np.minimum(0.7 / (norm + 1e-6), 1), rtol=1e-6)
  p = _params("per_head", CLIP)
  x = randn(1, (2, 6, CLIP.d_model))
  _, w = jit_apply("per_head", p, x, cfg=CLIP, return_weights=True, is_causal=True)
  _, w_plain = jit_apply("per_head", p, x, cfg=CLIP.replace(qk_l2_clip_threshold=None), return_weights=True,
                         is_causal=True)
  assert not np.allclose(w, w_plain, atol=1e-3)  # the clip acts at this scale
  # |q·k|·scale <= c²/sqrt(d_k) for every pair: a row's weights lie within e^(±2c²/sqrt(d_k)) of uniform
  bound = np.exp(2 * 0.7 ** 2 / np.sqrt(CLIP.d_k))
  w = np.asarray(w)[0, :, -1]  # the last query sees all 6 keys
  assert (w.max(-1) / w.min(-1) <= bound * (1 + 1e-5)).all()


def test_l2_clip_equals_transformers_inkling2_clip():
  torch = pytest.importorskip("torch")
  inkling2 = pytest.importorskip("transformers.models.inkling2.modeling_inkling2",
                                 reason="this transformers has no inkling2")
  from attn.variants.mechanisms.head_mechanisms import l2_clip
  x = np.random.default_rng(2).normal(size=(3, 4, 2, 6)).astype(np.float32) * 2
  want = inkling2.Inkling2L2Clip(1.3)(torch.tensor(x)).numpy()
  np.testing.assert_allclose(np.asarray(l2_clip(jnp.asarray(x), 1.3)), want, rtol=1e-6, atol=1e-7)


def test_l2_clip_decoding_equals_the_full_pass():
  v = api.get_variant("per_head")
  p = _params("per_head", CLIP, seed=3)
  x = randn(4, (2, 7, CLIP.d_model))
  full = jit_apply("per_head", p, x, cfg=CLIP, is_causal=True)
  c = cache.init(v, p, CLIP, 2, 7)
  step = jax.jit(lambda p, x, c, i: cache.decode_step(v, p, x, c, i, cfg=CLIP))
  ys, index = [], 0
  for n in (4, 1, 2):
    y, c = step(p, x[:, index:index + n], c, index)
    ys.append(y)
    index += n
  np.testing.assert_allclose(np.concatenate(ys, 1), full, atol=2e-5)


def test_l2_clip_counts_in_closed_form():
  T, S = 5, 9
  plain = CLIP.replace(qk_l2_clip_threshold=None)
  assert count.param_counts("per_head", CLIP)["stored"] == count.param_counts("per_head", plain)["stored"]
  extra = count.flops("per_head", CLIP, T, S) - count.flops("per_head", plain, T, S)
  assert extra == 3 * CLIP.d_k * (T * CLIP.num_heads + S * CLIP.num_kv_heads)
  # no closed form for the effective count: which vectors the clip reaches depends on the data
  assert "effective" in count.measured_figures("per_head", CLIP)


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), True, "1"])
def test_l2_clip_threshold_refused_by_name(value):
  with pytest.raises(ConfigError, match="qk_l2_clip_threshold=.* is not allowed"):
    HeadConfig(d_model=8, num_heads=2, qk_l2_clip_threshold=value)


def test_l2_clip_refused_on_a_head_without_query_key_heads():
  cfg = HeadConfig(d_model=8, num_heads=2, qk_l2_clip_threshold=1.0, use_bias=False)
  with pytest.raises(ConfigError, match="qk_l2_clip_threshold"):
    api.check_config("gated_deltanet", cfg)


# The delta rule with β in [0, 2].

def _delta_reference(q, k, v, g, beta):
  """S_t = α_t·S_{t−1} + β_t·k_t·(v_t − α_t·S_{t−1}ᵀk_t)ᵀ, o_t = S_tᵀq_t, token by token in float64."""
  B, T, H, K = q.shape
  S = np.zeros((B, H, K, v.shape[-1]))
  out = np.zeros(v.shape)
  for t in range(T):
    S = np.exp(g[:, t])[..., None, None] * S
    err = v[:, t] - np.einsum("BHKV,BHK->BHV", S, k[:, t])
    S = S + beta[:, t][..., None, None] * np.einsum("BHK,BHV->BHKV", k[:, t], err)
    out[:, t] = np.einsum("BHKV,BHK->BHV", S, q[:, t])
  return out


def test_chunked_delta_rule_with_beta_up_to_two_equals_the_recurrence():
  rng = np.random.default_rng(5)
  B, T, H, K, V = 2, 11, 3, 4, 5  # 11 tokens in chunks of 4: a partial last chunk
  q, k = (rng.normal(size=(B, T, H, K)) for _ in range(2))
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  v, g = rng.normal(size=(B, T, H, V)), -rng.uniform(0, 0.5, (B, T, H))
  beta = 2 / (1 + np.exp(-rng.normal(size=(B, T, H)) * 3))  # 2σ: many above 1
  assert (beta > 1.5).any()
  want = _delta_reference(q, k, v, g, beta)
  f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
  chunked = jax.jit(lambda *a: core.chunked(*a[:3], g=a[3], beta_BTH=a[4], delta=True, chunk=4)[0])
  got = chunked(*map(f32, (q, k, v, g, beta)))
  np.testing.assert_allclose(got, want, atol=2e-4)


@pytest.mark.parametrize("variant", ["gated_deltanet", "kda"])
def test_neg_eigval_counts_in_closed_form(variant):
  cfg = AWKWARD["mqa_nobias"].replace(linear_allow_neg_eigval=True)
  plain = cfg.replace(linear_allow_neg_eigval=False)
  assert count.flops(variant, cfg, 7) - count.flops(variant, plain, 7) == 7 * cfg.num_heads  # β's doubling
  assert api.param_shapes(variant, cfg) == api.param_shapes(variant, plain)  # no parameter added


@pytest.mark.slow  # fast sibling: the chunked rule against the recurrence above; tests/test_hf_olmo_hybrid.py
@pytest.mark.parametrize("variant", ["gated_deltanet", "kda"])
def test_neg_eigval_doubles_beta_and_decodes_as_the_full_pass(variant):
  cfg = AWKWARD["mqa_nobias"].replace(linear_allow_neg_eigval=True, chunk=3)
  v = api.get_variant(variant)
  p = attn.init(variant, jax.random.PRNGKey(6), cfg)
  x = jax.random.normal(jax.random.PRNGKey(7), (2, 7, cfg.d_model))
  full = attn.apply(variant, p, x, cfg=cfg, is_causal=True)
  assert not np.allclose(full, attn.apply(variant, p, x, cfg=cfg.replace(linear_allow_neg_eigval=False),
                                          is_causal=True), atol=1e-3)
  state = cache.init(v, p, cfg, 2, 7)
  ys, index = [], 0
  for n in (3, 1, 3):
    y, state = cache.decode_step(v, p, x[:, index:index + n], state, index, cfg=cfg)
    ys.append(y)
    index += n
  np.testing.assert_allclose(np.concatenate(ys, 1), full, atol=2e-5)


@pytest.mark.parametrize("variant", ["per_head", "mamba2", "linear"])
def test_neg_eigval_refused_on_a_head_that_cannot_take_it(variant):
  cfg = HeadConfig(d_model=8, num_heads=2, use_bias=False, linear_allow_neg_eigval=True)
  with pytest.raises(ConfigError, match="linear_allow_neg_eigval=True is not allowed.*gated_deltanet and kda"):
    api.check_config(variant, cfg)


def test_neg_eigval_must_be_a_bool():
  with pytest.raises(ConfigError, match="linear_allow_neg_eigval=1 is not allowed"):
    HeadConfig(d_model=8, num_heads=2, linear_allow_neg_eigval=1)


@pytest.mark.slow
def test_the_kit_passes_with_l2_clip():
  testing.check_mechanism(mechanisms.MECHANISMS["qk_l2_clip"], variants=["per_head", "talking_heads", "fused"])


@pytest.mark.slow
@pytest.mark.parametrize("variant, base", [("gated_deltanet", "h_not_dividing_D"), ("kda", "gqa_dv_ne_dk")])
def test_the_kit_passes_with_neg_eigval(variant, base):
  testing.check_variant(variant, configs=(AWKWARD[base].replace(linear_allow_neg_eigval=True, chunk=4),))


# Short causal convolutions on q, k and/or v inside softmax attention (qkv_conv).

CONV = AWKWARD["gqa_dv_ne_dk"].replace(qkv_conv="kv", qkv_conv_width=3, rope_dim=4)


def test_qkv_conv_equals_inkling2_short_convolution():
  """Inkling-2's (conv(x) + x)/sqrt(W + 1) is attn's convolution with taps (w + e_last)/sqrt(W + 1)."""
  torch = pytest.importorskip("torch")
  inkling2 = pytest.importorskip("transformers.models.inkling2.modeling_inkling2",
                                 reason="this transformers has no inkling2")
  from attn.variants.mechanisms.head_mechanisms import causal_conv
  N, C, W = 2, 3, 4
  torch.manual_seed(0)
  layer = inkling2.Inkling2ShortConvolution(N * C, W, layer_idx=0, conv_idx=0)
  x = np.random.default_rng(1).normal(size=(2, 7, N * C)).astype(np.float32)
  with torch.no_grad():
    want = layer(torch.tensor(x)).numpy()
  w = layer.conv1d.weight.detach().numpy()[:, 0].T.copy()  # (W, N·C), torch's tap order
  w[-1] += 1
  taps = (w / np.sqrt(W + 1)).reshape(W, N, C)
  got, _ = causal_conv(jnp.asarray(x.reshape(2, 7, N, C)), jnp.asarray(taps))
  np.testing.assert_allclose(np.asarray(got).reshape(2, 7, N * C), want, atol=1e-6)


# The fast case convolves queries too, through a window's ring; the kv case (the full cache) is slow.
@pytest.mark.parametrize("cfg", [pytest.param(CONV, marks=pytest.mark.slow),
                                 CONV.replace(qkv_conv="qkv", window=3)], ids=["kv", "qkv_window"])
def test_qkv_conv_decoding_equals_the_full_pass(cfg):
  """Through the KV cache (and a window's ring) with the convolutions' state, in uneven steps."""
  v = api.get_variant("per_head")
  p = _params("per_head", cfg, seed=8, scale=1.0)
  x = randn(9, (2, 7, cfg.d_model))
  full = jit_apply("per_head", p, x, cfg=cfg, is_causal=True)
  c = cache.init(v, p, cfg, 2, 7)
  assert cache.width(c, cfg) == cfg.num_kv_heads * (cfg.d_k + cfg.d_v)  # the state is per sequence
  step = jax.jit(lambda p, x, c, i: cache.decode_step(v, p, x, c, i, cfg=cfg))
  ys, index = [], 0
  for n in (3, 1, 2, 1):
    y, c = step(p, x[:, index:index + n], c, index)
    ys.append(y)
    index += n
  np.testing.assert_allclose(np.concatenate(ys, 1), full, atol=3e-5)


def test_qkv_conv_counts_in_closed_form():
  T, S, W = 5, 9, 3
  plain = CONV.replace(qkv_conv=None)
  G, K, V = CONV.num_kv_heads, CONV.d_k, CONV.d_v
  assert count.param_counts("per_head", CONV)["stored"] - count.param_counts("per_head", plain)["stored"] \
      == W * (G * K + G * V)
  assert count.flops("per_head", CONV, T, S) - count.flops("per_head", plain, T, S) == 2 * W * S * (G * K + G * V)
  assert count.score_weight_count("per_head", CONV) - count.score_weight_count("per_head", plain) == W * G * K
  assert count.kv_cache_bytes_per_token("per_head", CONV) == count.kv_cache_bytes_per_token("per_head", plain)


@pytest.mark.parametrize("changes, field", [({"qkv_conv": "x"}, "qkv_conv"), ({"qkv_conv": "kq"}, "qkv_conv"),
                                            ({"qkv_conv": "kv", "qkv_conv_width": 0}, "qkv_conv_width"),
                                            ({"qkv_conv": "kv", "qkv_conv_width": True}, "qkv_conv_width")])
def test_qkv_conv_bad_options_refused_by_name(changes, field):
  with pytest.raises(ConfigError, match=f"{field}=.* is not allowed"):
    HeadConfig(d_model=8, num_heads=2, **changes)


@pytest.mark.parametrize("variant", ["mla", "talking_heads", "merged", "gated_deltanet", "compressed"])
def test_qkv_conv_refused_where_it_cannot_act(variant):
  cfg = HeadConfig(d_model=8, num_heads=2, use_bias=False, qkv_conv="k")
  with pytest.raises(ConfigError, match="qkv_conv='k' is not allowed"):
    api.check_config(variant, cfg)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["per_head", "fused", "two_stage", "split_input"])
def test_the_kit_passes_with_qkv_conv(variant):
  testing.check_mechanism(mechanisms.MECHANISMS["qkv_conv"], variants=[variant])


@pytest.mark.slow  # fast sibling: test_qkv_conv_decoding_equals_the_full_pass
def test_a_decoder_with_qkv_conv_generates_as_its_full_pass():
  """DecoderLM layers with convolved keys and values (and a window ring in one): greedy decoding equals
  greedy decoding by the full pass (tests/hf_hybrid.full_pass_check); kv_source refuses it by name."""
  from flax import nnx
  from attn.nn import DecoderLM, ModelConfig
  from attn.nn.decoding import generate
  from hf_hybrid import full_pass_check  # tests/hf_hybrid.py
  cfg = ModelConfig(vocab_size=23, d_model=16, num_layers=2, num_heads=4, num_kv_heads=2, d_k=5, d_v=3, d_ff=24,
                    positional="rope", rope_dim=4, qkv_conv="qkv", qkv_conv_width=3, window=4, global_every=2)
  model = DecoderLM(cfg, rngs=nnx.Rngs(0))
  prompt = np.random.default_rng(10).integers(0, 23, (2, 3))
  got = np.asarray(generate(model, jnp.asarray(prompt), 6))
  np.testing.assert_array_equal(got, full_pass_check(model, prompt, got))
  with pytest.raises(ConfigError, match="qkv_conv='qkv' is not allowed.*kv_source"):
    cfg.replace(window=None, global_every=0, kv_source=(0, 0))
