"""Timing calls as a shared machine allows: (wall, process CPU) pairs, round-robin over candidates."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable


def timer(fn: Callable[[], Any]) -> Callable[[], tuple[float, float]]:
  """Wraps a call that blocks until done into one returning (wall, process CPU) seconds."""
  def timed():
    c, t = time.process_time(), time.perf_counter()
    fn()
    return time.perf_counter() - t, time.process_time() - c
  return timed


def round_robin(groups: list[dict[str, Callable[[], Any]]], repeats: int,
                 pause_s: float = 0.2) -> dict[str, dict[str, float]]:
  """Times each call once per round, group after group; medians and spread per call.

  Every call is warmed up twice first. A group is one framework: torch's and
  XLA's thread pools each spin for a while after a call, so switching between
  them call by call would make each wait on the other's threads; groups
  switch once per round, after a pause.
  """
  timers = [{k: timer(f) for k, f in g.items()} for g in groups]
  for g in timers:
    for t in g.values():
      t()
      t()
    time.sleep(pause_s)
  samples = {k: [] for g in groups for k in g}
  for _ in range(repeats):
    for g in timers:
      for k, t in g.items():
        samples[k].append(t())
      if len(timers) > 1:
        time.sleep(pause_s)
  out = {}
  for k, s in samples.items():
    wall = [w for w, _ in s]
    out[k] = {"median_s": statistics.median(wall), "min_s": min(wall), "max_s": max(wall),
              "cpu_median_s": statistics.median([c for _, c in s])}
  return out
