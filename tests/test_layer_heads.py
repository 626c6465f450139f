"""Per-layer-type head sizes (ModelConfig.layer_heads, attn.nn.layer_heads): Gemma 4's global layers,
wider heads and fewer kv heads than the sliding ones. Each layer's head, its counts per type
against closed forms written here, a model that trains a step and decodes equal to its full pass,
and refusals by name."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from attn import ConfigError, HeadConfig, count
from attn.experiments.running import config as config_lib
from attn.nn.models import MODELS, DecoderLM
from attn.nn.config import ModelConfig
from attn.variants import grouped_lowrank
from conftest import TINY_MQAR

# h = 4 does not divide d_model = 14; sliding layers 2 kv heads of (4, 3), global 1 of (6, 6).
BASE = dict(vocab_size=13, d_model=14, num_layers=4, num_heads=4, d_ff=16, d_k=4, d_v=3, num_kv_heads=2,
            variant="per_head", max_len=12, positional="rope", rope_dim=4, rope_theta=1000.0, window=3,
            global_every=2)
GLOBAL = {"full_attention": {"d_k": 6, "d_v": 6, "num_kv_heads": 1}}


def test_each_layer_gets_its_types_sizes():
  cfg = ModelConfig(**BASE, layer_heads=GLOBAL)
  local = dict(d_model=14, num_heads=4, d_k=4, d_v=3, num_kv_heads=2, rope_dim=4, rope_theta=1000.0)
  glob = local | dict(d_k=6, d_v=6, num_kv_heads=1)
  assert [cfg.layer_head(i) for i in range(4)] == [
      HeadConfig(**local, window=3, layer=1), HeadConfig(**glob, layer=2),
      HeadConfig(**local, window=3, layer=3), HeadConfig(**glob, layer=4)]
  hash(cfg)  # frozen, so a config stays hashable
  # Derived sizes follow the layer's own: grouped_lowrank's full o_rank is H/g·V of the layer.
  grouped = ModelConfig(**(BASE | dict(variant="grouped_lowrank", o_groups=2)), layer_heads=GLOBAL)
  assert [grouped_lowrank.rank(grouped.layer_head(i)) for i in range(2)] == [2 * 3, 2 * 6]


def _attention_params(D, H, G, K, V):
  return D * (H * K + G * K + G * V) + H * V * D + (H * K + G * K + G * V + D)


def test_counts_and_cache_bytes_per_type():
  cfg = ModelConfig(**BASE, layer_heads=GLOBAL)
  L = 10
  rows = {r["type"]: r for r in count.layer_type_table(cfg, "decoder_lm", L, "float32")}
  assert rows["sliding_attention"]["params_per_layer"] == _attention_params(14, 4, 2, 4, 3)
  assert rows["full_attention"]["params_per_layer"] == _attention_params(14, 4, 1, 6, 6)
  assert rows["sliding_attention"]["kv_bytes_per_token_per_layer"] == 4 * 2 * (4 + 3)
  assert rows["full_attention"]["kv_bytes_per_token_per_layer"] == 4 * 1 * (6 + 6)
  assert rows["total"]["kv_bytes_at_L"] == 4 * (2 * 3 * 2 * 7 + 2 * L * 12)
  assert count.model_kv_cache_bytes_per_token(cfg, "decoder_lm", "float32") == 4 * (2 * 14 + 2 * 12)
  shapes = nnx.eval_shape(lambda: MODELS["decoder_lm"](cfg, rngs=nnx.Rngs(0)))
  assert count.model_param_count(cfg, "decoder_lm") == sum(
      a.size for a in jax.tree.leaves(nnx.state(shapes, nnx.Param)))
  # k_eq_v caches one tensor per kv head: K, not K + V.
  keqv = ModelConfig(**(BASE | dict(variant="k_eq_v", d_v=4)), layer_heads=GLOBAL)
  assert count.model_kv_cache_bytes_per_token(keqv, "decoder_lm", "float32") == 4 * (2 * 2 * 4 + 2 * 1 * 6)


@pytest.mark.slow
@pytest.mark.parametrize("variant, d_v", [("per_head", 3), ("k_eq_v", 4)])
def test_a_model_with_per_type_heads_trains_a_step_and_decodes_as_its_full_pass(variant, d_v):
  cfg = ModelConfig(**(BASE | dict(variant=variant, d_v=d_v)), layer_heads=GLOBAL)
  model = DecoderLM(cfg, rngs=nnx.Rngs(0))
  assert [b.attn.cfg.num_kv_heads for b in model.blocks] == [2, 1, 2, 1]
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 13, (2, 9)), jnp.int32)

  def loss_fn(m):
    logits = m(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

  @nnx.jit
  def train_step(m, opt):
    loss, grads = nnx.value_and_grad(loss_fn)(m)
    opt.update(m, grads)
    return loss

  before = nnx.jit(loss_fn)(model)
  loss = train_step(model, opt)
  assert np.isfinite(loss) and np.isclose(loss, before)
  assert nnx.jit(loss_fn)(model) < before
  full = nnx.jit(lambda m, t: m(t))(model, tokens)
  model.init_cache(2, 10)
  caches = [{n: a[...].shape[1:] for n, a in b.attn.cache.items()} for b in model.blocks]
  if variant == "k_eq_v":  # one tensor per kv head: the keys are the values
    assert caches == [{"kv": (3, 2, 4)}, {"kv": (10, 1, 6)}] * 2
  else:
    assert caches == [{"k": (3, 2, 4), "v": (3, 2, 3)}, {"k": (10, 1, 6), "v": (10, 1, 6)}] * 2
  step = nnx.jit(lambda m, t: m(t, decode=True))
  outs, i = [], 0
  for T in (4, 1, 1, 1, 1, 1):  # a prompt longer than the sliding layers' ring, then single tokens
    outs.append(step(model, tokens[:, i:i + T]))
    i += T
  np.testing.assert_allclose(jnp.concatenate(outs, 1), full, atol=3e-5, rtol=3e-5)


@pytest.mark.parametrize("table, match", [
    ({"chunked_attention": {"d_k": 8}}, r"layer_heads.chunked_attention=.* is not allowed: a layer type the model has"),
    ({"full_attention": {"num_heads": 2}}, r"layer_heads.full_attention.num_heads=2 is not allowed: one of"),
    ({"full_attention": {"d_k": 0}}, r"layer_heads.full_attention.d_k=0 is not allowed: a positive integer"),
    ({"full_attention": {"num_kv_heads": 3}}, r"layer_types\[1\]='full_attention': num_kv_heads=3 is not allowed"),
    ("wide", r"layer_heads='wide' is not allowed"),
])
def test_bad_tables_are_refused_by_name(table, match):
  with pytest.raises(ConfigError, match=match):
    ModelConfig(**BASE, layer_heads=table)


def test_k_eq_v_per_type_refuses_d_v_by_layer():
  with pytest.raises(ConfigError, match=r"layer_types\[1\]='full_attention': d_v=5"):
    ModelConfig(**(BASE | dict(variant="k_eq_v", d_v=4)), layer_heads={"full_attention": {"d_k": 6, "d_v": 5}})


def test_layer_heads_through_toml():
  keys = ('positional = "rope"\nrope_dim = 4\nd_k = 8\nd_v = 8\n'
          '[model.layer_heads.full_attention]\nd_k = 12\nd_v = 12\nnum_kv_heads = 1\n')
  model = config_lib.loads(TINY_MQAR + keys, "a.toml", []).trials[0].config["model"]
  cfg = ModelConfig(**model)
  assert cfg.layer_head(0).d_k == 12 and cfg.layer_head(0).num_kv_heads == 1
