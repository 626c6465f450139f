"""Sink metrics at every evaluation: attn.analysis.sinks on one held-out batch, as flat row keys.

With train.sink_metrics = true, each evaluation runs the model once more on
the first held-out batch, recording every layer's attention weights, values
and residual stream, and adds to the metrics row (l: layer, h: query head,
g: kv head, from 0):

  first_mass_l{l}h{h}, sink_heads_l{l}, value_drain_l{l}g{g},
  residual_first_l{l}, residual_massive_l{l}
  first_mass_trigger_l{l}h{h}, first_mass_other_l{l}h{h}  (bigram_backcopy)
and over the whole model attn.analysis.sinks.summary's first_mass,
sink_heads, value_drain, residual_first, residual_massive (and
active_dormant). The threshold is train.sink_threshold.
"""

from __future__ import annotations

from typing import Any, Callable

import jax

from attn.analysis import sinks
from attn.nn import models

Array = jax.Array


def model_stats(model, tokens_BT: Array, threshold: float,
                domain_fn: Callable[[Array], Array] | None = None) -> list[dict[str, Array]]:
  """attn.analysis.sinks.sink_stats of a causal model (DecoderLM) on tokens (B,T)."""
  with models.record_residuals() as residuals, sinks.record_values() as values:
    _, weights = model(tokens_BT, return_weights=True)
  L = len(weights)
  values = values if len(values) == L and all(v.ndim == 4 for v in values) else [None] * L
  windows = [model.cfg.layer_head(l).window for l in range(L)]
  domain = None if domain_fn is None else domain_fn(tokens_BT)
  return sinks.sink_stats(weights, values, residuals, threshold, windows, domain)


# Per-head statistics and the letter of their axis in the row keys.
PER_HEAD = {"first_mass": "h", "first_mass_trigger": "h", "first_mass_other": "h", "value_drain": "g"}
PER_LAYER = ("sink_heads", "residual_first", "residual_massive")


def row_metrics(layers: list[dict[str, Array]]) -> dict[str, Array]:
  """The row keys of the module docstring: per layer (and head), then the model's summary."""
  out: dict[str, Any] = {}
  for l, lay in enumerate(layers):
    for key, letter in PER_HEAD.items():
      if key in lay:
        out.update({f"{key}_l{l}{letter}{i}": x for i, x in enumerate(lay[key])})
    out.update({f"{key}_l{l}": lay[key] for key in PER_LAYER})
  return {**out, **sinks.summary(layers)}
