"""Hybrid schedules: layer_types with "linear_attention" layers beside softmax ones (Qwen3-Next's
three linear layers to one full), decoding with KV caches and states together, refusals by name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attn import ConfigError
from attn.nn import DecoderLM
from attn.nn.config import ModelConfig

LIN, FULL = "linear_attention", "full_attention"


def config(**kw):
  base = dict(vocab_size=13, d_model=16, num_layers=4, num_heads=4, d_ff=16, d_k=4, d_v=4,
              num_kv_heads=2, max_len=12, positional="rope", rope_dim=2, qk_norm=True,
              layer_types=(LIN, LIN, LIN, FULL),
              linear_head={"num_heads": 4, "num_kv_heads": 2, "d_k": 3, "d_v": 5, "chunk": 4})
  return ModelConfig(**{**base, **kw})


def tokens(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).integers(0, 13, shape), jnp.int32)


# Slow: one linear layer then one full (the cache and the state side by side), and Qwen3-Next's schedule,
# three linear layers to one full. The fast sibling: test_block_kinds' decoding through a mamba2 layer's
# state beside a full layer's KV cache (and MLP-only blocks); each linear head's own decoding: the kit
# (test_contract's gated_deltanet and kda); the state's size: test_state_and_kv_cache_counts_of_a_hybrid.
@pytest.mark.slow
@pytest.mark.parametrize("linear_variant, layer_types", [
    ("gated_deltanet", (LIN, FULL)), ("mamba2", (LIN, LIN, LIN, FULL))])
def test_hybrid_decoding_equals_the_full_forward(linear_variant, layer_types):
  model = DecoderLM(config(linear_variant=linear_variant, num_layers=len(layer_types), layer_types=layer_types),
                    rngs=nnx.Rngs(0))
  tok = tokens(1, (2, 7))
  full = nnx.jit(lambda m, t: m(t))(model, tok)
  model.init_cache(2, 9)
  step = nnx.jit(lambda m, t: m(t, decode=True))  # one compile per step length (4, then 1)
  outs = [step(model, tok[:, :4])] + [step(model, tok[:, i:i + 1]) for i in range(4, 7)]
  np.testing.assert_allclose(jnp.concatenate(outs, 1), full, rtol=2e-5, atol=2e-5)
  linear_cache = {k: v[...].shape for k, v in model.blocks[0].attn.cache.items()}
  full_cache = {k: v[...].shape for k, v in model.blocks[-1].attn.cache.items()}
  assert linear_cache["ssm"] == (2, 4, 3, 5)  # (B, H, d_k, d_v): fixed, whatever max_len
  assert full_cache == {"k": (2, 9, 2, 4), "v": (2, 9, 2, 4)}  # (B, max_len, G, d_k)


def test_each_layer_gets_its_variant_and_head():
  m = config()
  assert [m.layer_variant(i) for i in range(4)] == ["gated_deltanet"] * 3 + ["fused"]
  lin, full = m.layer_head(0), m.layer_head(3)
  assert (lin.num_heads, lin.num_kv_heads, lin.d_k, lin.d_v, lin.chunk) == (4, 2, 3, 5, 4)
  assert lin.rope_dim == 0 and lin.qk_norm is False and lin.layer == 1  # none of the model's
  assert full.rope_dim == 2 and full.qk_norm is True and full.layer == 4
  model = nnx.eval_shape(lambda: DecoderLM(m, rngs=nnx.Rngs(0)))  # shapes only
  assert [b.attn.variant for b in model.blocks] == ["gated_deltanet"] * 3 + ["fused"]


@pytest.mark.slow  # ~10 s: a 4-layer model's gradient compiled (each layer's grads: the kit's)
def test_a_training_step_has_finite_gradients_and_right_padding_is_inert():
  model = DecoderLM(config(linear_variant="kda"), rngs=nnx.Rngs(0))
  tok = tokens(2, (2, 6))
  graph, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(p, t):
    return (nnx.merge(graph, p, rest)(t) ** 2).mean()

  grads = jax.jit(jax.grad(loss))(params, tok)
  leaves = jax.tree.leaves(grads)
  assert leaves and all(np.all(np.isfinite(g)) for g in leaves)
  assert any(float(jnp.abs(g).max()) > 0 for g in leaves)
  padded = nnx.jit(lambda m, t: m(t, lengths_B=jnp.array([6, 3])))
  y, y2 = padded(model, tok), padded(model, tok.at[1, 3:].set(0))
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


def test_state_and_kv_cache_counts_of_a_hybrid():
  """Per layer and per model, by hand: the linear layers' float32 state per sequence, the full
  layers' KV cache per token, and the context length where a softmax layer's cache passes the state."""
  from attn import count
  from attn.config import HeadConfig
  m = config()
  lin = m.layer_head(0)
  state = 4 * 3 * 5 + 3 * (2 * 2 * 3 + 4 * 5)  # H·K·V + (W − 1)·(2GK + HV) numbers
  assert count.state_bytes("gated_deltanet", lin) == 4 * state
  assert count.state_bytes("per_head", lin) == 0
  assert count.model_state_bytes(m) == 3 * 4 * state
  assert count.model_kv_cache_bytes_per_token(m, "decoder_lm", "float32") == 4 * 2 * (4 + 4)  # 1 full layer
  assert count.state_crossover("gated_deltanet", lin, "float32") == -(-4 * state // (4 * 2 * (3 + 5)))
  cfg = HeadConfig(d_model=24, num_heads=6, d_k=5, d_v=7, num_kv_heads=2)
  rows = {r["variant"]: r for r in count.layer_table(cfg, 8, variants=["per_head", "mamba2", "linear"])}
  assert "state_bytes" not in rows["per_head"]
  assert rows["linear"]["state_bytes"] == 4 * 6 * 5 * 8 and rows["linear"]["kv_bytes_per_token"] == 0
  assert rows["mamba2"]["state_crossover_T"] == -(-rows["mamba2"]["state_bytes"] // (4 * 2 * 12))  # float32 cache


def test_a_hybrid_goes_out_to_no_softmax_family():
  """to_hf refuses a model with linear layers by name, before converting any weight."""
  from attn.nn import hf
  m = config(norm_type="rmsnorm", mlp="gated", activation="silu", use_bias=False, qk_norm=False,
             linear_head=None, tie_embeddings=False)
  model = nnx.eval_shape(lambda: DecoderLM(m, rngs=nnx.Rngs(0)))  # shapes only: refused before any weight is read
  with pytest.raises(ConfigError, match="layer_types\\[0\\]='linear_attention' is not allowed: a softmax"):
    hf.to_hf_state(model, model_type="llama")
