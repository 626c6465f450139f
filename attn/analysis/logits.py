"""The largest attention logits of a model on one batch, per layer and head: what QK-norm, fixed-scale
QK-norm, L2 clipping and soft-capping keep in range (experiments/qk_control).

record_logits() yields a list to which every softmax layer run inside appends, at trace time, the
largest logit of each query head over the batch and the (query, key) pairs its masks allow:

  max_score (H,)   max of q·k·score_scale, the scaled score (after QK-norm, clipping and RoPE)
  max_logit (H,)   max of the logit the probabilities read: the score after the mechanisms'
                   on_logits (a softcap's cap); equal to max_score without one

Read through the hook every layer's shared core passes (attn.variants.base.LOGIT_HOOK), before any
key selection: the score of every allowed pair, chosen or not. A layer that computes its own logits
(talking_heads) or has none (linear and state-space heads) appends nothing.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import jax
import jax.numpy as jnp

from attn import kernel
from attn.variants import base, mechanisms

Array = jax.Array


def head_maxima(params, q_BTHK: Array, k_BSGK: Array, *, cfg, opts) -> dict[str, Array]:
  """{"max_score": (H,), "max_logit": (H,)} of one layer's call (module docstring); -inf for a head
  whose every pair is masked."""
  score_BHTS = kernel.scores(q_BTHK, k_BSGK) * cfg.score_scale
  logit_BHTS = mechanisms.on_logits(params, score_BHTS, cfg)
  mask = base.full_mask(q_BTHK.shape[1], k_BSGK.shape[1], cfg=cfg, opts=opts)
  if mask is not None:
    mask = jnp.broadcast_to(mask, score_BHTS.shape)
    score_BHTS = jnp.where(mask, score_BHTS, -jnp.inf)
    logit_BHTS = jnp.where(mask, logit_BHTS, -jnp.inf)
  return {"max_score": score_BHTS.max(axis=(0, 2, 3)), "max_logit": logit_BHTS.max(axis=(0, 2, 3))}


@contextlib.contextmanager
def record_logits() -> Iterator[list]:
  """Yields a list; each softmax layer run inside appends head_maxima of its call (in call order)."""
  seen: list = []

  def hook(params, q_BTHK, k_BSGK, *, cfg, opts):
    seen.append(head_maxima(params, q_BTHK, k_BSGK, cfg=cfg, opts=opts))

  token = base.LOGIT_HOOK.set(hook)
  try:
    yield seen
  finally:
    base.LOGIT_HOOK.reset(token)
