"""Faults of the machine: a full disk, an I/O error, a kill at every write boundary, told apart from a trial's own.

One tiny sweep (two trials of four steps, checkpoints at 2 and 4) is trained
undisturbed once; every test compares with it. The fault hook
(attn.process.faults) makes the N-th write of the store, of a
metrics row or of a checkpoint fail with ENOSPC (and every write after it: a
full disk) or EIO (that one), or kills the process right after it; a plain
re-run must then give the undisturbed numbers, every row once, no summary
ever written for an interrupted trial. A few N run in the fast tier; every N
of every kind, and a real 1 MB tmpfs, run in the slow tier.
"""

import errno
import io
import json
import os
import shutil
import subprocess
import sys

import pytest

from attn import cli
from attn.config import ConfigError
from attn.experiments.running import config as config_lib
from attn.experiments.running import space
from attn.experiments.running import status
from attn.experiments.running import store
from attn.experiments.running import sweep
from attn.process import faults
from conftest import TINY_SWEEP

CONFIG = TINY_SWEEP
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _results(out):
  """{trial id: (status, final metrics, [row steps])}: what a re-run must reproduce."""
  got = {}
  for t in store.iter_trials(out):
    s = t["summary"] or {}
    got[t["id"]] = (s.get("status"), s.get("final"), [r["step"] for r in t["rows"]],
                    [r["loss"] for r in t["rows"]])
  return got


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory):
  """(config path, results of an undisturbed run, its count of writes of each kind)."""
  root = tmp_path_factory.mktemp("faults")
  os.environ.setdefault("ATTN_JAX_CACHE", os.environ.get("ATTN_TEST_JAX_CACHE") or os.path.join(
      os.path.expanduser("~"), ".cache", "attn", "jax-tests"))
  path = str(root / "tiny.toml")
  with open(path, "w") as f:
    f.write(CONFIG)
  faults.arm(None)
  out = str(root / "out")
  assert sweep.run_sweep(config_lib.load(path), out, config_text=CONFIG, stream=io.StringIO())["ok"] == 2
  writes = faults.counts()
  results = _results(out)
  assert all(r[0] == "ok" and r[2] == [0, 1, 2, 3] for r in results.values())
  return path, results, writes


def _run(path, out):
  log = io.StringIO()
  try:
    counts = sweep.run_sweep(config_lib.load(path), out, config_text=CONFIG, stream=log)
  finally:
    faults.arm(None)
  return counts, log.getvalue()


def _inject_then_rerun(path, expected, out, kind, n, mode):
  """Runs with the fault armed, checks what it left, re-runs plainly, checks the numbers are the undisturbed ones."""
  faults.arm(kind, n, mode)
  try:
    counts, log = _run(path, out)
  except ConfigError as e:  # a write of the store's claim, before any training: refused naming --out
    assert "--out" in str(e) and f"errno {mode}" in str(e) and kind == "store", (kind, n, mode, e)
    counts, log = {"fault": f"errno {mode}: re-run the same command", "ok": 0, "unfinished": 2}, str(e)
  assert "fault" in counts, (kind, n, mode, counts, log)
  assert f"errno {mode}" in counts["fault"] and "re-run the same command" in counts["fault"]
  assert counts["ok"] < 2 and counts.get("unfinished", 0) >= 1
  if os.path.exists(os.path.join(out, store.SWEEP)):
    for t in store.iter_trials(out):  # no summary for an interrupted trial; nothing failed
      assert t["summary"] is None or t["summary"]["status"] == "ok", t
  counts, log = _run(path, out)
  assert "fault" not in counts and counts["failed"] == 0, log
  assert _results(out) == expected, (kind, n, mode, log)


@pytest.mark.parametrize("kind, n, mode", [
    # Subprocess sweeps, killed then re-run: every kind in the slow tier (the fast tier's time limit).
    pytest.param("row", 3, "ENOSPC", marks=pytest.mark.slow),
    pytest.param("checkpoint", 2, "EIO", marks=pytest.mark.slow),
    pytest.param("store", 4, "ENOSPC", marks=pytest.mark.slow)])
def test_a_fault_interrupts_and_a_plain_rerun_finishes_with_the_same_numbers(undisturbed, tmp_path, kind, n, mode):
  path, expected, _ = undisturbed
  _inject_then_rerun(path, expected, str(tmp_path / "out"), kind, n, mode)


@pytest.mark.slow
def test_an_interrupted_trial_is_shown_with_its_reason_by_status_and_report(undisturbed, tmp_path, capsys):
  path, expected, _ = undisturbed
  out = str(tmp_path / "out")
  faults.arm("checkpoint", 1, "EIO")  # one failing write: the disk still takes interrupted.json
  counts, _ = _run(path, out)
  assert counts["ok"] == 0 and counts["unfinished"] == 2
  trials = status.collect(out)
  assert [t["state"] for t in trials] == ["interrupted", "pending"]
  assert trials[0]["reason"].startswith("I/O error (errno EIO) writing ") and "checkpoints" in trials[0]["reason"]
  assert cli.main(["status", out]) == 0
  assert "1 interrupted" in capsys.readouterr().out
  from attn.experiments.reading import report
  text = open(report.write_report(out)).read()
  assert "## Interrupted trials" in text and "I/O error (errno EIO)" in text
  _run(path, out)
  assert _results(out) == expected
  text = open(report.write_report(out)).read()
  assert "Interrupted" not in text and "## Failed trials" not in text and "2 ok, 0 failed" in text
  assert not any(os.path.exists(os.path.join(store.Store(out).trial_dir(i), store.INTERRUPTED)) for i in expected)


def test_errors_are_told_apart():
  full = OSError(errno.ENOSPC, "No space left on device", "/s/x")
  assert faults.classify(full) == faults.Fault(errno.ENOSPC, "no space left on device", "/s/x")
  try:  # a fault anywhere in the chain of causes
    try:
      raise full
    except OSError as e:
      raise RuntimeError("while saving") from e
  except RuntimeError as e:
    assert faults.classify(e).errno == errno.ENOSPC
  orbax = ValueError('RESOURCE_EXHAUSTED: Error writing local file "/s/ck/2.orbax-checkpoint-tmp/m": Failed '
                     'writing: "/s/ck/2.orbax-checkpoint-tmp/m/d/1": Failed to write 9 bytes [os_error_code=\'5\']')
  assert faults.classify(orbax) == faults.Fault(errno.EIO, "I/O error", "/s/ck/2.orbax-checkpoint-tmp/m/d/1")
  assert faults.classify(FloatingPointError("non-finite loss")) is None
  assert faults.classify(OSError(errno.ENOENT, "No such file")) is None  # a bug, not the machine
  assert faults.classify(RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 9 bytes")) is None
  for errno_ in (errno.ENOSPC, errno.EIO):  # f.write names no file: the write's point (or naming) does
    with pytest.raises(OSError) as raised, faults.point("row", "/s/t/rows"):
      raise OSError(errno_, os.strerror(errno_))
    assert faults.classify(raised.value).reason.endswith(") writing /s/t/rows")
  with pytest.raises(OSError) as raised, faults.naming("/s/u"):
    raise OSError(errno.EIO, "I/O error", "/s/named")
  assert raised.value.filename == "/s/named"  # a named file keeps its name


@pytest.fixture
def config_path(tmp_path):
  path = str(tmp_path / "tiny.toml")
  with open(path, "w") as f:
    f.write(CONFIG)
  return path


def test_a_full_filesystem_is_refused_before_training_naming_its_space(config_path, tmp_path, monkeypatch):
  path = config_path
  monkeypatch.setattr(space, "free_bytes", lambda p: (str(tmp_path), 4096))
  with pytest.raises(ConfigError, match=r"--out.*4\.1 kB free \(4096 bytes"):
    sweep.prepare(config_lib.load(path), str(tmp_path / "out"))
  assert not os.path.exists(tmp_path / "out")


@pytest.mark.slow
def test_retry_failed_runs_failed_trials_again_and_says_when_there_are_none(undisturbed, tmp_path, capsys):
  path, expected, _ = undisturbed
  out = str(tmp_path / "out")
  argv = ["sweep", path, "--out", out, "--no-report"]
  assert cli.main(argv + ["--retry-failed"]) == 0
  assert f"--retry-failed: no failed trials in {out}: nothing to retry" in capsys.readouterr().err
  first = store.load_sweep(out)["trials"][0]["id"]
  summary = os.path.join(store.Store(out).trial_dir(first), store.SUMMARY)
  with open(summary) as f:
    s = json.load(f)
  store.write_json(summary, {**s, "status": "failed", "reason": "error: ValueError: a variant's own bug"})
  assert cli.main(argv) == 0  # a plain re-run leaves a failed trial failed
  assert status.collect(out)[0]["state"] == "failed"
  assert cli.main(argv + ["--retry-failed"]) == 0
  assert "retrying 1 failed trial from step 0" in capsys.readouterr().err
  assert _results(out) == expected
  assert cli.main(["sweep", path, "--out", str(tmp_path), "--retry-failed"]) == 2  # not a store: refused
  assert "--out" in capsys.readouterr().err


@pytest.mark.slow
def test_a_trial_wanting_more_memory_than_the_machine_has_fails_by_name_alone(undisturbed, tmp_path, monkeypatch):
  path, expected, _ = undisturbed
  asked = []
  monkeypatch.setattr(space, "available_memory", lambda: asked.append(1) or (1000 if len(asked) == 1 else None))
  counts, log = _run(path, str(tmp_path / "out"))
  assert counts["failed"] == 1 and counts["ok"] == 1, log
  trials = list(store.iter_trials(str(tmp_path / "out")))
  reason = trials[0]["summary"]["reason"]
  assert "XLA's memory analysis wants" in reason and "1.0 kB is available" in reason and "seed=0" in reason
  assert trials[1]["summary"]["final"] == expected[trials[1]["id"]][1]


def test_a_lease_of_a_killed_process_shows_the_trial_interrupted(config_path, tmp_path):
  path = config_path
  out = str(tmp_path / "out")
  sweep.prepare(config_lib.load(path), out, stream=io.StringIO())
  dead = subprocess.Popen([sys.executable, "-c", "pass"])
  dead.wait()
  d = store.Store(out).trial_dir(store.load_sweep(out)["trials"][1]["id"])
  from attn.experiments.running import leases
  import socket
  with open(os.path.join(d, leases.LEASE), "w") as f:
    json.dump({"token": "t", "host": socket.gethostname(), "pid": dead.pid, "pidns": leases._PIDNS}, f)
  t = status.collect(out)[1]
  assert t["state"] == "interrupted" and f"pid {dead.pid}" in t["reason"] and "out-of-memory" in t["reason"]


@pytest.mark.parametrize("sacct_says, state", [("OUT_OF_MEMORY|0:125", "interrupted"),
                                               ("RUNNING|0:0", "stale"), (None, "stale")])
def test_a_silent_slurm_tasks_trial_is_interrupted_when_sacct_says_the_cluster_ended_it(
    config_path, tmp_path, monkeypatch, sacct_says, state):
  out = str(tmp_path / "out")
  sweep.prepare(config_lib.load(config_path), out, stream=io.StringIO())
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  if sacct_says is not None:  # a stand-in for Slurm's accounting: prints its arguments' answer
    (bin_dir / "sacct").write_text(f"#!/bin/sh\necho '{sacct_says}'\necho \"$@\" > {bin_dir}/args\n")
    (bin_dir / "sacct").chmod(0o755)
  monkeypatch.setenv("PATH", str(bin_dir) + os.pathsep + "/usr/bin:/bin")
  d = store.Store(out).trial_dir(store.load_sweep(out)["trials"][0]["id"])
  with open(os.path.join(d, "lease.json"), "w") as f:
    json.dump({"token": "t", "host": "node7", "pid": 1, "pidns": "other", "job_id": "812_3.1"}, f)
  os.utime(os.path.join(d, "lease.json"), (0, 0))  # heartbeat long silent
  t = status.collect(out)[0]
  assert t["state"] == state
  if state == "interrupted":
    assert t["reason"] == "Slurm ended its job 812_3: OUT_OF_MEMORY (exit 0:125, sacct)"
    assert (bin_dir / "args").read_text().split()[-2:] == ["812_3", "--format=State,ExitCode"]


def _subprocess_sweep(path, out, fault=None, extra=()):
  env = {**os.environ, "PYTHONPATH": ROOT}
  env.pop("ATTN_FAULT", None)
  if fault:
    env["ATTN_FAULT"] = fault
  return subprocess.run([sys.executable, "-m", "attn", "sweep", path, "--out", out, "--no-report", *extra],
                        capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)


@pytest.mark.slow
def test_every_write_of_a_two_trial_sweep_failing_or_killed_then_a_plain_rerun(undisturbed, tmp_path):
  """ALICE's recipe: each write boundary of each kind, each way to fail; the re-run's numbers are the undisturbed."""
  path, expected, writes = undisturbed
  for kind in faults.KINDS:
    assert writes[kind] > 0
    for n in range(1, writes[kind] + 1 + 2 * (kind == "store")):  # `attn sweep` adds the run record's 2 lines
      for mode in ("ENOSPC", "EIO") if n <= writes[kind] else ():
        _inject_then_rerun(path, expected, str(tmp_path / f"{kind}-{n}-{mode}"), kind, n, mode)
      out = str(tmp_path / f"{kind}-{n}-kill")
      p = _subprocess_sweep(path, out, f"{kind}:{n}:kill")
      assert p.returncode == -9, p.stderr
      counts, log = _run(path, out)
      assert counts["failed"] == 0 and "fault" not in counts, log
      assert _results(out) == expected, (kind, n, log)


@pytest.mark.slow
@pytest.mark.parametrize("left_kb", [90, 170])  # this machine: Orbax's metadata file; the store's (neither names it)
def test_a_real_full_disk_stops_with_one_message_and_a_rerun_finishes(undisturbed, tmp_path, left_kb):
  """A 1 MB tmpfs, filled but for left_kb: one message naming the file, no traceback, exit 1; freed: a re-run finishes."""
  path, expected, _ = undisturbed
  disk = tmp_path / "disk"
  disk.mkdir()
  mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True, text=True)
  if mount.returncode != 0:
    pytest.skip(f"cannot mount a tmpfs here (needs root): {mount.stderr.strip()}")
  try:
    filler = disk / "filler"
    filler.write_bytes(b"\0" * (space.free_bytes(str(disk))[1] - left_kb * 1024))
    out = str(disk / "out")
    p = _subprocess_sweep(path, out)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    stops = [line for line in p.stderr.splitlines() if line.startswith("attn sweep: stopped: ")]
    assert len(stops) == 1 and "no space left on device (errno ENOSPC) writing " + out in stops[0], p.stderr
    assert all(t["summary"] is None or t["summary"]["status"] == "ok" for t in store.iter_trials(out))
    filler.unlink()
    p = _subprocess_sweep(path, out)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert _results(out) == expected
  finally:
    subprocess.run(["umount", str(disk)], capture_output=True)


@pytest.mark.slow
def test_a_full_disk_under_tensorboard_stops_the_sweep_after_the_trial_in_progress(undisturbed, tmp_path, monkeypatch):
  pytest.importorskip("tensorboardX")
  from attn.experiments.running import tb_writer
  path, expected, _ = undisturbed

  def full(writer, row):
    raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "tb" / "events"))

  monkeypatch.setattr(tb_writer, "add_row", full)
  out = str(tmp_path / "out")
  counts = sweep.run_sweep(config_lib.load(path), out, config_text=CONFIG, stream=io.StringIO(),
                           tensorboard=str(tmp_path / "tb"))
  assert counts["ok"] == 1 and counts["unfinished"] == 1 and "no space left on device" in counts["fault"]
  assert "tb/events" in counts["fault"]
  monkeypatch.undo()
  _run(path, out)
  assert _results(out) == expected


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_run_record_calls_a_tree_dirty_for_code_not_for_results(tmp_path):
  from attn.experiments.running import run_record
  root = str(tmp_path)

  def git(*args):
    subprocess.run(["git", "-C", root, "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True,
                   capture_output=True)

  def write(rel, text):
    os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
    with open(os.path.join(root, rel), "w") as f:
      f.write(text)

  git("init", "-q")
  write("attn/core.py", "x = 1\n")
  write("experiments/q/trials.json", "[]\n")
  git("add", ".")
  git("commit", "-q", "-m", "c")
  assert run_record._commit(root)["dirty"] is False
  write("experiments/q/trials.json", "[1]\n")  # what a run writes
  write("experiments/q/new.json", "{}\n")  # untracked
  assert run_record._commit(root) == {"commit": run_record._git("rev-parse", "HEAD", root=root).strip(),
                                      "dirty": False, "diff_sha256": None}
  write("attn/core.py", "x = 2\n")  # code
  first = run_record._commit(root)
  assert first["dirty"] is True and len(first["diff_sha256"]) == 16
  write("experiments/q/trials.json", "[2]\n")  # the results moving again leave the code's hash alone
  assert run_record._commit(root) == first


def test_the_run_record_is_appended_and_read_back_missing_or_damaged(tmp_path):
  from attn.experiments.running import run_record
  d = str(tmp_path)
  assert run_record.summary(d) == [f"run record: no run record ({d}/run.jsonl is missing: a store written before "
                                   "attn kept one)"]
  start = run_record.start_line()
  assert start["versions"]["jax"] and start["cores"] >= 1 and isinstance(start["loadavg"], list)
  run_record.append(d, start)
  with open(os.path.join(d, run_record.RECORD), "a") as f:
    f.write('{"event": "end", "cut sh')  # a write cut short
  run_record.append(d, run_record.end_line(start, "finished"))  # a resumed sweep appends after it
  lines = run_record.summary(d)
  assert lines[0].startswith("run record: ") and "line 2 of 3 is left out" in lines[0]
  assert lines[1].startswith("run record, first: start ") and start["command"] in lines[1]
  assert lines[2].startswith("run record, last: end ") and "finished after" in lines[2]
