"""The pieces the fixed-state heads share: their refusals, the short causal convolution, the norms,
padding, and the record fields of a state cache.

A head with a fixed-size state reads its own tokens in order, so its `apply` takes causal
self-attention only: context, mask, return_weights and is_causal=False are refused by name
(check_call), before any array is touched. kv_lengths is honoured: a token past its example's
length is zeroed before the projections (transformers' apply_mask_to_padding_states) and writes
nothing to the state nor decays it (core.chunked), so nothing it holds reaches any output. RoPE
and the head mechanisms that act on scores (sinks, softcap, window, probability, QK-norm, outside
mechanisms) have no scores here to act on and are refused in check(cfg); the output gate
(cfg.gate) acts on each head's output before W^O, as for every variant.

The short causal convolution (Qwen3-Next, Kimi Linear, Mamba-2): depthwise over time, width W =
cfg.conv_width, its weight (W, channels) with w[j] multiplying the input j − (W − 1) steps
before: torch's Conv1d weight (channels, 1, W) transposed. Decoding carries its last W − 1
inputs ("conv" in the state).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from attn.config import HeadConfig, invalid, kept_at
from attn.variants import mechanisms
from attn.variants.base import Options, Params, no_circuits

Array = jax.Array

NORM_EPS = 1e-6  # parts.rms's default; the gated output norms read HeadConfig.gated_norm_eps (1e-6)


def check(cfg: HeadConfig, name: str) -> None:
  """Refuse what a head without scores cannot carry, naming the field and what is allowed."""
  if cfg.rope_dim:
    raise invalid("rope_dim", cfg.rope_dim, f"0 for {name}: it has no query-key scores to rotate "
                  "(order comes from the recurrence and the short convolution)")
  for field, off in (("sinks", False), ("softcap", None), ("window", None),
                     ("probability", "softmax"), ("qk_norm", False)):
    if getattr(cfg, field) != off:
      raise invalid(field, getattr(cfg, field), f"{kept_at(off)} for {name}: a linear head has no "
                    "attention logits or weights for it to act on")
  for m in mechanisms.active(cfg):
    if m.fields and m.name not in ("gate", "value_scale"):  # a built-in the list above does not name (qk_l2_clip)
      raise invalid(m.fields[0], getattr(cfg, m.fields[0]), f"{kept_at(mechanisms.default_of(m.fields[0]))} "
                    f"for {name}: a linear head has no query/key heads for {m.name} to act on")
  others = [m.name for m in mechanisms.active(cfg) if m.name not in ("gate", "value_scale")]
  if others:
    raise invalid("extra", dict(cfg.extra or {}), f"{kept_at(None)} for {name}: of the head mechanisms only "
                  f"the output gate and value_scale act on a linear head (not {others})")


def check_call(name: str, context, opts) -> None:
  """Refuse what a causal, self-reading head cannot compute."""
  if context is not None:
    raise invalid("context", "an array", f"None for {name}: a linear head reads its own tokens in "
                  "order (self-attention only)")
  if opts.mask is not None:
    raise invalid("mask", "an array", f"None for {name}: a linear head has no scores to mask; "
                  "give is_causal=True and kv_lengths for padding")
  if opts.return_weights:
    raise invalid("return_weights", True, f"False for {name}: a linear head never forms "
                  "attention weights (its state replaces them)")
  if not opts.is_causal:
    raise invalid("is_causal", False, f"True for {name}: a linear head is causal by construction; "
                  "it has no bidirectional form")


def zero_padding(x_BTD: Array, kv_lengths) -> Array:
  """x with the tokens at and past each example's length zeroed (None: x)."""
  if kv_lengths is None:
    return x_BTD
  valid_BT = jnp.arange(x_BTD.shape[1])[None, :] < kv_lengths[:, None]
  return jnp.where(valid_BT[..., None], x_BTD, 0).astype(x_BTD.dtype)


def causal_conv(x_BTC: Array, w_WC: Array, b_C=None, state_BWC: Array | None = None
                ) -> tuple[Array, Array]:
  """(y (B,T,C), the last W − 1 inputs (B,W−1,C)): depthwise causal convolution from a state."""
  W = w_WC.shape[0]
  B, T, C = x_BTC.shape
  past = (jnp.zeros((B, W - 1, C), x_BTC.dtype) if state_BWC is None
          else state_BWC.astype(x_BTC.dtype))
  xp_BSC = jnp.concatenate([past, x_BTC], axis=1)
  y_BTC = sum(xp_BSC[:, j:j + T] * w_WC[j] for j in range(W))
  if b_C is not None:
    y_BTC = y_BTC + b_C
  return y_BTC, xp_BSC[:, xp_BSC.shape[1] - (W - 1):]


def conv_flops(W: int, channels: int, bias: bool = False) -> int:
  """FLOPs per token of causal_conv over `channels` and the SiLU after it: W multiplies and W − 1
  adds per channel (one more with a bias), SiLU 4 (x·σ(x) as XLA counts it)."""
  return (2 * W - 1 + int(bias) + 4) * channels


# Elementwise FLOPs per element as XLA's cost analysis counts them (exp, rsqrt: transcendentals,
# not FLOPs): l2norm and rms square, sum and scale (3); σ 3, SiLU 4, softplus 6.
NORM, SIGMOID, SILU, SOFTPLUS = 3, 3, 4, 6


def l2norm(x: Array, eps: float = 1e-6) -> Array:
  """x / sqrt(Σ x² + eps) over the last axis, in float32 (transformers' and fla's l2norm)."""
  x = x.astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def rms(x: Array, eps: float = NORM_EPS) -> Array:
  """x / sqrt(mean x² + eps) over the last axis, in float32."""
  x = x.astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


def state_size(state_shapes: dict[str, tuple[int, ...]]) -> int:
  """Numbers of one sequence's state: the sum over entries of their sizes past the batch axis."""
  total = 0
  for shape in state_shapes.values():
    n = 1
    for d in shape:
      n *= d
    total += n
  return total


def init_decay(key, H: int, dtype, shape=None) -> tuple[jax.Array, jax.Array]:
  """a_log = log A with A ~ U(1, 16) (H,), and dt_bias = softplus⁻¹(dt), dt ~ logU(0.001, 0.1)."""
  ka, kd = jax.random.split(key)
  a_log = jnp.log(jax.random.uniform(ka, (H,), jnp.float32, 1.0, 16.0))
  dt = jnp.exp(jax.random.uniform(kd, shape or (H,), jnp.float32, math.log(1e-3), math.log(0.1)))
  return a_log.astype(dtype), (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)


def state_record(name: str, forward_fn, shapes_fn) -> dict:
  """The Variant fields of a fixed-state head: apply (causal only), init_state, step, state_size,
  kv_cache_width 0 and no circuits."""

  def apply(params: Params, x_BTD, context_BSD=None, *, cfg: HeadConfig, opts: Options = Options()):
    check_call(name, context_BSD, opts)
    return forward_fn(params, x_BTD, None, cfg=cfg, opts=opts)[0], None

  def step(params: Params, x_BTD, state, *, cfg: HeadConfig, opts: Options):
    check_call(name, None, opts)
    return forward_fn(params, x_BTD, state, cfg=cfg, opts=opts)

  def init_state(cfg: HeadConfig, batch_size: int, dtype=jnp.float32) -> dict:
    return {n: jnp.zeros((batch_size, *s), jnp.float32 if n == "ssm" else dtype)
            for n, s in shapes_fn(cfg).items()}

  return dict(apply=apply, step=step, init_state=init_state,
              state_size=lambda cfg: state_size(shapes_fn(cfg)),
              kv_cache_width=lambda cfg: 0,
              circuits=no_circuits(name, "a variant with a fixed per-head W_QK = W_Q·W_Kᵀ: a "
                                   "linear head's mixing of values runs through its state, "
                                   "decayed and rewritten token by token"))
