"""Re-runs a slice of a shipped write-up (experiments/NAME) and compares each trial with its committed numbers.

The committed numbers come from experiments/NAME/trials.json (each trial's
final metrics at full precision, written by scripts/reproduce.py from the
store), or, for a write-up shipped before that file, from report.md's tables
(three significant digits; on `text`, bits per byte per seed to four
decimals). A re-run trial is bit-equal (every final metric identical; from a
report: equal at the printed digits), within the seeds' spread (the primary
metric moved by at most SPREAD standard deviations of the committed seeds of
its group), or different. One standard error here is the standard deviation
of one seed's value within its group (pooled over groups when a group has one
seed): the error of a single trial's number.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Any

import numpy as np

from attn.config import invalid
from attn.experiments.reading.plots import SEED_KEYS, short, show

COMMITTED = "trials.json"
SPREAD = 2.0
"""A re-run trial whose primary metric moved by more than this many of its group's seed standard deviations differs."""


@dataclasses.dataclass
class Writeup:
  """A shipped write-up: its directory, config, run record and committed per-trial numbers."""
  path: str
  name: str
  config: str
  primary: str
  trials: list[dict[str, Any]]  # id, label, final {metric: value}, in sweep order
  exact: bool  # full precision (trials.json) or printed digits (report.md)
  run: dict[str, Any]


def committed_trials(store: str) -> dict[str, Any]:
  """What experiments/NAME/trials.json holds: the sweep id and each finished trial's final metrics, from a store."""
  from attn.experiments.running import store as store_lib
  header = store_lib.load_sweep(store)
  trials = [{"id": t["id"], "label": t["label"], "final": t["summary"]["final"]}
            for t in store_lib.iter_trials(store) if t["summary"] and t["summary"]["status"] == "ok"]
  return {"sweep_id": header["sweep_id"], "config": header["config_path"], "trials": trials}


def _is_seed(key: str) -> bool:
  """train.seed in a store's label, seed in a report's."""
  return key in SEED_KEYS or key in {short(k) for k in SEED_KEYS}


def _group(label: dict[str, Any]) -> str:
  return ", ".join(f"{short(k)}={show(v)}" for k, v in label.items() if not _is_seed(k)) or "all"


def _seed(label: dict[str, Any]) -> Any:
  return next((v for k, v in label.items() if _is_seed(k)), None)


def _cells(line: str) -> list[str]:
  return [c.strip() for c in line.strip().strip("|").split("|")]


def _table(md: str, heading: str) -> list[dict[str, str]]:
  """The rows of the first Markdown table under `## heading`, as {column: cell}."""
  lines = md.split("\n")
  try:
    start = lines.index(f"## {heading}")
  except ValueError:
    return []
  block = []
  for l in lines[start + 1:]:
    if l.startswith("## "):
      break
    if l.startswith("|"):
      block.append(l)
    elif block:
      break
  if len(block) < 2:
    return []
  cols = _cells(block[0])
  return [dict(zip(cols, _cells(r))) for r in block[2:]]


def _number(cell: str) -> float | None:
  try:
    return float(cell.replace(",", ""))
  except ValueError:
    return None


def _parse_label(text: str) -> dict[str, Any]:
  label = {}
  for part in text.split(", "):
    key, _, value = part.partition("=")
    label[key] = value
  return label


def from_report(md: str, path: str) -> list[dict[str, Any]]:
  """Each trial's final metrics as report.md prints them (its Trials table; bits per byte from its Groups table)."""
  rows = _table(md, "Trials")
  if not rows or "id" not in rows[0] or "eval acc" not in rows[0]:
    raise invalid("WRITEUP", path, "a write-up whose report.md has a `## Trials` table with id and eval columns "
                  f"(or a {COMMITTED}); this one has none")
  trials = []
  for r in rows:
    if r.get("status") != "ok":
      continue
    final = {k: _number(r[c]) for k, c in (("loss", "train loss"), ("eval_loss", "eval loss"),
                                           ("eval_accuracy", "eval acc"))}
    trials.append({"id": r["id"], "label": _parse_label(r["trial"]), "final": final})
  per_seed = {g["group"]: [_number(v) for v in g["per seed (bits/byte)"].split(", ")]
              for g in _table(md, "Groups (mean ± std over seeds)") if "per seed (bits/byte)" in g}
  if per_seed:  # the report lists a group's seeds in the order of its trials
    seen: dict[str, int] = {}
    for t in trials:
      name = _group(t["label"])
      i = seen[name] = seen.get(name, -1) + 1
      values = per_seed.get(name, [])
      t["final"]["eval_bpb"] = values[i] if i < len(values) else None
  return trials


def _read_run(path: str) -> dict[str, Any]:
  """A write-up's run.json, with its copied run record's first line (commit, CPU) folded in; {} when missing or damaged."""
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
  except (OSError, json.JSONDecodeError):
    return {}
  if not isinstance(data, dict):
    return {}
  record = data.get("run_record")
  first = record[0] if isinstance(record, list) and record and isinstance(record[0], dict) else {}
  return {**first, **{k: v for k, v in data.items() if k != "run_record"}, "cpu": first.get("cpu") or data.get("cpu")}


def _checkouts(cwd: str) -> list[str]:
  """Checkouts of attn a write-up may belong to: the one holding cwd, then the one attn is imported from."""
  out = []
  here = os.path.abspath(cwd)
  while True:
    if os.path.isdir(os.path.join(here, "experiments")) and os.path.isdir(os.path.join(here, "configs")):
      out.append(here)
      break
    if os.path.dirname(here) == here:
      break
    here = os.path.dirname(here)
  package = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
  if os.path.isdir(os.path.join(package, "experiments")) and package not in out:
    out.append(package)
  return out


def resolve(path: str, cwd: str | None = None) -> str:
  """A write-up directory: `path` from the current directory, else from the checkout holding it or the
  one attn runs from (experiments/quick, or just quick); refused naming every place it looked."""
  cwd = cwd or os.getcwd()
  tried = [os.path.abspath(os.path.join(cwd, path))]
  if os.path.isdir(tried[0]) or os.path.isabs(path):
    return os.path.normpath(path)
  for root in _checkouts(cwd):
    bare = not os.path.normpath(path).startswith("experiments" + os.sep)
    for candidate in (os.path.join(root, path),) + ((os.path.join(root, "experiments", path),) if bare else ()):
      candidate = os.path.normpath(candidate)
      if candidate in tried:
        continue
      if os.path.isdir(candidate):
        return candidate
      tried.append(candidate)
  shipped = sorted(d for root in _checkouts(cwd)[:1] for d in os.listdir(os.path.join(root, "experiments"))
                   if os.path.isfile(os.path.join(root, "experiments", d, "report.md")))
  raise invalid("WRITEUP", path, "a directory of a shipped write-up; looked in " + ", ".join(tried)
                + (f" (write-ups there: {', '.join(shipped)})" if shipped else
                   " (no attn checkout holds the current directory: run from one, or give the write-up's path)"))


def load_writeup(path: str) -> Writeup:
  """The write-up at `path` (experiments/NAME, from the current directory or a checkout: resolve),
  refused by name unless it is one with a config in configs/."""
  path = resolve(path)
  name = os.path.basename(path)
  report = os.path.join(path, "report.md")
  config = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(path))), "configs", f"{name}.toml")
  if not (os.path.exists(os.path.join(path, "README.md")) and os.path.exists(report)):
    raise invalid("WRITEUP", path, "a shipped write-up: a directory experiments/NAME holding README.md and the "
                  "report.md of its sweep (this one lacks them)")
  if not os.path.exists(config):
    raise invalid("WRITEUP", path, f"a write-up of a sweep config: {os.path.relpath(config)} does not exist "
                  "(write-ups of scripts, such as pretrained_heads, are re-run by their script)")
  with open(report, encoding="utf-8") as f:
    md = f.read()
  committed = os.path.join(path, COMMITTED)
  if os.path.exists(committed):
    with open(committed, encoding="utf-8") as f:
      try:
        trials, exact = json.load(f)["trials"], True
      except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise invalid("WRITEUP", path, f"a write-up whose {COMMITTED} parses ({committed}: {e})") from None
  else:
    trials, exact = from_report(md, path), False
  if not trials:
    raise invalid("WRITEUP", path, "a write-up with at least one finished trial in its committed numbers")
  text = all("eval_bpb" in t["final"] for t in trials) or "bits/byte" in md.split("## Trials")[0]
  for t in trials:
    if text and "eval_bpb" not in t["final"] and t["final"].get("eval_loss") is not None:
      t["final"]["eval_bpb"] = t["final"]["eval_loss"] / math.log(2)
  return Writeup(path, name, config, "eval_bpb" if text else "eval_accuracy", trials, exact,
                 _read_run(os.path.join(path, "run.json")))


def check_config(w: Writeup, sweep_ids: list[str]) -> None:
  """Refuses a write-up whose config no longer resolves to the trials it ran (trial ids are config hashes)."""
  ran = [t["id"] for t in w.trials]
  missing = [i for i in ran if i not in sweep_ids]
  if missing:
    raise invalid("WRITEUP", w.path, f"a write-up whose config still resolves to the trials it ran: "
                  f"{os.path.relpath(w.config)} now gives trial ids that differ from {len(missing)} of the "
                  f"{len(ran)} committed ({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}): it changed "
                  f"since the write-up ran; re-run the whole sweep (python scripts/reproduce.py {w.name})")


def groups(w: Writeup) -> dict[str, list[dict[str, Any]]]:
  """The committed trials by group (label but the seed), best group first by the primary metric."""
  out: dict[str, list[dict[str, Any]]] = {}
  for t in w.trials:
    out.setdefault(_group(t["label"]), []).append(t)
  sign = 1.0 if w.primary == "eval_bpb" else -1.0
  mean = lambda ts: float(np.mean([t["final"][w.primary] for t in ts]))
  return dict(sorted(out.items(), key=lambda kv: sign * mean(kv[1])))


def choose(w: Writeup, k: int | None = None, seeds: list[Any] | None = None) -> list[dict[str, Any]]:
  """k trials (default one per group): the best and the worst group first, the others between, then more seeds."""
  if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
    raise invalid("--trials", k, f"a number of trials >= 1 (of the {len(w.trials)} committed; default one per group)")
  ranked = list(groups(w).values())
  if seeds is not None:
    known = sorted({str(_seed(t["label"])) for t in w.trials})
    unknown = [s for s in seeds if str(s) not in known]
    if unknown or not seeds:
      raise invalid("--seeds", seeds, f"seeds the write-up ran: {', '.join(known)}")
    ranked = [[t for t in ts if str(_seed(t["label"])) in map(str, seeds)] for ts in ranked]
    ranked = [ts for ts in ranked if ts]
  order = []  # best, worst, second best, second worst, ...: the answer's comparisons first
  lo, hi = 0, len(ranked) - 1
  while lo <= hi:
    order.append(ranked[lo])
    if hi != lo:
      order.append(ranked[hi])
    lo, hi = lo + 1, hi - 1
  picked = [t for depth in range(max(map(len, order))) for ts in order if depth < len(ts) for t in [ts[depth]]]
  return picked[:k if k is not None else len(order)]


def spread(w: Writeup, group: str) -> float:
  """One seed's standard deviation of the primary metric in `group` (pooled over groups when it has one seed)."""
  gs = groups(w)
  values = [t["final"][w.primary] for t in gs[group]]
  if len(values) > 1:
    return float(np.std(values, ddof=1))
  var = [np.var([t["final"][w.primary] for t in ts], ddof=1) for ts in gs.values() if len(ts) > 1]
  return float(math.sqrt(np.mean(var))) if var else 0.0


def _printed(x: float) -> str:
  return f"{x:.3g}"


def compare(w: Writeup, old: dict[str, Any], new: dict[str, Any]) -> tuple[str, float, float, float]:
  """(kind, committed, now, difference in standard errors) of one trial's primary metric; kind is
  "bit-equal", "equal at the printed digits", "within spread" or "different"."""
  a, b = old["final"][w.primary], new[w.primary]
  if w.exact and all(new.get(k) == v for k, v in old["final"].items() if k in new):
    return "bit-equal", a, b, 0.0
  if not w.exact and all(v is None or k not in new or
                         (f"{new[k]:.4f}" == f"{v:.4f}" if k == "eval_bpb" else _printed(new[k]) == _printed(v))
                         for k, v in old["final"].items()):
    return "equal at the printed digits", a, b, 0.0
  s = spread(w, _group(old["label"]))
  z = abs(b - a) / s if s > 0 else (0.0 if b == a else math.inf)  # seeds that all agree: only equal is within
  return ("within spread" if z <= SPREAD else "different"), a, b, z


def verdict_lines(w: Writeup, picked: list[dict[str, Any]], finals: dict[str, Any]) -> tuple[list[str], bool]:
  """One line per re-run trial (committed, now, the kind of match) and the verdict; (lines, whether any differs)."""
  lines, kinds = [], []
  for t in picked:
    label = ", ".join(f"{short(k)}={show(v)}" for k, v in t["label"].items())
    if t["id"] not in finals:
      kinds.append("failed")
      lines.append(f"  {t['id']}  {label}: did not finish")
      continue
    kind, a, b, z = compare(w, t, finals[t["id"]])
    kinds.append(kind)
    diff = "" if kind in ("bit-equal", "equal at the printed digits") else f", {b - a:+.4g} ({z:.1f} SE)"
    lines.append(f"  {t['id']}  {label}: committed {a:.6g}, now {b:.6g}: {kind}{diff}")
  bad = sum(k in ("different", "failed") for k in kinds)
  counts = ", ".join(f"{kinds.count(k)} {k}" for k in dict.fromkeys(kinds))
  lines.append(f"verdict: {'DIFFERS' if bad else 'REPRODUCED'} ({counts}; within spread = at most {SPREAD:g} "
               f"seed standard deviations of the committed group)")
  return lines, bool(bad)


def describe_run(run: dict[str, Any]) -> str:
  """'commit X, CPU Y, date' of a run record (run_record's start line, or an older run.json); "unknown" where it says nothing."""
  commit = (run.get("commit") or run.get("train_commit") or "unknown")[:12]
  if run.get("dirty"):
    commit += " (dirty)"
  when = run.get("start") or run.get("date") or "date unknown"
  return f"commit {commit}, CPU {run.get('cpu') or 'unknown'}, {when}"


def load_sweep(w: Writeup):
  """The write-up's config as a Sweep, refused when it no longer resolves to the committed trials."""
  from attn.experiments.running import config as config_lib
  sweep = config_lib.load(w.config)
  check_config(w, [t.id for t in sweep.trials])
  return sweep


def run_slice(w: Writeup, sweep: Any, picked: list[dict[str, Any]], out: str) -> dict[str, dict[str, Any]]:
  """Trains the picked trials of the write-up's sweep into the store `out`; their final metrics by id."""
  from attn.experiments.running import store as store_lib
  from attn.experiments.running import sweep as sweep_lib
  with open(w.config, encoding="utf-8") as f:
    sweep_lib.prepare(sweep, out, f.read(), [])
  sweep_lib.run_trials(out, [t["id"] for t in picked])
  finals = {}
  for t in store_lib.iter_trials(out):
    if t["summary"] and t["summary"]["status"] == "ok":
      final = dict(t["summary"]["final"])
      if "eval_loss" in final:
        final["eval_bpb"] = final["eval_loss"] / math.log(2)
      finals[t["id"]] = final
  return finals


def replot(w: Writeup, out_dir: str | None = None) -> list[str]:
  """Redraws a write-up's plots of final metrics (final_vs_AXIS.png) from its committed trials.json, without
  training; returns the files written. Learning curves need a store's rows: they are left as they are."""
  if not w.exact:
    raise invalid("WRITEUP", w.path, f"a write-up with a {COMMITTED} (its trials' labels and finals); "
                  "this one has only report.md's printed digits")
  from attn.experiments.reading import plots, report
  sweep = load_sweep(w)
  configs = {t.id: t.config for t in sweep.trials}
  trials = [{"id": t["id"], "label": t["label"], "config": configs[t["id"]], "rows": [],
             "summary": {"status": "ok", "final": dict(t["final"])}} for t in w.trials]
  text = report.add_bits_per_byte(trials)
  rows = report.summarize(trials, w.primary)
  return plots.make_plots(rows, trials, sweep.axes, out_dir or w.path,
                          plots.TEXT_METRICS if text else plots.METRICS, curves=False)
