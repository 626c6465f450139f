"""`attn sweep CONFIG [--out DIR] [--set KEY=VALUE ...] [--analyze]`: run a sweep config, then write its report."""

from __future__ import annotations

import argparse
import os

from attn.experiments import config as config_lib


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("config", metavar="CONFIG", help="a sweep config, e.g. configs/quick.toml")
  parser.add_argument("--out", metavar="DIR", default=None,
                      help="the store directory (default runs/<config name>); re-running resumes")
  parser.add_argument("--set", metavar="KEY=VALUE", action="append", default=[], dest="overrides",
                      help="override a config key, e.g. --set train.steps=50 (repeatable)")
  parser.add_argument("--no-report", action="store_true", help="skip writing DIR/report.md at the end")
  parser.add_argument("--analyze", action="store_true",
                      help="run `attn analyze` on the trained trials before the report "
                           "(also: [analysis] enabled = true in the config)")


def run(args: argparse.Namespace) -> int:
  sweep = config_lib.load(args.config, args.overrides)  # every check happens before any training
  out = args.out or os.path.join("runs", os.path.splitext(os.path.basename(args.config))[0])
  with open(args.config, encoding="utf-8") as f:
    text = f.read()
  from attn.experiments import sweep as sweep_lib  # lazy: jax
  counts = sweep_lib.run_sweep(sweep, out, config_text=text, overrides=args.overrides)
  if (args.analyze or sweep.analyze) and counts["ok"] + counts["skipped"]:
    from attn.experiments import analyze
    analyze.analyze_sweep(out)
  if not args.no_report:
    from attn.experiments import report
    path = report.write_report(out)
    print(f"report: {path}")
  return 0
