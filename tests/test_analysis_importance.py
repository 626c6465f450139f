"""attn.analysis.importance: gate gradients against finite differences, dead heads, pruning curves."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from attn import ConfigError
from attn.analysis import (gate_gradients, head_importance, prunable_fraction, pruning_curve,
                           pruning_gates, pruning_order, pruning_steps)
from attn.nn import DecoderLM
from attn.nn.config import ModelConfig

CFG = ModelConfig(vocab_size=11, d_model=16, num_layers=2, num_heads=3, d_k=5, d_v=6, d_ff=24, max_len=8,
                  variant="per_head")
B, T, L, H = 4, 7, 2, 3


def setup(seed=0):
  """A model with its weights scaled up (so heads matter), a batch, and per-example mean losses."""
  model = DecoderLM(CFG, rngs=nnx.Rngs(seed))
  rng = np.random.default_rng(seed)
  for block in model.blocks:
    block.attn.load_params({k: 3.0 * v for k, v in block.attn.params_dict().items()})
  tokens = jnp.asarray(rng.integers(0, 11, (B, T)), jnp.int32)
  targets = jnp.asarray(rng.integers(0, 11, (B, T)), jnp.int32)
  graphdef, state = nnx.split(model)

  @jax.jit
  def losses(gates, tokens, targets):  # gates (B,L,H) or (L,H) -> (B,)
    logits = nnx.merge(graphdef, state)(tokens, head_mask=gates)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean(-1)

  return model, tokens, lambda gates: losses(gates, tokens, targets)


def test_importance_is_the_mean_absolute_central_difference():
  _, _, example_loss = setup()
  grads = gate_gradients(example_loss, jnp.ones((B, L, H)))
  assert grads.shape == (B, L, H)
  eps = 3e-3  # truncation error ~ eps², float32 rounding ~ 1e-7·loss/eps: both below 1e-4 here
  fd = np.zeros((B, L, H))
  for l in range(L):
    for h in range(H):  # moving gate (l,h) of every example at once: example b sees only its own row
      up, down = np.ones((B, L, H), np.float32), np.ones((B, L, H), np.float32)  # numpy: no compile per (l, h)
      up[:, l, h], down[:, l, h] = 1 + eps, 1 - eps
      fd[:, l, h] = (np.asarray(example_loss(up), np.float64) - np.asarray(example_loss(down))) / (2 * eps)
  assert np.abs(fd).max() > 1e-2  # the heads matter, so the comparison means something
  np.testing.assert_allclose(grads, fd, atol=3e-4, rtol=1e-2)
  imp = head_importance(grads)
  want = np.abs(fd).mean(0)
  np.testing.assert_allclose(imp["raw"], want, atol=3e-4, rtol=1e-2)
  np.testing.assert_allclose(imp["normalized"], want / np.sqrt((want ** 2).sum(1, keepdims=True)),
                             atol=2e-3)
  # |E g| is not E|g|: the absolute value is taken per example (Michel et al. 2019)
  signs_differ = np.any(np.sign(fd).min(0) != np.sign(fd).max(0))
  assert signs_differ and not np.allclose(imp["raw"], np.abs(fd.mean(0)), atol=1e-3)


@pytest.mark.slow  # a model's importance twice, seconds
def test_a_head_with_zero_w_o_has_importance_0_and_gating_it_off_changes_nothing():
  model, tokens, _ = setup(1)
  p = model.blocks[1].attn.params_dict()
  model.blocks[1].attn.load_params({**p, "w_o": p["w_o"].at[2].set(0.0)})
  graphdef, state = nnx.split(model)
  loss = jax.jit(lambda g, t: nnx.merge(graphdef, state)(t, head_mask=g).sum(axis=(1, 2)))
  imp = head_importance(gate_gradients(lambda g: loss(g, tokens), jnp.ones((B, L, H))))
  assert imp["raw"][1, 2] == 0.0
  assert imp["raw"].min(initial=1.0, where=np.arange(L * H).reshape(L, H) != 5) > 0
  off = jnp.ones((L, H)).at[1, 2].set(0.0)
  np.testing.assert_allclose(model(tokens, head_mask=off), model(tokens), atol=1e-6)
  other = jnp.ones((L, H)).at[1, 1].set(0.0)
  assert float(jnp.abs(model(tokens, head_mask=other) - model(tokens)).max()) > 1e-3


def test_pruning_curve_starts_at_the_unpruned_loss_and_removes_heads_in_order():
  model, tokens, example_loss = setup(2)
  grads = gate_gradients(example_loss, jnp.ones((B, L, H)))
  imp = head_importance(grads)
  calls = []

  def evaluate(gates_KLH):
    calls.append(np.asarray(gates_KLH))
    losses = np.array([float(example_loss(jnp.asarray(g)).mean()) for g in gates_KLH])
    return losses, np.linspace(0.9, 0.0, len(gates_KLH))

  curve = pruning_curve(evaluate, imp)
  unpruned = float(example_loss(None).mean())
  np.testing.assert_allclose(curve["loss"][0], unpruned, rtol=1e-6)
  assert curve["heads_off"] == list(range(L * H + 1))
  gates = calls[0]
  assert [int((1 - g).sum()) for g in gates] == curve["heads_off"]
  first_off = tuple(np.argwhere(gates[1] == 0)[0])
  norm = imp["normalized"]
  assert norm[first_off] == norm.min()
  assert curve["order"][0] == list(first_off)
  assert curve["prunable_fraction"] == 0.0  # accuracy falls by 0.9/6 = 0.15 at the first head


def test_pruning_steps_every_head_up_to_64_then_tenths():
  assert pruning_steps(8) == list(range(9))
  assert pruning_steps(64) == list(range(65))
  assert pruning_steps(100) == [0, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100]
  assert pruning_steps(144) == [0, 14, 29, 43, 58, 72, 86, 101, 115, 130, 144]


def test_pruning_order_is_by_normalised_importance_then_raw():
  raw = np.array([[1.0, 2.0], [0.1, 0.3]])
  norm = np.array([[0.5, 0.9], [0.5, 0.8]])
  order = pruning_order({"raw": raw, "normalized": norm})
  assert order.tolist() == [[1, 0], [0, 0], [1, 1], [0, 1]]  # the 0.5 tie goes to the smaller raw


def test_pruning_gates_switch_off_the_first_heads_of_the_order():
  g = pruning_gates(np.array([[1, 2], [0, 0], [1, 0]]), [0, 1, 3], 2, 3)
  assert g.shape == (3, 2, 3) and g.dtype == np.float32
  assert g[0].min() == 1.0
  assert np.argwhere(g[1] == 0).tolist() == [[1, 2]]
  assert sorted(np.argwhere(g[2] == 0).tolist()) == [[0, 0], [1, 0], [1, 2]]


def test_prunable_fraction_stops_at_the_first_drop_beyond_tolerance():
  steps = [0, 1, 2, 3, 4]
  assert prunable_fraction(steps, [0.90, 0.90, 0.892, 0.85, 0.90], 4) == 0.5
  assert prunable_fraction(steps, [0.90, 0.95, 0.91, 0.90, 0.895], 4) == 1.0
  assert prunable_fraction(steps, [0.90, 0.88, 0.90, 0.90, 0.90], 4) == 0.0
  assert prunable_fraction([0, 10, 20], [0.5, 0.495, 0.3], 20) == 0.5


def test_bad_shapes_are_refused():
  with pytest.raises(ConfigError, match=r"gates\.shape"):
    gate_gradients(lambda g: g.sum(-1), jnp.ones((2, 3)))
  with pytest.raises(ConfigError, match=r"grads\.shape"):
    head_importance(np.ones((2, 3)))
