"""Gradient accumulation (train.grad_accum): the whole batch's update, micro-batch by micro-batch.

k micro-batches of B/k rows, their gradients summed in float32 inside the
compiled step, give the whole-batch gradient in another summation order: the
updated parameters and every metric agree with grad_accum = 1 to float32
rounding: the gradients to 1e-5 relative (entries whose exact value is 0, the
key bias's, to 1e-6 of the largest), every row of 6 steps to 1e-5 relative
but update_norm, looser as in test_data_parallel: Adam's g/(|g| + 1e-8) turns
rounding noise in a gradient entry near 0 into a full-size update entry.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attn.config import ConfigError
from attn.experiments.data import tasks as tasks_lib
from attn.experiments.running import config as config_lib
from attn.experiments.training import train
from attn.experiments.training.config import TrainConfig
from attn.nn import models
from attn.nn.config import ModelConfig
from conftest import TINY_MQAR

TINY = TINY_MQAR + """
[train]
steps = 6
batch_size = 8
warmup_steps = 1
eval_every = 3
eval_batches = 1

[sweep]
seeds = [0, 1]
"""
MARKER = 'name = "marker_position"\nvocab_size = 16\nseq_len = 10\nnum_classes = 3'
RTOL = {"update_norm": 2e-3}


def _load(*sets, text=TINY):
  return config_lib.loads(text, "tiny.toml", list(sets))


@pytest.mark.parametrize("sets,message", [
    (["train.grad_accum=3"], "train.grad_accum=3 is not allowed: a divisor of train.batch_size=8 (micro-batches "
                             "of equal size): one of [1, 2, 4, 8]"),
    (["train.grad_accum=0"], "train.grad_accum=0 is not allowed: an integer >= 1 (micro-batches per batch)"),
    (["train.grad_accum=2.0"], "train.grad_accum=2.0 is not allowed"),
    (["train.grad_accum=4", "train.data_parallel=4"],
     "train.grad_accum=4 is not allowed: a divisor of train.batch_size=8 leaving micro-batches that split over "
     "train.data_parallel=4 devices: 8 // 4 = 2 rows do not; one of [1, 2]"),
])
def test_a_micro_batch_count_that_does_not_divide_the_batch_is_refused(sets, message):
  with pytest.raises(ConfigError) as e:
    _load(*sets)
  assert message in str(e.value)


def test_grad_accum_leaves_trial_ids_alone():
  assert [t.id for t in _load("train.grad_accum=4").trials] == [t.id for t in _load().trials]


@pytest.mark.parametrize("task,k", [("mqar", 4), pytest.param("marker", 2, marks=pytest.mark.slow)])
def test_k_micro_batches_give_the_whole_batch_gradient_and_metrics(task, k):
  text = TINY if task == "mqar" else TINY.replace(TINY_MQAR.split("[model]")[0].split("[task]")[1].strip(), MARKER)
  trial = _load(text=text).trials[0]
  task_obj = tasks_lib.make_task(trial.config["task"])
  cfg = ModelConfig(**trial.config["model"])
  train_cfg = TrainConfig(**trial.config["train"])
  graphdef, params, rest = nnx.split(models.MODELS[task_obj.kind](cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
  tx = train.optimizer(train_cfg)
  batch = jax.tree.map(jnp.asarray, task_obj.batch(0, tasks_lib.TRAIN, 0, train_cfg.batch_size))
  out = {}
  for n in (1, k):
    value_and_grad = train._value_and_grad(graphdef, task_obj.kind, n)
    step, _ = train._step_fns(graphdef, tx, task_obj.kind, n)
    # One compile per n for both: the gradients and the whole step's metrics.
    both = jax.jit(lambda params, opt_state, rest, batch, lr: (value_and_grad(params, rest, batch),
                                                               step(params, opt_state, rest, batch, lr)[2]))
    ((loss, acc, _), grads), metrics = both(params, tx.init(params), rest, batch, jnp.float32(1e-2))
    out[n] = (float(loss), float(acc), jax.tree.leaves(grads), metrics)
  np.testing.assert_allclose(out[k][:2], out[1][:2], rtol=1e-6)
  for a, b in zip(out[1][2], out[k][2]):  # atol: entries whose exact gradient is 0 (the key bias's)
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6 * float(np.abs(a).max()))
  # The step's metrics, after clipping and AdamW; its first update is lr·g/(|g| + 1e-8) per entry, so
  # update_norm gets RTOL's slack for the entries whose gradient is noise around 0.
  for name in ("loss", "accuracy", "grad_norm", "param_norm", "update_norm"):
    np.testing.assert_allclose(out[k][3][name], out[1][3][name], rtol=RTOL.get(name, 1e-5), err_msg=name)


@pytest.mark.slow  # end to end, seconds: the slow tier runs it
def test_vmapped_seeds_accumulate_to_the_whole_batch_rows():
  def rows(*sets):
    trials = _load("sweep.vmap_seeds=true", *sets).trials
    out = [[] for _ in trials]
    train.train_group([t.config for t in trials], on_row=lambda j, r: out[j].append(r), vmap=True)
    return out
  ref, acc = rows(), rows("train.grad_accum=4")
  for seed_ref, seed_acc in zip(ref, acc):
    assert [r["step"] for r in seed_ref] == [r["step"] for r in seed_acc] == list(range(6))
    for r, e in zip(seed_acc, seed_ref):
      for key in r:
        if key != "step_time_s":
          np.testing.assert_allclose(r[key], e[key], rtol=RTOL.get(key, 1e-5), err_msg=f"{key} at {r['step']}")


def test_micro_batches_deal_rows_out_so_each_keeps_the_data_split():
  x = {"tokens": np.arange(8)[:, None] * np.ones((1, 3), int)}
  micro = train.micro_batches(x, 2)["tokens"]
  assert micro.shape == (2, 4, 3) and micro[:, :, 0].tolist() == [[0, 2, 4, 6], [1, 3, 5, 7]]
