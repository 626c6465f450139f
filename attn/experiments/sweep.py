"""Sweeps: a validated config -> trials -> training -> the store, with resume and progress.

Trials that are already finished in the store are skipped; an unfinished one
resumes from its newest readable checkpoint (a warning on the stream names any
checkpoint that could not be read). Unfinished trials that share a shape (equal
configs but for train.seed) train together under jax.vmap over seeds when
sweep.vmap_seeds is true (default false: slower on CPU, measured in the README);
each seed still saves its own checkpoints. A trial whose training raises is
recorded as failed with the error, and the sweep goes on.
"""

from __future__ import annotations

import sys
import time
import traceback
from typing import Any, TextIO

from attn.config import ConfigError
from attn.experiments import config as config_lib
from attn.experiments.store import Store


def header(sweep: config_lib.Sweep, config_text: str, overrides: list[str]) -> dict[str, Any]:
  """What sweep.json holds: enough to know which sweep a directory belongs to."""
  return {"sweep_id": sweep.id, "name": sweep.meta["name"], "question": sweep.meta["question"],
          "config_path": sweep.path, "config_text": config_text, "overrides": list(overrides),
          "axes": sweep.axes, "trials": [{"id": t.id, "label": t.label} for t in sweep.trials]}


def _fmt_time(seconds: float) -> str:
  seconds = int(seconds)
  return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


class Progress:
  """One status line: trial i/N, step, loss, ETA of the whole sweep; redrawn on a tty."""

  def __init__(self, total_steps: int, n_trials: int, stream: TextIO = sys.stderr):
    self.total, self.n, self.stream = total_steps, n_trials, stream
    self.done, self.t0, self.last = 0, time.perf_counter(), 0.0
    self.tty = hasattr(stream, "isatty") and stream.isatty()

  def update(self, first: int, count: int, label: str, step: int, steps: int, loss: float) -> None:
    self.done += count
    now = time.perf_counter()
    final = step == steps - 1
    if now - self.last < (0.2 if self.tty else 10.0) and not final and step > 0:
      return
    self.last = now
    rate = self.done / max(now - self.t0, 1e-9)
    eta = (self.total - self.done) / rate if rate > 0 else 0.0
    which = f"{first}/{self.n}" if count == 1 else f"{first}-{first + count - 1}/{self.n}"
    line = f"trial {which} [{label}] step {step + 1}/{steps} loss {loss:.4f} ETA {_fmt_time(eta)}"
    if self.tty:
      self.stream.write("\r\033[K" + line + ("\n" if final else ""))
    else:
      self.stream.write(line + "\n")
    self.stream.flush()


def _groups(trials: list[config_lib.Trial], vmap_seeds: bool) -> list[list[config_lib.Trial]]:
  """Consecutive batches of trials sharing a shape (seed-only differences), in sweep order."""
  if not vmap_seeds:
    return [[t] for t in trials]
  groups: dict[str, list[config_lib.Trial]] = {}
  for t in trials:
    groups.setdefault(config_lib.shape_key(t), []).append(t)
  return list(groups.values())


def _label(group: list[config_lib.Trial]) -> str:
  parts = {}
  for t in group:
    for k, v in t.label.items():
      parts.setdefault(k.split(".")[-1], [])
      if v not in parts[k.split(".")[-1]]:
        parts[k.split(".")[-1]].append(v)
  return ", ".join(f"{k}={','.join(map(str, v))}" for k, v in parts.items())


def run_sweep(sweep: config_lib.Sweep, out: str, *, config_text: str = "",
              overrides: list[str] | None = None, stream: TextIO = sys.stderr) -> dict[str, int]:
  """Runs every unfinished trial of `sweep` into the store at `out`; returns ok/failed/skipped counts."""
  from attn.experiments import train  # lazy: jax
  store = Store(out)
  resumed = store.claim(header(sweep, config_text, overrides or []))
  for t in sweep.trials:
    store.write_config(t.id, {"id": t.id, "label": t.label, **t.config})
  pending = [t for t in sweep.trials if not store.is_done(t.id)]
  counts = {"ok": 0, "failed": 0, "skipped": len(sweep.trials) - len(pending)}
  if resumed:
    stream.write(f"resuming {out}: {counts['skipped']} of {len(sweep.trials)} trials already finished\n")
  cache = train.enable_compilation_cache()
  stream.write(f"{len(pending)} trials to run into {out} (JAX compilation cache: {cache})\n")
  progress = Progress(sum(t.config["train"]["steps"] for t in pending), len(sweep.trials), stream)
  index = {t.id: i + 1 for i, t in enumerate(sweep.trials)}
  for group in _groups(pending, sweep.vmap_seeds):
    ids = [t.id for t in group]
    label, steps = _label(group), group[0].config["train"]["steps"]

    def on_start(j: int, step: int, group=group) -> None:
      store.start(group[j].id, resume_from=step)
      if step:
        progress.total -= step
        stream.write(f"trial {index[group[j].id]}/{len(sweep.trials)} [{_label([group[j]])}] "
                     f"resumes at step {step} from {store.checkpoint_dir(group[j].id)}\n")

    def on_step(step: int, loss: float, group=group, label=label, steps=steps) -> None:
      progress.update(index[group[0].id], len(group), label, step, steps, loss)

    try:
      summaries = train.train_group([t.config for t in group],
                                    on_row=lambda j, row, ids=ids: store.append(ids[j], row),
                                    on_step=on_step, vmap=sweep.vmap_seeds,
                                    checkpoint_dirs=[store.checkpoint_dir(i) for i in ids],
                                    on_start=on_start, log=lambda line: stream.write(line + "\n"))
    except (ConfigError, ValueError, TypeError, RuntimeError, FloatingPointError) as e:
      stream.write(f"\ntrial [{label}] failed: {type(e).__name__}: {e}\n")
      tb = traceback.format_exception_only(type(e), e)[-1].strip()
      summaries = [{"status": "failed", "reason": f"error: {tb}"} for _ in group]
    for t, summary in zip(group, summaries):
      store.finish(t.id, {"id": t.id, "label": t.label, **summary})
      counts[summary["status"]] += 1
      if summary["status"] == "failed":
        stream.write(f"trial {index[t.id]}/{len(sweep.trials)} [{_label([t])}] failed: {summary['reason']}\n")
  store.close()
  stream.write(f"done: {counts['ok']} ok, {counts['failed']} failed, {counts['skipped']} already finished\n")
  return counts
