"""RMSNorm forms and the residual gate: the pieces of Muse Spark's text model that attn's blocks lacked.

An RMSNorm over the last axis, x̂ = x / sqrt(mean(x²) + eps), in one of NORM_FORMS:
  "scale"         x̂·w, w starting at 1 (Llama's; norm_type "rmsnorm")
  "plus_one"      x̂·(1 + w), w starting at 0 (Gemma's; norm_type "rmsnorm_plus_one")
  "input_scaled"  the RMSNorm of x·(1 + w), w starting at 0: the scale goes in before normalising, so
                  it weighs the dims against each other and the output is still of RMS 1 (Muse Spark's
                  post-feed-forward norm and the experts' output norm)
  "none"          x̂, no parameter (Muse Spark's embedding, post-attention, per-head output and QK norms)
ModelConfig.norm_forms gives a place (NORM_PLACES) its form; the others follow norm_type.

The residual gate (ModelConfig.residual_gate τ; Muse Spark's MuseSparkResidualGate) replaces a
sublayer's x + y by α⊙x + β⊙y with a learned g (D,) per sublayer: w = g/τ, β = σ(w),
α = sqrt(max(σ(−w)·(1 + β), 1e-3)), in float32. Since σ(−w) = 1 − β, α² + β² = 1 (above the floor):
a variance-preserving mix of the stream and the sublayer's output; at g = 0 it is 0.87·x + 0.5·y.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array
NORM_FORMS = ("scale", "plus_one", "input_scaled", "none")
# Where ModelConfig.norm_forms may set a form: the embedding's norm, the norms after the attention and
# the MLP (norm "sandwich" or "after"), the final norm.
NORM_PLACES = ("embed", "attn_post", "mlp_post", "final")
RESIDUAL_GATE_EPS = 1e-3  # MuseSparkResidualGate's floor under α²


def rms(x: Array, scale: Array | None, eps: float, form: str) -> Array:
  """The RMSNorm of x over its last axis in `form` (module docstring), float32 inside, in x's dtype."""
  x32 = x.astype(jnp.float32)
  if form == "input_scaled":  # rounded to x's dtype before normalising, as transformers does
    x32 = (x32 * (1.0 + scale.astype(jnp.float32))).astype(x.dtype).astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  if form == "scale":
    y = y * scale.astype(jnp.float32)
  elif form == "plus_one":
    y = y * (1.0 + scale.astype(jnp.float32))
  return y.astype(x.dtype)


def initial_scale(form: str) -> float | None:
  """The scale's starting value in `form` (1 for "scale", 0 for the forms that add 1), None without one."""
  return {"scale": 1.0, "plus_one": 0.0, "input_scaled": 0.0}.get(form)


def residual_gate(g: Array, temperature: float, x: Array, y: Array) -> Array:
  """α⊙x + β⊙y in float32 (module docstring), returned in x's dtype."""
  w = g.astype(jnp.float32) / temperature
  beta = jax.nn.sigmoid(w)
  alpha = jnp.sqrt(jnp.maximum(jax.nn.sigmoid(-w) * (1.0 + beta), RESIDUAL_GATE_EPS))
  return (alpha * x.astype(jnp.float32) + beta * y.astype(jnp.float32)).astype(x.dtype)
