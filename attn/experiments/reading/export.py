"""`attn export DIR --tensorboard LOGDIR`: a sweep's metric rows, read from its store, as TensorBoard runs.

One run per finished trial (ok or failed), named as `attn sweep --tensorboard`
names it: LOGDIR/<settings>-<id>, e.g. LOGDIR/num_heads=4,seed=0-3f2a9c1b7d04
(attn.experiments.running.tb_writer), every key of a row but "step" a scalar
at the row's step. A run that LOGDIR already holds (from a live sweep or an
earlier export) is rewritten, so exporting again shows every step once.
Unfinished trials are left out, and said so: export again once they finish
(or watch them live with `attn sweep --tensorboard`). Rows the store leaves
out (a torn last line) are named, as `attn report` names them. Needs the
tensorboard extra (tensorboardX): pip install -e ".[tensorboard]".
"""

from __future__ import annotations

import sys
from typing import TextIO

from attn.config import invalid
from attn.experiments.running import store as store_lib
from attn.experiments.running import tb_writer


def export_tensorboard(root: str, logdir: str, stream: TextIO = sys.stderr) -> dict[str, int]:
  """Writes every finished trial's rows to logdir; returns counts of runs, rows and trials left out."""
  logdir = tb_writer.check(logdir)
  store_lib.load_sweep(root)  # refused by name before anything is written
  trials = list(store_lib.iter_trials(root))
  writer = tb_writer.Writer(logdir, stream, strict=True)
  counts = {"runs": 0, "rows": 0, "unfinished": 0, "damaged": 0}
  try:
    for t in trials:
      for w in ([t["damaged"]] if t["damaged"] else []) + t["warnings"]:
        stream.write(f"warning: {w}\n")
      if t["summary"] is None:
        counts["damaged" if t["damaged"] else "unfinished"] += 1
        continue
      writer.start(t["id"], t["label"], t["rows"])
      writer.close(t["id"])
      counts["runs"] += 1
      counts["rows"] += len(t["rows"])
  except OSError as e:
    raise invalid("--tensorboard", logdir, f"a directory TensorBoard's runs can be written to ({e})") from None
  finally:
    writer.close_all()
  return counts


