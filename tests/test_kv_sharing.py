"""Cross-layer KV sharing (ModelConfig.kv_source, attn.nn.kv_sharing): a layer attends to an earlier
layer's keys and values. Checked against cross-attention written with attn.apply (the sharing
layer's queries, its source's key and value weights on its source's input), decoding against the
full pass (with window rings), the counts against closed forms, and refusals by name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attn
from attn import ConfigError, count
from attn.count.measured import xla_flops
from attn.experiments.running import config as config_lib
from attn.nn.models import DecoderLM, _norm
from attn.nn.config import ModelConfig
from conftest import TINY_MQAR

# h = 4 does not divide d_model = 14; G = 2 < H; d_v ≠ d_k; sliding (window 3) and full layers.
BASE = dict(vocab_size=13, d_model=14, num_layers=4, num_heads=4, d_ff=16, d_k=4, d_v=3, num_kv_heads=2,
            variant="per_head", max_len=12, positional="rope", rope_dim=4, rope_theta=1000.0, window=3,
            global_every=2)
SHARED = (0, 1, 0, 1)  # layer 2 (sliding) reads layer 0's keys and values, layer 3 (full) layer 1's


def _tokens(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).integers(0, 13, shape), jnp.int32)


def _by_hand(model, tokens):
  """The stack block by block, each sharing layer as attn.apply cross-attention on its source's input."""
  cfg = model.cfg
  h = model.embed(tokens)
  inputs = {}
  for i, block in enumerate(model.blocks):
    head, p = cfg.layer_head(i), dict(block.attn.params_dict())
    src = cfg.kv_source[i]

    def attend(a, i=i, p=p, head=head, src=src):
      inputs[i] = a
      if src == i:
        return attn.apply(cfg.variant, p, a, cfg=head, is_causal=True)
      kv = {n: a_ for n, a_ in model.blocks[src].attn.params_dict().items() if n in ("w_k", "w_v", "b_k", "b_v")}
      return attn.apply(cfg.variant, p | kv, a, inputs[src], cfg=head, is_causal=True)

    h = block._residual(block.attn_norm, attend, h, block.attn_post_norm)
    h = block._residual(block.mlp_norm, block.mlp, h, block.mlp_post_norm)
  return model.head(_norm(model.final_norm, h))


@pytest.mark.slow
def test_a_sharing_layer_is_cross_attention_on_its_sources_keys_and_values():
  cfg = ModelConfig(**(BASE | dict(window=None, global_every=0)), kv_source=[0, 1, 1, 0])
  model = DecoderLM(cfg, rngs=nnx.Rngs(0))
  tokens = _tokens(1, (2, 7))
  got = nnx.jit(lambda m, t: m(t))(model, tokens)
  np.testing.assert_allclose(got, _by_hand(model, tokens), atol=2e-5, rtol=2e-5)
  unshared = DecoderLM(cfg.replace(kv_source=None), rngs=nnx.Rngs(0))
  assert float(jnp.abs(got - nnx.jit(lambda m, t: m(t))(unshared, tokens)).max()) > 1e-2


@pytest.mark.slow
def test_decoding_reads_the_sources_cache_and_equals_the_full_pass():
  cfg = ModelConfig(**BASE, kv_source=SHARED)
  model = DecoderLM(cfg, rngs=nnx.Rngs(2))
  tokens = _tokens(3, (2, 9))
  full = nnx.jit(lambda m, t: m(t))(model, tokens)
  np.testing.assert_allclose(full, _by_hand(model, tokens), atol=2e-5, rtol=2e-5)
  model.init_cache(2, 10)
  assert [b.attn.cache is not None for b in model.blocks] == [True, True, False, False]
  step = nnx.jit(lambda m, t: m(t, decode=True))
  outs, i = [], 0
  for T in (4, 1, 1, 1, 1, 1):  # a prompt longer than the sliding layers' ring, then single tokens
    outs.append(step(model, tokens[:, i:i + T]))
    i += T
  np.testing.assert_allclose(jnp.concatenate(outs, 1), full, atol=3e-5, rtol=3e-5)


def test_a_sharing_layer_holds_no_key_and_value_weights_and_the_count_follows():
  cfg = ModelConfig(**(BASE | dict(use_bias=True, qk_norm=True)), kv_source=SHARED)
  model = DecoderLM(cfg, rngs=nnx.Rngs(4))
  assert sorted(model.blocks[2].attn.params) == ["b_o", "b_q", "q_norm", "w_o", "w_q"]
  assert "w_k" in model.blocks[0].attn.params and "k_norm" in model.blocks[1].attn.params
  tokens = _tokens(5, (2, 6))
  grads = nnx.jit(nnx.grad(lambda m: (m(tokens) ** 2).mean()))(model)
  g = [{n: float(jnp.abs(a[...]).max()) for n, a in grads["blocks"][i]["attn"]["params"].items()}
       for i in range(4)]
  assert min(g[2]["w_q"], g[3]["q_norm"], g[0]["w_k"], g[1]["w_v"]) > 0
  leaves = sum(a.size for a in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert count.model_param_count(cfg, "decoder_lm") == leaves
  # Two layers without G·K + G·K + G·V weights, G·(K + K + V) biases and a key norm of K.
  G, K, V = 2, 4, 3
  assert count.model_param_count(cfg.replace(kv_source=None), "decoder_lm") - leaves == 2 * (
      14 * G * (K + V) + G * (K + V) + K)


def test_cache_bytes_count_each_shared_pair_once():
  cfg = ModelConfig(**BASE, kv_source=SHARED)
  per_layer = 4 * 2 * (4 + 3)  # float32, G·(K + V)
  assert count.model_kv_cache_bytes_per_token(cfg, "decoder_lm", "float32") == 2 * per_layer
  L = 10
  rows = {r["type"]: r for r in count.layer_type_table(cfg, "decoder_lm", L, "float32")}
  assert rows["sliding_attention"]["kv_shared_layers"] == rows["full_attention"]["kv_shared_layers"] == 1
  assert rows["total"]["kv_bytes_at_L"] == (3 + L) * per_layer  # one sliding ring, one full cache
  assert count.model_kv_cache_bytes(cfg.replace(kv_source=None), "decoder_lm", L, "float32") == 2 * (3 + L) * per_layer
  model = DecoderLM(cfg, rngs=nnx.Rngs(0))
  model.init_cache(2, L)
  held = sum(a[...][0].size // L if a[...].shape[1] == L else a[...][0].size // 3
             for b in model.blocks if b.attn.cache is not None for a in b.attn.cache.values())
  assert held * 4 == 2 * per_layer


@pytest.mark.parametrize("changes, match", [
    (dict(kv_source=[0, 2, 1, 1]), r"kv_source\[1\]=2 is not allowed: 1 \(its own keys and values\) or an earlier"),
    (dict(kv_source=[0, 1, 0, 2]), r"kv_source\[3\]=2 is not allowed: a layer with its own keys and values"),
    (dict(kv_source=[0, 0, 2, 3]), r"kv_source\[1\]=0 is not allowed: a layer with the same head: .*'window'"),
    (dict(kv_source=[0, 1, 2, 1], layer_heads={"full_attention": {"d_k": 6}}) , None),
    (dict(kv_source=[0, 1, 2]), r"kv_source='3 entries' is not allowed: one per layer"),
    (dict(kv_source=[0, 1, 0, 1], variant="mla", rope_dim=2), r"variant='mla' is not allowed: one whose keys"),
])
def test_bad_schedules_are_refused_by_name(changes, match):
  if match is None:  # a shared head of its own type's sizes is fine: layer 3 reads layer 1, both full
    ModelConfig(**(BASE | changes))
    with pytest.raises(ConfigError, match=r"kv_source\[2\]=1 is not allowed: a layer with the same head"):
      ModelConfig(**(BASE | changes | dict(kv_source=[0, 1, 1, 1])))
    return
  with pytest.raises(ConfigError, match=match):
    ModelConfig(**(BASE | changes))


def test_kv_source_through_toml():
  keys = "num_layers = 2\nkv_source = [0, 0]\n"
  text = TINY_MQAR.replace("num_layers = 1\n", "") + keys
  model = config_lib.loads(text, "a.toml", []).trials[0].config["model"]
  assert ModelConfig(**model).kv_source == (0, 0)
  with pytest.raises(ConfigError, match="a list of integers"):
    config_lib.loads(text.replace("[0, 0]", '"0"'), "b.toml", [])


def test_a_sharing_layer_saves_its_key_and_value_projections_in_closed_form_and_in_xla():
  """count.shared_flops_saved, 2·S·D·G·(K + V) per sharing layer, against XLA's cost analysis of the
  whole model with and without sharing (no RoPE or window: nothing else on the key side to count)."""
  cfg = ModelConfig(**(BASE | dict(positional="learned", rope_dim=0, window=None, global_every=0)),
                    kv_source=(0, 1, 1, 0))
  T, G, K, V, D = 6, 2, 4, 3, 14
  saved = [count.shared_flops_saved(cfg, i, T) for i in range(4)]
  assert saved == [0, 0, 2 * T * D * G * (K + V)] * 1 + [2 * T * D * G * (K + V)]
  tokens = jax.ShapeDtypeStruct((1, T), jnp.int32)

  def xla(c):
    graphdef, state = nnx.split(nnx.eval_shape(lambda: DecoderLM(c, rngs=nnx.Rngs(0))))  # shapes: lowered, not run
    return xla_flops(lambda s, t: nnx.merge(graphdef, s)(t), state, tokens)

  got = xla(cfg.replace(kv_source=None)) - xla(cfg)
  assert abs(got - sum(saved)) <= 0.05 * sum(saved), (got, sum(saved))
  rows = count.layer_type_table(cfg, "decoder_lm", T, "float32")
  assert rows[-1]["flops_fwd"] == 4 * count.flops("per_head", cfg.layer_head(0), T) - sum(saved)


def test_a_trials_attention_counts_follow_each_layers_variant_and_its_sharing():
  """The trial summary's attention figures (train.attention_counts) are attn count's: a sharing layer's
  key side left out of parameters and FLOPs, and each layer type counted as its own variant."""
  from attn.experiments.training import train
  cfg = ModelConfig(**(BASE | dict(use_bias=True, d_v=4, positional="learned", rope_dim=0)), kv_source=SHARED,
                    layer_heads={"full_attention": {"variant": "k_eq_v"}})
  assert [cfg.layer_variant(i) for i in range(4)] == ["per_head", "k_eq_v"] * 2
  got = train.attention_counts(cfg, 7)
  assert got["attention_params_analytic"] == count.model_param_breakdown(cfg, "decoder_lm")["attention"]
  rows = count.layer_type_table(cfg, "decoder_lm", 7, "float32")
  assert got["attention_flops_fwd"] == rows[-1]["flops_fwd"]
  assert got["attention_params_effective"] is None  # no closed form for a pair of layers sharing keys
  alone = train.attention_counts(cfg.replace(kv_source=None), 7)
  G, K, D = 2, 4, 14  # a sharing per_head layer drops w_k, w_v and their biases; a k_eq_v one w_kv, b_kv
  assert alone["attention_params_analytic"] - got["attention_params_analytic"] == (2 * D * G * K + 2 * G * K) + (
      D * G * K + G * K)
