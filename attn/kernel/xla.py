"""impl "xla" and "cudnn": the core through jax.nn.dot_product_attention.

jax's function has no weights out, no sinks, no soft-cap and only softmax, and
its public API needs d_v = d_k; attn's contract (bottom-right causal alignment,
zeros for a fully masked row) is restored around it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attn.kernel import masks
from attn.kernel.call import Call, Refusal

Array = jax.Array


_JAX = "jax.nn.dot_product_attention"


def why_not(call: Call) -> Refusal | None:
  """What of this call jax.nn.dot_product_attention cannot run, or None."""
  if call.return_weights:
    return Refusal("return_weights", True, "False", f"{_JAX} returns no weights")
  if call.sinks is not None:
    return Refusal("sinks", "an array", "None", f"{_JAX} has no sinks")
  if call.softcap is not None:
    return Refusal("softcap", call.softcap, "None", f"{_JAX} has no softcap")
  if call.probability != "softmax":
    return Refusal("probability", call.probability, '"softmax"', f"{_JAX} has only softmax")
  if call.V != call.K:
    return Refusal("v.shape[-1]", call.V, f"d_v = d_k = {call.K}", f"{_JAX} needs d_v = d_k")
  return None


def cudnn_head_max() -> int:
  """cuDNN flash attention's largest head: 256 from Hopper (compute capability 9.0) on, else 128."""
  try:
    capability = float(getattr(jax.devices()[0], "compute_capability", "0"))
  except (RuntimeError, ValueError):
    capability = 0.0
  return 256 if capability >= 9.0 else 128


def _dense_mask_needed(call: Call) -> bool:
  """Whether the call reaches cuDNN with a dense mask (which it adds as a bias)."""
  aligned = call.T == call.S or (call.T == 1 and call.window is None)
  return (call.mask is not None or (call.is_causal and not aligned)
          or (call.window is not None and not (call.is_causal and aligned)))


def why_not_cudnn(call: Call) -> Refusal | None:
  """cuDNN's flash attention (jax's checks in jax._src.cudnn.fused_attention_stablehlo, before tracing):
  half precision, one dtype, d_k a multiple of 8 up to 256 (128 before Hopper), even T and S
  with a bias or a dense mask."""
  if (why := why_not(call)) is not None:
    return why
  if call.dtypes - {"bfloat16", "float16"} or len(call.dtypes) > 1:
    return Refusal("q.dtype", sorted(call.dtypes), "one of bfloat16, float16 for q, k and v alike",
                   "cuDNN's flash attention runs in half precision")
  head_max = cudnn_head_max() if call.K > 128 else 256
  if call.K % 8 or call.K > head_max:
    return Refusal("q.shape[-1]", call.K, f"a multiple of 8 up to {head_max}",
                   "cuDNN's head sizes on this GPU")
  if (call.logits_bias is not None or _dense_mask_needed(call)) and (call.T % 2 or call.S % 2):
    return Refusal("q.shape[1]" if call.T % 2 else "k.shape[1]", call.T if call.T % 2 else call.S,
                   "an even length with a logits_bias, a dense mask, or causal/window at T != S",
                   "cuDNN's backward pass with a bias needs even T and S")
  return None


def attention(call: Call, implementation: str) -> Array:
  """The same function through jax.nn.dot_product_attention ("xla" or "cudnn")."""
  call = call.with_shared_key()
  q_BTHK, k_BSGK, v_BSGV, mask = call.q_BTHK, call.k_BSGK, call.v_BSGV, call.mask
  B, T, H, S = call.q_BTHK.shape[0], call.T, call.H, call.S
  window, is_causal, kv_lengths = call.window, call.is_causal, call.kv_lengths
  # jax's is_causal and local_window_size are top-left aligned (key s visible
  # iff s <= t, and t - left <= s <= t + right); attn's are bottom-right, so
  # for T != S they travel as a dense mask (which cuDNN adds as a bias: slower).
  # At T == S a causal window w is jax's (w - 1, 0), which cuDNN runs as its
  # sliding window. One query (decoding) with is_causal sees every key.
  if is_causal and T == 1 and S > 1 and window is None:
    is_causal = False
  jax_causal = is_causal and T == S
  jax_window = None
  if window is not None and jax_causal:
    jax_window = (min(window, S) - 1, 0)
  elif window is not None:
    mask = masks.combine_masks(mask, masks.window_mask(T, S, window))
  if is_causal and T != S:
    mask = masks.combine_masks(mask, masks.causal_mask(T, S))
  out_BTHV = jax.nn.dot_product_attention(
      q_BTHK, k_BSGK, v_BSGV, bias=call.logits_bias, mask=mask, scale=call.scale,
      is_causal=jax_causal,
      key_value_seq_lengths=None if kv_lengths is None else kv_lengths.astype(jnp.int32),
      local_window_size=jax_window, implementation=implementation)
  keep = masks.rows_with_keys(mask, T, S, jax_causal, kv_lengths, window if jax_window else None,
                              B, H)
  if keep is None:
    return out_BTHV
  # jax gives a fully masked row uniform weights; attn's contract is zeros.
  return jnp.where(keep, out_BTHV, 0).astype(out_BTHV.dtype)
