"""MoBA's attention over only the chosen (query, block) pairs: queries gathered per key block.

attn.kernel.sparse visits, per query block, the union of its rows' chosen blocks:
when the rows of a query block choose different blocks (MoBA's gate with 8
heads of 512 rows each) that union is nearly every block and nothing is saved.
Here the work follows the pairs themselves, as MoBA's own implementation does:
every (batch, head, query, k-th choice) pair is one row; the rows are sorted by
(batch, kv head, chosen block) and cut into chunks of CHUNK rows of one block
(each block's rows padded to whole chunks). A chunk gathers its CHUNK query rows
and its one key block, and computes their online-softmax partials (max, sum,
weighted values); the top_k partials of a row are merged by their log-sum-exp.
Work: B·H·T·top_k·block score pairs (plus padding), not B·H·T·S/2.

The backward pass recomputes each chunk's probabilities from the merged
log-sum-exp (FlashAttention-2's rule) and adds dq into the gathered rows, dk
and dv into the block. Causal (bottom-right aligned) and kv_lengths masks apply
inside a block; softcap is supported; no sinks, windows or dense masks (those
calls take the dense path, attn.variants.selection).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

Array = jax.Array

CHUNK = 512


@dataclasses.dataclass(frozen=True)
class _Plan:
  B: int
  T: int
  S: int
  H: int
  G: int
  N: int
  bs: int
  top: int
  chunk: int
  n_chunks: int  # the static bound on chunks
  is_causal: bool
  scale: float
  softcap: float | None


def _layout(plan: _Plan, idx_BHTk: Array, valid_BHTk: Array):
  """(row of each slot (L,) pair index or P for none, (b, g, j) of each chunk, chunks used, the slot
  of each pair (P,) or L for none)."""
  B, H, T, k, G, N, C = plan.B, plan.H, plan.T, plan.top, plan.G, plan.N, plan.chunk
  P = B * H * T * k
  b = jnp.arange(B)[:, None, None, None]
  g = (jnp.arange(H) // (H // G))[None, :, None, None]
  seg = jnp.where(valid_BHTk, (b * G + g) * N + idx_BHTk, B * G * N).reshape(P)
  order = jnp.argsort(seg, stable=True)
  sseg = seg[order]
  counts = jnp.bincount(seg, length=B * G * N + 1)[:-1]
  padded = -(-counts // C) * C
  start = jnp.concatenate([jnp.zeros(1, counts.dtype), jnp.cumsum(padded)])[:-1]
  first = jnp.concatenate([jnp.zeros(1, counts.dtype), jnp.cumsum(counts)])[:-1]
  real = sseg < B * G * N
  safe = jnp.where(real, sseg, 0)
  slot = jnp.where(real, start[safe] + (jnp.arange(P) - first[safe]), plan.n_chunks * C)
  L = plan.n_chunks * C
  row = jnp.full((L + 1,), P, jnp.int32).at[slot].set(order.astype(jnp.int32))[:L]
  seg_of_slot = jnp.zeros((L + 1,), jnp.int32).at[slot].set(safe.astype(jnp.int32))[:L]
  chunk_seg = seg_of_slot[::C]
  used = (jnp.sum(padded) // C).astype(jnp.int32)
  slot_P = jnp.zeros((P,), slot.dtype).at[order].set(slot)  # each pair's slot (L: none)
  return row, chunk_seg, used, slot_P


def _chunk(plan: _Plan, c, row_L, chunk_seg, limit_B, q_RK, k_BSGK, v_BSGV):
  """A chunk's rows (C,), its (b, g, j), queries (C,K), keys (bs,K), values (bs,V) and mask (C,bs)."""
  C, bs = plan.chunk, plan.bs
  P = plan.B * plan.H * plan.T * plan.top
  rows = lax.dynamic_slice_in_dim(row_L, c * C, C)
  ok = rows < P
  pair = jnp.where(ok, rows, 0)
  u = chunk_seg[c]
  b, g, j = u // (plan.G * plan.N), (u // plan.N) % plan.G, u % plan.N
  h = (pair // (plan.T * plan.top)) % plan.H
  t = (pair // plan.top) % plan.T
  qrow = (b * plan.T + t) * plan.H + h  # the row of q flattened as (B, T, H)
  q = q_RK[qrow]
  kb = lax.dynamic_slice(k_BSGK, (b, j * bs, g, 0), (1, bs, 1, k_BSGK.shape[3]))[0, :, 0]
  vb = lax.dynamic_slice(v_BSGV, (b, j * bs, g, 0), (1, bs, 1, v_BSGV.shape[3]))[0, :, 0]
  s_pos = j * bs + jnp.arange(bs)
  keep = ok[:, None] & (s_pos < limit_B[b])[None, :]
  if plan.is_causal:
    keep = keep & (s_pos[None, :] <= (t + plan.S - plan.T)[:, None])
  return rows, qrow, (b, g, j), q, kb, vb, keep


def _logits(plan: _Plan, q, kb, keep):
  s = jnp.dot(q.astype(jnp.float32), kb.astype(jnp.float32).T) * plan.scale
  dcap = None
  if plan.softcap is not None:
    u = jnp.tanh(s / plan.softcap)
    s, dcap = plan.softcap * u, 1.0 - u * u
  return jnp.where(keep, s, -jnp.inf), dcap


def _forward(plan: _Plan, q_BTHK, k_BSGK, v_BSGV, limit_B, idx_BHTk, valid_BHTk):
  B, T, H, K = q_BTHK.shape
  V = v_BSGV.shape[3]
  P = B * H * T * plan.top
  row_L, chunk_seg, used, slot_P = _layout(plan, idx_BHTk, valid_BHTk)
  q_RK = q_BTHK.reshape(B * T * H, K)
  C, L = plan.chunk, plan.n_chunks * plan.chunk

  def step(c, carry):  # partials by slot, chunk after chunk (no scatter in the loop)
    m_L, l_L, acc_LV = carry
    _, _, _, q, kb, vb, keep = _chunk(plan, c, row_L, chunk_seg, limit_B, q_RK, k_BSGK, v_BSGV)
    s, _ = _logits(plan, q, kb, keep)
    m = s.max(-1)
    p = jnp.exp(s - jnp.where(m == -jnp.inf, 0.0, m)[:, None])
    acc = jnp.dot(p, vb.astype(jnp.float32))
    return (lax.dynamic_update_slice_in_dim(m_L, m, c * C, 0),
            lax.dynamic_update_slice_in_dim(l_L, p.sum(-1), c * C, 0),
            lax.dynamic_update_slice_in_dim(acc_LV, acc, c * C, 0))

  init = (jnp.full((L + 1,), -jnp.inf, jnp.float32), jnp.zeros((L + 1,), jnp.float32),
          jnp.zeros((L + 1, V), jnp.float32))  # slot L: the pairs with no block
  m_L, l_L, acc_LV = lax.fori_loop(0, used, step, init)
  m_P, l_P, acc_PV = m_L[slot_P], l_L[slot_P], acc_LV[slot_P]
  shape = (B, H, T, plan.top)
  m, l, acc = m_P.reshape(shape), l_P.reshape(shape), acc_PV.reshape(*shape, V)
  M = m.max(-1, keepdims=True)
  w = jnp.exp(m - jnp.where(M == -jnp.inf, 0.0, M))  # 0 for a pair with nothing
  L = (w * l).sum(-1)
  seen = L > 0
  L_safe = jnp.where(seen, L, 1.0)
  o_BHTV = jnp.where(seen[..., None], (w[..., None] * acc).sum(-2) / L_safe[..., None], 0.0)
  lse_BHT = jnp.where(seen, M[..., 0] + jnp.log(L_safe), 0.0)
  return o_BHTV.transpose(0, 2, 1, 3).astype(q_BTHK.dtype), lse_BHT.transpose(0, 2, 1)


def _backward(plan: _Plan, q_BTHK, k_BSGK, v_BSGV, limit_B, idx_BHTk, valid_BHTk, out_BTHV, lse_BTH,
              do_BTHV):
  B, T, H, K = q_BTHK.shape
  V = v_BSGV.shape[3]
  row_L, chunk_seg, used, _ = _layout(plan, idx_BHTk, valid_BHTk)
  q_RK = q_BTHK.reshape(B * T * H, K)
  do_RV = do_BTHV.reshape(B * T * H, V).astype(jnp.float32)
  lse_R = lse_BTH.reshape(B * T * H)
  delta_R = jnp.einsum("RV,RV->R", do_RV, out_BTHV.reshape(B * T * H, V).astype(jnp.float32))
  bs = plan.bs

  def step(c, carry):
    dq_RK, dk_BSGK, dv_BSGV = carry
    _, qrow, (b, g, j), q, kb, vb, keep = _chunk(plan, c, row_L, chunk_seg, limit_B, q_RK, k_BSGK,
                                                 v_BSGV)
    s, dcap = _logits(plan, q, kb, keep)
    p = jnp.exp(s - lse_R[qrow][:, None])  # 0 where masked
    do = do_RV[qrow]
    dv = jnp.dot(p.T, do)
    ds = p * (jnp.dot(do, vb.astype(jnp.float32).T) - delta_R[qrow][:, None])
    if dcap is not None:
      ds = ds * dcap
    dq_RK = dq_RK.at[qrow].add(jnp.dot(ds, kb.astype(jnp.float32)) * plan.scale)

    def add(acc, d):
      old = lax.dynamic_slice(acc, (b, j * bs, g, 0), (1, bs, 1, acc.shape[3]))
      return lax.dynamic_update_slice(acc, old + d[None, :, None], (b, j * bs, g, 0))
    return dq_RK, add(dk_BSGK, jnp.dot(ds.T, q.astype(jnp.float32)) * plan.scale), add(dv_BSGV, dv)

  init = (jnp.zeros((B * T * H, K), jnp.float32), jnp.zeros(k_BSGK.shape, jnp.float32),
          jnp.zeros(v_BSGV.shape, jnp.float32))
  dq, dk, dv = lax.fori_loop(0, used, step, init)
  return (dq.reshape(q_BTHK.shape).astype(q_BTHK.dtype), dk.astype(k_BSGK.dtype),
          dv.astype(v_BSGV.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _core(plan, q, k, v, limit_B, idx, valid):
  return _forward(plan, q, k, v, limit_B, idx, valid)[0]


def _core_fwd(plan, q, k, v, limit_B, idx, valid):
  out, lse = _forward(plan, q, k, v, limit_B, idx, valid)
  return out, (q, k, v, limit_B, idx, valid, out, lse)


def _core_bwd(plan, res, do):
  dq, dk, dv = _backward(plan, *res, do)
  return dq, dk, dv, None, None, None


_core.defvjp(_core_fwd, _core_bwd)


def attention(q_BTHK: Array, k_BSGK: Array, v_BSGV: Array, idx_BHTk: Array, valid_BHTk: Array, *,
              block: int, scale: float, is_causal: bool = False, kv_lengths: Array | None = None,
              softcap: float | None = None, chunk: int = CHUNK) -> Array:
  """softmax attention of each (query, head) over its chosen blocks idx (valid where chosen) only.

  idx, valid (B, H|G, T, k): block ids per query head (MoBA's), or per kv group (the block indexer's:
  each of a group's H/G query heads attends to its group's blocks)."""
  B, T, H, K = q_BTHK.shape
  S, G = k_BSGK.shape[1], v_BSGV.shape[2]
  if idx_BHTk.shape[1] != H and idx_BHTk.shape[1] == G:
    idx_BHTk, valid_BHTk = (jnp.repeat(a, H // G, axis=1) for a in (idx_BHTk, valid_BHTk))
  if idx_BHTk.shape[:3] != (B, H, T) or valid_BHTk.shape != idx_BHTk.shape:
    raise ValueError(f"idx_BHTk {idx_BHTk.shape}, valid {valid_BHTk.shape}: want (B={B}, H={H} or G={G}, T={T}, k)")
  if k_BSGK.shape[2] != G:
    k_BSGK = jnp.broadcast_to(k_BSGK, (B, S, G, K))
  N, top = -(-S // block), idx_BHTk.shape[-1]
  chunk = min(chunk, H * T * top)
  P = B * H * T * top
  n_chunks = -(-(P + B * G * N * (chunk - 1)) // chunk)
  plan = _Plan(B, T, S, H, G, N, block, top, chunk, n_chunks, bool(is_causal), float(scale),
               None if softcap is None else float(softcap))
  pad = N * block - S
  k_p = jnp.pad(k_BSGK, ((0, 0), (0, pad), (0, 0), (0, 0)))
  v_p = jnp.pad(v_BSGV, ((0, 0), (0, pad), (0, 0), (0, 0)))
  limit_B = jnp.full((B,), S, jnp.int32)
  if kv_lengths is not None:
    limit_B = jnp.minimum(jnp.asarray(kv_lengths).astype(jnp.int32), S)
  out = _core(plan, q_BTHK, k_p, v_p, limit_B, lax.stop_gradient(idx_BHTk).astype(jnp.int32),
              lax.stop_gradient(valid_BHTk))
  return out
