"""Checkpoints: cadence and retention, resume bit for bit, corrupt-checkpoint fallback, load_trial."""

import glob
import io
import os
import re
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from attn.config import ConfigError
from attn.experiments.training import checkpoints
from attn.experiments import load_trial
from attn.experiments.running import store
from attn.experiments.running import sweep
from attn.experiments.data import tasks
from attn.experiments.running import config as config_lib
from conftest import TINY_MQAR

TINY = TINY_MQAR + """

[train]
steps = 7
batch_size = 2
lr = 1e-2
warmup_steps = 2
eval_every = 2
eval_batches = 1

[sweep]
seeds = [0, 1]
vmap_seeds = false
"""


class Crash(Exception):
  """Stands for a kill: not one of the errors the sweep records as a failed trial."""


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
  monkeypatch.setenv("ATTN_JAX_CACHE", str(tmp_path_factory.getbasetemp() / "jax_cache"))


def _load(tmp_path, text=TINY, overrides=()):
  path = tmp_path / "c.toml"
  path.write_text(text)
  return config_lib.load(str(path), list(overrides))


def _run(sw, out, crash_at=None, monkeypatch=None):
  """Runs the sweep; with crash_at, the first row of that step raises Crash (after it is written)."""
  log = io.StringIO()
  if crash_at is not None:
    original = store.Store.append

    def append(self, trial_id, row):
      original(self, trial_id, row)
      if row["step"] == crash_at:
        raise Crash(trial_id)
    monkeypatch.setattr(store.Store, "append", append)
    with pytest.raises(Crash):
      sweep.run_sweep(sw, out, stream=log)
    monkeypatch.setattr(store.Store, "append", original)
  else:
    sweep.run_sweep(sw, out, stream=log)
  return log.getvalue()


def _rows(out, trial_id):
  rows = store.read_rows(os.path.join(out, "trials", trial_id, store.METRICS))
  return [{k: v for k, v in r.items() if k != "step_time_s"} for r in rows]


def _params(out, trial_id, step=None):
  model, _, _ = load_trial(out, trial_id, step)
  return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def _assert_same_trials(sw, out, ref):
  for t in sw.trials:
    assert _rows(out, t.id) == _rows(ref, t.id)
    assert [r["step"] for r in _rows(out, t.id)] == list(range(7))  # none lost, none twice
    for a, b in zip(_params(out, t.id), _params(ref, t.id), strict=True):
      np.testing.assert_array_equal(a, b)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """An uninterrupted run of TINY, sequential and vmapped; .pruned: each checkpoint directory's listing
  after each of its saves (what test_the_default_cadence_keeps_the_newest_two reads)."""
  root = tmp_path_factory.mktemp("reference")
  os.environ.setdefault("ATTN_JAX_CACHE", str(root / "jax_cache"))

  # Each mode trained on first use, so the fast tier trains only the vmapped one (one program for both seeds:
  # fewer traces than one per trial; conftest's TINY_SWEEP program, which the other runner tests compile).
  class Runs(dict):
    pruned: dict[str, list[list[str]]] = {}

    def __missing__(self, vmap):
      sw = _load(root, TINY.replace("vmap_seeds = false", f"vmap_seeds = {str(vmap).lower()}"))
      self[vmap] = (sw, str(root / f"ref_vmap{vmap}"))
      original = checkpoints._prune

      def prune(directory):  # called once each save has completed
        original(directory)
        self.pruned.setdefault(directory, []).append(sorted(os.listdir(directory)))
      with pytest.MonkeyPatch.context() as mp:
        mp.setattr(checkpoints, "_prune", prune)
        _run(sw, self[vmap][1])
      return self[vmap]

  return Runs()


def test_the_default_cadence_keeps_the_newest_two(reference):
  """At each evaluation (eval_every = 2) and the end, the newest two kept: read from the reference run."""
  sw, out = reference[True]
  for t in sw.trials:
    directory = os.path.join(out, "trials", t.id, store.CHECKPOINTS)
    assert reference.pruned[directory] == [["2"], ["2", "4"], ["4", "6"], ["6", "7"]]


# All slow: the default's fast sibling is test_the_default_cadence_keeps_the_newest_two, on the reference run.
@pytest.mark.parametrize("train, kept_after_each_save", [
    pytest.param("", [[2], [2, 4], [4, 6], [6, 7]], marks=pytest.mark.slow),  # default: at each evaluation and the end
    pytest.param("checkpoint_every = 3\n", [[3], [3, 6], [6, 7]], marks=pytest.mark.slow),  # the default's fast
    pytest.param("checkpoint_every = 7\n", [[7]], marks=pytest.mark.slow),
    pytest.param("eval_every = 0\n", [[7]], marks=pytest.mark.slow),  # no evaluations before the end: the final only
])
def test_checkpoint_cadence_keeps_the_newest_two(tmp_path, monkeypatch, train, kept_after_each_save):
  text = TINY.replace("seeds = [0, 1]", "seeds = [0]").replace("eval_batches = 1\n", "eval_batches = 1\n" + train)
  if "eval_every = 0" in train:
    text = text.replace("eval_every = 2\n", "")
  sw = _load(tmp_path, text)
  seen, original = [], checkpoints._prune

  def prune(directory):  # called once each save has completed
    original(directory)
    seen.append(sorted(os.listdir(directory)))
  monkeypatch.setattr(checkpoints, "_prune", prune)
  _run(sw, str(tmp_path / "out"))
  assert seen == [[str(s) for s in kept] for kept in kept_after_each_save]


def test_checkpoint_every_is_validated_and_left_out_of_the_trial_id(tmp_path):
  plain = _load(tmp_path)
  often = _load(tmp_path, overrides=["train.checkpoint_every=1"])
  assert [t.id for t in often.trials] == [t.id for t in plain.trials] and often.id == plain.id
  assert {t.config["train"]["checkpoint_every"] for t in often.trials} == {1}
  with pytest.raises(ConfigError, match=r"train\.checkpoint_every=-1 is not allowed: an integer >= 0"):
    _load(tmp_path, overrides=["train.checkpoint_every=-1"])


# Sequential trials slow: the fast tier resumes the vmapped program (here and below) and a single trial, its rows
# equal to the uninterrupted run's, in test_store_damage.py (a damaged summary, a torn row).
@pytest.mark.parametrize("vmap", [pytest.param(False, marks=pytest.mark.slow), True])
def test_a_crashed_sweep_resumes_from_its_checkpoint_bit_for_bit(tmp_path, monkeypatch, reference, vmap):
  sw, ref = reference[vmap]
  out = str(tmp_path / "out")
  _run(sw, out, crash_at=5, monkeypatch=monkeypatch)  # checkpoints 2 and 4 exist; row 5 was written
  first = sw.trials[0].id
  assert checkpoints.steps(os.path.join(out, "trials", first, store.CHECKPOINTS)) == [2, 4]
  partial = store.read_rows(os.path.join(out, "trials", first, store.PARTIAL))
  assert [r["step"] for r in partial] == [0, 1, 2, 3, 4, 5]
  assert not os.path.exists(os.path.join(out, "trials", first, store.SUMMARY))
  log = _run(sw, out)
  assert "resumes at step 4" in log and "warning" not in log
  _assert_same_trials(sw, out, ref)
  summary = store.read_json(os.path.join(out, "trials", first, store.SUMMARY))
  assert summary["resumed_from"] == 4 and summary["steps_done"] == 7


@pytest.mark.slow  # a sweep resumed past a damaged checkpoint
def test_a_corrupt_checkpoint_is_reported_and_the_one_before_used(tmp_path, monkeypatch, reference):
  sw, ref = reference[False]
  out = str(tmp_path / "out")
  _run(sw, out, crash_at=5, monkeypatch=monkeypatch)
  bad = os.path.join(out, "trials", sw.trials[0].id, store.CHECKPOINTS, "4")
  for f in glob.glob(os.path.join(bad, "**", "*"), recursive=True):  # a disk that lost half of each file
    if os.path.isfile(f):
      with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) // 2)
  log = _run(sw, out)
  assert f"warning: checkpoint {bad} could not be read" in log
  assert "resumes at step 2" in log
  _assert_same_trials(sw, out, ref)


# Rows still in the partial file (False): slow; the crashed sweep above resumes from partial rows in the fast tier.
@pytest.mark.parametrize("rows_moved", [pytest.param(False, marks=pytest.mark.slow), True])
def test_an_unfinished_save_is_ignored_and_a_final_checkpoint_without_summary_is_redone(
    tmp_path, reference, rows_moved):
  sw, ref = reference[True]
  out = str(tmp_path / "out")
  shutil.copytree(ref, out)
  trials = [os.path.join(out, "trials", t.id) for t in sw.trials]
  for trial in trials:  # both seeds, so that they resume as the one program that trained them: bit for bit
    os.remove(os.path.join(trial, store.SUMMARY))  # killed after the final save, before the summary
    if not rows_moved:  # ... and before Store.finish moved the rows into metrics.jsonl
      os.replace(os.path.join(trial, store.METRICS), os.path.join(trial, store.PARTIAL))
    os.makedirs(os.path.join(trial, store.CHECKPOINTS, "8" + checkpoints.TMP_SUFFIX))  # a killed save
  log = _run(sw, out)
  assert "resumes at step 6" in log
  for trial in trials:
    assert sorted(os.listdir(os.path.join(trial, store.CHECKPOINTS))) == ["6", "7"]
  _assert_same_trials(sw, out, ref)


forward = nnx.jit(lambda model, tokens: model(tokens))  # one compile, not op by op


def test_load_trial_gives_the_model_whose_held_out_loss_is_the_summarys(reference):
  sw, out = reference[True]
  t = sw.trials[1]
  model, model_cfg, task = load_trial(out, t.id)
  assert model_cfg.d_model == 16 and model_cfg.vocab_size == 16 and isinstance(task, tasks.MQAR)
  summary = store.read_json(os.path.join(out, "trials", t.id, store.SUMMARY))

  def held_out_loss(model):
    losses = []
    for j in range(1):  # eval_batches
      b = task.batch(t.config["train"]["seed"], tasks.EVAL, j, 2)  # batch_size
      logp = jax.nn.log_softmax(np.asarray(forward(model, b["tokens"]), np.float64), axis=-1)
      nll = -np.take_along_axis(logp, b["targets"][..., None], axis=-1)[..., 0]
      losses.append((nll * b["weights"]).sum() / b["weights"].sum())
    return float(np.mean(losses))

  assert held_out_loss(model) == pytest.approx(summary["final"]["eval_loss"], rel=1e-5)
  earlier = _rows(out, t.id)[5]["eval_loss"]  # the checkpoint of step 6 holds the model after row 5
  assert held_out_loss(load_trial(out, t.id, 6)[0]) == pytest.approx(earlier, rel=1e-5)
  assert earlier != pytest.approx(summary["final"]["eval_loss"], rel=1e-3)


def test_load_trial_errors_name_what_is_known(reference, tmp_path):
  sw, out = reference[True]
  ids = [t.id for t in sw.trials]
  with pytest.raises(ConfigError, match=rf"trial_id='nope' is not allowed: one of the 2 trials .*{ids[0]}, {ids[1]}"):
    load_trial(out, "nope")
  with pytest.raises(ConfigError, match=r"step=3 is not allowed: one of the checkpointed steps .*\[6, 7\]"):
    load_trial(out, ids[0], 3)
  copy = str(tmp_path / "old")
  shutil.copytree(out, copy)
  shutil.rmtree(os.path.join(copy, "trials", ids[0], store.CHECKPOINTS))
  with pytest.raises(ConfigError) as e:
    load_trial(copy, ids[0])
  msg = str(e.value)
  assert "holds none" in msg and f"remove {os.path.join(copy, 'trials', ids[0])}" in msg
  assert f"attn sweep {sw.path} --out {copy}" in msg
  with pytest.raises(ConfigError, match="no sweep.json"):
    load_trial(str(tmp_path), ids[0])


def test_store_start_keeps_rows_before_the_checkpoint_and_refuses_a_gap(tmp_path):
  st = store.Store(str(tmp_path))
  os.makedirs(st.trial_dir("t"))
  partial = os.path.join(st.trial_dir("t"), store.PARTIAL)
  with open(partial, "w") as f:
    f.write("".join(f'{{"loss": {s / 10}, "step": {s}}}\n' for s in (0, 1, 3)) + '{"loss": 0.')  # torn last line
  with pytest.raises(store.StoreDamaged, match=re.escape(f"{partial} is damaged (3 rows before the checkpoint of "
                                                        "step 4, not rows 0..3; ") + ".* is torn"):
    st.start("t", resume_from=4)
  st.start("t", resume_from=2)
  st.append("t", {"step": 2, "loss": 9.0})
  st.close()
  assert store.read_rows(partial) == [{"loss": 0.0, "step": 0}, {"loss": 0.1, "step": 1}, {"loss": 9.0, "step": 2}]
