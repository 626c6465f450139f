"""Preemption: on SIGTERM or SIGUSR1 (or submitit's checkpoint()), save the running trials and stop.

Sweeps train in a worker thread (`run`) while the main thread waits, so a signal
handler, which Python runs in the main thread, never cuts a train step, an
Orbax save or a metrics row in half. save_now() asks the worker thread to stop
and waits for it: at the end of its current step the training loop
(attn.experiments.training.train) saves each trial it trains at that step N and waits
until Orbax has renamed the checkpoint into place; the sweep fsyncs the
trials' partial metrics (rows 0..N-1: the checkpoint's) and releases their
leases. Whoever runs a trial next resumes from N and keeps rows < N (the
store's rule): no row lost or written twice. A trial still compiling stops
before its first step (it keeps the checkpoint it started from), so save_now
waits at most one compile or one step. In a trial of several processes
(attn.experiments.training.distributed) the loop asks after every step
whether any of them was asked to stop, so all save and stop at the same step
(process 0 writing the checkpoint); Orbax's own preemption sync is not used.

`attn sweep` calls install_handlers(); its local workers and a trial's
processes pass handlers() to attn.process.setup(), which sets them (through
attn.process.signals, the one place handlers are set and put back); a Slurm
task leaves submitit's handler in place, whose checkpoint() calls save_now().
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any, Callable, TextIO

from attn.process import signals

_requested = threading.Event()
_threads: list[threading.Thread] = []
_saved: list[tuple[str, int]] = []  # (trial, step it resumes from), of the last stop


class Preempted(BaseException):
  """Raised in the training thread after a requested save: the trial stops without a summary."""

  def __init__(self, step: int):
    super().__init__(f"preempted at step {step}")
    self.step = step


def requested() -> bool:
  """True once save_now() has asked the running trials to save and stop."""
  return _requested.is_set()


def sleep(seconds: float) -> bool:
  """Waits up to `seconds`; True (at once) when save_now() asks the trials to stop."""
  return _requested.wait(seconds)


def record(trial: str, step: int) -> None:
  """Notes that `trial` stopped for preemption and resumes from `step` (for the exit message)."""
  _saved.append((trial, step))


def saved() -> list[tuple[str, int]]:
  """(trial, step) of each trial stopped by the last save_now()."""
  return list(_saved)


def run(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
  """fn(*args, **kwargs) in a worker thread that save_now() can stop; its result, or its exception."""
  _requested.clear()
  _saved.clear()
  box: dict[str, Any] = {}

  def target() -> None:
    try:
      box["value"] = fn(*args, **kwargs)
    except BaseException as e:  # handed to the waiting thread
      box["error"] = e

  thread = threading.Thread(target=target, name="attn training", daemon=True)
  _threads.append(thread)
  thread.start()
  try:
    while thread.is_alive():
      # Signal handlers run in this thread, at the latest when a wait ends: a signal the kernel
      # hands to another thread (XLA's) does not cut the wait short, so keep it short.
      thread.join(0.05)
  except KeyboardInterrupt:
    save_now()
    raise
  finally:
    if not thread.is_alive():
      _threads.remove(thread)
  if "error" in box:
    raise box["error"]
  return box["value"]


def save_now() -> None:
  """Saves the running trials at their last completed step, releases their leases, stops them; no-op if none."""
  running = [t for t in _threads if t.is_alive() and t is not threading.current_thread()]
  if not running:
    return
  _requested.set()
  for thread in running:
    thread.join()


def message(reason: str) -> str:
  """The one-line exit message after save_now(): which trials stopped at which step."""
  if not _saved:
    return f"{reason}: no trial was training; re-run the same command to resume"
  steps = sorted({s for _, s in _saved})
  where = f"step {steps[0]}" if len(steps) == 1 else f"steps {', '.join(map(str, steps))}"
  trials = ", ".join(t for t, _ in _saved)
  return f"{reason}: preempted at {where} of trial{'s' if len(_saved) > 1 else ''} {trials}; " \
         "re-run the same command to resume"


def install_handlers(stream: TextIO = sys.stderr) -> None:
  """SIGTERM and SIGUSR1 -> save_now(), a one-line message, exit 128 + the signal's number (handlers())."""
  signals.on(handlers(stream))


def handlers(stream: TextIO = sys.stderr) -> dict[int, Callable[[int, Any], None]]:
  """The handlers install_handlers sets, for attn.process.setup(signals=...)."""
  handling = threading.Lock()

  def handler(signum: int, frame: Any) -> None:
    if not handling.acquire(blocking=False):
      return  # a second signal while the first is being handled
    save_now()
    stream.write(message(signal.Signals(signum).name) + "\n")
    stream.flush()
    sys.exit(128 + signum)

  return {signal.SIGTERM: handler, signal.SIGUSR1: handler}
