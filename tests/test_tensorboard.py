"""TensorBoard curves: `attn sweep --tensorboard` (live) and `attn export --tensorboard`, read back by TensorBoard.

Every row of every trial must come back from the event files (TensorBoard's own
EventAccumulator) once per step, equal to the store's, for both paths, after a
resume and after a second export; a failing event writer never changes a row.
Skipped without tensorboardX (the tensorboard extra) or tensorboard (the reader).
"""

import io
import os
import shutil
import subprocess
import sys

import pytest

from attn import cli
from attn.experiments.running import config as config_lib
from attn.experiments.running import store
from attn.experiments.running import sweep
from attn.experiments.running import tb_writer
from conftest import TINY_SWEEP

CONFIG = TINY_SWEEP.replace("seeds = [0, 1]", "seeds = [0]") + """

[sweep.grid]
"model.num_heads" = [1, 2]
"""
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _reader():
  pytest.importorskip("tensorboardX")
  return pytest.importorskip("tensorboard.backend.event_processing.event_accumulator").EventAccumulator


def read_runs(logdir):
  """{run: {tag: [(step, value), ...]}} as TensorBoard shows it."""
  EventAccumulator = _reader()
  runs = {}
  for run in sorted(os.listdir(logdir)):
    ea = EventAccumulator(os.path.join(logdir, run), size_guidance={"scalars": 0})  # 0: keep every event
    ea.Reload()
    runs[run] = {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}
  return runs


def assert_mirrors_store(logdir, out):
  """Each trial's run holds each number of each of its rows, once per step; nothing else."""
  runs = read_runs(logdir)
  trials = list(store.iter_trials(out))
  assert sorted(runs) == sorted(tb_writer.run_name(t["id"], t["label"]) for t in trials)
  for t in trials:
    run = runs[tb_writer.run_name(t["id"], t["label"])]
    expected = {}
    for row in t["rows"]:
      for k, v in row.items():
        if k != "step":
          expected.setdefault(k, []).append((row["step"], v))
    assert sorted(run) == sorted(expected)
    for tag, points in expected.items():
      assert [s for s, _ in run[tag]] == [s for s, _ in points], tag  # every step once, in order
      assert [v for _, v in run[tag]] == pytest.approx([v for _, v in points], rel=1e-6), tag  # float32 in events
  return runs


@pytest.fixture(scope="module")
def live(tmp_path_factory):
  """(config path, store, logdir) of the tiny sweep trained with --tensorboard."""
  _reader()
  root = tmp_path_factory.mktemp("tensorboard")
  os.environ.setdefault("ATTN_JAX_CACHE", os.environ.get("ATTN_TEST_JAX_CACHE") or os.path.join(
      os.path.expanduser("~"), ".cache", "attn", "jax-tests"))
  path = str(root / "tiny.toml")
  with open(path, "w") as f:
    f.write(CONFIG)
  out, logdir = str(root / "out"), str(root / "logs")
  counts = sweep.run_sweep(config_lib.load(path), out, config_text=CONFIG, stream=io.StringIO(), tensorboard=logdir)
  assert counts == {"ok": 2, "failed": 0, "skipped": 0}
  return path, out, logdir


@pytest.mark.slow  # a sweep with live TensorBoard curves
def test_live_curves_hold_every_row_of_every_trial(live):
  _, out, logdir = live
  runs = assert_mirrors_store(logdir, out)
  ids = [t["id"] for t in store.load_sweep(out)["trials"]]
  assert sorted(runs) == sorted([f"num_heads=1,seed=0-{ids[0]}", f"num_heads=2,seed=0-{ids[1]}"])


@pytest.mark.slow  # a sweep with live TensorBoard curves
def test_export_writes_the_same_runs_and_again_shows_each_step_once(live, tmp_path, capsys):
  _, out, _ = live
  logdir = str(tmp_path / "exported")
  for _ in range(2):  # the second export rewrites each run
    assert cli.main(["export", out, "--tensorboard", logdir]) == 0
    assert capsys.readouterr().out.startswith(f"tensorboard: 2 runs, 8 rows in {logdir}")
    assert_mirrors_store(logdir, out)
  for run in os.listdir(logdir):
    assert len(os.listdir(os.path.join(logdir, run))) == 1


@pytest.mark.slow  # a sweep with live TensorBoard curves
def test_a_resumed_trial_rewrites_its_run_from_the_store(live, tmp_path):
  path, out, logdir = live
  out2, logdir2 = str(tmp_path / "out"), str(tmp_path / "logs")
  shutil.copytree(out, out2)
  shutil.copytree(logdir, logdir2)
  # As after a kill -9 past its checkpoint of step 2: rows 0..3 in the store and in TensorBoard, no summary.
  tid = store.load_sweep(out2)["trials"][1]["id"]
  trial = os.path.join(out2, "trials", tid)
  os.remove(os.path.join(trial, store.SUMMARY))
  os.replace(os.path.join(trial, store.METRICS), os.path.join(trial, store.PARTIAL))
  log = io.StringIO()
  assert sweep.run_sweep(config_lib.load(path), out2, config_text=CONFIG, stream=log, tensorboard=logdir2)["ok"] == 1
  assert "resumes at step 2" in log.getvalue()
  assert_mirrors_store(logdir2, out2)  # steps 2 and 3 once, with the values the store holds now
  t = next(t for t in store.iter_trials(out2) if t["id"] == tid)
  assert len(os.listdir(os.path.join(logdir2, tb_writer.run_name(tid, t["label"])))) == 1  # the old file replaced


@pytest.mark.slow  # a sweep with live TensorBoard curves
def test_a_failing_event_writer_changes_no_row(live, tmp_path, monkeypatch):
  """A disk that fills up under the log directory: reported, the trial in progress ends as without it, the sweep stops."""
  path, out, _ = live
  record_writer = pytest.importorskip("tensorboardX.record_writer")
  write, calls = record_writer.RecordWriter.write, []

  def full_disk(self, data):
    calls.append(len(data))
    if len(calls) > 3:  # the file's header, the START event, step 0; then none
      raise OSError(28, "No space left on device")
    return write(self, data)
  monkeypatch.setattr(record_writer.RecordWriter, "write", full_disk)
  log, mine = io.StringIO(), str(tmp_path / "out")
  counts = sweep.run_sweep(config_lib.load(path), mine, config_text=CONFIG, stream=log,
                           tensorboard=str(tmp_path / "logs"))
  assert counts["ok"] == 1 and counts["unfinished"] == 1, counts
  assert counts["fault"].startswith(f"no space left on device (errno ENOSPC) writing {tmp_path / 'logs'}")
  assert log.getvalue().count("warning: TensorBoard: writing step 1 of trial") == 1
  assert "No space left on device" in log.getvalue() and len(calls) == 4  # off for the rest of the sweep
  monkeypatch.undo()  # space again: the same sweep finishes
  assert sweep.run_sweep(config_lib.load(path), mine, config_text=CONFIG, stream=log,
                         tensorboard=str(tmp_path / "logs"))["ok"] == 1
  strip = lambda rows: [{k: v for k, v in r.items() if k != "step_time_s"} for r in rows]
  for a, b in zip(store.iter_trials(out), store.iter_trials(mine), strict=True):
    assert strip(a["rows"]) == strip(b["rows"]) and a["summary"]["final"] == b["summary"]["final"]


def test_without_tensorboardx_the_flag_is_refused_with_the_extra(tmp_path, capsys, monkeypatch):
  monkeypatch.setitem(sys.modules, "tensorboardX", None)  # import tensorboardX raises ImportError
  cfg = tmp_path / "c.toml"
  cfg.write_text(CONFIG)
  for argv in (["sweep", str(cfg), "--out", str(tmp_path / "o"), "--tensorboard", str(tmp_path / "l")],
               ["export", str(tmp_path / "o"), "--tensorboard", str(tmp_path / "l")]):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"attn {argv[0]}: error: --tensorboard=") and 'pip install -e ".[tensorboard]"' in err
  assert os.listdir(tmp_path) == ["c.toml"]  # refused before anything was written


@pytest.mark.slow
def test_each_local_worker_writes_its_own_trials(tmp_path):
  _reader()
  cfg = tmp_path / "c.toml"
  cfg.write_text(CONFIG.replace("seeds = [0]", "seeds = [0, 1]"))
  out, logdir = str(tmp_path / "out"), str(tmp_path / "logs")
  env = {**os.environ, "ATTN_JAX_CACHE": str(tmp_path / "cache"),
         "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
  proc = subprocess.Popen([sys.executable, "-m", "attn", "sweep", str(cfg), "--out", out, "--workers", "2",
                           "--no-report", "--tensorboard", logdir], cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  log = proc.communicate(timeout=600)[0]
  assert proc.returncode == 0, log
  assert_mirrors_store(logdir, out)
  pids = {int(name.rsplit(".", 1)[-1]) for run in os.listdir(logdir) for name in os.listdir(os.path.join(logdir, run))}
  assert pids and proc.pid not in pids  # written by the worker processes, not the parent
