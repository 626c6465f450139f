"""`attn report DIR`: report.md and PNG plots from a sweep's store (the work: attn.experiments.reading.report)."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("dir", metavar="DIR", help="a sweep directory written by `attn sweep`")


def run(args: argparse.Namespace) -> int:
  from attn.experiments.reading import report
  from attn.experiments.running import run_record
  from attn.process import faults
  try:
    print(f"report: {report.write_report(args.dir)}")
  except OSError as e:  # a full disk under report.md or a plot: one message, the store is untouched
    fault = faults.classify(e)
    if fault is None:
      raise
    print(f"attn report: stopped: {fault.reason}: free space there, then run `attn report {args.dir}` again",
          file=sys.stderr)
    return 1
  for line in run_record.summary(args.dir):
    print(line)
  return 0
