"""Faults of the machine: a full disk, an I/O error, lost permission, a kill; told apart from a trial's own errors.

A trial that fails for its own reasons (a non-finite loss, a config the model
cannot run, an error in a variant) is `failed` and stays so. A trial stopped
by the machine is `interrupted`: `classify` recognises such an error (an
OSError with one of MACHINE_ERRNOS anywhere in its chain of causes, or
tensorstore's error text from an Orbax save, which carries os_error_code)
and the sweep leaves the trial resumable from its last complete checkpoint,
writes no summary for it, and stops after it with one message (`Fault.message`).
The store notes the reason in DIR/trials/ID/interrupted.json when the disk
still takes it (attn.experiments.running.store); `attn status` and the report read it.

attn.process.hooks.quiet() keeps the failure of a background write to that one
message (Orbax's logged copies of a fault dropped).

Fault injection for the tests (ALICE's and SQLite's recipe: a fault at every
write boundary): ATTN_FAULT="KIND:N:MODE" (or `arm`) makes the N-th write of
KIND in this process fail, KIND one of store (every file of the store written
whole), row (each metrics row), checkpoint (each checkpoint save); MODE
ENOSPC (that write and every later one of any kind fail: a full disk), EIO
(that one write fails) or kill (SIGKILL right after that write completes).
`counts()` tells how many writes of each kind a run made. Importing this
module arms nothing and installs nothing: a process of the `attn` command
calls `arm_from_env()` in attn.process.setup().
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import re
import signal
import sys
import threading
from typing import Any, Iterator

MACHINE_ERRNOS = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
                  errno.EIO: "I/O error", errno.EROFS: "read-only file system",
                  errno.EACCES: "permission denied", errno.EPERM: "operation not permitted",
                  errno.ESTALE: "stale file handle", errno.EFBIG: "file too large"}
KINDS = ("store", "row", "checkpoint")
OS_CODE = re.compile(r"os_error_code='?(\d+)")
_PATH = re.compile(r'(?:Failed writing|local file|Error writing local file): "([^"]+)"')


@dataclasses.dataclass(frozen=True)
class Fault:
  """A fault of the machine: its errno, what it means, the path written, and where (trial or file)."""
  errno: int
  what: str
  path: str | None

  @property
  def reason(self) -> str:
    """`no space left on device (errno ENOSPC) writing PATH`."""
    where = f" writing {self.path}" if self.path else ""
    return f"{self.what} (errno {errno.errorcode.get(self.errno, self.errno)}){where}"

  @property
  def message(self) -> str:
    todo = ("free space on that filesystem (or choose another --out)" if self.errno in (errno.ENOSPC, errno.EDQUOT)
            else "check the filesystem and its permissions")
    return f"{self.reason}: {todo}, then re-run the same command to finish the sweep"


def _chain(e: BaseException) -> Iterator[BaseException]:
  seen: set[int] = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    yield e
    e = e.__cause__ or e.__context__


def classify(e: BaseException) -> Fault | None:
  """The machine's fault behind an error (anywhere in its chain of causes), or None for an error of the trial's own."""
  for x in _chain(e):
    if isinstance(x, OSError) and x.errno in MACHINE_ERRNOS:
      return Fault(x.errno, MACHINE_ERRNOS[x.errno], x.filename)
    m = OS_CODE.search(str(x))
    if m and int(m.group(1)) in MACHINE_ERRNOS:  # tensorstore (an Orbax save): the path is in its text
      path = _PATH.search(str(x))
      return Fault(int(m.group(1)), MACHINE_ERRNOS[int(m.group(1))], path.group(1) if path else None)
  return None


# --- injection --------------------------------------------------------------------------------------------------

_lock = threading.Lock()
_counts = dict.fromkeys(KINDS, 0)
_armed: dict[str, Any] = {"kind": None, "n": 0, "mode": None, "full": False}


def arm(kind: str | None, n: int = 0, mode: str = "ENOSPC") -> None:
  """Makes the n-th write of `kind` (from now) fail with mode ENOSPC or EIO, or be followed by SIGKILL; None disarms."""
  if kind is not None and (kind not in KINDS or mode not in ("ENOSPC", "EIO", "kill") or n < 1):
    raise ValueError(f"fault {kind}:{n}:{mode}: KIND one of {KINDS}, N >= 1, MODE ENOSPC, EIO or kill")
  with _lock:
    for k in KINDS:
      _counts[k] = 0
    _armed.update(kind=kind, n=n, mode=mode, full=False)


def counts() -> dict[str, int]:
  """How many writes of each kind this process has made since the last arm()."""
  with _lock:
    return dict(_counts)


def arm_from_env() -> None:
  """Arms $ATTN_FAULT ("KIND:N:MODE"), if set: called by attn.process.setup(), never on import."""
  spec = os.environ.get("ATTN_FAULT")
  if not spec:
    return
  try:
    kind, n, mode = spec.split(":")
    arm(kind, int(n), mode)
  except ValueError:
    from attn.config import invalid  # imports jax: only on the error path
    raise invalid("ATTN_FAULT", spec, f"KIND:N:MODE with KIND one of {list(KINDS)}, N >= 1, MODE ENOSPC, EIO "
                  "or kill") from None


@contextlib.contextmanager
def naming(path: str) -> Iterator[None]:
  """An OSError inside that names no file (Python's f.write, Orbax's write_text) re-raised naming path."""
  try:
    yield
  except OSError as e:
    if e.filename is not None or e.errno is None:
      raise
    raise OSError(e.errno, e.strerror, path) from e


@contextlib.contextmanager
def point(kind: str, path: str) -> Iterator[None]:
  """One write of `kind` to `path`: where an armed fault strikes (no-op when none is armed)."""
  with _lock:
    _counts[kind] += 1
    hit = _armed["kind"] == kind and _counts[kind] == _armed["n"]
    mode = _armed["mode"]
    if hit and mode == "ENOSPC":
      _armed["full"] = True
    fail = _armed["full"] or (hit and mode == "EIO")
  if fail:
    code = errno.ENOSPC if _armed["full"] else errno.EIO
    raise OSError(code, os.strerror(code), path)
  with naming(path):
    yield
  if hit and mode == "kill":
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


