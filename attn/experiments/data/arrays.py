"""What every task shares: its seeded generator, integer checks and language-model arrays."""

from __future__ import annotations

from typing import Any

import numpy as np

from attn.config import invalid

TRAIN, EVAL = 0, 1


def rng(seed: int, split: int, index: int) -> np.random.Generator:
  """The generator of batch `index` of `split` under `seed`: batches depend on these three numbers only."""
  return np.random.default_rng([seed, split, index])


def check_int(name: str, value: Any, low: int) -> None:
  """Refuses task.<name> unless it is an integer >= low."""
  if isinstance(value, bool) or not isinstance(value, int) or value < low:
    raise invalid(f"task.{name}", value, f"an integer >= {low}")


def lm_arrays(seq_BT1: np.ndarray, weights_BT: np.ndarray) -> dict[str, np.ndarray]:
  """Inputs are seq[:, :-1], targets seq[:, 1:]: position t predicts token t+1."""
  return {"tokens": seq_BT1[:, :-1].astype(np.int32),
          "targets": seq_BT1[:, 1:].astype(np.int32),
          "weights": weights_BT.astype(np.float32)}
