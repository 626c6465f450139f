"""Hybrid schedules: layer_types with "linear_attention" layers beside softmax ones (Qwen3-Next's
three linear layers to one full), decoding with KV caches and states together, refusals by name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attn import ConfigError
from attn.nn import DecoderLM, ModelConfig

LIN, FULL = "linear_attention", "full_attention"


def config(**kw):
  base = dict(vocab_size=13, d_model=16, num_layers=4, num_heads=4, d_ff=16, d_k=4, d_v=4,
              num_kv_heads=2, max_len=12, positional="rope", rope_dim=2, qk_norm=True,
              layer_types=(LIN, LIN, LIN, FULL),
              linear_head={"num_heads": 4, "num_kv_heads": 2, "d_k": 3, "d_v": 5, "chunk": 4})
  return ModelConfig(**{**base, **kw})


def tokens(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).integers(0, 13, shape), jnp.int32)


@pytest.mark.parametrize("linear_variant", ["gated_deltanet", "mamba2"])
def test_hybrid_decoding_equals_the_full_forward(linear_variant):
  model = DecoderLM(config(linear_variant=linear_variant), rngs=nnx.Rngs(0))
  tok = tokens(1, (2, 7))
  full = model(tok)
  model.init_cache(2, 9)
  outs = [model(tok[:, :4], decode=True)] + [model(tok[:, i:i + 1], decode=True) for i in range(4, 7)]
  np.testing.assert_allclose(jnp.concatenate(outs, 1), full, rtol=2e-5, atol=2e-5)
  linear_cache = {k: v[...].shape for k, v in model.blocks[0].attn.cache.items()}
  full_cache = {k: v[...].shape for k, v in model.blocks[3].attn.cache.items()}
  assert linear_cache["ssm"] == (2, 4, 3, 5)  # (B, H, d_k, d_v): fixed, whatever max_len
  assert full_cache == {"k": (2, 9, 2, 4), "v": (2, 9, 2, 4)}  # (B, max_len, G, d_k)


def test_each_layer_gets_its_variant_and_head():
  m = config()
  assert [m.layer_variant(i) for i in range(4)] == ["gated_deltanet"] * 3 + ["fused"]
  lin, full = m.layer_head(0), m.layer_head(3)
  assert (lin.num_heads, lin.num_kv_heads, lin.d_k, lin.d_v, lin.chunk) == (4, 2, 3, 5, 4)
  assert lin.rope_dim == 0 and lin.qk_norm is False and lin.layer == 1  # none of the model's
  assert full.rope_dim == 2 and full.qk_norm is True and full.layer == 4
  model = DecoderLM(m, rngs=nnx.Rngs(0))
  assert [b.attn.variant for b in model.blocks] == ["gated_deltanet"] * 3 + ["fused"]


def test_a_training_step_has_finite_gradients_and_right_padding_is_inert():
  model = DecoderLM(config(linear_variant="kda"), rngs=nnx.Rngs(0))
  tok = tokens(2, (2, 6))
  graph, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(p, t):
    return (nnx.merge(graph, p, rest)(t) ** 2).mean()

  grads = jax.grad(loss)(params, tok)
  leaves = jax.tree.leaves(grads)
  assert leaves and all(np.all(np.isfinite(g)) for g in leaves)
  assert any(float(jnp.abs(g).max()) > 0 for g in leaves)
  y = model(tok, lengths_B=jnp.array([6, 3]))
  y2 = model(tok.at[1, 3:].set(0), lengths_B=jnp.array([6, 3]))
  np.testing.assert_allclose(y2[1, :3], y[1, :3], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kw, field", [
    (dict(linear_variant="fused"), "linear_variant"),
    (dict(linear_head={"num_heads": 4, "num_kv_heads": 3}), "num_kv_heads"),
    (dict(linear_head={"heads": 4}), "linear_head.heads"),
    (dict(linear_head={"num_heads": 4, "chunk": 0}), "chunk"),
    (dict(layer_types=None), "linear_head"),
    (dict(layer_types=None, linear_head=None, linear_variant="kda"), "linear_variant"),
])
def test_bad_hybrid_refused_by_name(kw, field):
  with pytest.raises(ConfigError, match=f"{field}=.* is not allowed"):
    config(**kw)
