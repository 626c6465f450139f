"""Host memory: keep XLA's freed CPU buffers for the next call instead of handing them back to the OS.

XLA:CPU allocates each call's temporaries as one block with malloc and frees
it when the call ends. glibc serves a block over its mmap threshold (at most
32 MB) with a fresh mmap and unmaps it on free, so every call faults in the
whole block again, page by page (the kernel zeroes each 4 KB page): the merged
h = 4 model of configs/quick.toml has a 35 MB block, 8,600 page faults per
training step, 1.5x its step time; the fused layer's forward+backward at the
reference shape has 64 MB, 16,000 faults per call. Whether a call pays it
depended on the heap's history (a free chunk of the right size left by an
earlier trial in the same process), which made a sweep's step times depend on
the order of its trials (experiments/performance.md, "The sweep's 1.5x swing").

keep_freed_memory() sets three glibc malloc options for the process: no mmap
for large blocks (M_MMAP_MAX = 0), one arena for every thread (M_ARENA_MAX = 1:
a thread arena cannot hold a block over 64 MB and would mmap it anyway), and
freed memory at the top of the heap returned to the OS only beyond KEEP_BYTES
(M_TRIM_THRESHOLD). The process then keeps up to its peak memory plus
KEEP_BYTES. attn's CLI and the training runner call it; set ATTN_HOST_MALLOC=default
to leave glibc's own behaviour (for comparing the two). Other C libraries: nothing is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

from attn.config import invalid

ENV = "ATTN_HOST_MALLOC"
MODES = ("keep", "default")
KEEP_BYTES = 1 << 30
# mallopt parameter numbers from glibc's malloc.h
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8

_state: dict[str, str] = {}


def mode() -> str:
  """The requested mode: $ATTN_HOST_MALLOC, default "keep"; anything else is a ConfigError."""
  value = os.environ.get(ENV, "keep")
  if value not in MODES:
    raise invalid(ENV, value, f"one of {list(MODES)} (keep: reuse freed XLA buffers; default: glibc's own)")
  return value


def keep_freed_memory() -> str:
  """Applies the mode once per process (module docstring); returns what is in force, for records."""
  if "setting" in _state:
    return _state["setting"]
  if mode() == "default":
    setting = "glibc default (ATTN_HOST_MALLOC=default)"
  elif platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
    setting = f"not glibc ({platform.system()} {platform.libc_ver()[0] or 'libc'}): unchanged"
  else:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    options = ((_M_MMAP_MAX, 0, "M_MMAP_MAX=0"), (_M_ARENA_MAX, 1, "M_ARENA_MAX=1"),
               (_M_TRIM_THRESHOLD, KEEP_BYTES, f"M_TRIM_THRESHOLD={KEEP_BYTES}"))
    failed = [name for number, value, name in options if libc.mallopt(number, value) != 1]
    if failed:  # named, not swallowed: glibc refused a setting
      raise RuntimeError(f"{ENV}=keep: glibc's mallopt refused {', '.join(failed)}")
    setting = "glibc mallopt " + ", ".join(name for *_, name in options)
  _state["setting"] = setting
  return setting


def in_force() -> str:
  """What keep_freed_memory() set in this process, or that it was not called."""
  return _state.get("setting", "glibc default (keep_freed_memory not called)")
