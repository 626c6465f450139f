"""`attn export DIR --tensorboard LOGDIR`: a sweep's metric rows, read from its store, as TensorBoard runs.

The work: attn.experiments.reading.export.export_tensorboard (its docstring says which runs and rows).
"""

from __future__ import annotations

import argparse
import os


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("dir", metavar="DIR", help="a sweep directory written by `attn sweep`")
  parser.add_argument("--tensorboard", metavar="LOGDIR", required=True,
                      help="the TensorBoard log directory to write one run per trial into "
                           '(needs: pip install -e ".[tensorboard]")')


def run(args: argparse.Namespace) -> int:
  from attn.experiments.reading.export import export_tensorboard
  counts = export_tensorboard(args.dir, args.tensorboard)
  left = [f"{counts[k]} {k}" for k in ("unfinished", "damaged") if counts[k]]
  print(f"tensorboard: {counts['runs']} runs, {counts['rows']} rows in {os.path.abspath(args.tensorboard)}"
        + (f" ({', '.join(left)} trials left out: export again once they finish)" if left else ""))
  print(f"view: tensorboard --logdir {args.tensorboard}")
  return 0
