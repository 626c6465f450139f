"""A damaged store: each file that does not parse, cut short or overwritten, against sweep, report and status.

sweep.json and a trial's config.json are refused by path with what to do; a
trial whose summary.json is damaged is shown as damaged and re-run from its
checkpoint, rows unchanged and nothing else rewritten; a torn last row of the
metrics is a warning, dropped when the trial resumes. One tiny sweep (two
trials of four steps, checkpoints at 2 and 4) trained once, copied per test.
"""

import io
import os
import shutil

import pytest

from attn import cli
from attn.experiments.reading import report
from attn.experiments.running import config as config_lib
from attn.experiments.running import store
from attn.experiments.running import sweep
from conftest import TINY_SWEEP

CONFIG = TINY_SWEEP

DAMAGES = {
    "cut": lambda b: b[:len(b) // 2],  # a write cut short
    "garbage": lambda b: b"\x00\xffnot json at all\n",  # overwritten
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """(config path, a finished store) of the tiny sweep; tests copy the store before damaging it."""
  root = tmp_path_factory.mktemp("damage")
  os.environ.setdefault("ATTN_JAX_CACHE", os.environ.get("ATTN_TEST_JAX_CACHE") or os.path.join(
      os.path.expanduser("~"), ".cache", "attn", "jax-tests"))
  path = str(root / "tiny.toml")
  with open(path, "w") as f:
    f.write(CONFIG)
  out = str(root / "out")
  counts = sweep.run_sweep(config_lib.load(path), out, config_text=CONFIG, stream=io.StringIO())
  assert counts == {"ok": 2, "failed": 0, "skipped": 0}
  return path, out


@pytest.fixture
def copy(trained, tmp_path):
  """(config path, a fresh copy of the finished store, the first trial's id)."""
  path, out = trained
  d = str(tmp_path / "out")
  shutil.copytree(out, d)
  return path, d, store.load_sweep(d)["trials"][0]["id"]


def _damage(path, how):
  with open(path, "rb") as f:
    body = f.read()
  with open(path, "wb") as f:
    f.write(DAMAGES[how](body))


def _snapshot(d):
  """Every file under d: its bytes and mtime."""
  out = {}
  for root, _, files in os.walk(d):
    for name in files:
      p = os.path.join(root, name)
      with open(p, "rb") as f:
        out[os.path.relpath(p, d)] = (f.read(), os.stat(p).st_mtime_ns)
  return out


def _rows(path):
  return [{k: v for k, v in r.items() if k != "step_time_s"} for r in store.read_rows(path)]


@pytest.mark.parametrize("how", sorted(DAMAGES))
@pytest.mark.parametrize("which", ["sweep", "config"])
def test_a_damaged_header_or_config_is_refused_by_path(copy, capsys, how, which):
  path, d, tid = copy
  target = os.path.join(d, store.SWEEP) if which == "sweep" else os.path.join(d, "trials", tid, store.CONFIG)
  _damage(target, how)
  before = _snapshot(d)
  todo = "remove" if which == "sweep" else "remove it and run the sweep's command again"
  for argv in (["sweep", path, "--out", d, "--no-report"], ["report", d]):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"attn {argv[0]}: error: {target} is damaged (") and todo in err, err
    assert "Traceback" not in err
  code = cli.main(["status", d])
  out, err = capsys.readouterr()
  if which == "sweep":  # nothing to show without the trial list
    assert code == 2 and err.startswith(f"attn status: error: {target} is damaged (")
  else:  # the trial is shown as damaged, the others as they are
    assert code == 0 and "Traceback" not in err
    lines = out.splitlines()
    assert lines[0].split()[1] == "damaged" and f"{target} is damaged (" in lines[0] and todo in lines[0]
    assert lines[1].split()[1] == "ok"
    assert lines[-1] == "2 trials: 1 ok, 0 failed, 0 running, 0 stale, 0 pending, 1 damaged"
  assert _snapshot(d) == before  # nothing written, nothing rewritten


# One damage in the fast tier: both are one failed parse (the header and config test runs both fast).
@pytest.mark.parametrize("how", [pytest.param(h, marks=pytest.mark.slow if h == "garbage" else ()) for h in sorted(DAMAGES)])
def test_a_damaged_summary_is_shown_then_re_run_from_its_checkpoint(copy, capsys, how):
  path, d, tid = copy
  trial = os.path.join(d, "trials", tid)
  target = os.path.join(trial, store.SUMMARY)
  original = store.read_json(target)
  rows = _rows(os.path.join(trial, store.METRICS))
  _damage(target, how)

  assert cli.main(["status", d]) == 0
  out, err = capsys.readouterr()
  assert out.splitlines()[0].split()[1] == "damaged" and f"{target} is damaged (" in out
  assert "re-runs the trial from its checkpoint" in out and "Traceback" not in err
  warnings = io.StringIO()
  md = open(report.write_report(d, warnings)).read()
  assert f"warning: {target} is damaged (" in warnings.getvalue()
  assert f"| {tid} | seed=0 | damaged |" in md and "## Damaged store files" in md and "1 damaged" in md

  before = _snapshot(d)
  log = io.StringIO()
  counts = sweep.run_sweep(config_lib.load(path), d, config_text=CONFIG, stream=log)
  assert counts == {"ok": 1, "failed": 0, "skipped": 1}, log.getvalue()
  assert f"{target} is damaged (" in log.getvalue() and "re-running it from its checkpoint" in log.getvalue()
  assert "resumes at step 2" in log.getvalue()  # the newest checkpoint before the final step
  summary = store.read_json(target)
  assert summary["status"] == "ok" and summary["final"] == original["final"] and summary["resumed_from"] == 2
  assert _rows(os.path.join(trial, store.METRICS)) == rows  # nothing lost, nothing counted twice
  after = _snapshot(d)
  rewritten = {p for p in set(before) | set(after) if before.get(p) != after.get(p)}
  assert all(p.startswith(os.path.join("trials", tid, "")) for p in rewritten), rewritten
  assert os.path.join("trials", tid, store.CONFIG) not in rewritten
  assert cli.main(["status", d]) == 0
  assert capsys.readouterr().out.splitlines()[-1] == "2 trials: 2 ok, 0 failed, 0 running, 0 stale, 0 pending"


def test_a_torn_last_row_is_a_warning_and_is_dropped_on_resume(copy, capsys):
  path, d, tid = copy
  trial = os.path.join(d, "trials", tid)
  metrics = os.path.join(trial, store.METRICS)
  rows = _rows(metrics)
  with open(metrics, "rb+") as f:
    f.truncate(os.path.getsize(metrics) - 40)  # the last row cut short

  assert cli.main(["status", d]) == 0  # finished: a warning only
  out, err = capsys.readouterr()
  assert out.splitlines()[-1] == "2 trials: 2 ok, 0 failed, 0 running, 0 stale, 0 pending"
  assert err.startswith(f"warning: trial 1/2: {metrics}: its last line (") and "is torn" in err
  warnings = io.StringIO()
  md = open(report.write_report(d, warnings)).read()
  assert f"{metrics}: its last line (" in warnings.getvalue() and "left out" in warnings.getvalue()
  assert "## Damaged store files" in md and "is torn" in md
  assert [r["step"] for r in store.read_rows(metrics)] == [0, 1, 2]

  # The same torn row in the partial rows of a trial that was stopped: dropped when it resumes.
  os.remove(os.path.join(trial, store.SUMMARY))
  os.replace(metrics, os.path.join(trial, store.PARTIAL))
  assert cli.main(["status", d]) == 0
  out, err = capsys.readouterr()
  assert out.splitlines()[0].split()[1] == "pending" and "dropped when the trial resumes" in err
  log = io.StringIO()
  assert sweep.run_sweep(config_lib.load(path), d, config_text=CONFIG, stream=log)["ok"] == 1
  assert "resumes at step 2" in log.getvalue()
  assert _rows(metrics) == rows and not os.path.exists(os.path.join(trial, store.PARTIAL))


def test_bad_lines_are_named_and_missing_rows_refuse_a_resume(tmp_path):
  path = str(tmp_path / store.PARTIAL)
  with open(path, "w") as f:
    f.write('{"step": 0}\n{"step": 1, "lo\n{"step": 2}\n[3]\n{"step": 4, "loss"')
  rows, problems = store.scan_rows(path)
  assert [r["step"] for r in rows] == [0, 2]
  assert problems[0].startswith(f"{path}: line 2 of 5 is left out (not JSON")
  assert problems[1] == f"{path}: line 4 of 5 is left out (not a JSON object with an integer step)"
  assert problems[2].startswith(f"{path}: its last line (18 bytes) is torn")
  assert store.torn_tail(path) == problems[2]
  st = store.Store(str(tmp_path / "s"))
  os.makedirs(st.trial_dir("t"))
  partial = os.path.join(st.trial_dir("t"), store.PARTIAL)
  shutil.copy(path, partial)
  with pytest.raises(store.StoreDamaged, match=r"1 rows before the checkpoint of step 2, not rows 0\.\.1; .*line 2 "
                     r"of 5 .*: remove .* and re-run the sweep to train this trial from step 0"):
    st.start("t", resume_from=2)
  assert st.start("t", resume_from=1) == [p.replace(path, partial) for p in problems]  # row 0 kept, rest dropped
  st.close()
  assert open(partial).read() == '{"step": 0}\n'
