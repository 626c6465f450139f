"""A real `kill -9` of `python -m attn sweep` mid-trial, after a checkpoint, then a rerun.

The rerun resumes the killed trial from its checkpoint; every trial's rows and
final parameters equal those of an uninterrupted run bit for bit, with no row
lost or written twice. Slow tier: `python -m pytest -m slow tests/test_experiments_resume.py`.
"""

import glob
import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from flax import nnx

from attn.experiments.training import checkpoints
from attn.experiments import load_trial
from attn.experiments.running import store
from conftest import TINY_MQAR

CONFIG = TINY_MQAR + """

[train]
steps = 300
batch_size = 2
eval_every = 50
eval_batches = 1

[sweep]
seeds = [0, 1, 2]
vmap_seeds = false
"""
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _sweep(cfg, out, env):
  return subprocess.Popen([sys.executable, "-m", "attn", "sweep", cfg, "--out", out, "--no-report"],
                          cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _mid_trial_after_a_checkpoint(out):
  """True when one trial is finished and another is unfinished, past its first checkpoint."""
  trials = glob.glob(os.path.join(out, "trials", "*"))
  if not any(os.path.exists(os.path.join(t, store.SUMMARY)) for t in trials):
    return False
  for t in trials:
    saved = checkpoints.steps(os.path.join(t, store.CHECKPOINTS))
    partial = os.path.join(t, store.PARTIAL)
    if saved and not os.path.exists(os.path.join(t, store.SUMMARY)) and os.path.exists(partial):
      if len(store.read_rows(partial)) > saved[-1] + 5:
        return True
  return False


def _rows(out, trial_id):
  rows = store.read_rows(os.path.join(out, "trials", trial_id, store.METRICS))
  return [{k: v for k, v in r.items() if k != "step_time_s"} for r in rows]


@pytest.mark.slow
def test_kill_9_mid_trial_then_resume_equals_an_uninterrupted_run(tmp_path):
  cfg, out, ref = tmp_path / "c.toml", str(tmp_path / "out"), str(tmp_path / "ref")
  cfg.write_text(CONFIG)
  env = {**os.environ, "ATTN_JAX_CACHE": str(tmp_path / "cache"),
         "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
  uninterrupted = _sweep(str(cfg), ref, env)
  proc = _sweep(str(cfg), out, env)
  deadline = time.time() + 300
  while time.time() < deadline and not _mid_trial_after_a_checkpoint(out):
    assert proc.poll() is None, proc.stdout.read().decode()
    time.sleep(0.01)
  assert _mid_trial_after_a_checkpoint(out), "the sweep never reached a trial past its first checkpoint"
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  finished = {p: open(p).read() for p in glob.glob(os.path.join(out, "trials", "*", store.SUMMARY))}
  assert finished and glob.glob(os.path.join(out, "trials", "*", store.PARTIAL))

  rerun = _sweep(str(cfg), out, env)
  log = rerun.communicate(timeout=600)[0].decode()
  assert rerun.returncode == 0, log
  assert f"{len(finished)} of 3 trials already finished" in log and "resumes at step" in log, log
  assert "warning" not in log, log
  assert uninterrupted.wait(timeout=600) == 0, uninterrupted.stdout.read().decode()
  for path, text in finished.items():  # what was finished before the kill is untouched
    assert open(path).read() == text
  header = json.load(open(os.path.join(out, "sweep.json")))
  for t in header["trials"]:
    d = os.path.join(out, "trials", t["id"])
    assert json.load(open(os.path.join(d, store.SUMMARY)))["status"] == "ok"
    assert not os.path.exists(os.path.join(d, store.PARTIAL))
    assert [r["step"] for r in _rows(out, t["id"])] == list(range(300))  # nothing lost, nothing twice
    assert _rows(out, t["id"]) == _rows(ref, t["id"])
    assert checkpoints.steps(os.path.join(d, store.CHECKPOINTS)) == [250, 300]
    mine, theirs = (jax.tree.leaves(nnx.state(load_trial(o, t["id"])[0], nnx.Param)) for o in (out, ref))
    for a, b in zip(mine, theirs, strict=True):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
