"""One trial over several processes: refusals by name, the coordinator timeout, real groups of 2 processes.

Fast (this process, and one short subprocess per timeout case): bad
--processes-per-trial, --workers, --coordinator-timeout and --slurm-nodes
input and configs whose batch or mesh cannot be shared over P processes are
refused by name before any store or training; a process whose group does not
connect exits after --coordinator-timeout naming the address it tried.

Slow (real `attn sweep --processes-per-trial 2`): the rows of a 2-process
trial equal the 1-process trial's to rtol 1e-5 (update_norm 2e-3: Adam's
g/(|g| + 1e-8) at gradient entries near 0, as in tests/test_data_parallel.py;
each batch's loss and gradients are summed per process, then across them);
with 2 host devices per process and train.mesh.heads = 2 as well (a 2 × 2 mesh,
each heads pair inside one process, seeds stacked under vmap); a SIGKILL of
either process mid-trial ends the group and leaves the trial unfinished (not
failed) with its rows and checkpoint, and no live writer; SIGUSR1 to the
command makes both processes stop at one step, saved; after either, a re-run
of the command resumes from that checkpoint and ends with every row once.
Run: `python -m pytest -m slow tests/test_multiprocess.py` (120 s for the
file on the 2-core machine, shared with other jobs).
"""

import glob
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from attn import cli
from attn.config import ConfigError
from attn.experiments.running import config as config_lib
from attn.experiments.running import leases
from attn.experiments.running import store
from attn.experiments.training import checkpoints
from conftest import TINY_MQAR

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = TINY_MQAR + """

[train]
steps = 12
batch_size = 4
warmup_steps = 2
eval_every = 4
eval_batches = 1
checkpoint_every = 4

[sweep]
seeds = [0, 1]
"""
RTOL = {"update_norm": 2e-3}  # others: 1e-5


def _refused(tmp_path, capsys, *argv, config=CONFIG):
  cfg = tmp_path / "c.toml"
  cfg.write_text(config)
  out = tmp_path / "out"
  assert cli.main(["sweep", str(cfg), "--out", str(out), *argv]) == 2
  assert not out.exists()  # refused before the store
  return capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--processes-per-trial", "0"], "--processes-per-trial=0 is not allowed: an integer >= 1"),
    (["--processes-per-trial", "-2"], "--processes-per-trial=-2 is not allowed: an integer >= 1"),
    (["--processes-per-trial", "2", "--workers", "2"],
     "--workers=2 is not allowed: 1 with --processes-per-trial 2: the 2 processes of each trial already share "
     "this machine's CPUs; to train trials side by side, start another `attn sweep` on the same --out"),
    (["--processes-per-trial", "2", "--executor", "slurm"],
     "--processes-per-trial=2 is not allowed: left out with --executor slurm: give --slurm-nodes N "
     "--slurm-tasks-per-node T"),
    (["--coordinator-timeout", "0"], "--coordinator-timeout=0.0 is not allowed: a number of seconds > 0"),
    (["--slurm-nodes", "2"], "--slurm-nodes='2' is not allowed: only with --executor slurm"),
    (["--executor", "slurm", "--slurm-tasks-per-node", "0"], "--slurm-tasks-per-node='0' is not allowed: a positive"),
    (["--executor", "slurm", "--slurm-option", "nodes=2"], "--slurm-option='nodes=2' is not allowed: an option "
                                                           "without a --slurm-* flag of its own: use --slurm-nodes"),
    (["--executor", "slurm", "--slurm-option", "ntasks=4"], "an option attn does not set itself (ntasks: a "
                                                            "trial's processes are --slurm-nodes × --slurm-tasks-per-node)"),
])
def test_bad_process_options_are_refused_by_name(tmp_path, capsys, argv, message):
  assert message in _refused(tmp_path, capsys, *argv)


def test_a_batch_that_cannot_be_shared_over_the_processes_is_refused_with_the_numbers(tmp_path, capsys):
  err = _refused(tmp_path, capsys, "--processes-per-trial", "3")
  assert ("train.batch_size=4 is not allowed: a multiple of 3 with 3 processes per trial of 1 device(s) each "
          "(train.mesh.data): each batch is shared over the 3 devices of the trial's processes, and 4 rows leave "
          "1 over; e.g. one of [3, 6]") in err
  err = _refused(tmp_path, capsys, "--processes-per-trial", "2", "--set", "train.grad_accum=4")
  assert ("train.batch_size=4 is not allowed: a multiple of 8 with 2 processes per trial of 1 device(s) each "
          "(train.mesh.data) and 4 micro-batches: each batch is shared over the 2 devices of the trial's "
          "processes, and 1 rows in each of 4 micro-batches (train.grad_accum) leave 1 over") in err
  # On Slurm the nodes' devices are unknown where it submits: the processes alone are checked there.
  sweep = config_lib.loads(CONFIG, "c.toml", ["train.data_parallel=2"])
  with pytest.raises(ConfigError, match=r"train.batch_size=4 is not allowed: a multiple of 8 with 4 processes "
                                        r"per trial of 2 device\(s\) each"):
    config_lib.check_processes(sweep.trials, 4)
  config_lib.check_processes(sweep.trials, 2)


def test_a_mesh_beyond_each_process_devices_and_the_seed_axis_are_refused(tmp_path, capsys):
  n = len(jax.local_devices())
  err = _refused(tmp_path, capsys, "--processes-per-trial", "2", "--set", f"train.mesh.heads={2 * n}",
                 config=CONFIG.replace("num_heads = 2", f"num_heads = {2 * n}"))
  assert (f"train.mesh={{'data': 1, 'heads': {2 * n}}} is not allowed: at most the {n} local cpu device(s) of "
          f"each of the 2 processes of the trial: data × heads = 1 × {2 * n} = {2 * n} devices in each process") in err
  err = _refused(tmp_path, capsys, "--processes-per-trial", "2", "--set", "train.data_parallel_axis=seed",
                 "--set", "sweep.vmap_seeds=true")
  assert ("train.data_parallel_axis='seed' is not allowed: \"batch\" with 2 processes per trial: processes that "
          "train different seeds share no computation") in err


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env(**extra) -> dict:
  return {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra}


@pytest.mark.slow  # end to end, seconds: the slow tier runs it
def test_a_process_that_cannot_reach_its_coordinator_exits_naming_the_address(tmp_path):
  """Process 1 of 2, through the entry point `attn sweep` starts, with nobody at the address; then process 0 alone."""
  address = f"127.0.0.1:{_free_port()}"  # nothing listens there
  spec = {"out": str(tmp_path), "address": address, "processes": 2, "index": 1, "cpus": sorted(os.sched_getaffinity(0)),
          "timeout": 1.5, "lease_timeout": 60.0, "tensorboard": None, "worker": None}
  t0 = time.monotonic()
  p = subprocess.run([sys.executable, "-m", "attn.experiments.running.processes", json.dumps(spec)], cwd=REPO,
                     env=_env(), capture_output=True, text=True, timeout=60)
  took = time.monotonic() - t0
  assert p.returncode == 3, p.stderr[-2000:]
  assert (f"attn: error: process 1 of 2 could not reach its coordinator at {address} within 1.5 s; is process 0 "
          "running there, and is that address reachable from this host? (the timeout is --coordinator-timeout)") \
      in p.stderr, p.stderr[-2000:]
  assert took < 10, took
  code = ("from attn.experiments.training import distributed as d; "
          f"d.connect(d.Group('127.0.0.1:{_free_port()}', 3, 0, 1.0))")
  p = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=60)
  assert p.returncode == 3 and "process 0 of 3 (the coordinator, listening at 127.0.0.1:" in p.stderr, p.stderr
  assert "waited 1 s for the other 2 processes to connect" in p.stderr


# --- real groups of processes (slow) ----------------------------------------------------------

def _attn(*args, env, **kw):
  return subprocess.run([sys.executable, "-m", "attn", *args], cwd=REPO, env=env, capture_output=True, text=True,
                        timeout=900, **kw)


def _rows(out, trial_id):
  return store.read_rows(os.path.join(out, "trials", trial_id, store.METRICS))


def _assert_rows_close(out, ref, steps):
  for t in store.load_sweep(ref)["trials"]:
    mine, theirs = _rows(out, t["id"]), _rows(ref, t["id"])
    assert [r["step"] for r in mine] == list(range(steps))  # every row once
    assert [r["step"] for r in theirs] == list(range(steps))
    for r, e in zip(mine, theirs):
      assert r.keys() == e.keys()
      for k in r:
        if k != "step_time_s":
          np.testing.assert_allclose(r[k], e[k], rtol=RTOL.get(k, 1e-5), err_msg=f"{k} at step {r['step']}")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
  return _env(ATTN_JAX_CACHE=str(tmp_path_factory.mktemp("cache")))


@pytest.mark.slow
def test_two_processes_give_the_one_process_rows(tmp_path, env):
  cfg = tmp_path / "c.toml"
  cfg.write_text(CONFIG)
  ref, two = str(tmp_path / "ref"), str(tmp_path / "two")
  p = _attn("sweep", str(cfg), "--out", ref, "--no-report", env=env)
  assert p.returncode == 0, p.stderr
  p = _attn("sweep", str(cfg), "--out", two, "--processes-per-trial", "2", env=env)
  assert p.returncode == 0, p.stderr
  assert "2 processes per trial, coordinator 127.0.0.1:" in p.stderr and "processes done: 2 trials: 2 ok" in p.stderr
  assert f"report: {two}" in p.stdout
  _assert_rows_close(two, ref, 12)
  for t in store.load_sweep(two)["trials"]:
    d = os.path.join(two, "trials", t["id"])
    summary = store.read_json(os.path.join(d, store.SUMMARY))
    assert summary["processes"] == 2 and summary["mesh"] == {"data": 2, "heads": 1}
    assert checkpoints.steps(os.path.join(d, store.CHECKPOINTS)) == [8, 12]  # written by process 0
    assert not os.path.exists(os.path.join(d, leases.LEASE))
  logs = sorted(glob.glob(os.path.join(two, "local", "processes-*", "process_*.log")))
  assert len(logs) == 2
  follower = open(logs[1]).read()
  assert len(re.findall(r"^process 1 of 2: trial \w+ \[seed=\d\]$", follower, re.M)) == 2, follower
  assert "done: process 0 has no more trials" in follower


@pytest.mark.slow
def test_heads_inside_each_process_and_seeds_under_vmap_give_the_one_process_rows(tmp_path, env):
  """2 processes × 2 host devices: a (data 2, heads 2) mesh, each heads pair in one process; seeds stacked."""
  cfg = tmp_path / "c.toml"
  # No biases: the key bias drops out of the softmax, so its gradient is float noise that Adam's
  # g/(|g| + 1e-8) turns into updates of its own, and its values would differ by more than tolerance.
  cfg.write_text(CONFIG.replace("d_ff = 16", "d_ff = 16\nuse_bias = false") + "vmap_seeds = true\n")
  ref, two = str(tmp_path / "ref"), str(tmp_path / "two")
  p = _attn("sweep", str(cfg), "--out", ref, "--no-report", env=env)
  assert p.returncode == 0, p.stderr
  forced = {**env, "XLA_FLAGS": env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"}
  p = _attn("sweep", str(cfg), "--out", two, "--no-report", "--processes-per-trial", "2",
            "--set", "train.mesh.heads=2", env=forced)
  assert p.returncode == 0, p.stderr
  _assert_rows_close(two, ref, 12)
  from flax import nnx
  from attn.experiments import load_trial
  for t in store.load_sweep(two)["trials"]:
    summary = store.read_json(os.path.join(two, "trials", t["id"], store.SUMMARY))
    assert summary["mesh"] == {"data": 2, "heads": 2} and summary["group_size"] == 2
    # Process 0 saved the heads-split parameters whole, from its own shards.
    mine, theirs = (nnx.state(load_trial(d, t["id"])[0], nnx.Param) for d in (two, ref))
    for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(theirs)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


KILL_CONFIG = TINY_MQAR + """

[train]
steps = 160
batch_size = 2
eval_every = 40
eval_batches = 1
checkpoint_every = 10
"""
KILL_STEPS = 160


def _mid_trial_after_a_checkpoint(out):
  for d in glob.glob(os.path.join(out, "trials", "*")):
    saved = checkpoints.steps(os.path.join(d, store.CHECKPOINTS))
    partial = os.path.join(d, store.PARTIAL)
    if saved and os.path.exists(partial) and saved[-1] + 5 < len(store.read_rows(partial)) < KILL_STEPS - 40:
      return d
  return None


@pytest.fixture(scope="module")
def kill_setup(tmp_path_factory, env):
  """(config, the store of one uninterrupted 1-process run of it)."""
  root = tmp_path_factory.mktemp("kill")
  cfg = root / "c.toml"
  cfg.write_text(KILL_CONFIG)
  ref = str(root / "ref")
  p = _attn("sweep", str(cfg), "--out", ref, "--no-report", env=env)
  assert p.returncode == 0, p.stderr
  return str(cfg), ref


def _start_mid_trial(cfg, out, env, log):
  """A 2-process `attn sweep` (its output to `log`) and its trial's directory, once a few steps past a checkpoint."""
  with open(log, "w") as f:
    launcher = subprocess.Popen([sys.executable, "-m", "attn", "sweep", cfg, "--out", out, "--no-report",
                                 "--processes-per-trial", "2"], cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
  deadline = time.time() + 300
  while (trial := _mid_trial_after_a_checkpoint(out)) is None:
    assert launcher.poll() is None and time.time() < deadline, log.read_text()
    time.sleep(0.01)
  return launcher, trial


def _logs(out):
  """The newest group's log of each process."""
  newest = max(glob.glob(os.path.join(out, "local", "processes-*")), key=os.path.getmtime)
  return [open(os.path.join(newest, f"process_{k}.log")).read() for k in range(2)]


def _rerun_resumes(cfg, out, env, ref, trial, step):
  p = _attn("sweep", cfg, "--out", out, "--no-report", "--processes-per-trial", "2", env=env)
  assert p.returncode == 0, p.stderr
  leader = _logs(out)[0]
  assert re.findall(r"resumes at step (\d+) from", leader) == [str(step)], leader
  assert store.read_json(os.path.join(trial, store.SUMMARY))["status"] == "ok"
  assert not os.path.exists(os.path.join(trial, leases.LEASE))
  _assert_rows_close(out, ref, KILL_STEPS)


@pytest.mark.slow
@pytest.mark.parametrize("victim", [1, 0], ids=["follower", "leader"])
def test_a_sigkilled_process_leaves_a_trial_that_a_rerun_resumes(kill_setup, tmp_path, env, victim):
  cfg, ref = kill_setup
  out, log = str(tmp_path / "out"), tmp_path / "launcher.log"
  launcher, trial = _start_mid_trial(cfg, out, env, log)
  pid = int(re.search(rf"process {victim} pid (\d+)", log.read_text()).group(1))
  os.kill(pid, signal.SIGKILL)
  assert launcher.wait(timeout=120) == 1, log.read_text()
  text = log.read_text()
  assert f"process {victim} of 2: killed by SIGKILL" in text, text
  assert "re-run the same command to resume" in text and "1 trials unfinished" in text, text
  if victim == 0:  # the lease names a process of this machine that is gone: shown as interrupted, and why
    assert "interrupted: trial 1/1" in text and f"pid {pid} " in text and "is gone: killed" in text, text
  assert not os.path.exists(os.path.join(trial, store.SUMMARY))  # unfinished, not failed
  held, _ = leases.read(os.path.join(trial, leases.LEASE))
  assert held is None or leases.gone(held)  # released, or its process is gone: no writer left
  saved = checkpoints.steps(os.path.join(trial, store.CHECKPOINTS))[-1]
  assert 0 < saved < KILL_STEPS
  _rerun_resumes(cfg, out, env, ref, trial, saved)


@pytest.mark.slow
def test_a_signal_saves_every_process_at_one_step_and_a_rerun_resumes(kill_setup, tmp_path, env):
  cfg, ref = kill_setup
  out, log = str(tmp_path / "out"), tmp_path / "launcher.log"
  launcher, trial = _start_mid_trial(cfg, out, env, log)
  launcher.send_signal(signal.SIGUSR1)  # passed on to both processes
  assert launcher.wait(timeout=120) == 128 + signal.SIGUSR1, log.read_text()
  assert "SIGUSR1: the processes saved their trial and stopped; re-run the same command" in log.read_text()
  leader, follower = _logs(out)
  step = int(re.search(r"^SIGUSR1: preempted at step (\d+) of trial 1/1 \[\]; re-run", leader, re.M).group(1))
  assert f"stopped at step {step} (preempted; process 0 saved it)" in follower, follower
  assert checkpoints.steps(os.path.join(trial, store.CHECKPOINTS))[-1] == step  # saved at that very step
  assert [r["step"] for r in store.read_rows(os.path.join(trial, store.PARTIAL))] == list(range(step))
  assert not os.path.exists(os.path.join(trial, leases.LEASE))  # released
  _rerun_resumes(cfg, out, env, ref, trial, step)
