"""Per-layer attention types: the schedule, NoPE, a per-type RoPE base, decoding, counts, refusals.

The heads each type should give are written out by hand here; decoding is
checked against the full pass of the same model (window ring, NoPE and
global layers in one stack); the counts against closed forms.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attn import ConfigError, HeadConfig, count
from attn.experiments.running import config as config_lib
from attn.nn import layer_types
from attn.nn.models import MODELS, DecoderLM
from attn.nn.config import ModelConfig
from conftest import TINY_MQAR

MIXED = ("sliding_attention", "full_attention_nope", "sliding_attention_nope", "full_attention")
BASE = dict(vocab_size=13, d_model=12, num_layers=4, num_heads=4, d_ff=16, d_k=4, d_v=3, num_kv_heads=2,
            variant="per_head", max_len=12, positional="rope", rope_dim=4, rope_theta=1000.0, window=3)


def test_each_type_sets_window_and_rope_as_written_here():
  cfg = ModelConfig(**BASE, layer_types=list(MIXED), sliding_rope_theta=10.0, rope_scaling="linear",
                    rope_factor=2.0)
  assert cfg.layer_types == MIXED  # a list (TOML, JSON) becomes a tuple
  head = dict(d_model=12, num_heads=4, d_k=4, d_v=3, num_kv_heads=2)
  want = [HeadConfig(**head, window=3, rope_dim=4, rope_theta=10.0, layer=1),  # own base, unscaled
          HeadConfig(**head, layer=2),
          HeadConfig(**head, window=3, layer=3),
          HeadConfig(**head, rope_dim=4, rope_theta=1000.0, rope_scaling="linear", rope_factor=2.0, layer=4)]
  assert [cfg.layer_head(i) for i in range(4)] == want
  assert layer_types.schedule(cfg) == MIXED


def test_global_every_is_a_shorthand_for_the_list():
  short = ModelConfig(**BASE, global_every=2)
  spelled = ModelConfig(**BASE, layer_types=["sliding_attention", "full_attention"] * 2)
  assert layer_types.schedule(short) == spelled.layer_types
  assert [short.layer_head(i) for i in range(4)] == [spelled.layer_head(i) for i in range(4)]
  assert layer_types.schedule(short.replace(global_every=0)) == ("sliding_attention",) * 4
  assert layer_types.schedule(ModelConfig(**(BASE | dict(window=None)))) == ("full_attention",) * 4


@pytest.mark.slow  # a whole model with every layer type, decoded: the fast tier's time limit
def test_decoding_equals_the_full_pass_with_window_nope_and_global_layers():
  """One model with all of this change: the four types, a sliding base, interleaved YaRN RoPE, experts."""
  cfg = ModelConfig(**BASE, layer_types=MIXED, sliding_rope_theta=10.0, sinks=True, rope_layout="interleaved",
                    rope_scaling="yarn", rope_factor=4.0, rope_original_max_len=4, mlp="moe", activation="silu",
                    moe_experts=3, moe_top_k=2)
  model = DecoderLM(cfg, rngs=nnx.Rngs(0))
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 13, (2, 9)), jnp.int32)
  full = nnx.jit(lambda m, t: m(t))(model, tokens)
  model.init_cache(2, 10)
  assert [next(iter(b.attn.cache.values()))[...].shape[1] for b in model.blocks] == [3, 10, 3, 10]
  step = nnx.jit(lambda m, t: m(t, decode=True))
  outs, i = [], 0
  for T in (4, 1, 1, 1, 1, 1):  # a prompt longer than the ring, then single tokens
    outs.append(step(model, tokens[:, i:i + T]))
    i += T
  np.testing.assert_allclose(jnp.concatenate(outs, 1), full, atol=2e-5, rtol=2e-5)


def test_nope_layers_are_position_free():
  """A model of NoPE layers only is the same function as the same weights with positional 'none'."""
  cfg = ModelConfig(**(BASE | dict(window=None, num_layers=1)), layer_types=["full_attention_nope"])
  nope = DecoderLM(cfg, rngs=nnx.Rngs(2))
  weights = nnx.state(nope, nnx.Param)  # the same weights in models built from shapes only
  plain, rope = (nnx.eval_shape(lambda c=c: DecoderLM(c, rngs=nnx.Rngs(3)))
                 for c in (cfg.replace(positional="none", rope_dim=0, layer_types=None), cfg.replace(layer_types=None)))
  nnx.update(plain, weights)
  nnx.update(rope, weights)
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, 13, (2, 6)), jnp.int32)
  forward = nnx.jit(lambda m, t: m(t))  # one compile per model, not op by op
  np.testing.assert_allclose(forward(nope, tokens), forward(plain, tokens), atol=1e-6)
  assert not np.allclose(forward(nope, tokens), forward(rope, tokens))


@pytest.mark.slow
def test_mla_decoding_with_nope_and_window_layers():
  """mla caches its latent and, in layers with RoPE only, its decoupled key."""
  cfg = ModelConfig(**(BASE | dict(variant="mla", rope_dim=2, latent_dim=6, max_len=10)), layer_types=MIXED)
  model = DecoderLM(cfg, rngs=nnx.Rngs(4))
  tokens = jnp.asarray(np.random.default_rng(3).integers(0, 13, (2, 8)), jnp.int32)
  full = model(tokens)
  model.init_cache(2, 8)
  outs = [model(tokens[:, :5], decode=True)] + [model(tokens[:, i:i + 1], decode=True) for i in range(5, 8)]
  np.testing.assert_allclose(jnp.concatenate(outs, 1), full, atol=3e-5, rtol=3e-5)


def test_counts_per_type_against_closed_forms():
  """KV cache at L: a sliding layer min(L, w), a full one L tokens of 2·G·K bytes (bf16: ×2)."""
  cfg = ModelConfig(**(BASE | dict(d_v=4, num_layers=9)), layer_types=MIXED * 2 + ("full_attention",))
  L, G, K = 20, 2, 4
  rows = {r["type"]: r for r in count.layer_type_table(cfg, "decoder_lm", L)}
  per_token = 2 * G * K * 4  # float32, count.DTYPE
  assert rows["sliding_attention"]["kv_bytes_at_L"] == 2 * 3 * per_token
  assert rows["full_attention_nope"]["kv_bytes_at_L"] == 2 * L * per_token
  assert rows["full_attention"]["layers"] == 3 and rows["full_attention"]["kv_bytes_at_L"] == 3 * L * per_token
  assert rows["total"]["kv_bytes_at_L"] == (4 * 3 + 5 * L) * per_token
  assert count.model_kv_cache_bytes(cfg, "decoder_lm", L) == rows["total"]["kv_bytes_at_L"]
  assert rows["total"]["params"] == count.model_param_breakdown(cfg, "decoder_lm")["attention"]
  assert rows["sliding_attention"]["flops_fwd_per_layer"] == count.flops("per_head", cfg.layer_head(0), L)
  mla = cfg.replace(variant="mla", rope_dim=2, latent_dim=6, layer_types=MIXED, num_layers=4)
  # mla caches d_c + rope_dim per token with RoPE, d_c without: 2 layers of each.
  assert count.model_kv_cache_bytes_per_token(mla, "decoder_lm") == (2 * (6 + 2) + 2 * 6) * 4  # float32
  for m, kind in ((mla, "decoder_lm"), (mla.replace(num_decoder_layers=4), "encoder_decoder")):
    shapes = nnx.eval_shape(lambda: MODELS[kind](m, rngs=nnx.Rngs(0)))  # without RoPE mla has no W^KR
    assert count.model_param_count(m, kind) == sum(a.size for a in jax.tree.leaves(nnx.state(shapes, nnx.Param)))


def test_count_cli_sums_the_types(capsys):
  from attn import cli
  argv = ["count", "--preset", "gpt2", "--variant", "fused", "--window", "512", "--global-every", "4",
          "--seq-len", "8192", "--format", "json"]
  assert cli.main(argv) == 0
  rows = {r["type"]: r for r in json.loads(capsys.readouterr().out)["model"]["layer_types"]}
  per_token = 2 * 12 * 64 * 4  # GPT-2 small: 12 heads of 64, float32
  assert rows["sliding_attention"]["layers"] == 9 and rows["full_attention"]["layers"] == 3
  assert rows["total"]["kv_bytes_at_L"] == (9 * 512 + 3 * 8192) * per_token
  assert cli.main(["count", "--layer-types", "full_attention"]) == 2
  assert "layer_types is not allowed without --preset" in capsys.readouterr().err


@pytest.mark.parametrize("changes, match", [
    (dict(layer_types=MIXED[:3]), r"layer_types='3 entries' is not allowed: one per layer: num_layers=4"),
    (dict(layer_types=MIXED[:3] + ("chunked_attention",)),
     r"layer_types\[3\]='chunked_attention' is not allowed: one of \['full_attention'"),
    (dict(layer_types=MIXED, window=None), r"layer_types\[0\]='sliding_attention' is not allowed: a "
                                           r"full_attention type when window=None"),
    (dict(layer_types=("full_attention",) * 4), r"window=3 is not allowed: None: no entry of layer_types"),
    (dict(layer_types=MIXED, positional="learned", rope_dim=0),
     r"layer_types\[1\]='full_attention_nope' is not allowed: a type with RoPE when positional='learned'"),
    (dict(layer_types=MIXED, global_every=2), r"global_every=2 is not allowed: 0 when layer_types is given"),
    (dict(layer_types="full_attention"), r"layer_types='full_attention' is not allowed: None or a list"),
    (dict(layer_types=MIXED, num_decoder_layers=2), r"num_decoder_layers=2 is not allowed"),
    (dict(sliding_rope_theta=0.0), r"sliding_rope_theta=0.0 is not allowed: None or a positive"),
    (dict(layer_types=("sliding_attention_nope", "full_attention") * 2, sliding_rope_theta=10.0),
     r"sliding_rope_theta=10.0 is not allowed: None: no layer is sliding with RoPE"),
])
def test_bad_schedules_name_the_field_and_the_layer(changes, match):
  with pytest.raises(ConfigError, match=match):
    ModelConfig(**(BASE | changes))


def test_layer_types_through_toml():
  keys = 'positional = "rope"\nrope_dim = 8\nwindow = 4\nlayer_types = ["sliding_attention_nope"]\n'
  model = config_lib.loads(TINY_MQAR + keys, "a.toml", []).trials[0].config["model"]
  assert ModelConfig(**model).layer_types == ("sliding_attention_nope",)
  with pytest.raises(ConfigError, match="model.layer_types=3 is not allowed: a list of strings"):
    config_lib.loads(TINY_MQAR + keys.replace('["sliding_attention_nope"]', "3"), "b.toml", [])
