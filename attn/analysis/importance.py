"""Head importance from the gradient of the loss in the head gates, and pruning curves (Michel et al. 2019).

Gates ξ (L,H) multiply each head's output before W^O (a model's head_mask).
The importance of head h of layer l is

  I_lh = E_x |∂L(x)/∂ξ_lh|  at ξ = 1,

the absolute value taken per example x, as Michel et al. do: per-example gates
(B,L,H) give every example's own gradient in one backward pass, since example
b's loss depends on row b of the gates only. Scores are then normalised per
layer by their ℓ2 norm over heads (Michel et al. §4.1, after Molchanov et al.
2017), so layers whose gradients differ in scale can be compared.

Pruning: heads are gated off globally in increasing order of normalised
importance (ties: raw importance, then layer, then head), and the model is
evaluated after each head when it has at most EVERY_HEAD_UP_TO heads in all,
else at every 10% of them. The prunable fraction is the largest fraction k/N
such that every evaluated point up to k heads off keeps accuracy within
TOLERANCE (1 point) of the unpruned model.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from attn.config import invalid

Array = jax.Array
EVERY_HEAD_UP_TO = 64
TOLERANCE = 0.01


def gate_gradients(example_loss: Callable[[Array], Array], gates_BLH) -> Array:
  """∂L_b/∂ξ_{b,l,h} (B,L,H) at gates_BLH, for example_loss(gates (B,L,H)) -> per-example losses (B,)."""
  gates_BLH = jnp.asarray(gates_BLH)
  if gates_BLH.ndim != 3 or not jnp.issubdtype(gates_BLH.dtype, jnp.floating):
    raise invalid("gates.shape", tuple(gates_BLH.shape), "(B, L, H) float gates, one row per example")
  return jax.grad(lambda g: example_loss(g).sum())(gates_BLH)


def head_importance(grads_NLH) -> dict[str, np.ndarray]:
  """{"raw": E|g| (L,H), "normalized": raw / its ℓ2 norm over each layer's heads} from per-example gradients."""
  g = np.asarray(grads_NLH, np.float64)
  if g.ndim != 3 or g.shape[0] < 1:
    raise invalid("grads.shape", g.shape, "(N, L, H) per-example gate gradients, N >= 1")
  raw_LH = np.abs(g).mean(0)
  norm_L1 = np.linalg.norm(raw_LH, axis=1, keepdims=True)
  return {"raw": raw_LH, "normalized": raw_LH / np.where(norm_L1 > 0, norm_L1, 1.0)}


def pruning_order(importance: dict[str, np.ndarray]) -> np.ndarray:
  """(N,2) (layer, head) pairs, least important first, by normalised then raw importance."""
  norm_LH, raw_LH = np.asarray(importance["normalized"]), np.asarray(importance["raw"])
  L, H = norm_LH.shape
  l_N, h_N = np.divmod(np.arange(L * H), H)
  keys = (h_N, l_N, raw_LH.ravel(), norm_LH.ravel())  # np.lexsort: the last key is the primary one
  order = np.lexsort(keys)
  return np.stack([l_N[order], h_N[order]], axis=1)


def pruning_steps(n_heads: int) -> list[int]:
  """How many heads are off at each evaluated point: 0..N one by one up to EVERY_HEAD_UP_TO, else 10% steps."""
  if n_heads <= EVERY_HEAD_UP_TO:
    return list(range(n_heads + 1))
  return sorted({round(i * n_heads / 10) for i in range(11)})


def pruning_gates(order, steps: list[int], L: int, H: int) -> np.ndarray:
  """(K,L,H) float32 gates: row k has the first steps[k] heads of `order` off, every other head on."""
  gates = np.ones((len(steps), L, H), np.float32)
  for k, n in enumerate(steps):
    for l, h in order[:n]:
      gates[k, l, h] = 0.0
  return gates


def prunable_fraction(steps: list[int], accuracy, n_heads: int, tolerance: float = TOLERANCE) -> float:
  """The largest steps[k]/N such that accuracy stays >= accuracy[0] - tolerance at every point up to k."""
  acc = np.asarray(accuracy, np.float64)
  ok = acc >= acc[0] - tolerance - 1e-9  # accuracies are means of 0/1 hits: equal ones compare exactly
  last = len(ok) - 1 if ok.all() else int(np.argmin(ok)) - 1
  return steps[last] / n_heads


def pruning_curve(evaluate: Callable[[np.ndarray], tuple], importance: dict[str, np.ndarray],
                  tolerance: float = TOLERANCE) -> dict[str, object]:
  """The pruning curve: evaluate(gates (K,L,H)) -> (loss (K,), accuracy (K,)) at each point of pruning_steps.

  Returns order (N,2), heads_off, fraction_off, loss, accuracy (lists, the
  first point unpruned), tolerance and prunable_fraction.
  """
  L, H = np.asarray(importance["raw"]).shape
  order = pruning_order(importance)
  steps = pruning_steps(L * H)
  loss, acc = (np.asarray(a, np.float64) for a in evaluate(pruning_gates(order, steps, L, H)))
  return {"order": order.tolist(), "heads_off": steps, "fraction_off": [n / (L * H) for n in steps],
          "loss": loss.tolist(), "accuracy": acc.tolist(), "tolerance": tolerance,
          "prunable_fraction": prunable_fraction(steps, acc, L * H, tolerance)}
