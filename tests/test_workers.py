"""Real processes on one store: two `attn sweep` at once, one of them kill -9'd, SIGTERM/SIGUSR1, --workers 2.

Every store must end with each trial finished once, rows 0..N-1 each once, and
rows equal to those of one uninterrupted `attn sweep` bit for bit (step_time_s
aside): a trial's rows depend only on its config and seed, and each trial is
computed by one process at a time, resuming from a bit-exact checkpoint. Every
process here runs on one CPU (the --workers 2 parent on two, one per worker):
XLA's CPU matmuls split their work by the number of CPUs a process may use,
which changes float32 rounding (measured on configs/quick.toml: 1 CPU against
2 differs within 8 steps, by at most 7.3e-7 relative in the loss). Slow tier:
`python -m pytest -m slow tests/test_workers.py`.
"""

import glob
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from attn.experiments.training import checkpoints
from attn.experiments.running import leases
from attn.experiments.running import store
from attn.experiments.running.workers import cpu_shares
from conftest import TINY_MQAR

CONFIG = TINY_MQAR + """

[train]
steps = 200
batch_size = 2
eval_every = 20
eval_batches = 1

[sweep]
seeds = [0, 1, 2, 3]
"""
STEPS = 200
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPUS = sorted(os.sched_getaffinity(0))


def test_cpu_shares_split_the_cpus():
  assert cpu_shares(2, [0, 1, 2, 3, 4]) == [[0, 1], [2, 3, 4]]
  assert cpu_shares(3, [4, 5, 6, 7, 8, 9]) == [[4, 5], [6, 7], [8, 9]]
  assert cpu_shares(3, [0, 1]) == [[0], [1], [0]]
  assert cpu_shares(1, [0, 1]) == [[0, 1]]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  """(config path, env, reference store): one uninterrupted `attn sweep` of CONFIG."""
  root = tmp_path_factory.mktemp("workers")
  cfg = root / "c.toml"
  cfg.write_text(CONFIG)
  env = {**os.environ, "ATTN_JAX_CACHE": str(root / "cache"),
         "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
  ref = str(root / "ref")
  proc = _sweep(str(cfg), ref, env, cpu=0)
  log = proc.communicate(timeout=600)[0].decode()
  assert proc.returncode == 0, log
  return str(cfg), env, ref


def _attn(cpus, *args):
  """The command running `attn ARGS` on just these CPUs."""
  code = (f"import os, runpy, sys; os.sched_setaffinity(0, {cpus!r}); sys.argv[0] = 'attn'; "
          "runpy.run_module('attn', run_name='__main__')")
  return [sys.executable, "-c", code, *args]


def _sweep(cfg, out, env, *extra, cpu=0):
  return subprocess.Popen(_attn([CPUS[cpu % len(CPUS)]], "sweep", cfg, "--out", out, "--no-report", *extra),
                          cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _rows(out, trial_id):
  rows = store.read_rows(os.path.join(out, "trials", trial_id, store.METRICS))
  return [{k: v for k, v in r.items() if k != "step_time_s"} for r in rows]


def _assert_complete_and_equal(out, ref):
  header = json.load(open(os.path.join(out, "sweep.json")))
  assert len(header["trials"]) == 4
  for t in header["trials"]:
    d = os.path.join(out, "trials", t["id"])
    assert store.read_json(os.path.join(d, store.SUMMARY))["status"] == "ok"
    assert sorted(os.listdir(d)) == [store.CHECKPOINTS, store.CONFIG, store.METRICS, store.SUMMARY]  # no lease
    assert [r["step"] for r in _rows(out, t["id"])] == list(range(STEPS))  # nothing lost, nothing twice
    assert _rows(out, t["id"]) == _rows(ref, t["id"])


def _ran_here(log):
  """How many trials a process trained to the end, from its `done:` line."""
  return int(re.search(r"^done: (\d+) ok, 0 failed", log, re.M).group(1))


def _mid_trial_after_a_checkpoint(out, pid=None):
  """A trial held by pid (any worker if None) that is past its first checkpoint, mid-way."""
  for d in glob.glob(os.path.join(out, "trials", "*")):
    held, _ = leases.read(os.path.join(d, leases.LEASE))
    saved = checkpoints.steps(os.path.join(d, store.CHECKPOINTS))
    partial = os.path.join(d, store.PARTIAL)
    if held and (pid is None or held.get("pid") == pid) and saved and os.path.exists(partial):
      if saved[-1] + 5 < len(store.read_rows(partial)) < STEPS - 60:
        return d
  return None


def _wait_for(condition, proc, timeout=300):
  deadline = time.time() + timeout
  while time.time() < deadline:
    found = condition()
    if found:
      return found
    assert proc.poll() is None, proc.stdout.read().decode()
    time.sleep(0.005)
  raise AssertionError("timed out")


@pytest.mark.slow
def test_two_sweeps_at_once_run_every_trial_once(setup, tmp_path):
  cfg, env, ref = setup
  out = str(tmp_path / "out")
  procs = [_sweep(cfg, out, env, cpu=0), _sweep(cfg, out, env, cpu=1)]
  logs = [p.communicate(timeout=600)[0].decode() for p in procs]
  assert [p.returncode for p in procs] == [0, 0], logs
  assert sum(_ran_here(log) for log in logs) == 4, logs  # each trial trained by one of them
  assert not any("resumes at step" in log or "taken over from" in log for log in logs), logs
  _assert_complete_and_equal(out, ref)


@pytest.mark.slow
def test_a_sweep_killed_mid_trial_is_finished_by_the_other(setup, tmp_path):
  cfg, env, ref = setup
  out = str(tmp_path / "out")
  victim = _sweep(cfg, out, env, "--lease-timeout", "3", cpu=0)
  survivor = _sweep(cfg, out, env, "--lease-timeout", "3", cpu=1)
  trial = _wait_for(lambda: _mid_trial_after_a_checkpoint(out, victim.pid), victim)
  victim.send_signal(signal.SIGSTOP)
  # As if it ran on another machine: the survivor cannot see that its process is gone, only
  # that its heartbeat stopped (a kill -9 on this machine is taken over at once, tested in
  # tests/test_store_leases.py).
  path = os.path.join(trial, leases.LEASE)
  held, mtime = leases.read(path)
  assert held["pid"] == victim.pid
  store.write_json(path, {**held, "host": "elsewhere"})
  os.utime(path, (mtime, mtime))
  victim.send_signal(signal.SIGKILL)
  victim.wait()
  log = survivor.communicate(timeout=600)[0].decode()
  assert survivor.returncode == 0, log
  name = re.escape(f"pid {victim.pid}")
  m = re.search(rf"trial \d/4 \[seed=\d\]: taken over from elsewhere {name}: no heartbeat for (\d+) s", log)
  assert m and int(m.group(1)) >= 3, log
  assert re.search(r"resumes at step [1-9]\d* from " + re.escape(trial), log), log
  _assert_complete_and_equal(out, ref)


@pytest.mark.slow
def test_a_signal_saves_and_exits_then_two_workers_resume_and_match_one(setup, tmp_path):
  pytest.importorskip("submitit")
  cfg, env, ref = setup
  out = str(tmp_path / "out")
  proc = _sweep(cfg, out, env)
  _wait_for(lambda: _mid_trial_after_a_checkpoint(out), proc)
  proc.send_signal(signal.SIGUSR1)  # SIGTERM takes the same path (tests/test_store_leases.py)
  log = proc.communicate(timeout=300)[0].decode()
  assert proc.returncode == 128 + signal.SIGUSR1, log
  m = re.search(r"^SIGUSR1: preempted at step (\d+) of trial (\d)/4 \[seed=\d\]; "
                "re-run the same command to resume$", log, re.M)
  assert m, log
  step, index = int(m.group(1)), int(m.group(2))
  trial = os.path.join(out, "trials", json.load(open(os.path.join(out, "sweep.json")))["trials"][index - 1]["id"])
  assert checkpoints.steps(os.path.join(trial, store.CHECKPOINTS))[-1] == step  # saved at that very step
  assert [r["step"] for r in store.read_rows(os.path.join(trial, store.PARTIAL))] == list(range(step))
  assert not os.path.exists(os.path.join(trial, leases.LEASE))  # released

  proc = subprocess.run(_attn(CPUS[:2], "sweep", cfg, "--out", out, "--workers", "2"),
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr
  assert "2 local workers on CPUs" in proc.stderr and "workers done: 4 trials: 4 ok" in proc.stderr
  assert os.path.exists(os.path.join(out, "report.md")) and f"report: {out}" in proc.stdout
  logs = [open(p).read() for p in glob.glob(os.path.join(out, "local", "*_0_log.err"))]
  assert len(logs) == 2 and sum(_ran_here(log) for log in logs) == 4 - index + 1, logs
  assert sum(f"resumes at step {step} " in log for log in logs) == 1, logs
  _assert_complete_and_equal(out, ref)
