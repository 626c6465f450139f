"""Logit metrics at every evaluation: attn.analysis.logits on one held-out batch, as flat row keys.

With train.logit_metrics = true, each evaluation runs the model once more on the first held-out
batch and adds to the metrics row, per softmax layer l (from 0, in call order) and over the model:

  max_score_l{l}, max_score   the largest scaled score q·k·score_scale over the heads and the pairs
                              the masks allow (after QK-norm, clipping and RoPE)
  max_logit_l{l}, max_logit   the largest logit the probabilities read (after a softcap's cap)

experiments/qk_control reads them: what keeps attention logits in range as the learning rate grows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attn.analysis import logits

Array = jax.Array


def row_metrics(model, tokens_BT: Array) -> dict[str, Array]:
  """The row keys of the module docstring, for a causal model (DecoderLM) on tokens (B,T)."""
  with logits.record_logits() as layers:
    model(tokens_BT)
  if not layers:
    raise ValueError("train.logit_metrics: no layer of this model computes softmax logits through the "
                     "shared core (linear and state-space heads have none; talking_heads computes its own)")
  out = {}
  for key in ("max_score", "max_logit"):
    per_layer = [lay[key].max() for lay in layers]
    out.update({f"{key}_l{l}": x for l, x in enumerate(per_layer)})
    out[key] = jnp.max(jnp.stack(per_layer))
  return out
