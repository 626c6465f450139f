"""The results store: one directory per sweep, crash-safe, resumable, JSON only (plus Orbax checkpoints).

  DIR/sweep.json                     sweep id, name, question, config text, trial list
  DIR/trials/ID/config.json          the resolved trial config and its axis values
  DIR/trials/ID/metrics.jsonl        one JSON row per training step (complete trials)
  DIR/trials/ID/metrics.jsonl.partial  rows of the trial now running
  DIR/trials/ID/checkpoints/N/       Orbax checkpoints after N steps (attn.experiments.training.checkpoints)
  DIR/trials/ID/summary.json         status ok|failed, reason, final metrics, counts, timings
  DIR/trials/ID/lease.json           the worker running the trial (attn.experiments.running.leases)

Every JSON file is written to a temporary file, fsynced and renamed over the
target (os.replace is atomic), so a reader or a kill -9 sees the old file or
the new one, never half of one. summary.json is written last: a trial is
finished exactly when it exists. A trial without it resumes from its newest
readable checkpoint N (or step 0): its partial rows of steps < N are kept and
later ones dropped, so nothing is lost or counted twice.

Several workers may share a store. sweep.json is created by link(2) of a fully
written file, so of two `attn sweep` processes claiming one DIR at once one
creates it and the other checks it holds the same sweep. A worker writes a
trial only while it holds the trial's lease: start, append and finish raise
leases.LeaseLost otherwise.
"""

from __future__ import annotations

import json
import os
import uuid
from typing import Any, Iterator

from attn.config import invalid
from attn.experiments.running import leases

SWEEP, CONFIG, METRICS, SUMMARY = "sweep.json", "config.json", "metrics.jsonl", "summary.json"
PARTIAL, CHECKPOINTS = METRICS + ".partial", "checkpoints"


def _fsync_dir(path: str) -> None:
  try:
    fd = os.open(path, os.O_RDONLY)
  except OSError:
    return
  try:
    os.fsync(fd)
  except OSError:
    pass
  finally:
    os.close(fd)


def atomic_write(path: str, text: str) -> None:
  """Writes text to path via a temporary file, fsync and os.replace."""
  tmp = f"{path}.tmp.{os.getpid()}"
  with open(tmp, "w", encoding="utf-8") as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)
  _fsync_dir(os.path.dirname(path) or ".")


def write_json(path: str, obj: Any) -> None:
  atomic_write(path, json.dumps(obj, indent=1, sort_keys=True) + "\n")


def read_json(path: str) -> Any:
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def read_rows(path: str) -> list[dict[str, Any]]:
  """JSON lines; a torn last line (a kill mid-write of a partial file) is dropped."""
  rows = []
  with open(path, encoding="utf-8") as f:
    for line in f:
      try:
        rows.append(json.loads(line))
      except json.JSONDecodeError:
        break
  return rows


class Store:
  """A sweep directory: claimed by one sweep id, holding one sub-directory per trial."""

  def __init__(self, root: str):
    self.root = root
    self._files: dict[str, Any] = {}
    self._leases: dict[str, leases.Lease] = {}

  def trial_dir(self, trial_id: str) -> str:
    return os.path.join(self.root, "trials", trial_id)

  def checkpoint_dir(self, trial_id: str) -> str:
    return os.path.join(self.trial_dir(trial_id), CHECKPOINTS)

  def claim(self, header: dict[str, Any]) -> bool:
    """Creates the store, or checks that it holds this same sweep; True when it already did."""
    path = os.path.join(self.root, SWEEP)
    if os.path.exists(self.root) and not os.path.isdir(self.root):
      raise invalid("--out", self.root, "a directory (new, empty, or holding this same sweep); "
                    "it is an existing file: choose another --out (nothing was overwritten)")
    if not os.path.exists(path) and self._create(path, header):
      return False
    held = read_json(path)
    if held.get("sweep_id") != header["sweep_id"]:
      raise invalid("--out", self.root,
                    f"an empty directory or one holding this same sweep; it holds sweep "
                    f"{held.get('sweep_id')} ({held.get('name')!r} from {held.get('config_path')}), "
                    f"this is {header['sweep_id']}: choose another --out (nothing was overwritten)")
    return True

  def _create(self, path: str, header: dict[str, Any]) -> bool:
    """Creates sweep.json unless another process just did (False); refuses a directory holding other files."""
    if os.path.isdir(self.root):
      leftovers = [f for f in os.listdir(self.root) if not f.startswith(SWEEP)]  # sweep.json.tmp.*: a claim
      if leftovers and not os.path.exists(path):
        raise invalid("--out", self.root,
                      f"an empty directory or a sweep directory; it holds {sorted(leftovers)[:5]} "
                      f"and no {SWEEP}: choose another --out (nothing was overwritten)")
    try:
      os.makedirs(self.root, exist_ok=True)
    except OSError as e:
      raise invalid("--out", self.root, f"a directory that can be created ({e.strerror}: {e.filename})") from None
    tmp = f"{path}.tmp.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    atomic_write(tmp, json.dumps(header, indent=1, sort_keys=True) + "\n")
    try:
      created = leases.link(tmp, path)
    finally:
      os.unlink(tmp)
    os.makedirs(os.path.join(self.root, "trials"), exist_ok=True)
    _fsync_dir(self.root)
    return created

  def write_config(self, trial_id: str, config: dict[str, Any]) -> None:
    d = self.trial_dir(trial_id)
    os.makedirs(d, exist_ok=True)
    if not os.path.exists(os.path.join(d, CONFIG)):
      write_json(os.path.join(d, CONFIG), config)

  def is_done(self, trial_id: str) -> bool:
    return os.path.exists(os.path.join(self.trial_dir(trial_id), SUMMARY))

  def lease(self, trial_id: str, timeout: float = leases.DEFAULT_TIMEOUT,
            worker: str | None = None) -> leases.Lease | None:
    """Takes the trial's lease (a new one, or a stale one over); None when a live worker holds it."""
    lease = leases.acquire(self.trial_dir(trial_id), timeout, worker)
    if lease is not None:
      self._leases[trial_id] = lease
    return lease

  def release(self, trial_id: str) -> None:
    """Closes the trial's partial metrics (fsynced) and gives its lease back."""
    self.sync(trial_id)
    f = self._files.pop(trial_id, None)
    if f is not None:
      f.close()
    lease = self._leases.pop(trial_id, None)
    if lease is not None:
      lease.release()

  def sync(self, trial_id: str) -> None:
    """Makes the rows appended so far durable (flush and fsync)."""
    f = self._files.get(trial_id)
    if f is not None:
      f.flush()
      os.fsync(f.fileno())

  def _check(self, trial_id: str) -> None:
    lease = self._leases.get(trial_id)
    if lease is not None:
      lease.check()

  def start(self, trial_id: str, resume_from: int = 0) -> None:
    """Opens the partial metrics, keeping rows of steps < resume_from (a checkpoint's) and dropping the rest."""
    self._check(trial_id)
    path = os.path.join(self.trial_dir(trial_id), PARTIAL)
    # A kill inside `finish` can leave the rows moved to metrics.jsonl and no summary yet.
    source = next((p for p in (path, os.path.join(self.trial_dir(trial_id), METRICS)) if os.path.exists(p)), None)
    kept = [r for r in read_rows(source) if r["step"] < resume_from] if resume_from and source else []
    if [r["step"] for r in kept] != list(range(resume_from)):
      raise ValueError(f"{path} holds {len(kept)} rows before the checkpoint of step {resume_from}, "
                       f"not rows 0..{resume_from - 1}: remove {self.trial_dir(trial_id)} and re-run "
                       "the sweep to train this trial from step 0")
    atomic_write(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))
    self._files[trial_id] = open(path, "a", encoding="utf-8")

  def append(self, trial_id: str, row: dict[str, Any]) -> None:
    self._check(trial_id)
    f = self._files[trial_id]
    f.write(json.dumps(row, sort_keys=True) + "\n")
    f.flush()

  def finish(self, trial_id: str, summary: dict[str, Any]) -> None:
    """Moves the partial rows (if any) into place, then writes summary.json (the done marker)."""
    d = self.trial_dir(trial_id)
    if trial_id in self._leases:
      self._leases[trial_id].refresh()  # freshly confirmed: no takeover before the summary is written
    f = self._files.pop(trial_id, None)
    if f is not None:
      f.flush()
      os.fsync(f.fileno())
      f.close()
    if os.path.exists(os.path.join(d, PARTIAL)):
      os.replace(os.path.join(d, PARTIAL), os.path.join(d, METRICS))
    write_json(os.path.join(d, SUMMARY), summary)

  def close(self) -> None:
    for trial_id in list(self._files) + list(self._leases):
      self.release(trial_id)


def load_sweep(root: str) -> dict[str, Any]:
  """The sweep header of a store; a directory without one is refused by name."""
  path = os.path.join(root, SWEEP)
  if not os.path.exists(path):
    raise invalid("DIR", root, f"a sweep directory written by `attn sweep` (no {SWEEP} in it)")
  return read_json(path)


def iter_trials(root: str) -> Iterator[dict[str, Any]]:
  """Each trial of the sweep in order: id, label, config, summary (None if not finished), rows."""
  header = load_sweep(root)
  for entry in header["trials"]:
    d = os.path.join(root, "trials", entry["id"])
    summary_path, metrics_path = os.path.join(d, SUMMARY), os.path.join(d, METRICS)
    config_path = os.path.join(d, CONFIG)
    done = os.path.exists(summary_path)
    yield {"id": entry["id"], "label": entry["label"],
           "config": read_json(config_path) if os.path.exists(config_path) else None,
           "summary": read_json(summary_path) if done else None,
           "rows": read_rows(metrics_path) if done and os.path.exists(metrics_path) else []}
