"""The run record: DIR/run.jsonl, where and how each `attn sweep` on a store ran, one JSON line per start and end.

A start line holds the command line, attn's commit (whether the tree was
dirty, and a SHA-256 of `git diff HEAD` when it was; experiments/, where runs write their results
and write-ups, does not count), the versions of attn,
jax, jaxlib, flax, optax, numpy and Python, the CPU model and its AVX-512 and
AMX flags, the cores (and those this process may use), XLA_FLAGS, the device
kind, the host allocator in force (attn.process.in_force: mimalloc preloaded,
glibc mallopt or glibc's default; off on an accelerator run), jax's backend and the attention kernel's table there (the order "auto"
tries, the implementations of that backend, whether Pallas runs interpreted),
the start time and the load average. Which implementation each trial's
attention calls ran ("auto" resolved) is in its summary, attention_impls. An end line holds the end time,
the wall time since its start, the load average and how the run ended, and
the run's throughput (throughput): the trials it finished, trials per hour and
device busy time. A
resumed sweep appends to the file (rewritten whole, atomically, like every
file of the store). `attn report` and `attn status` print its first and last
lines; a store without one (older than this record) or with a damaged one
still reads, and they say so.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from typing import Any

from attn import process
from attn.experiments.running import store as store_lib

RECORD = "run.jsonl"
PACKAGES = ("attn", "jax", "jaxlib", "flax", "optax", "numpy")
CPU_FLAGS = ("avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
# What a run writes into a checkout (experiments/NAME/: results, reports, write-ups) is not code: a
# tree whose only changes are there is clean.
NOT_CODE = ":(exclude)experiments"


def _git(*args: str, root: str = ROOT) -> str | None:
  try:
    p = subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, timeout=20)
  except (OSError, subprocess.TimeoutExpired):
    return None
  return p.stdout if p.returncode == 0 else None


def _commit(root: str = ROOT) -> dict[str, Any]:
  head = _git("rev-parse", "HEAD", root=root)
  if head is None:
    return {"commit": None, "dirty": None}
  status = _git("status", "--porcelain", "--untracked-files=no", "--", ".", NOT_CODE, root=root)
  dirty = bool((status or "").strip())
  diff = (_git("diff", "HEAD", "--", ".", NOT_CODE, root=root) or "") if dirty else None
  return {"commit": head.strip(), "dirty": dirty,
          "diff_sha256": hashlib.sha256(diff.encode()).hexdigest()[:16] if diff is not None else None}


def _versions() -> dict[str, str | None]:
  from importlib import metadata
  out: dict[str, str | None] = {}
  for name in PACKAGES:
    try:
      out[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
      out[name] = None
  out["python"] = platform.python_version()
  return out


def _cpu() -> dict[str, Any]:
  model, flags = platform.processor() or None, set()
  try:
    with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
      for line in f:
        key, _, value = line.partition(":")
        if key.strip() == "model name" and model in (None, "", "x86_64"):
          model = value.strip()
        elif key.strip() == "flags" and not flags:
          flags = set(value.split())
  except OSError:
    pass
  return {"cpu": model, "cpu_flags": [f for f in CPU_FLAGS if f in flags], "cores": os.cpu_count(),
          "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None}


def _now() -> str:
  return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def kernel_table() -> dict[str, Any]:
  """jax's backend and the attention kernel's table on it: auto's order, the implementations for it."""
  from attn.kernel import impls, splash
  backend = impls.backend()
  return {"backend": backend, "auto_order": list(impls.AUTO.get(backend, impls.AUTO["cpu"])),
          "impls_for_backend": [n for n, i in impls.IMPLEMENTATIONS.items() if backend in i.backends],
          "pallas_interpret": splash.interpret()}


def start_line() -> dict[str, Any]:
  """Where and how this process runs (the start line)."""
  import jax  # the sweep has imported it already
  return {"event": "start", "command": shlex.join(["attn", *sys.argv[1:]]), **_commit(), "versions": _versions(),
          **_cpu(), "xla_flags": os.environ.get("XLA_FLAGS"), "allocator": process.in_force(),
          "device_kind": jax.devices()[0].device_kind, "devices": jax.device_count(), "kernel": kernel_table(),
          "start": _now(),
          "start_unix": time.time(),
          "loadavg": list(os.getloadavg())}


def end_line(start: dict[str, Any], outcome: str, root: str | None = None) -> dict[str, Any]:
  """The end line; given the store's root, with this run's throughput."""
  line = {"event": "end", "end": _now(), "wall_s": round(time.time() - start["start_unix"], 3),
          "loadavg": list(os.getloadavg()), "outcome": outcome}
  return {**line, **throughput(root, start)} if root is not None else line


def throughput(root: str, start: dict[str, Any]) -> dict[str, Any]:
  """Trials finished since the start line, trials per hour and device busy time; {} for none.

  The training wall is from the start line to the last trial's finish (the report and analysis after
  it are left out). Device busy time is the time during which a trial's compiled train step was
  executing: each program's train_s (from the dispatch of each step to its metrics on the host,
  summed over steps: attn.experiments.training.train._run) counted once per program (a pack or seed
  group of n trials shares one: train_s / group_size each) and once per device of its mesh. Its
  fraction is busy / (training wall x the devices jax sees). Programs running side by side on one
  device (--trials-per-device K, several workers) are each counted, so there it is the mean number of
  steps in flight per device and may pass 1.
  """
  t0 = start.get("start_unix")
  if t0 is None:
    return {}
  done, busy, last = 0, 0.0, t0
  for trial in os.listdir(os.path.join(root, "trials")) if os.path.isdir(os.path.join(root, "trials")) else []:
    try:
      s = store_lib.read_json(os.path.join(root, "trials", trial, store_lib.SUMMARY))
    except (OSError, ValueError, store_lib.StoreDamaged):
      continue
    finished = s.get("finished_unix") if isinstance(s, dict) else None
    if not isinstance(finished, (int, float)) or finished < t0:
      continue
    done += 1
    last = max(last, finished)
    mesh = s.get("mesh") or {}
    devices = int(mesh.get("data", 1) or 1) * int(mesh.get("heads", 1) or 1)
    busy += float(s.get("train_s", 0.0) or 0.0) * devices / max(int(s.get("group_size", 1) or 1), 1)
  if not done:
    return {}
  wall = max(last - t0, 1e-9)
  return {"trials_finished": done, "training_wall_s": round(wall, 3),
          "trials_per_hour": round(done * 3600 / wall, 2), "device_busy_s": round(busy, 3),
          "device_busy_fraction": round(busy / (wall * max(int(start.get("devices") or 1), 1)), 4)}


def read(root: str) -> tuple[list[dict[str, Any]], str | None]:
  """(the record's lines, what is wrong with it or None); a missing record is ([], "missing ...")."""
  path = os.path.join(root, RECORD)
  if not os.path.exists(path):
    return [], f"no run record ({path} is missing: a store written before attn kept one)"
  try:
    rows, problems = store_lib.scan_rows(path, need_step=False)
  except OSError as e:
    return [], f"{path} cannot be read ({e.strerror})"
  return rows, "; ".join(problems) or None


def append(root: str, line: dict[str, Any]) -> None:
  """Adds one line to DIR/run.jsonl (the whole file rewritten atomically); lines that do not parse are kept."""
  path = os.path.join(root, RECORD)
  try:
    with open(path, encoding="utf-8", errors="replace") as f:
      old = f.read()
  except FileNotFoundError:
    old = ""
  if old and not old.endswith("\n"):
    old += "\n"
  store_lib.atomic_write(path, old + json.dumps(line, sort_keys=True) + "\n")


def describe(line: dict[str, Any]) -> str:
  """One line of the record, short: when, what ran where, on which commit."""
  if line.get("event") == "end":
    rate = (f"; {line['trials_finished']} trials in {line.get('training_wall_s')} s of training wall: "
            f"{line.get('trials_per_hour')} trials per hour, device busy {line.get('device_busy_s')} s "
            f"({line.get('device_busy_fraction', 0):.0%} of it)" if line.get("trials_finished") else "")
    return f"end {line.get('end')}: {line.get('outcome')} after {line.get('wall_s')} s{rate}"
  commit = (line.get("commit") or "unknown")[:12] + (" (dirty)" if line.get("dirty") else "")
  v = line.get("versions") or {}
  backend = (line.get("kernel") or {}).get("backend")
  where = f"{line.get('device_kind')} ({backend} backend) with " if backend and backend != "cpu" else ""
  return (f"start {line.get('start')}: `{line.get('command')}` at commit {commit}, jax {v.get('jax')}, "
          f"on {where}{line.get('cpu')} ({line.get('cores_usable')} of {line.get('cores')} cores; "
          f"{', '.join(line.get('cpu_flags') or []) or 'no AVX-512/AMX'}), XLA_FLAGS={line.get('xla_flags')}"
          + (f", allocator {line['allocator']}" if line.get("allocator") else ""))


def summary(root: str) -> list[str]:
  """`run record:` lines for `attn report` and `attn status`: its first and last lines, or what is wrong."""
  lines, problem = read(root)
  out = [f"run record: {problem}"] if problem else []
  if lines:
    out.append(f"run record, first: {describe(lines[0])}")
    if len(lines) > 1:
      out.append(f"run record, last: {describe(lines[-1])}")
  return out
