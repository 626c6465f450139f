"""Leases: one worker holds a trial at a time, through DIR/trials/ID/lease.json and a heartbeat.

lease.json holds token (unique per hold), host, pid, pidns (boot and PID
namespace), job_id (Slurm's, else null), worker and started. It is acquired by link(2) of a fully written temporary
file: link fails with EEXIST when the name exists, atomically on local
filesystems and on NFS (where O_EXCL creates were not atomic before NFSv3, and
link also means a reader never sees a half-written lease). When the server's
reply to a link is lost and the retried call says EEXIST, the temporary file's
link count (2) tells that the link was made (the open(2) man page's recipe).

A heartbeat thread touches the file every timeout/4 s and then reads it back:
another token, or no file, means the trial was taken over, and the worker
stops writing it. Its mtime is the heartbeat; a lease whose mtime is older
than the timeout (default 60 s) on the filesystem's own clock (compared with
the mtime of the taker's freshly written file, so hosts' clocks need not
agree) is taken over: the taker first creates (by link) lease.json.takeover.TOKEN,
TOKEN being the stale lease's, so of several takers of that one stale lease
only one goes on; it re-reads the lease, and if it is still the very one
judged stale (same token and mtime) renames its own file over it (atomic: the
name never stands empty, so no fresh acquirer can slip in), then removes the
takeover file (one older than the timeout, left by a taker that died, is removed). A lease is also taken over at once
when its process is known to be gone: same host, boot and PID namespace (so
the pid means the same process) and no such pid (a kill -9 on this machine),
and by a Slurm task requeued with the same job id.

A holder writes only within timeout/2 of its last confirmed heartbeat (its
monotonic clock, from before the touch): Lease.check refreshes synchronously
past that, so a worker paused longer than the timeout (SIGSTOP, swap) finds
its lease gone before it writes again. The one window left is a worker silent
for longer than the timeout that wakes inside the microseconds of a takeover.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import subprocess
import threading
import time
import uuid
from typing import Any

LEASE = "lease.json"
DEFAULT_TIMEOUT = 60.0


class LeaseLost(Exception):
  """This worker no longer holds the trial: taken over, removed, or its heartbeat lapsed."""


def job_id() -> str | None:
  """This process's Slurm job (ARRAYJOB_TASK for array tasks, .PROCID with several tasks), else None."""
  env = os.environ
  if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
    jid = f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
  else:
    jid = env.get("SLURM_JOB_ID")
  if jid and env.get("SLURM_NTASKS", "1") not in ("", "1"):  # tasks of one job must not share leases
    jid += f".{env.get('SLURM_PROCID', '0')}"
  return jid or None


def _pid_namespace() -> str | None:
  """This boot and PID namespace (Linux; else None): where a pid names the same process."""
  try:
    with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
      return f"{f.read().strip()}:{os.stat('/proc/self/ns/pid').st_ino}"
  except OSError:
    return None


_PIDNS = _pid_namespace()


def gone(held: dict[str, Any]) -> bool:
  """True when the lease's process is known to be dead: this host, boot and PID namespace, no such pid."""
  if not _PIDNS or held.get("pidns") != _PIDNS or held.get("host") != socket.gethostname():
    return False
  try:
    os.kill(int(held["pid"]), 0)
  except ProcessLookupError:
    return True
  except (OSError, KeyError, TypeError, ValueError, OverflowError):  # e.g. another user's live process
    return False
  return False


# Slurm job states (sacct) in which the cluster, not the trial, ended the job: the trial is
# interrupted and a re-run resumes it. (FAILED and COMPLETED are the task's own exit.)
MACHINE_ENDS = ("OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED", "TIMEOUT", "CANCELLED", "BOOT_FAIL", "DEADLINE")


def slurm_end(held: dict[str, Any], timeout: float = 10.0) -> str | None:
  """Why Slurm ended the job of a lease whose heartbeat stopped, from its accounting (`sacct`), when
  the cluster ended it (MACHINE_ENDS); None without a job, without sacct, or while it runs."""
  job = str(held.get("job_id") or "").split(".")[0]
  if not job or shutil.which("sacct") is None:
    return None
  try:
    out = subprocess.run(["sacct", "-n", "-P", "-X", "-j", job, "--format=State,ExitCode"],
                         capture_output=True, text=True, timeout=timeout).stdout
  except (OSError, subprocess.SubprocessError):
    return None
  for line in out.splitlines():
    state, _, code = line.strip().partition("|")
    if state.split(" ")[0] in MACHINE_ENDS:
      return f"Slurm ended its job {job}: {state} (exit {code or '?'}, sacct)"
  return None


def read(path: str) -> tuple[dict[str, Any] | None, float]:
  """(lease, mtime) of a lease file; (None, 0.0) when absent. An unreadable body reads as {}."""
  try:
    with open(path, "rb") as f:  # open revalidates NFS's attribute cache (close-to-open)
      mtime, body = os.fstat(f.fileno()).st_mtime, f.read()
  except FileNotFoundError:
    return None, 0.0
  try:
    held = json.loads(body)
  except (json.JSONDecodeError, UnicodeDecodeError):
    held = {}
  return (held if isinstance(held, dict) else {}), mtime


def link(src: str, dst: str) -> bool:
  """Atomically creates dst as a hard link of src; False when dst exists."""
  try:
    os.link(src, dst)
    return True
  except FileExistsError:
    return os.stat(src).st_nlink == 2  # NFS: a retried link whose first try succeeded
  except FileNotFoundError:
    return False


def describe(held: dict[str, Any]) -> str:
  """`host pid N (job J, worker W)` of a lease, for messages."""
  extra = ", ".join(f"{name} {held[k]}" for k, name in (("job_id", "job"), ("worker", "worker")) if held.get(k))
  return f"{held.get('host', '?')} pid {held.get('pid', '?')}" + (f" ({extra})" if extra else "")


class Lease:
  """This worker's hold on one trial, kept alive by a heartbeat thread until released."""

  def __init__(self, path: str, token: str, timeout: float, took_over: dict[str, Any] | None):
    self.path, self.token, self.timeout, self.took_over = path, token, timeout, took_over
    self._confirmed = time.monotonic()
    self._lost: str | None = None
    self._lock = threading.Lock()
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._beat, name=f"heartbeat {path}", daemon=True)
    self._thread.start()

  def _beat(self) -> None:
    while not self._stop.wait(self.timeout / 4):
      try:
        self.refresh()
      except LeaseLost:
        return
      except OSError:  # a transient filesystem error: check() stops writes once timeout/2 passes
        pass

  def refresh(self) -> None:
    """Touches the lease and reads it back; raises LeaseLost if it is no longer this worker's."""
    with self._lock:
      if self._lost:
        raise LeaseLost(self._lost)
      before = time.monotonic()
      try:
        os.utime(self.path)
      except FileNotFoundError:
        pass
      held, _ = read(self.path)
      if held is None or held.get("token") != self.token:
        self._lost = f"{self.path} was taken over by {describe(held)}" if held else f"{self.path} was removed"
        raise LeaseLost(self._lost)
      self._confirmed = before

  def check(self) -> None:
    """Raises LeaseLost unless the lease is held and was confirmed within timeout/2 (refreshing if not)."""
    if self._lost:
      raise LeaseLost(self._lost)
    if time.monotonic() - self._confirmed > self.timeout / 2:
      self.refresh()

  @property
  def lost(self) -> str | None:
    return self._lost

  def release(self) -> None:
    """Stops the heartbeat and removes the lease if it is still this worker's (never another's)."""
    self._stop.set()
    if self._thread is not threading.current_thread():
      self._thread.join()
    try:
      self.refresh()
    except (LeaseLost, OSError):
      return  # not this worker's any more, or unreachable: left for a takeover
    with self._lock:
      self._lost = "released"
      aside = f"{self.path}.released.{self.token}"
      try:
        os.rename(self.path, aside)
      except FileNotFoundError:
        return
      held, _ = read(aside)
      if held is None or held.get("token") != self.token:
        link(aside, self.path)  # another worker's lease: put it back
      os.unlink(aside)


def acquire(trial_dir: str, timeout: float = DEFAULT_TIMEOUT, worker: str | None = None) -> Lease | None:
  """This worker's new lease on the trial in trial_dir, or None when another live worker holds it."""
  path = os.path.join(trial_dir, LEASE)
  token = uuid.uuid4().hex
  me = {"token": token, "host": socket.gethostname(), "pid": os.getpid(), "pidns": _PIDNS,
        "job_id": job_id(), "worker": worker, "started": time.time()}
  tmp = f"{path}.{token}"
  with open(tmp, "w", encoding="utf-8") as f:
    f.write(json.dumps(me, sort_keys=True) + "\n")
    f.flush()
    os.fsync(f.fileno())
  try:
    for _ in range(4):
      if link(tmp, path):
        return Lease(path, token, timeout, None)
      held, mtime = read(path)
      if held is None:
        continue  # released meanwhile: try again
      os.utime(tmp)
      age = os.stat(tmp).st_mtime - mtime  # both times from the filesystem's clock
      if me["job_id"] and held.get("job_id") == me["job_id"]:
        reason = f"the same Slurm job {me['job_id']}, requeued"
      elif age >= timeout:
        reason = f"no heartbeat for {age:.0f} s"
      elif gone(held):
        reason = "its process is gone"
      else:
        return None
      if _take_over(path, held, mtime, me, token, timeout):
        return Lease(path, token, timeout, {**held, "heartbeat_age_s": age, "reason": reason})
      return None
    return None
  finally:
    _unlink(tmp)


def _take_over(path: str, held: dict[str, Any], mtime: float, me: dict[str, Any], token: str,
               timeout: float) -> bool:
  """Replaces the stale lease `held` (of mtime `mtime`) by this worker's; False when another taker is on it."""
  guard, guard_tmp, mine = f"{path}.takeover.{held.get('token')}", f"{path}.{token}.guard", f"{path}.{token}.new"
  with open(guard_tmp, "w", encoding="utf-8") as f:
    f.write(token + "\n")
  try:
    if not link(guard_tmp, guard):  # another worker is taking over this same stale lease, or died doing so
      try:
        if os.stat(guard_tmp).st_mtime - os.stat(guard).st_mtime > timeout:
          _unlink(guard)  # a takeover lasts microseconds: this guard's taker died; the next try goes on
      except FileNotFoundError:
        pass
      return False
  finally:
    _unlink(guard_tmp)
  try:
    now, now_mtime = read(path)
    if now is None or now.get("token") != held.get("token") or now_mtime != mtime:
      return False  # released, refreshed or replaced since it was judged stale
    with open(mine, "w", encoding="utf-8") as f:
      f.write(json.dumps(me, sort_keys=True) + "\n")
      f.flush()
      os.fsync(f.fileno())
    os.replace(mine, path)
    return True
  finally:
    _unlink(mine)
    _unlink(guard)


def _unlink(path: str) -> None:
  try:
    os.unlink(path)
  except OSError as e:
    if e.errno != errno.ENOENT:
      raise
