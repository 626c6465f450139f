"""Experiment runner: config validation, trial ids, tasks, training, NaN handling, store, report."""

import json
import re
import os

import numpy as np
import pytest

from attn import count
from attn.nn import models
from attn.nn.config import ModelConfig
from attn.config import ConfigError
from attn.experiments.running import config as config_lib
from attn.experiments.reading import report
from attn.experiments.running import store
from attn.experiments.running import sweep
from attn.experiments.data import tasks
from attn.experiments.training import train
from attn.experiments.training.config import TrainConfig

TINY = """
[meta]
name = "tiny"
question = "does the runner run?"

[task]
name = "mqar"
vocab_size = 16
seq_len = 12
num_pairs = 2

[model]
d_model = 16
num_layers = 2
num_heads = 2
d_ff = 16

[train]
steps = 3
batch_size = 4
warmup_steps = 1
eval_every = 2
eval_batches = 1

[sweep]
seeds = [0, 1]

[sweep.grid]
"train.lr" = [1e-2, 1e30]
"""


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
  monkeypatch.setenv("ATTN_JAX_CACHE", str(tmp_path_factory.getbasetemp() / "jax_cache"))
  monkeypatch.setenv("ATTN_TEXT_CACHE", str(tmp_path_factory.getbasetemp() / "text_cache"))


def write(tmp_path, text, name="c.toml"):
  path = tmp_path / name
  path.write_text(text)
  return str(path)


# --- config parsing and validation -------------------------------------------------------

def test_expands_grid_times_zip_times_seeds(tmp_path):
  text = TINY.replace('"train.lr" = [1e-2, 1e30]', '"model.variant" = ["per_head", "fused"]') + \
      '[sweep.zip]\n"model.num_heads" = [1, 2, 4]\n"model.d_k" = [16, 8, 4]\n'
  sw = config_lib.load(write(tmp_path, text))
  assert len(sw.trials) == 2 * 3 * 2
  labels = [t.label for t in sw.trials]
  assert {(l["model.num_heads"], l["model.d_k"]) for l in labels} == {(1, 16), (2, 8), (4, 4)}
  for t in sw.trials:  # the axis values reach the resolved config
    assert t.config["model"]["num_heads"] == t.label["model.num_heads"]
    assert t.config["model"]["variant"] == t.label["model.variant"]
    assert t.config["train"]["seed"] == t.label["train.seed"]
    assert t.config["model"]["vocab_size"] == 16  # derived from the task


def test_fixed_width_and_fixed_params_constraints(tmp_path):
  text = TINY.replace('"train.lr" = [1e-2, 1e30]', '"model.num_heads" = [1, 2, 4]')
  text = text.replace("seeds = [0, 1]", 'seeds = [0]\nderive = ["fixed_width", "fixed_params"]')
  sw = config_lib.load(write(tmp_path, text.replace("d_ff = 16", "d_ff = 32")))
  counts = []
  for t in sw.trials:
    m = t.config["model"]
    assert m["d_k"] == m["d_v"] == 16 // m["num_heads"]
    counts.append(count.model_param_count(ModelConfig(**m), "decoder_lm"))
  per_unit = 2 * 16 * 2 + 2  # one more d_ff unit: a column and row of both MLP matrices, one bias, 2 layers
  assert max(counts) - min(counts) <= per_unit


def _derived(tmp_path, edit=()):
  text = TINY.replace('"train.lr" = [1e-2, 1e30]', '"model.num_heads" = [1, 2]')
  text = text.replace("seeds = [0, 1]", 'derive = ["fixed_width", "fixed_params"]\nseeds = [0, 1]')
  return write(tmp_path, text.replace(*edit) if edit else text)


@pytest.mark.parametrize("edit, overrides, words", [
    ((), ["model.d_k=0"], ["--set='model.d_k=0' is not allowed", "'fixed_width' computes model.d_k",
                           """--set 'sweep.derive=["fixed_params"]'"""]),
    (("d_ff = 16", "d_ff = 16\nd_v = 8"), [], ["model.d_v=8 is not allowed: left out of [model]", "'fixed_width'"]),
    ((), ["sweep.grid.model.d_k=[4, 8]"], ["sweep.grid.model.d_k=[4, 8] is not allowed", "'fixed_width'"]),
    (("seeds = [0, 1]", 'seeds = [0]\n[sweep.zip]\n"model.d_v" = [4]'), [],
     ["sweep.zip.model.d_v=[4] is not allowed", "'fixed_width' computes model.d_v"]),
    ((), ["model.d_ff=64"], ["--set='model.d_ff=64' is not allowed", "'fixed_params' computes model.d_ff",
                             "sweep.param_budget=N"]),
    (("seeds = [0, 1]", "seeds = [0]\nparam_budget = 5000"), [],
     ["model.d_ff=16 is not allowed: left out of [model]: sweep.param_budget is an integer", "'fixed_params'"]),
    ((), ['sweep.grid.model.d_ff=[8]'], ["sweep.grid.model.d_ff=[8] is not allowed", "'fixed_params'"]),
])
def test_a_value_that_a_derive_would_overwrite_is_refused(tmp_path, edit, overrides, words):
  path = _derived(tmp_path, edit)
  with pytest.raises(ConfigError) as e:
    config_lib.load(path, overrides)
  msg = str(e.value)
  assert msg.startswith(path)
  for w in words:
    assert w in msg, (w, msg)


def test_a_value_a_derive_leaves_alone_is_kept(tmp_path):
  path = _derived(tmp_path)
  assert {t.config["model"]["d_k"] for t in config_lib.load(path).trials} == {16, 8}
  # The derive dropped, the value is the trials'.
  sw = config_lib.load(path, ["model.d_k=4", "model.d_v=8", 'sweep.derive=["fixed_params"]'])
  assert {(t.config["model"]["d_k"], t.config["model"]["d_v"]) for t in sw.trials} == {(4, 8)}
  # Under fixed_params an integer budget needs no d_ff in [model]; the file's d_ff with "base" sets the budget.
  fitted = config_lib.load(_derived(tmp_path, ("d_ff = 16\n", "")), ["sweep.param_budget=5000"])
  for t in fitted.trials:
    cfg = ModelConfig(**t.config["model"])
    per_unit = count.model_param_count(cfg.replace(d_ff=2), "decoder_lm") - count.model_param_count(
        cfg.replace(d_ff=1), "decoder_lm")
    assert abs(count.model_param_count(cfg, "decoder_lm") - 5000) <= per_unit / 2


def test_cli_refuses_a_set_that_fixed_width_would_overwrite(tmp_path, capsys):
  from attn import cli
  out = tmp_path / "o"
  assert cli.main(["sweep", QUICK, "--set", "model.d_k=0", "--out", str(out)]) == 2
  err = capsys.readouterr().err
  assert err.startswith(f"attn sweep: error: {QUICK}: --set='model.d_k=0' is not allowed: ")
  assert "sweep.derive 'fixed_width' computes model.d_k" in err and "Traceback" not in err and not out.exists()


@pytest.mark.parametrize("edit, words", [
    (("[model]", "[modle]"), ["modle", "[model]"]),
    (("d_ff = 16", "d_ff = 16\nwidth = 3"), ["model.width", "num_heads"]),
    (("d_ff = 16", 'd_ff = "16"'), ["model.d_ff", "'16'", "integer"]),
    (("steps = 3", "steps = 2.5"), ["train.steps", "2.5", "int"]),
    (("steps = 3", "steps = 0"), ["train.steps=0", ">= 1"]),
    (('"train.lr" = [1e-2, 1e30]', '"train.lr" = [1e-2, -1.0]'), ["train.lr=-1.0", "> 0"]),
    (("d_ff = 16", "d_ff = 16\nvocab_size = 9"), ["model.vocab_size", "derived from the task"]),
    (('"train.lr" = [1e-2, 1e30]', '"model.num_heads" = [3]\n'), ["num_heads", "d_k"]),
    (('"train.lr" = [1e-2, 1e30]', '"model.nope" = [1]'), ["sweep.grid.model.nope"]),
    (('"train.lr" = [1e-2, 1e30]', '"train.lr" = []'), ["sweep.grid.train.lr", "non-empty list"]),
    (("seeds = [0, 1]", 'seeds = [0]\nderive = ["wide"]'), ["sweep.derive", "wide", "fixed_width"]),
    (('name = "mqar"', 'name = "mqqar"'), ["task.name", "mqqar", "induction"]),
    (('name = "mqar"\nvocab_size = 16\nseq_len = 12\nnum_pairs = 2', 'name = "text"\npath = "/no/such/file.txt"'), ["task.path", "/no/such/file.txt", "existing"]),
    (("num_pairs = 2", "num_pairs = 9"), ["task.seq_len", "integer >="]),
    (('name = "mqar"', 'name = "induction"'), ["task.num_pairs", "induction"]),
    (("seeds = [0, 1]", 'seeds = [0]\n[sweep.zip]\n"model.num_heads" = [1, 2]\n"model.d_k" = [4]'),
     ["sweep.zip", "equal length"]),
])
def test_validation_errors_name_file_key_value_and_allowed(tmp_path, edit, words):
  path = write(tmp_path, TINY.replace(*edit))
  with pytest.raises(ConfigError) as e:
    config_lib.load(path)
  msg = str(e.value)
  assert msg.startswith(path) and "not allowed" in msg
  for w in words:
    assert w in msg, (w, msg)


@pytest.mark.parametrize("field, value, allowed", [
    ("steps", 0, "an integer >= 1"),
    ("steps", 2.0, "an integer >= 1"),
    ("seed", True, "an integer >= 0"),
    ("lr", 0.0, "a finite number > 0"),
    ("lr", float("inf"), "a finite number > 0"),
    ("b2", 1.0, "a number in [0, 1)"),
    ("grad_clip", -0.5, "a finite number >= 0 (0 turns clipping off)"),
    ("eval_every", -1, "an integer >= 0 (0: only at the end)"),
    ("checkpoint_every", 1.5, "an integer >= 0 (0: at each evaluation"),
    ("weight_decay", "0.1", "a finite number >= 0"),
])
def test_train_config_names_field_value_and_allowed(field, value, allowed):
  with pytest.raises(ConfigError) as e:
    TrainConfig(**{field: value})
  assert str(e.value).startswith(f"train.{field}={value!r} is not allowed: {allowed}")


def test_train_config_defaults_and_resolved_dict(tmp_path):
  cfg = TrainConfig(lr=1, steps=10)
  assert cfg.lr == 1.0 and isinstance(cfg.lr, float)  # 1 and 1.0 are one config, one trial id
  assert cfg.checkpoint_interval == 50 and cfg.replace(checkpoint_every=7).checkpoint_interval == 7
  assert cfg.replace(eval_every=0).checkpoint_interval == 0  # only at the end
  sw = config_lib.load(write(tmp_path, TINY))
  assert sw.trials[0].config["train"] == {
      "steps": 3, "batch_size": 4, "lr": 0.01, "warmup_steps": 1, "end_lr_ratio": 0.1,
      "weight_decay": 0.01, "b1": 0.9, "b2": 0.98, "grad_clip": 1.0, "eval_every": 2,
      "eval_batches": 1, "seed": 0, "checkpoint_every": 0, "data_parallel": 1, "data_parallel_axis": "batch",
      "grad_accum": 1, "mesh": {"data": 1, "heads": 1}, "sink_metrics": False, "sink_threshold": 0.3, "logit_metrics": False,
      "indexer": "off", "indexer_kl_weight": 1.0, "indexer_dense_steps": None, "indexer_warmup_steps": None}


def test_induction_refuses_one_layer(tmp_path):
  text = TINY.replace('name = "mqar"\nvocab_size = 16\nseq_len = 12\nnum_pairs = 2',
                      'name = "induction"\nvocab_size = 16\nseq_len = 12')
  path = write(tmp_path, text.replace("num_layers = 2", "num_layers = 1"))
  with pytest.raises(ConfigError, match=r"model\.num_layers=1 is not allowed: >= 2"):
    config_lib.load(path)


def test_bad_toml_and_missing_file(tmp_path):
  with pytest.raises(ConfigError, match="valid TOML"):
    config_lib.load(write(tmp_path, "[model\n"))
  with pytest.raises(ConfigError, match="existing TOML file"):
    config_lib.load(str(tmp_path / "absent.toml"))


def test_set_overrides_base_and_pins_swept_keys(tmp_path):
  path = write(tmp_path, TINY)
  sw = config_lib.load(path, ["train.steps=7", "model.variant=per_head", "train.lr=0.005"])
  assert {t.config["train"]["steps"] for t in sw.trials} == {7}
  assert {t.config["model"]["variant"] for t in sw.trials} == {"per_head"}
  assert len(sw.trials) == 2 and {t.config["train"]["lr"] for t in sw.trials} == {0.005}
  sw = config_lib.load(path, ["seed=3"])
  assert [t.config["train"]["seed"] for t in sw.trials] == [3, 3]
  text = tmp_path / "t.txt"
  text.write_text("some local text to model, character by character. " * 10)
  sw = config_lib.load(path, ["task.name=text", f"task.path={text}"])  # mqar-only keys dropped
  assert sw.trials[0].config["task"] == {"name": "text", "path": str(text), "glob": "", "seq_len": 12, "bos": False}
  with pytest.raises(ConfigError, match="--set"):
    config_lib.load(path, ["steps"])
  with pytest.raises(ConfigError, match=r"train\.steps='x' is not allowed"):
    config_lib.load(path, ["train.steps=x"])


def test_trial_ids_are_stable_and_change_with_any_value(tmp_path):
  path = write(tmp_path, TINY)
  a, b = config_lib.load(path), config_lib.load(path)
  assert [t.id for t in a.trials] == [t.id for t in b.trials] and a.id == b.id
  assert len({t.id for t in a.trials}) == len(a.trials)
  reordered = TINY.replace("num_heads = 2\nd_ff = 16", "d_ff = 16\nnum_heads = 2")
  assert [t.id for t in config_lib.load(write(tmp_path, reordered, "r.toml")).trials] == [t.id for t in a.trials]
  for change in ["train.steps=4", "model.d_ff=17", "model.variant=per_head", "task.num_pairs=3",
                 "train.weight_decay=0.02", "train.batch_size=5"]:
    other = config_lib.load(path, [change])
    assert not {t.id for t in other.trials} & {t.id for t in a.trials}, change
    assert other.id != a.id


# --- tasks ----------------------------------------------------------------------------------

def test_tasks_are_deterministic_and_correct(tmp_path):
  mq = tasks.MQAR(vocab_size=32, seq_len=20, num_pairs=4)
  b = mq.batch(5, tasks.TRAIN, 3, 8)
  assert all(np.array_equal(b[k], mq.batch(5, tasks.TRAIN, 3, 8)[k]) for k in b)
  assert not np.array_equal(b["tokens"], mq.batch(6, tasks.TRAIN, 3, 8)["tokens"])
  assert not np.array_equal(b["tokens"], mq.batch(5, tasks.EVAL, 3, 8)["tokens"])
  for tok, tgt, w in zip(b["tokens"], b["targets"], b["weights"]):
    pairs = dict(zip(tok[0:8:2], tok[1:8:2]))
    assert len(pairs) == 4
    for t in np.nonzero(w)[0]:  # each weighted position holds a key whose value is the target
      assert pairs[tok[t]] == tgt[t]
  ind = tasks.Induction(vocab_size=50, seq_len=23).batch(0, 0, 0, 16)
  starts = set()
  for tok, tgt, w in zip(ind["tokens"], ind["targets"], ind["weights"]):
    seq = np.concatenate([tok, tgt[-1:]])
    pattern = seq[-8:]  # the repeat at the end; its first copy sits somewhere before it
    first = [s for s in range(0, 24 - 15) if (seq[s:s + 8] == pattern).all()]
    assert first and np.nonzero(w)[0].tolist() == list(range(16, 23))
    starts.add(first[0])
  assert len(starts) > 3  # the gap between the copies varies
  mp = tasks.MarkerPosition(vocab_size=10, seq_len=12, num_classes=3, num_markers=3).batch(1, 0, 0, 64)
  first = np.argmax(mp["tokens"] == 1, axis=1)
  assert ((mp["tokens"] == 1).sum(1) == 3).all() and (mp["labels"] == first // 4).all()
  assert set(mp["labels"].tolist()) == {0, 1, 2}
  am = tasks.AfterMarker(vocab_size=9, seq_len=11, num_classes=3, copies=2).batch(2, 1, 0, 200)
  for tok, label in zip(am["tokens"], am["labels"]):
    (p,) = np.nonzero(tok == 1)[0]  # one marker, and the label is the class token right after it
    assert p + 1 < 11 and tok[p + 1] == 2 + label
    assert np.bincount(tok, minlength=9)[2:5].tolist() == [2, 2, 2]  # counting tokens says nothing
  assert set(am["labels"].tolist()) == {0, 1, 2} and len(set(np.argmax(am["tokens"] == 1, 1))) == 10
  text = tmp_path / "t.txt"
  text.write_text("the quick brown fox jumps over the lazy dog. " * 20)
  ch = tasks.Text(path=str(text), seq_len=16)
  cb = ch.batch(0, tasks.TRAIN, 0, 3)
  assert ch.vocab_size == 256
  assert (cb["tokens"][:, 1:] == cb["targets"][:, :-1]).all()


# A classifier in the fast tier; a decoder is trained by tiny_sweep in the fast tier (its ok trials' rows are checked
# the same way in test_nan_trial_fails_with_reason_and_sweep_goes_on), and byte-level text batches reach a decoder's
# loss there too (test_start_loss.py's text case): mqar, induction, text (decoders like tiny_sweep's) and
# after_marker (a classifier like marker_position) in the slow tier.
@pytest.mark.parametrize("task", [
    pytest.param({"name": "mqar", "vocab_size": 16, "seq_len": 12, "num_pairs": 2}, marks=pytest.mark.slow),
    pytest.param({"name": "induction", "vocab_size": 16, "seq_len": 12}, marks=pytest.mark.slow),
    {"name": "marker_position", "vocab_size": 16, "seq_len": 12, "num_classes": 3},
    pytest.param({"name": "after_marker", "vocab_size": 16, "seq_len": 12, "num_classes": 3}, marks=pytest.mark.slow),
    pytest.param({"name": "text", "seq_len": 12}, marks=pytest.mark.slow),
])
def test_one_training_step_of_every_task(tmp_path, task):
  if task["name"] == "text":
    (tmp_path / "c.txt").write_text("abcdefghij klmnop, qrstuv. " * 10)
    task = {**task, "path": str(tmp_path / "c.txt")}
  layers = 2 if task["name"] == "induction" else 1  # an induction head needs two; one compiles faster
  cfg = config_lib.resolve({"task": task, "model": {"d_model": 16, "num_layers": layers, "num_heads": 2, "d_ff": 16,
                                                    "pooling": "mean"},
                            "train": {"steps": 2, "batch_size": 2, "eval_batches": 1}}, [], None)
  rows = []
  (summary,) = train.train_group([cfg], lambda i, r: rows.append(r))
  assert summary["status"] == "ok" and [r["step"] for r in rows] == [0, 1]
  for key in ("loss", "accuracy", "grad_norm", "param_norm", "update_norm", "step_time_s"):
    assert np.isfinite(rows[-1][key])
  assert rows[1]["update_norm"] > 0 and "eval_loss" in rows[-1]


@pytest.mark.parametrize("kind", ["decoder_lm", "classifier"])
def test_embed_init_std_scales_only_the_token_table(kind):
  from flax import nnx
  from attn.nn import models
  from attn.nn.config import ModelConfig
  cfg = ModelConfig(vocab_size=200, d_model=32, num_layers=1, num_heads=2, d_ff=8,
                           num_classes=3 if kind == "classifier" else 0)
  states = [nnx.to_flat_state(nnx.state(
      models.MODELS[kind](cfg.replace(embed_init_std=std), rngs=nnx.Rngs(3)), nnx.Param))
      for std in (0.02, 1.0, 1.0)]
  changed = []
  for (path, a), (_, b), (_, c) in zip(*states):
    np.testing.assert_array_equal(np.asarray(b[...]), np.asarray(c[...]))  # deterministic in seed
    if not np.array_equal(np.asarray(a[...]), np.asarray(b[...])):
      changed.append(path)
      assert abs(float(np.std(np.asarray(b[...]))) - 1.0) < 0.1
      assert abs(float(np.std(np.asarray(a[...]))) - 0.02) < 0.005
  assert len(changed) == 1 and changed[0][-1] == "token"


def test_experiments_default_to_unit_token_embeddings(tmp_path):
  """Unset, embed_init_std is 1.0 in every resolved trial (ModelConfig's own default is 0.02)."""
  sw = config_lib.load(write(tmp_path, TINY))
  assert {t.config["model"]["embed_init_std"] for t in sw.trials} == {1.0}
  sw = config_lib.load(write(tmp_path, TINY), ["model.embed_init_std=0.5"])
  assert {t.config["model"]["embed_init_std"] for t in sw.trials} == {0.5}


# --- sweeps, store, NaN handling, determinism, report ----------------------------------------

@pytest.fixture(scope="module")
def tiny_sweep(tmp_path_factory):
  root = tmp_path_factory.mktemp("sweep")
  # One block and two rows a batch: conftest's TINY_SWEEP programs (compiled once for the runner tests), the same runner.
  text = TINY.replace("num_layers = 2", "num_layers = 1").replace("batch_size = 4", "batch_size = 2")
  path = write(root, text)
  os.environ.setdefault("ATTN_JAX_CACHE", str(root / "jax_cache"))
  sw = config_lib.load(path)
  counts = sweep.run_sweep(sw, str(root / "out"), config_text=text)
  return sw, str(root / "out"), counts, path


def test_nan_trial_fails_with_reason_and_sweep_goes_on(tiny_sweep):
  sw, out, counts, _ = tiny_sweep
  assert counts == {"ok": 2, "failed": 2, "skipped": 0}
  for t in sw.trials:
    s = store.read_json(os.path.join(out, "trials", t.id, "summary.json"))
    if t.label["train.lr"] > 1:
      assert s["status"] == "failed" and "non-finite" in s["reason"]
    else:
      rows = store.read_rows(os.path.join(out, "trials", t.id, "metrics.jsonl"))
      assert s["status"] == "ok" and [r["step"] for r in rows] == [0, 1, 2]
      assert s["final"]["eval_loss"] == rows[-1]["eval_loss"]
      for key in ("loss", "accuracy", "grad_norm", "param_norm", "update_norm", "step_time_s", "eval_loss"):
        assert np.isfinite(rows[-1][key]), key
      assert rows[-1]["update_norm"] > 0  # (step 0's is 0: warm-up starts at lr 0)


def test_rerun_skips_finished_and_other_sweep_is_refused(tiny_sweep, tmp_path):
  sw, out, _, path = tiny_sweep
  before = {f: os.path.getmtime(os.path.join(r, f)) for r, _, fs in os.walk(out) for f in fs}
  assert sweep.run_sweep(sw, out) == {"ok": 0, "failed": 0, "skipped": 4}
  other = config_lib.load(path, ["train.steps=4"])
  with pytest.raises(ConfigError, match=r"--out=.* holding this same sweep.*nothing was overwritten"):
    sweep.run_sweep(other, out)
  (tmp_path / "junk.txt").write_text("mine")
  with pytest.raises(ConfigError, match="junk.txt"):
    sweep.run_sweep(other, str(tmp_path))
  after = {f: os.path.getmtime(os.path.join(r, f)) for r, _, fs in os.walk(out) for f in fs}
  assert {k: v for k, v in after.items() if k != "report.md"} == \
      {k: v for k, v in before.items() if k != "report.md"}


def _rows(out, trial_id):
  rows = store.read_rows(os.path.join(out, "trials", trial_id, "metrics.jsonl"))
  return [{k: v for k, v in r.items() if k != "step_time_s"} for r in rows]


@pytest.mark.slow  # end to end, seconds: the slow tier runs it
def test_same_trial_and_seed_give_identical_metrics(tiny_sweep, tmp_path):
  sw, out, _, _ = tiny_sweep
  again = sweep.run_sweep(sw, str(tmp_path / "again"))
  assert again["ok"] == 2
  for t in sw.trials:
    assert _rows(out, t.id) == _rows(str(tmp_path / "again"), t.id)


def test_vmap_over_seeds_matches_separate_runs(tiny_sweep):
  sw, out, _, _ = tiny_sweep
  ok = [t for t in sw.trials if t.label["train.lr"] < 1]
  rows = {}
  train.train_group([t.config for t in ok], lambda i, r: rows.setdefault(i, []).append(r), vmap=False)
  for i, t in enumerate(ok):
    vm = _rows(out, t.id)
    for a, b in zip(vm, rows[i]):
      np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-4)
      np.testing.assert_allclose(a["eval_accuracy"] if "eval_accuracy" in a else 0,
                                 b.get("eval_accuracy", 0), atol=1e-6)


def test_report_from_store(tiny_sweep):
  sw, out, _, _ = tiny_sweep
  path = report.write_report(out)
  md = open(path).read()
  assert "does the runner run?" in md and "Measured answer" in md
  for t in sw.trials:
    assert t.id in md
  assert md.count("non-finite") == 2  # both failed trials listed with their reason
  assert "lr=0.01" in md and "## Failed trials" in md
  pytest.importorskip("matplotlib")
  linked = re.findall(r"\]\((\w+\.png)\)", md)
  assert "learning_curves.png" in linked
  for png in linked:  # every plot the report shows exists (an axis left with one value has none)
    assert os.path.getsize(os.path.join(out, png)) > 1000, png
  header = json.load(open(os.path.join(out, "sweep.json")))
  assert header["sweep_id"] == sw.id and len(header["trials"]) == 4


def _group(label, accuracies, losses=None):
  losses = losses or [0.0] * len(accuracies)
  return {"group": ", ".join(f"{k}={v}" for k, v in label.items()), "label": label,
          "n": len(accuracies), "accuracies": accuracies,
          "eval_accuracy": report._mean_std(accuracies), "eval_loss": report._mean_std(losses),
          "seed_values": {"eval_accuracy": accuracies, "eval_loss": losses}}


def test_measured_answer_compares_each_axis_with_the_others_fixed():
  rng = np.random.default_rng(0)
  # Accuracy falls with h (0.9, 0.6, 0.3) and does not depend on the variant.
  rows = [_group({"model.num_heads": h, "model.variant": v},
                 list(base + 0.02 * rng.standard_normal(4)))
          for h, base in ((1, 0.9), (2, 0.6), (4, 0.3)) for v in ("fused", "merged")]
  lines = report.axis_answers(rows, ["model.num_heads", "model.variant", "train.seed"])
  heads = [l for l in lines if l.startswith("- **num_heads**")]
  variants = [l for l in lines if l.startswith("- **variant**")]
  assert len(heads) == 2 and len(variants) == 3
  assert all("Falls at every step" in l and "a clear difference" in l for l in heads)
  assert all("within seed noise" in l for l in variants)
  # Tied axes (a zip) are answered once, under the first.
  tied = [_group({"model.num_heads": h, "model.d_k": 64 // h}, [a, a + 0.01]) for h, a in ((1, 0.5), (4, 0.2))]
  (line,) = report.axis_answers(tied, ["model.num_heads", "model.d_k"])
  assert line.startswith("- **num_heads (tied to d_k)**")
  assert "one seed only" in report.verdict([0.9], [0.1, 0.2])
  # Three seeds each, completely separated: clear (p = 1/20) even when one outlier keeps t below 3.
  assert "a clear difference (2.5 standard errors" in report.verdict([0.988, 0.529, 0.477], [0.333, 0.212, 0.212])
  assert "p = 0.05 by chance" in report.verdict([0.988, 0.529, 0.477], [0.333, 0.212, 0.212])
  # Two seeds each, separated but under 3 standard errors: only suggestive.
  assert "suggestive" in report.verdict([0.9, 0.5], [0.3, 0.2])
  # Overlapping trials are never "clear", however large the mean gap.
  assert "clear difference" not in report.verdict([0.9, 0.9, 0.1], [0.15, 0.15, 0.15])
  assert report.compare([0.9, 0.8], [0.1, 0.85])[2] == 0.75
  # Settings that all reach the ceiling are level, not "not monotone".
  ceiling = [_group({"model.d_k": k}, [a, a]) for k, a in ((2, 0.7), (4, 1.0), (8, 1.0), (16, 0.999))]
  (line,) = report.axis_answers(ceiling, ["model.d_k"])
  assert "Rises or stays level at every step" in line
  dip = [_group({"model.d_k": k}, [a, a]) for k, a in ((2, 0.7), (4, 1.0), (8, 0.8))]
  assert "Not monotone" in report.axis_answers(dip, ["model.d_k"])[0]
  # Equal accuracies (a saturated task) are told apart by held-out loss, lower is better.
  same = [_group({"model.d_k": k}, [1.0, 1.0, 1.0], l) for k, l in ((16, [0.5, 0.52, 0.51]), (32, [0.1, 0.12, 0.11]))]
  (line,) = report.axis_answers(same, ["model.d_k"])
  assert "same accuracy at every setting" in line and "Best" not in line
  assert "best 32 (0.11) vs worst 16 (0.51): a clear difference" in line


def test_late_change_measures_the_end_of_a_curve():
  # Evaluations every 100 steps of a 1000-step run: the last 10% reaches back to step 899.
  rows = [{"step": s, "eval_bpb": 3.0 - s / 1000} for s in range(99, 1000, 100)] + [{"step": 999}]
  change, span = report.late_change(rows, "eval_bpb")
  assert span == 100 and change == pytest.approx(-0.1)
  # A longer window reaches the evaluation at or before 1000 * 0.75 = 750 steps from the end.
  assert report.late_change(rows, "eval_bpb", frac=0.25) == (pytest.approx(-0.3), 300)
  assert report.late_change(rows[:1], "eval_bpb") is None


def test_cli_reports_config_errors_without_traceback(tmp_path, capsys):
  from attn import cli
  path = write(tmp_path, TINY.replace("d_ff = 16", "d_ff = -1"))
  assert cli.main(["sweep", path, "--out", str(tmp_path / "o")]) == 2
  err = capsys.readouterr().err
  assert "d_ff=-1" in err and "Traceback" not in err and not (tmp_path / "o").exists()
  assert cli.main(["report", str(tmp_path / "nothing")]) == 2
  assert "no sweep.json" in capsys.readouterr().err


QUICK = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "quick.toml")


def test_cli_refuses_zero_heads_under_fixed_width(tmp_path, capsys):
  from attn import cli
  out = tmp_path / "o"
  assert cli.main(["sweep", QUICK, "--set", "model.num_heads=0", "--out", str(out)]) == 2
  err = capsys.readouterr().err
  assert "model.num_heads=0 is not allowed: an integer >= 1" in err and "fixed_width" in err
  assert "Traceback" not in err and not out.exists()


def test_cli_refuses_an_out_that_is_a_file(tmp_path, capsys):
  from attn import cli
  out = tmp_path / "results.txt"
  out.write_text("mine")
  assert cli.main(["sweep", QUICK, "--out", str(out), "--no-report"]) == 2
  err = capsys.readouterr().err
  assert f"--out={str(out)!r} is not allowed: a directory" in err and "existing file" in err
  assert "Traceback" not in err and out.read_text() == "mine"


def test_sweep_cases_are_named_settings_crossed_with_the_grid(tmp_path):
  text = TINY + '''
[[sweep.cases]]
name = "base"
[[sweep.cases]]
name = "two kv heads, no bias"
model.num_kv_heads = 1
model.use_bias = false
'''
  sweep = config_lib.loads(text, "c.toml")
  assert sweep.axes[0] == "case"
  cases = {(t.label["case"], t.label["train.seed"]): t.config["model"] for t in sweep.trials}
  assert sorted(cases) == [("base", 0), ("base", 1), ("two kv heads, no bias", 0), ("two kv heads, no bias", 1)]
  assert cases[("base", 0)]["use_bias"] is True
  assert cases[("two kv heads, no bias", 1)]["num_kv_heads"] == 1
  assert cases[("two kv heads, no bias", 1)]["use_bias"] is False
  bad = text.replace('model.num_kv_heads = 1', 'model.num_kv_heads = "one"')
  with pytest.raises(ConfigError, match=r"sweep.cases\[1\].model.num_kv_heads='one'.*an integer"):
    config_lib.loads(bad, "c.toml")
  with pytest.raises(ConfigError, match=r"sweep.cases\[1\].name"):
    config_lib.loads(text.replace('"two kv heads, no bias"', '"base"'), "c.toml")
