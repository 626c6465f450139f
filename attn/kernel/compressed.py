"""Compressed keys and values (DeepSeek-V4): blocks of m tokens pooled into one entry, attended
beside the tokens.

pool: entry n is Σ_j softmax_j(z_j + b_j) ⊙ c_j over the m tokens of block n (tokens
[n·m, (n+1)·m)), the softmax per feature over the block's slots, in float32, b (P, m, G, X) a
learned bias per slot. With two series (P = 2, V4's CSA overlap) entry n pools 2m slots:
series 0 of block n − 1 and series 1 of block n (block −1's slots weigh 0). Only complete
blocks are pooled: N = S // m entries.

attention: one softmax over a query's visible tokens and compressed entries (and sinks). Entry n
pools tokens before (n + 1)·m, so it is visible where all of them are: causal (it has ended:
(n + 1)·m − 1 <= the query's position), within kv_lengths, and, under a dense mask, where the
mask shows every token it pools. The window acts on the tokens only: V4's layers see the last w
tokens and every ended block. impl "einsum" builds the (B,H,T,S+N) logits (weights out; the
definition); "blocked" runs attn.kernel.blocked with the entries as a second run of key blocks
in the same online softmax (no T×S array: a query block visits its window's token blocks and the
compressed blocks that have ended); "auto" picks blocked from T·(S+N) >= BLOCKED_MIN_SCORES
without weights out.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attn import kernel as _kernel
from attn.config import invalid
from attn.kernel.entries import structured_entries  # noqa: F401  (its old home; attn.kernel.entries now)

Array = jax.Array

IMPLS = ("auto", "einsum", "blocked")


def pool(c_BSPGX: Array, z_BSPGX: Array, bias_PmGX: Array, m: int) -> Array:
  """(B, S // m, G, X): each complete block's entry (module docstring), in c's dtype."""
  B, S, P, G, X = c_BSPGX.shape
  N = S // m
  c = c_BSPGX[:, :N * m].reshape(B, N, m, P, G, X)
  z = z_BSPGX[:, :N * m].reshape(B, N, m, P, G, X).astype(jnp.float32)
  z = z + jnp.moveaxis(bias_PmGX, 0, 1).astype(jnp.float32)  # (m, P, G, X) per slot
  if P == 2:  # slots: series 0 of the previous block, then series 1 of this one
    prev_c = jnp.pad(c[:, :-1, :, 0], ((0, 0), (1, 0), (0, 0), (0, 0), (0, 0)))
    prev_z = jnp.pad(z[:, :-1, :, 0], ((0, 0), (1, 0), (0, 0), (0, 0), (0, 0)),
                     constant_values=-jnp.inf)
    c = jnp.concatenate([prev_c, c[:, :, :, 1]], axis=2)
    z = jnp.concatenate([prev_z, z[:, :, :, 1]], axis=2)
  else:
    c, z = c[:, :, :, 0], z[:, :, :, 0]
  w = jax.nn.softmax(z, axis=2)
  return jnp.einsum("BNjGX,BNjGX->BNGX", w, c.astype(jnp.float32)).astype(c_BSPGX.dtype)


def entry_mask(mask: Array | None, S: int, m: int, span: int) -> Array | None:
  """A token mask broadcastable to (B,H,T,S) as one over the S // m entries: True where it shows
  every token an entry pools (the span tokens before its end)."""
  if mask is None:
    return None
  mask = jnp.asarray(mask)
  mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
  N = S // m
  if mask.shape[3] == 1:
    return mask
  blocks = mask[..., :N * m].reshape(*mask.shape[:3], N, m).all(-1)
  if span > m:  # the previous block too (none before block 0)
    prev = jnp.pad(blocks[..., :-1], ((0, 0),) * 3 + ((1, 0),), constant_values=True)
    blocks = blocks & prev
  return blocks


def check(m, impl: str) -> None:
  if isinstance(m, bool) or not isinstance(m, int) or m <= 0:
    raise invalid("compress_block", m, "a positive integer: the tokens each compressed entry pools")
  if impl not in IMPLS:
    raise invalid("impl", impl, f"one of {IMPLS} with compressed keys")


def attention(q_BTHK: Array, k_BSGK: Array, v_BSGV: Array, ck_BNGK: Array, cv_BNGV: Array, *,
              m: int, span: int | None = None, mask: Array | None = None,
              entry_mask_: Array | None = None, is_causal: bool = False,
              kv_lengths: Array | None = None, scale: float, window: int | None = None,
              sinks: Array | None = None, softcap: float | None = None,
              return_weights: bool = False, impl: str = "auto", block_q: int | None = None,
              block_k: int | None = None):
  """softmax over [tokens | compressed entries] (module docstring): (B,T,H,V), and with
  return_weights the weights (B,H,T,S+N) in float32.

  span: the tokens an entry pools (m, or 2m with two series; default m), for reading a dense
  mask; entry_mask_: the mask over the entries (B,H,T,N)-broadcastable, in its place (decoding,
  whose token slots are no positions).
  """
  check(m, impl)
  cmask = entry_mask(mask, k_BSGK.shape[1], m, span or m) if entry_mask_ is None else entry_mask_
  # A row of the kernel's table: einsum or blocked, "auto" counting the entries as keys (kernel.impls).
  return _kernel.attention(q_BTHK, k_BSGK, v_BSGV, mask, is_causal=is_causal, kv_lengths=kv_lengths,
                           scale=scale, window=window, sinks=sinks, softcap=softcap,
                           return_weights=return_weights, impl=impl, block_q=block_q, block_k=block_k,
                           entries=(ck_BNGK, cv_BNGV, m, cmask))
