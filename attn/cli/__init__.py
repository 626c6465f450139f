"""The `attn` command: thin dispatch to subcommands that live in the library.

Every command is attn/cli/NAME.py with add_arguments(parser) and run(args) -> int: its
arguments and a call into the library, where the work lives (the module's docstring
names where); `attn python` passes its arguments on unparsed (attn/cli/python.py). The old paths (attn.demo's and attn.eval_cli's commands,
attn.count.cli, attn.experiments.cli, attn.experiments.reproduce_cli) re-export them.

Run as a command (`attn ...`, `python -m attn ...`: main() without argv),
attn.process.setup() sets up the process first (its allocator, hooks, fault
injection; XLA_FLAGS and ATTN_HOST_MALLOC checked); main(argv) called from
Python runs the subcommand in the caller's process and leaves it as it found
it: what the command changed (the warnings' format, signal handlers, hooks,
os.environ, jax's config) is put back on return (attn.process.kept).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import warnings

from attn import process

# subcommand -> module with add_arguments(parser) and run(args) -> int ("python": passthrough(argv) -> int).
COMMANDS = {
    "demo": ("attn.cli.demo", "answer the seed questions for one config in one screen"),
    "count": ("attn.cli.count", "parameter counts (analytic, stored, effective) and FLOPs per variant"),
    "sweep": ("attn.cli.sweep", "run a sweep config: trials, metrics, resumable store"),
    "report": ("attn.cli.report", "write report.md and plots from a sweep directory"),
    "status": ("attn.cli.status", "each trial of a sweep directory: done, running, stale or pending; ETA"),
    "reproduce": ("attn.cli.reproduce", "re-run a slice of a shipped write-up and compare with its committed numbers"),
    "analyze": ("attn.cli.analyze", "inside the heads: circuits, attention statistics, importance, pruning"),
    "export": ("attn.cli.export", "write a sweep's metric rows from its store as TensorBoard runs"),
    "bench": ("attn.cli.bench", "time every variant against flax, jax and torch attention"),
    "eval": ("attn.cli.eval", "held-out loss of a pretrained Hugging Face model, before and after converting its heads"),
    "python": ("attn.cli.python", "run python ARGS with this command's allocator (mimalloc preloaded); "
               "--print-env prints its variables"),
}


def _one_line(message, category, filename, lineno, line=None) -> str:
  """A plugin that failed to import is one line on stderr; other warnings as Python prints them."""
  from attn.registry import PluginWarning
  if issubclass(category, PluginWarning):
    return f"attn: warning: {message}\n"
  return _FORMAT(message, category, filename, lineno, line)


_FORMAT = warnings.formatwarning


def _config_error() -> type[Exception]:
  from attn.config import ConfigError  # imports jax: after the process is set up
  return ConfigError


def main(argv: list[str] | None = None) -> int:
  """The `attn` command; argv None: this process is the command's (process.setup() first), else the
  caller's, left as it was found (process.kept)."""
  own_process = argv is None
  argv = sys.argv[1:] if argv is None else argv
  command = argv[0] if argv and argv[0] in COMMANDS else None
  try:
    if command == "python":  # its arguments are python's own, passed on as they are
      return importlib.import_module(COMMANDS[command][0]).passthrough(argv[1:])
    if own_process and command:
      process.setup()
  except _config_error() as e:  # evaluated only when an error is on its way
    print(f"attn {command}: error: {e}", file=sys.stderr)
    return 2
  if own_process:
    return _run(argv, command)
  with process.kept():
    return _run(argv, command)


def _run(argv: list[str], command: str | None) -> int:
  warnings.formatwarning = _one_line
  parser = argparse.ArgumentParser(prog="attn", description=__doc__.splitlines()[0])
  sub = parser.add_subparsers(dest="command", metavar="COMMAND")
  for name, (module, help_text) in COMMANDS.items():
    p = sub.add_parser(name, help=help_text, description=help_text)
    p.set_defaults(_module=module)
    # Arguments are added lazily: only the chosen command's module is imported.
  if command is None:
    args = parser.parse_args(argv)  # prints help or the error for an unknown command
    parser.print_help()
    return 2
  module = importlib.import_module(COMMANDS[command][0])
  p = argparse.ArgumentParser(prog=f"attn {command}", description=COMMANDS[command][1])
  module.add_arguments(p)
  args = p.parse_args(argv[1:])
  try:
    return int(module.run(args) or 0)
  except _config_error() as e:
    print(f"attn {command}: error: {e}", file=sys.stderr)
    return 2
