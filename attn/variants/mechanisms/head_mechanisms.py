"""The built-in head mechanisms, as records: output gates, attention sinks, QK-norm, window, softcap,
the probability function.

HeadConfig switches them on (gate, sinks, qk_norm, window, softcap, probability) and
validates those fields where it declares them; each record below holds a
mechanism's parameters, its math at its point of the shared path and its
counts (attn.variants.mechanisms has the record and the registry).

  gate "headwise"     w_gate (D,H) [+ b_gate (H,)]: o_h ← o_h·σ(x·w_gate[:, h] + b_gate[h])
  gate "elementwise"  w_gate (D,H,V) [+ b_gate (H,V)]: o_h ← o_h ⊙ σ(x·w_gate[:, h] + b_gate[h])
      (Qiu et al. 2025, "Gated Attention for LLMs", G1: after the attention
      core, before W^O; x is the token whose output o_h is.)
  sinks               sinks (H,): one more logit per query head in every softmax
      denominator, with no value (gpt-oss); a row's weights sum to less than 1.
  qk_norm             q_norm (K,), k_norm (K,): every query and key head RMS-normalised
      over its d_k dims, times the scales (shared by the heads), before RoPE (Qwen3);
      with qk_norm_plus_one, times (1 + the scales), which start at 0 (Gemma 3).
  qk_norm "whole"     q_norm_whole (H,K), k_norm_whole (G,K): all query heads normalised
      together over H·K dims, all key heads over G·K, one scale per dim (OLMo 2): a head's
      score depends on every head's projection, so the heads are coupled.
  window, softcap     no parameters: arguments of kernel.attention.
  probability         no parameters: "sigmoid" σ(l − log n) or "relu" max(l, 0)/n in place of
      the softmax, n the keys a row's masks leave visible (attn.kernel.probability, which cites
      the papers and says why n is that); refused with sinks (HeadConfig). It composes
      with a gate (on the output), a softcap (on the logits first), a window and QK-norm,
      and differential's two maps become σ(·) − λ·σ(·) (or the relu pair). Its effective
      count is measured (no closed form: without a normaliser the key bias's constant
      terms move the weights and b_v no longer folds into b_o, and relu is positively
      homogeneous, which trades a scale between each head's W_QK and W_OV).

Counts, per layer (b = 1 with use_bias): params H·(D + b) (headwise gate),
H·V·(D + b) (elementwise), H (sinks), 2·K (qk_norm), (H + G)·K (whole). FLOPs: 2·T·D·H or
2·T·D·H·V for the gate's projection (elementwise products not counted). Score
weights: 2·K for qk_norm, (H + G)·K whole (the logits depend on both scales). The effective
count (the dimension of the function class) changes beyond the mechanism's own
parameters: base.value_output_dof and base.factored_score_dof read cfg, and
the records' effective_param_count add the rest: the gate's weights and biases
are all free (σ is not homogeneous: no rescaling trades them against W^O);
each sink is one more logit per head.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attn.config import HeadConfig
from attn.variants.mechanisms import nsa, pooled, selection
from attn.variants.mechanisms.record import Mechanism

Array = jax.Array
Params = dict[str, Array]


def _zero(cfg: HeadConfig, *lengths) -> int:
  del cfg, lengths
  return 0


# gate

def _gate_shape(cfg: HeadConfig) -> tuple[int, ...]:
  return (cfg.num_heads,) if cfg.gate == "headwise" else (cfg.num_heads, cfg.d_v)


def _gate_init(key: Array, cfg: HeadConfig, dtype=jnp.float32) -> Params:
  """Gate weights N(0, 1/D), zero bias."""
  D, shape = cfg.d_model, _gate_shape(cfg)
  out = {"w_gate": (jax.random.normal(key, (D, *shape), jnp.float32) / jnp.sqrt(D)).astype(dtype)}
  if cfg.use_bias:
    out["b_gate"] = jnp.zeros(shape, dtype)
  return out


def gate_output(params: Params, x_BTD: Array, o_BTHV: Array, *, cfg: HeadConfig) -> Array:
  """o_h times σ(x·W_gate,h + b_gate,h): one gate per head ("headwise") or per value dim."""
  w_gate = params["w_gate"]
  z = jnp.einsum("BTD,D...->BT...", x_BTD, w_gate, preferred_element_type=jnp.float32)
  z = z + params.get("b_gate", jnp.zeros((), w_gate.dtype)).astype(jnp.float32)
  g = jax.nn.sigmoid(z)
  g_BTHV = g[..., None] if cfg.gate == "headwise" else g
  return (o_BTHV.astype(jnp.float32) * g_BTHV).astype(o_BTHV.dtype)


def _gate_params(cfg: HeadConfig) -> int:
  b = 1 if cfg.use_bias else 0
  return {"headwise": 1, "elementwise": cfg.d_v}[cfg.gate] * cfg.num_heads * (cfg.d_model + b)


def _gate_flops(cfg: HeadConfig, T: int, S: int) -> int:
  del S
  return 2 * T * cfg.d_model * cfg.num_heads * {"headwise": 1, "elementwise": cfg.d_v}[cfg.gate]


GATE = Mechanism(
    name="gate", fields=("gate",), init=_gate_init, sharding={"w_gate": "DHV", "b_gate": "HV"},
    on_output=gate_output, param_count=_gate_params, effective_param_count=_gate_params,
    flops=_gate_flops, score_weights=_zero, examples=(("gate headwise", {"gate": "headwise"}, "H·(D + b)", "2·T·D·H"),
              ("gate elementwise", {"gate": "elementwise"}, "H·V·(D + b)", "2·T·D·H·V")),
    help="gate: headwise|elementwise, σ(x·W_gate) on each head's output")


# sinks

def _sinks_init(key: Array, cfg: HeadConfig, dtype=jnp.float32) -> Params:
  del key
  return {"sinks": jnp.zeros((cfg.num_heads,), dtype)}


SINKS = Mechanism(
    name="sinks", fields=("sinks",), init=_sinks_init, sharding={"sinks": "H"},
    kernel=lambda params, cfg: {"sinks": params["sinks"]},
    param_count=lambda cfg: cfg.num_heads, effective_param_count=lambda cfg: cfg.num_heads,
    flops=_zero, score_weights=_zero, examples=(("sinks", {"sinks": True}, "H", "0"),),
    help="sinks: a learned logit per head in every softmax denominator")


# qk_norm

def rms_norm(x_BTNK: Array, scale_K: Array, eps: float, plus_one: bool = False) -> Array:
  """x / sqrt(mean over K of x² + eps) · scale (plus_one: · (1 + scale)), in float32, returned in
  x's dtype."""
  x = x_BTNK.astype(jnp.float32)
  y = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
  scale = scale_K.astype(jnp.float32)
  return (y * (1.0 + scale if plus_one else scale)).astype(x_BTNK.dtype)


def normalize_qk(params: Params, q_BTHK: Array, k_BSGK: Array, *,
                 cfg: HeadConfig) -> tuple[Array, Array]:
  """Each query and key head RMS-normalised, times q_norm and k_norm; with qk_norm "whole", the
  queries over all H·K dims at once (times q_norm_whole (H,K)), the keys over all G·K; with
  qk_norm_plus_one, times 1 + the scales."""
  eps, one = cfg.qk_norm_eps, cfg.qk_norm_plus_one
  if cfg.qk_norm == "whole":
    return (_whole_norm(q_BTHK, params["q_norm_whole"], eps, one),
            _whole_norm(k_BSGK, params["k_norm_whole"], eps, one))
  return rms_norm(q_BTHK, params["q_norm"], eps, one), rms_norm(k_BSGK, params["k_norm"], eps, one)


def _whole_norm(x_BTNK: Array, scale_NK: Array, eps: float, plus_one: bool) -> Array:
  B, T, N, K = x_BTNK.shape
  return rms_norm(x_BTNK.reshape(B, T, N * K), scale_NK.reshape(N * K), eps, plus_one).reshape(B, T, N, K)


def _qk_norm_init(key: Array, cfg: HeadConfig, dtype=jnp.float32) -> Params:
  del key
  fill = jnp.zeros if cfg.qk_norm_plus_one else jnp.ones  # a scale of 1 either way
  if cfg.qk_norm == "whole":
    return {"q_norm_whole": fill((cfg.num_heads, cfg.d_k), dtype),
            "k_norm_whole": fill((cfg.num_kv_heads, cfg.d_k), dtype)}
  return {"q_norm": fill((cfg.d_k,), dtype), "k_norm": fill((cfg.d_k,), dtype)}


def _qk_norm_params(cfg: HeadConfig) -> int:
  return (cfg.num_heads + cfg.num_kv_heads) * cfg.d_k if cfg.qk_norm == "whole" else 2 * cfg.d_k


QK_NORM = Mechanism(
    name="qk_norm", fields=("qk_norm", "qk_norm_eps", "qk_norm_plus_one"), init=_qk_norm_init,
    sharding={"q_norm": None, "k_norm": None, "q_norm_whole": "HK", "k_norm_whole": "GK"},
    on_qk=normalize_qk, param_count=_qk_norm_params, effective_param_count=_zero, flops=_zero,
    score_weights=_qk_norm_params, needs={"qk_heads": "it normalises each query and key head over its d_k dims"},
    examples=(("qk_norm whole", {"qk_norm": "whole"}, "(H + G)·K", "0"),  # before True: the kit's
              ("qk_norm", {"qk_norm": True}, "2·K", "0")),  # all-at-once config keeps per-head
    help="qk_norm: True|whole, RMSNorm of each query and key head (whole: of all heads at once, "
         "coupling them) before RoPE")


# window and softcap: arguments of kernel.attention, no parameters

WINDOW = Mechanism(
    name="window", fields=("window",), kernel=lambda params, cfg: {"window": cfg.window},
    param_count=_zero, effective_param_count=_zero, flops=_zero, score_weights=_zero,
    kv_tokens=lambda cfg, length: min(length, cfg.window),
    examples=(("window", {"window": 4}, "0",
               "0 (fewer in practice: the kernels skip keys outside the window)"),), help="window: keys closer than it to the query")


def _softcap(params: Params, logits_BHTS: Array, *, cfg: HeadConfig) -> Array:
  del params
  return cfg.softcap * jnp.tanh(logits_BHTS / cfg.softcap)


SOFTCAP = Mechanism(
    name="softcap", fields=("softcap",), kernel=lambda params, cfg: {"softcap": cfg.softcap},
    on_logits=_softcap, param_count=_zero, effective_param_count=_zero, flops=_zero,
    score_weights=_zero, examples=(("softcap", {"softcap": 30.0}, "0", "0"),),
    help="softcap: logits -> c·tanh(logits/c)")

# probability: an argument of kernel.attention, no parameters. Last in the registry: the kit's
# all-at-once config keeps sinks, which refuse it.

PROBABILITY = Mechanism(
    name="probability", fields=("probability",),
    kernel=lambda params, cfg: {"probability": cfg.probability},
    param_count=_zero, flops=_zero, score_weights=_zero,
    examples=(("probability relu", {"probability": "relu"}, "0", "0"),
              ("probability sigmoid", {"probability": "sigmoid"}, "0", "0")),
    help="probability: softmax|sigmoid|relu, logits -> weights; sigmoid σ(l − log n), relu "
         "max(l, 0)/n, n the keys a row sees")

# Key selection (attn.variants.mechanisms.selection) last: the kit's all-at-once config, with probability
# "sigmoid" on, leaves them off (they take softmax heads only).
MECHANISMS = (GATE, SINKS, QK_NORM, WINDOW, SOFTCAP, PROBABILITY, *selection.RECORDS, nsa.NSA, *pooled.RECORDS)
