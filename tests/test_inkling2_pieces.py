"""Inkling-2's text-model pieces, each against transformers' own submodule (slow tier) and each refused by name
where set wrong (default tier); the family they make up: tests/test_hf_inkling2.py.

Issue 53, one piece at a time, each off by default:
- the experts' softcapped SwiGLU (ModelConfig.moe_gate_softcap, moe_up_softcap) against Inkling2SparseMoeBlock
  (its sigmoid router with a correction bias and route_scale is attn's moe_router "sigmoid");
- the convolutions on the residual after every attention and MLP (ModelConfig.residual_conv) against
  Inkling2ShortConvolution, counted (W·D a sublayer), and a DecoderLM with them decoding as its full pass;
- the unembedding of unpadded_vocab_size rows (ModelConfig.output_vocab): logits over the first ids only;
- the heads' per-token sinks (token_sinks), relative position bias (rel_bias_*), log-position scaling
  (log_scaling_*), the query's learned scale before its clip (qk_clip_scale), the keys' and values' convolutions
  in Inkling-2's form (qkv_conv_residual) with per-token taps (qkv_conv_dynamic) and keys and values from inputs of
  their own (kv_inputs): each attention layer, sliding and hybrid, equal to Inkling2SlidingAttention /
  Inkling2FullAttention with nothing zeroed, the log scaling reached (log_scaling_n_floor 3 at 9 tokens); layers
  and a DecoderLM of those heads decode as their full pass; the kit (check_mechanism) on each record;
- block attention residuals (ModelConfig.attn_res_block, attn_res_kv_types): the depth mix against
  Inkling2BlockAttentionResidual (one query, three), a DecoderLM with them counted and decoding as its full pass.

Random weights, awkward sizes (D = 10 or 16, E = 5 experts, k = 3, F = 6; heads of 6 and 10 over 2 and 1 kv heads),
values that bite (caps, clips). Skipped by name where transformers lacks inkling2 (the floor, 4.51.1).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attn import ConfigError, count
from attn.nn import moe, short_conv
from attn.nn.config import ModelConfig
from attn.nn.models import DecoderLM, Encoder, activate

from test_hf_inkling2 import _skip_the_earlier_form  # transformers 5.23's earlier Inkling-2

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



def assert_pieces_give_the_full_pass(model, seed: int) -> None:
  """Nine random tokens fed through the caches and states in three pieces (one of a single token, as decoding
  feeds them) give the full pass's logits."""
  tokens = jnp.asarray(np.random.default_rng(seed).integers(0, 13, (2, 9)))
  full = np.asarray(model(tokens))
  model.init_cache(2, 9)
  parts = [np.asarray(model(tokens[:, a:b], decode=True)) for a, b in ((0, 4), (4, 5), (5, 9))]
  np.testing.assert_allclose(np.concatenate(parts, 1), full, atol=2e-5, rtol=1e-5)

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
  assert_pieces_give_the_full_pass(model, seed=0)


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


# The heads: token_sinks, rel_bias, log_scaling, qk_clip_scale beside the L2 clip, qkv_conv, value norm, gate

TEXT = dict(vocab_size=61, unpadded_vocab_size=57, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=10, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=6,
            sliding_window_size=3, d_rel=4, rel_extent=5, log_scaling_n_floor=3, log_scaling_alpha=0.7,
            rel_l2_clip_threshold=1.3, conv_kernel_size=3, qk_l2_clip_threshold=0.9, moe_intermediate_size=8,
            n_routed_experts=4, num_experts_per_tok=2, n_layers_per_attn_res_block=1,
            layer_types=["hybrid_sliding", "hybrid"], eos_token_id=0)


def _head_cfg(index: int):
  """attn's HeadConfig of TEXT's layer `index` (0 sliding, 1 hybrid): Inkling-2's heads in full."""
  from attn import HeadConfig
  t = TEXT
  sliding = index == 0
  H, G, K = ((t["swa_num_attention_heads"], t["swa_num_key_value_heads"], t["swa_head_dim"]) if sliding else
             (t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]))
  return HeadConfig(d_model=t["hidden_size"], num_heads=H, num_kv_heads=G, d_k=K, d_v=K, use_bias=False,
                    qk_l2_clip_threshold=t["qk_l2_clip_threshold"], qk_clip_scale=True, qkv_conv="kv",
                    qkv_conv_width=t["conv_kernel_size"], qkv_conv_residual=True, qkv_conv_dynamic=not sliding,
                    value_norm_eps=1e-6, gate="elementwise", token_sinks=True,
                    rel_bias_dim=t["d_rel"], rel_bias_extent=t["sliding_window_size"] if sliding else t["rel_extent"],
                    rel_bias_clip=t["rel_l2_clip_threshold"], window=t["sliding_window_size"] if sliding else None,
                    log_scaling_alpha=None if sliding else t["log_scaling_alpha"],
                    log_scaling_floor=1 if sliding else t["log_scaling_n_floor"])


def _taps(sd: dict, name: str, W: int, G: int, K: int, dynamic: bool) -> dict:
  """Inkling-2's key or value convolution as attn's qkv_conv_residual taps (W, G, K), Conv1d's order (the
  sliding layers' conv1d.weight, the hybrid's static_weight[lag] reversed), and the hybrid layers' per-token taps
  (D, G, W) from sconv.weight_proj (G·W rows by lag), reversed to Conv1d's order: no arithmetic."""
  c = name[0]
  if not dynamic:
    return {f"qkv_conv_{c}": sd[f"{name}.sconv.conv1d.weight"][:, 0].T.reshape(W, G, K)}
  dyn = sd[f"{name}.sconv.weight_proj.weight"].T
  return {f"qkv_conv_{c}": sd[f"{name}.sconv.static_weight"][::-1].reshape(W, G, K),
          f"qkv_conv_dyn_{c}": dyn.reshape(dyn.shape[0], G, W)[..., ::-1]}


def _head_params(sd: dict, head, hybrid: bool) -> dict:
  D, H, G, K, W = head.d_model, head.num_heads, head.num_kv_heads, head.d_k, head.qkv_conv_width
  d = head.rel_bias_dim
  return {"w_q": sd["q_proj.linear.weight"].T.reshape(D, H, K), "q_clip_scale": sd["q_proj.norm.scale"],
          "w_k": sd["k_proj.linear.weight"].T.reshape(D, G, K), "w_v": sd["v_proj.linear.weight"].T.reshape(D, G, K),
          "w_o": sd["o_proj.linear.weight"].T.reshape(H, K, D),
          "w_gate": sd["o_proj.gate_proj.weight"].T.reshape(D, H, K), "w_sink": sd["sink_proj.weight"].T,
          "w_rel": sd["relative_position_bias.linear.weight"].T.reshape(D, H, d),
          "rel_scale": sd["relative_position_bias.norm.scale"], "rel_proj": sd["relative_position_bias.proj"],
          **_taps(sd, "k_proj", W, G, K, hybrid), **_taps(sd, "v_proj", W, G, K, hybrid)}


@pytest.mark.slow
@pytest.mark.parametrize("index", [0, 1], ids=["sliding", "hybrid"])
def test_heads_equal_inkling2_attention(index):
  """attn.apply of layer `index`'s head equals Inkling2SlidingAttention / Inkling2FullAttention (eager, causal and
  windowed masks): per-token sinks, relative bias, log scaling all on; the hybrid layer's keys and values from
  inputs of their own (kv_inputs) through per-token taps."""
  _skip_the_earlier_form(_inkling2()[0])
  modeling, configuration = _inkling2()
  import jax
  import torch

  import attn
  config = configuration.Inkling2TextConfig(**TEXT)
  config._attn_implementation = "eager"
  head = _head_cfg(index)
  torch.manual_seed(index)
  layer = (modeling.Inkling2SlidingAttention, modeling.Inkling2FullAttention)[index](config, index).eval()
  with torch.no_grad():
    for p in layer.parameters():
      p.normal_(0.0, 0.6)  # clips, scales, taps, sinks and the bias away from their starting points
  sd = {k: v.detach().numpy() for k, v in layer.state_dict().items()}
  params = _head_params(sd, head, index == 1)
  shapes = jax.eval_shape(lambda: attn.init("per_head", jax.random.key(0), head))
  assert {k: v.shape for k, v in shapes.items()} == {k: v.shape for k, v in params.items()}
  B, T = 2, 9
  x, xk, xv = np.random.default_rng(index).normal(size=(3, B, T, head.d_model)).astype(np.float32)
  kv = (jnp.asarray(xk), jnp.asarray(xv)) if index == 1 else None
  got = attn.apply("per_head", {k: jnp.asarray(v) for k, v in params.items()}, jnp.asarray(x), cfg=head,
                   is_causal=True, kv_inputs=kv)
  pos = torch.arange(T)
  distance = pos[:, None] - pos[None, :]
  seen = (distance >= 0) & ((distance < TEXT["sliding_window_size"]) if index == 0 else True)
  mask = torch.where(seen, 0.0, torch.finfo(torch.float32).min)[None, None].expand(B, 1, T, T)
  inputs = torch.tensor(x)
  kwargs = {"key_hidden_states": torch.tensor(xk), "value_hidden_states": torch.tensor(xv)} if index == 1 else {}
  with torch.no_grad():
    want = layer(hidden_states=inputs, attention_mask=mask, relative_distance=distance,
                 position_ids=pos[None].expand(B, T), **kwargs)[0].numpy()
  np.testing.assert_allclose(np.asarray(got), want, atol=3e-6, rtol=1e-5)
  # each piece bites here: without the sinks, the bias or the log scaling the head is another function
  for off in (dict(token_sinks=False), dict(rel_bias_dim=0, rel_bias_extent=0, rel_bias_clip=None)) + (
      (dict(log_scaling_alpha=None, log_scaling_floor=1), dict(qkv_conv_dynamic=False)) if index else ()):
    cfg = head.replace(**off)
    kept = {k: jnp.asarray(v) for k, v in params.items() if k in jax.eval_shape(
        lambda: attn.init("per_head", jax.random.key(0), cfg))}
    other = attn.apply("per_head", kept, jnp.asarray(x), cfg=cfg, is_causal=True, kv_inputs=kv)
    assert np.abs(np.asarray(other) - want).max() > 1e-3, off


@pytest.mark.slow  # the kit's per_head decoding (tests/test_contract.py) has them on in the default tier
def test_token_mechanisms_decode_as_their_full_pass():
  """A DecoderLM of Inkling-2's heads (sliding: a window's ring; full: log scaling past its floor), per-token sinks
  and relative bias on both: the prompt then single tokens through the caches give the full pass's logits."""
  cfg = ModelConfig(**(DENSE | dict(num_layers=2, num_heads=3, num_kv_heads=1, d_k=4, d_v=4, max_len=16)),
                    layer_types=("sliding_attention", "full_attention"), window=3, qk_l2_clip_threshold=1.1,
                    qk_clip_scale=True, token_sinks=True, rel_bias_dim=2, rel_bias_extent=5, rel_bias_clip=0.8,
                    log_scaling_alpha=0.9, log_scaling_floor=2, qkv_conv="kv", qkv_conv_width=2)
  model = DecoderLM(cfg, rngs=nnx.Rngs(3))
  tokens = jnp.asarray(np.random.default_rng(4).integers(0, 13, (2, 11)))
  full = np.asarray(model(tokens))
  model.init_cache(2, 11)
  parts = [np.asarray(model(tokens[:, a:b], decode=True)) for a, b in ((0, 5), (5, 6), (6, 7), (7, 11))]
  np.testing.assert_allclose(np.concatenate(parts, 1), full, atol=2e-5, rtol=1e-5)


@pytest.mark.slow
def test_per_token_taps_and_kv_inputs_decode_as_their_full_pass():
  """MultiHeadAttention with qkv_conv_dynamic and keys and values from inputs of their own: the tokens in pieces
  through the cache and the convolutions' state give the full pass."""
  from attn import HeadConfig
  from attn.nn.attention import MultiHeadAttention
  cfg = HeadConfig(d_model=10, num_heads=3, num_kv_heads=1, d_k=4, d_v=5, use_bias=False, qkv_conv="kv",
                   qkv_conv_width=3, qkv_conv_residual=True, qkv_conv_dynamic=True, token_sinks=True,
                   rel_bias_dim=2, rel_bias_extent=4, log_scaling_alpha=0.5, log_scaling_floor=2)
  layer = MultiHeadAttention(cfg, "per_head", rngs=nnx.Rngs(5))
  x, xk, xv = (jnp.asarray(a) for a in np.random.default_rng(6).normal(size=(3, 2, 9, 10)).astype(np.float32))
  full = np.asarray(layer(x, is_causal=True, kv_inputs=(xk, xv)))
  layer.init_cache(2, 9)
  parts = [np.asarray(layer(x[:, a:b], decode=True, kv_inputs=(xk[:, a:b], xv[:, a:b])))
           for a, b in ((0, 4), (4, 5), (5, 9))]
  np.testing.assert_allclose(np.concatenate(parts, 1), full, atol=2e-5, rtol=1e-5)


def test_kv_inputs_refused_where_not_read():
  import attn
  cfg = attn.HeadConfig(d_model=8, num_heads=2)
  x = jnp.zeros((1, 3, 8))
  params = attn.init("fused", jax.random.key(0), cfg)
  with pytest.raises(ConfigError, match=r"kv_inputs='given' is not allowed: None for fused"):
    attn.apply("fused", params, x, cfg=cfg, kv_inputs=(x, x))
  with pytest.raises(ConfigError, match=r"kv_inputs=.* is not allowed: None, or \(the key projection's input"):
    attn.apply("per_head", attn.init("per_head", jax.random.key(0), cfg), x, cfg=cfg, kv_inputs=(x, x[:, :2]))


@pytest.mark.parametrize("changes, match", [
    (dict(qkv_conv_residual=True), r"qkv_conv_residual=True is not allowed: True or False, and False without "
                                   r"qkv_conv"),
    (dict(qkv_conv="kv", qkv_conv_dynamic=True), r"qkv_conv_dynamic=True is not allowed: .*and qkv_conv_residual"),
    (dict(token_sinks=True, sinks=True), r"token_sinks=True is not allowed: False with sinks=True"),
    (dict(token_sinks=1), r"token_sinks=1 is not allowed: True or False"),
    (dict(rel_bias_dim=-1), r"rel_bias_dim=-1 is not allowed: an integer >= 0"),
    (dict(rel_bias_dim=3), r"rel_bias_extent=0 is not allowed: an integer >= 1 with rel_bias_dim=3"),
    (dict(rel_bias_extent=4), r"rel_bias_extent=4 is not allowed: 0 with rel_bias_dim=0"),
    (dict(rel_bias_dim=3, rel_bias_extent=4, rel_bias_clip=0.0), r"rel_bias_clip=0.0 is not allowed"),
    (dict(rel_bias_clip=1.0), r"rel_bias_clip=1.0 is not allowed: None with rel_bias_dim=0"),
    (dict(log_scaling_alpha=-0.1), r"log_scaling_alpha=-0.1 is not allowed: a positive finite number"),
    (dict(log_scaling_floor=5), r"log_scaling_floor=5 is not allowed: .*1 with log_scaling_alpha=None"),
    (dict(log_scaling_alpha=0.1, log_scaling_floor=0), r"log_scaling_floor=0 is not allowed"),
    (dict(qk_clip_scale=True), r"qk_clip_scale=True is not allowed: .*False without qk_l2_clip_threshold"),
    (dict(token_sinks=True, extra={"moba": {"block": 2, "top_k": 1}}),
     r"token_sinks=True is not allowed: off with moba"),
])
def test_bad_token_mechanisms_are_named(changes, match):
  """Refused by name when the config is built or checked against a variant, before any tracing."""
  import attn
  with pytest.raises(ConfigError, match=match):
    cfg = attn.HeadConfig(d_model=8, num_heads=2, **changes)
    attn.api.check_config("per_head", cfg)


@pytest.mark.parametrize("variant", ["mla", "differential", "gated_deltanet"])
def test_variants_without_their_per_head_projections_refuse_them(variant):
  import attn
  cfg = attn.HeadConfig(d_model=8, num_heads=2, token_sinks=True)
  with pytest.raises(ConfigError, match=r"token_sinks=True is not allowed"):
    attn.api.check_config(variant, cfg)


# attn_res_block: block attention residuals


@pytest.mark.slow
@pytest.mark.parametrize("queries", [1, 3])
def test_depth_mix_equals_inkling2_block_attention_residual(queries):
  modeling, configuration = _inkling2()
  import torch
  from attn.nn import attn_res
  config = configuration.Inkling2TextConfig(**TEXT)
  config._attn_implementation = "eager"
  torch.manual_seed(queries)
  theirs = modeling.Inkling2BlockAttentionResidual(config, num_queries=queries).eval()
  with torch.no_grad():
    theirs.query.normal_(0.0, 2.0)
  mine = attn_res.DepthMix(16, queries)
  mine.query[...] = jnp.asarray(theirs.query.detach().numpy().reshape(queries, 16))
  rng = np.random.default_rng(queries)
  states, partial = rng.normal(size=(2, 5, 3, 16)).astype(np.float32) * 3, rng.normal(size=(2, 5, 16)).astype(np.float32)
  with torch.no_grad():
    want = [a.numpy() for a in theirs(torch.tensor(states), torch.tensor(partial))]
  got = mine([jnp.asarray(states[:, :, i]) for i in range(3)], jnp.asarray(partial))
  assert len(got) == len(want) == queries
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), w, atol=2e-6, rtol=1e-5)


RES = DENSE | dict(num_layers=3, variant="per_head", layer_types=("sliding_attention", "full_attention",
                   "sliding_attention"), window=3, attn_res_block=2, attn_res_kv_types=("full_attention",),
                   residual_conv=3, embed_norm=True)


@pytest.mark.parametrize("changes, match", [
    (dict(attn_res_block=0), r"attn_res_block=0 is not allowed: None or an integer >= 1"),
    (dict(attn_res_block=2, hc_mult=2), r"attn_res_block=2 is not allowed: None with hc_mult=2"),
    (dict(attn_res_block=2, norm="sandwich"), r"attn_res_block=2 is not allowed: None with norm='sandwich'"),
    (dict(attn_res_kv_types=("full_attention",)), r"attn_res_kv_types=\('full_attention',\) is not allowed: \(\) "
                                                  r"with attn_res_block=None"),
    (dict(attn_res_block=1, layer_types=("sliding_attention",) * 2, window=2, attn_res_kv_types=("full_attention",)),
     r"attn_res_kv_types=.* is not allowed: a tuple of the model's layer types \['sliding_attention'\]"),
    (dict(attn_res_block=1, layer_types=("full_attention",) * 2, attn_res_kv_types=("full_attention",)),
     r"attn_res_kv_types=.* is not allowed: layer types whose variant is per_head \(layer 0"),
])
def test_bad_attention_residuals_are_named(changes, match):
  with pytest.raises(ConfigError, match=match):
    ModelConfig(**(DENSE | changes))


def test_attention_residuals_are_counted():
  """Q·D per attention input after the first layer (3 on the split layer), D per MLP input and for the final
  mix, 2 norms on the split layer: counted as stored."""
  import jax
  cfg = ModelConfig(**RES)
  model = DecoderLM(cfg, rngs=nnx.Rngs(0))
  stored = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  extra = (3 + 1) * 10 + 3 * 10 + 10 + 2 * 10  # attention inputs, MLP inputs, final, k and v norms
  plain = ModelConfig(**(RES | dict(attn_res_block=None, attn_res_kv_types=())))
  assert stored == count.model_param_count(cfg) == count.model_param_count(plain) + extra


@pytest.mark.slow
def test_attention_residuals_decode_as_their_full_pass():
  """The tokens in pieces through the caches give the full pass (each position mixes its own depth only)."""
  import jax
  model = DecoderLM(ModelConfig(**RES), rngs=nnx.Rngs(0))
  for block in model.blocks:  # the queries start at zero (a uniform mix): give them something to choose
    for mix in (block.attn_input, block.mlp_input):
      if mix is not None:
        mix.query[...] = jax.random.normal(jax.random.key(7), mix.query.shape)
  assert_pieces_give_the_full_pass(model, seed=2)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["token_sinks", "rel_bias", "log_scaling", "qkv_conv", "qk_l2_clip"])
def test_check_mechanism(name):
  """The kit on each record (with its examples: qkv_conv's and qk_l2_clip's Inkling-2 forms among them): sharding
  letters, declared counts as stored, decoding = full pass, FLOPs against XLA's."""
  from attn import testing
  from attn.variants import mechanisms
  testing.check_mechanism(mechanisms.MECHANISMS[name])
