"""Head mechanisms any variant carries: output gates, attention sinks, QK-norm (window, softcap).

HeadConfig switches them on (gate, sinks, qk_norm, window, softcap); this
module holds their parameters, their math and their counts, in one place, and
attn.variants.base applies them in the shared path every variant goes through
(queries_and_keys, core, probabilities, project_out). attn.init adds their
parameters to the variant's own, attn.count adds their counts to the
variant's, attn.convert carries them across unchanged: every mechanism acts on
query heads, key heads of width d_k or the attention core, which all variants
share. A variant that cannot carry one refuses it in its `check`, with the
reason.

  gate "headwise"     w_gate (D,H) [+ b_gate (H,)]: o_h ← o_h·σ(x·w_gate[:, h] + b_gate[h])
  gate "elementwise"  w_gate (D,H,V) [+ b_gate (H,V)]: o_h ← o_h ⊙ σ(x·w_gate[:, h] + b_gate[h])
      (Qiu et al. 2025, "Gated Attention for LLMs", G1: after the attention
      core, before W^O; x is the token whose output o_h is.)
  sinks               sinks (H,): one more logit per query head in every softmax
      denominator, with no value (gpt-oss); a row's weights sum to less than 1.
  qk_norm             q_norm (K,), k_norm (K,): every query and key head RMS-normalised
      over its d_k dims, times the scales (shared by the heads), before RoPE (Qwen3).
  window, softcap     no parameters: arguments of kernel.attention.

Counts, per layer (b = 1 with use_bias): params H·(D + b) (headwise gate),
H·V·(D + b) (elementwise), H (sinks), 2·K (qk_norm). FLOPs: 2·T·D·H or
2·T·D·H·V for the gate's projection (elementwise products not counted). Score
weights: 2·K for qk_norm (the logits depend on both scales). The effective
count (the dimension of the function class) changes beyond the mechanism's own
parameters: base.value_output_dof and base.factored_score_dof read cfg, and
effective_param_count here adds the rest; their docstrings give the reasons.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attn.config import HeadConfig

Array = jax.Array
Params = dict[str, Array]

# Every parameter name a mechanism may add; a variant never uses these names.
NAMES = ("w_gate", "b_gate", "sinks", "q_norm", "k_norm")


def init(key: Array, cfg: HeadConfig, dtype=jnp.float32) -> Params:
  """The mechanisms' parameters for cfg: gate weights N(0, 1/D) and zero bias, zero sinks, unit
  norm scales; {} when none is on."""
  D, H, K, V = cfg.d_model, cfg.num_heads, cfg.d_k, cfg.d_v
  out = {}
  if cfg.gate is not None:
    shape = (H,) if cfg.gate == "headwise" else (H, V)
    out["w_gate"] = (jax.random.normal(key, (D, *shape), jnp.float32) / jnp.sqrt(D)).astype(dtype)
    if cfg.use_bias:
      out["b_gate"] = jnp.zeros(shape, dtype)
  if cfg.sinks:
    out["sinks"] = jnp.zeros((H,), dtype)
  if cfg.qk_norm:
    out.update(q_norm=jnp.ones((K,), dtype), k_norm=jnp.ones((K,), dtype))
  return out


def split(params: Params) -> tuple[Params, Params]:
  """(the variant's own parameters, the mechanisms')."""
  own = {n: a for n, a in params.items() if n not in NAMES}
  return own, {n: a for n, a in params.items() if n in NAMES}


# The math, applied by attn.variants.base's shared path.

def rms_norm(x_BTNK: Array, scale_K: Array, eps: float) -> Array:
  """x / sqrt(mean over K of x² + eps) · scale, in float32, returned in x's dtype."""
  x = x_BTNK.astype(jnp.float32)
  y = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
  return (y * scale_K.astype(jnp.float32)).astype(x_BTNK.dtype)


def normalize_qk(params: Params, q_BTHK: Array, k_BSGK: Array,
                 cfg: HeadConfig) -> tuple[Array, Array]:
  """QK-norm (cfg.qk_norm): each query and key head RMS-normalised, times q_norm and k_norm."""
  if not cfg.qk_norm:
    return q_BTHK, k_BSGK
  return (rms_norm(q_BTHK, params["q_norm"], cfg.qk_norm_eps),
          rms_norm(k_BSGK, params["k_norm"], cfg.qk_norm_eps))


def sinks(params: Params, cfg: HeadConfig) -> Array | None:
  """The per-head sink logits (H,), or None without sinks."""
  return params["sinks"] if cfg.sinks else None


def gate_output(params: Params, x_BTD: Array, o_BTHV: Array, cfg: HeadConfig) -> Array:
  """o_h times σ(x·W_gate,h + b_gate,h): one gate per head ("headwise") or per value dim."""
  if cfg.gate is None:
    return o_BTHV
  w_gate = params["w_gate"]
  z = jnp.einsum("BTD,D...->BT...", x_BTD, w_gate, preferred_element_type=jnp.float32)
  z = z + params.get("b_gate", jnp.zeros((), w_gate.dtype)).astype(jnp.float32)
  g = jax.nn.sigmoid(z)
  g_BTHV = g[..., None] if cfg.gate == "headwise" else g
  return (o_BTHV.astype(jnp.float32) * g_BTHV).astype(o_BTHV.dtype)


# Counts, added to the variant's by attn.count.

def param_count(cfg: HeadConfig) -> int:
  """Parameters the mechanisms add (module docstring)."""
  D, H, K, V = cfg.d_model, cfg.num_heads, cfg.d_k, cfg.d_v
  b = 1 if cfg.use_bias else 0
  gate = {None: 0, "headwise": H * (D + b), "elementwise": H * V * (D + b)}[cfg.gate]
  return gate + (H if cfg.sinks else 0) + (2 * K if cfg.qk_norm else 0)


def effective_param_count(cfg: HeadConfig) -> int:
  """Degrees of freedom the mechanisms add beyond what the variant's own count reads from cfg.

  The gate's weights and biases are all free (σ is not homogeneous: no
  rescaling trades them against W^O); each sink is one more logit per head.
  The rest (b_v no longer folding into b_o, the elementwise gate's smaller
  gauge, the key bias no longer dropping out, QK-norm's scales) is counted by
  base.value_output_dof and base.factored_score_dof, which read cfg.
  """
  D, H, V = cfg.d_model, cfg.num_heads, cfg.d_v
  b = 1 if cfg.use_bias else 0
  gate = {None: 0, "headwise": H * (D + b), "elementwise": H * V * (D + b)}[cfg.gate]
  return gate + (H if cfg.sinks else 0)


def flops(cfg: HeadConfig, T: int, S: int) -> int:
  """The gate's projection, 2·T·D·H (headwise) or 2·T·D·H·V (elementwise); the rest elementwise."""
  del S
  D, H, V = cfg.d_model, cfg.num_heads, cfg.d_v
  return {None: 0, "headwise": 2 * T * D * H, "elementwise": 2 * T * D * H * V}[cfg.gate]


def score_weights(cfg: HeadConfig) -> int:
  """Weights the logits depend on that the mechanisms add: q_norm and k_norm (2·K)."""
  return 2 * cfg.d_k if cfg.qk_norm else 0
