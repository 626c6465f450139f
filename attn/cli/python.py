"""`attn python [ARGS]`: python ARGS with the command's allocator (mimalloc preloaded); `--print-env` prints
its variables. The work is attn.process.python; the arguments are python's own, so attn.cli.main passes
them on unparsed."""

from __future__ import annotations

from attn import process


def passthrough(argv: list[str]) -> int:
  """Execs python with argv (or prints the allocator's variables for --print-env)."""
  return process.python(argv)
