"""Native Sparse Attention's compressed branch and block choice as pure functions (Yuan et al. 2025,
"Native Sparse Attention: Hardware-Aligned and Natively Trainable Sparse Attention").

Positions as in attn.kernel.select: query t sits at p_t = t + S - T under is_causal;
without it (a decoding step's dense mask) p_t is the last key the query sees. Key
s is visible under is_causal (s <= p_t), kv_lengths and any dense mask.

Compression. Keys and values are cut into blocks of `block` starting every
`stride` keys (stride <= block: blocks overlap or touch), N_c = floor((S - block)
/ stride) + 1 of them (none while S < block). Block i is pooled by learned
weights over its intra-block positions j: k~_i = sum_j a_j k_{i*stride + j},
v~_i = sum_j b_j v_{i*stride + j} (`compress`). A query uses compressed block i
only when every key of it is visible (under is_causal: the block has ended,
i*stride + block - 1 <= p_t), so no query reads a key it could not see.

Block choice. Selection blocks of `select_block` keys (the last may be short).
A query's compressed-branch probabilities p_i (per head, summed over the heads
of a kv group: one choice per group, as the paper's GQA rule) score selection
block j by sum_i p_i * |[i*stride, i*stride + block) ∩ [j*sb, (j+1)*sb)|: each
compressed block spreads its probability over the keys it pooled, and a
selection block collects its keys' share. The paper's formula (its eq. 9) is this
rule when stride divides both block sizes; the overlap form needs no divisibility.
Candidates are the blocks where the query sees a key; always kept: its own
block (the last candidate, +inf), the initial block and the block before its own
(LOCAL = 2 local blocks with its own; a large finite score). The top `count`
candidates are kept (ties: lower index, lax.top_k's order); with fewer candidates
than `count`, all of them. Everything on the choice runs under stop_gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from attn.kernel.select import NEG, num_blocks

Array = jax.Array

LOCAL = 2  # local blocks always kept: the query's own and the one before it (with the initial block)
FORCED = 1e30  # score of an always-kept block below the own block's +inf; above any real score


def num_compressed(S: int, block: int, stride: int) -> int:
  """Compressed blocks among S keys: floor((S - block) / stride) + 1, or 0 while S < block."""
  return 0 if S < block else (S - block) // stride + 1


def compress(x_BSGX: Array, w_L: Array, *, block: int, stride: int) -> Array:
  """(B, N_c, G, X) float32: sum_j w_j · x_{i·stride + j} over each block's intra-block positions j."""
  B, S, G, X = x_BSGX.shape
  N = num_compressed(S, block, stride)
  if N == 0:
    return jnp.zeros((B, 0, G, X), jnp.float32)
  x = x_BSGX.astype(jnp.float32)
  w = w_L.astype(jnp.float32)
  out = jnp.zeros((B, N, G, X), jnp.float32)
  for j in range(block):  # strided slices: no (N_c, block) gather of the keys
    out = out + w[j] * lax.slice_in_dim(x, j, j + (N - 1) * stride + 1, stride=stride, axis=1)
  return out


def overlaps(S: int, block: int, stride: int, select_block: int) -> tuple[np.ndarray, np.ndarray]:
  """The band of compressed blocks each selection block shares keys with: (idx (W, N_s) int32,
  keys (W, N_s) float32), keys[r, j] shared by compressed block idx[r, j] and selection block j
  (0 where none). W = ceil((select_block + block) / stride) + 1 bounds the band: a dense (N_c, N_s)
  product would cost 2·T·G·N_c·N_s, at T = 16384 more than the attention it prunes."""
  N, Ns = num_compressed(S, block, stride), num_blocks(S, select_block)
  W = -(-(select_block + block) // stride) + 1
  j = np.arange(Ns)[None, :]
  first = np.maximum((j * select_block - block) // stride, 0)  # no earlier block reaches block j
  idx = first + np.arange(W)[:, None]
  start = idx * stride
  shared = np.minimum(start + block, (j + 1) * select_block) - np.maximum(start, j * select_block)
  keys = np.where(idx < N, np.maximum(shared, 0), 0).astype(np.float32)
  return np.minimum(idx, max(N - 1, 0)).astype(np.int32), keys


def query_positions(t_c: Array, T: int, S: int, is_causal: bool, vis_BHcS: Array | None) -> Array:
  """(B|1, H|1, c) p_t: t + S - T under is_causal; else the last key the row sees (-1: none)."""
  if is_causal or vis_BHcS is None:
    p = t_c + (S - T) if is_causal else jnp.full(t_c.shape, S - 1)
    return p[None, None]
  return jnp.max(jnp.where(vis_BHcS, jnp.arange(S), -1), axis=-1)


def compressed_visible(t_c: Array, *, T: int, S: int, block: int, stride: int, is_causal: bool,
                       limit_B: Array, vis_BHcS: Array | None) -> Array:
  """(B, H|1, c, N_c) bool: compressed block i usable by query t (every key of it visible)."""
  N = num_compressed(S, block, stride)
  if vis_BHcS is not None:
    ok = jnp.ones((*vis_BHcS.shape[:3], N), bool)
    for j in range(block if N else 0):
      ok = ok & lax.slice_in_dim(vis_BHcS, j, j + (N - 1) * stride + 1, stride=stride, axis=3)
    return ok
  end = jnp.arange(N) * stride + block - 1
  ok = (end[None, :] < limit_B[:, None])[:, None, None, :]
  if is_causal:
    ok = ok & (end[None, :] <= (t_c + S - T)[:, None])[None, None]
  return jnp.broadcast_to(ok, (limit_B.shape[0], 1, t_c.shape[0], N))


def selection_visible(t_c: Array, *, T: int, S: int, select_block: int, is_causal: bool,
                      limit_B: Array, vis_BHcS: Array | None) -> Array:
  """(B, H|1, c, N_s) bool: selection blocks in which query t sees at least one key."""
  Ns = num_blocks(S, select_block)
  if vis_BHcS is not None:
    v = jnp.pad(vis_BHcS, ((0, 0),) * 3 + ((0, Ns * select_block - S),))
    return v.reshape(*v.shape[:3], Ns, select_block).any(-1)
  start = jnp.arange(Ns) * select_block
  ok = (start[None, :] < limit_B[:, None])[:, None, None, :]
  if is_causal:
    ok = ok & (start[None, :] <= (t_c + S - T)[:, None])[None, None]
  return jnp.broadcast_to(ok, (limit_B.shape[0], 1, t_c.shape[0], Ns))


def choose_blocks(scores_BGcN: Array, cand_BGcN: Array, count: int) -> tuple[Array, Array]:
  """(idx (B,G,c,k) int32, chosen (B,G,c,k) bool), k = min(count, N_s): the own block (the last
  candidate), the initial block and the block before the own always; then the best scores."""
  Ns = scores_BGcN.shape[-1]
  n = jnp.arange(Ns)
  own = jnp.max(jnp.where(cand_BGcN, n, -1), axis=-1, keepdims=True)
  s = jnp.where(cand_BGcN, scores_BGcN, NEG)
  s = jnp.where(cand_BGcN & ((n == 0) | (n > own - LOCAL)), FORCED, s)
  s = jnp.where(n == own, jnp.inf, s)
  vals, idx = lax.top_k(s, min(count, Ns))
  return idx.astype(jnp.int32), vals > NEG


def _cap(logits, softcap):
  return logits if softcap is None else softcap * jnp.tanh(logits / softcap)


def branch(q_BcHK: Array, kc_BNGK: Array, vc_BNGV: Array, cvis_BHcN: Array, svis_BHcN: Array, *,
           groups: int, band: tuple, count: int, scale: float, softcap: float | None):
  """One chunk of queries: the compressed branch's output (B,c,H,V) in float32 and the chosen
  selection blocks per kv group (idx, chosen: (B,groups,c,k)). Rows seeing no compressed block get 0."""
  B, c, H, K = q_BcHK.shape
  Gk, Gv, V = kc_BNGK.shape[2], vc_BNGV.shape[2], vc_BNGV.shape[3]  # a key may have 1 head, values G
  idx_WM, keys_WM = band
  N, Ns = kc_BNGK.shape[1], keys_WM.shape[1]
  if N == 0:
    o = jnp.zeros((B, c, H, V), jnp.float32)
    scores = jnp.zeros((B, groups, c, Ns), jnp.float32)
  else:
    q = q_BcHK.astype(jnp.float32).reshape(B, c, Gk, H // Gk, K)
    logits = jnp.einsum("BTGRK,BNGK->BGRTN", q, kc_BNGK).reshape(B, H, c, N) * scale
    logits = jnp.where(cvis_BHcN, _cap(logits, softcap), NEG)
    m = jnp.max(logits, axis=-1, keepdims=True)
    e = jnp.exp(logits - jnp.where(m == NEG, 0.0, m))
    z = e.sum(-1, keepdims=True)
    p = e / jnp.where(z > 0, z, 1.0)  # 0 on a row that sees no compressed block
    o = jnp.einsum("BGRTN,BNGV->BTGRV", p.reshape(B, Gv, H // Gv, c, N), vc_BNGV).reshape(B, c, H, V)
    ps = lax.stop_gradient(p).reshape(B, groups, H // groups, c, N).sum(2)
    scores = jnp.einsum("BGTWM,WM->BGTM", ps[..., idx_WM], keys_WM)  # the band only
  cand = svis_BHcN
  if cand.shape[1] not in (1, groups):  # a per-head dense mask: a group's block where any head sees
    cand = cand.reshape(B, groups, H // groups, c, Ns).any(2)
  idx, chosen = choose_blocks(scores, jnp.broadcast_to(cand, scores.shape), count)
  return o, idx, chosen
