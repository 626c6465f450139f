"""Pooled key selection as pure functions: the choice is made over contiguous groups of keys, not tokens.

Three checkpoints of 2026 choose keys this way (../shared/research/selection.md, transformers 5.25):

  K-pool (GLM-5.3-Flash, glm5_next's Glm5NextTextIndexer). Keys are cut into pools of P
  (index_kpool) tokens from the first; a complete pool's index key is a gated average of its
  tokens' index keys, per channel: softmax over the pool of (gate_s + ape_(s mod P)), the
  gate a learned projection of each token, ape one learned row per offset. A query scores
  pool n by Σ_j w_j · ReLU(q_j · k̄_n · I^-1/2) and keeps its top top_k / P complete pools
  whose last token it sees; with always_select_tail, the tokens of its own pool when that
  pool is incomplete (the "tail") are kept too.
  QSA (Qwen4-Exp, qwen4_exp's Qwen4ExpTextQSAIndexer). Blocks of r (indexer_compress_ratio)
  tokens; a complete block's index key is RMSNorm(mean of its tokens' raw index keys), one
  per index key head (indexer_kv_heads E); a query scores block n by
  Σ_j ReLU(q_j · k̄_n,e(j)) · I^-1/2 (index query head j reads key head e(j) = j·E/J), keeps
  its top budget / r complete visible blocks and always its incomplete tail.
  Block indexer (MiniMax-M3, minimax_m3_vl's MiniMaxM3VLIndexer). One index query per kv
  group, one index key per token; block n's score is the largest q · k over its visible keys
  (max-pooled token scores); the `local` blocks ending at the query's own block are always
  kept (+inf), and each kv group keeps its top top_k blocks (the local ones among them).

Visibility is a prefix here: a query sees keys 0 .. L, L its last visible key (is_causal,
bottom-right aligned, and kv_lengths: right padding; or from a decoding cache's dense mask,
which gives the full pass's L). Pools and blocks start at key 0. A pool or block is a candidate
when it is complete and its last key is visible (K-pool, QSA), or when it holds a visible key
(block indexer). Ties go to the lower index (lax.top_k). Everything runs under stop_gradient.

The choice comes out as token indices (B, 1|G, T, k), -1 for none, distinct: what attn.kernel.tokens
gathers; `token_mask` makes the dense mask the kernels equal (the reference).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from attn.kernel.select import NEG, positions, visible
from attn.kernel.tokens import unit_tokens

Array = jax.Array

ROWS = 256  # queries scored at a time (ROWS × N pool scores, or ROWS × S token scores, alive)
RMS_EPS = 1e-6  # Qwen4-Exp's RMSNorm on the pooled keys (rms_norm_eps)


def last_key(T: int, S: int, *, is_causal: bool, kv_lengths: Array | None = None, mask: Array | None = None,
             B: int = 1) -> Array:
  """(B,T) int32: each query's last visible key, -1 where it sees none. Without a dense mask from the
  structure alone; with one (B|1,1|H,T,S, any head counting), from the dense visibility."""
  if mask is not None:
    vis = visible(T, S, is_causal, kv_lengths, B) & jnp.asarray(mask, bool).any(axis=1)
    return jnp.max(jnp.where(vis, jnp.arange(S, dtype=jnp.int32), -1), axis=-1)
  limit = jnp.full((B,), S, jnp.int32) if kv_lengths is None else jnp.minimum(jnp.asarray(kv_lengths), S)
  L = jnp.broadcast_to(limit.astype(jnp.int32)[:, None] - 1, (B, T))
  if is_causal:
    L = jnp.minimum(L, positions(T, S).astype(jnp.int32)[None, :])
  return jnp.maximum(L, -1)


def _rows(fn, T: int, rows: int, *xs):
  """fn(rows of each x (axis 1), t0) over chunks of queries, concatenated along axis 1."""
  rows = min(rows, T)
  n = -(-T // rows)
  if n == 1:
    return fn(*xs, 0)
  pad = n * rows - T
  xs = [jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2)) for x in xs]
  out = lax.map(lambda i: fn(*(lax.dynamic_slice_in_dim(x, i * rows, rows, 1) for x in xs), i * rows),
                jnp.arange(n))
  out = jnp.moveaxis(out, 0, 1)
  return out.reshape(out.shape[0], n * rows, *out.shape[3:])[:, :T]


# K-pool and QSA: pooled index keys, a top-n over complete pools, the tail.

def kpool_keys(ki_BSI: Array, gate_BSI: Array, ape_PI: Array, pool: int) -> Array:
  """(B,N,I) float32, N = S // pool: each complete pool's gated average of its index keys (GLM-5.3)."""
  B, S, I = ki_BSI.shape
  N = S // pool
  k = ki_BSI[:, :N * pool].astype(jnp.float32).reshape(B, N, pool, I)
  g = gate_BSI[:, :N * pool].astype(jnp.float32).reshape(B, N, pool, I) + ape_PI.astype(jnp.float32)
  return jnp.sum(jax.nn.softmax(g, axis=2) * k, axis=2)


def qsa_keys(ki_BSEI: Array, norm_I: Array, pool: int, eps: float = RMS_EPS) -> Array:
  """(B,N,E,I) float32: each complete block's RMSNorm(mean of its raw index keys) (Qwen4-Exp)."""
  B, S, E, I = ki_BSEI.shape
  N = S // pool
  m = ki_BSEI[:, :N * pool].astype(jnp.float32).reshape(B, N, pool, E, I).mean(2)
  return m * lax.rsqrt(jnp.mean(m * m, -1, keepdims=True) + eps) * norm_I.astype(jnp.float32)


def kpool_scores(qi_BTJI: Array, pk_BNI: Array, w_BTJ: Array) -> Array:
  """(B,T,N): Σ_j w_j · ReLU(q_j · k̄_n) · I^-1/2."""
  d = jnp.einsum("BTJI,BNI->BTJN", qi_BTJI.astype(jnp.float32), pk_BNI)
  return jnp.einsum("BTJN,BTJ->BTN", jax.nn.relu(d), w_BTJ.astype(jnp.float32)) * qi_BTJI.shape[-1] ** -0.5


def qsa_scores(qi_BTJI: Array, pk_BNEI: Array) -> Array:
  """(B,T,N): Σ_j ReLU(q_j · k̄_n,e(j)) · I^-1/2, index query head j reading key head j // (J / E)."""
  B, T, J, I = qi_BTJI.shape
  E = pk_BNEI.shape[2]
  q = qi_BTJI.astype(jnp.float32).reshape(B, T, E, J // E, I)
  return jax.nn.relu(jnp.einsum("BTEJI,BNEI->BTEJN", q, pk_BNEI)).sum((2, 3)) * I ** -0.5


def pool_top(score_fn, qs: tuple, L_BT: Array, *, N: int, pool: int, n: int, rows: int = ROWS) -> Array:
  """(B,T,min(n, N)) int32: each query's top n complete pools whose last key it sees, -1 for none.
  score_fn(*rows of qs) -> (B,rows,N) scores; scored `rows` queries at a time."""
  k = min(n, N)
  end = (jnp.arange(N, dtype=jnp.int32) + 1) * pool - 1

  def fn(*xs):
    *q, L, _ = xs
    s = jnp.where(end[None, None, :] <= L[:, :, None], score_fn(*q), NEG)
    vals, idx = lax.top_k(s, k)
    return jnp.where(vals > NEG, idx.astype(jnp.int32), -1)

  return _rows(fn, L_BT.shape[1], rows, *qs, L_BT)


def pool_units(pools_BTn: Array, L_BT: Array, *, pool: int, tail: bool) -> Array:
  """(B,T,n [+ 1]) int32: pool_tokens' choice as pool ids (whole pools [pool·i, pool·i + pool)), then
  (tail) the query's own pool when it is incomplete, -1 for none. Its keys past L are the ones a query
  does not see (causal, kv_lengths), which the kernels mask: the same keys as pool_tokens."""
  if not tail or pool == 1:
    return pools_BTn
  seen = L_BT + 1
  own = jnp.where(seen % pool > 0, seen // pool, -1).astype(jnp.int32)
  return jnp.concatenate([pools_BTn, own[..., None]], axis=-1)


def pool_tokens(pools_BTn: Array, L_BT: Array, *, pool: int, tail: bool) -> Array:
  """(B,T,n·pool [+ pool - 1]) int32 token indices of the chosen pools, then (tail) the tokens of the
  query's own pool when it is incomplete (its keys up to L); -1 for none."""
  B, T, n = pools_BTn.shape
  tok = pools_BTn[..., None] * pool + jnp.arange(pool, dtype=jnp.int32)
  tok = jnp.where(pools_BTn[..., None] >= 0, tok, -1).reshape(B, T, n * pool)
  if not tail or pool == 1:
    return tok
  seen = L_BT + 1
  start, count = (seen // pool) * pool, seen % pool
  off = jnp.arange(pool - 1, dtype=jnp.int32)
  rest = jnp.where(off < count[..., None], start[..., None] + off, -1)
  return jnp.concatenate([tok, rest], axis=-1)


# The block indexer: token scores max-pooled into blocks, local blocks forced, top-k per kv group.

def block_top(qi_BTGI: Array, ki_BSI: Array, L_BT: Array, *, block: int, top_k: int, local: int,
              rows: int = ROWS) -> Array:
  """(B,G,T,min(top_k, N)) int32: each kv group's chosen blocks (N = ceil(S / block)), -1 for none."""
  qi, ki = (lax.stop_gradient(a).astype(jnp.float32) for a in (qi_BTGI, ki_BSI))
  B, T, G, _ = qi.shape
  S = ki.shape[1]
  N = -(-S // block)
  k = min(top_k, N)
  s_pos = jnp.arange(N * block, dtype=jnp.int32)
  kp = jnp.pad(ki, ((0, 0), (0, N * block - S), (0, 0)))
  n = jnp.arange(N, dtype=jnp.int32)

  def fn(q, L, _):
    d = jnp.einsum("BcGI,BSI->BGcS", q, kp)
    d = jnp.where(s_pos[None, None, None, :] <= L[:, None, :, None], d, NEG)
    sc = d.reshape(*d.shape[:3], N, block).max(-1)  # (B,G,c,N)
    own = (L // block)[:, None, :, None]
    forced = (n <= own) & (n > own - local) & (L[:, None, :, None] >= 0)
    sc = jnp.where(forced, jnp.inf, sc)
    vals, idx = lax.top_k(sc, k)
    return jnp.where(vals > NEG, idx.astype(jnp.int32), -1).transpose(0, 2, 1, 3)  # (B,c,G,k)

  return _rows(fn, T, rows, qi, L_BT).transpose(0, 2, 1, 3)


def block_tokens(blocks_BGTk: Array, *, block: int) -> Array:
  """(B,G,T,k·block) int32 token indices of the chosen blocks (-1 for none; past S: ignored by the
  kernels, as the keys a query does not see)."""
  return unit_tokens(blocks_BGTk, block)


def token_mask(tok_BGTk: Array, S: int) -> Array:
  """(B,G,T,S) bool: the keys the token indices name (-1 and indices past S name none)."""
  B, G, T, _ = tok_BGTk.shape
  where = jnp.where((tok_BGTk >= 0) & (tok_BGTk < S), tok_BGTk, S)
  b = jnp.arange(B)[:, None, None, None]
  g = jnp.arange(G)[None, :, None, None]
  t = jnp.arange(T)[None, None, :, None]
  return jnp.zeros((B, G, T, S + 1), bool).at[b, g, t, where].set(True)[..., :S]
