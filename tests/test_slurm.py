"""`attn sweep --executor slurm` against a real Slurm: a 4-trial job array; tasks preempted by USR1 and SIGTERM.

The `slurm` tests need submitit, sbatch and a responding node (`sudo scripts/slurm-local start`
makes a one-node cluster here); without them they skip, saying which. The store must end with
each trial finished once, rows 0..N-1 each once, and after a USR1 requeue and a SIGTERM plus a
re-run of the command, rows equal bit for bit (step_time_s aside) to those of the untouched
array, whose tasks saw the same environment. Run: `python -m pytest -m slurm tests/test_slurm.py`
(94 s on the 2-core machine, shared with other jobs). The option checks at the top need no cluster.
A trial over one job of two tasks (--slurm-nodes 1 --slurm-tasks-per-node 2, one process each)
must give the rows of the untouched array's one-process trial to float32 tolerance, task 0
alone writing the store; one preempted by USR1 saves on both tasks at one step, is requeued and
resumes with every row once."""

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

from attn import cli
from attn.config import ConfigError
from attn.experiments.training import checkpoints
from attn.experiments.running import leases
from attn.experiments.running import slurm
from attn.experiments.running import store
from attn.experiments import cli as sweep_cli
from conftest import TINY_MQAR

CONFIG = TINY_MQAR + """

[train]
steps = 300
batch_size = 2
eval_every = 50
eval_batches = 1
checkpoint_every = 25

[sweep]
seeds = [0, 1]
[sweep.grid]
"model.num_heads" = [1, 2]
"""
STEPS, TRIALS = 300, 4
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _args(*argv: str) -> argparse.Namespace:
  p = argparse.ArgumentParser()
  sweep_cli.add_arguments(p)
  return p.parse_args(["c.toml", "--executor", "slurm", *argv])


@pytest.mark.parametrize("argv, name, allowed", [
    (["--slurm-option", "mem"], "--slurm-option", "KEY=VALUE"),
    (["--slurm-option", "mem=lots"], "--slurm-option", "mem=SIZE"),
    (["--slurm-option", "mail-type=SOMETIMES"], "--slurm-option", "mail-type="),
    (["--slurm-option", "Bad Key=1"], "--slurm-option", "sbatch long option name"),
    (["--slurm-option", "partition=gpu"], "--slurm-option", "use --slurm-partition"),
    (["--slurm-option", "output=x.log"], "--slurm-option", "does not set itself"),
    (["--slurm-option", "signal=USR2@60"], "--slurm-option", "does not set itself"),
    (["--slurm-option", "qos=a", "--slurm-option", "qos=b"], "--slurm-option", "each KEY once"),
    (["--slurm-time", "1:2:3:4"], "--slurm-time", "[D-]HH:MM[:SS]"),
    (["--slurm-time", "00:00"], "--slurm-time", "above zero"),
    (["--slurm-cpus-per-task", "0"], "--slurm-cpus-per-task", "positive integer"),
    (["--slurm-array-parallelism", "two"], "--slurm-array-parallelism", "positive integer"),
    (["--slurm-partition", "a b"], "--slurm-partition", "partition name"),
])
def test_bad_slurm_options_are_refused_by_name(argv, name, allowed):
  with pytest.raises(ConfigError) as e:
    slurm.check_args(_args(*argv))
  assert str(e.value).startswith(f"{name}=") and allowed in str(e.value), str(e.value)


def test_slurm_options_map_to_submitit_parameters():
  params = slurm.check_args(_args("--slurm-time", "1-00:00:30", "--slurm-partition", "gpu,cpu",
                                  "--slurm-option", "mem_per_cpu=2G", "--slurm-option", "exclusive",
                                  "--slurm-array-parallelism", "3", "--slurm-gpus-per-task", "1"))
  assert params == {"time": 24 * 60 + 1, "partition": "gpu,cpu", "gpus_per_task": 1, "array_parallelism": 3,
                    "additional_parameters": {"mem-per-cpu": "2G", "exclusive": True}}
  assert slurm.check_args(_args())["time"] == slurm.DEFAULT_TIME_MIN
  assert [slurm.minutes("t", v) for v in ("90", "1:30", "02:00:01", "2-1")] == [90, 2, 121, 2940]


def test_the_cli_refuses_before_touching_the_store(tmp_path, capsys, monkeypatch):
  out = tmp_path / "out"
  assert cli.main(["sweep", "none.toml", "--out", str(out), "--slurm-partition", "gpu"]) == 2
  assert "--slurm-partition='gpu' is not allowed: only with --executor slurm" in capsys.readouterr().err
  assert cli.main(["sweep", "none.toml", "--out", str(out), "--executor", "slurm",
                   "--slurm-option", "mem"]) == 2
  assert "attn sweep: error: --slurm-option='mem' is not allowed" in capsys.readouterr().err
  assert not out.exists()
  monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch here
  with pytest.raises(ConfigError, match="sbatch and srun are on PATH.*scripts/slurm-local start"):
    slurm.submit(None, str(out), _args())


# ---- against a real cluster ----

def _cluster_problem() -> str | None:
  if shutil.which("sbatch") is None:
    return "sbatch is not on PATH (a one-node cluster: sudo scripts/slurm-local start)"
  try:
    states = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=20).stdout.split()
  except (OSError, subprocess.TimeoutExpired) as e:
    return f"sinfo does not answer ({e})"
  if not any(s in ("idle", "mixed", "allocated", "completing") for s in states):
    return f"sinfo shows no responding node (states: {states or 'none'}; try scripts/slurm-local start)"
  return None


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  """(config path, env, uninterrupted store, its job id): CONFIG run as one Slurm job array, untouched."""
  pytest.importorskip("submitit")
  problem = _cluster_problem()
  if problem:
    pytest.skip(problem)
  root = tmp_path_factory.mktemp("slurm")
  cfg = root / "c.toml"
  cfg.write_text(CONFIG)
  env = {**os.environ, "ATTN_JAX_CACHE": str(root / "cache"),
         "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
  ref = str(root / "ref")
  job = _submit(str(cfg), ref, env)
  _wait_done(ref, job)
  return str(cfg), env, ref, job


def _submit(cfg: str, out: str, env: dict, *extra: str) -> str:
  p = subprocess.run([sys.executable, "-m", "attn", "sweep", cfg, "--out", out, "--executor", "slurm",
                      "--slurm-time", "30", *extra], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
  assert p.returncode == 0, p.stderr
  assert f"watch: attn status {out}" in p.stdout and f"{out}/slurm/" in p.stdout
  return re.search(r"submitted Slurm job (\d+): \d+ tasks?", p.stdout).group(1)


def _logs(out: str) -> str:
  return "\n".join(f"--- {f}\n" + open(f).read()[-3000:] for f in sorted(glob.glob(f"{out}/slurm/*/*_log.*")))


def _wait_done(out: str, job: str, trials: int = TRIALS, timeout: float = 600) -> None:
  """Until the job has left the queue, with `trials` trials finished."""
  deadline = time.time() + timeout
  while time.time() < deadline:
    queued = subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True).stdout.strip()
    done = len(glob.glob(os.path.join(out, "trials", "*", store.SUMMARY)))
    if not queued:
      assert done == trials, f"job {job} left the queue with {done} trials done, not {trials}\n{_logs(out)}"
      return
    time.sleep(1)
  subprocess.run(["scancel", job])
  raise AssertionError(f"job {job} not done after {timeout} s\n{_logs(out)}")


def _rows(root: str, trial_id: str) -> list[dict]:
  rows = store.read_rows(os.path.join(root, "trials", trial_id, store.METRICS))
  return [{k: v for k, v in r.items() if k != "step_time_s"} for r in rows]


@pytest.mark.slurm
def test_a_job_array_runs_every_trial_once(setup):
  _, env, ref, job = setup
  ids = [t["id"] for t in store.load_sweep(ref)["trials"]]
  assert len(ids) == TRIALS
  for i in ids:
    assert store.read_json(os.path.join(ref, "trials", i, store.SUMMARY))["status"] == "ok"
    assert [r["step"] for r in _rows(ref, i)] == list(range(STEPS))  # every row once, in order
    assert not os.path.exists(os.path.join(ref, "trials", i, leases.LEASE))
  assert len(glob.glob(f"{ref}/slurm/{job}_*/{job}_*_0_log.out")) == TRIALS  # one log per task
  status = subprocess.run([sys.executable, "-m", "attn", "status", ref], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
  assert status.returncode == 0 and f"{TRIALS} ok" in status.stdout, status.stdout + status.stderr


def _running_past_a_checkpoint(out: str, but: str | None = None) -> tuple[str, str]:
  """(trial id, its array task) of a trial (not `but`) training a few steps past a checkpoint, well before its end.

  "Well before": half its steps left, for the signal to land before the trial ends (a fast CPU
  trains the tiny model's remaining steps in well under a second)."""
  deadline = time.time() + 300
  while time.time() < deadline:
    for d in glob.glob(os.path.join(out, "trials", "*")):
      try:
        job = store.read_json(os.path.join(d, leases.LEASE))["job_id"]
        rows = len(store.read_rows(os.path.join(d, store.PARTIAL)))
      except (OSError, ValueError, KeyError):
        continue
      saved = checkpoints.steps(os.path.join(d, store.CHECKPOINTS))
      if os.path.basename(d) != but and job and saved and saved[-1] + 3 < rows < STEPS // 2:
        return os.path.basename(d), job
    time.sleep(0.05)
  raise AssertionError(f"no trial got past a checkpoint\n{_logs(out)}")


def _log(out: str, task: str, ext: str) -> str:
  with open(f"{out}/slurm/{task}/{task}_0_log.{ext}") as f:
    return f.read()


@pytest.mark.slurm
def test_preempted_tasks_resume_from_their_checkpoints(setup, tmp_path):
  """USR1 requeues a task, which resumes; SIGTERM saves and ends one, and re-running the command finishes it."""
  cfg, env, ref, _ = setup
  out = str(tmp_path / "out")
  job = _submit(cfg, out, env)
  usr1_trial, usr1_task = _running_past_a_checkpoint(out)
  # Signal the task's step 0 (its srun): `scancel --signal=USR1 TASK` on an array with pending
  # tasks gets "Job can not be altered now" from slurmctld 22.05, and scancel retries until the
  # requeued task runs again and signals that run too.
  subprocess.run(["scancel", "--signal=USR1", f"{usr1_task}.0"], check=True, timeout=30)
  term_trial, term_task = _running_past_a_checkpoint(out, but=usr1_trial)
  subprocess.run(["scancel", term_task], check=True, timeout=30)  # SIGTERM, as at a time limit
  _wait_done(out, job, trials=TRIALS - 1)
  assert "attn: SIGTERM: saving" in _log(out, term_task, "err")
  rerun = _submit(cfg, out, env)  # the same command again: the SIGTERM'd trial only
  _wait_done(out, rerun)

  for t in store.load_sweep(ref)["trials"]:  # every row once, equal to the uninterrupted run's
    assert store.read_json(os.path.join(out, "trials", t["id"], store.SUMMARY))["status"] == "ok"
    assert [r["step"] for r in _rows(out, t["id"])] == list(range(STEPS))
    assert _rows(out, t["id"]) == _rows(ref, t["id"])
    assert not os.path.exists(os.path.join(out, "trials", t["id"], leases.LEASE))
  log_out = _log(out, usr1_task, "out")
  assert "Caught signal SIGUSR1" in log_out and f"Requeued job {usr1_task}" in log_out, log_out
  shown = subprocess.run(["scontrol", "show", "job", usr1_task], capture_output=True, text=True).stdout
  assert int(re.search(r"Restarts=(\d+)", shown).group(1)) >= 1, shown
  for trial, log in ((usr1_trial, _log(out, usr1_task, "err")), (term_trial, _log(out, rerun, "err"))):
    resumed = re.findall(r"resumes at step (\d+) from (\S+)", log)
    assert len(resumed) == 1 and int(resumed[0][0]) > 0 and trial in resumed[0][1], log


@pytest.mark.slurm
def test_a_trial_over_two_tasks_gives_the_one_process_rows(setup, tmp_path):
  """One array task of 1 node × 2 tasks trains one trial as one program; task 0 writes, task 1 follows."""
  cfg, env, ref, _ = setup
  out = str(tmp_path / "out")
  # One trial of the sweep (the same id as in `ref`): pinning swept keys drops their axes.
  job = _submit(cfg, out, env, "--slurm-nodes", "1", "--slurm-tasks-per-node", "2",
                "--set", "seed=0", "--set", "model.num_heads=2")
  _wait_done(out, job, trials=1)
  (trial,) = [t["id"] for t in store.load_sweep(out)["trials"]]
  summary = store.read_json(os.path.join(out, "trials", trial, store.SUMMARY))
  assert summary["status"] == "ok" and summary["processes"] == 2 and summary["mesh"] == {"data": 2, "heads": 1}
  mine, theirs = _rows(out, trial), _rows(ref, trial)
  assert [r["step"] for r in mine] == [r["step"] for r in theirs] == list(range(STEPS))
  for r, e in zip(mine, theirs):
    for k in r:  # update_norm: Adam's g/(|g| + 1e-8) at gradient entries near 0 (tests/test_data_parallel.py)
      np.testing.assert_allclose(r[k], e[k], rtol=2e-3 if k == "update_norm" else 1e-5, err_msg=f"{k} at {r['step']}")
  (leader,) = glob.glob(f"{out}/slurm/{job}*/*_0_log.err")  # one job (submitit submits no array for one task)
  follower = open(leader.replace("_0_log.err", "_1_log.err")).read()  # Slurm task 1's log
  assert f"process 1 of 2: trial {trial} [" in follower and "done: process 0 has no more trials" in follower, follower
  assert "resumes at step" not in open(leader).read()
  assert not os.path.exists(os.path.join(out, "trials", trial, leases.LEASE))


@pytest.mark.slurm
def test_a_two_task_trial_preempted_by_usr1_is_requeued_and_resumes(setup, tmp_path):
  """USR1 reaches both tasks: they save at one step (task 0 writes), submitit requeues the job, it resumes."""
  cfg, env, ref, _ = setup
  out = str(tmp_path / "out")
  job = _submit(cfg, out, env, "--slurm-nodes", "1", "--slurm-tasks-per-node", "2",
                "--set", "seed=1", "--set", "model.num_heads=2")
  trial, held_by = _running_past_a_checkpoint(out)
  assert held_by == f"{job}.0"  # the lease of task 0 (leases.job_id: .PROCID with several tasks)
  subprocess.run(["scancel", "--signal=USR1", f"{job}.0"], check=True, timeout=30)  # every task of step 0
  _wait_done(out, job, trials=1)
  mine, theirs = _rows(out, trial), _rows(ref, trial)
  assert [r["step"] for r in mine] == [r["step"] for r in theirs] == list(range(STEPS))  # every row once
  for r, e in zip(mine, theirs):
    for k in r:
      np.testing.assert_allclose(r[k], e[k], rtol=2e-3 if k == "update_norm" else 1e-5, err_msg=f"{k} at {r['step']}")
  (leader,) = glob.glob(f"{out}/slurm/{job}*/*_0_log.err")
  log, follower = open(leader).read(), open(leader.replace("_0_log.err", "_1_log.err")).read()
  step = re.search(r"saved at step (\d+) and stopped \(preempted\)", log).group(1)
  assert f"stopped at step {step} (preempted; process 0 saved it)" in follower, follower
  assert re.findall(r"resumes at step (\d+) from", log) == [step], log
  shown = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
  assert int(re.search(r"Restarts=(\d+)", shown).group(1)) == 1, shown
  summary = store.read_json(os.path.join(out, "trials", trial, store.SUMMARY))
  assert summary["processes"] == 2 and summary["resumed_from"] == int(step)
