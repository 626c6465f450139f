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
from attn.kernel.dense import structured_mask

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


def why_not_cudnn(call: Call) -> Refusal | None:
  """cuDNN's flash attention: also half precision, one dtype, d_k a multiple of 8 up to 256."""
  if (why := why_not(call)) is not None:
    return why
  if call.dtypes - {"bfloat16", "float16"} or len(call.dtypes) > 1:
    return Refusal("q.dtype", sorted(call.dtypes), "one of bfloat16, float16 for q, k and v alike",
                   "cuDNN's flash attention runs in half precision")
  if call.K % 8 or call.K > 256:
    return Refusal("q.shape[-1]", call.K, "a multiple of 8 up to 256", "cuDNN's head sizes")
  return None


def attention(call: Call, implementation: str) -> Array:
  """The same function through jax.nn.dot_product_attention ("xla" or "cudnn")."""
  call = call.with_shared_key()
  q_BTHK, k_BSGK, v_BSGV, mask = call.q_BTHK, call.k_BSGK, call.v_BSGV, call.mask
  B, T, H, S = call.q_BTHK.shape[0], call.T, call.H, call.S
  window, is_causal, kv_lengths = call.window, call.is_causal, call.kv_lengths
  # jax's is_causal and local_window_size are top-left aligned (key s visible
  # iff s <= t, and t - left <= s <= t + right); attn's are bottom-right, so
  # for T != S they travel as a dense mask. At T == S a causal window w is
  # jax's (w - 1, 0), which cuDNN runs as its sliding window.
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
  full = masks.combine_masks(mask, structured_mask(T, S, jax_causal, kv_lengths,
                                                   window if jax_window else None))
  if full is None:
    return out_BTHV
  # jax gives a fully masked row uniform weights; attn's contract is zeros.
  has_key_BHT = jnp.broadcast_to(full, (B, H, T, S)).any(-1)
  return jnp.where(has_key_BHT.transpose(0, 2, 1)[..., None], out_BTHV, 0).astype(out_BTHV.dtype)
