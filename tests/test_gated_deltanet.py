"""gated_deltanet against transformers' Qwen3NextGatedDeltaNet (torch) with the same weights; the
decoding from the state (the kit runs in tests/test_linear_variants.py); refusals by name; counts by hand.

The second implementation is transformers' own layer (its pure-torch chunked and recurrent
fallbacks), built in code from a tiny Qwen3NextConfig: no download (skipped without torch and
transformers; the rest of the file runs without them).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attn
from attn import ConfigError, HeadConfig
from attn.variants import VARIANTS, cache, gated_deltanet

CFG = HeadConfig(d_model=24, num_heads=6, d_k=5, d_v=7, num_kv_heads=2, use_bias=False, chunk=4)


def to_torch_layer(params, cfg: HeadConfig):
  """A Qwen3NextGatedDeltaNet holding attn's parameters (its fused in_proj_qkvz and in_proj_ba)."""
  torch = pytest.importorskip("torch")
  qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
  from transformers import Qwen3NextConfig
  D, H, G, K, V, W = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_k, cfg.d_v, cfg.conv_width
  R = H // G
  hf = Qwen3NextConfig(hidden_size=D, linear_num_key_heads=G, linear_num_value_heads=H,
                       linear_key_head_dim=K, linear_value_head_dim=V, linear_conv_kernel_dim=W,
                       rms_norm_eps=1e-6, num_hidden_layers=1, layer_types=["linear_attention"])
  layer = qwen3_next.Qwen3NextGatedDeltaNet(hf, layer_idx=0).eval()
  p = {n: np.asarray(a, np.float32) for n, a in params.items()}
  qkvz = np.concatenate([p["w_q"], p["w_k"], p["w_v"].reshape(D, G, R * V),
                         p["w_z"].reshape(D, G, R * V)], axis=-1).reshape(D, -1)
  ba = np.concatenate([p["w_b"].reshape(D, G, R), p["w_a"].reshape(D, G, R)], -1).reshape(D, -1)
  conv = np.concatenate([p["conv_q"].reshape(W, -1), p["conv_k"].reshape(W, -1),
                         p["conv_v"].reshape(W, -1)], -1)
  t = lambda a: torch.from_numpy(np.array(a, np.float32))
  with torch.no_grad():
    layer.in_proj_qkvz.weight.copy_(t(qkvz.T))
    layer.in_proj_ba.weight.copy_(t(ba.T))
    layer.conv1d.weight.copy_(t(conv.T[:, None, :]))
    layer.A_log.copy_(t(p["a_log"]))
    layer.dt_bias.copy_(t(p["dt_bias"]))
    layer.norm.weight.copy_(t(p["norm"]))
    layer.out_proj.weight.copy_(t(p["w_o"].reshape(H * V, D).T))
  return layer


def random_params(cfg, seed):
  p = attn.init("gated_deltanet", jax.random.PRNGKey(seed), cfg)
  r = np.random.default_rng(seed)
  p["norm"] = jnp.asarray(1 + 0.3 * r.standard_normal(cfg.d_v).astype(np.float32))
  return p


@pytest.mark.parametrize("T", [1, 6, 13])
@pytest.mark.slow
def test_equals_transformers_qwen3_next_layer(T):
  """Chunked at chunk 4 (13 is not a multiple) against transformers' chunk of 64."""
  torch = pytest.importorskip("torch")
  p = random_params(CFG, T)
  x = np.random.default_rng(T).standard_normal((2, T, CFG.d_model)).astype(np.float32)
  want = to_torch_layer(p, CFG)(torch.from_numpy(x)).detach().numpy()
  got = attn.apply("gated_deltanet", p, jnp.asarray(x), cfg=CFG, is_causal=True)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-5 * np.abs(want).max())


@pytest.mark.slow
def test_chunk_does_not_change_the_function():
  p = random_params(CFG, 3)
  x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 11, CFG.d_model)), jnp.float32)
  ys = [attn.apply("gated_deltanet", p, x, cfg=CFG.replace(chunk=c), is_causal=True)
        for c in (1, 3, 64)]
  np.testing.assert_allclose(ys[0], ys[1], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ys[0], ys[2], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_decoding_a_prompt_then_tokens_equals_the_full_pass_with_padding():
  """A batch of two lengths: the padded full pass's outputs at real tokens equal decoding."""
  v = VARIANTS["gated_deltanet"]
  p = random_params(CFG, 5)
  x = jnp.asarray(np.random.default_rng(5).standard_normal((2, 9, CFG.d_model)), jnp.float32)
  full = attn.apply(v, p, x, cfg=CFG, is_causal=True, kv_lengths=jnp.array([9, 6]))
  state = cache.init(v, p, CFG, 2, 9)
  y0, state = cache.decode_step(v, p, x[:, :5], state, 0, cfg=CFG)
  ys = [y0]
  for t in range(5, 9):
    y, state = cache.decode_step(v, p, x[:, t:t + 1], state, t, cfg=CFG)
    ys.append(y)
  y = jnp.concatenate(ys, 1)
  np.testing.assert_allclose(y[0], full[0], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(y[1, :6], full[1, :6], rtol=1e-5, atol=1e-5)
  assert state["ssm"].shape == (2, 6, 5, 7) and state["ssm"].dtype == jnp.float32
  assert state["conv"].shape == (2, 3, 2 * 2 * 5 + 6 * 7)


def test_counts_by_hand():
  # D·(2GK + 2HV + 2H) + W·(2GK + HV) + 2H + V + HVD, no biases
  want = 24 * (20 + 84 + 12) + 4 * (20 + 42) + 12 + 7 + 6 * 7 * 24
  assert VARIANTS["gated_deltanet"].param_count(CFG) == want == 4059
  shapes = jax.eval_shape(lambda: attn.init("gated_deltanet", jax.random.PRNGKey(0), CFG))  # nothing drawn
  assert sum(a.size for a in shapes.values()) == want
  assert VARIANTS["gated_deltanet"].state_size(CFG) == 6 * 5 * 7 + 3 * (20 + 42)
  assert VARIANTS["gated_deltanet"].kv_cache_width(CFG) == 0


@pytest.mark.parametrize("change, field", [
    (dict(num_kv_heads=4), "num_kv_heads"), (dict(conv_width=0), "conv_width"),
    (dict(chunk=0), "chunk"), (dict(sinks=True), "sinks"), (dict(softcap=30.0), "softcap"),
    (dict(window=4), "window"), (dict(probability="sigmoid"), "probability"),
    (dict(rope_dim=2, d_k=6), "rope_dim"), (dict(qk_norm=True), "qk_norm")])
def test_bad_config_refused_by_name(change, field):
  with pytest.raises(ConfigError, match=f"{field}=.* is not allowed"):
    attn.api.check_config("gated_deltanet", CFG.replace(**change))


@pytest.mark.parametrize("kw, field", [
    (dict(return_weights=True, is_causal=True), "return_weights"),
    (dict(is_causal=False), "is_causal"),
    (dict(mask=jnp.ones((1, 1, 4, 4), bool), is_causal=True), "mask"),
    (dict(context=jnp.ones((1, 4, 24)), is_causal=True), "context")])
def test_bad_call_refused_by_name(kw, field):
  p = jax.eval_shape(lambda: attn.init("gated_deltanet", jax.random.PRNGKey(0), CFG))  # refused before any is read
  with pytest.raises(ConfigError, match=f"{field}=.* is not allowed"):
    attn.apply("gated_deltanet", p, jnp.ones((1, 4, 24)), cfg=CFG, **kw)


def test_a_linear_head_has_no_circuits():
  with pytest.raises(ConfigError, match="variant='gated_deltanet'"):
    gated_deltanet.VARIANT.circuits({}, CFG)
