"""Signal handlers of a process of the `attn` command, set in one place and put back from it.

Whoever handles a signal (the preemption save, a Slurm task's requeue, the
supervisor that passes a signal on to its children) sets its handler here:
`on` for the rest of the command (attn.process.setup(signals=...) and the
commands themselves), `handling` for a block. What each handler replaced is
remembered, so that `restore()` puts back what the process had before the
command; attn.cli.main(argv) called from Python does (attn.process.state.kept).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Callable, Iterator

Handler = Callable[[int, Any], Any]

_before: dict[int, Any] = {}  # signal -> its handler before `on` first set one


def _main_thread() -> bool:
  return threading.current_thread() is threading.main_thread()


def on(handlers: dict[int, Handler]) -> None:
  """Sets each signal's handler for the rest of the command (from the main thread; elsewhere Python cannot)."""
  for sig, handler in handlers.items():
    previous = signal.signal(sig, handler)
    _before.setdefault(sig, previous)


def restore() -> None:
  """Puts back every handler `on` replaced, as it was before the first `on`."""
  while _before:
    sig, handler = _before.popitem()
    signal.signal(sig, handler)


@contextlib.contextmanager
def handling(handlers: dict[int, Handler]) -> Iterator[None]:
  """Sets each signal's handler for the block, then puts back what it replaced."""
  previous = {sig: signal.signal(sig, handler) for sig, handler in handlers.items()}
  try:
    yield
  finally:
    for sig, handler in previous.items():
      signal.signal(sig, handler)


def snapshot() -> dict[int, Any]:
  """Every catchable signal's handler now (nothing outside the main thread, where none can be set)."""
  if not _main_thread():
    return {}
  out = {}
  for sig in signal.valid_signals():
    try:
      out[sig] = signal.getsignal(sig)
    except (OSError, ValueError):
      continue
  return out


def put_back(handlers: dict[int, Any]) -> None:
  """Sets the handlers of a snapshot again where they changed (None: a handler not set from Python, left)."""
  _before.clear()
  for sig, handler in handlers.items():
    if handler is not None and signal.getsignal(sig) is not handler:
      try:
        signal.signal(sig, handler)
      except (OSError, ValueError):
        continue
