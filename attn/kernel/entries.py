"""Compressed entries beside the tokens on the dense (einsum) row: one softmax over [tokens | entries].

A call may carry N compressed keys and values (call.entries: ck (B,N,G,K), cv (B,N,G,V), m, the
entries' dense mask or None; attn.kernel.compressed pools them, DeepSeek-V4): entry n pools the
tokens before (n + 1)·m and is visible where all of them are. The rows that take entries
(Impl.entries: einsum here, blocked as a second run of key blocks in its online softmax) are rows
of the one table; every other row refuses them (impls.refuses).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attn.kernel import dense, masks
from attn.kernel.call import Call
from attn.kernel.dense import structured_mask
from attn.kernel.products import Products

Array = jax.Array


def structured_entries(T: int, S: int, N: int, m: int, is_causal: bool,
                       kv_lengths: Array | None) -> Array | None:
  """(B|1, 1, T|1, N): the entries causality (bottom-right aligned) and kv_lengths leave visible."""
  end = (jnp.arange(N) + 1) * m
  out = None
  if is_causal:
    out = (end[None, :] <= (jnp.arange(T) + S - T + 1)[:, None])[None, None]
  if kv_lengths is not None:
    out = masks.combine_masks(out, (end[None, :] <= jnp.asarray(kv_lengths)[:, None])[:, None, None])
  return out


def run_dense(call: Call, products: Products):
  """The einsum kernel over the tokens and entries concatenated, their masks as one (B,H,T,S+N)."""
  q_BTHK, k_BSGK, v_BSGV = call.q_BTHK, call.k_BSGK, call.v_BSGV
  ck_BNGK, cv_BNGV, m, cmask = call.entries
  T, S, N = call.T, call.S, ck_BNGK.shape[1]
  tokens = masks.combine_masks(call.mask, structured_mask(T, S, call.is_causal, call.kv_lengths, call.window))
  entries = masks.combine_masks(cmask, structured_entries(T, S, N, m, call.is_causal, call.kv_lengths))
  B, H = q_BTHK.shape[0], q_BTHK.shape[2]
  full = jnp.concatenate([jnp.broadcast_to(True if tokens is None else tokens, (B, H, T, S)),
                          jnp.broadcast_to(True if entries is None else entries, (B, H, T, N))],
                         axis=-1)
  G = max(k_BSGK.shape[2], ck_BNGK.shape[2])
  grow = lambda a: jnp.broadcast_to(a, (*a.shape[:2], G, a.shape[3]))  # noqa: E731
  k = jnp.concatenate([grow(k_BSGK), grow(ck_BNGK).astype(k_BSGK.dtype)], axis=1)
  v = jnp.concatenate([grow(v_BSGV), grow(cv_BNGV).astype(v_BSGV.dtype)], axis=1)
  return dense.attention(q_BTHK, k, v, full, is_causal=False, kv_lengths=None, scale=call.scale,
                         logits_bias=None, return_weights=call.return_weights, window=None, sinks=call.sinks,
                         softcap=call.softcap, probability=call.probability, products=products)
