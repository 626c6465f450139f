"""The built-in head mechanisms, as records: output gates, attention sinks, QK-norm, QK L2 clip, window, softcap,
the probability function.

HeadConfig switches them on (gate, sinks, qk_norm, window, softcap, probability) and
validates those fields where it declares them; each record below holds a
mechanism's parameters, its math at its point of the shared path and its
counts (attn.variants.mechanisms has the record and the registry).

  gate "headwise"     w_gate (D,H) [+ b_gate (H,)]: o_h ← o_h·σ(x·w_gate[:, h] + b_gate[h])
  gate "elementwise"  w_gate (D,H,V) [+ b_gate (H,V)]: o_h ← o_h ⊙ σ(x·w_gate[:, h] + b_gate[h])
      (gate_activation "softplus": softplus in σ's place, Laguna's g_proj: a gate in (0, ∞))
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
  qkv_conv            qkv_conv_q (W,H,K), qkv_conv_k (W,G,K), qkv_conv_v (W,G,V) for the projections
      qkv_conv names: each channel of each head through a causal convolution over time,
      y[t] = Σ_j w[j]·x[t − (W − 1) + j] (torch Conv1d's tap order, no bias), before QK-norm,
      the L2 clip, the value norm (value_norm_eps) and RoPE (on_qkv: the variants that offer
      "qkv_heads"). Decoding keeps each convolved projection's last W − 1 tokens as the record's
      state, so cached decoding equals the full pass. Inkling-2's (conv(x) + x)/sqrt(W + 1) is this with taps
      (w + e_last)/sqrt(W + 1), or qkv_conv_residual with its own taps; qkv_conv_dynamic adds per-token taps
      qkv_conv_dyn_* (D,N,W): head n's tap j at token t is x_in[t]·dyn[:, n, j], x_in the projection's input
      (Inkling-2's sconv.weight_proj), and the sum is (conv(x) + dyn(x) + x)/sqrt(2W + 1).
  qk_l2_clip          each query and key head vector scaled by min(1, c/(‖·‖ + 1e-6)),
      c = qk_l2_clip_threshold, after QK-norm and before RoPE (Inkling-2): a vector longer than
      c is brought to norm c, so no logit exceeds c²·scale; with qk_clip_scale the queries are first
      times q_clip_scale (H,K), ones at the start (Inkling-2's query norm.scale).
  qk_norm "fixed"     no parameters: each query and key head RMS-normalised with no learned scale,
      the queries times qk_scale_factor (Muse Spark): every logit is then at most
      qk_scale_factor·√d_k·scale in size whatever the weights.
  output_norm         no parameters: each head's output o_h RMS-normalised over its d_v dims with no
      learned scale (epsilon output_norm_eps), before the gate (Muse Spark's o_norm).
  value_scale         no parameters: every value times a constant (MiMo-V2-Flash), applied to each
      head's output, which is the same function (the weighted sum is linear in the values).
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
from attn.variants.mechanisms import cca, nsa, pooled, selection
from attn.variants.mechanisms.record import HookError, Mechanism

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
  """o_h times σ(x·W_gate,h + b_gate,h) (softplus with gate_activation "softplus"): one gate per head
  ("headwise") or per value dim."""
  w_gate = params["w_gate"]
  z = jnp.einsum("BTD,D...->BT...", x_BTD, w_gate, preferred_element_type=jnp.float32)
  z = z + params.get("b_gate", jnp.zeros((), w_gate.dtype)).astype(jnp.float32)
  g = jax.nn.softplus(z) if cfg.gate_activation == "softplus" else jax.nn.sigmoid(z)
  g_BTHV = g[..., None] if cfg.gate == "headwise" else g
  return (o_BTHV.astype(jnp.float32) * g_BTHV).astype(o_BTHV.dtype)


def _gate_params(cfg: HeadConfig) -> int:
  b = 1 if cfg.use_bias else 0
  return {"headwise": 1, "elementwise": cfg.d_v}[cfg.gate] * cfg.num_heads * (cfg.d_model + b)


def _gate_flops(cfg: HeadConfig, T: int, S: int) -> int:
  del S
  return 2 * T * cfg.d_model * cfg.num_heads * {"headwise": 1, "elementwise": cfg.d_v}[cfg.gate]


GATE = Mechanism(
    name="gate", fields=("gate", "gate_activation"), init=_gate_init, sharding={"w_gate": "DHV", "b_gate": "HV"},
    on_output=gate_output, param_count=_gate_params, effective_param_count=_gate_params,
    flops=_gate_flops, score_weights=_zero, examples=(("gate headwise", {"gate": "headwise"}, "H·(D + b)", "2·T·D·H"),
              ("gate softplus", {"gate": "headwise", "gate_activation": "softplus"}, "H·(D + b)", "2·T·D·H"),
              ("gate elementwise", {"gate": "elementwise", "gate_activation": "sigmoid"}, "H·V·(D + b)",
               "2·T·D·H·V")),
    help="gate: headwise|elementwise, σ(x·W_gate) on each head's output (gate_activation softplus: "
         "softplus(x·W_gate), Laguna's)")


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
  if cfg.qk_norm == "fixed":
    return fixed_norm(q_BTHK, eps, cfg.qk_scale_factor), fixed_norm(k_BSGK, eps, 1.0)
  if cfg.qk_norm == "whole":
    return (_whole_norm(q_BTHK, params["q_norm_whole"], eps, one),
            _whole_norm(k_BSGK, params["k_norm_whole"], eps, one))
  return rms_norm(q_BTHK, params["q_norm"], eps, one), rms_norm(k_BSGK, params["k_norm"], eps, one)


def fixed_norm(x_BTNK: Array, eps: float, factor: float) -> Array:
  """x / sqrt(mean over K of x² + eps) · factor, no learned scale (Muse Spark's qk_norm, its queries times
  qk_scale_factor), in float32, returned in x's dtype: transformers rounds the norm to x's dtype
  before the factor, so in bf16 the two differ by one rounding."""
  x = x_BTNK.astype(jnp.float32)
  y = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
  return (y * factor).astype(x_BTNK.dtype)


def _whole_norm(x_BTNK: Array, scale_NK: Array, eps: float, plus_one: bool) -> Array:
  B, T, N, K = x_BTNK.shape
  return rms_norm(x_BTNK.reshape(B, T, N * K), scale_NK.reshape(N * K), eps, plus_one).reshape(B, T, N, K)


def _qk_norm_init(key: Array, cfg: HeadConfig, dtype=jnp.float32) -> Params:
  del key
  if cfg.qk_norm == "fixed":
    return {}
  fill = jnp.zeros if cfg.qk_norm_plus_one else jnp.ones  # a scale of 1 either way
  if cfg.qk_norm == "whole":
    return {"q_norm_whole": fill((cfg.num_heads, cfg.d_k), dtype),
            "k_norm_whole": fill((cfg.num_kv_heads, cfg.d_k), dtype)}
  return {"q_norm": fill((cfg.d_k,), dtype), "k_norm": fill((cfg.d_k,), dtype)}


def _qk_norm_params(cfg: HeadConfig) -> int:
  if cfg.qk_norm == "fixed":
    return 0
  return (cfg.num_heads + cfg.num_kv_heads) * cfg.d_k if cfg.qk_norm == "whole" else 2 * cfg.d_k


QK_NORM = Mechanism(
    name="qk_norm", fields=("qk_norm", "qk_norm_eps", "qk_norm_plus_one", "qk_scale_factor"), init=_qk_norm_init,
    sharding={"q_norm": None, "k_norm": None, "q_norm_whole": "HK", "k_norm_whole": "GK"},
    on_qk=normalize_qk, param_count=_qk_norm_params, effective_param_count=_zero, flops=_zero,
    score_weights=_qk_norm_params, needs={"qk_heads": "it normalises each query and key head over its d_k dims"},
    examples=(("qk_norm whole", {"qk_norm": "whole"}, "(H + G)·K", "0"),  # before True: the kit's
              ("qk_norm fixed", {"qk_norm": "fixed", "qk_scale_factor": 2.5}, "0", "0"),  # all-at-once
              ("qk_norm", {"qk_norm": True, "qk_scale_factor": 1.0}, "2·K", "0")),  # config keeps per-head
    help="qk_norm: True|whole|fixed, RMSNorm of each query and key head (whole: of all heads at once, "
         "coupling them; fixed: no learned scale, the queries times qk_scale_factor) before RoPE")


# value_scale: a constant on every value, applied to each head's output (the weighted sum is linear
# in the values, so the two are the same function: MiMo-V2-Flash scales v before its cache).

def _value_scale(params: Params, x_BTD: Array, o_BTHV: Array, *, cfg: HeadConfig) -> Array:
  del params, x_BTD
  return (o_BTHV.astype(jnp.float32) * cfg.value_scale).astype(o_BTHV.dtype)


VALUE_SCALE = Mechanism(
    name="value_scale", fields=("value_scale",), on_output=_value_scale, param_count=_zero,
    effective_param_count=_zero, flops=_zero, score_weights=_zero,
    examples=(("value_scale", {"value_scale": 0.707}, "0", "0"),),
    help="value_scale: every value times a constant (MiMo-V2-Flash's attention_value_scale)")


# output_norm: no parameters, on each head's output before the gate (Muse Spark's o_norm)

def _output_norm(params: Params, x_BTD: Array, o_BTHV: Array, *, cfg: HeadConfig) -> Array:
  del params, x_BTD
  return fixed_norm(o_BTHV, cfg.output_norm_eps, 1.0)


OUTPUT_NORM = Mechanism(
    name="output_norm", fields=("output_norm_eps",), on_output=_output_norm, param_count=_zero,
    flops=_zero, score_weights=_zero,  # effective count measured: the norm breaks W_V·W_O's GL(d_v) symmetry
    examples=(("output_norm", {"output_norm_eps": 1e-5}, "0", "0"),),
    help="output_norm_eps: each head's output RMS-normalised over d_v, no learned scale, before the gate "
         "(Muse Spark's o_norm)")


# qk_l2_clip: no parameters, on the queries and keys (after QK-norm, before RoPE)

def l2_clip(x_BTNK: Array, threshold: float) -> Array:
  """Each head vector times min(1, c/(‖x‖ + 1e-6)): longer than c -> norm c, shorter unchanged; in
  float32, returned in x's dtype (Inkling-2's Inkling2L2Clip, its 1e-6 too)."""
  x = x_BTNK.astype(jnp.float32)
  norm = jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True))
  return (x * jnp.minimum(threshold / (norm + 1e-6), 1.0)).astype(x_BTNK.dtype)


def clip_qk(params: Params, q_BTHK: Array, k_BSGK: Array, *, cfg: HeadConfig) -> tuple[Array, Array]:
  """Both clipped; with qk_clip_scale the queries first times q_clip_scale (H,K), in float32 (Inkling-2's
  Inkling2ScaledL2Clip)."""
  c = cfg.qk_l2_clip_threshold
  if cfg.qk_clip_scale:
    scaled = q_BTHK.astype(jnp.float32) * params["q_clip_scale"].astype(jnp.float32)
    return l2_clip(scaled, c).astype(q_BTHK.dtype), l2_clip(k_BSGK, c)
  return l2_clip(q_BTHK, c), l2_clip(k_BSGK, c)


def _clip_init(key: Array, cfg: HeadConfig, dtype=jnp.float32) -> Params:
  del key
  return {"q_clip_scale": jnp.ones((cfg.num_heads, cfg.d_k), dtype)} if cfg.qk_clip_scale else {}


def _clip_flops(cfg: HeadConfig, T: int, S: int) -> int:
  """Per vector of K: K squares and K − 1 adds for the norm, K products: (3K)·(T·H + S·G) (the
  square root, the divide and the min per vector, like the norms' elementwise work elsewhere, not
  counted)."""
  return 3 * cfg.d_k * (T * cfg.num_heads + S * cfg.num_kv_heads)


# Its effective count has no closed form: which vectors the clip reaches depends on the data (none
# at a large threshold: the plain head's count; all at a small one: a norm that frees each row's
# scale, as QK-norm does), so attn.count measures it (the Jacobian's rank at random inputs).
QK_L2_CLIP = Mechanism(
    name="qk_l2_clip", fields=("qk_l2_clip_threshold", "qk_clip_scale"), on_qk=clip_qk, init=_clip_init,
    sharding={"q_clip_scale": "HK"}, param_count=lambda cfg: cfg.num_heads * cfg.d_k if cfg.qk_clip_scale else 0,
    flops=_clip_flops, score_weights=lambda cfg: cfg.num_heads * cfg.d_k if cfg.qk_clip_scale else 0,
    needs=lambda cfg: {"qk_heads": "it clips each query and key head vector of d_k dims",
                       **({"qkv_heads": "its learned scale is one per query head and dim, on the H query heads "
                                        "the per-head projections hand over"} if cfg.qk_clip_scale else {})},
    examples=(("qk_l2_clip", {"qk_l2_clip_threshold": 1.0}, "0", "3·K·(T·H + S·G)"),
              ("qk_l2_clip scaled", {"qk_l2_clip_threshold": 1.0, "qk_clip_scale": True}, "H·K",
               "3·K·(T·H + S·G)")),
    help="qk_l2_clip_threshold: c > 0, each query/key head vector scaled down to L2 norm ≤ c "
         "(Inkling-2) before RoPE; qk_clip_scale: the queries times a learned (H,K) scale first")


# qkv_conv: a short causal convolution over time on the projections, per head and channel

_QKV_LETTERS = {"q": "HK", "k": "GK", "v": "GV"}


def _conv_sizes(cfg: HeadConfig) -> dict[str, tuple[int, int]]:
  """Each convolved projection's (heads, width): q (H, K), k (G, K), v (G, V), in cfg.qkv_conv's order."""
  sizes = {"q": (cfg.num_heads, cfg.d_k), "k": (cfg.num_kv_heads, cfg.d_k), "v": (cfg.num_kv_heads, cfg.d_v)}
  return {c: sizes[c] for c in cfg.qkv_conv}


def _qkv_conv_init(key: Array, cfg: HeadConfig, dtype=jnp.float32) -> Params:
  """Taps (W, N, C), torch Conv1d's order (the last one multiplies the current token): 1 on the last
  (the identity: at step 0 the head is the plain one) plus U(−1, 1)/sqrt(W) on every tap, so the
  gradient reaches the earlier taps from the first step; with qkv_conv_residual no 1 (the input is added
  back), with qkv_conv_dynamic per-token taps' projections qkv_conv_dyn_* (D, N, W) at N(0, 1/D)/W."""
  W, out = cfg.qkv_conv_width, {}
  for i, (c, (N, C)) in enumerate(_conv_sizes(cfg).items()):
    noise = jax.random.uniform(jax.random.fold_in(key, i), (W, N, C), jnp.float32, -1.0, 1.0) / W ** 0.5
    out[f"qkv_conv_{c}"] = (noise if cfg.qkv_conv_residual else noise.at[W - 1].add(1.0)).astype(dtype)
    if cfg.qkv_conv_dynamic:
      D = cfg.d_model
      dyn = jax.random.normal(jax.random.fold_in(key, 10 + i), (D, N, W), jnp.float32) / (D ** 0.5 * W)
      out[f"qkv_conv_dyn_{c}"] = dyn.astype(dtype)
  return out


def causal_conv(x_BTNC: Array, w_WNC: Array, state_BWNC: Array | None = None) -> tuple[Array, Array]:
  """(y, new state): y[t] = Σ_j w[j]·x[t − (W − 1) + j] over x preceded by state (its last W − 1
  tokens; zeros when None), in float32, returned in x's dtype; the new state is the last W − 1 rows."""
  W = w_WNC.shape[0]
  B, T, N, C = x_BTNC.shape
  if state_BWNC is None:
    state_BWNC = jnp.zeros((B, W - 1, N, C), x_BTNC.dtype)
  padded = jnp.concatenate([state_BWNC.astype(x_BTNC.dtype), x_BTNC], axis=1)
  f32, w = padded.astype(jnp.float32), w_WNC.astype(jnp.float32)
  y = sum(w[j] * f32[:, j:j + T] for j in range(W))
  return y.astype(x_BTNC.dtype), padded[:, T:]


def dynamic_conv(x_BTNC: Array, w_WNC: Array, dyn_BTNW: Array, state_BWNC: Array | None) -> tuple[Array, Array]:
  """(y, new state), Inkling-2's hybrid form: y[t] = (Σ_j (w[j] + dyn[t, :, j])·x[t − (W − 1) + j] + x[t])
  / sqrt(2W + 1), dyn (B,T,N,W) one tap per head and token in Conv1d's order, in float32."""
  W = w_WNC.shape[0]
  B, T, N, C = x_BTNC.shape
  if state_BWNC is None:
    state_BWNC = jnp.zeros((B, W - 1, N, C), x_BTNC.dtype)
  padded = jnp.concatenate([state_BWNC.astype(x_BTNC.dtype), x_BTNC], axis=1)
  f32, w, dyn = padded.astype(jnp.float32), w_WNC.astype(jnp.float32), dyn_BTNW.astype(jnp.float32)
  y = sum((w[j] + dyn[..., j, None]) * f32[:, j:j + T] for j in range(W)) + f32[:, W - 1:]
  return (y / jnp.sqrt(jnp.float32(2 * W + 1))).astype(x_BTNC.dtype), padded[:, T:]


def conv_qkv(params: Params, q_BTHK: Array, k_BSGK: Array, v_BSGV: Array, *, cfg: HeadConfig,
             state=None, inputs=None) -> tuple[Array, Array, Array]:
  """The projections cfg.qkv_conv names through their convolutions; while decoding (state), from the
  state's last W − 1 projections, which are replaced by the ones after these tokens. qkv_conv_residual:
  (conv(x) + x)/sqrt(W + 1); qkv_conv_dynamic: per-token taps from inputs (the projections' inputs)."""
  out = {"q": q_BTHK, "k": k_BSGK, "v": v_BSGV}
  for c in cfg.qkv_conv:
    name = f"qkv_conv_state_{c}"
    held = None if state is None else state[name]
    if cfg.qkv_conv_dynamic:
      if inputs is None:
        raise HookError("qkv_conv", "on_qkv", "qkv_conv_dynamic reads the projections' inputs, and this "
                        "variant hands none (per_head, fused, two_stage and split_input do)")
      x_in = inputs["qkv".index(c)]
      dyn = jnp.einsum("BTD,DNW->BTNW", x_in, params[f"qkv_conv_dyn_{c}"], preferred_element_type=jnp.float32)
      out[c], new = dynamic_conv(out[c], params[f"qkv_conv_{c}"], dyn, held)
    else:
      y, new = causal_conv(out[c], params[f"qkv_conv_{c}"], held)
      if cfg.qkv_conv_residual:  # Inkling-2's sliding form
        W = cfg.qkv_conv_width
        y = ((y.astype(jnp.float32) + out[c].astype(jnp.float32)) / jnp.sqrt(jnp.float32(W + 1))).astype(y.dtype)
      out[c] = y
    if state is not None:
      state[name] = new.astype(state[name].dtype)
  return out["q"], out["k"], out["v"]


def _qkv_conv_params(cfg: HeadConfig) -> int:
  dyn = cfg.d_model * sum(N for N, _ in _conv_sizes(cfg).values()) if cfg.qkv_conv_dynamic else 0
  return cfg.qkv_conv_width * (sum(N * C for N, C in _conv_sizes(cfg).values()) + dyn)


def _qkv_conv_flops(cfg: HeadConfig, T: int, S: int) -> int:
  """2·W per channel and token: the queries' H·K channels over T tokens, the keys' and values' over S; with
  qkv_conv_dynamic 2·W per channel and token more, and 2·D·N·W per token for the per-token taps."""
  tokens = {"q": T, "k": S, "v": S}
  taps = 2 if cfg.qkv_conv_dynamic else 1
  total = 2 * taps * cfg.qkv_conv_width * sum(tokens[c] * N * C for c, (N, C) in _conv_sizes(cfg).items())
  if cfg.qkv_conv_dynamic:
    total += 2 * cfg.d_model * cfg.qkv_conv_width * sum(tokens[c] * N for c, (N, _) in _conv_sizes(cfg).items())
  return total


def _qkv_conv_score_weights(cfg: HeadConfig) -> int:
  dyn = cfg.d_model if cfg.qkv_conv_dynamic else 0
  return cfg.qkv_conv_width * sum(N * (C + dyn) for c, (N, C) in _conv_sizes(cfg).items() if c != "v")


# Its effective count is measured: the taps of a channel trade against that channel's column of
# W_Q, W_K or W_V only where W = 1 (a scale), and how the rest adds to the function class is not
# worked out here.
QKV_CONV = Mechanism(
    name="qkv_conv", fields=("qkv_conv", "qkv_conv_width", "qkv_conv_residual", "qkv_conv_dynamic"),
    init=_qkv_conv_init, reads_inputs=True,
    sharding={"qkv_conv_q": "WHK", "qkv_conv_k": "WGK", "qkv_conv_v": "WGV", "qkv_conv_dyn_q": "DHW",
              "qkv_conv_dyn_k": "DGW", "qkv_conv_dyn_v": "DGW"},
    on_qkv=conv_qkv, param_count=_qkv_conv_params, flops=_qkv_conv_flops,
    score_weights=_qkv_conv_score_weights,
    state=lambda cfg: {f"qkv_conv_state_{c}": (cfg.qkv_conv_width - 1, N, C) for c, (N, C) in _conv_sizes(cfg).items()},
    needs=lambda cfg: {"qkv_heads": "it convolves each query, key and value head over time and keeps their last "
                                    "projections while decoding",
                       **({"projection_inputs": "qkv_conv_dynamic computes per-token taps from them"}
                          if cfg.qkv_conv_dynamic else {})},
    examples=(("qkv_conv kv", {"qkv_conv": "kv", "qkv_conv_width": 3}, "W·(G·K + G·V)", "2·W·S·(G·K + G·V)"),
              ("qkv_conv qkv", {"qkv_conv": "qkv", "qkv_conv_width": 2}, "W·(H·K + G·K + G·V)",
               "2·W·(T·H·K + S·G·K + S·G·V)"),
              ("qkv_conv kv dynamic", {"qkv_conv": "kv", "qkv_conv_width": 3, "qkv_conv_residual": True,
                                       "qkv_conv_dynamic": True}, "W·(G·K + G·V + 2·D·G)",
               "4·W·S·(G·K + G·V) + 4·W·S·D·G")),
    help="qkv_conv: q|k|v|qk|qv|kv|qkv, a causal depthwise convolution of qkv_conv_width taps over "
         "time on those projections, per head (Inkling-2: keys and values)")


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
# output_norm before the gate: Muse Spark normalises each head's output, then gates it.
MECHANISMS = (OUTPUT_NORM, GATE, SINKS, QKV_CONV, cca.CCA, QK_NORM, QK_L2_CLIP, VALUE_SCALE, WINDOW, SOFTCAP,
              PROBABILITY, *selection.RECORDS, nsa.NSA, *pooled.RECORDS)
