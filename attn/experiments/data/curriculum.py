"""A length curriculum: training sequences that grow over the steps, evaluation at the task's own seq_len.

task.curriculum lists the training lengths, growing, each at most seq_len (the
model's positions are seq_len + 1); task.curriculum_steps the fraction of
train.steps each stage takes (default equal shares; they sum to 1). A stage's
batches have one static shape, so the train step compiles once per length.
Held-out batches are always the full task's. The plateau before recall grows
as a power law in the sequence length (Zucchet et al. 2025); Based and Zoology
train short and test long (Arora et al. 2024).
"""

from __future__ import annotations

import math
from typing import Any

from attn.config import invalid


def check(lengths: Any, fractions: Any, seq_len: int) -> tuple[tuple[int, ...], tuple[float, ...]]:
  """(lengths, fractions) as tuples, or a ConfigError naming task.curriculum or task.curriculum_steps."""
  if not isinstance(lengths, (list, tuple)):
    raise invalid("task.curriculum", lengths, "a list of growing training lengths, e.g. [128, 256, 512] "
                  "([] for none)")
  lengths = tuple(lengths)
  if not isinstance(fractions, (list, tuple)):
    raise invalid("task.curriculum_steps", fractions, "a list of fractions of train.steps, one a stage")
  fractions = tuple(fractions)
  if not lengths:
    if fractions:
      raise invalid("task.curriculum_steps", list(fractions), "[] without task.curriculum")
    return (), ()
  for L in lengths:
    if isinstance(L, bool) or not isinstance(L, int) or L < 2:
      raise invalid("task.curriculum", list(lengths), "integers >= 2, each a stage's training length")
  if any(b <= a for a, b in zip(lengths, lengths[1:])):
    raise invalid("task.curriculum", list(lengths), "lengths that grow from stage to stage")
  if lengths[-1] > seq_len:
    raise invalid("task.curriculum", list(lengths), f"lengths at most task.seq_len={seq_len}: the model has "
                  f"seq_len + 1 = {seq_len + 1} positions")
  if not fractions:
    return lengths, tuple(1 / len(lengths) for _ in lengths)
  if len(fractions) != len(lengths) or any(isinstance(f, bool) or not isinstance(f, (int, float))
                                           or not 0 < f <= 1 for f in fractions):
    raise invalid("task.curriculum_steps", list(fractions), f"{len(lengths)} fractions in (0, 1], one for "
                  f"each length of task.curriculum={list(lengths)}")
  if not math.isclose(sum(fractions), 1.0, abs_tol=1e-6):
    raise invalid("task.curriculum_steps", list(fractions), f"fractions that sum to 1 (they sum to {sum(fractions):g})")
  return lengths, tuple(float(f) for f in fractions)


def starts(fractions: tuple[float, ...], steps: int) -> list[int]:
  """The first step of each stage: stage i runs steps [starts[i], starts[i + 1])."""
  out, total = [], 0.0
  for f in fractions:
    out.append(min(steps, round(total * steps)))
    total += f
  return out


def stage(lengths: tuple[int, ...], fractions: tuple[float, ...], step: int, steps: int) -> int:
  """The training length at `step` of `steps`."""
  i = max(j for j, s in enumerate(starts(fractions, steps)) if s <= step)
  return lengths[i]


def train_task(task, step: int, steps: int):
  """The task whose batch trains step `step` of `steps`: task itself without a curriculum."""
  at = getattr(task, "at_length", None)
  if at is None or not getattr(task, "curriculum", ()):
    return task
  return at(stage(task.curriculum, task.curriculum_steps, step, steps))
