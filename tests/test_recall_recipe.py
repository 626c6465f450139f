"""The recall recipe (experiments/recall_recipe): MQAR's layout, the length curriculum, the short convolution.

The data is checked position by position against a second reading of the
layout; the curriculum by the lengths the train loop draws; the convolution by
causality through gradients, by cached decoding against the full pass for a
variant other than per_head, and by its parameter count against the module's.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attn.config import ConfigError
from attn.count.model import model_param_count
from attn.experiments.data import curriculum, tasks
from attn.experiments.training import train as train_lib
from attn.nn import DecoderLM, ModelConfig
from attn.nn import short_conv
from conftest import randn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_mqar_puts_keys_values_and_queries_where_they_belong():
  task = tasks.MQAR(vocab_size=41, seq_len=29, num_pairs=5)  # odd length: the last query has no value token
  b = task.batch(3, tasks.TRAIN, 7, 6)
  seq = np.concatenate([b["tokens"], b["targets"][:, -1:]], axis=1)  # the seq_len + 1 tokens
  n, key_vocab = 5, 20
  for row, w in zip(seq, b["weights"]):
    keys, values = row[0:2 * n:2], row[1:2 * n:2]
    assert len(set(keys)) == n and keys.min() >= 1 and keys.max() <= key_vocab
    assert values.min() > key_vocab and values.max() < 41
    table = dict(zip(keys, values))
    asked = np.flatnonzero(w)  # labels only at query positions, each predicting its key's value
    assert list(asked) == list(range(2 * n, 2 * n + 2 * task.num_queries, 2))
    for t in asked:
      assert row[t] in table and row[t + 1] == table[row[t]]
  again = task.batch(3, tasks.TRAIN, 7, 6)
  other = task.batch(4, tasks.TRAIN, 7, 6)
  assert all(np.array_equal(b[k], again[k]) for k in b)
  assert not np.array_equal(b["tokens"], other["tokens"])


def test_curriculum_stages_cover_the_steps_and_keep_the_pair_density():
  task = tasks.MQAR(vocab_size=64, seq_len=48, num_pairs=12, curriculum=[12, 24, 48],
                    curriculum_steps=[0.5, 0.3, 0.2])
  lengths = [curriculum.train_task(task, t, 10).seq_len for t in range(10)]
  assert lengths == [12] * 5 + [24] * 3 + [48] * 2
  assert [curriculum.train_task(task, t, 10).num_pairs for t in (0, 5, 9)] == [3, 6, 12]
  assert curriculum.train_task(task, 0, 10).batch(0, tasks.TRAIN, 0, 2)["tokens"].shape == (2, 12)
  assert task.batch(0, tasks.EVAL, 0, 2)["tokens"].shape == (2, 48)  # held out at the full length
  equal = tasks.MQAR(vocab_size=64, seq_len=48, num_pairs=12, curriculum=[16, 32])
  assert equal.curriculum_steps == (0.5, 0.5)


def test_the_train_loop_draws_each_stage_and_compiles_once_per_length(monkeypatch):
  drawn, real = [], curriculum.train_task
  monkeypatch.setattr(curriculum, "train_task", lambda task, t, steps: drawn.append(real(task, t, steps).seq_len)
                      or real(task, t, steps))
  from attn.experiments.running import config as config_lib
  # conftest's TINY_MQAR at two rows a batch: its full-length step and evaluation are the programs the runner
  # tests compile; only the short stage's step is new here.
  cfg = config_lib.resolve({"task": {"name": "mqar", "vocab_size": 16, "seq_len": 12, "num_pairs": 2,
                                     "curriculum": [6, 12]},
                            "model": {"d_model": 16, "num_layers": 1, "num_heads": 2, "d_ff": 16},
                            "train": {"steps": 2, "batch_size": 2, "eval_every": 0, "eval_batches": 1}}, [], None)
  rows = []
  out = train_lib.train_group([cfg], lambda i, row: rows.append(row))
  assert out[0]["status"] == "ok" and [r["step"] for r in rows] == [0, 1]
  assert drawn[-2:] == [6, 12]


@pytest.mark.parametrize("options, key", [
    ({"curriculum": [24, 12]}, "task.curriculum"),
    ({"curriculum": [12, 12]}, "task.curriculum"),
    ({"curriculum": [12, 64]}, "task.curriculum"),  # past the model's positions (seq_len + 1)
    ({"curriculum": [12, 24], "curriculum_steps": [0.5, 0.6]}, "task.curriculum_steps"),
    ({"curriculum": [12, 24], "curriculum_steps": [1.0]}, "task.curriculum_steps"),
    ({"num_pairs": 24}, "task.seq_len=48 .*task.num_pairs=24"),  # 48 tokens of pairs and a query do not fit
])
def test_bad_recall_tasks_are_refused_naming_the_option(options, key):
  with pytest.raises(ConfigError, match=key):
    tasks.make_task({"name": "mqar", "vocab_size": 64, "seq_len": 48, "num_pairs": 8, **options})


@pytest.mark.parametrize("width", [0, -1, 2.0, True])
def test_a_convolution_width_below_one_is_refused(width):
  with pytest.raises(ConfigError, match="short_conv"):
    ModelConfig(vocab_size=8, d_model=8, num_layers=1, num_heads=2, d_ff=8, short_conv=width)


# The model of the convolution's tests below: one config, so that its initialisers compile once. Untied: the
# token table's gradient then comes from the input side only.
CONV_CFG = ModelConfig(vocab_size=13, d_model=12, num_layers=2, num_heads=3, d_ff=16, d_k=4, d_v=5, num_kv_heads=1,
                       variant="merged", max_len=8, short_conv=3, tie_embeddings=False)  # merged: not per_head


def test_the_convolution_is_causal_through_gradients():
  W, T = 3, 7
  w_WD = randn(0, (W, 5)) + 1.0  # every tap nonzero
  x_BTD = randn(1, (2, T, 5))
  # Compiled whole (here and below): op by op, each small op of the Jacobian and the model compiles alone.
  J = jax.jit(jax.jacobian(lambda x: short_conv.causal_conv(w_WD, jnp.zeros(5), x)[0]))(x_BTD)  # (B,T,D,B,T,D)
  reach = np.abs(np.asarray(J)).sum(axis=(0, 2, 3, 5))  # (t, s): how much y[t] moves with x[s]
  t, s = np.indices((T, T))
  assert np.all(reach[s > t] == 0) and np.all(reach[s < t - W + 1] == 0)
  assert np.all(reach[(s <= t) & (s > t - W)] > 0)
  assert CONV_CFG.short_conv == W
  model = DecoderLM(CONV_CFG, rngs=nnx.Rngs(2))
  tokens = jnp.asarray([[1, 2, 3, 1, 4, 5, 6, 7]], jnp.int32)
  g = np.asarray(nnx.jit(nnx.grad(lambda m: m(tokens)[0, 4].sum()))(model).embed.token[...])  # the token table's rows
  assert np.all(g[[0, 5, 6, 7, 8, 9, 10, 11, 12]] == 0)  # tokens only after position 4 (or absent): no gradient
  assert np.all(np.abs(g[[1, 2, 3, 4]]).sum(axis=1) > 0)


def test_the_convolution_state_carries_across_chunks():
  w_WD, b_D = randn(0, (4, 6)), randn(1, (6,))
  x_BTD = randn(2, (2, 9, 6))
  conv = jax.jit(short_conv.causal_conv)
  full = conv(w_WD, b_D, x_BTD)[0]
  state, outs, i = None, [], 0
  for T in (1, 1, 5, 2):  # chunks shorter and longer than the W - 1 = 3 rows of state
    y, state = conv(w_WD, b_D, x_BTD[:, i:i + T], state)
    outs.append(y)
    i += T
  np.testing.assert_allclose(np.concatenate(outs, axis=1), full, rtol=1e-6, atol=1e-6)


def test_cached_decoding_with_the_convolution_equals_the_full_pass():
  model = DecoderLM(CONV_CFG, rngs=nnx.Rngs(1))
  tokens_BT = jnp.asarray(np.random.default_rng(5).integers(0, 13, (2, 5)), jnp.int32)
  full = nnx.jit(lambda m, t: m(t))(model, tokens_BT)
  model.init_cache(2, 6)
  step = nnx.jit(lambda m, t: m(t, decode=True))  # one compile per chunk length (1, then 3)
  outs = [step(model, tokens_BT[:, i:j]) for i, j in ((0, 1), (1, 4), (4, 5))]
  np.testing.assert_allclose(np.concatenate(outs, axis=1), full, rtol=1e-5, atol=1e-5)


def test_the_convolution_parameters_are_counted():
  cfg = CONV_CFG
  model = DecoderLM(cfg, rngs=nnx.Rngs(0))
  stored = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert stored == model_param_count(cfg, "decoder_lm")
  # per layer: a width-3 filter and a bias over d_model = 12
  assert stored - model_param_count(cfg.replace(short_conv=None), "decoder_lm") == 2 * (3 + 1) * 12


def test_the_recipe_configs_hold_what_their_write_up_says():
  from attn.experiments.running import config as config_lib
  for name, lengths in (("recall_recipe", {512}), ("recall_recipe_long", {1024, 2048})):
    trials = config_lib.load(os.path.join(ROOT, "configs", f"{name}.toml")).trials
    assert {t.config["task"]["seq_len"] for t in trials} == lengths
    for t in trials:
      task, model = t.config["task"], t.config["model"]
      assert task["num_pairs"] * 8 == task["seq_len"] and task["curriculum"] == (128, 256, 512)
      assert model["short_conv"] == 3 and model["variant"] == "fused" and model["window"] is None


@pytest.mark.slow
def test_the_recipe_learns_recall_at_a_reduced_size():
  """configs/recall_recipe.toml's model and optimizer at T = 128 with 16 pairs, 400 steps (about 40 CPU-s)."""
  from attn.experiments.running import config as config_lib
  sweep = config_lib.load(os.path.join(ROOT, "configs", "recall_recipe.toml"), [
      "task.seq_len=128", "task.num_pairs=16", "task.curriculum=[]", "task.curriculum_steps=[]",
      "train.steps=400", "train.eval_every=0"])
  rows = []
  out = train_lib.train_group([sweep.trials[0].config], lambda i, row: rows.append(row))
  assert out[0]["status"] == "ok"
  assert rows[-1]["eval_accuracy"] >= 0.9  # chance is 0.070 (tasks.MQAR.chance)
