"""ZAYA1's router and residuals as options of the general model (attn.nn.moe, attn.nn.models): the router
network (moe_router_mlp), its state carried across expert layers (moe_router_carry), the skip expert
(moe_skip_expert) and the rescaled residuals (residual_scale).

One expert layer against a numpy loop that routes token by token (argsort over the probabilities plus
the balancing bias, only the chosen experts run, the skip class runs none), the carried state handed in
as transformers' ZayaRouter takes it; the closed-form counts against the models' parameter trees; the
options refused by name before tracing; in the slow tier, decoding through the cache against the full
pass with the state carried across a dense layer. transformers' own ZAYA modules are the second check
(tests/test_hf_zaya.py).
"""

import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attn import ConfigError, count
from attn.nn import moe
from attn.nn.config import ModelConfig
from attn.nn.models import DecoderLM, activate
from conftest import randn

BASE = dict(vocab_size=11, d_model=10, num_layers=3, num_heads=2, d_k=4, d_ff=12, mlp="moe", activation="silu",
            max_len=16, moe_experts=3, moe_top_k=1, moe_d_ff=6, moe_router_mlp=5, moe_norm_topk=False,
            moe_skip_expert=True, use_bias=False)


def _layer(carried: bool, seed: int = 0, **changes) -> tuple[ModelConfig, moe.MoE]:
  """An expert layer with every router weight and the balancing bias moved off its init."""
  cfg = ModelConfig(**(BASE | dict(moe_router_carry=carried) | changes))
  layer = moe.MoE(cfg, rngs=nnx.Rngs(seed), activation=lambda x: activate("silu", x), carried=carried)
  rng = np.random.default_rng(seed + 1)
  for var in [*jax.tree.leaves(nnx.state(layer.router_net, nnx.Param), is_leaf=lambda v: isinstance(v, nnx.Variable)),
              layer.correction]:
    var[...] = var[...] + jnp.asarray(rng.standard_normal(var[...].shape) * 0.5, jnp.float32)
  layer.correction[...] = jnp.asarray([0.0, 0.0, 0.0, 0.2], jnp.float32)  # the skip class chosen at times
  return cfg, layer


def _numpy_moe(cfg, layer, x, state=None):
  """Token by token: r (+ s⊙state), the router network, the top k of probabilities + bias, only the chosen
  experts (the skip class: none), weighted by their probabilities."""
  net = {k: np.asarray(v, np.float64) for k, v in nnx.to_pure_dict(nnx.state(layer.router_net)).items()}
  g = lambda name: np.asarray(getattr(layer, name)[...], np.float64)  # noqa: E731
  gelu = np.vectorize(lambda a: 0.5 * a * (1 + math.erf(a / math.sqrt(2))))
  E, k = cfg.moe_experts, cfg.moe_top_k
  out, rs, skips = np.zeros(x.shape, np.float64), np.zeros(x.shape[:2] + (cfg.moe_router_mlp,)), 0
  for b in range(x.shape[0]):
    for t in range(x.shape[1]):
      xt = np.asarray(x[b, t], np.float64)
      r = xt @ net["down"] + net["down_b"] + (0 if state is None else state[b, t] * net["carry_scale"])
      rs[b, t] = r
      h = r / np.sqrt(np.mean(r * r) + cfg.norm_eps) * net["norm"]
      h = gelu(gelu(h @ net["fc1"] + net["fc1_b"]) @ net["fc2"] + net["fc2_b"])
      logits = h @ net["out"]
      p = np.exp(logits - logits.max())
      p /= p.sum()
      for e in np.argsort(-(p + g("correction")), kind="stable")[:k]:
        if e == E:  # the skip expert
          skips += 1
          continue
        gate, up = xt @ g("w_gate")[e], xt @ g("w_up")[e]
        out[b, t] += p[e] * ((gate / (1 + np.exp(-gate)) * up) @ g("w_down")[e])
  return out, rs, skips


@pytest.mark.parametrize("carried", [False, True])
def test_an_expert_layer_against_a_numpy_loop(carried):
  cfg, layer = _layer(carried)
  x = randn(3, (2, 7, 10))
  state = np.asarray(randn(4, (2, 7, 5))) if carried else None
  holder = None
  if carried:
    with moe.carrying([types.SimpleNamespace(mlp=layer)]) as holder:
      holder["state"] = jnp.asarray(state)
      got = np.asarray(layer(x))
  else:
    got = np.asarray(layer(x))
  want, rs, skips = _numpy_moe(cfg, layer, np.asarray(x), state)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert 0 < skips < 14  # the skip class chosen by some tokens, an expert by the others
  if carried:
    np.testing.assert_allclose(np.asarray(holder["state"]), rs, rtol=1e-5, atol=1e-6)  # carried on


def _measured(cfg: ModelConfig) -> int:
  model = nnx.eval_shape(lambda: DecoderLM(cfg, rngs=nnx.Rngs(0)))
  return sum(a.size for a in jax.tree.leaves(nnx.state(model, nnx.Param)))


@pytest.mark.parametrize("changes", [
    dict(moe_router_carry=True, residual_scale=True, norm_type="rmsnorm", positional="rope", rope_dim=4),
    dict(moe_router_carry=True, moe_layer_types=("sparse", "dense", "sparse"), dense_bias=True),
    dict(moe_router_carry=True, block_kinds=("attention", "mlp", "attention_mlp"), residual_scale=True),
    dict(moe_router_mlp=None, moe_top_k=2, moe_norm_topk=True),  # a skip class on a plain softmax router
    dict(moe_skip_expert=False, moe_router_mlp=7),
], ids=["zaya", "dense_between", "single_mixers", "skip_only", "net_only"])
def test_counts_are_the_parameter_trees(changes):
  """The closed forms (attn.count) against the models' nnx.Param trees: the router network, a carry scale in
  every expert layer but the first, the skip class, four (D,) per sublayer and two for the embeddings."""
  cfg = ModelConfig(**(BASE | changes))
  assert count.model_param_count(cfg) == _measured(cfg)
  plain = cfg.replace(moe_router_carry=False, residual_scale=False)
  layers = sum(cfg.has_attention(i) for i in range(3)) + sum(cfg.has_mlp(i) for i in range(3))
  carried = sum(cfg.router_carried(i) for i in range(3))
  assert count.model_param_count(cfg) - count.model_param_count(plain) == (
      carried * (cfg.moe_router_mlp or 0) + (layers * 4 * 10 + 2 * 10 if cfg.residual_scale else 0))
  R, C, D = cfg.moe_router_mlp, 3 + cfg.moe_skip_expert, 10
  router = D * C if R is None else D * R + 2 * R + 2 * (R * R + R) + R * C
  assert count.expert_params(cfg)["total"] == 3 * 3 * D * 6 + router + (2 * 6 + D) * 3 * cfg.has_dense_bias


@pytest.mark.parametrize("changes, match", [
    (dict(moe_router_mlp=0), r"moe_router_mlp=0 is not allowed: an integer >= 1"),
    (dict(moe_router_carry=1), r"moe_router_carry=1 is not allowed: True or False"),
    (dict(moe_skip_expert="yes"), r"moe_skip_expert='yes' is not allowed: True or False"),
    (dict(moe_router_mlp=None, moe_skip_expert=False, moe_router_carry=True),
     r"moe_router_carry=True is not allowed: False without moe_router_mlp"),
    (dict(moe_router="sigmoid", moe_experts=4), r"moe_router_mlp=5 is not allowed: None with moe_router='sigmoid'"),
    (dict(moe_router_mlp=None, moe_pool_width=4, norm_type="rmsnorm"),
     r"moe_skip_expert=True is not allowed: False with .*moe_pool_width=4"),
    (dict(moe_router_carry=True, num_decoder_layers=1),
     r"moe_router_carry=True is not allowed: False with num_decoder_layers=1"),
    (dict(mlp="gated", moe_experts=0, moe_top_k=0, moe_d_ff=None, moe_norm_topk=True, moe_skip_expert=False),
     r"moe_router_mlp=5 is not allowed: None when mlp='gated'"),
    (dict(residual_scale=1), r"residual_scale=1 is not allowed: True or False"),
    (dict(residual_scale=True, norm="post"), r"residual_scale=True is not allowed: False with norm='post'"),
    (dict(residual_scale=True, residual_gate=0.3, norm="sandwich", norm_type="rmsnorm"),
     r"residual_scale=True is not allowed: False with .*residual_gate=0.3"),
    (dict(residual_scale=True, hc_mult=2), r"residual_scale=True is not allowed: False with .*hc_mult=2"),
])
def test_bad_settings_are_named_before_tracing(changes, match):
  with pytest.raises(ConfigError, match=match):
    ModelConfig(**(BASE | changes))


@pytest.mark.slow  # three compiles of a 3-layer model; test_an_expert_layer_against_a_numpy_loop is the sibling
def test_decoding_equals_the_full_pass_with_the_state_carried_across_a_dense_layer():
  """Prompt of 5 then 4 tokens one at a time against the full pass; the carry and the residual scales act
  (setting the carry scales to zero, or a residual scale to 2, moves the logits)."""
  cfg = ModelConfig(**(BASE | dict(moe_router_carry=True, residual_scale=True, moe_layer_types=("sparse", "dense",
                                                                                                  "sparse"))))
  model = DecoderLM(cfg, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(5)
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    if "router_net" in path or "scale" in str(path[-1]) or "bias" in str(path[-1]):
      var[...] = var[...] + jnp.asarray(rng.standard_normal(var[...].shape) * 0.3, jnp.float32)
  ids = jnp.asarray(rng.integers(0, 11, (2, 9)))
  full = np.asarray(nnx.jit(lambda m, t: m(t))(model, ids))
  model.init_cache(2, 16)
  step = nnx.jit(lambda m, t: m(t, decode=True))
  got = np.concatenate([np.asarray(step(model, ids[:, :5]))] + [np.asarray(step(model, ids[:, t:t + 1]))
                                                               for t in range(5, 9)], 1)
  np.testing.assert_allclose(got, full, rtol=1e-5, atol=1e-5 * np.abs(full).max())
  assert model.blocks[2].mlp.router_net.carry_scale is not None and model.blocks[0].mlp.router_net.carry_scale is None
  model.blocks[2].mlp.router_net.carry_scale[...] = jnp.zeros(5)
  model.blocks[0].attn_scale.res_scale[...] = 2 * model.blocks[0].attn_scale.res_scale[...]
  assert np.abs(np.asarray(nnx.jit(lambda m, t: m(t))(model, ids)) - full).max() > 1e-3
