"""Inkling-2's text-model pieces that attn runs, each against transformers' own submodule (slow tier) and each
refused by name where set wrong (default tier).

Issue 53: the pieces attn.nn.hf.load._INKLING2 lists, one at a time, each off by default:
- the experts' softcapped SwiGLU (ModelConfig.moe_gate_softcap, moe_up_softcap) against Inkling2SparseMoeBlock
  (its sigmoid router with a correction bias and route_scale is attn's moe_router "sigmoid");
- the convolutions on the residual after every attention and MLP (ModelConfig.residual_conv) against
  Inkling2ShortConvolution, counted (W·D a sublayer), and a DecoderLM with them decoding as its full pass;
- the unembedding of unpadded_vocab_size rows (ModelConfig.output_vocab): logits over the first ids only.

Random weights, awkward sizes (D = 10, E = 5 experts, k = 3, F = 6), caps small enough to bite. Skipped by name
where transformers lacks inkling2 (the floor, 4.51.1).
"""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attn import ConfigError, count
from attn.nn import moe, short_conv
from attn.nn.config import ModelConfig
from attn.nn.models import DecoderLM, Encoder, activate

MOE = dict(vocab_size=11, d_model=10, num_layers=2, num_heads=2, d_k=4, d_ff=12, mlp="moe", activation="silu",
           max_len=16, moe_experts=5, moe_top_k=3, moe_d_ff=6, moe_router="sigmoid", moe_routed_scaling=2.5,
           use_bias=False)


def _inkling2():
  """transformers' inkling2 modeling and configuration modules; skipped by name without them."""
  pytest.importorskip("torch")
  reason = "transformers inkling2 (added in 5.x; absent on the floor 4.51.1)"
  return (pytest.importorskip("transformers.models.inkling2.modeling_inkling2", reason=reason),
          pytest.importorskip("transformers.models.inkling2.configuration_inkling2", reason=reason))


def _randomize(torch, module, scale: float = 0.5):
  with torch.no_grad():
    for p in module.parameters():
      p.copy_(torch.randn_like(p) * scale)
    for _, b in module.named_buffers():
      b.copy_(torch.randn_like(b) * 0.3)
  return module.eval()


def _set(var, tensor):
  var[...] = jnp.asarray(tensor.detach().numpy(), jnp.float32)


@pytest.mark.parametrize("changes, match", [
    (dict(moe_gate_softcap=0.0), r"moe_gate_softcap=0.0 is not allowed: a positive finite number"),
    (dict(moe_up_softcap=float("inf")), r"moe_up_softcap=inf is not allowed: a positive finite number"),
    (dict(moe_gate_softcap=4.0, activation="gelu"), r"moe_gate_softcap=4.0 is not allowed: None with "
                                                    r"activation='gelu'"),
    (dict(moe_up_softcap=25.0, moe_swiglu_limit=7.0), r"moe_up_softcap=25.0 is not allowed: None with .*"
                                                      r"moe_swiglu_limit=7.0"),
    (dict(mlp="gated", moe_experts=0, moe_top_k=0, moe_router="softmax", moe_routed_scaling=1.0,
          moe_d_ff=None, moe_gate_softcap=4.0), r"moe_gate_softcap=4.0 is not allowed: None when mlp='gated'"),
])
def test_bad_softcaps_are_named(changes, match):
  with pytest.raises(ConfigError, match=match):
    ModelConfig(**(MOE | changes))


def test_softcaps_off_is_swiglu_and_on_bounds_the_factors():
  """No cap: g·σ(g)·u, SwiGLU; caps: |cap(g)| ≤ c_g and |cap(u)| ≤ c_u whatever the inputs."""
  g, u = (jnp.asarray(np.random.default_rng(i).normal(size=(3, 7)) * 20, jnp.float32) for i in (0, 1))
  np.testing.assert_allclose(moe.softcapped_swiglu(g, u, None, None), activate("silu", g) * u, rtol=1e-6)
  capped = np.asarray(moe.softcapped_swiglu(g, u, 0.5, 2.0))
  assert np.all(np.abs(capped) <= 0.5 * 2.0 + 1e-6)


@pytest.mark.slow
def test_softcapped_experts_equal_inkling2_sparse_moe_block():
  """attn's MoE with moe_router "sigmoid" and the two caps equals Inkling2SparseMoeBlock: the router (sigmoid,
  correction bias in the choice only, renormalised, times route_scale) and the experts' capped SwiGLU."""
  modeling, configuration = _inkling2()
  import torch
  torch.manual_seed(0)
  c = configuration.Inkling2TextConfig(hidden_size=10, moe_intermediate_size=6, n_routed_experts=5,
                                       num_experts_per_tok=3, route_scale=2.5, mlp_gate_softcap=0.7,
                                       mlp_up_softcap=1.1)
  hf = _randomize(torch, modeling.Inkling2SparseMoeBlock(c))
  cfg = ModelConfig(**MOE, moe_gate_softcap=0.7, moe_up_softcap=1.1)
  layer = moe.MoE(cfg, rngs=nnx.Rngs(0), activation=lambda x: activate("silu", x))
  _set(layer.router_w, hf.gate.weight.T)
  _set(layer.correction, hf.gate.e_score_correction_bias)
  F = 6  # gate_up_proj (E, 2F, D): gate rows first, then up
  _set(layer.w_gate, hf.experts.gate_up_proj[:, :F].transpose(1, 2))
  _set(layer.w_up, hf.experts.gate_up_proj[:, F:].transpose(1, 2))
  _set(layer.w_down, hf.experts.down_proj.transpose(1, 2))
  x = np.random.default_rng(3).standard_normal((2, 5, 10)).astype(np.float32) * 2
  with torch.no_grad():
    want = hf(torch.from_numpy(x)).numpy()
  got = np.asarray(layer(jnp.asarray(x)))
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
  # the caps bite here: without them the layer is another function
  plain = moe.MoE(ModelConfig(**MOE), rngs=nnx.Rngs(0), activation=lambda x: activate("silu", x))
  nnx.update(plain, nnx.state(layer))
  assert np.abs(np.asarray(plain(jnp.asarray(x))) - want).max() > 1e-2


# residual_conv: (conv(y) + y)/sqrt(W + 1) on each sublayer's output

DENSE = dict(vocab_size=13, d_model=10, num_layers=2, num_heads=2, num_kv_heads=1, d_k=3, d_ff=7, mlp="gated",
             activation="silu", positional="none", norm_type="rmsnorm", use_bias=False, max_len=24,
             tie_embeddings=False)


@pytest.mark.parametrize("width", [0, True, 2.0, "3"])
def test_bad_residual_conv_is_named(width):
  with pytest.raises(ConfigError, match=rf"residual_conv={width!r} is not allowed: None .* or an integer >= 1"):
    ModelConfig(**DENSE, residual_conv=width)


def test_an_encoder_refuses_the_causal_residual_conv():
  with pytest.raises(ConfigError, match=r"residual_conv=3 is not allowed: None for Encoder"):
    Encoder(ModelConfig(**DENSE, residual_conv=3), rngs=nnx.Rngs(0))


def test_residual_conv_is_counted_and_decodes_as_its_full_pass():
  """W·D per attention and per MLP, counted as stored; tokens fed through the caches and states in three pieces (one of a
  single token, as decoding feeds them) give the full pass's logits."""
  import jax
  cfg = ModelConfig(**DENSE, residual_conv=3)
  model = DecoderLM(cfg, rngs=nnx.Rngs(0))
  stored = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert stored == count.model_param_count(cfg) == count.model_param_count(ModelConfig(**DENSE)) + 2 * 2 * 3 * 10
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 13, (2, 9)))
  full = np.asarray(model(tokens))
  model.init_cache(2, 9)
  parts = [np.asarray(model(tokens[:, a:b], decode=True)) for a, b in ((0, 4), (4, 5), (5, 9))]
  np.testing.assert_allclose(np.concatenate(parts, 1), full, atol=2e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("W", [1, 4])
def test_residual_conv_equals_inkling2_short_convolution(W):
  """short_conv.residual_conv with Conv1d's taps equals Inkling2ShortConvolution (no cache): the whole
  sequence, and the sequence in two pieces through the state."""
  modeling, _ = _inkling2()
  import torch
  torch.manual_seed(W)
  layer = modeling.Inkling2ShortConvolution(7, W, layer_idx=0, conv_idx=2).float().eval()
  with torch.no_grad():
    layer.conv1d.weight.normal_()
  y = np.random.default_rng(W).normal(size=(2, 11, 7)).astype(np.float32)
  with torch.no_grad():
    want = layer(torch.from_numpy(y)).numpy()
  w_WD = jnp.asarray(layer.conv1d.weight.detach().numpy()[:, 0].T)  # (D, 1, W) -> (W, D)
  got, state = short_conv.residual_conv(w_WD, jnp.asarray(y[:, :5]))
  rest, _ = short_conv.residual_conv(w_WD, jnp.asarray(y[:, 5:]), state)
  np.testing.assert_allclose(np.asarray(short_conv.residual_conv(w_WD, jnp.asarray(y))[0]), want, atol=1e-6)
  np.testing.assert_allclose(np.concatenate([got, rest], 1), want, atol=1e-6)


# output_vocab: an untied output layer of fewer rows than the token table


@pytest.mark.parametrize("changes, match", [
    (dict(output_vocab=14), r"output_vocab=14 is not allowed: None, or an integer in \[1, vocab_size=13\]"),
    (dict(output_vocab=0), r"output_vocab=0 is not allowed"),
    (dict(output_vocab=True), r"output_vocab=True is not allowed"),
    (dict(output_vocab=9, tie_embeddings=True), r"output_vocab=9 is not allowed: .*tie_embeddings=True"),
])
def test_bad_output_vocab_is_named(changes, match):
  with pytest.raises(ConfigError, match=match):
    ModelConfig(**(DENSE | changes))


def test_output_vocab_rows_are_the_logits_and_the_count():
  """An untied head of output_vocab rows: logits (B,T,output_vocab), the first rows of the full head's logits
  when it holds those rows; counted D·output_vocab."""
  import jax
  cfg = ModelConfig(**DENSE, output_vocab=9)
  model, full = DecoderLM(cfg, rngs=nnx.Rngs(0)), DecoderLM(ModelConfig(**DENSE), rngs=nnx.Rngs(0))
  model.head.linear.kernel[...] = full.head.linear.kernel[...][:, :9]
  for name in ("embed", "blocks", "final_norm"):
    nnx.update(getattr(model, name), nnx.state(getattr(full, name)))
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 13, (2, 5)))
  got, want = np.asarray(model(tokens)), np.asarray(full(tokens))
  assert got.shape == (2, 5, 9)
  np.testing.assert_array_equal(got, want[..., :9])
  stored = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert stored == count.model_param_count(cfg) == count.model_param_count(ModelConfig(**DENSE)) - 4 * 10
