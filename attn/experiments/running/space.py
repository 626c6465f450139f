"""Room to write: the free space of a store's filesystem, the memory a machine has left, bytes for people.

The sweep checks a store's filesystem for MIN_FREE bytes before it writes
(attn.experiments.running.sweep) and plans packed trials on the memory
available; fmt_bytes says both in the messages.
"""

from __future__ import annotations

import os

MIN_FREE = 64 * 1024  # bytes a store's filesystem must have free before a sweep writes to it


def free_bytes(path: str) -> tuple[str, int]:
  """(the nearest existing directory at or above path, the bytes free to this user on its filesystem)."""
  d = os.path.abspath(path)
  while not os.path.isdir(d) and os.path.dirname(d) != d:
    d = os.path.dirname(d)
  st = os.statvfs(d)
  return d, st.f_bavail * st.f_frsize


def available_memory() -> int | None:
  """Bytes of memory this machine can give a new allocation now (MemAvailable), or None where unknown."""
  try:
    with open("/proc/meminfo", encoding="ascii") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except (OSError, ValueError, IndexError):
    pass
  return None


def fmt_bytes(n: float) -> str:
  """1.5 GB, 300 MB, 12 kB."""
  for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
    if n >= size:
      return f"{n / size:.1f} {unit}"
  return f"{int(n)} bytes"
