"""Blocked attention: exact softmax attention over blocks, never building a T×S array.

Online softmax (Rabe & Staats 2021; FlashAttention-2 ordering, Dao 2023): the
forward pass runs over query blocks, and for each over key blocks with a
running max m, running sum l and unnormalised output in float32; it keeps only
the output and the row log-sum-exp. The custom VJP recomputes each block's
scores from q, k and lse instead of storing them, running over key blocks
(dK, dV of a block finish in one pass) and, inside, over query blocks (dQ
accumulates). Memory is the inputs and outputs, the saved output and row
log-sum-exp (for the backward pass), and a few (B,H,block_q,block_k) blocks,
whatever T·S is.

Structured masks never become arrays: is_causal (bottom-right aligned, key s
visible to query t iff s <= t + S - T, as attn.kernel.masks.causal_mask),
kv_lengths (keys s >= kv_lengths[b] masked) and window w (key s visible iff
|t + S - T - s| < w, as attn.kernel.masks.window_mask) are compared per block from
iotas, and key blocks that no query of a block can see (above the causal
diagonal, outside the window, or past every length in the batch) are skipped
by the loop bounds (key_block_ranges): causal attention does about half the
work, and a window O(T·w) instead of O(T·S). A window whose keys fit in a slab
of at most SLAB_MAX takes the slab path instead: query blocks of SLAB_Q rows,
each against the one slab of keys it may see (SLAB_Q + w with a causal mask),
a plain softmax in one step, and a backward pass over the same slabs (dk, dv
accumulate where slabs overlap). A dense boolean mask is sliced per block and
combined with them. Fully masked rows give 0, in value and gradient.

softcap c caps each block's scaled logits to c·tanh(l / c); the backward
pass multiplies dS by its derivative 1 - tanh². sinks (H,) start each row's
running max and sum at (sink_h, 1), as a key with no value would; their
gradient is -Σ_t p_sink(t)·D_t with p_sink = exp(sink - lse) and
D_t = Σ_v dO·O.

probability "sigmoid" or "relu" (attn.kernel.probability) needs no online
normaliser: each weight σ(l − log n_t) or max(l, 0)/n_t is pointwise once n_t,
the keys a row's masks leave visible, is known (probability.visible_keys,
before the loop, from the masks' bounds and a prefix sum of a dense mask). The
forward pass sums weight·v over key blocks (the block loop: no slab path); the
backward pass recomputes each weight and multiplies dP = dO·vᵀ by its
derivative (σ(1 − σ), or 1/n_t where l > 0): there is no row term D_t.

Letters as in the README; t and s index a block's queries and keys.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from attn.kernel import probability as prob
from attn.kernel.products import XLA, Products
from attn.kernel.plan import (BLOCK_K, BLOCK_Q, SLAB_MAX, SLAB_Q, Plan, block_sizes, block_steps,
                                comp_blocks_for, comp_query_blocks_for, key_block_ranges,
                                key_blocks_for, plan_for, query_block_ranges, query_blocks_for,
                                slab_start, work_fraction)

Array = jax.Array


def _pad(x: Array, axis: int, size: int) -> Array:
  extra = size - x.shape[axis]
  if extra == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths)


def _rows(x_BTHX: Array, start, size: int, G: int) -> Array:
  """Rows [start, start+size) of (B,T,H,...) as (B,G,M,...), M = R·t: a group's R heads stacked."""
  blk = lax.dynamic_slice_in_dim(x_BTHX, start, size, axis=1)
  B, t, H = blk.shape[:3]
  blk = jnp.moveaxis(blk.reshape(B, t, G, H // G, *blk.shape[3:]), 1, 3)
  return blk.reshape(B, G, (H // G) * t, *blk.shape[4:])


def _unrows(x_BGMX: Array, R: int) -> Array:
  """(B,G,M,...) with M = R·t back to (B,t,H,...)."""
  B, G, M = x_BGMX.shape[:3]
  x = x_BGMX.reshape(B, G, R, M // R, *x_BGMX.shape[3:])
  return jnp.moveaxis(x, 3, 1).reshape(B, M // R, G * R, *x_BGMX.shape[3:])


def _keys(x_BSGX: Array, start, size: int) -> Array:
  """Keys or values [start, start+size) of (B,S,G,X) as (B,G,s,X)."""
  return lax.dynamic_slice_in_dim(x_BSGX, start, size, axis=1).transpose(0, 2, 1, 3)


def _keep(plan: Plan, t0, s0, width: int, limit_B: Array, mask5, R: int, keys_first: bool):
  """Which entries of queries [t0, t0+bq) × keys [s0, s0+width) may attend: (B,G,M,s), or (B,G,s,M)
  if keys_first; True = all."""
  s_pos = s0 + jnp.arange(width)
  t_pos = t0 + jnp.tile(jnp.arange(plan.bq), R)  # query position of each of the M rows
  keep = True
  if plan.key_limit:
    keep_Bs = s_pos[None, :] < limit_B[:, None]
    keep = keep_Bs[:, None, :, None] if keys_first else keep_Bs[:, None, None, :]
  shift = plan.S - plan.T
  if plan.is_causal or plan.window is not None:
    # Query position minus key position, (M, s) or (s, M): >= 0 causal, |.| < w in the window.
    d = (t_pos[None, :] + shift - s_pos[:, None] if keys_first
         else t_pos[:, None] + shift - s_pos[None, :])
    if plan.is_causal:
      keep = keep & (d >= 0)
    if plan.window is not None:
      keep = keep & (jnp.abs(d) < plan.window)
  if mask5 is not None:
    m = mask5
    if m.shape[3] > 1:
      m = lax.dynamic_slice_in_dim(m, t0, plan.bq, axis=3)
    if m.shape[4] > 1:
      m = lax.dynamic_slice_in_dim(m, s0, width, axis=4)
    Bm, Gm, _, tm, sm = m.shape
    m = jnp.broadcast_to(m, (Bm, Gm, R, plan.bq, sm)).reshape(Bm, Gm, R * plan.bq, sm)
    keep = keep & (m.transpose(0, 1, 3, 2) if keys_first else m)
  return keep


def _keep_comp(plan: Plan, t0, n0, width: int, limit_B: Array, cmask5, R: int, keys_first: bool):
  """Which of compressed entries [n0, n0+width) queries [t0, t0+bq) may see: entry n pools tokens
  before (n + 1)·cm, so it needs them all within the kv length and (causal) before the query."""
  n_pos = n0 + jnp.arange(width)
  end = (n_pos + 1) * plan.cm  # one past the last token entry n pools
  keep_Bn = (n_pos[None, :] < plan.N) & (end[None, :] <= limit_B[:, None])
  keep = keep_Bn[:, None, :, None] if keys_first else keep_Bn[:, None, None, :]
  if plan.is_causal:
    p = t0 + jnp.tile(jnp.arange(plan.bq), R) + plan.S - plan.T + 1
    keep = keep & ((p[None, :] >= end[:, None]) if keys_first else (p[:, None] >= end[None, :]))
  if cmask5 is not None:
    m = cmask5
    if m.shape[3] > 1:
      m = lax.dynamic_slice_in_dim(m, t0, plan.bq, axis=3)
    if m.shape[4] > 1:
      m = lax.dynamic_slice_in_dim(m, n0, width, axis=4)
    Bm, Gm, _, tm, sm = m.shape
    m = jnp.broadcast_to(m, (Bm, Gm, R, plan.bq, sm)).reshape(Bm, Gm, R * plan.bq, sm)
    keep = keep & (m.transpose(0, 1, 3, 2) if keys_first else m)
  return keep


def _dot(plan: Plan, spec: str, a: Array, b: Array) -> Array:
  """A block matmul in float32: batch letters first, then "MK,KN->MN" or "MK,NK->MN"."""
  # Half-precision blocks are upcast first: XLA's CPU matmul lacks a bf16 x bf16
  # -> f32 kernel for some block shapes, and the upcast copies one block only.
  return plan.products.block(spec, a.astype(jnp.float32), b.astype(jnp.float32))


def _logits(plan: Plan, s, keep):
  """Scaled (and capped) float32 logits of a block, masked entries -inf; and d cap / d logit."""
  # The scale rides on the block (fused into the exp pass), not on q: a scaled
  # copy of q would be one more (B,T,H,K) array alive through the backward pass.
  s = s * plan.scale
  dcap = None
  if plan.softcap is not None:
    u = jnp.tanh(s / plan.softcap)
    s, dcap = plan.softcap * u, 1.0 - u * u
  return (s if keep is True else jnp.where(keep, s, -jnp.inf)), dcap


def _sink_rows(sinks_H: Array, G: int, bq: int) -> Array:
  """Sink logits (H,) as (G, M) in float32, M = R·bq rows as _rows stacks them."""
  return jnp.repeat(sinks_H.astype(jnp.float32).reshape(G, -1), bq, axis=1)


def online_step(plan: Plan, state, s, v_BGsV: Array):
  """One key block of the online softmax: the running max, denominator and weighted sum, given its logits s."""
  m_BGM, l_BGM, acc_BGMV = state
  m_new = jnp.maximum(m_BGM, s.max(-1))
  m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row with nothing seen yet
  p = jnp.exp(s - m_use[..., None])
  alpha = jnp.exp(m_BGM - m_use)
  pv = _dot(plan, "BGMs,BGsV->BGMV", p.astype(v_BGsV.dtype), v_BGsV)
  return m_new, alpha * l_BGM + p.sum(-1), alpha[..., None] * acc_BGMV + pv


def store_rows(plan: Plan, i, R: int, carry, state):
  """Query block i's output and log-sum-exp (zeros for a row that saw no key) written into carry."""
  out_BTHV, lse_BTH = carry
  m, l, acc = state
  seen = l > 0
  l_safe = jnp.where(seen, l, 1.0)
  o_BGMV = jnp.where(seen[..., None], acc / l_safe[..., None], 0.0)
  lse_BGM = jnp.where(seen, m + jnp.log(l_safe), 0.0)
  out_BTHV = lax.dynamic_update_slice_in_dim(
      out_BTHV, _unrows(o_BGMV, R).astype(out_BTHV.dtype), i * plan.bq, axis=1)
  lse_BTH = lax.dynamic_update_slice_in_dim(lse_BTH, _unrows(lse_BGM, R), i * plan.bq, axis=1)
  return out_BTHV, lse_BTH


def _forward(plan: Plan, q_BTHK, k_BSGK, v_BSGV, limit_B, mask5, sinks_H, n_BTH, comp=None):
  """Output (B,Tp,H,V) and row log-sum-exp (B,Tp,H) in float32 (0 for fully masked rows).

  comp: None, or (ck (B,Np,G,K), cv (B,Np,G,V), cmask5): compressed keys and values each query
  block also sees (_keep_comp), after its token keys, in the same online softmax. With sinks the log-sum-exp includes the sink, and a fully masked row's is the sink. With
  sigmoid or relu (n_BTH the rows' visible keys), the log-sum-exp is all zeros, unused.
  """
  if plan.probability != "softmax":
    return _forward_pointwise(plan, q_BTHK, k_BSGK, v_BSGV, limit_B, mask5, n_BTH)
  B, Tp, H, K = q_BTHK.shape
  G, V = k_BSGK.shape[2], v_BSGV.shape[3]
  R, M = H // G, (H // G) * plan.bq
  key_end = jnp.max(limit_B)

  def query_block(i, carry):
    out_BTHV, lse_BTH = carry
    q_BGMK = _rows(q_BTHK, i * plan.bq, plan.bq, G)

    def key_step(s0, width, state):
      k_BGsK = _keys(k_BSGK, s0, width)
      v_BGsV = _keys(v_BSGV, s0, width)
      s = _dot(plan, "BGMK,BGsK->BGMs", q_BGMK, k_BGsK)
      s, _ = _logits(plan, s, _keep(plan, i * plan.bq, s0, width, limit_B, mask5, R,
                                    keys_first=False))
      return online_step(plan, state, s, v_BGsV)

    if sinks_H is None:
      m0, l0 = jnp.full((B, G, M), -jnp.inf, jnp.float32), jnp.zeros((B, G, M), jnp.float32)
    else:  # the sink is a key seen first: logit sink_h, no value
      m0 = jnp.broadcast_to(_sink_rows(sinks_H, G, plan.bq), (B, G, M))
      l0 = jnp.ones((B, G, M), jnp.float32)
    init = (m0, l0, jnp.zeros((B, G, M, V), jnp.float32))
    if plan.slab:  # every key the block may see, in one step
      m, l, acc = key_step(slab_start(plan, i), plan.slab, init)
    else:
      m, l, acc = lax.fori_loop(*key_blocks_for(plan, i, key_end),
                                lambda j, st: key_step(j * plan.bk, plan.bk, st), init)
    if comp is not None:
      ck_BNGK, cv_BNGV, cmask5 = comp

      def comp_step(j, state):
        n0 = j * plan.bc
        s = _dot(plan, "BGMK,BGsK->BGMs", q_BGMK, _keys(ck_BNGK, n0, plan.bc))
        s, _ = _logits(plan, s, _keep_comp(plan, i * plan.bq, n0, plan.bc, limit_B, cmask5, R,
                                           keys_first=False))
        return online_step(plan, state, s, _keys(cv_BNGV, n0, plan.bc))

      m, l, acc = lax.fori_loop(*comp_blocks_for(plan, i, key_end), comp_step, (m, l, acc))
    return store_rows(plan, i, R, (out_BTHV, lse_BTH), (m, l, acc))

  init = (jnp.zeros((B, Tp, H, V), q_BTHK.dtype), jnp.zeros((B, Tp, H), jnp.float32))
  return lax.fori_loop(0, plan.nq, query_block, init)


def _forward_pointwise(plan: Plan, q_BTHK, k_BSGK, v_BSGV, limit_B, mask5, n_BTH):
  """Σ_s weight_ts·v_s over the key blocks a query block sees, weights pointwise given n_t."""
  B, Tp, H, K = q_BTHK.shape
  G, V = k_BSGK.shape[2], v_BSGV.shape[3]
  R, M = H // G, (H // G) * plan.bq
  key_end = jnp.max(limit_B)

  def query_block(i, out_BTHV):
    q_BGMK = _rows(q_BTHK, i * plan.bq, plan.bq, G)
    n_BGM1 = _rows(n_BTH, i * plan.bq, plan.bq, G)[..., None]

    def key_block(j, acc_BGMV):
      s0 = j * plan.bk
      s = _dot(plan, "BGMK,BGsK->BGMs", q_BGMK, _keys(k_BSGK, s0, plan.bk))
      s, _ = _logits(plan, s, _keep(plan, i * plan.bq, s0, plan.bk, limit_B, mask5, R,
                                    keys_first=False))
      p = prob.pointwise(plan.probability, s, n_BGM1)  # 0 where masked (s = -inf)
      return acc_BGMV + _dot(plan, "BGMs,BGsV->BGMV", p.astype(v_BSGV.dtype), _keys(v_BSGV, s0, plan.bk))

    acc = lax.fori_loop(*key_blocks_for(plan, i, key_end), key_block,
                        jnp.zeros((B, G, M, V), jnp.float32))
    return lax.dynamic_update_slice_in_dim(out_BTHV, _unrows(acc, R).astype(out_BTHV.dtype),
                                           i * plan.bq, axis=1)

  out = lax.fori_loop(0, plan.nq, query_block, jnp.zeros((B, Tp, H, V), q_BTHK.dtype))
  return out, jnp.zeros((B, Tp, H), jnp.float32)


def _block_grads(plan: Plan, q_BGMK, do_BGMV, lse_BGM, delta_BGM, n_BGM, k_BGsK, v_BGsV, keep,
                 R: int, dtype):
  """One block's dK (unscaled), dV in float32 (B,G,s,·) and dQ (B,t,H,K), from recomputed P."""
  s = _dot(plan, "BGsK,BGMK->BGsM", k_BGsK, q_BGMK)
  s, dcap = _logits(plan, s, keep)
  if n_BGM is not None:  # sigmoid or relu
    n_BG1M = n_BGM[:, :, None, :]
    p = prob.pointwise(plan.probability, s, n_BG1M)  # 0 where masked (s = -inf)
  else:
    p = jnp.exp(s - lse_BGM[:, :, None, :])  # 0 where masked (s = -inf)
  dv_BGsV = _dot(plan, "BGsM,BGMV->BGsV", p.astype(dtype), do_BGMV)
  dp = _dot(plan, "BGsV,BGMV->BGsM", v_BGsV, do_BGMV)
  if n_BGM is not None:
    ds = dp * prob.pointwise_grad(plan.probability, s, p, n_BG1M)
  else:
    ds = p * (dp - delta_BGM[:, :, None, :])
  ds = (ds if dcap is None else ds * dcap).astype(dtype)
  dk_BGsK = _dot(plan, "BGsM,BGMK->BGsK", ds, q_BGMK)
  # dQᵀ keeps the matmul plain; its (K, M) block is small to transpose back.
  dq_BGKM = _dot(plan, "BGKs,BGsM->BGKM", k_BGsK.transpose(0, 1, 3, 2), ds)
  return dk_BGsK, dv_BGsV, _unrows(dq_BGKM.transpose(0, 1, 3, 2), R) * plan.scale


def _query_rows(plan: Plan, t0, G: int, q_BTHK, do_BTHV, lse_BTH, delta_BTH, n_BTH):
  """q, dO, lse, delta and n (None for softmax) of queries [t0, t0 + bq) in the (B,G,M,·) layout."""
  return tuple(None if x is None else _rows(x, t0, plan.bq, G)
               for x in (q_BTHK, do_BTHV, lse_BTH, delta_BTH, n_BTH))


def _backward(plan: Plan, q_BTHK, k_BSGK, v_BSGV, limit_B, mask5, sinks_H, n_BTH, out_BTHV,
              lse_BTH, do_BTHV, comp=None):
  """dq, dk, dv, dsinks, recomputing each block's probabilities from lse (FlashAttention-2, Alg. 2).

  Blocks are key-major, (B,G,s,M): then dV = Pᵀ·dO, dK = dSᵀ·Q and dQᵀ = Kᵀ·dSᵀ
  are all plain matmuls, with no transposed copy of a score block. Key block
  j is read only by outer step j, so dk and dv overwrite k and v block by
  block in the loop's carry: XLA may then reuse their buffers. The slab path
  (a window) runs over query blocks instead: each sees its whole slab of keys
  in one step, so dq is final and dk, dv accumulate over the slabs.
  """
  B, Tp, H, K = q_BTHK.shape
  G, V = k_BSGK.shape[2], v_BSGV.shape[3]
  R = H // G
  dtype = q_BTHK.dtype
  # delta_t = Σ_v dO·O = Σ_s P·dP: the softmax Jacobian's row term.
  delta_BTH = jnp.einsum("BTHV,BTHV->BTH", do_BTHV.astype(jnp.float32),
                         out_BTHV.astype(jnp.float32))
  dsinks_H = None
  if sinks_H is not None:  # dO/dsink = -p_sink·O per row: dsink = -Σ_t p_sink·delta
    p_sink_BTH = jnp.exp(sinks_H.astype(jnp.float32) - lse_BTH)
    dsinks_H = -jnp.einsum("BTH,BTH->H", p_sink_BTH, delta_BTH).astype(sinks_H.dtype)
  rows = functools.partial(_query_rows, plan, G=G, q_BTHK=q_BTHK, do_BTHV=do_BTHV,
                           lse_BTH=lse_BTH, delta_BTH=delta_BTH,
                           n_BTH=None if plan.probability == "softmax" else n_BTH)
  # logits = scale·q·kᵀ: dq = scale·dS·k and dk = scale·dSᵀ·q.
  if plan.slab:
    def slab_block(i, carry):
      dq_BTHK, dk_BSGK, dv_BSGV = carry
      t0, s0 = i * plan.bq, slab_start(plan, i)
      keep = _keep(plan, t0, s0, plan.slab, limit_B, mask5, R, keys_first=True)
      dk_BGsK, dv_BGsV, dq_BtHK = _block_grads(
          plan, *rows(t0), _keys(k_BSGK, s0, plan.slab), _keys(v_BSGV, s0, plan.slab), keep, R, dtype)

      def add_at(acc_BSGX, d_BGsX):  # slabs overlap: dk, dv accumulate
        new = lax.dynamic_slice_in_dim(acc_BSGX, s0, plan.slab, axis=1) + d_BGsX.transpose(0, 2, 1, 3)
        return lax.dynamic_update_slice_in_dim(acc_BSGX, new, s0, axis=1)
      return (lax.dynamic_update_slice_in_dim(dq_BTHK, dq_BtHK, t0, axis=1),
              add_at(dk_BSGK, dk_BGsK), add_at(dv_BSGV, dv_BGsV))

    init = (jnp.zeros((B, Tp, H, K), jnp.float32), jnp.zeros(k_BSGK.shape, jnp.float32),
            jnp.zeros(v_BSGV.shape, jnp.float32))
    dq_BTHK, dk_BSGK, dv_BSGV = lax.fori_loop(0, plan.nq, slab_block, init)
    dq_BTHK, dcomp = _comp_backward(plan, comp, rows, limit_B, R, dtype, dq_BTHK)
    return (dq_BTHK.astype(dtype), (dk_BSGK * plan.scale).astype(k_BSGK.dtype),
            dv_BSGV.astype(v_BSGV.dtype), dsinks_H, dcomp)

  nk_seen = (jnp.max(limit_B) + plan.bk - 1) // plan.bk  # key blocks before every length ends

  def key_block(j, carry):
    dq_BTHK, kdk_BSGK, vdv_BSGV = carry  # blocks >= j still hold k and v
    s0 = j * plan.bk
    k_BGsK = _keys(kdk_BSGK, s0, plan.bk)
    v_BGsV = _keys(vdv_BSGV, s0, plan.bk)

    def query_block(i, state):
      dq_BTHK, dk_BGsK, dv_BGsV = state
      t0 = i * plan.bq
      keep = _keep(plan, t0, s0, plan.bk, limit_B, mask5, R, keys_first=True)
      dk, dv, dq_BtHK = _block_grads(plan, *rows(t0), k_BGsK, v_BGsV, keep, R, dtype)
      dq_old = lax.dynamic_slice_in_dim(dq_BTHK, t0, plan.bq, axis=1)
      dq_BTHK = lax.dynamic_update_slice_in_dim(dq_BTHK, dq_old + dq_BtHK, t0, axis=1)
      return dq_BTHK, dk_BGsK + dk, dv_BGsV + dv

    init = (dq_BTHK, jnp.zeros((B, G, plan.bk, K), jnp.float32),
            jnp.zeros((B, G, plan.bk, V), jnp.float32))
    # A key block past every kv length runs no query block: its dk, dv are 0.
    lo, hi = query_blocks_for(plan, j)
    hi = jnp.where(j < nk_seen, hi, lo)
    dq_BTHK, dk_BGsK, dv_BGsV = lax.fori_loop(lo, hi, query_block, init)
    dk_BsGK = (dk_BGsK * plan.scale).transpose(0, 2, 1, 3).astype(kdk_BSGK.dtype)
    kdk_BSGK = lax.dynamic_update_slice_in_dim(kdk_BSGK, dk_BsGK, s0, axis=1)
    dv_BsGV = dv_BGsV.transpose(0, 2, 1, 3).astype(vdv_BSGV.dtype)
    vdv_BSGV = lax.dynamic_update_slice_in_dim(vdv_BSGV, dv_BsGV, s0, axis=1)
    return dq_BTHK, kdk_BSGK, vdv_BSGV

  init = (jnp.zeros((B, Tp, H, K), jnp.float32), k_BSGK, v_BSGV)
  dq_BTHK, dk_BSGK, dv_BSGV = lax.fori_loop(0, plan.nk, key_block, init)
  dq_BTHK, dcomp = _comp_backward(plan, comp, rows, limit_B, R, dtype, dq_BTHK)
  return dq_BTHK.astype(dtype), dk_BSGK, dv_BSGV, dsinks_H, dcomp


def _comp_backward(plan: Plan, comp, rows, limit_B, R: int, dtype, dq_BTHK):
  """dq (float32) with the compressed keys' share added, and (dck, dcv), key-major as the token loop."""
  if comp is None:
    return dq_BTHK, None
  ck_BNGK, cv_BNGV, cmask5 = comp

  def comp_block(j, carry):
    dq_BTHK, dck_BNGK, dcv_BNGV = carry
    n0 = j * plan.bc
    k_BGsK, v_BGsV = _keys(ck_BNGK, n0, plan.bc), _keys(cv_BNGV, n0, plan.bc)

    def query_block(i, state):
      dq_BTHK, dk_BGsK, dv_BGsV = state
      t0 = i * plan.bq
      keep = _keep_comp(plan, t0, n0, plan.bc, limit_B, cmask5, R, keys_first=True)
      dk, dv, dq_BtHK = _block_grads(plan, *rows(t0), k_BGsK, v_BGsV, keep, R, dtype)
      dq_old = lax.dynamic_slice_in_dim(dq_BTHK, t0, plan.bq, axis=1)
      dq_BTHK = lax.dynamic_update_slice_in_dim(dq_BTHK, dq_old + dq_BtHK, t0, axis=1)
      return dq_BTHK, dk_BGsK + dk, dv_BGsV + dv

    B, G = k_BGsK.shape[:2]
    init = (dq_BTHK, jnp.zeros((B, G, plan.bc, k_BGsK.shape[3]), jnp.float32),
            jnp.zeros((B, G, plan.bc, v_BGsV.shape[3]), jnp.float32))
    dq_BTHK, dk_BGsK, dv_BGsV = lax.fori_loop(*comp_query_blocks_for(plan, j), query_block, init)
    dck_BNGK = lax.dynamic_update_slice_in_dim(
        dck_BNGK, (dk_BGsK * plan.scale).transpose(0, 2, 1, 3).astype(dck_BNGK.dtype), n0, axis=1)
    dcv_BNGV = lax.dynamic_update_slice_in_dim(
        dcv_BNGV, dv_BGsV.transpose(0, 2, 1, 3).astype(dcv_BNGV.dtype), n0, axis=1)
    return dq_BTHK, dck_BNGK, dcv_BNGV

  init = (dq_BTHK.astype(jnp.float32), jnp.zeros_like(ck_BNGK), jnp.zeros_like(cv_BNGV))
  dq_BTHK, dck_BNGK, dcv_BNGV = lax.fori_loop(0, plan.nc, comp_block, init)
  return dq_BTHK, (dck_BNGK, dcv_BNGV, None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _core(plan: Plan, q_BTHK, k_BSGK, v_BSGV, limit_B, mask5, sinks_H, n_BTH, comp):
  return _forward(plan, q_BTHK, k_BSGK, v_BSGV, limit_B, mask5, sinks_H, n_BTH, comp)[0]


def _core_fwd(plan: Plan, q_BTHK, k_BSGK, v_BSGV, limit_B, mask5, sinks_H, n_BTH, comp):
  out_BTHV, lse_BTH = _forward(plan, q_BTHK, k_BSGK, v_BSGV, limit_B, mask5, sinks_H, n_BTH, comp)
  return out_BTHV, (q_BTHK, k_BSGK, v_BSGV, limit_B, mask5, sinks_H, n_BTH, out_BTHV, lse_BTH, comp)


def _core_bwd(plan: Plan, res, do_BTHV):
  *res, comp = res
  dq, dk, dv, dsinks, dcomp = _backward(plan, *res, do_BTHV, comp=comp)
  return dq, dk, dv, None, None, dsinks, None, dcomp


_core.defvjp(_core_fwd, _core_bwd)


def _mask5(mask: Array | None, H: int, G: int, Tp: int, Sp: int) -> Array | None:
  """A dense mask broadcastable to (B,H,T,S) as (B|1, G|1, R|1, Tp|1, Sp|1), padded with False."""
  if mask is None:
    return None
  mask = jnp.asarray(mask)
  mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
  Bm, Hm, Tm, Sm = mask.shape
  m5 = mask[:, :, None] if Hm == 1 else mask.reshape(Bm, G, H // G, Tm, Sm)
  if Tm > 1:
    m5 = _pad(m5, 3, Tp)
  if Sm > 1:
    m5 = _pad(m5, 4, Sp)
  return m5


def attention(q_BTHK: Array, k_BSGK: Array, v_BSGV: Array, mask: Array | None = None, *,
              is_causal: bool = False, kv_lengths: Array | None = None, scale: float,
              block_q: int | None = None, block_k: int | None = None, window: int | None = None,
              sinks: Array | None = None, softcap: float | None = None,
              probability: str = "softmax", products: Products = XLA,
              compressed: tuple | None = None) -> Array:
  """softmax(cap(scale · q kᵀ), masked, sinks) v over blocks (or sigmoid, relu: attn.kernel.probability);
  inputs checked by kernel.attention; the block matmuls on products (attn.kernel.products).

  compressed: None, or (ck (B,N,G,K), cv (B,N,G,V), m, cmask): N compressed keys and values (entry
  n pooling the tokens before (n + 1)·m, attn.kernel.compressed) that every query also sees in the
  same softmax where all those tokens are visible (causal, kv_lengths) and cmask (None or
  broadcastable to (B,H,T,N)) allows; the window and mask act on the token keys only. Softmax only.
  """
  B, T, H, K = q_BTHK.shape
  S, G = k_BSGK.shape[1], k_BSGK.shape[2]
  plan = plan_for(T, S, block_q, block_k, is_causal=is_causal, window=window, scale=scale,
                  softcap=softcap, has_lengths=kv_lengths is not None, probability=probability)
  plan = dataclasses.replace(plan, products=products)
  comp = None
  if compressed is not None and compressed[0].shape[1] > 0:
    ck_BNGK, cv_BNGV, m, cmask = compressed
    N = ck_BNGK.shape[1]
    bc = block_sizes(T, N, None, block_k)[1]
    plan = dataclasses.replace(plan, cm=int(m), N=N, bc=bc, key_limit=True)
    Np = plan.nc * bc
    comp = (_pad(ck_BNGK, 1, Np), _pad(cv_BNGV, 1, Np), _mask5(cmask, H, G, plan.nq * plan.bq, Np))
  Tp, Sp = plan.nq * plan.bq, plan.nk * plan.bk
  limit_B = jnp.full((B,), S, jnp.int32)
  if kv_lengths is not None:
    limit_B = jnp.minimum(jnp.asarray(kv_lengths).astype(jnp.int32), S)
  n_BTH = None
  if probability != "softmax":  # padded query rows get n = 1: their outputs are dropped
    n_BHT = prob.visible_keys(T, S, mask, is_causal=is_causal, kv_lengths=kv_lengths, window=window)
    n_BTH = jnp.broadcast_to(n_BHT.transpose(0, 2, 1), (B, T, H))
    n_BTH = _pad(jnp.maximum(n_BTH, 1).astype(jnp.float32), 1, Tp).at[:, T:].set(1.0)
  out_BTHV = _core(plan, _pad(q_BTHK, 1, Tp), _pad(k_BSGK, 1, Sp), _pad(v_BSGV, 1, Sp),
                   limit_B, _mask5(mask, H, G, Tp, Sp), sinks, n_BTH, comp)
  return out_BTHV[:, :T]


# The plan's public names are re-exported: attn.kernel.blocked.key_block_ranges and the rest.
__all__ = ["BLOCK_K", "BLOCK_Q", "SLAB_MAX", "SLAB_Q", "attention", "block_sizes", "block_steps",
           "key_block_ranges", "query_block_ranges", "work_fraction"]
