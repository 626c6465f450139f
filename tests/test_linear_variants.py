"""kda, mamba2 and linear: against transformers' layers (kimi_linear, mamba2; torch, same weights)
and causal linear attention against its quadratic form; decoding; refusals by name; counts by
hand. The kit (attn.testing.check_variant) runs on every built-in in tests/test_contract.py.

gated_deltanet has its own file (tests/test_gated_deltanet.py); the shared core is in
tests/test_linear_core.py.
"""

import dataclasses
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attn
from attn import ConfigError, HeadConfig
from attn.variants import VARIANTS, cache
from conftest import jit_apply

STATE_HEADS = ("gated_deltanet", "kda", "mamba2", "linear")


def t(a):
  torch = pytest.importorskip("torch")
  return torch.from_numpy(np.array(a, np.float32))


def random_params(name, cfg, seed):
  """init's parameters with the scales and norms moved off their initial values."""
  p = attn.init(name, jax.random.PRNGKey(seed), cfg)
  r = np.random.default_rng(seed)
  for n in ("norm", "d_skip"):
    if n in p:
      p[n] = jnp.asarray(1 + 0.3 * r.standard_normal(p[n].shape).astype(np.float32))
  if "a_log" in p:  # mild decays: transformers' chunked torch paths divide by them
    p["a_log"] = jnp.asarray(np.log(r.uniform(0.1, 0.5, p["a_log"].shape)).astype(np.float32))
  for n in [n for n in p if n.startswith("conv_") and n.endswith("_bias")]:
    p[n] = jnp.asarray(0.3 * r.standard_normal(p[n].shape).astype(np.float32))
  return p


def x_of(seed, B, T, D):
  return np.random.default_rng(seed).standard_normal((B, T, D)).astype(np.float32)


# kda against KimiLinearDeltaAttention: Kimi Linear has as many key as value heads and d_k = d_v.
KDA = HeadConfig(d_model=20, num_heads=3, d_k=6, d_v=6, use_bias=False, chunk=4)


def kimi_layer(p, cfg):
  torch = pytest.importorskip("torch")
  kimi = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
  from transformers import KimiLinearConfig
  D, H, K, W = cfg.d_model, cfg.num_heads, cfg.d_k, cfg.conv_width
  hf = KimiLinearConfig(hidden_size=D, linear_num_heads=H, linear_head_dim=K,
                        linear_conv_kernel_dim=W, rms_norm_eps=1e-6, num_hidden_layers=1)
  layer = kimi.KimiLinearDeltaAttention(hf, layer_idx=0).eval()
  p = {n: np.asarray(a, np.float32) for n, a in p.items()}
  conv = np.concatenate([p[f"conv_{n}"].reshape(W, -1) for n in "qkv"], -1)
  with torch.no_grad():
    for name, w in (("q_proj", p["w_q"]), ("k_proj", p["w_k"]), ("v_proj", p["w_v"])):
      getattr(layer, name).weight.copy_(t(w.reshape(D, -1).T))
    layer.conv1d.weight.copy_(t(conv.T[:, None, :]))
    layer.forget_gate.f_a_proj.weight.copy_(t(p["w_fa"].T))
    layer.forget_gate.f_b_proj.weight.copy_(t(p["w_fb"].reshape(K, -1).T))
    layer.forget_gate.dt_bias.copy_(t(p["dt_bias"].reshape(-1)))
    layer.forget_gate.A_log.copy_(t(p["a_log"].reshape(1, 1, H, 1)))
    layer.b_proj.weight.copy_(t(p["w_b"].T))
    layer.g_a_proj.weight.copy_(t(p["w_ga"].T))
    layer.g_b_proj.weight.copy_(t(p["w_gb"].reshape(cfg.d_v, -1).T))
    layer.o_norm.weight.copy_(t(p["norm"]))
    layer.o_proj.weight.copy_(t(p["w_o"].reshape(-1, D).T))
  return layer


@pytest.mark.parametrize("T", [1, 9])
@pytest.mark.slow
def test_kda_equals_transformers_kimi_linear_layer(T):
  torch = pytest.importorskip("torch")
  p = random_params("kda", KDA, T)
  x = x_of(T, 2, T, KDA.d_model)
  want = kimi_layer(p, KDA)(torch.from_numpy(x)).detach().numpy()
  got = attn.apply("kda", p, jnp.asarray(x), cfg=KDA, is_causal=True)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-5 * np.abs(want).max())


# mamba2 against Mamba2Mixer: H·P = expand·D (Mamba2Config's intermediate_size).
MAMBA = HeadConfig(d_model=24, num_heads=4, d_k=5, d_v=12, num_kv_heads=2, use_bias=False, chunk=4)


def mamba_layer(p, cfg):
  torch = pytest.importorskip("torch")
  mamba2_hf = pytest.importorskip("transformers.models.mamba2.modeling_mamba2")
  from transformers import Mamba2Config
  D, H, G, K, V, W = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_k, cfg.d_v, cfg.conv_width
  hf = Mamba2Config(hidden_size=D, num_heads=H, head_dim=V, state_size=K, n_groups=G, expand=H * V // D,
                    conv_kernel=W, use_bias=False, use_conv_bias=True, chunk_size=64,
                    num_hidden_layers=1)
  layer = mamba2_hf.Mamba2Mixer(hf, layer_idx=0).eval()
  p = {n: np.asarray(a, np.float32) for n, a in p.items()}
  in_proj = np.concatenate([p["w_z"].reshape(D, -1), p["w_v"].reshape(D, -1), p["w_k"].reshape(D, -1),
                            p["w_q"].reshape(D, -1), p["w_dt"]], -1)
  conv = np.concatenate([p[f"conv_{n}"].reshape(W, -1) for n in "vkq"], -1)
  conv_bias = np.concatenate([p[f"conv_{n}_bias"].reshape(-1) for n in "vkq"])
  with torch.no_grad():
    layer.in_proj.weight.copy_(t(in_proj.T))
    layer.conv1d.weight.copy_(t(conv.T[:, None, :]))
    layer.conv1d.bias.copy_(t(conv_bias))
    layer.dt_bias.copy_(t(p["dt_bias"]))
    layer.A_log.copy_(t(p["a_log"]))
    layer.D.copy_(t(p["d_skip"]))
    layer.norm.weight.copy_(t(p["norm"].reshape(-1)))
    layer.out_proj.weight.copy_(t(p["w_o"].reshape(-1, D).T))
  return layer


@pytest.mark.parametrize("G", [1, 2])
@pytest.mark.parametrize("T", [1, 11])
def test_mamba2_equals_transformers_mamba2_mixer(T, G):
  torch = pytest.importorskip("torch")
  mamba2_hf = pytest.importorskip("transformers.models.mamba2.modeling_mamba2")
  gated_norm = getattr(mamba2_hf, "Mamba2RMSNormGated", None) or mamba2_hf.MambaRMSNormGated  # renamed in 5.25
  if G > 1 and "group_size" not in inspect.signature(gated_norm).parameters:
    # transformers before its grouped gated norm (4.51.1, the hf floor, among them) normalises all
    # groups as one; Mamba-2's reference (mamba_ssm's mamba2.py) and attn normalise each group.
    pytest.skip("this transformers' Mamba2 gated norm does not group: no reference for G > 1")
  cfg = dataclasses.replace(MAMBA, num_kv_heads=G)
  p = random_params("mamba2", cfg, T)
  x = x_of(T, 2, T, cfg.d_model)
  want = mamba_layer(p, cfg)(torch.from_numpy(x)).detach().numpy()
  got = attn.apply("mamba2", p, jnp.asarray(x), cfg=cfg, is_causal=True)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-5 * np.abs(want).max())


LINEAR = HeadConfig(d_model=20, num_heads=6, d_k=4, d_v=3, num_kv_heads=3, chunk=4)


def test_linear_equals_its_quadratic_form():
  """o_t = Σ_{s≤t} φ(q_t)·φ(k_s)·v_s / Σ_{s≤t} φ(q_t)·φ(k_s), in float64 numpy, with biases."""
  p = random_params("linear", LINEAR, 2)
  r = np.random.default_rng(2)
  p = {n: (jnp.asarray(0.3 * r.standard_normal(a.shape).astype(np.float32)) if n.startswith("b_") else a)
       for n, a in p.items()}
  x = x_of(4, 2, 10, LINEAR.d_model)
  n = {k: np.asarray(a, np.float64) for k, a in p.items()}
  phi = lambda z: np.where(z > 0, z + 1, np.exp(z))
  fq = phi(np.einsum("BTD,DGK->BTGK", x, n["w_q"]) + n["b_q"]).repeat(2, axis=2)
  fk = phi(np.einsum("BTD,DGK->BTGK", x, n["w_k"]) + n["b_k"]).repeat(2, axis=2)
  v = np.einsum("BTD,DHV->BTHV", x, n["w_v"]) + n["b_v"]
  a = np.einsum("BTHK,BSHK->BHTS", fq, fk) * np.tril(np.ones((10, 10)))
  o = np.einsum("BHTS,BSHV->BTHV", a / a.sum(-1, keepdims=True), v)
  want = np.einsum("BTHV,HVD->BTD", o, n["w_o"]) + n["b_o"]
  got = jit_apply("linear", p, jnp.asarray(x), cfg=LINEAR, is_causal=True)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


# Fast on gated_deltanet (the hybrids' linear head; the fixed-state heads' one fast decoding check), the rest slow.
@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n == "gated_deltanet" else pytest.mark.slow)
                                  for n in STATE_HEADS])
def test_prompt_then_tokens_equal_the_full_pass(name):
  """A 6-token prompt in one step (chunked from the empty state), then 1-token steps (recurrent)."""
  cfg = HeadConfig(d_model=20, num_heads=4, d_k=3, d_v=5, num_kv_heads=2, chunk=4)
  v = VARIANTS[name]
  p = random_params(name, cfg, 1)
  x = jnp.asarray(x_of(1, 2, 9, 20))
  full = jit_apply(name, p, x, cfg=cfg, is_causal=True)
  step = jax.jit(cache.decode_step, static_argnums=(0, 4), static_argnames=("cfg",))  # each step one program
  y, state = step(v, p, x[:, :6], cache.init(v, p, cfg, 2, 9), 0, cfg=cfg)
  ys = [y]
  for i in range(6, 9):
    y, state = step(v, p, x[:, i:i + 1], state, i, cfg=cfg)
    ys.append(y)
  np.testing.assert_allclose(jnp.concatenate(ys, 1), full, rtol=1e-5, atol=1e-5)


def test_counts_by_hand():
  D, H, G, K, V, W = 20, 4, 2, 3, 5, 4
  cfg = HeadConfig(d_model=D, num_heads=H, d_k=K, d_v=V, num_kv_heads=G)
  want = {  # with use_bias (the default)
      "kda": D * (2 * G * K + H * V + H) + W * (2 * G * K + H * V) + D * K + K * H * K + H * K + H
             + D * V + V * H * V + V + H * V * D + (2 * G * K + H * V + D),
      "mamba2": D * (2 * H * V + 2 * G * K + H) + (W + 1) * (H * V + 2 * G * K) + 3 * H + H * V
                + H * V * D + (2 * H * V + 2 * G * K + H + D),
      "linear": D * (2 * G * K + H * V) + H * V * D + (2 * G * K + H * V + D),
  }
  assert want == {"kda": 1617, "mamba2": 1788, "linear": 1092}
  for name, n in want.items():
    assert VARIANTS[name].param_count(cfg) == n
    shapes = jax.eval_shape(lambda: attn.init(name, jax.random.PRNGKey(0), cfg))  # nothing drawn
    assert sum(a.size for a in shapes.values()) == n
  assert VARIANTS["mamba2"].state_size(cfg) == H * K * V + (W - 1) * (H * V + 2 * G * K)
  assert VARIANTS["kda"].state_size(cfg) == H * K * V + (W - 1) * (2 * G * K + H * V)
  assert VARIANTS["linear"].state_size(cfg) == H * K * (V + 1)


@pytest.mark.parametrize("name", STATE_HEADS)
@pytest.mark.parametrize("change, field", [
    (dict(num_kv_heads=3), "num_kv_heads"), (dict(conv_width=0), "conv_width"),
    (dict(chunk=0), "chunk"), (dict(d_k=0), "d_k"), (dict(sinks=True), "sinks"),
    (dict(softcap=50.0), "softcap"), (dict(window=2), "window"),
    (dict(probability="relu"), "probability")])
def test_bad_config_refused_by_name(name, change, field):
  with pytest.raises(ConfigError, match=f"{field}=.* is not allowed"):
    attn.api.check_config(name, HeadConfig(d_model=20, num_heads=4, d_k=3, d_v=5,
                                           num_kv_heads=2).replace(**change))


@pytest.mark.parametrize("name", STATE_HEADS)
def test_return_weights_refused_by_name(name):
  cfg = HeadConfig(d_model=20, num_heads=4, d_k=3, d_v=5, num_kv_heads=2)
  p = jax.eval_shape(lambda: attn.init(name, jax.random.PRNGKey(0), cfg))  # refused before any is read
  with pytest.raises(ConfigError, match="return_weights=True is not allowed: False for"):
    attn.apply(name, p, jnp.ones((1, 3, 20)), cfg=cfg, is_causal=True, return_weights=True)


@pytest.mark.parametrize("name", STATE_HEADS)
def test_conversions_to_and_from_softmax_heads_refused_by_name(name):
  """No exact (nor lossy) map between a state head and a softmax head: attn.convert names both."""
  cfg = HeadConfig(d_model=16, num_heads=4, num_kv_heads=2)
  shapes = lambda v: jax.eval_shape(lambda: attn.init(v, jax.random.PRNGKey(0), cfg))  # refused before any is read
  with pytest.raises(ConfigError, match=f"conversion='{name} -> per_head' is not allowed: one of"):
    attn.convert(shapes(name), name, "per_head", cfg)
  with pytest.raises(ConfigError, match=f"conversion='per_head -> {name}' is not allowed"):
    attn.convert(shapes("per_head"), "per_head", name, cfg)
