"""Key selection as pure functions: which keys each query attends to under MoBA and the lightning indexer.

Positions are bottom-right aligned, as kernel.attention's is_causal: query t sits
at p = t + S - T. A key s is visible to query t when kv_lengths allows it
(s < kv_lengths[b]) and, with is_causal, s <= p. A selection never adds a key
the masks hide; it keeps a subset of the visible ones. Ties are broken
deterministically: of two equal scores, the lower index wins.

MoBA (Lu et al. 2025, "MoBA: Mixture of Block Attention for Long-Context
LLMs"). Keys are cut into blocks of `block` (the last one may be short).
Query head h scores block n by q_h · k̄_n, k̄_n the mean of kv head g(h)'s
keys of block n that kv_lengths leaves (a block with none is never chosen).
With is_causal (the paper's rule: a query is never routed to a future block,
and always to its own, masked causally inside): the query's own block
c = p // block is always selected, the blocks n < c (every key already seen)
compete for the other top_k - 1 places, and no block n > c can be chosen.
Without is_causal every block with a visible key competes for top_k places.
When fewer blocks compete than places, all of them are taken. The choice is
per query head (each head has its own q and kv head).

Lightning indexer (DeepSeek-V3.2, DSA). n_I index heads of width d_I: index
queries q^I (B,T,J,I), weights w (B,T,J), one index key k^I (B,S,I) per token;
score I_ts = Σ_j w_tj · ReLU(q^I_tj · k^I_s). Each query keeps its top_k
visible keys by I_ts, the same set for every attention head of the layer;
with fewer than top_k visible keys it keeps them all.

The functions here return the selection; `*_reference` versions compute the
same sets by counting, per candidate, the candidates that beat it (a second,
naive implementation for the tests). A dense boolean mask (B,H|1,T,S) of a
selection, given to the einsum kernel, is the function the blocked kernel
(attn.kernel.sparse) equals. Everything here runs under stop_gradient: the
selection has no gradient, as in both papers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

Array = jax.Array

NEG = -jnp.inf


def positions(T: int, S: int) -> Array:
  """(T,) the position of each query among S keys, bottom-right aligned."""
  return jnp.arange(T) + (S - T)


def visible(T: int, S: int, is_causal: bool, kv_lengths: Array | None, B: int) -> Array:
  """(B,T,S): key s visible to query t under is_causal and kv_lengths."""
  s = jnp.arange(S)
  keep = jnp.ones((B, T, S), bool)
  if is_causal:
    keep = keep & (s[None, None, :] <= positions(T, S)[None, :, None])
  if kv_lengths is not None:
    keep = keep & (s[None, None, :] < jnp.asarray(kv_lengths)[:, None, None])
  return keep


def num_blocks(S: int, block: int) -> int:
  return -(-S // block)


# MoBA

def block_means(k_BSGK: Array, block: int, kv_lengths: Array | None = None) -> tuple[Array, Array]:
  """(k̄ (B,N,G,K) float32, has (B,N) bool): each block's mean over its keys below kv_lengths."""
  B, S, G, K = k_BSGK.shape
  N = num_blocks(S, block)
  limit_B = jnp.full((B,), S) if kv_lengths is None else jnp.minimum(jnp.asarray(kv_lengths), S)
  valid_BS = jnp.arange(S)[None, :] < limit_B[:, None]
  k = jnp.where(valid_BS[:, :, None, None], k_BSGK.astype(jnp.float32), 0.0)
  k = jnp.pad(k, ((0, 0), (0, N * block - S), (0, 0), (0, 0))).reshape(B, N, block, G, K)
  n_BN = jnp.pad(valid_BS, ((0, 0), (0, N * block - S))).reshape(B, N, block).sum(-1)
  mean = k.sum(2) / jnp.maximum(n_BN, 1)[:, :, None, None].astype(jnp.float32)
  return mean, n_BN > 0


def moba_scores(q_BTHK: Array, k_BSGK: Array, *, block: int, is_causal: bool,
                kv_lengths: Array | None = None) -> tuple[Array, Array]:
  """(gate scores (B,H,T,N) float32: -inf where a block cannot be chosen, +inf for the forced own
  block; the number of places the competing blocks get, top_k minus the forced one: (T,) 0 or 1)."""
  B, T, H, K = q_BTHK.shape
  S, G = k_BSGK.shape[1], k_BSGK.shape[2]
  N = num_blocks(S, block)
  mean_BNGK, has_BN = block_means(lax.stop_gradient(k_BSGK), block, kv_lengths)
  q = lax.stop_gradient(q_BTHK).astype(jnp.float32).reshape(B, T, G, H // G, K)
  s_BHTN = jnp.einsum("BTGRK,BNGK->BGRTN", q, mean_BNGK).reshape(B, H, T, N)
  ok_B11N = has_BN[:, None, None, :]
  forced = jnp.zeros((T,), jnp.int32)
  if is_causal:
    own_T = positions(T, S) // block  # negative: the query sees no key
    n = jnp.arange(N)
    ok_B1TN = ok_B11N & (n[None, None, None, :] < own_T[None, None, :, None])
    s_BHTN = jnp.where(ok_B1TN, s_BHTN, NEG)
    own_1TN = (n[None, :] == own_T[:, None])[None, None]
    s_BHTN = jnp.where(own_1TN & ok_B11N, jnp.inf, s_BHTN)
    forced = (own_T >= 0).astype(jnp.int32)
  else:
    s_BHTN = jnp.where(ok_B11N, s_BHTN, NEG)
  return s_BHTN, forced


def _top(scores: Array, top_k: int) -> Array:
  """Boolean over the last axis: the top_k largest finite-or-+inf entries (ties: lower index)."""
  n = scores.shape[-1]
  k = min(top_k, n)
  vals, idx = lax.top_k(scores, k)  # lax.top_k: equal values keep the lower index first
  chosen = vals > NEG
  out = jnp.zeros(scores.shape, bool)
  flat = out.reshape(-1, n)
  rows = jnp.arange(flat.shape[0])[:, None]
  flat = flat.at[rows, idx.reshape(-1, k)].set(chosen.reshape(-1, k))
  return flat.reshape(scores.shape)


def moba_blocks(q_BTHK: Array, k_BSGK: Array, *, block: int, top_k: int, is_causal: bool,
                kv_lengths: Array | None = None) -> Array:
  """(B,H,T,N) bool: the blocks each query head attends to (module docstring)."""
  scores, _ = moba_scores(q_BTHK, k_BSGK, block=block, is_causal=is_causal, kv_lengths=kv_lengths)
  return _top(scores, top_k)


def _rank_select(scores: Array, top_k: int) -> Array:
  """The same choice as _top by counting: kept where fewer than top_k entries beat it and it is > -inf."""
  n = scores.shape[-1]
  a, b = scores[..., :, None], scores[..., None, :]  # a: the candidate, b: a rival
  lower = jnp.arange(n)[None, :] < jnp.arange(n)[:, None]  # rival index below the candidate's
  beats = (b > a) | ((b == a) & lower)
  return (beats.sum(-1) < top_k) & (scores > NEG)


def moba_blocks_reference(q_BTHK, k_BSGK, *, block: int, top_k: int, is_causal: bool,
                          kv_lengths=None) -> Array:
  """moba_blocks by counting rivals, with a per-query loop in numpy-style jnp (tests)."""
  B, T, H, K = q_BTHK.shape
  S, G = k_BSGK.shape[1], k_BSGK.shape[2]
  N = num_blocks(S, block)
  R = H // G
  lim = [S] * B if kv_lengths is None else [min(int(x), S) for x in kv_lengths]
  out = []
  for b in range(B):
    per_h = []
    for h in range(H):
      rows = []
      for t in range(T):
        p = t + S - T
        score, forced = [], None
        for n in range(N):
          keys = [s for s in range(n * block, min((n + 1) * block, S)) if s < lim[b]]
          if not keys:
            score.append(-jnp.inf)
            continue
          mean = jnp.mean(k_BSGK[b, jnp.array(keys), h // R].astype(jnp.float32), axis=0)
          val = jnp.dot(q_BTHK[b, t, h].astype(jnp.float32), mean)
          if is_causal and n == p // block and p >= 0:  # forced (it has a visible key: keys is not empty)
            forced = n
            score.append(-jnp.inf)
          elif is_causal and n > p // block or is_causal and p < 0:
            score.append(-jnp.inf)
          else:
            score.append(val)
        places = top_k - (1 if forced is not None else 0)
        row = _rank_select(jnp.array(score), places) if places > 0 else jnp.zeros(N, bool)
        if forced is not None:
          row = row.at[forced].set(True)
        rows.append(row)
      per_h.append(jnp.stack(rows))
    out.append(jnp.stack(per_h))
  return jnp.stack(out)


def blocks_to_mask(sel_BHTN: Array, block: int, S: int) -> Array:
  """(B,H,T,S): key s kept where its block is selected."""
  return jnp.repeat(sel_BHTN, block, axis=-1)[..., :S]


def moba_mask(q_BTHK, k_BSGK, *, block: int, top_k: int, is_causal: bool, kv_lengths=None) -> Array:
  """The dense (B,H,T,S) mask of MoBA's selection, the structured masks ANDed in."""
  B, T = q_BTHK.shape[:2]
  S = k_BSGK.shape[1]
  sel = moba_blocks(q_BTHK, k_BSGK, block=block, top_k=top_k, is_causal=is_causal,
                    kv_lengths=kv_lengths)
  return blocks_to_mask(sel, block, S) & visible(T, S, is_causal, kv_lengths, B)[:, None]


# The lightning indexer

def index_scores(qi_BTJI: Array, ki_BSI: Array, w_BTJ: Array) -> Array:
  """I (B,T,S) float32 = Σ_j w_tj · ReLU(q^I_tj · k^I_s)."""
  dots = jnp.einsum("BTJI,BSI->BTJS", qi_BTJI.astype(jnp.float32), ki_BSI.astype(jnp.float32))
  return jnp.einsum("BTJS,BTJ->BTS", jax.nn.relu(dots), w_BTJ.astype(jnp.float32))


def indexer_tokens(qi_BTJI: Array, ki_BSI: Array, w_BTJ: Array, *, top_k: int, is_causal: bool,
                   kv_lengths: Array | None = None, chunk: int | None = None) -> Array:
  """(B,T,S) bool: each query's top_k visible keys by the index score (module docstring).

  chunk: queries scored at a time (the index scores of chunk queries by S keys are
  alive at once, never T×S); None: all at once.
  """
  qi, ki, w = (lax.stop_gradient(a) for a in (qi_BTJI, ki_BSI, w_BTJ))
  B, T = qi.shape[:2]
  S = ki.shape[1]
  chunk = T if chunk is None else min(chunk, T)
  n = -(-T // chunk)
  pad = n * chunk - T

  def one(i):
    t0 = i * chunk
    q = lax.dynamic_slice_in_dim(jnp.pad(qi, ((0, 0), (0, pad), (0, 0), (0, 0))), t0, chunk, 1)
    wc = lax.dynamic_slice_in_dim(jnp.pad(w, ((0, 0), (0, pad), (0, 0))), t0, chunk, 1)
    scores = index_scores(q, ki, wc)
    t = t0 + jnp.arange(chunk)
    keep = jnp.ones((B, chunk, S), bool)
    if is_causal:
      keep = keep & (jnp.arange(S)[None, None, :] <= (t + S - T)[None, :, None])
    if kv_lengths is not None:
      keep = keep & (jnp.arange(S)[None, None, :] < jnp.asarray(kv_lengths)[:, None, None])
    return _top(jnp.where(keep, scores, NEG), top_k)

  if n == 1:
    return one(0)[:, :T]
  out = lax.map(one, jnp.arange(n))  # (n, B, chunk, S)
  return out.transpose(1, 0, 2, 3).reshape(B, n * chunk, S)[:, :T]


def indexer_tokens_reference(qi_BTJI, ki_BSI, w_BTJ, *, top_k: int, is_causal: bool,
                             kv_lengths=None) -> Array:
  """indexer_tokens by counting rivals over the whole (B,T,S) score (tests)."""
  B, T = qi_BTJI.shape[:2]
  S = ki_BSI.shape[1]
  scores = index_scores(qi_BTJI, ki_BSI, w_BTJ)
  keep = visible(T, S, is_causal, kv_lengths, B)
  return _rank_select(jnp.where(keep, scores, NEG), top_k)


# Bits: a token selection packed 32 keys to a word, for the blocked kernel's masks inside a block.

def pack_bits(mask_BTS: Array) -> Array:
  """(B,T,S) bool -> (B,T,ceil(S/32)) uint32, key s at bit s % 32 of word s // 32."""
  B, T, S = mask_BTS.shape
  W = -(-S // 32)
  m = jnp.pad(mask_BTS, ((0, 0), (0, 0), (0, W * 32 - S))).reshape(B, T, W, 32)
  return (m.astype(jnp.uint32) << jnp.arange(32, dtype=jnp.uint32)).sum(-1, dtype=jnp.uint32)


def bits_at(bits_BTW: Array, s_pos: Array) -> Array:
  """(B,T,s) bool: bit s of each row, for key positions s_pos (B,s)."""
  word = jnp.clip(s_pos // 32, 0, bits_BTW.shape[2] - 1)
  words = jnp.take_along_axis(bits_BTW, jnp.broadcast_to(word[:, None, :],
                                                         (*bits_BTW.shape[:2], s_pos.shape[-1])), axis=2)
  return ((words >> (s_pos % 32).astype(jnp.uint32)[:, None, :]) & 1).astype(bool)


def token_blocks(bits_BTW: Array, block_k: int, S: int) -> Array:
  """(B,1,T,N) bool: the key blocks of block_k (a multiple of 32) holding a selected token."""
  if block_k % 32:
    raise ValueError(f"block_k={block_k}: a multiple of 32 (whole words of the bits)")
  B, T, W = bits_BTW.shape
  N, per = num_blocks(S, block_k), block_k // 32
  bits = jnp.pad(bits_BTW, ((0, 0), (0, 0), (0, N * per - W)))
  return (bits.reshape(B, T, N, per) != 0).any(-1)[:, None]
