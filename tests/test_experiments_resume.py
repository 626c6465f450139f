"""A real `kill -9` of a running `python -m attn sweep`, then a rerun: nothing lost, nothing twice."""

import glob
import json
import os
import signal
import subprocess
import sys
import time

from attn.experiments import store

CONFIG = """
[task]
name = "mqar"
vocab_size = 16
seq_len = 12
num_pairs = 2

[model]
d_model = 16
num_layers = 1
num_heads = 2
d_ff = 16

[train]
steps = 400
batch_size = 2
eval_every = 100
eval_batches = 1

[sweep]
seeds = [0, 1, 2]
vmap_seeds = false
"""
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _sweep(cfg, out, env):
  return subprocess.Popen([sys.executable, "-m", "attn", "sweep", cfg, "--out", out, "--no-report"],
                          cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _partial_rows(out):
  rows = 0
  for path in glob.glob(os.path.join(out, "trials", "*", store.PARTIAL)):
    with open(path) as f:
      rows += sum(1 for _ in f)
  return rows


def test_kill_9_mid_trial_then_resume(tmp_path):
  cfg, out = tmp_path / "c.toml", str(tmp_path / "out")
  cfg.write_text(CONFIG)
  env = {**os.environ, "ATTN_JAX_CACHE": str(tmp_path / "cache"),
         "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
  proc = _sweep(str(cfg), out, env)
  deadline = time.time() + 120
  while time.time() < deadline:  # one trial finished and another part-way through
    done = glob.glob(os.path.join(out, "trials", "*", store.SUMMARY))
    if done and _partial_rows(out) >= 5:
      break
    assert proc.poll() is None, proc.stdout.read().decode()
    time.sleep(0.01)
  else:
    raise AssertionError("the sweep never reached a finished trial plus a partial one")
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  finished = {p: open(p).read() for p in glob.glob(os.path.join(out, "trials", "*", "*.json*"))
              if not p.endswith(store.PARTIAL) and "config.json" not in p and ".tmp." not in p}
  assert finished and glob.glob(os.path.join(out, "trials", "*", store.PARTIAL))

  rerun = _sweep(str(cfg), out, env)
  log = rerun.communicate(timeout=300)[0].decode()
  assert rerun.returncode == 0, log
  assert "resuming" in log and f"{len(finished) // 2} of 3 trials already finished" in log
  for path, text in finished.items():  # what was finished before the kill is untouched
    assert open(path).read() == text
  header = json.load(open(os.path.join(out, "sweep.json")))
  assert len(header["trials"]) == 3
  for t in header["trials"]:
    d = os.path.join(out, "trials", t["id"])
    assert json.load(open(os.path.join(d, store.SUMMARY)))["status"] == "ok"
    steps = [r["step"] for r in store.read_rows(os.path.join(d, store.METRICS))]
    assert steps == list(range(400))  # contiguous and unique: nothing lost, nothing twice
    assert not os.path.exists(os.path.join(d, store.PARTIAL))
