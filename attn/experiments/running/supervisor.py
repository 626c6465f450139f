"""The one loop that watches a sweep's processes (local workers, a trial's group) and the one ending of `attn sweep`.

`supervise` waits for the children an executor started, passing SIGTERM and
SIGUSR1 (and, for a group, Ctrl-C) on to each so that it saves its trial and
stops, and printing the store's one-line status meanwhile. With `grace`
(the processes of one trial) the first child that ends with an error makes
the others end: they get `grace` seconds, then SIGKILL, so that no process
outlives its group as a writer.

`finish` reads the store once every executor has returned (or the trials
ran in this process) and says how the sweep stands in one place: the
machine's fault that stopped it (a full disk: one message, the path and what
to do), each interrupted trial and why (interrupted.json, or a worker of this
machine that is gone: the kernel's out-of-memory killer or a signal), and
how many trials are left for a re-run of the same command.
"""

from __future__ import annotations

import dataclasses
import signal
import sys
import time
from typing import Any, Callable, TextIO

from attn.experiments.running import status as status_lib
from attn.process import signals as process_signals


@dataclasses.dataclass
class Child:
  """A process the supervisor watches: its exit code (None while it runs), how to signal it and how to kill it."""
  name: str
  poll: Callable[[], int | None]
  signal: Callable[[int], None]
  kill: Callable[[], None]


def supervise(children: list[Child], out: str, prefix: str, lease_timeout: float, stream: TextIO = sys.stderr,
              grace: float | None = None, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGUSR1)) -> int:
  """Waits until every child has ended; returns the signal that stopped them (passed on to each), or 0."""
  stopping: list[int] = []

  def forward(signum: int, frame: Any) -> None:
    stopping.append(signum)
    for child in children:
      if child.poll() is None:
        child.signal(signal.SIGTERM if signum == signal.SIGINT else signum)

  tty = hasattr(stream, "isatty") and stream.isatty()
  last, broken = 0.0, None
  with process_signals.handling(dict.fromkeys(signals, forward)):
    while any(child.poll() is None for child in children):
      bad = [c for c in children if c.poll() not in (None, 0)]
      if grace is not None and bad and broken is None and not stopping:
        broken = time.monotonic()
        stream.write(f"\n{bad[0].name} ended with {bad[0].poll()}; stopping the others (SIGKILL after {grace:g} s)\n")
      if broken is not None and time.monotonic() - broken > grace:
        for child in children:
          if child.poll() is None:
            child.kill()
      last = status_lib.print_progress(stream, prefix, out, lease_timeout, last)
      time.sleep(0.2)
  if tty:
    stream.write("\n")
  return stopping[0] if stopping else 0


def finish(out: str, lease_timeout: float, stream: TextIO = sys.stderr, fault: str | None = None) -> int:
  """After the executors: the fault, the interrupted trials and the unfinished count, in one place; 0 when all ended."""
  trials = status_lib.collect(out, lease_timeout)
  interrupted = [t for t in trials if t["state"] == "interrupted"]
  unfinished = [t for t in trials if t["state"] not in ("ok", "failed")]
  if not unfinished and fault is None:
    return 0
  which = ", ".join(f"{t['index']}/{len(trials)} [{t['label']}]" for t in interrupted)
  if fault is None and interrupted:  # a worker of this machine that is gone, or a fault a worker's log holds
    fault = f"{interrupted[0]['reason']}: re-run the same command to resume"
  left = f"{len(unfinished)} trials unfinished" + (f"; interrupted: trial {which}" if which else "")
  if fault is not None:
    stream.write(f"attn sweep: stopped: {fault} ({left})\n")
  else:
    stream.write(f"{left}: re-run the same command to resume\n")
  return 1
