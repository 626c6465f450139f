"""The `attn` command: thin dispatch to subcommands that live in the library."""

from __future__ import annotations

import argparse
import importlib
import sys
import warnings

from attn import host_memory
from attn.config import ConfigError
from attn.registry import PluginWarning

# subcommand -> module with add_arguments(parser) and run(args) -> int.
COMMANDS = {
    "demo": ("attn.demo", "answer the seed questions for one config in one screen"),
    "count": ("attn.count.cli", "parameter counts (analytic, stored, effective) and FLOPs per variant"),
    "sweep": ("attn.experiments.cli", "run a sweep config: trials, metrics, resumable store"),
    "report": ("attn.experiments.reading.report", "write report.md and plots from a sweep directory"),
    "status": ("attn.experiments.running.status", "each trial of a sweep directory: done, running, stale or pending; ETA"),
    "reproduce": ("attn.experiments.reproduce_cli", "re-run a slice of a shipped write-up and compare with its committed numbers"),
    "analyze": ("attn.experiments.reading.analyze", "inside the heads: circuits, attention statistics, importance, pruning"),
    "export": ("attn.experiments.reading.export", "write a sweep's metric rows from its store as TensorBoard runs"),
    "bench": ("attn.bench.layer", "time every variant against flax, jax and torch attention"),
    "eval": ("attn.eval_cli", "held-out loss of a pretrained Hugging Face model, before and after converting its heads"),
}


def _one_line(message, category, filename, lineno, line=None) -> str:
  """A plugin that failed to import is one line on stderr; other warnings as Python prints them."""
  if issubclass(category, PluginWarning):
    return f"attn: warning: {message}\n"
  return _FORMAT(message, category, filename, lineno, line)


_FORMAT = warnings.formatwarning


def main(argv: list[str] | None = None) -> int:
  warnings.formatwarning = _one_line
  parser = argparse.ArgumentParser(prog="attn", description=__doc__)
  sub = parser.add_subparsers(dest="command", metavar="COMMAND")
  for name, (module, help_text) in COMMANDS.items():
    p = sub.add_parser(name, help=help_text, description=help_text)
    p.set_defaults(_module=module)
    # Arguments are added lazily: only the chosen command's module is imported.
  argv = sys.argv[1:] if argv is None else argv
  if not argv or argv[0] not in COMMANDS:
    args = parser.parse_args(argv)  # prints help or the error for an unknown command
    parser.print_help()
    return 2
  module = importlib.import_module(COMMANDS[argv[0]][0])
  p = argparse.ArgumentParser(prog=f"attn {argv[0]}", description=COMMANDS[argv[0]][1])
  module.add_arguments(p)
  args = p.parse_args(argv[1:])
  try:
    host_memory.keep_freed_memory()  # before XLA's threads first allocate (attn.host_memory)
    return int(module.run(args) or 0)
  except ConfigError as e:
    print(f"attn {argv[0]}: error: {e}", file=sys.stderr)
    return 2
