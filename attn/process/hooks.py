"""The exception hooks of a process of the `attn` command: one message per fault of the machine.

`quiet()` keeps the failure of a background write to the one message the sweep
prints (attn.process.faults): Orbax logs the same error with a traceback from
each of its threads (absl's logger) and leaves an "Event loop is closed" for
sys.unraisablehook; those records of a fault are dropped, everything else
passes. attn.process.setup() calls it; importing this module installs nothing.
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any

from attn.process.faults import OS_CODE, classify

LOGGERS = ("absl", "concurrent.futures", "asyncio")  # where Orbax's threads log a failed write


class _DropFaults(logging.Filter):
  def filter(self, rec: logging.LogRecord) -> bool:
    if rec.exc_info and rec.exc_info[1] is not None and classify(rec.exc_info[1]):
      return False
    return not (rec.levelno >= logging.ERROR and OS_CODE.search(rec.getMessage() or ""))


_FILTER = _DropFaults()


def quiet() -> None:
  """Drops Orbax's logged copies of a fault and its leftover unraisable errors; other errors pass (idempotent).

  Process-wide (logging filters, sys.unraisablehook, threading.excepthook):
  attn.process.setup() calls it for the `attn` command; a library user may.
  """
  for name in LOGGERS:
    logger = logging.getLogger(name)
    if _FILTER not in logger.filters:
      logger.addFilter(_FILTER)
  if getattr(sys.unraisablehook, "_attn", False):
    return
  previous_unraisable, previous_thread = sys.unraisablehook, threading.excepthook

  def unraisable(u: Any) -> None:
    if u.exc_value is not None and (classify(u.exc_value) or str(u.exc_value) == "Event loop is closed"):
      return  # asyncio's loop of a failed Orbax save, closed under its callbacks
    previous_unraisable(u)

  def thread_hook(a: Any) -> None:
    fault = classify(a.exc_value) if a.exc_value is not None else None
    if fault is None:
      previous_thread(a)
    else:
      sys.stderr.write(f"attn: thread {a.thread.name if a.thread else '?'}: {fault.what}"
                       f"{f' writing {fault.path}' if fault.path else ''}\n")

  unraisable._attn = True  # type: ignore[attr-defined]
  sys.unraisablehook, threading.excepthook = unraisable, thread_hook
