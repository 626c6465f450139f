"""Key selection as pure functions: which keys each query attends to under MoBA and the lightning indexer.

Positions are bottom-right aligned, as kernel.attention's is_causal: query t sits
at p = t + S - T. A key s is visible to query t when kv_lengths allows it
(s < kv_lengths[b]) and, with is_causal, s <= p. A selection never adds a key
the masks hide; it keeps a subset of the visible ones. Ties are broken
deterministically: of two equal scores, the lower index wins.

MoBA (Lu et al. 2025, "MoBA: Mixture of Block Attention for Long-Context
LLMs"). Keys are cut into blocks of `block` (the last one may be short).
Query head h scores block n by q_h · k̄_n, k̄_n the mean of kv head g(h)'s
keys of block n below kv_lengths. A query's own block is the last block in
which it sees a key; it is always selected, and the other blocks in which it
sees a key compete for the remaining top_k - 1 places. Under is_causal this
is the paper's rule: the own block is the one holding the query's position
(attended causally inside), no later block can be chosen, and the earlier
ones compete. The same rule under a dense mask (a KV cache's decoding mask)
gives the same choice as the causal full pass. When fewer blocks compete than
places, all of them are taken. The choice is per query head (each head has its
own q and kv head).

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
import numpy as np
from jax import lax

from attn.kernel import topk

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


def visible_blocks(T: int, S: int, block: int, *, is_causal: bool, kv_lengths: Array | None = None,
                   mask: Array | None = None, B: int = 1) -> Array:
  """(B,1|H,T,N) bool: the key blocks in which query t sees at least one key.

  Without a dense mask, from the structure alone (no T×S array); with one (B|1,1|H,T,S),
  from the dense visibility.
  """
  N = num_blocks(S, block)
  if mask is not None:
    vis = visible(T, S, is_causal, kv_lengths, B)[:, None] & jnp.asarray(mask, bool)
    vis = jnp.pad(vis, ((0, 0),) * 3 + ((0, N * block - S),))
    return vis.reshape(*vis.shape[:3], N, block).any(-1)
  start_N = jnp.arange(N) * block
  limit_B = jnp.full((B,), S) if kv_lengths is None else jnp.minimum(jnp.asarray(kv_lengths), S)
  vis = jnp.broadcast_to((start_N[None, :] < limit_B[:, None])[:, None, None, :], (B, 1, T, N))
  if is_causal:
    vis = vis & (start_N[None, :] <= positions(T, S)[:, None])[None, None]
  return vis


def moba_scores(q_BTHK: Array, k_BSGK: Array, *, block: int, is_causal: bool,
                kv_lengths: Array | None = None, mask: Array | None = None) -> Array:
  """Gate scores (B,H,T,N) float32: q_h · k̄_n; -inf where the query sees no key of the block,
  +inf for its own block (the last it sees a key of)."""
  B, T, H, K = q_BTHK.shape
  S, G = k_BSGK.shape[1], k_BSGK.shape[2]
  N = num_blocks(S, block)
  mean_BNGK, _ = block_means(lax.stop_gradient(k_BSGK), block, kv_lengths)
  q = lax.stop_gradient(q_BTHK).astype(jnp.float32).reshape(B, T, G, H // G, K)
  s_BHTN = jnp.einsum("BTGRK,BNGK->BGRTN", q, mean_BNGK).reshape(B, H, T, N)
  vis = visible_blocks(T, S, block, is_causal=is_causal, kv_lengths=kv_lengths, mask=mask, B=B)
  n = jnp.arange(N)
  own = jnp.max(jnp.where(vis, n, -1), axis=-1, keepdims=True)  # -1: sees nothing
  s_BHTN = jnp.where(vis, s_BHTN, NEG)
  return jnp.where(n == own, jnp.inf, s_BHTN)


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
                kv_lengths: Array | None = None, mask: Array | None = None) -> Array:
  """(B,H,T,N) bool: the blocks each query head attends to (module docstring)."""
  scores = moba_scores(q_BTHK, k_BSGK, block=block, is_causal=is_causal, kv_lengths=kv_lengths,
                       mask=mask)
  return _top(scores, top_k)


def _rank_select(scores: Array, top_k: int) -> Array:
  """The same choice as _top by counting: kept where fewer than top_k entries beat it and it is > -inf."""
  n = scores.shape[-1]
  a, b = scores[..., :, None], scores[..., None, :]  # a: the candidate, b: a rival
  lower = jnp.arange(n)[None, :] < jnp.arange(n)[:, None]  # rival index below the candidate's
  beats = (b > a) | ((b == a) & lower)
  return (beats.sum(-1) < top_k) & (scores > NEG)


def moba_blocks_reference(q_BTHK, k_BSGK, *, block: int, top_k: int, is_causal: bool,
                          kv_lengths=None, mask=None) -> Array:
  """moba_blocks from the dense (B,H,T,S) visibility, one query at a time, by counting rivals (tests)."""
  B, T, H, K = q_BTHK.shape
  S, G = k_BSGK.shape[1], k_BSGK.shape[2]
  N, R = num_blocks(S, block), H // G
  lim = [S] * B if kv_lengths is None else [min(int(x), S) for x in kv_lengths]
  vis = visible(T, S, is_causal, kv_lengths, B)[:, None]
  if mask is not None:
    vis = vis & jnp.asarray(mask, bool)
  vis = np.asarray(jnp.broadcast_to(vis, (B, H, T, S)))
  q, k = np.asarray(q_BTHK, np.float32), np.asarray(k_BSGK, np.float32)
  out = np.zeros((B, H, T, N), bool)
  for b in range(B):
    for h in range(H):
      for t in range(T):
        seen = np.flatnonzero(vis[b, h, t])
        if not len(seen):
          continue
        own = seen[-1] // block
        score = np.full(N, -np.inf, np.float32)
        for n in set(int(s) // block for s in seen) - {own}:
          keys = np.arange(n * block, min((n + 1) * block, lim[b]))
          score[n] = np.dot(q[b, t, h], k[b, keys, h // R].mean(0))
        out[b, h, t] = np.asarray(_rank_select(jnp.asarray(score), top_k - 1))
        out[b, h, t, own] = True
  return jnp.asarray(out)


def blocks_to_mask(sel_BHTN: Array, block: int, S: int) -> Array:
  """(B,H,T,S): key s kept where its block is selected."""
  return jnp.repeat(sel_BHTN, block, axis=-1)[..., :S]


def moba_mask(q_BTHK, k_BSGK, *, block: int, top_k: int, is_causal: bool, kv_lengths=None,
              mask=None) -> Array:
  """The dense (B,H,T,S) mask of MoBA's selection, the structured masks ANDed in (not mask)."""
  B, T = q_BTHK.shape[:2]
  S = k_BSGK.shape[1]
  sel = moba_blocks(q_BTHK, k_BSGK, block=block, top_k=top_k, is_causal=is_causal,
                    kv_lengths=kv_lengths, mask=mask)
  return blocks_to_mask(sel, block, S) & visible(T, S, is_causal, kv_lengths, B)[:, None]


# The lightning indexer

def index_scores(qi_BTJI: Array, ki_BSI: Array, w_BTJ: Array) -> Array:
  """I (B,T,S) float32 = Σ_j w_tj · ReLU(q^I_tj · k^I_s)."""
  dots = jnp.einsum("BTJI,BSI->BTJS", qi_BTJI.astype(jnp.float32), ki_BSI.astype(jnp.float32))
  return jnp.einsum("BTJS,BTJ->BTS", jax.nn.relu(dots), w_BTJ.astype(jnp.float32))


def _indexer_chunk(qi, ki, w, t0, *, T: int, top_k: int, is_causal: bool, kv_lengths, mask) -> Array:
  """(B,c,S) bool: the top_k visible keys of queries [t0, t0 + c) (qi, w already these rows)."""
  B, c = qi.shape[:2]
  S = ki.shape[1]
  scores = index_scores(qi, ki, w)
  t = t0 + jnp.arange(c)
  s = jnp.arange(S)
  keep = jnp.ones((B, c, S), bool)
  if is_causal:
    keep = keep & (s[None, None, :] <= (t + S - T)[None, :, None])
  if kv_lengths is not None:
    keep = keep & (s[None, None, :] < jnp.asarray(kv_lengths)[:, None, None])
  if mask is not None:  # (B|1,1|H,T|1,S): a key any head sees
    m = jnp.asarray(mask, bool).any(axis=1)
    if m.shape[1] > 1:
      m = lax.dynamic_slice_in_dim(jnp.pad(m, ((0, 0), (0, c), (0, 0))), t0, c, axis=1)
    keep = keep & m
  return _top(jnp.where(keep, scores, NEG), top_k)


def _by_chunks(fn, qi, w, T: int, chunk: int):
  """fn(qi rows, w rows, t0) over chunks of queries, concatenated along T."""
  chunk = min(chunk, T)
  n = -(-T // chunk)
  if n == 1:
    return fn(qi, w, 0)
  pad = n * chunk - T
  qi = jnp.pad(qi, ((0, 0), (0, pad), (0, 0), (0, 0)))
  w = jnp.pad(w, ((0, 0), (0, pad), (0, 0)))
  out = lax.map(lambda i: fn(lax.dynamic_slice_in_dim(qi, i * chunk, chunk, 1),
                             lax.dynamic_slice_in_dim(w, i * chunk, chunk, 1), i * chunk), jnp.arange(n))
  return jnp.moveaxis(out, 0, 1).reshape(out.shape[1], n * chunk, *out.shape[3:])[:, :T]


def indexer_tokens(qi_BTJI: Array, ki_BSI: Array, w_BTJ: Array, *, top_k: int, is_causal: bool,
                   kv_lengths: Array | None = None, mask: Array | None = None,
                   chunk: int | None = None) -> Array:
  """(B,T,S) bool: each query's top_k visible keys by the index score (module docstring).

  chunk: queries scored at a time (chunk × S index scores alive at once); None: all at once.
  """
  qi, ki, w = (lax.stop_gradient(a) for a in (qi_BTJI, ki_BSI, w_BTJ))
  T = qi.shape[1]
  fn = lambda q, ww, t0: _indexer_chunk(q, ki, ww, t0, T=T, top_k=top_k, is_causal=is_causal,
                                        kv_lengths=kv_lengths, mask=mask)
  return _by_chunks(fn, qi, w, T, T if chunk is None else chunk)


def indexer_bits(qi_BTJI: Array, ki_BSI: Array, w_BTJ: Array, *, top_k: int, is_causal: bool,
                 kv_lengths: Array | None = None, chunk: int = 256) -> Array:
  """indexer_tokens packed (pack_bits): (B,T,ceil(S/32)) uint32, no T×S bool; made from indexer_top's
  indices (the same set). A caller that also wants the token kernel keeps those indices itself
  (indexer_top, then indices_to_bits) and hands them to attn.kernel.sparse as idx_BTk. `chunk` is kept
  for the callers; the selector picks its own row tiles."""
  del chunk
  idx_BTk = indexer_top(qi_BTJI, ki_BSI, w_BTJ, top_k=top_k, is_causal=is_causal, kv_lengths=kv_lengths)
  return indices_to_bits(idx_BTk, ki_BSI.shape[1])


def indices_to_bits(idx_BTk: Array, S: int) -> Array:
  """(B,T,ceil(S/32)) uint32 of distinct indices (-1: none), key s at bit s % 32 of word s // 32."""
  B, T, k = idx_BTk.shape
  W = -(-S // 32)
  ok = idx_BTk >= 0
  word = jnp.where(ok, idx_BTk // 32, W)
  bit = jnp.where(ok, jnp.uint32(1) << (idx_BTk % 32).astype(jnp.uint32), jnp.uint32(0))
  b = jnp.arange(B)[:, None, None]
  t = jnp.arange(T)[None, :, None]
  return jnp.zeros((B, T, W), jnp.uint32).at[b, t, word].add(bit, mode="drop")


INDEX_ROWS = 32  # queries the selector scores and selects at a time (32 × 16384 scores: 2 MiB)
BUCKETS = 8  # causal: query ranges, each scoring only the keys its last query sees


def _top_chunk(qi, ki, w, t0, *, T: int, S: int, k: int, is_causal: bool, kv_lengths) -> Array:
  """(B,c,k) int32: the top min(k, e) of queries [t0, t0 + c) over the first e keys (ki: (B,e,I))."""
  B, c = qi.shape[:2]
  e = ki.shape[1]
  scores = index_scores(qi, ki, w)  # (B,c,e)
  s = jnp.arange(e)
  keep = jnp.ones((B, c, e), bool)
  if is_causal:
    keep = keep & (s[None, None, :] <= (t0 + jnp.arange(c) + S - T)[None, :, None])
  if kv_lengths is not None:
    keep = keep & (s[None, None, :] < jnp.asarray(kv_lengths)[:, None, None])
  idx = topk.indices(jnp.where(keep, scores, NEG).reshape(B * c, e), min(k, e)).reshape(B, c, -1)
  return jnp.pad(idx, ((0, 0), (0, 0), (0, k - idx.shape[2])), constant_values=-1)


def indexer_top(qi_BTJI: Array, ki_BSI: Array, w_BTJ: Array, *, top_k: int, is_causal: bool,
                kv_lengths: Array | None = None, rows: int = INDEX_ROWS, buckets: int = BUCKETS) -> Array:
  """(B,T,k) int32, k = min(top_k, S): each query's top_k visible keys by the index score, ascending,
  -1 after the last; the same set as indexer_tokens (attn.kernel.topk: exact, ties to the lower index).

  Scored `rows` queries at a time (rows × S scores alive, never T × S); under is_causal the queries
  are cut into `buckets` ranges, each scoring only the keys its last query sees (about half the
  scores of the full square).
  """
  qi, ki, w = (lax.stop_gradient(a) for a in (qi_BTJI, ki_BSI, w_BTJ))
  T, S = qi.shape[1], ki.shape[1]
  k = min(top_k, S)
  rows = min(rows, T)
  n = -(-T // rows)
  per = -(-n // buckets) if is_causal else n
  out = []
  for a in range(0, n, per):
    t0, t1 = a * rows, min(T, (a + per) * rows)
    e = max(1, min(S, t1 + S - T)) if is_causal else S
    fn = lambda q, ww, c0, t0=t0, e=e: _top_chunk(q, ki[:, :e], ww, t0 + c0, T=T, S=S, k=k,  # noqa: E731
                                                  is_causal=is_causal, kv_lengths=kv_lengths)
    out.append(_by_chunks(fn, qi[:, t0:t1], w[:, t0:t1], t1 - t0, rows))
  return out[0] if len(out) == 1 else jnp.concatenate(out, axis=1)


def indexer_top_flops(T: int, S: int, J: int, I: int, *, is_causal: bool, rows: int = INDEX_ROWS,
                      buckets: int = BUCKETS) -> tuple[int, int]:
  """(score FLOPs 2·J·(I + 1) a scored pair, compare-and-count operations 32 a pair) of indexer_top."""
  rows = min(rows, T)
  n = -(-T // rows)
  per = -(-n // buckets) if is_causal else n
  pairs = 0
  for a in range(0, n, per):
    t0, t1 = a * rows, min(T, (a + per) * rows)
    e = max(1, min(S, t1 + S - T)) if is_causal else S
    pairs += (-(-(t1 - t0) // rows) * rows) * e
  return 2 * J * (I + 1) * pairs, 32 * pairs


def indexer_tokens_reference(qi_BTJI, ki_BSI, w_BTJ, *, top_k: int, is_causal: bool,
                             kv_lengths=None, mask=None) -> Array:
  """indexer_tokens by counting rivals over the whole (B,T,S) score (tests)."""
  B, T = qi_BTJI.shape[:2]
  S = ki_BSI.shape[1]
  scores = index_scores(qi_BTJI, ki_BSI, w_BTJ)
  keep = visible(T, S, is_causal, kv_lengths, B)
  if mask is not None:
    keep = keep & jnp.asarray(mask, bool).any(axis=1)
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


def moba_top(q_BTHK: Array, k_BSGK: Array, *, block: int, top_k: int, is_causal: bool,
             kv_lengths: Array | None = None) -> tuple[Array, Array]:
  """MoBA's choice as indices: (blocks (B,H,T,k) int32, chosen (B,H,T,k) bool), k = min(top_k, N);
  the same set as moba_blocks (attn.kernel.gathered reads it)."""
  scores = moba_scores(q_BTHK, k_BSGK, block=block, is_causal=is_causal, kv_lengths=kv_lengths)
  vals, idx = lax.top_k(scores, min(top_k, scores.shape[-1]))
  return idx.astype(jnp.int32), vals > NEG
