"""Rewrites the `attn count` tables in experiments/parameter_counts/README.md.

Each table sits between `<!-- attn count ARGS -->` and `<!-- /attn count -->`;
this script runs `attn count ARGS` and puts its output there (without the first
line, which restates the layer). tests/test_count.py checks that the files hold
exactly what the command prints, so run this after changing a count.

  python scripts/count_tables.py          # rewrite in place
  python scripts/count_tables.py --check  # exit 1 if a table is stale
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = (os.path.join("experiments", "parameter_counts", "README.md"),)
BLOCK = re.compile(r"(<!-- attn count (.*?) -->\n)(.*?)(<!-- /attn count -->)", re.S)


def count_output(args: str) -> str:
  """What `attn count ARGS` prints, minus a leading 'One attention layer' line."""
  from attn import cli
  buf = io.StringIO()
  with contextlib.redirect_stdout(buf):
    code = cli.main(["count", *shlex.split(args)])
  if code != 0:
    raise SystemExit(f"count_tables: `attn count {args}` exited {code}")
  chunks = [c for c in buf.getvalue().strip().split("\n\n") if not c.startswith("One attention layer")]
  return "\n\n".join(chunks) + "\n"


def refresh(text: str) -> str:
  return BLOCK.sub(lambda m: m.group(1) + "\n" + count_output(m.group(2)) + "\n" + m.group(4), text)


def main(argv: list[str]) -> int:
  stale = []
  for name in FILES:
    path = os.path.join(ROOT, name)
    with open(path, encoding="utf-8") as f:
      old = f.read()
    new = refresh(old)
    if new != old:
      stale.append(name)
      if "--check" not in argv:
        with open(path, "w", encoding="utf-8") as f:
          f.write(new)
  print(("stale: " if "--check" in argv else "rewrote: ") + (", ".join(stale) or "nothing"))
  return 1 if stale and "--check" in argv else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
