"""The dense mixture-of-experts feed-forward: against a numpy loop, transformers' MoE modules, closed forms.

The numpy loop routes token by token with argsort and runs only the chosen
experts (a sparse dispatch), so it shares nothing with the dense einsums and
lax.top_k of attn.nn.moe. transformers' GptOssMLP, MixtralSparseMoeBlock and
DeepseekV3MoE, on random weights at tiny sizes, are the second check (slow
tier: importing torch and transformers takes seconds).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attn import ConfigError, count
from attn.nn import moe
from attn.nn.models import MLP, DecoderLM, activate
from attn.nn.config import ModelConfig
from conftest import randn

BASE = dict(vocab_size=11, d_model=10, num_layers=3, num_heads=2, d_k=4, d_ff=12, mlp="moe", activation="silu",
            max_len=16)
CASES = {
    "softmax": dict(moe_experts=5, moe_top_k=3, moe_d_ff=6, use_bias=False),  # Mixtral
    "softmax_unnormed_bias": dict(moe_experts=5, moe_top_k=2, moe_d_ff=6, moe_norm_topk=False, dense_bias=True,
                                  moe_routed_scaling=1.5),
    "gpt_oss": dict(moe_experts=4, moe_top_k=2, moe_d_ff=6, moe_swiglu_limit=0.5, dense_bias=True),
    "deepseek": dict(moe_experts=8, moe_top_k=3, moe_d_ff=6, moe_router="sigmoid", moe_groups=4,
                     moe_topk_groups=2, moe_routed_scaling=2.5, moe_shared_experts=2, moe_dense_first=1,
                     use_bias=False),
    # HY-V4: DeepSeek's router, the routed experts' SwiGLU clamped (min(g, ℓ), clip(u, ±ℓ)), the shared one not
    "clamp_routed": dict(moe_experts=8, moe_top_k=3, moe_d_ff=6, moe_router="sigmoid", moe_groups=1,
                         moe_topk_groups=1, moe_routed_scaling=2.8, moe_shared_experts=1, use_bias=False,
                         moe_swiglu_limit=0.3, moe_swiglu_form="clamp_routed"),
}


def _layer(case: str, seed: int = 0, **changes) -> tuple[ModelConfig, moe.MoE]:
  cfg = ModelConfig(**(BASE | CASES[case] | changes))
  rngs = nnx.Rngs(seed)
  shared = MLP(cfg, rngs=rngs, d_ff=cfg.moe_d_ff * cfg.moe_shared_experts) if cfg.moe_shared_experts else None
  layer = moe.MoE(cfg, rngs=rngs, activation=lambda x: activate("silu", x), shared=shared)
  rng = np.random.default_rng(seed + 1)
  for name in ("router_b", "b_gate", "b_up", "b_down", "correction"):  # nonzero, so that they count
    var = getattr(layer, name)
    if var is not None:
      var[...] = jnp.asarray(rng.standard_normal(var[...].shape) * 0.3, jnp.float32)
  return cfg, layer


def numpy_moe(cfg, layer, x):
  """Token by token: scores, the chosen experts by argsort, each chosen expert's output, weighted."""
  g = lambda name: None if getattr(layer, name) is None else np.asarray(getattr(layer, name)[...], np.float64)
  E, k, limit = cfg.moe_experts, cfg.moe_top_k, cfg.moe_swiglu_limit
  out = np.zeros(x.shape, np.float64)
  for b in range(x.shape[0]):
    for t in range(x.shape[1]):
      xt = np.asarray(x[b, t], np.float64)
      logit = xt @ g("router_w") + (g("router_b") if layer.router_b is not None else 0)
      if cfg.moe_router == "softmax":
        score = np.exp(logit - logit.max()) / np.exp(logit - logit.max()).sum()
        chosen = np.argsort(-score)[:k]
      else:
        score = 1 / (1 + np.exp(-logit))
        choice = score + g("correction")
        size = E // cfg.moe_groups
        group = [np.sort(choice[i * size:(i + 1) * size])[-2:].sum() for i in range(cfg.moe_groups)]
        allowed = np.concatenate([np.arange(i * size, (i + 1) * size)
                                  for i in np.argsort(group)[::-1][:cfg.moe_topk_groups]])
        chosen = allowed[np.argsort(-choice[allowed])[:k]]
      w = score[chosen]
      if cfg.moe_norm_topk:
        w = w / w.sum()
      w = w * cfg.moe_routed_scaling
      for e, we in zip(chosen, w):
        gate = xt @ g("w_gate")[e] + (g("b_gate")[e] if layer.b_gate is not None else 0)
        up = xt @ g("w_up")[e] + (g("b_up")[e] if layer.b_up is not None else 0)
        if limit is None:
          h = gate / (1 + np.exp(-gate)) * up
        elif cfg.moe_swiglu_form == "clamp_routed":
          gate = np.minimum(gate, limit)
          h = gate / (1 + np.exp(-gate)) * np.clip(up, -limit, limit)
        else:
          gate = np.minimum(gate, limit)
          h = gate / (1 + np.exp(-1.702 * gate)) * (np.clip(up, -limit, limit) + 1)
        out[b, t] += we * (h @ g("w_down")[e] + (g("b_down")[e] if layer.b_down is not None else 0))
      if layer.shared is not None:
        s = layer.shared
        a = xt @ np.asarray(s.gate.kernel[...], np.float64)
        out[b, t] += (a / (1 + np.exp(-a)) * (xt @ np.asarray(s.up.kernel[...], np.float64))) \
            @ np.asarray(s.down.kernel[...], np.float64)
  return out


# Mixtral's "softmax" (top-k weights renormalised, no biases) in the slow tier: gpt_oss renormalises
# softmax's top k too, and deepseek and clamp_routed run without biases.
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow if c == "softmax" else ())
                                  for c in CASES])
def test_dense_moe_against_a_numpy_loop(case):
  cfg, layer = _layer(case)
  x = randn(3, (2, 3, cfg.d_model))
  w, y = nnx.jit(lambda m, x: (m.weights(x), m(x)))(layer, x)  # one compile, not one per operation
  w = np.asarray(w)
  assert ((w > 0).sum(-1) == cfg.moe_top_k).all()  # exactly k experts per token
  np.testing.assert_allclose(y, numpy_moe(cfg, layer, x), rtol=2e-5, atol=2e-5)


def test_bfloat16_and_gradients():
  """bf16 experts stay near float32 (routing is float32 either way); the router learns through its weights."""
  cfg, layer = _layer("softmax")
  x = randn(4, (2, 3, cfg.d_model))
  forward = nnx.jit(lambda m, x: m(x))  # one compile per layer, not op by op
  want = np.asarray(forward(layer, x))
  got = forward(_layer("softmax", dtype="bfloat16")[1], x)  # the same weights (same seeds), in bf16
  assert got.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=0.05 * np.abs(want).max())
  grads = nnx.jit(nnx.grad(lambda m: jnp.sum(m(x) ** 2)))(layer)
  g_router = np.asarray(grads["router_w"][...])
  assert np.isfinite(g_router).all() and np.abs(g_router).max() > 0
  assert "correction" not in grads  # a buffer, not a parameter


def test_moe_model_counts_total_and_active():
  """A DeepSeek-shaped model: its nnx.Param tree is the count; the buffer is not a parameter."""
  cfg = ModelConfig(**BASE, **CASES["deepseek"])
  model = nnx.eval_shape(lambda: DecoderLM(cfg, rngs=nnx.Rngs(0)))  # shapes only; it runs in test_layer_types
  stored = sum(a.size for a in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert stored == count.model_param_count(cfg, "decoder_lm")
  D, F, E, k, S = 10, 6, 8, 3, 2
  expert, router, shared = 3 * D * F, D * E, 3 * D * S * F
  dense = 3 * D * 12
  assert count.expert_params(cfg) == {"total": E * expert + router + shared, "active": k * expert + router + shared}
  moe_layers = cfg.num_layers - cfg.moe_dense_first
  assert stored - count.active_param_count(cfg, "decoder_lm") == moe_layers * (E - k) * expert
  plain = cfg.replace(**{n: d for n, d in moe.FIELDS.items()}, mlp="gated")
  assert stored - count.model_param_count(plain, "decoder_lm") == moe_layers * (E * expert + router + shared - dense)
  assert count.active_param_count(plain, "decoder_lm") == count.model_param_count(plain, "decoder_lm")


def test_a_gated_shared_expert_of_its_own_width_is_counted():
  """Qwen3-Next's shared expert (moe_shared_d_ff wide, σ(x·w) gate of D): the Param tree is the count."""
  cfg = ModelConfig(**BASE, moe_experts=4, moe_top_k=2, moe_d_ff=6, moe_shared_experts=1, use_bias=False,
                    moe_shared_d_ff=7, moe_shared_gate=True)
  model = nnx.eval_shape(lambda: DecoderLM(cfg, rngs=nnx.Rngs(0)))
  stored = sum(a.size for a in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert stored == count.model_param_count(cfg, "decoder_lm")
  D = 10
  assert count.expert_params(cfg)["total"] == 4 * 3 * D * 6 + D * 4 + 3 * D * 7 + D


@pytest.mark.parametrize("changes, match", [
    (dict(moe_experts=4, moe_top_k=5), r"moe_top_k=5 is not allowed: at most moe_experts=4"),
    (dict(moe_experts=4, moe_top_k=0), r"moe_top_k=0 is not allowed: an integer >= 1"),
    (dict(moe_experts=0, moe_top_k=1), r"moe_experts=0 is not allowed: an integer >= 1"),
    (dict(moe_experts=6, moe_top_k=2, moe_groups=4, moe_router="sigmoid"), r"moe_groups=4 is not allowed: a divisor"),
    (dict(moe_experts=8, moe_top_k=2, moe_groups=2), r"moe_groups=2 is not allowed: 1 with moe_router='softmax'"),
    (dict(moe_experts=8, moe_top_k=5, moe_groups=4, moe_topk_groups=2, moe_router="sigmoid"),
     r"moe_top_k=5 is not allowed: at most moe_topk_groups"),
    (dict(moe_experts=4, moe_top_k=2, moe_router="top1"), r"moe_router='top1' is not allowed"),
    (dict(moe_experts=4, moe_top_k=2, moe_swiglu_limit=0.0), r"moe_swiglu_limit=0.0 is not allowed"),
    (dict(moe_experts=4, moe_top_k=2, moe_dense_first=4), r"moe_dense_first=4 is not allowed: at most num_layers=3"),
    (dict(mlp="gated", moe_experts=4), r"moe_experts=4 is not allowed: 0 when mlp='gated'"),
    (dict(moe_experts=4, moe_top_k=2, moe_shared_gate=True),
     r"moe_shared_gate=True is not allowed: False with moe_shared_experts=0"),
    (dict(moe_experts=4, moe_top_k=2, moe_shared_d_ff=5), r"moe_shared_d_ff=5 is not allowed: None with moe_shared"),
    (dict(moe_experts=4, moe_top_k=2, moe_shared_experts=1, moe_shared_d_ff=0),
     r"moe_shared_d_ff=0 is not allowed: an integer >= 1"),
    (dict(moe_experts=4, moe_top_k=2, moe_shared_experts=1, moe_shared_gate=1),
     r"moe_shared_gate=1 is not allowed: True or False"),
    (dict(mlp="gated", moe_shared_gate=True), r"moe_shared_gate=True is not allowed: False when mlp='gated'"),
])
def test_bad_moe_settings_are_named(changes, match):
  with pytest.raises(ConfigError, match=match):
    ModelConfig(**(BASE | changes))


# transformers 5.0's experts (integrations/moe.py, use_experts_implementation's forward) look their forward up
# by the config's _experts_implementation, None in a module built outside a PreTrainedModel: KeyError: None
# (5.1's ExpertsInterface.get_interface falls back to eager). experts_implementation="eager" names the release's
# own loop on every release (transformers 4's configs keep it as an unused attribute).
EAGER = dict(experts_implementation="eager")


def _torch_setup():
  pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  import torch
  torch.manual_seed(0)
  return torch, transformers


def _randomize(torch, module):
  with torch.no_grad():
    for p in module.parameters():
      p.copy_(torch.randn_like(p) * 0.5)
    for name, b in module.named_buffers():
      b.copy_(torch.randn_like(b) * 0.3)
  return module.eval()


def _set(var, value):
  var[...] = jnp.asarray(value.detach().numpy(), jnp.float32)


def _compare(hf_out, layer, x):
  hf_out = hf_out[0] if isinstance(hf_out, tuple) else hf_out  # transformers 4's Mixtral adds router logits
  got = np.asarray(layer(jnp.asarray(x)))
  np.testing.assert_allclose(got, hf_out.detach().numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_against_gpt_oss_mlp():
  """The clamp at 7.0: transformers 4.55-5.18's GptOssExperts fix `self.limit = 7.0` (and ignore a
  config.swiglu_limit), 5.19 on read config.swiglu_limit, 7.0 by default; inputs large enough that it bites."""
  torch, transformers = _torch_setup()
  GptOssMLP = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss",
                                  reason="gpt-oss arrived in transformers 4.55").GptOssMLP
  c = transformers.GptOssConfig(hidden_size=10, intermediate_size=6, num_local_experts=4, num_experts_per_tok=2,
                                **EAGER)
  hf = _randomize(torch, GptOssMLP(c))
  cfg, layer = _layer("gpt_oss")
  cfg = cfg.replace(moe_swiglu_limit=moe.GPT_OSS_LIMIT)
  layer.m = cfg
  _set(layer.router_w, hf.router.weight.T)
  _set(layer.router_b, hf.router.bias)
  gu, gub = hf.experts.gate_up_proj, hf.experts.gate_up_proj_bias  # gate and up interleaved
  for name, a in (("w_gate", gu[..., ::2]), ("w_up", gu[..., 1::2]), ("b_gate", gub[:, ::2]),
                  ("b_up", gub[:, 1::2]), ("w_down", hf.experts.down_proj), ("b_down", hf.experts.down_proj_bias)):
    _set(getattr(layer, name), a)
  x = 5 * np.random.default_rng(1).standard_normal((2, 5, 10)).astype(np.float32)
  gate_up = (torch.einsum("nd,edf->nef", torch.from_numpy(x).reshape(-1, 10), gu) + gub).detach().numpy()
  assert (gate_up[..., ::2] > 7).any() and (np.abs(gate_up[..., 1::2]) > 7).any()  # both clamps bite
  _compare(hf(torch.from_numpy(x))[0], layer, x)


def _gate_up(layer, experts):
  if isinstance(experts, (list, tuple)) or not hasattr(experts, "gate_up_proj"):  # transformers 4: one
    import torch  # module per expert (Mixtral: w1 gate, w3 up, w2 down; DeepSeek: *_proj)
    names = ("w1", "w3", "w2") if hasattr(experts[0], "w1") else ("gate_proj", "up_proj", "down_proj")
    gate, up, down = (torch.stack([getattr(e, n).weight for e in experts]) for n in names)
    experts = type("Fused", (), {"gate_up_proj": torch.cat([gate, up], 1), "down_proj": down})
  F = experts.gate_up_proj.shape[1] // 2  # (E, 2F, D): gate rows first, then up
  _set(layer.w_gate, experts.gate_up_proj[:, :F].transpose(1, 2))
  _set(layer.w_up, experts.gate_up_proj[:, F:].transpose(1, 2))
  _set(layer.w_down, experts.down_proj.transpose(1, 2))


@pytest.mark.slow
def test_against_mixtral_sparse_moe_block():
  torch, transformers = _torch_setup()
  from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
  c = transformers.MixtralConfig(hidden_size=10, intermediate_size=6, num_local_experts=5, num_experts_per_tok=3,
                                 **EAGER)
  hf = _randomize(torch, MixtralSparseMoeBlock(c))
  cfg, layer = _layer("softmax")
  _set(layer.router_w, hf.gate.weight.T)
  _gate_up(layer, hf.experts)
  x = np.random.default_rng(2).standard_normal((2, 4, 10)).astype(np.float32)
  _compare(hf(torch.from_numpy(x)), layer, x)


@pytest.mark.slow
def test_against_deepseek_v3_moe():
  torch, transformers = _torch_setup()
  from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
  c = transformers.DeepseekV3Config(hidden_size=10, moe_intermediate_size=6, n_routed_experts=8,
                                    num_experts_per_tok=3, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                    n_shared_experts=2, norm_topk_prob=True, **EAGER)
  hf = _randomize(torch, DeepseekV3MoE(c))
  cfg, layer = _layer("deepseek")
  _set(layer.router_w, hf.gate.weight.T)
  _set(layer.correction, hf.gate.e_score_correction_bias)
  _gate_up(layer, hf.experts)
  s = hf.shared_experts
  pairs = ((layer.shared.gate, s.gate_proj), (layer.shared.up, s.up_proj), (layer.shared.down, s.down_proj))
  for mine, theirs in pairs:
    _set(mine.kernel, theirs.weight.T)
  x = np.random.default_rng(3).standard_normal((2, 4, 10)).astype(np.float32)
  _compare(hf(torch.from_numpy(x)), layer, x)


@pytest.mark.slow
def test_against_qwen3_next_sparse_moe_block():
  """The softmax router, experts, and a shared expert of its own width behind σ(x·w) (moe_shared_gate)."""
  torch, transformers = _torch_setup()
  block = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next",
                              reason="qwen3_next arrived in transformers 4.57").Qwen3NextSparseMoeBlock
  c = transformers.Qwen3NextConfig(hidden_size=10, moe_intermediate_size=6, shared_expert_intermediate_size=7,
                                   num_experts=5, num_experts_per_tok=2, norm_topk_prob=True, **EAGER)
  hf = _randomize(torch, block(c))
  cfg = ModelConfig(**BASE, moe_experts=5, moe_top_k=2, moe_d_ff=6, moe_shared_experts=1, moe_shared_d_ff=7,
                    moe_shared_gate=True, use_bias=False)
  rngs = nnx.Rngs(0)
  layer = moe.MoE(cfg, rngs=rngs, activation=lambda x: activate("silu", x), shared=MLP(cfg, rngs=rngs, d_ff=7))
  _set(layer.router_w, hf.gate.weight.T)
  _gate_up(layer, hf.experts)
  _set(layer.shared_gate, hf.shared_expert_gate.weight.T)
  s = hf.shared_expert
  for mine, theirs in ((layer.shared.gate, s.gate_proj), (layer.shared.up, s.up_proj), (layer.shared.down, s.down_proj)):
    _set(mine.kernel, theirs.weight.T)
  x = np.random.default_rng(5).standard_normal((2, 4, 10)).astype(np.float32)
  _compare(hf(torch.from_numpy(x)), layer, x)
