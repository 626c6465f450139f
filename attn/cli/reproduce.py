"""`attn reproduce experiments/NAME [--trials K] [--seeds S ...] [--out DIR]`.

Re-runs a slice of a shipped write-up in a temporary store (by default one
trial per group, the best and the worst group first: the comparison the
write-up's answer makes) and compares each trial with the committed numbers
(attn.experiments.reading.reproduce: the work): one line per trial, then a
verdict, the commit and CPU of both runs. Exits 1 when a trial differs by more
than the seeds' spread, 2 on bad input.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

from attn.experiments.reading import reproduce as lib
from attn.experiments.running import run_record

TITLES = {"eval_accuracy": "held-out accuracy", "eval_bpb": "held-out bits per byte"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("writeup", metavar="WRITEUP", help="a shipped write-up directory, e.g. experiments/quick")
  parser.add_argument("--trials", metavar="K", type=int, default=None,
                      help="how many trials to re-run (default one per group; best and worst group first)")
  parser.add_argument("--seeds", metavar="S", nargs="+", default=None,
                      help="re-run only trials of these seeds (default: the first seed of each group)")
  parser.add_argument("--out", metavar="DIR", default=None,
                      help="keep the re-run's store here (default a temporary directory, removed after)")
  parser.add_argument("--replot", action="store_true",
                      help="train nothing: redraw the write-up's final_vs_*.png from its trials.json "
                      "(into --out, default the write-up's directory)")


def run(args: argparse.Namespace) -> int:
  w = lib.load_writeup(args.writeup)
  if args.replot:
    made = lib.replot(w, args.out)
    print(f"replot {w.path}: {', '.join(made) or 'nothing (matplotlib is not installed)'} into "
          f"{args.out or w.path} from {lib.COMMITTED}")
    return 0
  picked = lib.choose(w, args.trials, args.seeds)  # bad --trials/--seeds refused before any training
  sweep = lib.load_sweep(w)  # a config changed since the write-up ran is refused here
  out = args.out or tempfile.mkdtemp(prefix="attn-reproduce-")
  here = run_record.start_line()  # this run's commit and CPU, as `attn sweep` records them
  print(f"reproduce {w.path}: {len(picked)} of {len(w.trials)} trials, {TITLES[w.primary]}, committed numbers from "
        f"{lib.COMMITTED if w.exact else 'report.md (printed digits)'}", flush=True)
  t0 = time.perf_counter()
  try:
    finals = lib.run_slice(w, sweep, picked, out)
  finally:
    if args.out is None:
      shutil.rmtree(out, ignore_errors=True)
  wall = time.perf_counter() - t0
  lines, bad = lib.verdict_lines(w, picked, finals)
  print("\n".join(lines))
  print(f"committed run: {lib.describe_run(w.run)} ({os.path.join(w.path, 'run.json')})")
  print(f"this run:      {lib.describe_run(here)}, {wall:.0f} s for {len(picked)} trial{'s' * (len(picked) > 1)}")
  return 1 if bad else 0
