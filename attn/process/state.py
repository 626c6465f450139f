"""What a command may change in its process, kept: `kept()` puts it back as it was when the block ends.

attn.cli.main(argv) called from Python (a notebook, a test, a script) runs
the command in its caller's process inside `kept()`: the warnings' format and
filters, the signal handlers, sys.excepthook, sys.unraisablehook,
threading.excepthook, the filters of the loggers attn.process.hooks touches,
os.environ, and jax's configuration (where jax was imported before the call)
are as they were when it returns.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import warnings
from typing import Any, Iterator

from attn.process import hooks, signals


def _jax_config() -> dict[str, Any] | None:
  jax = sys.modules.get("jax")
  config = getattr(jax, "config", None)
  return dict(config.values) if config is not None and hasattr(config, "values") else None


@contextlib.contextmanager
def kept() -> Iterator[None]:
  """Runs the block, then puts back what it changed of the process (module docstring)."""
  formatwarning = warnings.formatwarning
  excepthook, unraisablehook, thread_hook = sys.excepthook, sys.unraisablehook, threading.excepthook
  loggers = {name: list(logging.getLogger(name).filters) for name in hooks.LOGGERS}
  environ, handlers, jax_config = dict(os.environ), signals.snapshot(), _jax_config()
  try:
    with warnings.catch_warnings():  # the filters and showwarning, put back as the module knows how
      yield
  finally:
    warnings.formatwarning = formatwarning
    sys.excepthook, sys.unraisablehook, threading.excepthook = excepthook, unraisablehook, thread_hook
    for name, kept_filters in loggers.items():
      logging.getLogger(name).filters[:] = kept_filters
    for key in set(os.environ) - set(environ):
      del os.environ[key]
    os.environ.update({k: v for k, v in environ.items() if os.environ.get(k) != v})
    signals.put_back(handlers)
    if jax_config is not None:
      import jax
      for name, value in jax_config.items():
        if jax.config.values.get(name) != value:
          jax.config.update(name, value)
