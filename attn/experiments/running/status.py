"""`attn status DIR [--lease-timeout S]`: each trial done, failed, running, stale or pending; totals; an ETA.

It reads the store only, so it works whatever runs the trials (`attn sweep`,
its local workers, Slurm array tasks):

  ok, failed   summary.json exists (failed: with its reason)
  running      lease.json's heartbeat (its mtime) is younger than the lease timeout:
               the worker (host, pid, Slurm job), the step reached (the partial rows), heartbeat age
  interrupted  stopped by the machine, not by itself: its interrupted.json names why (no space left, an
               I/O error), or its lease names a process of this machine that is gone (killed by the
               kernel's out-of-memory killer or a signal), or a Slurm job that sacct says the cluster
               ended (OUT_OF_MEMORY, NODE_FAIL, TIMEOUT, ...); `attn sweep` resumes it from its checkpoint
  stale        a lease older than the timeout: its worker is gone; the next worker takes it over
  pending      none of these (with the step of its checkpoint, if it has one)
  damaged      its config.json or summary.json does not parse (the file and what is
               wrong; `attn sweep` re-runs a trial whose summary.json is damaged)

A torn last line of a trial's metrics (a write cut short) is named in a warning
on stderr; the trial keeps its state.

ETA: seconds per trial-step, from the finished trials' timings ((compile +
train + checkpoint time) / group size / steps run), else from the running
trials' recent step times; times the steps left (all of a pending trial's, the
rest of a running or stale one's); divided by the number of running trials
(at least 1, the next worker). Heartbeat ages compare the file's mtime with
this host's clock.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from attn.experiments.running import config as config_lib
from attn.experiments.running import leases
from attn.experiments.running import store as store_lib

STATES = ("ok", "failed", "running", "interrupted", "stale", "pending", "damaged")
SHOWN_IF_ANY = ("interrupted", "damaged")


def _tail(path: str, n: int = 8) -> list[dict[str, Any]]:
  """The last n complete JSON rows of a metrics file ([] if none)."""
  try:
    with open(path, "rb") as f:
      f.seek(0, os.SEEK_END)
      size = f.seek(max(0, f.tell() - 64 * 1024))
      lines = f.read().split(b"\n")
  except FileNotFoundError:
    return []
  rows = []
  for line in lines[1:] if size else lines:  # the first may be cut by the seek
    try:
      rows.append(json.loads(line))
    except (json.JSONDecodeError, UnicodeDecodeError):
      pass
  return rows[-n:]


def _checkpoint(trial_dir: str) -> int:
  d = os.path.join(trial_dir, store_lib.CHECKPOINTS)
  return max((int(x) for x in os.listdir(d) if x.isdigit()), default=0) if os.path.isdir(d) else 0


def collect(out: str, lease_timeout: float = leases.DEFAULT_TIMEOUT) -> list[dict[str, Any]]:
  """One dict per trial, in sweep order: index, id, label, state, steps, step reached, lease, age, summary.

  "damaged" holds what is wrong with a damaged trial's files, "warnings" a torn last line of its metrics.
  """
  header = store_lib.load_sweep(out)
  now, rows = time.time(), []
  for i, entry in enumerate(header["trials"]):
    d = os.path.join(out, "trials", entry["id"])
    label = ", ".join(f"{config_lib.axis_name(k)}={config_lib.show(v)}" for k, v in entry["label"].items())
    t = {"index": i + 1, "id": entry["id"], "label": label, "steps": None, "step": 0, "lease": None,
         "age": None, "summary": None, "recent": [], "damaged": None, "warnings": []}
    rows.append(t)
    config = os.path.join(d, store_lib.CONFIG)
    try:
      if os.path.exists(config):
        t["steps"] = store_lib.read_config(config, store_lib.config_todo(out, header))["train"]["steps"]
    except store_lib.StoreDamaged as e:
      t["damaged"] = str(e)
    try:
      if os.path.exists(os.path.join(d, store_lib.SUMMARY)):
        t["summary"] = store_lib.read_summary(os.path.join(d, store_lib.SUMMARY))
    except store_lib.StoreDamaged as e:
      t["damaged"] = t["damaged"] or f"{e}: {store_lib.summary_todo(out, header)}"
    if t["summary"] is not None:
      t["state"] = "ok" if t["summary"].get("status") == "ok" else "failed"
      t["warnings"] = [w for w in [store_lib.torn_tail(os.path.join(d, store_lib.METRICS))] if w]
      if t["damaged"] is not None:
        t["state"] = "damaged"
      continue
    held, mtime = leases.read(os.path.join(d, leases.LEASE))
    t["recent"] = _tail(os.path.join(d, store_lib.PARTIAL))
    t["step"] = t["recent"][-1]["step"] + 1 if t["recent"] else 0
    killed = held is not None and leases.gone(held)
    if held is not None and now - mtime < lease_timeout and not killed:  # a live worker may be mid-row
      t["lease"], t["age"], t["state"] = held, now - mtime, "running"
      continue
    reason = store_lib.read_interrupted(d)
    if killed:
      reason = f"its worker ({leases.describe(held)}) is gone: killed (the kernel's out-of-memory " \
               "killer, or a signal)"
    elif held is not None and held.get("job_id"):  # a silent Slurm task: did the cluster end it?
      reason = leases.slurm_end(held) or reason
    torn = store_lib.torn_tail(os.path.join(d, store_lib.PARTIAL))
    t["warnings"] = [f"{torn}: dropped when the trial resumes"] if torn else []
    if t["damaged"] is not None:
      t["state"] = "damaged"
    elif reason is not None:
      t["state"], t["checkpoint"], t["reason"] = "interrupted", _checkpoint(d), reason
    elif held is not None:
      t["lease"], t["age"], t["state"] = held, now - mtime, "stale"
    else:
      t["state"], t["checkpoint"] = "pending", _checkpoint(d)
  return rows


def totals(trials: list[dict[str, Any]]) -> dict[str, int]:
  """How many trials are in each state."""
  return {s: sum(t["state"] == s for t in trials) for s in STATES}


def eta(trials: list[dict[str, Any]]) -> float | None:
  """Seconds until every trial is finished (the module docstring's estimate); None when nothing is known yet."""
  spent, ran = 0.0, 0.0
  for t in trials:
    s = t["summary"]
    if t["state"] == "ok" and s.get("steps_done", 0) > s.get("resumed_from", 0) and "train_s" in s:
      spent += (s.get("compile_s", 0.0) + s["train_s"] + s.get("checkpoint_s", 0.0)) / s.get("group_size", 1)
      ran += s["steps_done"] - s.get("resumed_from", 0)
  if not ran:
    times = [r["step_time_s"] for t in trials if t["state"] == "running" for r in t["recent"] if "step_time_s" in r]
    spent, ran = sum(times), len(times)
  left = sum((t["steps"] or 0) - (t["step"] if t["state"] != "pending" else 0)
             for t in trials if t["state"] in ("running", "interrupted", "stale", "pending"))
  if not left:
    return 0.0
  if not ran:
    return None
  return left * spent / ran / max(1, totals(trials)["running"])


def fmt_time(seconds: float | None) -> str:
  """1h02m, 3m05s, or `unknown`."""
  if seconds is None:
    return "unknown"
  seconds = int(seconds)
  return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def summary_line(trials: list[dict[str, Any]]) -> str:
  """`12 trials: 4 ok, 0 failed, 2 running, 0 stale, 6 pending; ETA 3m10s` (interrupted, damaged: if any)."""
  n = totals(trials)
  counts = ", ".join(f"{n[s]} {s}" for s in STATES if s not in SHOWN_IF_ANY or n[s])
  left = n["running"] + n["interrupted"] + n["stale"] + n["pending"]
  return f"{len(trials)} trials: {counts}" + (f"; ETA {fmt_time(eta(trials))}" if left else "")


def _detail(t: dict[str, Any], lease_timeout: float) -> str:
  s, steps = t["summary"], t["steps"] or "?"
  if t["state"] == "ok":
    final = s.get("final", {})
    took = s.get("compile_s", 0.0) + s.get("train_s", 0.0) + s.get("checkpoint_s", 0.0)
    return (f"eval_accuracy {final.get('eval_accuracy', float('nan')):.4f}  "
            f"eval_loss {final.get('eval_loss', float('nan')):.4f}  ({took:.0f} s"
            + (f" on {s['worker']})" if s.get("worker") else ")"))
  if t["state"] == "failed":
    return s.get("reason", "?")
  if t["state"] == "damaged":
    return t["damaged"]
  if t["state"] == "interrupted":
    return f"{t['reason']}; at step {t['step']}/{steps}, resumes from its checkpoint of step {t['checkpoint']}"
  if t["state"] in ("running", "stale"):
    where = f"step {t['step']}/{steps} on {leases.describe(t['lease'])}, heartbeat {t['age']:.0f} s ago"
    return where + (f" (> {lease_timeout:g} s: the next worker takes it over)" if t["state"] == "stale" else "")
  return f"stopped at step {t['step']}/{steps}, resumes from its checkpoint of step {t['checkpoint']}" \
      if t["step"] else ""


def table(trials: list[dict[str, Any]], lease_timeout: float) -> list[str]:
  """`attn status`'s lines: one per trial (its state and what it is doing), then the totals and ETA."""
  width = max((len(t["label"]) for t in trials), default=0)
  lines = [f"{t['index']:>4}/{len(trials)}  {t['state']:<8} {t['label']:<{width}}  {_detail(t, lease_timeout)}".rstrip()
           for t in trials]
  return lines + [summary_line(trials)]


def warning_lines(trials: list[dict[str, Any]]) -> list[str]:
  """A line for each torn metrics row or damaged file the trials' store showed."""
  return [f"warning: trial {t['index']}/{len(trials)}: {w}" for t in trials for w in t["warnings"]]


def print_progress(stream, prefix: str, out: str, lease_timeout: float, last: float) -> float:
  """prefix and the store's one-line summary: every 1 s on a terminal (rewriting the line), else
  every 10 s (a line each); returns when it last printed (pass it back as `last`)."""
  tty = hasattr(stream, "isatty") and stream.isatty()
  if time.monotonic() - last < (1.0 if tty else 10.0):
    return last
  line = f"{prefix}; {summary_line(collect(out, lease_timeout))}"
  stream.write(("\r\033[K" + line) if tty else line + "\n")
  stream.flush()
  return time.monotonic()
