"""impl "tokamax": tokamax.dot_product_attention's GPU kernels (Mosaic on sm90+, else Triton).

tokamax (pip install 'attn[tokamax]') has grouped heads, d_v ≠ d_k, a dense
mask, a bias, soft-cap, causal, kv lengths and a window, forward and backward,
and no sinks. attn's contract is kept around it:

- its is_causal and local window are top-left aligned (key s visible to query
  t iff s <= t); attn's are bottom-right (s <= t + S - T), so for T ≠ S they
  travel as a dense mask (right, slower); at T = S they are tokamax's own;
- it caps scale·q kᵀ + bias, attn caps before the bias: soft-cap with a
  logits_bias is refused;
- a fully masked row is zeros, in value and gradient.

IMPLEMENTATIONS is the order handed to tokamax (the first that takes the call);
its "xla" path, which runs anywhere, lets the tests check this wrapper on CPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attn.kernel import masks
from attn.kernel.call import Call, Refusal

Array = jax.Array

IMPLEMENTATIONS = ("mosaic", "triton")  # never "xla": an O(T²)-memory fallback would hide


def unavailable() -> str | None:
  try:
    import tokamax  # noqa: F401
  except ImportError as e:
    return f"the tokamax package does not import ({e}); pip install 'attn[tokamax]'"
  return None


def why_not(call: Call) -> Refusal | None:
  """What of this call tokamax cannot run, or None."""
  if call.return_weights:
    return Refusal("return_weights", True, "False", "tokamax returns no weights")
  if call.sinks is not None:
    return Refusal("sinks", "an array", "None", "tokamax has no sinks")
  if call.probability != "softmax":
    return Refusal("probability", call.probability, '"softmax"', "tokamax is softmax only")
  if call.softcap is not None and call.logits_bias is not None:
    return Refusal("softcap", call.softcap, "None with a logits_bias",
                   "tokamax caps the logits after the bias, attn before it")
  return None


def _present(names) -> tuple[str, ...]:
  """The names tokamax has here ("mosaic" needs its Mosaic GPU module to have imported)."""
  from tokamax._src.ops.attention import api  # the one private name read: what imported
  have = set(getattr(api, "IMPLEMENTATIONS", {}))
  keep = tuple(n for n in names if n in have or (n == "mosaic" and "mosaic_gpu" in have))
  return keep or tuple(names)


def _absl_defaults() -> None:
  """tokamax reads its settings from absl flags, parsing sys.argv on first use, which fails under
  any command line with flags of its own (attn's, pytest's): absl's flags keep their defaults."""
  from absl import flags
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()


def attention(call: Call, implementation=None) -> Array:
  """kernel.attention's function through tokamax.dot_product_attention; the call checked by why_not."""
  import tokamax
  _absl_defaults()
  c = call.with_shared_key()
  B, T, H, S = c.q_BTHK.shape[0], c.T, c.H, c.S
  mask, window = c.mask, c.window
  aligned = T == S  # tokamax's top-left alignment is attn's bottom-right one
  tk_window = None
  if window is not None and aligned:
    w = min(window, S)
    tk_window = (w - 1, 0 if c.is_causal else w - 1)
  elif window is not None:
    mask = masks.combine_masks(mask, masks.window_mask(T, S, window))
  if c.is_causal and not aligned:
    mask = masks.combine_masks(mask, masks.causal_mask(T, S))
  names = IMPLEMENTATIONS if implementation is None else (implementation,)
  out_BTHV = tokamax.dot_product_attention(
      c.q_BTHK, c.k_BSGK, c.v_BSGV, bias=c.logits_bias,
      mask=mask,
      scale=c.scale, is_causal=c.is_causal and aligned,
      key_value_seq_lengths=None if c.kv_lengths is None else c.kv_lengths.astype(jnp.int32),
      local_window_size=tk_window, logits_soft_cap=c.softcap,
      implementation=_present(names) if implementation is None else names)
  keep = masks.rows_with_keys(mask, T, S, c.is_causal, c.kv_lengths, window, B, H)
  if keep is None:
    return out_BTHV
  return jnp.where(keep, out_BTHV, 0).astype(out_BTHV.dtype)
