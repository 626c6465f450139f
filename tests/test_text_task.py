"""The byte-level `text` task: corpus listing, split by file, windows, the on-disk cache, refusals, bits per byte."""

import builtins
import hashlib
import json
import math
import os

import numpy as np
import pytest

from attn.config import ConfigError
from attn.experiments.data import corpus
from attn.experiments.reading import report
from attn.experiments.data import tasks


@pytest.fixture(autouse=True)
def _fresh_cache(tmp_path, monkeypatch):
  monkeypatch.setenv("ATTN_TEXT_CACHE", str(tmp_path / "text_cache"))
  monkeypatch.setattr(corpus, "_MEMO", {})


def make_dir(root, files):
  for rel, data in files.items():
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
  return root


# Relative paths whose sha256 fraction (first 16 hex digits / 2^64) was worked out by hand:
# "chunk.py" 0.0033, "copyreg.py" 0.016, "traceback.py" 0.048 are below 0.05; "os.py" 0.85,
# "re/__init__.py" 0.20, "c.txt" 0.31, "b.txt" 0.9985 are not.
HELD, KEPT = ["chunk.py", "copyreg.py", "traceback.py"], ["os.py", "re/__init__.py", "c.txt", "b.txt"]


def test_split_by_file_hash_is_stable_and_about_five_percent():
  assert corpus.split_files(HELD + KEPT) == [True] * 3 + [False] * 4
  assert corpus.split_files(KEPT + HELD) == [False] * 4 + [True] * 3  # a file's side ignores the others
  names = [f"pkg{i % 7}/module_{i}.py" for i in range(4000)]
  expected = [int(hashlib.sha256(n.encode()).hexdigest()[:16], 16) < 0.05 * 2**64 for n in names]
  held = corpus.split_files(names)
  assert held == expected and 0.04 < np.mean(held) < 0.06
  # Too few files for the hash to pick one: the smallest hash is held out, one file always trains.
  assert corpus.split_files(["c.txt", "b.txt"]) == [True, False]
  assert corpus.split_files(["chunk.py", "copyreg.py"]) == [True, False]


def test_corpus_bytes_are_sorted_files_each_ended_by_nul(tmp_path):
  root = make_dir(tmp_path / "c", {"os.py": "x = 1\n", "chunk.py": "held\n", "re/__init__.py": "",
                                   "b.txt": "not matched", ".hidden/a.py": "hidden", "z.py": "zz"})
  c = corpus.load(str(root), "**/*.py")
  assert c.files == ("chunk.py", "os.py", "re/__init__.py", "z.py") and c.held_out == (True, False, False, False)
  assert bytes(c.train) == b"x = 1\n\0zz\0"  # the empty file adds nothing
  assert bytes(c.heldout) == b"held\n\0"
  assert corpus.load(str(root), "*.py").files == ("chunk.py", "os.py", "z.py")  # * stays in one directory
  assert corpus.load(str(root)).files == ("b.txt", "chunk.py", "os.py", "re/__init__.py", "z.py")  # "": every file
  one = corpus.load(str(root / "b.txt"))  # a single file holds out its last 5% (1 of 12 bytes, rounded up)
  assert bytes(one.train) == b"not matched" and bytes(one.heldout) == b"\0"


def test_default_corpus_is_the_stdlib_without_site_packages_and_tests():
  root, listing = corpus.list_files("")
  rels = [r for r, _, _ in listing]
  assert root == corpus.default_root() and "os.py" in rels and "json/__init__.py" in rels
  assert rels == sorted(rels) and all(r.endswith(".py") for r in rels)
  assert not [r for r in rels if {"site-packages", "test", "tests", "pydoc_data"} & set(r.split("/"))]


def test_windows_are_deterministic_and_come_from_their_split(tmp_path):
  files = {f"{name}": letter * 300 for name, letter in
           (("chunk.py", "h"), ("copyreg.py", "g"), ("os.py", "a"), ("c.txt", "b"), ("b.txt", "c"))}
  task = tasks.make_task({"name": "text", "path": str(make_dir(tmp_path / "w", files)), "seq_len": 9})
  assert task.vocab_size == 256 and task.kind == "decoder_lm"
  tr = task.batch(3, tasks.TRAIN, 5, 16)
  assert all(np.array_equal(tr[k], task.batch(3, tasks.TRAIN, 5, 16)[k]) for k in tr)
  assert not np.array_equal(tr["tokens"], task.batch(4, tasks.TRAIN, 5, 16)["tokens"])
  assert not np.array_equal(tr["tokens"], task.batch(3, tasks.TRAIN, 6, 16)["tokens"])
  assert tr["tokens"].shape == (16, 9) and tr["tokens"].dtype == np.int32 and (tr["weights"] == 1).all()
  assert (tr["tokens"][:, 1:] == tr["targets"][:, :-1]).all()
  ev = task.batch(3, tasks.EVAL, 2, 16)  # held-out windows: the same for every seed
  assert np.array_equal(ev["tokens"], task.batch(9, tasks.EVAL, 2, 16)["tokens"])
  assert set(np.unique(tr["tokens"])) <= {0, ord("a"), ord("b"), ord("c")}
  assert set(np.unique(ev["tokens"])) <= {0, ord("h"), ord("g")}


def test_cache_hit_reads_no_file_and_a_changed_file_is_read_again(tmp_path, monkeypatch):
  root = make_dir(tmp_path / "k", {"os.py": "a = 1\n" * 20, "chunk.py": "b = 2\n" * 20, "c.txt": "c\n"})
  corpus.load(str(root))
  assert not os.path.exists(corpus.cache_dir())  # under CACHE_MIN_BYTES: read, not cached
  monkeypatch.setattr(corpus, "CACHE_MIN_BYTES", 0)
  monkeypatch.setattr(corpus, "_MEMO", {})
  first = corpus.load(str(root))
  assert corpus.load(str(root)) is first  # the in-process memo
  opened = []
  real_open = builtins.open

  def counting_open(path, *args, **kwargs):
    opened.append(str(path))
    return real_open(path, *args, **kwargs)

  monkeypatch.setattr(builtins, "open", counting_open)
  monkeypatch.setattr(corpus, "_MEMO", {})  # a new process: only the disk cache is left
  again = corpus.load(str(root))
  assert not [p for p in opened if p.startswith(str(root))] and opened  # the cache was read, no corpus file
  assert np.array_equal(again.train, first.train) and np.array_equal(again.heldout, first.heldout)
  index = json.load(real_open(next(p for p in opened if p.endswith(".json"))))
  assert [f["path"] for f in index["files"]] == ["c.txt", "chunk.py", "os.py"]
  st = os.stat(root / "os.py")
  os.utime(root / "os.py", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # same bytes, new mtime
  opened.clear()
  corpus.load(str(root))
  assert str(root / "os.py") in opened
  (root / "os.py").write_text("A = 1\n" * 21)  # new size, mtime put back as it was
  os.utime(root / "os.py", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
  changed = corpus.load(str(root))
  assert bytes(changed.train).startswith(b"c\n\0A = 1\n")
  assert len(os.listdir(corpus.cache_dir())) == 2  # the new entry replaced the stale ones


@pytest.mark.parametrize("files,options,words", [
    ({}, {}, ["task.path", "empty"]),
    ({"a.txt": "text"}, {"glob": "**/*.md"}, ["task.glob", "**/*.md", "none matches"]),
    ({"a.txt": "text " * 50, "b.bin": b"ab\0cd"}, {}, ["task.path", "b.bin", "NUL byte at offset 2"]),
    ({"a.txt": "text " * 50, "sub/c.txt": b"ok \xff\xfe"}, {}, ["task.path", "sub/c.txt", "not UTF-8 at byte 3"]),
    ({"a.txt": "short"}, {"seq_len": 8}, ["task.path", "train split holds at least seq_len+1=9 bytes"]),
    ({"os.py": "x" * 400, "chunk.py": "y"}, {"seq_len": 8}, ["task.path", "held-out split"]),
])
def test_bad_corpora_are_refused_naming_the_path(tmp_path, files, options, words):
  root = make_dir(tmp_path / "bad", files)
  root.mkdir(exist_ok=True)
  with pytest.raises(ConfigError) as e:
    tasks.make_task({"name": "text", "path": str(root), **options})
  for w in [str(root)] + words:
    assert w in str(e.value), (w, str(e.value))


def test_missing_path_is_refused():
  with pytest.raises(ConfigError, match=r"task\.path='/no/such/dir' is not allowed: an existing text file"):
    tasks.make_task({"name": "text", "path": "/no/such/dir"})


def test_bits_per_byte_from_a_known_loss():
  # Uniform over 256 bytes is ln 256 nats = 8 bits; ln 2 nats = 1 bit.
  trials = [{"config": {"task": {"name": "text"}}, "rows": [{"step": 0, "eval_loss": math.log(256)}, {"step": 1}],
             "summary": {"status": "ok", "final": {"eval_loss": 0.6931471805599453}}}]
  assert report.add_bits_per_byte(trials)
  assert trials[0]["rows"][0]["eval_bpb"] == pytest.approx(8.0, abs=1e-12) and "eval_bpb" not in trials[0]["rows"][1]
  assert trials[0]["summary"]["final"]["eval_bpb"] == pytest.approx(1.0, abs=1e-12)
  mqar = [{"config": {"task": {"name": "mqar"}}, "rows": [{"eval_loss": 1.0}], "summary": None}]
  assert not report.add_bits_per_byte(mqar) and "eval_bpb" not in mqar[0]["rows"][0]


def test_report_ranks_text_settings_by_bits_per_byte_lower_first():
  def group(h, bpb):
    return {"group": f"num_heads={h}", "label": {"model.num_heads": h}, "n": 3,
            "eval_bpb": report._mean_std(bpb), "eval_accuracy": (0.5, 0.0), "eval_loss": (1.0, 0.0),
            "seed_values": {"eval_bpb": bpb, "eval_accuracy": [0.5] * 3, "eval_loss": [1.0] * 3}}
  rows = [group(1, [2.30, 2.31, 2.32]), group(4, [2.10, 2.11, 2.12]), group(16, [2.20, 2.21, 2.22])]
  (line,) = report.axis_answers(rows, ["model.num_heads"], primary="eval_bpb")
  assert "bits per byte (lower is better) 1: 2.310 ± 0.010, 4: 2.110 ± 0.010, 16: 2.210 ± 0.010" in line
  assert "Not monotone" in line and "Best 4 vs worst 1: gap 0.200, a clear difference" in line
  assert report.answer(sorted(rows, key=lambda r: r["eval_bpb"][0]), [], "eval_bpb").startswith(
      "Best: **num_heads=4**, held-out bits per byte 2.110 ± 0.010")


@pytest.mark.slow
def test_set_task_name_text_trains_quick_toml_with_no_other_setup(tmp_path, monkeypatch, capsys):
  from attn import cli
  monkeypatch.setenv("ATTN_JAX_CACHE", str(tmp_path / "jax"))
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = str(tmp_path / "run")
  code = cli.main(["sweep", os.path.join(root, "configs", "quick.toml"), "--out", out,
                   "--set", "task.name=text", "--set", "train.steps=1", "--set", "seed=0",
                   "--set", "model.num_heads=4", "--set", "model.variant=per_head",
                   "--set", "train.eval_batches=1", "--set", "train.batch_size=2"])
  assert code == 0
  (trial,) = os.listdir(os.path.join(out, "trials"))
  cfg = json.load(open(os.path.join(out, "trials", trial, "config.json")))
  assert cfg["task"] == {"name": "text", "path": "", "glob": "", "seq_len": 32, "bos": False}
  assert cfg["model"]["vocab_size"] == 256
  summary = json.load(open(os.path.join(out, "trials", trial, "summary.json")))
  # One step from init: held-out bits per byte near log2(256) = 8, as the report prints them.
  bpb = summary["final"]["eval_loss"] / math.log(2)
  assert summary["status"] == "ok" and 4 < bpb < 12
  md = open(os.path.join(out, "report.md")).read()
  assert f"held-out bits per byte {bpb:.3f}" in md and "| eval bits/byte |" in md
