"""impl "splash": Pallas's TPU splash attention (jax.experimental.pallas.ops.tpu.splash_attention).

Splash runs one example's (H,T,K) heads against (G,S,K) keys in blocks, skips
the blocks its static mask leaves empty, and has soft-cap, sinks, grouped
heads and d_v ≠ d_k in its forward and backward kernels. attn's contract is
kept around it:

- the scale multiplies q (splash does not scale); the batch is a vmap;
- is_causal and window are splash's CausalMask / LocalMask with offset S - T,
  which is attn's bottom-right alignment;
- T and S are padded to whole blocks; padded keys and keys past kv_lengths
  are masked with splash's segment ids (key id 0, query id 1);
- a fully masked row (S < T with is_causal, kv_lengths 0) is zeros in value
  and gradient: splash leaves it undefined.

What it cannot run it refuses by name (weights out, logits_bias, a dense
mask, probabilities other than softmax, blocks that are not multiples of 128).

Interpret mode: with ATTN_PALLAS_INTERPRET=1 in the environment (read at each
call) the kernel runs in Pallas's interpret mode on any backend, slowly; the
tests use it on CPU to check splash against the einsum kernel.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from attn.config import invalid
from attn.kernel.call import Call, Refusal
from attn.kernel.masks import visible_rows

Array = jax.Array

INTERPRET_ENV = "ATTN_PALLAS_INTERPRET"
LANES = 128  # splash's blocks are multiples of the TPU's 128 lanes
BLOCK_MAX = 512  # the default block when a call names none (MaxText's default)


TRUE, FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")  # any case


def interpret() -> bool:
  """Whether the Pallas kernels run in interpret mode (ATTN_PALLAS_INTERPRET=1): any backend, slowly.

  1/true/yes/on turn it on, 0/false/no/off or unset/empty leave it off; anything else is refused
  by name (a typo must neither turn the slow interpreter on nor leave it silently off)."""
  value = os.environ.get(INTERPRET_ENV, "")
  if value.strip().lower() in TRUE + FALSE:
    return value.strip().lower() in TRUE
  raise invalid(INTERPRET_ENV, value, f"one of {list(TRUE)} (Pallas interpret mode on) or "
                f"{list(FALSE[1:])} or unset (off), in any case")


def unavailable() -> str | None:
  try:
    from jax.experimental.pallas.ops.tpu import splash_attention  # noqa: F401
  except ImportError as e:  # pragma: no cover - jax ships it
    return f"jax.experimental.pallas.ops.tpu.splash_attention does not import ({e})"
  return None


def why_not(call: Call) -> Refusal | None:
  """What of this call splash attention cannot run, or None."""
  if call.return_weights:
    return Refusal("return_weights", True, "False", "splash attention returns no weights")
  if call.logits_bias is not None:
    return Refusal("logits_bias", "an array", "None", "splash attention takes no bias")
  if call.mask is not None:
    return Refusal("mask", "an array", "None (is_causal, kv_lengths and window instead)",
                   "splash attention's masks are static structures")
  if call.probability != "softmax":
    return Refusal("probability", call.probability, '"softmax"', "splash attention is softmax only")
  for name in ("block_q", "block_k"):
    value = getattr(call, name)
    if value is not None and value % LANES:
      return Refusal(name, value, f"a multiple of {LANES} or None",
                     "splash attention's blocks are whole TPU lane tiles")
  return None


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def _block(n: int, given: int | None) -> int:
  return given if given is not None else min(BLOCK_MAX, _round_up(n, LANES))


def _mask(Tp: int, Sp: int, T: int, S: int, is_causal: bool, window: int | None, H: int):
  from jax.experimental.pallas.ops.tpu import splash_attention as sa
  shape, offset = (Tp, Sp), S - T
  if window is not None:
    w = min(window, max(T, S))
    one = sa.LocalMask(shape, window_size=(w - 1, 0 if is_causal else w - 1), offset=offset)
  elif is_causal:
    one = sa.CausalMask(shape, offset=offset)
  else:
    one = sa.FullMask(shape)
  return sa.MultiHeadMask([one] * H)


def attention(call: Call) -> Array:
  """kernel.attention's function through splash attention; the call already checked by why_not."""
  from jax.experimental.pallas.ops.tpu import splash_attention as sa
  c = call.with_shared_key()
  q_BTHK, k_BSGK, v_BSGV = c.q_BTHK, c.k_BSGK, c.v_BSGV
  B, T, H, _ = q_BTHK.shape
  S = c.S
  bq, bk = _block(T, c.block_q), _block(S, c.block_k)
  Tp, Sp = _round_up(T, bq), _round_up(S, bk)
  dtype = q_BTHK.dtype
  # Splash does not scale the logits; the scale goes on q in float32.
  q_BHTK = jnp.moveaxis((q_BTHK.astype(jnp.float32) * c.scale).astype(dtype), 1, 2)
  k_BGSK, v_BGSV = jnp.moveaxis(k_BSGK, 1, 2), jnp.moveaxis(v_BSGV, 1, 2)
  pad = lambda x, n: jnp.pad(x, [(0, 0), (0, 0), (0, n - x.shape[2]), (0, 0)])
  q_BHTK, k_BGSK, v_BGSV = pad(q_BHTK, Tp), pad(k_BGSK, Sp), pad(v_BGSV, Sp)
  blocks = sa.BlockSizes(block_q=bq, block_kv=bk, block_kv_compute=bk, block_q_dkv=bq,
                         block_kv_dkv=bk, block_kv_dkv_compute=bk, block_q_dq=bq, block_kv_dq=bk)
  kernel = sa.make_splash_mha(_mask(Tp, Sp, T, S, c.is_causal, c.window, H), block_sizes=blocks,
                              head_shards=1, q_seq_shards=1, attn_logits_soft_cap=c.softcap,
                              interpret=interpret())
  sinks = None if c.sinks is None else c.sinks.astype(jnp.float32)
  if c.kv_lengths is None and Sp == S:
    run = jax.vmap(lambda q, k, v: kernel(q, k, v, sinks=sinks))
    out_BHTV = run(q_BHTK, k_BGSK, v_BGSV)
  else:
    lengths_B = jnp.full((B,), S) if c.kv_lengths is None else jnp.minimum(c.kv_lengths, S)
    kv_ids_BS = (jnp.arange(Sp)[None] < lengths_B[:, None]).astype(jnp.int32)
    ids = sa.SegmentIds(q=jnp.ones((B, Tp), jnp.int32), kv=kv_ids_BS)
    run = jax.vmap(lambda q, k, v, i: kernel(q, k, v, segment_ids=i, sinks=sinks))
    out_BHTV = run(q_BHTK, k_BGSK, v_BGSV, ids)
  out_BTHV = jnp.moveaxis(out_BHTV[:, :, :T], 1, 2).astype(dtype)
  rows_BT = visible_rows(T, S, c.is_causal, c.kv_lengths, c.window)
  if rows_BT is None:
    return out_BTHV
  # Splash leaves a row with no visible key undefined; attn's contract is zeros.
  return jnp.where(rows_BT[:, :, None, None], out_BTHV, 0).astype(dtype)
