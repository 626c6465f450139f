"""Hyper-connections (ModelConfig.hc_mult; attn.nn.hyper): off is the plain residual bit for bit;
on, the mix equals transformers' DeepSeek-V4 module and a naive Sinkhorn written here; decoding
equals the full pass; bad settings are refused by name."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attn.config import ConfigError
from attn.nn import hyper
from attn.nn.config import ModelConfig
from attn.nn.models import DecoderLM, Encoder, _norm
from conftest import randn

BASE = dict(vocab_size=50, d_model=12, num_layers=2, num_heads=3, d_ff=20, max_len=16,
            norm_type="rmsnorm")


def test_off_is_the_plain_residual_bit_for_bit():
  """hc_mult=1 (the default) adds no parameter and its logits are embed -> blocks -> norm -> head
  run by hand, exactly."""
  model = DecoderLM(ModelConfig(**{**BASE, "num_layers": 1}), rngs=nnx.Rngs(0))
  names = {"/".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  assert not any("hc" in n for n in names)
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 50, (2, 7)), jnp.int32)

  def by_hand(model, tokens):
    h = model.embed(tokens)
    for block in model.blocks:
      h = block(h, is_causal=True)
    return model.head(_norm(model.final_norm, h))

  # each compiled whole (op by op, every small op compiles alone)
  np.testing.assert_array_equal(nnx.jit(lambda m, t: m(t))(model, tokens), nnx.jit(by_hand)(model, tokens))


def naive_weights(x, fn, base, scale, n, iters, eps, norm_eps):
  """pre, post, comb of one token's streams x (n, D) in float64 by loops."""
  flat = x.reshape(-1).astype(np.float64)
  flat = flat / np.sqrt(np.mean(flat ** 2) + norm_eps)
  mix = fn @ flat
  sig = lambda a: 1 / (1 + np.exp(-a))
  pre = sig(mix[:n] * scale[0] + base[:n]) + eps
  post = 2 * sig(mix[n:2 * n] * scale[1] + base[n:2 * n])
  c = (mix[2 * n:] * scale[2] + base[2 * n:]).reshape(n, n)
  c = np.exp(c - c.max(1, keepdims=True))
  c = c / c.sum(1, keepdims=True) + eps
  for it in range(iters):
    if it:
      for j in range(n):
        c[j] /= c[j].sum() + eps
    for k in range(n):
      c[:, k] /= c[:, k].sum() + eps
  return pre, post, c


def test_streams_count():
  """hc_mult=2 adds the closed form's parameters: two mixes per block and the head."""
  model = nnx.eval_shape(lambda: DecoderLM(ModelConfig(**{**BASE, "num_layers": 1, "hc_mult": 2}),
                                           rngs=nnx.Rngs(0)))  # shapes only
  flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
  assert hyper.param_count(2, 12, 1) == sum(a.size for p, a in flat if any("hc" in str(k) for k in p))
  from attn import count
  assert count.model_param_count(model.cfg, "decoder_lm") == sum(a.size for _, a in flat)


def test_mix_matches_naive_and_is_doubly_stochastic():
  n, D = 3, 5
  hc = hyper.HyperConnection(n, D, iters=20, eps=1e-6, norm_eps=1e-6, rngs=nnx.Rngs(0), std=0.5)
  hc.base[...] = randn(3, hc.base.shape)
  hc.scale[...] = jnp.array([0.7, 1.3, 2.0])
  x = randn(1, (2, 4, n, D))
  f = lambda h: jnp.tanh(h) * 3.0
  got, (pre, post, comb) = nnx.jit(lambda hc, x: (hc(f, x), hc.weights(x)))(hc, x)  # 20 passes: one program
  np.testing.assert_allclose(comb.sum(-2), 1, atol=1e-5)  # the last pass normalises columns
  np.testing.assert_allclose(comb.sum(-1), 1, atol=0.05)  # rows: 20 passes from a far start
  xs = np.asarray(x, np.float64)
  for b, t in ((0, 0), (1, 3)):
    p, q, c = naive_weights(xs[b, t], np.asarray(hc.fn[...]), np.asarray(hc.base[...]),
                            np.asarray(hc.scale[...]), n, 20, 1e-6, 1e-6)
    y = np.tanh((p[:, None] * xs[b, t]).sum(0)) * 3.0
    want = q[:, None] * y[None] + c.T @ xs[b, t]
    np.testing.assert_allclose(got[b, t], want, atol=1e-5)


def test_independent_form_matches_naive_and_counts():
  """hc_form "independent" (HY-V4's iHC): x'_k = post_k·f(Σ pre·x) + x_k, pre = σ(·) + ε and
  post = hc_magnitude·σ(·) + ε from 2n mixes, no comb; its parameters 2n·(n·D + 1) + 2 per mix."""
  n, D, eps, m = 3, 5, 1e-3, 1.5
  hc = hyper.HyperConnection(n, D, iters=20, eps=eps, norm_eps=1e-6, rngs=nnx.Rngs(0), std=0.5,
                             form="independent", magnitude=m)
  assert (hc.fn.shape, hc.base.shape, hc.scale.shape) == ((2 * n, n * D), (2 * n,), (2,))
  hc.base[...] = randn(3, hc.base.shape)
  hc.scale[...] = jnp.array([0.7, 1.3])
  x = randn(1, (2, 4, n, D))
  got = nnx.jit(lambda hc, x: hc(lambda h: jnp.tanh(h) * 3.0, x))(hc, x)
  xs, sig = np.asarray(x, np.float64), lambda a: 1 / (1 + np.exp(-a))
  fn, base, scale = (np.asarray(a[...], np.float64) for a in (hc.fn, hc.base, hc.scale))
  for b, t in ((0, 0), (1, 3)):
    flat = xs[b, t].reshape(-1) / np.sqrt(np.mean(xs[b, t] ** 2) + 1e-6)
    mix = fn @ flat
    pre = sig(mix[:n] * scale[0] + base[:n]) + eps
    post = m * sig(mix[n:] * scale[1] + base[n:]) + eps
    y = np.tanh((pre[:, None] * xs[b, t]).sum(0)) * 3.0
    np.testing.assert_allclose(got[b, t], post[:, None] * y[None] + xs[b, t], atol=1e-5)
  model = nnx.eval_shape(lambda: DecoderLM(ModelConfig(**{**BASE, "num_layers": 1, "hc_mult": 2,
                                                       "hc_form": "independent"}), rngs=nnx.Rngs(0)))
  flat_state = nnx.to_flat_state(nnx.state(model, nnx.Param))
  hc_params = sum(a.size for p, a in flat_state if any("hc" in str(k) for k in p))
  assert hyper.param_count(2, 12, 1, form="independent") == hc_params == 2 * (4 * 25 + 2) + 2 * 25 + 1
  with pytest.raises(ConfigError, match=r"hc_form='comb'.*one of \['mhc', 'independent'\]"):
    ModelConfig(**BASE, hc_mult=2, hc_form="comb")
  with pytest.raises(ConfigError, match=r"hc_magnitude=0"):
    ModelConfig(**BASE, hc_mult=2, hc_magnitude=0)


@pytest.mark.slow
def test_decoding_equals_full_pass_with_streams():
  model = DecoderLM(ModelConfig(**BASE, hc_mult=3), rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 9), 0, 50)
  full = model(tokens)
  model.init_cache(2, 9)
  got = jnp.concatenate([model(tokens[:, :4], decode=True)] +
                        [model(tokens[:, i:i + 1], decode=True) for i in range(4, 9)], axis=1)
  np.testing.assert_allclose(got, full, atol=2e-5)
  # the streams are used: the same model without its hyper-connections computes something else
  assert not np.allclose(full, DecoderLM(ModelConfig(**BASE), rngs=nnx.Rngs(0))(tokens), atol=1e-3)


@pytest.mark.parametrize("kw, field", [
    (dict(hc_mult=0), "hc_mult"), (dict(hc_mult=2.0), "hc_mult"), (dict(hc_mult=True), "hc_mult"),
    (dict(hc_mult=2, hc_sinkhorn_iters=0), "hc_sinkhorn_iters"), (dict(hc_mult=2, hc_eps=0.0), "hc_eps"),
    (dict(hc_mult=2, norm="post"), "norm")])
def test_bad_settings_refused(kw, field):
  with pytest.raises(ConfigError, match=field):
    ModelConfig(**{**BASE, **kw})


def test_encoder_refuses_streams():
  with pytest.raises(ConfigError, match="hc_mult"):
    Encoder(ModelConfig(**BASE, hc_mult=2), rngs=nnx.Rngs(0))


@pytest.mark.slow
def test_matches_transformers_deepseek_v4_hyper_connection():
  """One sublayer's mix and the final collapse equal transformers' DeepseekV4HyperConnection and
  DeepseekV4HyperHead with the same weights (skipped where transformers lacks deepseek_v4)."""
  mod = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
  torch = pytest.importorskip("torch")
  from transformers import DeepseekV4Config
  n, D = 4, 8
  hf_cfg = DeepseekV4Config(hidden_size=D, hc_mult=n, hc_sinkhorn_iters=7, hc_eps=1e-6, rms_norm_eps=1e-6,
                            num_hidden_layers=1, vocab_size=10)
  ref, ref_head = mod.DeepseekV4HyperConnection(hf_cfg), mod.DeepseekV4HyperHead(hf_cfg)
  g = torch.Generator().manual_seed(0)
  with torch.no_grad():
    for p in (*ref.parameters(), *ref_head.parameters()):
      p.copy_(torch.randn(p.shape, generator=g) * 0.5)
  hc = hyper.HyperConnection(n, D, iters=7, eps=1e-6, norm_eps=1e-6, rngs=nnx.Rngs(0))
  head = hyper.HyperHead(n, D, eps=1e-6, norm_eps=1e-6, rngs=nnx.Rngs(0))
  hc.fn[...], hc.base[...], hc.scale[...] = (jnp.asarray(t.detach().numpy()) for t in (ref.fn, ref.base, ref.scale))
  head.fn[...], head.base[...], head.scale[...] = (jnp.asarray(t.detach().numpy())
                                                    for t in (ref_head.hc_fn, ref_head.hc_base, ref_head.hc_scale))
  x = np.random.default_rng(1).normal(size=(2, 5, n, D)).astype(np.float32)
  post, comb, collapsed = ref(torch.from_numpy(x))
  y = torch.tanh(collapsed)
  want = post.unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), torch.from_numpy(x))
  np.testing.assert_allclose(hc(jnp.tanh, jnp.asarray(x)), want.detach().numpy(), atol=1e-5)
  np.testing.assert_allclose(head(jnp.asarray(x)), ref_head(torch.from_numpy(x)).detach().numpy(), atol=1e-5)
