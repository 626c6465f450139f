"""TensorBoard curves: a trial's metric rows as event files, one run per trial (tensorboardX, an optional extra).

`attn sweep CONFIG --tensorboard LOGDIR` writes each trial's rows as it trains
them; `attn export DIR --tensorboard LOGDIR` (attn.experiments.reading.export)
writes them from a store. A trial's run is LOGDIR/<label>-<id>, e.g.
LOGDIR/num_heads=4,seed=0-3f2a9c1b7d04; every key of a row but "step" is a
scalar of that name at global step = the row's step.

The store stays the source of truth. A row goes to TensorBoard only once the
store has it; an error while writing events is reported once, after which that
worker writes no more events, and it never fails, stops or changes a trial.
Each time a trial starts (from step 0, or resumed from its checkpoint at step N)
its run is rewritten: the run's earlier event files are deleted and the rows
the store keeps (steps < N) are written again before the new ones, after a
SessionLog START at step 0 (what SummaryWriter's purge_step writes: a
TensorBoard that had read the old files drops their steps), so each step shows
once even where a killed worker had written rows past its checkpoint. Writers
name their files by host, pid and start time: several workers (--workers N,
Slurm tasks) never overwrite one another. Events are flushed every few seconds
and when the trial ends.

A fault of the machine there (no space under LOGDIR, an I/O error) lets the
trial in progress finish and then stops the sweep with one message, as a
full disk under the store does: a re-run writes the remaining trials' events.

Events go through tensorboardX's synchronous EventsWriter, one Event per row,
not its SummaryWriter: SummaryWriter hands events to a writer thread through a
bounded queue, and once a write fails (a full disk) that thread is gone, the
11th add_scalar after it blocks for good and the process hangs at exit
(tensorboardX 2.6.5). Written here, a failed write raises in the training
thread, where it is caught and reported.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Any, Iterable, TextIO

from attn.config import invalid
from attn.experiments.running.config import axis_name, show
from attn.process import faults

EXTRA = 'pip install -e ".[tensorboard]"'
PREFIX = "events.out.tfevents."


def check(logdir: str, flag: str = "--tensorboard") -> str:
  """logdir as an absolute path, once tensorboardX imports; refused by `flag` otherwise or when it is a file."""
  try:
    import tensorboardX  # noqa: F401
  except ImportError:
    raise invalid(flag, logdir, f"an install with tensorboardX, the optional extra: {EXTRA}") from None
  if os.path.exists(logdir) and not os.path.isdir(logdir):
    raise invalid(flag, logdir, "a directory for TensorBoard's runs; it is an existing file")
  return os.path.abspath(logdir)


def run_name(trial_id: str, label: dict[str, Any]) -> str:
  """`num_heads=4,seed=0-<id>`: the trial's axis values (short keys) and its id; just the id without axes."""
  values = ",".join(f"{axis_name(k)}={show(v)}" for k, v in label.items())
  name = f"{values}-{trial_id}" if values else trial_id
  return name.replace("/", "_").replace(os.sep, "_")


def add_row(writer: Any, row: dict[str, Any]) -> None:
  """One event: every number of a row but its step, a scalar of its key at the row's step."""
  from tensorboardX.proto.event_pb2 import Event
  from tensorboardX.proto.summary_pb2 import Summary
  values = [Summary.Value(tag=key, simple_value=float(value)) for key, value in row.items()
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)]
  writer.write_event(Event(wall_time=time.time(), step=row["step"], summary=Summary(value=values)))


class Writer:
  """One tensorboardX EventsWriter per trial being written, under logdir.

  strict=False (a sweep's workers): the first error is written to `stream`
  and turns this writer off; strict=True (export): errors are raised.
  """

  def __init__(self, logdir: str, stream: TextIO = sys.stderr, strict: bool = False, flush_secs: int = 5):
    self.logdir, self.stream, self.strict, self.flush_secs = logdir, stream, strict, flush_secs
    self.error: str | None = None
    self.fault: faults.Fault | None = None  # a full disk under LOGDIR: the sweep stops after the trial in progress
    self._open: dict[str, Any] = {}
    self._flushed: dict[str, float] = {}

  def _guard(self, what: str, fn, *args) -> None:
    if self.error is not None:
      return
    if self.strict:
      fn(*args)
      return
    try:
      fn(*args)
    except Exception as e:  # anything: TensorBoard must never stop a trial
      self.error = f"{type(e).__name__}: {e}"
      self.fault = faults.classify(e)
      if self.fault is not None and self.fault.path is None:  # tensorboardX's writes name no file
        self.fault = dataclasses.replace(self.fault, path=self.logdir)
      self.stream.write(f"warning: TensorBoard: {what} failed ({self.error}); this worker writes no more "
                        f"events (the store has every row: `attn export DIR --tensorboard {self.logdir}` "
                        "writes them from it)\n")
      for w in self._open.values():
        try:
          w.close()
        except Exception:
          pass
      self._open.clear()

  def start(self, trial_id: str, label: dict[str, Any], rows: Iterable[dict[str, Any]] = ()) -> None:
    """(Re)writes the trial's run: its earlier event files go, the given rows (those the store keeps) come first."""
    self._guard(f"starting the run of trial {trial_id}", self._start, trial_id, label, list(rows))

  def _start(self, trial_id: str, label: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    from tensorboardX.event_file_writer import EventsWriter  # lazy: an optional extra
    from tensorboardX.proto.event_pb2 import Event, SessionLog
    self._close(trial_id)
    d = os.path.join(self.logdir, run_name(trial_id, label))
    os.makedirs(d, exist_ok=True)
    for name in os.listdir(d):
      if name.startswith(PREFIX):
        os.remove(os.path.join(d, name))
    writer = EventsWriter(os.path.join(d, "events"), f".{time.time_ns()}.{os.getpid()}")
    self._open[trial_id] = writer
    writer.write_event(Event(wall_time=time.time(), step=0, session_log=SessionLog(status=SessionLog.START)))
    for row in rows:
      add_row(writer, row)
    writer.flush()
    self._flushed[trial_id] = time.monotonic()

  def row(self, trial_id: str, row: dict[str, Any]) -> None:
    """One new row of a started trial (after the store has it); flushed every flush_secs."""
    if trial_id in self._open:
      self._guard(f"writing step {row.get('step')} of trial {trial_id}", self._row, trial_id, row)

  def _row(self, trial_id: str, row: dict[str, Any]) -> None:
    writer = self._open[trial_id]
    add_row(writer, row)
    if time.monotonic() - self._flushed[trial_id] >= self.flush_secs:
      writer.flush()
      self._flushed[trial_id] = time.monotonic()

  def close(self, trial_id: str) -> None:
    """Flushes and closes the trial's event file."""
    self._guard(f"closing the run of trial {trial_id}", self._close, trial_id)

  def _close(self, trial_id: str) -> None:
    writer = self._open.pop(trial_id, None)
    self._flushed.pop(trial_id, None)
    if writer is not None:
      writer.close()

  def close_all(self) -> None:
    for trial_id in list(self._open):
      self.close(trial_id)
