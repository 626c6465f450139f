"""XLA_FLAGS checked before jax starts: what XLA would abort on is refused by name.

XLA aborts the process (a fatal log line, SIGABRT) when a backend
first starts and XLA_FLAGS holds a flag it does not know, or a value whose
first token lacks `--` and names no file (XLA reads such a value as a file of
flags); a later token without `--` it ignores silently (`--flag 2`: the 2 is
lost). Decided here: a token without `--` is refused at once; whether XLA
knows each flag is asked of XLA itself, in a child `python -c "import jax;
jax.devices()"` with the same XLA_FLAGS (and no preload), whose fatal line
"Unknown flag in XLA_FLAGS: --NAME" names the flag. A list of known flags kept
here would go stale with every jaxlib (flags come and go each release); the
probe cannot. It costs one jax start (about 0.5 s on CPU, more where a GPU
starts), once per command, nothing when XLA_FLAGS is unset, and nothing in
attn's own children: ATTN_XLA_FLAGS_CHECKED carries the value already checked.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

from attn.process.allocator import clean_env

XLA_CHECKED = "ATTN_XLA_FLAGS_CHECKED"  # the XLA_FLAGS value check_xla_flags() has accepted
_XLA_PROBE = "import jax; jax.devices()"
_UNKNOWN_FLAG = re.compile(r"Unknown flags? in XLA_FLAGS: (.*)")


def check_xla_flags() -> None:
  """Refuses, by name, XLA_FLAGS that XLA would abort on (module docstring); once per value, none when unset."""
  flags = os.environ.get("XLA_FLAGS", "")
  if not flags.strip() or os.environ.get(XLA_CHECKED) == flags:
    return
  from_file = len(flags.split()) == 1 and not flags.strip().startswith("-") and os.path.isfile(flags.strip())
  bare = [] if from_file else [t for t in flags.split() if not t.startswith("--")]
  if bare:
    from attn.config import invalid
    raise invalid("XLA_FLAGS", flags, f"flags --NAME=VALUE separated by spaces, or the path of a file of them "
                  f"({bare[0]!r} does not start with --: XLA "
                  f"{'ignores it' if flags.split()[0].startswith('--') else 'reads it as a file name and aborts'})")
  try:
    probe = subprocess.run([sys.executable, "-c", _XLA_PROBE], env={**clean_env(), "XLA_FLAGS": flags},
                           capture_output=True, text=True, timeout=300)
  except (OSError, subprocess.TimeoutExpired):
    return  # no verdict: the command meets XLA's own message if the flags are wrong
  unknown = _UNKNOWN_FLAG.search(probe.stderr)
  fatal = [line for line in probe.stderr.splitlines() if line.startswith("F") and "XLA_FLAGS" in line]
  if probe.returncode != 0 and (unknown or fatal):
    from attn.config import invalid
    why = (f"{unknown.group(1).strip()} is not a flag this jaxlib's XLA knows" if unknown
           else f"XLA aborts on it: {fatal[-1].split('] ', 1)[-1]}")
    raise invalid("XLA_FLAGS", flags, f"flags XLA knows ({why}; `python -c 'import jax; jax.devices()'` "
                  "with these XLA_FLAGS shows XLA's own message)")
  if probe.returncode == 0:
    os.environ[XLA_CHECKED] = flags
