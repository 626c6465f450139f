"""Bigram-Backcopy (Guo et al. 2024, "Active-Dormant Attention Heads"): a task on which attention sinks form.

Token 0 is [BOS] and starts every sequence; tokens 1..num_triggers are the
triggers; the rest are ordinary. The first token after [BOS] is an ordinary
token drawn uniformly. After an ordinary token x the next is drawn from row x
of a fixed transition matrix P (a bigram chain); after a trigger the next
token copies the token before the trigger. By induction no two triggers are
adjacent and a copy is always an ordinary token. P's rows over the tokens
1..vocab_size-1 are drawn from a symmetric Dirichlet(concentration) by
transition_seed alone, so every trial and seed sees the same chain; smaller
concentrations give peakier rows.

An MLP alone predicts the bigram part; only attention (to the previous
token) predicts the token after a trigger, so a head is needed on trigger
inputs and useless on the others, where Guo et al. find it falls dormant on
[BOS]. Every position counts in the loss; trigger_mask marks the positions
whose input is a trigger, whose next token is a copy.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import numpy as np

from attn.config import invalid
from attn.experiments.data import arrays

BOS = 0


@dataclasses.dataclass(frozen=True)
class BigramBackcopy:
  """Bigram chain with back-copy after trigger tokens, [BOS] first (module docstring)."""

  kind: ClassVar[str] = "decoder_lm"
  vocab_size: int = 64
  seq_len: int = 64
  num_triggers: int = 3
  concentration: float = 0.5
  transition_seed: int = 0

  def __post_init__(self):
    arrays.check_int("vocab_size", self.vocab_size, 3)
    arrays.check_int("seq_len", self.seq_len, 3)
    arrays.check_int("transition_seed", self.transition_seed, 0)
    n = self.num_triggers
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
      raise invalid("task.num_triggers", n, "an integer >= 1: the task needs trigger tokens")
    if n > self.vocab_size - 2:
      raise invalid("task.num_triggers", n, f"at most vocab_size - 2 = {self.vocab_size - 2}: with [BOS], "
                    "triggers must leave at least one ordinary token")
    c = self.concentration
    if isinstance(c, bool) or not isinstance(c, (int, float)) or not (math.isfinite(c) and c > 0):
      raise invalid("task.concentration", c, "a finite number > 0 (the Dirichlet parameter of P's rows)")
    object.__setattr__(self, "concentration", float(c))
    g = np.random.default_rng([self.transition_seed, 0xB16])
    P = np.zeros((self.vocab_size, self.vocab_size))
    P[1:, 1:] = g.dirichlet(np.full(self.vocab_size - 1, self.concentration), self.vocab_size - 1)
    object.__setattr__(self, "_cumulative", np.cumsum(P, axis=1))

  @property
  def transition(self) -> np.ndarray:
    """P (vocab, vocab): row x is the next token's distribution after ordinary token x (row 0 and column 0 zero)."""
    return np.diff(self._cumulative, axis=1, prepend=0.0)

  def trigger_mask(self, tokens_BT):
    """True where the input token is a trigger (its next token is a copy); numpy or jax arrays."""
    return (tokens_BT >= 1) & (tokens_BT <= self.num_triggers)

  def batch(self, seed: int, split: int, index: int, batch_size: int) -> dict[str, np.ndarray]:
    rng = arrays.rng(seed, split, index)
    B, L = batch_size, self.seq_len + 1
    seq = np.zeros((B, L), np.int64)  # seq[:, 0] = [BOS]
    seq[:, 1] = rng.integers(self.num_triggers + 1, self.vocab_size, B)
    u_BL = rng.random((B, L))
    for t in range(1, L - 1):
      cum_BV = self._cumulative[seq[:, t]]
      drawn = np.minimum((cum_BV < u_BL[:, t:t + 1] * cum_BV[:, -1:]).sum(1), self.vocab_size - 1)
      seq[:, t + 1] = np.where(self.trigger_mask(seq[:, t]), seq[:, t - 1], drawn)
    return arrays.lm_arrays(seq, np.ones((B, self.seq_len)))
