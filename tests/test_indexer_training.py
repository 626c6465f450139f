"""Training the lightning indexer (train.indexer; DeepSeek-V3.2 §2.1): the warm-up, the sparse phase, staged.

warmup: dense attention, the loss adds the indexer's KL to the attention summed over heads, and only the
indexer's parameters move: the KL falls over a few steps on a tiny MQAR model and every other parameter
stays bit for bit. sparse: the model attends to its selection; the KL reaches only the indexer and the
language-model loss only the rest (their gradients equal those of train.indexer "off", whose indexer gets
none). staged: dense steps (the model without its indexer, bit for bit; the indexer frozen), then the
warm-up's steps, then the sparse phase's, each step's phase by its number (a resume continues in it).
Refusals by name.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attn.config import ConfigError
from attn.experiments.data import tasks as tasks_lib
from attn.experiments.running import config as config_lib
from attn.experiments.training import checkpoints
from attn.experiments.training import train
from attn.experiments.training.config import TrainConfig
from attn.nn import models
from attn.nn.config import ModelConfig
from attn.variants.mechanisms import selection
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
    (["train.indexer='staged'", "train.indexer_dense_steps=-1", "train.indexer_warmup_steps=2"],
     "train.indexer_dense_steps=-1 is not allowed: an integer >= 0"),
    (["train.indexer='staged'", "train.indexer_dense_steps=1", "train.indexer_warmup_steps=0"],
     "train.indexer_warmup_steps=0 is not allowed: an integer >= 1"),
    (["train.indexer='staged'", "train.indexer_dense_steps=1.5", "train.indexer_warmup_steps=1"],
     "train.indexer_dense_steps=1.5 is not allowed: an integer >= 0"),
    (["train.indexer='staged'", "train.indexer_dense_steps=4", "train.indexer_warmup_steps=2"],  # steps = 6
     "train.indexer_warmup_steps=2 is not allowed: a value with train.indexer_dense_steps + "
     "train.indexer_warmup_steps < train.steps=6, leaving at least one sparse step (4 + 2 leaves none)"),
    (["train.indexer='staged'", "train.indexer_dense_steps=6", "train.indexer_warmup_steps=1"],
     "train.indexer_dense_steps=6 is not allowed: a value with"),
    (["train.indexer='staged'", "train.indexer_warmup_steps=2"],
     "train.indexer_dense_steps=None is not allowed: an integer >= 0, given with train.indexer = \"staged\""),
    (["train.indexer_warmup_steps=2"],
     "train.indexer_warmup_steps=2 is not allowed: unset with train.indexer='warmup'"),
    (["train.indexer='off'", "train.indexer_dense_steps=0"],
     "train.indexer_dense_steps=0 is not allowed: unset with train.indexer='off'"),
    (["model.extra={}", "train.indexer='staged'", "train.indexer_dense_steps=1", "train.indexer_warmup_steps=2"],
     "train.indexer='staged' is not allowed: \"off\" for a model without the lightning indexer"),
])
def test_bad_values_refused_by_name(sets, message):
  with pytest.raises(ConfigError) as e:
    _load(*sets)
  assert message in str(e.value)


def _setup(trial):
  task = tasks_lib.make_task(trial.config["task"])
  cfg = ModelConfig(**trial.config["model"])
  train_cfg = TrainConfig(**trial.config["train"])
  graphdef, params, rest = nnx.split(models.MODELS[task.kind](cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
  tx = train.optimizer(train_cfg)
  batches = [jax.tree.map(jnp.asarray, task.batch(0, tasks_lib.TRAIN, t, train_cfg.batch_size)) for t in range(8)]
  return task, train_cfg, graphdef, params, rest, tx, batches


def _names(params):
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  return [jax.tree_util.keystr(p) for p, _ in flat], [a for _, a in flat]


def test_warmup_trains_only_the_indexer_and_its_kl_falls():
  # Weight decay would move the frozen parameters: it must not, nor count in update_norm.
  task, train_cfg, graphdef, params, rest, tx, batches = _setup(_load("train.weight_decay=0.1").trials[0])
  step, _ = train._step_fns(graphdef, tx, task.kind, 1, task, train_cfg)
  step = jax.jit(step)
  p, opt = params, tx.init(params)
  kls = []
  for t in range(8):
    previous = jax.tree.map(np.asarray, p)
    p, opt, m = step(p, opt, rest, batches[0], jnp.float32(train_cfg.lr))
    kls.append(float(m["indexer_kl"]))
    moved = [np.asarray(a, np.float64) - b for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(previous))]
    applied = np.sqrt(sum(float((d * d).sum()) for d in moved))  # the frozen parameters' part is 0
    np.testing.assert_allclose(float(m["update_norm"]), applied, rtol=1e-3)
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


@pytest.mark.slow
def test_staged_on_mla_with_the_deepseek_indexer():
  """"staged" on mla with the deepseek-form indexer (its index queries read the query latent): the dense
  steps are the model without the indexer's, bit for bit; the warm-up's KL falls; the sparse phase runs."""
  base = TEXT.replace("[model.extra.indexer]", "[model.extra.indexer]\nform = \"deepseek\"").replace(
      "[model]\n", "[model]\nvariant = \"mla\"\nlatent_dim = 5\nq_latent_dim = 6\nlatent_norm_eps = 1e-6\n")
  old = ("model.tie_embeddings=true", "model.embed_init_std=1.0")  # the defaults this 6-step KL fall was seen at
  staged = _load("train.indexer='staged'", "train.indexer_dense_steps=3", "train.indexer_warmup_steps=6",
                 "train.steps=12", *old, text=base).trials[0]
  plain = _load("train.indexer='off'", "model.extra={}", "train.steps=12", *old, text=base).trials[0]
  rows, plain_rows = [], []
  assert train.train_group([staged.config], on_row=lambda j, r: rows.append(r))[0]["status"] == "ok"
  train.train_group([plain.config], on_row=lambda j, r: plain_rows.append(r))
  assert [r["indexer_phase"] for r in rows] == ["dense"] * 3 + ["warmup"] * 6 + ["sparse"] * 3
  for r, p in zip(rows[:4], plain_rows[:4]):  # step 3, the warm-up's first: dense attention, the same rest
    assert (r["loss"], r["accuracy"]) == (p["loss"], p["accuracy"]) and ("indexer_kl" in r) == (r["step"] == 3)
  kl = [r["indexer_kl"] for r in rows[3:]]
  assert all(np.isfinite(kl)) and min(kl) > 0 and np.mean(kl[3:6]) < np.mean(kl[:3]), kl


STAGED = ("train.indexer='staged'", "train.indexer_dense_steps=2", "train.indexer_warmup_steps=2")


def test_staged_phase_is_a_function_of_the_step_alone():
  t = TrainConfig(steps=7, indexer="staged", indexer_dense_steps=2, indexer_warmup_steps=3)
  assert [t.indexer_phase(s) for s in range(7)] == ["dense"] * 2 + ["warmup"] * 3 + ["sparse"] * 2
  assert t.indexer_phases() == ["dense", "warmup", "sparse"]
  assert t.indexer_phases(3) == ["warmup", "sparse"] and t.indexer_phases(5) == ["sparse"]  # resumed there
  assert t.replace(indexer_dense_steps=0).indexer_phases() == ["warmup", "sparse"]
  assert TrainConfig(indexer="sparse").indexer_phases(7) == ["sparse"]
  with pytest.raises(ValueError, match="give phase"):
    train._step_fns(None, None, "decoder_lm", 1, None, t)


def test_packed_trials_must_share_the_staged_steps():
  a = _load(*STAGED).trials[0].config
  b = _load(*STAGED[:2], "train.indexer_warmup_steps=3").trials[0].config
  with pytest.raises(ConfigError, match=r"configs=1 is not allowed: .*from trial 0 in train\.indexer_warmup_steps"):
    train.train_group([a, b], on_row=lambda j, r: None)


def _is_indexer(name):
  return any(f"'{k}'" in name for k in selection.INDEXER_PARAMS)


def test_dense_phase_is_the_model_without_its_indexer_and_leaves_the_indexer_bit_for_bit():
  """Two steps of "staged"'s dense phase against train.indexer "off" on the same model without the indexer
  (the same init for every other parameter): the same loss, accuracy and gradient norm, the same
  parameters after, to float32 rounding (two programs: XLA may fuse and order their sums otherwise,
  and does in a venv without the extras: 2e-7 relative); the indexer's parameters untouched, bit for
  bit, weight decay included."""
  # No biases: the key bias's gradient is rounding noise (a softmax ignores it) that Adam scales up to
  # lr-sized steps, different in two programs.
  trial = _load(*STAGED, "model.use_bias=false").trials[0]
  plain = _load("model.extra={}", "train.indexer='off'", "model.use_bias=false").trials[0]
  task, train_cfg, graphdef, params, rest, tx, batches = _setup(trial)
  _, plain_cfg, plain_graph, plain_params, plain_rest, _, _ = _setup(plain)
  names, before = _names(params)
  kept = [(n, a) for n, a in zip(names, before) if not _is_indexer(n)]
  assert len(kept) < len(names) and [n for n, _ in kept] == _names(plain_params)[0]
  for (_, a), b in zip(kept, _names(plain_params)[1]):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  dense = jax.jit(train._step_fns(graphdef, tx, task.kind, 1, task, train_cfg, "dense")[0])
  off = jax.jit(train._step_fns(plain_graph, tx, task.kind, 1, task, plain_cfg)[0])
  p, opt, q, opt_q = params, tx.init(params), plain_params, tx.init(plain_params)
  for t in range(2):
    p, opt, m = dense(p, opt, rest, batches[t], jnp.float32(train_cfg.lr))
    q, opt_q, n = off(q, opt_q, plain_rest, batches[t], jnp.float32(train_cfg.lr))
    assert "indexer_kl" not in m
    for k in ("loss", "accuracy", "grad_norm"):
      assert float(m[k]) == pytest.approx(float(n[k]), rel=1e-6, abs=0), (t, k)
  after = _names(p)[1]
  for name, a, b in zip(names, before, after):
    if _is_indexer(name):
      np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=name)
  moved = [b for n, b in zip(names, after) if not _is_indexer(n)]
  for a, b in zip(moved, _names(q)[1], strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


class _Crash(Exception):
  """Stands for a kill mid-trial."""


def _rows(configs, dirs=None, crash_at=None):
  """train_group's rows of each trial (step_time_s dropped) and summaries; one vmapped program for several
  trials. crash_at: raise in the first row of that step (the checkpoints before it are in place)."""
  rows = [[] for _ in configs]

  def on_row(j, row):
    if row["step"] == crash_at:
      raise _Crash()
    rows[j].append({k: v for k, v in row.items() if k != "step_time_s"})
  if crash_at is None:
    return rows, train.train_group(configs, on_row=on_row, checkpoint_dirs=dirs)
  with pytest.raises(_Crash):
    train.train_group(configs, on_row=on_row, checkpoint_dirs=dirs)
  return rows, None


# Sequential: one trial. Vmapped: two trials packed (seeds 0 and 1, learning rates 0.03 and 0.02, as
# sweep.pack groups them) with two micro-batches each (train.grad_accum = 2), in one vmapped program.
PACKS = {False: [()], True: [("train.seed=0", "train.grad_accum=2"),
                             ("train.seed=1", "train.lr=0.02", "train.grad_accum=2")]}


def _configs(vmap, *sets):
  return [_load(*sets, *pack).trials[0].config for pack in PACKS[vmap]]


@pytest.mark.slow
@pytest.mark.parametrize("vmap", [False, True])
def test_staged_is_warmup_then_sparse_and_its_dense_steps_the_model_without_indexer(tmp_path, vmap):
  """"staged" with no dense step: its rows are train.indexer "warmup"'s for the warm-up steps, then those
  of train.indexer "sparse" resumed from the warm-up's checkpoint, bit for bit (the same programs), plus
  indexer_phase. With N1 = 2 its dense steps are train.indexer "off" on the model without the indexer
  (the same init for the rest): loss, accuracy and gradient norm to float32 rounding, the dense evaluation at
  step 1 to float32 rounding, and the warm-up's first loss (dense attention on the parameters the dense
  steps left) to float32 rounding. Sequential, and packed under vmap."""
  n = len(PACKS[vmap])
  rows, summaries = _rows(_configs(vmap, *STAGED[:1], "train.indexer_dense_steps=0", "train.indexer_warmup_steps=2"))
  for r in rows:
    assert [row.pop("indexer_phase") for row in r] == ["warmup"] * 2 + ["sparse"] * 4
  dirs = [str(tmp_path / f"ckpt{j}") for j in range(n)]
  warm, _ = _rows(_configs(vmap, "train.checkpoint_every=2"), dirs, crash_at=2)  # checkpoint 2 saved before row 2
  sparse, sparse_summaries = _rows(_configs(vmap, "train.indexer='sparse'", "train.checkpoint_every=2"), dirs)
  for j in range(n):
    assert sparse_summaries[j]["resumed_from"] == 2
    assert rows[j] == warm[j] + sparse[j]
    assert summaries[j]["final"] == sparse_summaries[j]["final"]

  rows, _ = _rows(_configs(vmap, *STAGED, "train.eval_every=2"))
  plain, _ = _rows(_configs(vmap, "model.extra={}", "train.indexer='off'", "train.eval_every=2"))
  # Two programs (the indexer's unused ops in one) may fuse and order their sums otherwise (packed, the
  # micro-batches' gradients: grad_norm 1 ulp apart at step 1; alone, in a venv without the extras):
  # equal to float32 rounding.
  same = lambda a, b: a == pytest.approx(b, rel=1e-6, abs=0)
  for r, p in zip(rows, plain):
    assert [row["indexer_phase"] for row in r] == ["dense"] * 2 + ["warmup"] * 2 + ["sparse"] * 2
    for row, plain_row in zip(r[:2], p[:2]):
      assert "indexer_kl" not in row
      for k in ("loss", "accuracy", "grad_norm", "lr"):
        assert same(row[k], plain_row[k]), (row["step"], k)
    # The dense evaluation: another program than the plain model's, whose sums XLA may order otherwise:
    # equal to float32 rounding (measured: 1.3e-7 relative).
    assert r[1]["eval_accuracy"] == p[1]["eval_accuracy"]
    assert r[1]["eval_loss"] == pytest.approx(p[1]["eval_loss"], rel=1e-6, abs=0)
    assert same(r[2]["loss"], p[2]["loss"]) and "indexer_kl" in r[2]


@pytest.mark.slow
def test_staged_resumed_mid_warmup_gives_the_uninterrupted_rows(tmp_path):
  """Killed at step 4 of 6 (dense 0-1, warm-up 2-3, sparse 4-5) after the checkpoint of step 3 (mid
  warm-up), then run again: rows 3-5 and the final parameters equal the uninterrupted trial's."""
  config = _load(*STAGED, "train.checkpoint_every=3").trials[0].config
  (whole,), (summary,) = _rows([config], [str(tmp_path / "whole")])
  dirs = [str(tmp_path / "cut")]
  (first,), _ = _rows([config], dirs, crash_at=4)
  assert [r["step"] for r in first] == [0, 1, 2, 3]
  (rest,), (resumed,) = _rows([config], dirs)
  assert resumed["resumed_from"] == 3 and rest[0]["indexer_phase"] == "warmup"
  assert first[:3] + rest == whole
  assert resumed["final"] == summary["final"]
  _, _, _, params, rest, tx, _ = _setup(_load(*STAGED).trials[0])
  like = {"params": params, "opt_state": tx.init(params), "rest": rest}
  a, b = (checkpoints.restore(d, 6, like) for d in (dirs[0], str(tmp_path / "whole")))
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
