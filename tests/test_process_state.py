"""attn.cli.main(argv) from Python leaves its caller's process as it found it; signal handlers are set in one place."""

import ast
import json
import logging
import os
import signal
import sys
import threading
import types
import warnings

import jax

from attn import cli, process
from attn.experiments.training import preempt

ATTN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "attn")
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


def _changes_everything(args) -> int:
  """A command that changes every piece of process state a command may touch."""
  preempt.install_handlers()  # SIGTERM and SIGUSR1, as `attn sweep --workers 1` does
  process.signals.on({signal.SIGUSR2: lambda s, f: None})
  os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
  os.environ.pop("ATTN_TEST_KEPT", None)
  os.environ["ATTN_TEST_CHANGED"] = "after"
  process.quiet()  # sys.unraisablehook, threading.excepthook, the loggers' filters
  sys.excepthook = lambda *a: None
  logging.getLogger("absl").addFilter(logging.Filter("x"))
  warnings.simplefilter("ignore")
  jax.config.update("jax_default_matmul_precision", "highest")
  return 0


def _state():
  return {"formatwarning": warnings.formatwarning, "showwarning": warnings.showwarning,
          "filters": list(warnings.filters), "handlers": {s: signal.getsignal(s) for s in SIGNALS},
          "environ": dict(os.environ), "hooks": (sys.excepthook, sys.unraisablehook, threading.excepthook),
          "loggers": {n: list(logging.getLogger(n).filters) for n in ("absl", "asyncio", "concurrent.futures")},
          "precision": jax.config.values["jax_default_matmul_precision"]}


def test_main_from_python_puts_back_each_thing_a_command_changed(monkeypatch):
  fake = types.ModuleType("attn_fake_command")
  fake.add_arguments, fake.run = (lambda p: None), _changes_everything
  monkeypatch.setitem(sys.modules, "attn_fake_command", fake)
  monkeypatch.setitem(cli.COMMANDS, "fake", ("attn_fake_command", "changes everything"))
  monkeypatch.setenv("ATTN_TEST_KEPT", "1")
  monkeypatch.setenv("ATTN_TEST_CHANGED", "before")
  mine = lambda s, f: None
  previous = {s: signal.signal(s, mine) for s in SIGNALS}
  try:
    before = _state()
    assert cli.main(["fake"]) == 0
    after = _state()
  finally:
    for s, h in previous.items():
      signal.signal(s, h)
  assert after["handlers"] == {s: mine for s in SIGNALS}
  for key in before:
    assert after[key] == before[key], key


def test_a_real_command_leaves_the_warnings_format(tmp_path, capsys):
  (tmp_path / "config.json").write_text(json.dumps(
      {"model_type": "llama", "vocab_size": 11, "hidden_size": 8, "intermediate_size": 12, "num_hidden_layers": 1,
       "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4, "max_position_embeddings": 16}))
  before = warnings.formatwarning
  assert cli.main(["count", "--hf", str(tmp_path), "--format", "json"]) == 0
  assert json.loads(capsys.readouterr().out)["total"] > 0
  assert warnings.formatwarning is before


def test_signal_handlers_are_set_only_by_attn_process_signals():
  found = []
  for root, _, files in os.walk(ATTN):
    for f in files:
      path = os.path.join(root, f)
      if not f.endswith(".py") or path == os.path.join(ATTN, "process", "signals.py"):
        continue
      text = open(path, encoding="utf-8").read()
      if "signal" not in text:  # no call of signal.signal can be in it: not parsed (most files; a faster test)
        continue
      for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "signal" \
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "signal":
          found.append(f"{os.path.relpath(path, ATTN)}:{node.lineno}")
  assert found == []
