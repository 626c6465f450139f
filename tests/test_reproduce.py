"""attn reproduce: committed numbers read back, the slice it picks, the verdicts, and bad input refused by name."""

import json
import math
import os
import shutil

import pytest

from attn import cli
from attn.config import ConfigError
from attn.experiments.reading import reproduce
from conftest import TINY_MQAR

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICK = os.path.join(ROOT, "experiments", "quick")


def _report(name):
  with open(os.path.join(ROOT, "experiments", name, "report.md"), encoding="utf-8") as f:
    return f.read()


def test_report_table_agrees_with_the_committed_trials_json():
  """Two writers of the same run (report.md's table, the store's summaries) give the same numbers."""
  parsed = {t["id"]: t for t in reproduce.from_report(_report("quick"), QUICK)}
  with open(os.path.join(QUICK, "trials.json"), encoding="utf-8") as f:
    exact = json.load(f)["trials"]
  assert sorted(parsed) == sorted(t["id"] for t in exact) and len(exact) == 12
  for t in exact:
    for key in ("loss", "eval_loss", "eval_accuracy"):
      assert f"{t['final'][key]:.3g}" == f"{parsed[t['id']]['final'][key]:.3g}", (t["id"], key)
    assert parsed[t["id"]]["label"]["seed"] == str(t["label"]["train.seed"])


def test_text_report_gives_bits_per_byte_per_seed():
  trials = reproduce.from_report(_report("text_dk_fixed_heads"), "experiments/text_dk_fixed_heads")
  assert len(trials) == 12
  for t in trials:  # four decimals from the Groups table against the Trials table's three-digit loss
    assert abs(t["final"]["eval_bpb"] - t["final"]["eval_loss"] / math.log(2)) < 0.01, t


def test_default_slice_is_one_trial_per_group_best_and_worst_first():
  w = reproduce.load_writeup(QUICK)
  assert w.exact and w.primary == "eval_accuracy"
  two = reproduce.choose(w, 2)
  # experiments/quick/README.md: h = 1 per_head is best (0.444), h = 4 per_head worst (0.213).
  assert [(t["label"]["model.num_heads"], t["label"]["model.variant"]) for t in two] == [(1, "per_head"),
                                                                                        (4, "per_head")]
  default = reproduce.choose(w)
  assert len({reproduce._group(t["label"]) for t in default}) == len(default) == 4
  assert {t["label"]["train.seed"] for t in default} == {0}
  five = reproduce.choose(w, 5)
  assert five[:4] == default and five[4]["label"]["train.seed"] == 1
  assert {t["label"]["train.seed"] for t in reproduce.choose(w, seeds=["2"])} == {2}


def _writeup(values):
  trials = [{"id": f"t{i}", "label": {"model.num_heads": 1, "train.seed": i}, "final": {"eval_accuracy": v}}
            for i, v in enumerate(values)]
  return reproduce.Writeup("experiments/x", "x", "configs/x.toml", "eval_accuracy", trials, True, {})


def test_compare_bit_equal_within_spread_and_different():
  w = _writeup([0.1, 0.2, 0.3])  # one seed's standard deviation: 0.1
  t = w.trials[1]
  assert reproduce.compare(w, t, {"eval_accuracy": 0.2})[0] == "bit-equal"
  kind, a, b, z = reproduce.compare(w, t, {"eval_accuracy": 0.35})
  assert kind == "within spread" and (a, b) == (0.2, 0.35) and z == pytest.approx(1.5)
  kind, _, _, z = reproduce.compare(w, t, {"eval_accuracy": -0.05})
  assert kind == "different" and z == pytest.approx(2.5)
  assert reproduce.compare(w, t, {"eval_accuracy": 0.2 + 1e-9})[0] == "within spread"


def test_a_group_whose_seeds_agree_is_matched_by_the_same_value_only():
  # recall_vs_state's MHA h=1 at 8 pairs: every seed 1.0; a re-run at 1.0 whose loss moved is within spread.
  w = _writeup([1.0, 1.0, 1.0])
  t = {**w.trials[0], "final": {"eval_accuracy": 1.0, "eval_loss": 2e-5}}
  assert reproduce.compare(w, t, {"eval_accuracy": 1.0, "eval_loss": 3e-5})[1:] == (1.0, 1.0, 0.0)
  assert reproduce.compare(w, t, {"eval_accuracy": 1.0, "eval_loss": 3e-5})[0] == "within spread"
  kind, _, _, z = reproduce.compare(w, t, {"eval_accuracy": 0.999, "eval_loss": 3e-5})
  assert kind == "different" and z == math.inf


def test_run_records_name_unknown_where_missing(tmp_path):
  assert reproduce.describe_run({}) == "commit unknown, CPU unknown, date unknown"
  assert "commit 4c1bb24" in reproduce.describe_run({"train_commit": "4c1bb24", "cpu": "Xeon"})
  path = tmp_path / "run.json"  # scripts/reproduce.py's shape: its own keys and the store's record lines
  path.write_text(json.dumps({"date": "2026-11-26", "cpu": "AMD EPYC", "run_record": [
      {"event": "start", "commit": "0123456789abcdef0123", "dirty": True, "cpu": "Xeon 8480",
       "start": "2026-11-26T10:00:00+00:00"}, {"event": "end", "wall_s": 3.0}]}))
  assert reproduce.describe_run(reproduce._read_run(str(path))) == \
      "commit 0123456789ab (dirty), CPU Xeon 8480, 2026-11-26T10:00:00+00:00"
  path.write_text("{not json")
  assert reproduce._read_run(str(path)) == {} and reproduce._read_run(str(tmp_path / "none.json")) == {}


def _main(capsys, *argv):
  rc = cli.main(["reproduce", *argv])
  out, err = capsys.readouterr()
  assert "Traceback" not in out + err
  return rc, out, err


@pytest.mark.parametrize("path,words", [
    ("experiments/nope", "a directory of a shipped write-up"),
    ("attn", "holding README.md and the report.md"),
    ("experiments/pretrained_heads", "configs/pretrained_heads.toml does not exist"),
])
def test_not_a_writeup_is_refused_by_name(capsys, monkeypatch, path, words):
  monkeypatch.chdir(ROOT)
  rc, _, err = _main(capsys, path)
  assert rc == 2 and f"WRITEUP='{path}'" in err and words in err


def test_a_writeup_resolves_from_the_checkout_and_a_miss_says_where_it_looked(tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)  # outside any checkout: the one attn is imported from
  assert reproduce.resolve("experiments/quick") == QUICK
  assert reproduce.resolve("quick") == QUICK
  monkeypatch.chdir(os.path.join(ROOT, "attn"))  # inside the checkout, below its root
  assert reproduce.resolve("experiments/quick") == QUICK
  monkeypatch.chdir(tmp_path)
  rc, _, err = _main(capsys, "experiments/nope", "--trials", "1")
  assert rc == 2 and "WRITEUP='experiments/nope'" in err
  assert f"looked in {tmp_path / 'experiments' / 'nope'}, {os.path.join(ROOT, 'experiments', 'nope')}" in err
  assert "write-ups there: " in err and " quick," in err


def test_zero_trials_and_unknown_seeds_are_refused_by_name(capsys):
  rc, _, err = _main(capsys, QUICK, "--trials", "0")
  assert rc == 2 and "--trials=0" in err and ">= 1" in err
  rc, _, err = _main(capsys, QUICK, "--seeds", "7")
  assert rc == 2 and "--seeds" in err and "0, 1, 2" in err


def _copy(tmp_path, name="quick"):
  (tmp_path / "configs").mkdir()
  shutil.copytree(os.path.join(ROOT, "experiments", name), tmp_path / "experiments" / name)
  shutil.copy(os.path.join(ROOT, "configs", f"{name}.toml"), tmp_path / "configs")
  return tmp_path / "experiments" / name, tmp_path / "configs" / f"{name}.toml"


def test_a_config_changed_since_the_writeup_ran_is_refused(tmp_path, capsys):
  writeup, config = _copy(tmp_path)
  config.write_text(config.read_text().replace("steps = 250", "steps = 251"))
  rc, _, err = _main(capsys, str(writeup))
  assert rc == 2 and "WRITEUP=" in err and "trial ids that differ from 12 of the 12" in err
  assert not any(p.name.startswith("attn-reproduce") for p in tmp_path.iterdir())


def test_a_damaged_trials_json_is_refused_by_path(tmp_path, capsys):
  writeup, _ = _copy(tmp_path)
  (writeup / "trials.json").write_text('{"trials": [')
  rc, _, err = _main(capsys, str(writeup))
  assert rc == 2 and "trials.json parses" in err


TINY = """
[meta]
name = "tiny"
question = "does reproduce reproduce?"
""" + TINY_MQAR + """
[train]
steps = 3
batch_size = 4
warmup_steps = 1
eval_every = 2
eval_batches = 1

[sweep]
seeds = [0, 1]

[sweep.grid]
"model.num_heads" = [1, 2]
"""


@pytest.mark.slow  # two sweeps end to end
def test_reproduce_end_to_end_bit_equal_then_different(tmp_path, capsys, monkeypatch):
  from attn.experiments.reading import report
  monkeypatch.setenv("ATTN_JAX_CACHE", str(tmp_path / "jax_cache"))
  (tmp_path / "configs").mkdir()
  (tmp_path / "configs" / "tiny.toml").write_text(TINY)
  monkeypatch.chdir(tmp_path)
  assert cli.main(["sweep", "configs/tiny.toml", "--out", "runs/tiny", "--no-report"]) == 0
  report.write_report("runs/tiny")
  w = tmp_path / "experiments" / "tiny"
  w.mkdir(parents=True)
  (w / "README.md").write_text("tiny\n")
  shutil.copy("runs/tiny/report.md", w)
  committed = reproduce.committed_trials("runs/tiny")
  (w / "trials.json").write_text(json.dumps(committed))
  rc, out, _ = _main(capsys, "experiments/tiny")
  assert rc == 0 and out.count(": bit-equal") == 2 and "REPRODUCED" in out, out
  assert "committed run: commit unknown, CPU unknown" in out  # no run.json
  from attn.experiments.running import run_record
  record = run_record.read("runs/tiny")[0]  # as scripts/reproduce.py copies it
  (w / "run.json").write_text(json.dumps({"run_record": record}))
  rc, out, err = _main(capsys, "experiments/tiny", "--trials", "1")
  assert "1 trials to run" in err and "trial 1/1 [" in err and "trial 1/2" not in err  # counts what it runs
  commit = (record[0]["commit"] or "unknown")[:12]
  assert rc == 0 and f"committed run: commit {commit}" in out and f"CPU {record[0]['cpu']}" in out, out
  group = [t for t in committed["trials"] if t["label"]["model.num_heads"] == 1]
  values = [t["final"]["eval_accuracy"] for t in group]
  for t in group:  # both seeds moved alike: the group's spread stays, the re-run is far from both
    t["final"]["eval_accuracy"] += 10 * abs(values[0] - values[1]) + 0.1
  (w / "trials.json").write_text(json.dumps(committed))
  rc, out, _ = _main(capsys, "experiments/tiny", "--trials", "1")
  assert rc == 1 and ": different" in out and "DIFFERS" in out, out
  (w / "trials.json").unlink()
  rc, out, _ = _main(capsys, "experiments/tiny", "--trials", "1")
  assert rc == 0 and "equal at the printed digits" in out and "report.md (printed digits)" in out, out
