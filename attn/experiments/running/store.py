"""The results store: one directory per sweep, crash-safe, resumable, JSON only (plus Orbax checkpoints).

  DIR/sweep.json                     sweep id, name, question, config text, trial list
  DIR/trials/ID/config.json          the resolved trial config and its axis values
  DIR/trials/ID/metrics.jsonl        one JSON row per training step (complete trials)
  DIR/trials/ID/metrics.jsonl.partial  rows of the trial now running
  DIR/trials/ID/checkpoints/N/       Orbax checkpoints after N steps (attn.experiments.training.checkpoints)
  DIR/trials/ID/summary.json         status ok|failed, reason, final metrics, counts, timings
  DIR/trials/ID/lease.json           the worker running the trial (attn.experiments.running.leases)
  DIR/trials/ID/interrupted.json     why the machine stopped the trial (a full disk, an I/O error, a kill),
                                     when the disk took it; removed once the trial finishes

Every JSON file is written to a temporary file, fsynced and renamed over the
target (os.replace is atomic), so a reader or a kill -9 sees the old file or
the new one, never half of one. summary.json is written last: a trial is
finished exactly when it exists and parses. A trial without it resumes from its newest
readable checkpoint N (or step 0): its partial rows of steps < N are kept and
later ones dropped, so nothing is lost or counted twice.

A file that does not parse is named by path with what is wrong (StoreDamaged,
an attn.ConfigError) and what to do:

  sweep.json, trials/ID/config.json   refused: `attn sweep`, `attn report` and
                                      `attn analyze` stop before any work (`attn
                                      status` shows such a trial as damaged)
  trials/ID/summary.json              the trial counts as unfinished: `attn sweep`
                                      re-runs it from its checkpoint; `attn report`
                                      and `attn status` show it as damaged
  a torn last line of metrics.jsonl   (a write cut short) left out: dropped when
  (or .partial)                       the trial resumes, a warning in `attn report`
                                      and `attn status`

Several workers may share a store. sweep.json is created by link(2) of a fully
written file, so of two `attn sweep` processes claiming one DIR at once one
creates it and the other checks it holds the same sweep. A worker writes a
trial only while it holds the trial's lease: start, append and finish raise
leases.LeaseLost otherwise.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import uuid
from typing import Any, Iterator

from attn.config import ConfigError, invalid
from attn.experiments.running import leases
from attn.process import faults

SWEEP, CONFIG, METRICS, SUMMARY = "sweep.json", "config.json", "metrics.jsonl", "summary.json"
PARTIAL, CHECKPOINTS, INTERRUPTED = METRICS + ".partial", "checkpoints", "interrupted.json"


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
  """Writes text to path via a temporary file, fsync and os.replace; on an error the old file stays, no temporary."""
  tmp = f"{path}.tmp.{os.getpid()}"
  try:
    with faults.point("store", path), open(tmp, "w", encoding="utf-8") as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
      os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(OSError):
      os.unlink(tmp)
    raise
  _fsync_dir(os.path.dirname(path) or ".")


def write_json(path: str, obj: Any) -> None:
  atomic_write(path, json.dumps(obj, indent=1, sort_keys=True) + "\n")


class StoreDamaged(ConfigError):
  """A file of the store that does not parse: its path, what is wrong with it and what to do."""

  def __init__(self, path: str, problem: str, todo: str = ""):
    self.path, self.problem = path, problem
    super().__init__(f"{path} is damaged ({problem})" + (f": {todo}" if todo else ""))


def _parse(text: bytes) -> tuple[Any, str | None]:
  """(value, None) for a JSON text, else (None, what is wrong with it)."""
  if not text.strip():
    return None, "empty"
  try:
    return json.loads(text.decode("utf-8")), None
  except UnicodeDecodeError:
    return None, "not UTF-8 text"
  except json.JSONDecodeError as e:
    return None, f"not JSON, cut short or overwritten: {e.msg} (line {e.lineno} column {e.colno})"


def read_json(path: str) -> Any:
  """The JSON value of a file; one that does not parse raises StoreDamaged naming it."""
  with open(path, "rb") as f:
    value, problem = _parse(f.read())
  if problem:
    raise StoreDamaged(path, problem)
  return value


def _row(line: bytes, need_step: bool = True) -> tuple[dict[str, Any] | None, str | None]:
  """(row, None) for a metrics line (a JSON object with an integer step), else (None, what is wrong with it)."""
  row, problem = _parse(line)
  if problem is None and not (isinstance(row, dict) and (isinstance(row.get("step"), int) or not need_step)):
    return None, "not a JSON object with an integer step" if need_step else "not a JSON object"
  return row, problem


def _torn(path: str, line: bytes, problem: str) -> str:
  return f"{path}: its last line ({len(line)} bytes) is torn, a write cut short ({problem})"


def scan_rows(path: str, need_step: bool = True) -> tuple[list[dict[str, Any]], list[str]]:
  """(rows, what was left out) of a JSON-lines file: lines that do not parse are skipped and named.

  A torn last line (a write cut short by a kill) is the one expected kind:
  it is dropped when the trial resumes. Any other bad line is damage.
  """
  rows, problems = [], []
  with open(path, "rb") as f:
    lines = f.read().split(b"\n")
  if lines and not lines[-1]:
    lines.pop()  # the end of the last complete line
  for i, line in enumerate(lines):
    row, problem = _row(line, need_step)
    if problem is None:
      rows.append(row)
    elif i == len(lines) - 1:
      problems.append(_torn(path, line, problem))
    else:
      problems.append(f"{path}: line {i + 1} of {len(lines)} is left out ({problem})")
  return rows, problems


def read_rows(path: str) -> list[dict[str, Any]]:
  """The rows of a JSON-lines file, without any line that does not parse (see scan_rows)."""
  return scan_rows(path)[0]


def torn_tail(path: str) -> str | None:
  """What is wrong with the last line of a JSON-lines file (read from its end only), or None."""
  try:
    with open(path, "rb") as f:
      start = max(0, f.seek(0, os.SEEK_END) - 64 * 1024)
      f.seek(start)
      tail = f.read()
  except FileNotFoundError:
    return None
  body = tail[:-1] if tail.endswith(b"\n") else tail
  if not body or (start and b"\n" not in body):  # empty, or one line longer than the window
    return None
  last = body.rsplit(b"\n", 1)[-1]
  problem = _row(last)[1]
  return None if problem is None else _torn(path, last, problem)


def rerun_command(root: str, header: dict[str, Any]) -> str:
  """The `attn sweep` command that resumes the sweep of a store."""
  sets = "".join(f" --set {shlex.quote(o)}" for o in header.get("overrides", []))
  return f"attn sweep {shlex.quote(header.get('config_path', 'CONFIG'))} --out {shlex.quote(root)}{sets}"


def _shape(path: str, ok: bool, wanted: str, todo: str = "") -> None:
  if not ok:
    raise StoreDamaged(path, f"not {wanted}", todo)


def read_header(path: str) -> dict[str, Any]:
  """sweep.json, checked; damage is refused with what to do."""
  root = os.path.dirname(path) or "."
  todo = (f"the sweep's id and trial list cannot be rebuilt from the trials: remove {root} (or choose "
          "another --out) and run the sweep again")
  try:
    head = read_json(path)
  except StoreDamaged as e:
    raise StoreDamaged(path, e.problem, todo) from None
  trials = head.get("trials") if isinstance(head, dict) else None
  _shape(path, isinstance(head, dict) and isinstance(head.get("sweep_id"), str) and isinstance(trials, list)
         and all(isinstance(t, dict) and isinstance(t.get("id"), str) and isinstance(t.get("label"), dict)
                 for t in trials), "a sweep header (sweep_id, trials with id and label)", todo)
  return head


def read_config(path: str, todo: str = "") -> dict[str, Any]:
  """A trial's config.json, checked (label, train.steps); damage is refused with `todo`."""
  try:
    cfg = read_json(path)
  except StoreDamaged as e:
    raise StoreDamaged(path, e.problem, todo) from None
  train = cfg.get("train") if isinstance(cfg, dict) else None
  _shape(path, isinstance(train, dict) and isinstance(train.get("steps"), int) and isinstance(cfg.get("label"), dict),
         "a trial config (label, train.steps, ...)", todo)
  return cfg


def config_todo(root: str, header: dict[str, Any] | None = None) -> str:
  """What to do about a damaged config.json: `attn sweep` writes it again, keeping the trial's rows."""
  again = f" (`{rerun_command(root, header)}`)" if header else ""
  return (f"remove it and run the sweep's command again{again}: it writes the file anew from the config "
          "and keeps the trial's rows and checkpoints")


def read_summary(path: str) -> dict[str, Any]:
  """A trial's summary.json, checked (a JSON object with status ok or failed)."""
  summary = read_json(path)
  _shape(path, isinstance(summary, dict) and summary.get("status") in ("ok", "failed"),
         "a trial summary (status ok or failed)")
  return summary


def summary_todo(root: str, header: dict[str, Any]) -> str:
  """What to do about a damaged summary.json: `attn sweep` re-runs the trial from its checkpoint."""
  return f"the sweep's command re-runs the trial from its checkpoint (`{rerun_command(root, header)}`)"


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
    held = read_header(path)
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

  def write_config(self, trial_id: str, config: dict[str, Any], header: dict[str, Any] | None = None) -> None:
    """Writes the trial's config.json unless it exists; an existing one that does not parse is refused."""
    d = self.trial_dir(trial_id)
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, CONFIG)
    if not os.path.exists(path):
      write_json(path, config)
    else:
      read_config(path, config_todo(self.root, header))

  def damage(self, trial_id: str) -> str | None:
    """What is wrong with the trial's summary.json when it exists and does not parse, else None."""
    path = os.path.join(self.trial_dir(trial_id), SUMMARY)
    try:
      read_summary(path)
    except FileNotFoundError:
      return None
    except StoreDamaged as e:
      return str(e)
    return None

  def is_done(self, trial_id: str) -> bool:
    """Whether the trial is finished: its summary.json exists and parses (a damaged one is re-run)."""
    path = os.path.join(self.trial_dir(trial_id), SUMMARY)
    return os.path.exists(path) and self.damage(trial_id) is None

  def lease(self, trial_id: str, timeout: float = leases.DEFAULT_TIMEOUT,
            worker: str | None = None) -> leases.Lease | None:
    """Takes the trial's lease (a new one, or a stale one over); None when a live worker holds it."""
    lease = leases.acquire(self.trial_dir(trial_id), timeout, worker)
    if lease is not None:
      self._leases[trial_id] = lease
    return lease

  def release(self, trial_id: str) -> None:
    """Closes the trial's partial metrics (fsynced) and gives its lease back; a failing disk is left as it is.

    Rows a failed write did not finish are past the trial's last checkpoint
    (a row is written before the checkpoint of its step starts): a resume drops them.
    """
    f = self._files.pop(trial_id, None)
    if f is not None:
      with contextlib.suppress(OSError):
        f.flush()
        os.fsync(f.fileno())
      with contextlib.suppress(OSError):
        f.close()
    lease = self._leases.pop(trial_id, None)
    if lease is not None:
      with contextlib.suppress(OSError):
        lease.release()

  def sync(self, trial_id: str) -> None:
    """Makes the rows appended so far durable (flush and fsync)."""
    f = self._files.get(trial_id)
    if f is not None:
      with faults.naming(f.name):
        f.flush()
        os.fsync(f.fileno())

  def _check(self, trial_id: str) -> None:
    lease = self._leases.get(trial_id)
    if lease is not None:
      lease.check()

  def start(self, trial_id: str, resume_from: int = 0) -> list[str]:
    """Opens the partial metrics, keeping rows of steps < resume_from (a checkpoint's) and dropping the rest.

    Returns what was left out of the kept rows (a torn last line: see scan_rows).
    """
    self._check(trial_id)
    path = os.path.join(self.trial_dir(trial_id), PARTIAL)
    # A kill inside `finish` can leave the rows moved to metrics.jsonl and no summary yet (or a damaged one).
    source = next((p for p in (path, os.path.join(self.trial_dir(trial_id), METRICS)) if os.path.exists(p)), None)
    rows, problems = scan_rows(source) if resume_from and source else ([], [])
    kept = [r for r in rows if r["step"] < resume_from]
    if [r["step"] for r in kept] != list(range(resume_from)):
      raise StoreDamaged(source or path, f"{len(kept)} rows before the checkpoint of step {resume_from}, "
                         f"not rows 0..{resume_from - 1}" + (f"; {'; '.join(problems)}" if problems else ""),
                         f"remove {self.trial_dir(trial_id)} and re-run the sweep to train this trial from step 0")
    atomic_write(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))
    self._files[trial_id] = open(path, "a", encoding="utf-8")
    return problems

  def append(self, trial_id: str, row: dict[str, Any]) -> None:
    self._check(trial_id)
    f = self._files[trial_id]
    with faults.point("row", f.name):
      f.write(json.dumps(row, sort_keys=True) + "\n")
      f.flush()

  def finish(self, trial_id: str, summary: dict[str, Any]) -> None:
    """Moves the partial rows (if any) into place, then writes summary.json (the done marker)."""
    d = self.trial_dir(trial_id)
    if trial_id in self._leases:
      self._leases[trial_id].refresh()  # freshly confirmed: no takeover before the summary is written
    f = self._files.pop(trial_id, None)
    if f is not None:
      with faults.naming(f.name):
        f.flush()
        os.fsync(f.fileno())
        f.close()
    if os.path.exists(os.path.join(d, PARTIAL)):
      os.replace(os.path.join(d, PARTIAL), os.path.join(d, METRICS))
    write_json(os.path.join(d, SUMMARY), summary)
    with contextlib.suppress(OSError):
      os.unlink(os.path.join(d, INTERRUPTED))

  def interrupt(self, trial_id: str, reason: str) -> bool:
    """Notes in interrupted.json why the machine stopped the trial; False when the disk does not take it."""
    try:
      write_json(os.path.join(self.trial_dir(trial_id), INTERRUPTED), {"reason": reason})
      return True
    except OSError:
      return False

  def failed(self, trial_id: str) -> bool:
    """Whether the trial finished as failed (its summary says so)."""
    try:
      return read_summary(os.path.join(self.trial_dir(trial_id), SUMMARY))["status"] == "failed"
    except (OSError, StoreDamaged):
      return False

  def reset(self, trial_id: str) -> None:
    """Makes a finished trial unfinished and new (`attn sweep --retry-failed`): rows and checkpoints go, summary last."""
    d = self.trial_dir(trial_id)
    shutil.rmtree(os.path.join(d, CHECKPOINTS), ignore_errors=True)
    for name in (METRICS, PARTIAL, INTERRUPTED, SUMMARY):  # killed midway: still finished, or still new
      with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(d, name))
    _fsync_dir(d)

  def close(self) -> None:
    for trial_id in list(self._files) + list(self._leases):
      self.release(trial_id)


def read_interrupted(trial_dir: str) -> str | None:
  """Why the machine stopped an unfinished trial, from its interrupted.json; None when absent or unreadable."""
  try:
    value = read_json(os.path.join(trial_dir, INTERRUPTED))
  except (OSError, StoreDamaged):
    return None
  return value["reason"] if isinstance(value, dict) and isinstance(value.get("reason"), str) else None


def load_sweep(root: str) -> dict[str, Any]:
  """The sweep header of a store; a directory without one, or with a damaged one, is refused by name."""
  path = os.path.join(root, SWEEP)
  if not os.path.exists(path):
    raise invalid("DIR", root, f"a sweep directory written by `attn sweep` (no {SWEEP} in it)")
  return read_header(path)


def iter_trials(root: str) -> Iterator[dict[str, Any]]:
  """Each trial of the sweep in order: id, label, config, summary (None if not finished), rows, damage.

  A damaged config.json is refused (StoreDamaged). A damaged summary.json
  gives summary None and "damaged", its message; "warnings" names rows left
  out of metrics.jsonl (a torn last line) and rows that disagree with the summary.
  """
  header = load_sweep(root)
  for entry in header["trials"]:
    d = os.path.join(root, "trials", entry["id"])
    summary_path, metrics_path = os.path.join(d, SUMMARY), os.path.join(d, METRICS)
    config_path = os.path.join(d, CONFIG)
    t = {"id": entry["id"], "label": entry["label"], "summary": None, "rows": [], "damaged": None, "warnings": [],
         "config": read_config(config_path, config_todo(root, header)) if os.path.exists(config_path) else None}
    if os.path.exists(summary_path):
      try:
        t["summary"] = read_summary(summary_path)
      except StoreDamaged as e:
        t["damaged"] = f"{e}: {summary_todo(root, header)}"
    if t["summary"] is not None and os.path.exists(metrics_path):
      t["rows"], t["warnings"] = scan_rows(metrics_path)
      t["warnings"] = [f"{w}: left out" for w in t["warnings"]]
      done = t["summary"].get("steps_done")
      if t["summary"]["status"] == "ok" and isinstance(done, int) and not t["warnings"] and \
          [r["step"] for r in t["rows"]] != list(range(done)):
        t["warnings"].append(f"{metrics_path}: {len(t['rows'])} rows, not rows 0..{done - 1} of the "
                             f"{done} steps its {SUMMARY} counts")
    t["interrupted"] = read_interrupted(d) if t["summary"] is None else None
    yield t
