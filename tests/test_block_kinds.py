"""ModelConfig.block_kinds: blocks holding one sublayer (attention alone, or the MLP alone), each with
its own pre-norm residual (NemotronH's single-mixer layers); the default unchanged, counts exact,
decoding through a stack with MLP-only blocks, refusals by name."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attn import ConfigError
from attn.count import model_param_count
from attn.nn import DecoderLM
from attn.nn.config import ModelConfig

LIN, FULL = "linear_attention", "full_attention"


def config(**kw):
  base = dict(vocab_size=13, d_model=10, num_layers=4, num_heads=3, d_ff=7, d_k=4, d_v=5, num_kv_heads=1,
              max_len=12, positional="none", norm_type="rmsnorm", activation="relu2", tie_embeddings=False,
              block_kinds=("attention", "mlp", "attention", "mlp"), layer_types=(LIN, FULL, FULL, FULL),
              linear_variant="mamba2", linear_head={"num_heads": 2, "num_kv_heads": 1, "d_k": 3, "d_v": 4,
                                                   "chunk": 4})
  return ModelConfig(**{**base, **kw})


def tokens(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).integers(0, 13, shape), jnp.int32)


def n_params(model):
  return sum(int(np.prod(a.shape)) for a in jax.tree.leaves(nnx.state(model, nnx.Param)))


def test_the_default_is_every_block_attention_then_mlp_bit_for_bit():
  base = dict(vocab_size=13, d_model=10, num_layers=1, num_heads=3, d_ff=7, d_k=4, d_v=5)
  a = DecoderLM(ModelConfig(**base), rngs=nnx.Rngs(3))
  b = DecoderLM(ModelConfig(**base, block_kinds=("attention_mlp",)), rngs=nnx.Rngs(3))
  tok = tokens(0, (2, 6))
  forward = nnx.jit(lambda m, t: m(t))  # compiled whole: op by op, each small op compiles alone
  np.testing.assert_array_equal(np.asarray(forward(a, tok)), np.asarray(forward(b, tok)))
  assert jax.tree.structure(nnx.state(a)) == jax.tree.structure(nnx.state(b))


def test_an_attention_block_then_an_mlp_block_is_one_full_block():
  """Two single-sublayer blocks with one full block's weights give that block's logits (pre-norm)."""
  split_cfg = config(num_layers=2, block_kinds=("attention", "mlp"), layer_types=None, linear_variant="gated_deltanet",
                     linear_head=None)
  split = DecoderLM(split_cfg, rngs=nnx.Rngs(1))
  whole = nnx.eval_shape(lambda: DecoderLM(split_cfg.replace(num_layers=1, block_kinds=None), rngs=nnx.Rngs(2)))
  # (shapes only: every part is replaced by split's below)
  blocks = split.blocks
  assert blocks[0].mlp is None and blocks[0].mlp_norm is None and blocks[1].attn is None
  whole.blocks[0].attn, whole.blocks[0].attn_norm = blocks[0].attn, blocks[0].attn_norm
  whole.blocks[0].mlp, whole.blocks[0].mlp_norm = blocks[1].mlp, blocks[1].mlp_norm
  whole.embed, whole.final_norm, whole.head = split.embed, split.final_norm, split.head
  tok = tokens(1, (2, 7))
  forward = nnx.jit(lambda m, t: m(t))  # compiled whole: op by op, each small op compiles alone
  np.testing.assert_array_equal(np.asarray(forward(split, tok)), np.asarray(forward(whole, tok)))
  _, weights = nnx.jit(lambda m, t: m(t, return_weights=True))(split, tok)
  assert len(weights) == 1 and weights[0].shape == (2, 3, 7, 7)  # the attention block's only


@pytest.mark.parametrize("changes", [
    dict(), pytest.param(dict(mlp="gated", activation="silu", norm="sandwich"), marks=pytest.mark.slow),
    pytest.param(dict(mlp="moe", moe_experts=3, moe_top_k=2, activation="silu"), marks=pytest.mark.slow)])
def test_the_count_is_the_models_parameters(changes):
  cfg = config(**changes)
  model = nnx.eval_shape(lambda: DecoderLM(cfg, rngs=nnx.Rngs(0)))  # shapes only: nothing drawn
  assert model_param_count(cfg, "decoder_lm") == n_params(model)


def test_active_parameters_leave_out_the_experts_of_mlp_blocks_only():
  """Experts live in the MLP-only blocks alone: active = total less (E − k)/E of each such block's experts."""
  from attn.count import active_param_count
  cfg = config(mlp="moe", moe_experts=3, moe_top_k=2, activation="silu")
  model = nnx.eval_shape(lambda: DecoderLM(cfg, rngs=nnx.Rngs(0)))
  experts = [b.mlp for b in model.blocks if b.mlp is not None]
  assert len(experts) == 2 and all(b.mlp is None for b in model.blocks[::2])
  arrays = [getattr(e, n) for e in experts for n in ("w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down")]
  idle = sum(int(np.prod(a.shape)) * (3 - 2) // 3 for a in arrays if a is not None)
  assert active_param_count(cfg, "decoder_lm") == n_params(model) - idle


def test_decoding_through_mlp_only_blocks_equals_the_full_pass():
  model = DecoderLM(config(), rngs=nnx.Rngs(0))
  tok = tokens(2, (2, 7))
  full = nnx.jit(lambda m, t: m(t))(model, tok)
  model.init_cache(2, 9)
  assert model.blocks[1].attn is None
  step = nnx.jit(lambda m, t: m(t, decode=True))  # one compile per step length (4, then 1)
  outs = [step(model, tok[:, :4])] + [step(model, tok[:, i:i + 1]) for i in range(4, 7)]
  np.testing.assert_allclose(jnp.concatenate(outs, 1), full, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("changes, field", [
    (dict(block_kinds=("attention", "mlp")), "block_kinds"),
    (dict(block_kinds=("attention", "mlp", "cross", "mlp")), "block_kinds[2]"),
    (dict(block_kinds="mlp"), "block_kinds"),
    (dict(layer_types=(LIN, LIN, FULL, FULL)), "layer_types[1]"),
    (dict(kv_source=(0, 1, 2, 3)), "kv_source"),
    (dict(hc_mult=2), "hc_mult"),
])
def test_bad_block_kinds_are_refused_by_name(changes, field):
  with pytest.raises(ConfigError, match="^" + re.escape(field)):
    config(**changes)


def test_analyze_refuses_mlp_only_blocks_by_name(tmp_path):
  """attn analyze reads one attention layer per block: a model with MLP-only blocks is refused first."""
  from attn.experiments.reading.analyze import analyze_model
  cfg = config()
  with pytest.raises(ConfigError, match=r"^block_kinds=.*MLP-only block"):
    analyze_model(None, cfg, "decoder_lm", {}, {}, str(tmp_path), {})


def test_a_trials_attention_counts_leave_out_the_mlp_only_blocks():
  """train.attention_counts over blocks (attention, mlp, attention, mlp) = over the two attention layers alone,
  and its analytic parameters are the attention sublayers' own."""
  from attn.experiments.training import train
  cfg = config()
  got = train.attention_counts(cfg, 9)
  alone = train.attention_counts(cfg.replace(num_layers=2, block_kinds=None, layer_types=(LIN, FULL)), 9)
  assert got == alone
  model = nnx.eval_shape(lambda: DecoderLM(cfg, rngs=nnx.Rngs(0)))  # shapes only
  assert got["attention_params_analytic"] == sum(n_params(b.attn) for b in model.blocks if b.attn is not None)
