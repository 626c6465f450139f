"""Leases, the concurrent claim, preemption by signal and `attn status`, on tiny hand-made stores.

No training here: the real processes (two `attn sweep` at once, kill -9, SIGTERM)
are in tests/test_workers.py, slow tier.
"""

import io
import json
import os
import re
import signal
import subprocess
import threading
import time

import pytest

from attn import cli
from attn.config import ConfigError
from attn.experiments.running import leases
from attn.experiments.training import preempt
from attn.experiments.running import status
from attn.experiments.running import store


def _write_lease(trial_dir, age=0.0, **fields):
  """A lease of another worker (token `theirs`), its heartbeat `age` seconds old."""
  path = os.path.join(trial_dir, leases.LEASE)
  held = {"token": "theirs", "host": "nodeA", "pid": 4242, "job_id": None, "worker": None,
          "started": time.time() - age, **fields}
  with open(path, "w") as f:
    json.dump(held, f)
  os.utime(path, (time.time() - age, time.time() - age))
  return path


def _files(d):
  return sorted(os.listdir(d))


@pytest.fixture(autouse=True)
def _no_slurm(monkeypatch):
  for k in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_NTASKS", "SLURM_PROCID"):
    monkeypatch.delenv(k, raising=False)


def test_a_held_lease_is_refused_released_then_taken(tmp_path):
  d = str(tmp_path)
  mine = leases.acquire(d, timeout=30, worker="w1")
  held, _ = leases.read(os.path.join(d, leases.LEASE))
  assert held["token"] == mine.token and held["pid"] == os.getpid() and held["worker"] == "w1"
  assert held["job_id"] is None and set(held) == {"token", "host", "pid", "pidns", "job_id", "worker", "started"}
  assert leases.acquire(d, timeout=30) is None
  mine.release()
  assert _files(d) == []
  again = leases.acquire(d, timeout=30)
  assert again is not None and again.took_over is None
  again.release()


def _eventually(condition, seconds=10.0):
  deadline = time.time() + seconds
  while not condition() and time.time() < deadline:
    time.sleep(0.01)
  return condition()


def test_the_heartbeat_refreshes_and_notices_a_takeover(tmp_path):
  d = str(tmp_path)
  mine = leases.acquire(d, timeout=0.4)  # heartbeat every 0.1 s
  path = os.path.join(d, leases.LEASE)
  os.utime(path, (0, 0))
  assert _eventually(lambda: os.stat(path).st_mtime > time.time() - 60) and mine.lost is None
  tmp = path + ".other"
  with open(tmp, "w") as f:
    json.dump({"token": "theirs", "host": "nodeB", "pid": 7}, f)
  os.replace(tmp, path)  # another worker's lease now
  assert _eventually(lambda: mine.lost is not None)
  assert "taken over by nodeB pid 7" in mine.lost
  with pytest.raises(leases.LeaseLost):
    mine.check()
  mine.release()  # never removes another's lease
  assert leases.read(path)[0]["token"] == "theirs"


def test_a_holder_past_half_the_timeout_checks_before_writing(tmp_path):
  st = store.Store(str(tmp_path))
  os.makedirs(st.trial_dir("t"))
  lease = st.lease("t", timeout=30)  # no heartbeat within this test
  st.start("t")
  st.append("t", {"step": 0})
  lease._confirmed -= 20  # as after a 20 s pause (SIGSTOP, swap)
  os.remove(os.path.join(st.trial_dir("t"), leases.LEASE))  # ... during which it was taken over
  with pytest.raises(leases.LeaseLost, match="was removed"):
    st.append("t", {"step": 1})
  with pytest.raises(leases.LeaseLost):
    st.finish("t", {"status": "ok"})
  assert not os.path.exists(os.path.join(st.trial_dir("t"), store.SUMMARY))
  assert store.read_rows(os.path.join(st.trial_dir("t"), store.PARTIAL)) == [{"step": 0}]
  st.close()


def test_a_stale_lease_is_taken_over_a_fresh_one_is_not(tmp_path):
  d = str(tmp_path)
  _write_lease(d, age=5)
  assert leases.acquire(d, timeout=30) is None
  _write_lease(d, age=45)
  mine = leases.acquire(d, timeout=30)
  assert mine.took_over["pid"] == 4242 and mine.took_over["reason"] == "no heartbeat for 45 s"
  assert _files(d) == [leases.LEASE]
  mine.release()


def test_the_lease_of_a_dead_process_on_this_machine_is_taken_at_once(tmp_path):
  d = str(tmp_path)
  mine = leases.acquire(d, timeout=30)
  me = leases.read(os.path.join(d, leases.LEASE))[0]
  mine.release()
  dead = subprocess.Popen(["true"])
  dead.wait()  # exited and reaped: its pid names no process
  _write_lease(d, age=0, host=me["host"], pidns=me["pidns"], pid=os.getpid())
  assert leases.acquire(d, timeout=30) is None  # alive (this process)
  _write_lease(d, age=0, host="elsewhere", pidns=me["pidns"], pid=dead.pid)
  assert leases.acquire(d, timeout=30) is None  # another machine's pid says nothing here
  _write_lease(d, age=0, host=me["host"], pidns="another boot or container", pid=dead.pid)
  assert leases.acquire(d, timeout=30) is None
  _write_lease(d, age=0, host=me["host"], pidns=me["pidns"], pid=dead.pid)
  taken = leases.acquire(d, timeout=30)
  assert taken.took_over["pid"] == dead.pid and taken.took_over["reason"] == "its process is gone"
  taken.release()


def test_the_same_slurm_job_takes_its_own_lease_at_once(tmp_path, monkeypatch):
  d = str(tmp_path)
  monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "77")
  monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
  _write_lease(d, age=0, job_id="77_4")
  assert leases.acquire(d, timeout=30) is None  # another task of the array
  _write_lease(d, age=0, job_id="77_3")
  mine = leases.acquire(d, timeout=30)  # this task, requeued
  assert mine is not None and mine.took_over["job_id"] == "77_3"
  assert leases.read(os.path.join(d, leases.LEASE))[0]["job_id"] == "77_3"
  mine.release()
  monkeypatch.setenv("SLURM_NTASKS", "2")
  monkeypatch.setenv("SLURM_PROCID", "1")
  assert leases.job_id() == "77_3.1"


@pytest.mark.parametrize("age", [None, 100.0])
def test_of_many_takers_exactly_one_wins(tmp_path, age):
  for round_ in range(8):
    d = str(tmp_path / str(round_))
    os.makedirs(d)
    if age is not None:
      _write_lease(d, age=age)
    barrier, won = threading.Barrier(6), []

    def take():
      barrier.wait()
      lease = leases.acquire(d, timeout=30)
      if lease is not None:
        won.append(lease)
    threads = [threading.Thread(target=take) for _ in range(6)]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    assert len(won) == 1, f"round {round_}: {len(won)} winners"
    assert leases.read(os.path.join(d, leases.LEASE))[0]["token"] == won[0].token
    assert _files(d) == [leases.LEASE]  # no temporary or moved-aside file left
    won[0].release()


def test_a_takeover_guard_left_by_a_dead_taker_blocks_once_then_goes(tmp_path):
  d = str(tmp_path)
  _write_lease(d, age=100.0)
  guard = os.path.join(d, leases.LEASE + ".takeover.theirs")
  with open(guard, "w") as f:
    f.write("dead\n")
  assert leases.acquire(d, timeout=30) is None  # a fresh guard would mean a taker at work
  os.utime(guard, (time.time() - 100, time.time() - 100))
  assert leases.acquire(d, timeout=30) is None and not os.path.exists(guard)
  lease = leases.acquire(d, timeout=30)
  assert lease is not None and lease.took_over["token"] == "theirs"
  assert _files(d) == [leases.LEASE]
  lease.release()


def test_two_claims_at_once_one_creates_the_other_checks(tmp_path):
  header = {"sweep_id": "abc", "name": "n", "config_path": "c.toml", "trials": []}
  for round_ in range(5):
    root = str(tmp_path / str(round_))
    barrier, results, errors = threading.Barrier(2), [], []

    def claim():
      barrier.wait()
      try:
        results.append(store.Store(root).claim(header))
      except Exception as e:  # any error fails the assertion below
        errors.append(e)
    threads = [threading.Thread(target=claim) for _ in range(2)]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    assert errors == [] and sorted(results) == [False, True]
    assert store.read_json(os.path.join(root, store.SWEEP)) == header
    assert _files(root) == [store.SWEEP, "trials"]
  with pytest.raises(ConfigError, match=r"--out=.*holds sweep abc .*this is other"):
    store.Store(root).claim({**header, "sweep_id": "other"})


def test_a_signal_saves_the_running_trial_and_exits():
  previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
  for sig in previous:
    stream, reached = io.StringIO(), []

    def train():
      step = 0
      threading.Timer(0.05, os.kill, (os.getpid(), sig)).start()
      while not preempt.requested():  # stands for the training loop's check after each step
        step += 1
        time.sleep(0.001)
      reached.append(step)
      preempt.record("2/4 [h=1]", step)
    try:
      preempt.install_handlers(stream)
      with pytest.raises(SystemExit) as e:
        preempt.run(train)
    finally:
      for s, handler in previous.items():
        signal.signal(s, handler)
    assert e.value.code == 128 + sig and reached and reached[0] > 0
    assert stream.getvalue() == (f"{signal.Signals(sig).name}: preempted at step {reached[0]} of trial 2/4 [h=1]; "
                                 "re-run the same command to resume\n")
  preempt.save_now()  # nothing runs: a no-op
  assert preempt.run(lambda: 7) == 7 and not preempt.requested()


def _hand_made_store(root):
  """Six trials of 100 steps: ok, failed, running, stale, pending, pending with a checkpoint."""
  ids = ["ok", "failed", "running", "stale", "pending", "resumable"]
  store.write_json(os.path.join(root, store.SWEEP), {"sweep_id": "s", "trials": [
      {"id": i, "label": {"model.num_heads": n}} for n, i in enumerate(ids)]})
  for i in ids:
    d = os.path.join(root, "trials", i)
    os.makedirs(d)
    store.write_json(os.path.join(d, store.CONFIG), {"id": i, "label": {}, "train": {"steps": 100}})

  def partial(i, n):
    with open(os.path.join(root, "trials", i, store.PARTIAL), "w") as f:
      f.write("".join(json.dumps({"step": s, "step_time_s": 0.5}) + "\n" for s in range(n)))
  store.write_json(os.path.join(root, "trials", "ok", store.SUMMARY), {
      "status": "ok", "steps_done": 100, "resumed_from": 20, "compile_s": 2.0, "train_s": 6.0,
      "checkpoint_s": 0.0, "group_size": 1, "final": {"eval_accuracy": 0.5, "eval_loss": 1.25}})
  store.write_json(os.path.join(root, "trials", "failed", store.SUMMARY),
                   {"status": "failed", "reason": "non-finite loss=nan at step 3"})
  partial("running", 40)
  _write_lease(os.path.join(root, "trials", "running"), age=2, job_id="55_2")
  partial("stale", 10)
  _write_lease(os.path.join(root, "trials", "stale"), age=300)
  partial("resumable", 25)
  os.makedirs(os.path.join(root, "trials", "resumable", store.CHECKPOINTS, "20"))


def test_status_of_a_hand_made_store(tmp_path, capsys):
  root = str(tmp_path)
  _hand_made_store(root)
  trials = status.collect(root, lease_timeout=60)
  assert [t["state"] for t in trials] == ["ok", "failed", "running", "stale", "pending", "pending"]
  assert [t["step"] for t in trials[2:]] == [40, 10, 0, 25]
  # 8 s over the 80 steps the ok trial ran: 0.1 s a step; steps left 60 + 90 + 100 + 100; one worker runs
  assert status.eta(trials) == pytest.approx(35.0)
  assert cli.main(["status", root]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert lines[0].split() == ["1/6", "ok", "num_heads=0", "eval_accuracy", "0.5000", "eval_loss", "1.2500", "(8", "s)"]
  assert lines[1].endswith("failed   num_heads=1  non-finite loss=nan at step 3")
  assert re.search(r"running  num_heads=2  step 40/100 on nodeA pid 4242 \(job 55_2\), heartbeat [23] s ago$",
                   lines[2])
  assert re.search(r"stale    num_heads=3  step 10/100 on nodeA pid 4242, heartbeat 30[01] s ago \(> 60 s:", lines[3])
  assert lines[4].endswith("pending  num_heads=4")
  assert lines[5].endswith("stopped at step 25/100, resumes from its checkpoint of step 20")
  assert lines[6] == "6 trials: 1 ok, 1 failed, 1 running, 1 stale, 2 pending; ETA 0m35s"
  assert cli.main(["status", root, "--lease-timeout", "400"]) == 0  # the stale lease counts as running now
  assert capsys.readouterr().out.splitlines()[-1].startswith("6 trials: 1 ok, 1 failed, 2 running, 0 stale")


@pytest.mark.parametrize("argv, message", [
    (["status", "{tmp}"], "DIR='{tmp}' is not allowed: a sweep directory written by `attn sweep`"),
    (["status", "{tmp}", "--lease-timeout", "0"], "--lease-timeout=0.0 is not allowed: a number of seconds >= 1"),
    (["sweep", "configs/quick.toml", "--workers", "0"], "--workers=0 is not allowed: an integer >= 1"),
    (["sweep", "configs/quick.toml", "--lease-timeout", "nan"], "--lease-timeout=nan is not allowed"),
    (["sweep", "configs/quick.toml", "--executor", "slurm", "--workers", "2"],
     "--workers=2 is not allowed: left out with --executor slurm"),
])
def test_bad_arguments_are_refused_by_name(tmp_path, capsys, argv, message):
  argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
  assert cli.main(argv) == 2
  err = capsys.readouterr().err
  assert err.startswith(f"attn {argv[0]}: error: ") and message.replace("{tmp}", str(tmp_path)) in err
  assert _files(tmp_path) == []
