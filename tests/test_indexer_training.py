"""Training the lightning indexer (train.indexer; DeepSeek-V3.2 §2.1): the warm-up and the sparse phase.

warmup: dense attention, the loss adds the indexer's KL to the attention summed over heads, and only the
indexer's parameters move: the KL falls over a few steps on a tiny MQAR model and every other parameter
stays bit for bit. sparse: the model attends to its selection; the KL reaches only the indexer and the
language-model loss only the rest (their gradients equal those of train.indexer "off", whose indexer gets
none). Refusals by name.
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
from attn.variants import selection
from conftest import TINY_MQAR

TEXT = TINY_MQAR.replace("num_heads = 2", "num_heads = 2\npositional = \"rope\"\nrope_dim = 2\nd_k = 6\nd_v = 5") + """
[model.extra.indexer]
heads = 2
head_dim = 4
top_k = 3

[train]
steps = 6
batch_size = 4
lr = 0.03
warmup_steps = 0
eval_every = 3
eval_batches = 1
indexer = "warmup"
"""


def _load(*sets, text=TEXT):
  return config_lib.loads(text, "tiny.toml", list(sets))


@pytest.mark.parametrize("sets,message", [
    (["train.indexer='dense'"], "train.indexer='dense' is not allowed: \"off\""),
    (["train.indexer_kl_weight=0"], "train.indexer_kl_weight=0.0 is not allowed: a finite number > 0"),
    (["model.extra={}"], "train.indexer='warmup' is not allowed: \"off\" for a model without the lightning indexer"),
])
def test_bad_values_refused_by_name(sets, message):
  with pytest.raises(ConfigError) as e:
    _load(*sets)
  assert message in str(e.value)


def _setup(trial):
  task = tasks_lib.make_task(trial.config["task"])
  cfg = models.ModelConfig(**trial.config["model"])
  train_cfg = TrainConfig(**trial.config["train"])
  graphdef, params, rest = nnx.split(models.MODELS[task.kind](cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
  tx = train.optimizer(train_cfg)
  batches = [jax.tree.map(jnp.asarray, task.batch(0, tasks_lib.TRAIN, t, train_cfg.batch_size)) for t in range(8)]
  return task, train_cfg, graphdef, params, rest, tx, batches


def _names(params):
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  return [jax.tree_util.keystr(p) for p, _ in flat], [a for _, a in flat]


def test_warmup_trains_only_the_indexer_and_its_kl_falls():
  task, train_cfg, graphdef, params, rest, tx, batches = _setup(_load().trials[0])
  step, _ = train._step_fns(graphdef, tx, task.kind, 1, task, train_cfg)
  step = jax.jit(step)
  p, opt = params, tx.init(params)
  kls = []
  for t in range(8):
    p, opt, m = step(p, opt, rest, batches[0], jnp.float32(train_cfg.lr))
    kls.append(float(m["indexer_kl"]))
  assert kls[-1] < 0.8 * kls[0], kls
  names, before = _names(params)
  _, after = _names(p)
  moved = {n for n, a, b in zip(names, before, after) if not np.array_equal(np.asarray(a), np.asarray(b))}
  indexer = {n for n in names if any(f"'{k}'" in n for k in selection.INDEXER_PARAMS)}
  assert indexer and moved == indexer, (sorted(moved), sorted(indexer))


@pytest.mark.slow
def test_sparse_phase_splits_the_gradients():
  """train.indexer "sparse": the model's gradients are those of "off" (the same sparse attention, the KL
  does not reach them; to float32 rounding), and the indexer's, zero under "off", are the KL's alone."""
  task, train_cfg, graphdef, params, rest, tx, batches = _setup(_load("train.indexer='sparse'").trials[0])
  out = {}
  for phase in ("off", "sparse"):
    out[phase] = jax.jit(train._value_and_grad(graphdef, task.kind, 1, phase))(params, rest, batches[1])
  (loss_off, _, kl_off), g_off = out["off"]
  (loss_sp, _, kl_sp), g_sp = out["sparse"]
  assert float(loss_sp) == pytest.approx(float(loss_off), rel=1e-6) and float(kl_off) == 0 and float(kl_sp) > 0
  names, a = _names(g_off)
  _, b = _names(g_sp)
  for n, x, y in zip(names, a, b):
    if any(f"'{k}'" in n for k in selection.INDEXER_PARAMS):
      assert not np.any(np.asarray(x)) and np.any(np.asarray(y)), n
    else:
      # One program with the KL's ops, one without: XLA may fuse the same sums in another order.
      np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-5, atol=1e-7, err_msg=n)
  # Two micro-batches (train.grad_accum = 2): the same KL (every MQAR row is full length) and gradients.
  (loss_2, _, kl_2), g_2 = jax.jit(train._value_and_grad(graphdef, task.kind, 2, "sparse"))(params, rest, batches[1])
  assert float(kl_2) == pytest.approx(float(kl_sp), rel=1e-5) and float(loss_2) == pytest.approx(float(loss_sp))
  for n, x, y in zip(names, b, _names(g_2)[1]):
    np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-4, atol=1e-6 * float(np.abs(x).max()), err_msg=n)


@pytest.mark.slow
def test_train_group_warmup_then_sparse_on_mla_with_the_deepseek_indexer():
  """End to end through train_group on mla with the deepseek-form indexer: the warm-up's rows carry
  indexer_kl, which falls; then the sparse phase runs and reports it too."""
  base = TEXT.replace("[model.extra.indexer]", "[model.extra.indexer]\nform = \"deepseek\"").replace(
      "[model]\n", "[model]\nvariant = \"mla\"\nlatent_dim = 5\nq_latent_dim = 6\nlatent_norm_eps = 1e-6\n")
  for phase in ("warmup", "sparse"):
    trial = _load(f"train.indexer='{phase}'", "train.steps=12", text=base).trials[0]
    rows = []
    summary = train.train_group([trial.config], on_row=lambda j, r: rows.append(r))[0]
    assert summary["status"] == "ok" and len(rows) == 12
    kl = [r["indexer_kl"] for r in rows]
    assert all(np.isfinite(kl)) and min(kl) > 0
    if phase == "warmup":
      assert np.mean(kl[-3:]) < np.mean(kl[:3]), kl
