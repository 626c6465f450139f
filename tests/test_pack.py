"""sweep.pack: same-shape trials (differing in seed, lr, warmup or end_lr_ratio) trained as one vmapped program.

Each packed trial's rows equal those of the same trial trained alone to float32 rounding (rtol 1e-5;
update_norm 2e-3: Adam's g/(|g| + 1e-8) magnifies a last-bit change of a gradient entry near 1e-8,
as tests/test_data_parallel.py measured); a pack's memory is checked before training (fit_packs);
a trial another worker holds is never packed in; a killed pack resumes bit for bit (slow tier).
"""

import io
import os

import jax
import numpy as np
import pytest
from flax import nnx

from attn.config import ConfigError
from attn.experiments import load_trial
from attn.experiments.running import config as config_lib
from attn.experiments.running import store
from attn.experiments.running import sweep
from attn.experiments.data import tasks
from attn.experiments.training import train
from attn.experiments.training.config import TrainConfig
from attn.nn import models
from attn.nn.config import ModelConfig
from conftest import TINY_MQAR

# Four trials of one shape: two learning rates (one warmup each) by two seeds.
PACKED = TINY_MQAR + """
[train]
steps = 5
batch_size = 4
lr = 1e-2
eval_every = 2
eval_batches = 1

[sweep]
pack = 4
[sweep.grid]
seed = [0, 1]
[sweep.zip]
"train.lr" = [1e-2, 3e-3]
"train.warmup_steps" = [1, 3]
"""
RTOL = {"update_norm": 2e-3}


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
  monkeypatch.setenv("ATTN_JAX_CACHE", str(tmp_path_factory.getbasetemp() / "jax_cache"))


def _load(text=PACKED, overrides=()):
  return config_lib.loads(text, "packed.toml", list(overrides))


def _rows(out, trial_id):
  rows = store.read_rows(os.path.join(out, "trials", trial_id, store.METRICS))
  return [{k: v for k, v in r.items() if k != "step_time_s"} for r in rows]


def _params(out, trial_id):
  """{path: array} of a trial's final parameters."""
  model, _, _ = load_trial(out, trial_id)
  flat, _ = jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))
  return {jax.tree_util.keystr(path): np.asarray(x) for path, x in flat}


@pytest.mark.parametrize("sweep_text, match", [
    ("pack = 0", r"sweep\.pack=0 is not allowed: an integer >= 1"),
    ("pack = true", r"sweep\.pack=True is not allowed: an integer >= 1"),
    ('pack = "all"', r"sweep\.pack='all' is not allowed: an integer >= 1.*train\.seed, train\.lr"),
    ("pack = 2\nvmap_seeds = true", r"sweep\.pack=2 is not allowed: 1 with sweep\.vmap_seeds = true"),
])
def test_pack_is_refused_by_name(sweep_text, match):
  with pytest.raises(ConfigError, match=match):
    _load(PACKED.replace("pack = 4", sweep_text))


def test_packs_hold_trials_equal_but_for_the_packable_keys_each_once():
  sw = _load(PACKED.replace("seed = [0, 1]", 'seed = [0, 1, 2]\n"model.num_heads" = [2, 4]'))
  assert sw.pack == 4 and len(sw.trials) == 12  # 2 head counts x 3 seeds x 2 (lr, warmup)
  for pack, limits, sizes in ((4, None, [4, 2, 4, 2]), (4, "3", [3, 3, 3, 3]), (1, None, [1] * 12),
                              (12, None, [6, 6])):
    keys = {config_lib.pack_key(t) for t in sw.trials}
    groups = config_lib.seed_groups(sw.trials, False, pack, {k: int(limits) for k in keys} if limits else None)
    assert sorted(len(g) for g in groups) == sorted(sizes)
    assert sorted(t.id for g in groups for t in g) == sorted(t.id for t in sw.trials)  # each trial once
    for g in groups:
      assert len({t.config["model"]["num_heads"] for t in g}) == 1
      assert len({config_lib.pack_key(t) for t in g}) == 1
  # what a resumed sweep regroups: only the unfinished trials, never a finished one beside them
  left = sw.trials[3:]
  assert all(t in left for g in config_lib.seed_groups(left, False, 4) for t in g)
  with pytest.raises(ConfigError, match=r"configs=1 is not allowed: trials that differ only in train\.seed.*"
                                        r"model\.num_heads"):
    train.train_group([sw.trials[0].config, sw.trials[-1].config], lambda i, r: None)


def test_fit_packs_reduces_a_pack_naming_the_memory(monkeypatch):
  sw = _load()
  monkeypatch.setattr(train, "memory_estimate", lambda cfg: 1000)
  monkeypatch.setattr(sweep, "device_memory", lambda: (int(2500 / sweep.PACK_MEMORY_FRACTION), "the test's memory"))
  log = io.StringIO()
  limits = sweep.fit_packs(sw.trials, 4, log)
  assert list(limits.values()) == [2]
  assert ("sweep.pack=4: reduced to 2 for [seed=0,1, lr=0.01,0.003, warmup_steps=1,3]: one trial's train step "
          "needs 1.0 kB (XLA's memory analysis), the test's memory has 3.1 kB available") in log.getvalue()
  assert [len(g) for g in config_lib.seed_groups(sw.trials, False, 4, limits)] == [2, 2]
  assert sweep.fit_packs(sw.trials, 3, io.StringIO()) == {config_lib.pack_key(sw.trials[0]): 2}
  monkeypatch.setattr(sweep, "device_memory", lambda: (10, "the test's memory"))  # not even one fits
  assert list(sweep.fit_packs(sw.trials, 4, io.StringIO()).values()) == [1]  # check_memory fails it by name
  monkeypatch.setattr(sweep, "device_memory", lambda: (None, "nowhere"))
  assert sweep.fit_packs(sw.trials, 4, io.StringIO()) == {}
  assert sweep.fit_packs(sw.trials, 1, io.StringIO()) == {}


@pytest.mark.slow  # 14 s here (two programs compiled); fast sibling: test_a_pack_leaves_a_trial_another_worker_holds
def test_a_packed_sweep_trains_each_trial_as_it_trains_alone(tmp_path, monkeypatch):
  """Four trials (two lrs and warmups by two seeds), pack = 4 with memory for three: packs of 3 and 1."""
  sw = _load()
  cfg0 = sw.trials[0].config
  per = train.memory_estimate(cfg0)
  assert per > 0
  monkeypatch.setattr(sweep, "device_memory", lambda: (int(3.5 * per / sweep.PACK_MEMORY_FRACTION), "test memory"))
  peaks, check = [], sweep.check_memory
  monkeypatch.setattr(sweep, "check_memory", lambda g, c: (peaks.append((len(g), train.peak_bytes(c[0]))),
                                                           check(g, c)))
  out, log = str(tmp_path / "packed"), io.StringIO()
  sweep.run_sweep(sw, out, stream=log)
  assert "sweep.pack=4: reduced to 3" in log.getvalue()
  assert sorted(n for n, _ in peaks) == [1, 3]
  for n, peak in peaks:  # a pack of n wants no more than n trials alone: what fit_packs plans on
    assert peak <= n * per * 1.05, (n, peak, per)
  alone = {i: [] for i in range(4)}
  summaries = train.train_group([t.config for t in sw.trials], lambda i, r: alone[i].append(r), vmap=False)
  assert {s["group_size"] for s in summaries} == {1}
  assert len({t.config["train"]["lr"] for t in sw.trials[:3]}) == 2  # the pack of 3 mixes learning rates
  for i, t in enumerate(sw.trials):
    summary = store.read_json(os.path.join(out, "trials", t.id, store.SUMMARY))
    assert summary["status"] == "ok" and summary["group_size"] == (3 if i < 3 else 1)
    rows, expected = _rows(out, t.id), alone[i]
    assert [r["step"] for r in rows] == list(range(5)) and len(expected) == 5
    assert [r["lr"] for r in rows] == [r["lr"] for r in expected]  # each its own schedule
    for r, e in zip(rows, expected):
      for k in r:
        np.testing.assert_allclose(r[k], e[k], rtol=RTOL.get(k, 1e-5), err_msg=f"{k} at step {r['step']}")


@pytest.mark.slow  # two sweeps; the fast sibling above compares every row
def test_a_packed_trials_parameters_equal_those_it_reaches_alone(tmp_path):
  sw, sw1 = _load(overrides=["sweep.pack=3"]), _load(overrides=["sweep.pack=1"])
  assert [t.id for t in sw1.trials] == [t.id for t in sw.trials]  # packing is not part of a trial's id
  out, ref = str(tmp_path / "packed"), str(tmp_path / "alone")
  sweep.run_sweep(sw, out, stream=io.StringIO())
  sweep.run_sweep(sw1, ref, stream=io.StringIO())
  # The key bias (the middle third of the fused b_qkv: H = G, K = V here) is left out: it drops out
  # of the softmax, so its exact gradient is 0 and Adam's g/(|g| + 1e-8) steps it by the sign of
  # round-off, differently in each program.
  for t in sw.trials[:3]:
    packed, ref_params = _params(out, t.id), _params(ref, t.id)
    assert packed.keys() == ref_params.keys() and len(packed) == 18 and any("b_qkv" in k for k in packed)  # 18: an untied output head (kernel, bias)
    for k in packed:
      a, b = packed[k], ref_params[k]
      if "b_qkv" in k:
        a, b = np.delete(a, np.s_[16:32]), np.delete(b, np.s_[16:32])
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * float(np.abs(b).max()), err_msg=k)


def test_a_pack_leaves_a_trial_another_worker_holds(tmp_path, monkeypatch):
  # Three trials, each its own seed, learning rate and warm-up; the pack of the two left is the program of
  # conftest's TINY_SWEEP (two seeds vmapped, two rows a batch) that the other runner tests compile: faster.
  text = PACKED.replace('[sweep.grid]\nseed = [0, 1]\n[sweep.zip]\n"train.lr" = [1e-2, 3e-3]\n"train.warmup_steps" = [1, 3]',
                        '[sweep.zip]\nseed = [0, 1, 2]\n"train.lr" = [1e-2, 3e-3, 1e-3]\n"train.warmup_steps" = [1, 3, 2]')
  sw = _load(text, ["train.checkpoint_every=5", "train.batch_size=2"])  # one save per trial, at the end
  assert len(sw.trials) == 3
  monkeypatch.setattr(sweep, "device_memory", lambda: (None, "unknown"))  # no memory check (tested above): faster
  out = str(tmp_path / "out")
  sweep.prepare(sw, out)
  other = store.Store(out)
  held = sw.trials[1].id
  assert other.lease(held, 600.0, "other worker") is not None
  log = io.StringIO()
  counts = sweep.run_trials(out, stream=log)  # wait=False: the held one is left
  assert counts["ok"] == 2 and counts.get("unfinished") == 1
  assert f"is held by" in log.getvalue()
  assert not os.path.exists(os.path.join(out, "trials", held, store.SUMMARY))
  assert not os.path.exists(os.path.join(out, "trials", held, store.PARTIAL))
  sizes = [store.read_json(os.path.join(out, "trials", t.id, store.SUMMARY))["group_size"]
           for t in sw.trials if t.id != held]
  assert sizes == [2, 2]
  other.release(held)
  other.close()
  # Each member of the pack (two learning rates, two seeds) got its own schedule, data and init:
  # its lr column is its own schedule's, its first loss its own initial model's on its own first batch.
  task = tasks.make_task(sw.trials[0].config["task"])
  loss_of = nnx.jit(lambda m, b: train._loss(m, b, task.kind))  # one compile for the three, not op by op
  for t in sw.trials:
    if t.id == held:
      continue
    rows, cfg = _rows(out, t.id), t.config
    tc = TrainConfig(**cfg["train"])
    np.testing.assert_array_equal([r["lr"] for r in rows], np.asarray(jax.vmap(train.schedule(tc))(np.arange(5))))
    model = models.MODELS[task.kind](ModelConfig(**cfg["model"]), rngs=nnx.Rngs(tc.seed))
    batch = tasks.batch_rows(task, tc.seed, tasks.TRAIN, 0, tc.batch_size)
    loss, _ = loss_of(model, batch)
    np.testing.assert_allclose(rows[0]["loss"], float(loss), rtol=1e-5)


class Crash(Exception):
  """Stands for a kill: not one of the errors the sweep records as a failed trial."""


@pytest.mark.slow  # three packed runs
def test_a_killed_pack_resumes_bit_for_bit(tmp_path, monkeypatch):
  sw = _load()
  ref = str(tmp_path / "ref")
  sweep.run_sweep(sw, ref, stream=io.StringIO())
  out = str(tmp_path / "out")
  original = store.Store.append

  def append(self, trial_id, row):
    original(self, trial_id, row)
    if row["step"] == 3:
      raise Crash(trial_id)
  monkeypatch.setattr(store.Store, "append", append)
  with pytest.raises(Crash):
    sweep.run_sweep(sw, out, stream=io.StringIO())
  monkeypatch.setattr(store.Store, "append", original)
  log = io.StringIO()
  sweep.run_sweep(sw, out, stream=log)
  assert log.getvalue().count("resumes at step 2") == 4
  for t in sw.trials:
    assert _rows(out, t.id) == _rows(ref, t.id)
    a, b = _params(out, t.id), _params(ref, t.id)
    assert a.keys() == b.keys()
    for k in a:
      np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_the_run_records_end_line_gives_trials_per_hour_and_device_busy_time(tmp_path):
  from attn.experiments.running import run_record
  root, t0 = str(tmp_path), 1000.0
  summaries = {  # a pack of 3 (one program: 30 s of steps), one trial alone on a mesh of 2, one from before
      "a": {"finished_unix": t0 + 50, "train_s": 30.0, "group_size": 3, "mesh": {"data": 1, "heads": 1}},
      "b": {"finished_unix": t0 + 55, "train_s": 30.0, "group_size": 3, "mesh": {"data": 1, "heads": 1}},
      "c": {"finished_unix": t0 + 60, "train_s": 30.0, "group_size": 3, "mesh": {"data": 1, "heads": 1}},
      "d": {"finished_unix": t0 + 90, "train_s": 20.0, "group_size": 1, "mesh": {"data": 2, "heads": 1}},
      "old": {"finished_unix": t0 - 5, "train_s": 99.0, "group_size": 1},
  }
  for name, s in summaries.items():
    os.makedirs(os.path.join(root, "trials", name))
    store.write_json(os.path.join(root, "trials", name, store.SUMMARY), {"status": "ok", **s})
  os.makedirs(os.path.join(root, "trials", "running"))  # unfinished: no summary
  line = run_record.end_line({"start_unix": t0, "devices": 2}, "finished", root)
  assert line["trials_finished"] == 4 and line["training_wall_s"] == 90.0
  assert line["trials_per_hour"] == 160.0  # 4 trials in 90 s
  assert line["device_busy_s"] == 70.0  # 30 s once for the pack + 20 s on each of 2 devices
  assert line["device_busy_fraction"] == round(70 / (90 * 2), 4)
  assert "4 trials in 90.0 s of training wall: 160.0 trials per hour, device busy 70.0 s (39% of it)" in \
      run_record.describe(line)
  assert "trials_finished" not in run_record.end_line({"start_unix": t0 + 100}, "finished", root)


@pytest.mark.parametrize("step_s, sizes, said", [
    # a step whose time grows slower than the pack: doubling pays until memory (4 here) stops it
    (lambda n: 1.0 + 0.1 * n, [1, 2, 4, 4, 1], "4 trials per program ran 2.9 trial-steps/s: 4 per program from here"),
    # a step as slow per trial packed as alone (a busy CPU): one trial per program after one try of 2
    (lambda n: 1.0 * n, [1, 2] + [1] * 9, "2 trials per program ran 1.0 trial-steps/s, under 1.1x the 1.0 of 1 "
                                          "per program: 1 per program from here"),
])
def test_pack_auto_chooses_the_size_by_measured_throughput(tmp_path, monkeypatch, step_s, sizes, said):
  """sweep.pack = "auto" on 12 trials of one shape, the step time a given function of the pack's size."""
  sw = _load(PACKED.replace("pack = 4", 'pack = "auto"').replace("seed = [0, 1]", "seed = [0, 1, 2, 3, 4, 5]"))
  assert sw.pack == "auto" and len(sw.trials) == 12
  monkeypatch.setattr(train, "memory_estimate", lambda cfg: 1000)
  monkeypatch.setattr(sweep, "device_memory", lambda: (int(4000 / sweep.PACK_MEMORY_FRACTION), "the test's memory"))
  seen = []

  def fake_train_group(configs, on_row, on_step=None, vmap=True, checkpoint_dirs=None, on_start=None, log=None,
                       on_compiled=None):  # no JAX: the worker's choices only
    seen.append(len(configs))
    assert vmap  # "auto" packs: a pack of one runs the unbatched program (train_group: vmap and n > 1)
    for i in range(len(configs)):
      on_start(i, 0)
    return [{"status": "ok", "steps_done": 5, "group_size": len(configs), "step_time_s_median": step_s(len(configs)),
             "train_s": 5 * step_s(len(configs))} for _ in configs]
  monkeypatch.setattr(train, "train_group", fake_train_group)
  log = io.StringIO()
  counts = sweep.run_sweep(sw, str(tmp_path / "out"), stream=log)
  assert counts["ok"] == 12 and seen == sizes and sum(seen) == 12
  assert "sweep.pack=auto: at most 4 for [" in log.getvalue()  # memory: 4 of 1.0 kB in 4.0 kB
  assert said in log.getvalue()


def test_pack_auto_and_packs_beside_processes_per_trial_are_refused():
  assert _load(PACKED.replace("pack = 4", 'pack = "auto"')).pack == "auto"
  with pytest.raises(ConfigError, match=r"sweep\.pack='every' is not allowed: an integer >= 1.*or \"auto\""):
    _load(PACKED.replace("pack = 4", 'pack = "every"'))
  with pytest.raises(ConfigError, match=r"sweep\.pack=4 is not allowed: 1 with 2 processes per trial"):
    config_lib.check_devices(_load().trials, False, 2, 4)
