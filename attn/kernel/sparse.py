"""The blocked kernel honouring a key selection: only the selected key blocks are computed.

attn.kernel.blocked's online softmax and recomputing VJP, over a per-(batch, query
block) list of key blocks instead of a range. A selection arrives as

  blocks_BHTN  (B, H|1, T, N) bool, N = ceil(S / block_k): the key blocks each query
               row (of each head, or of every head) may touch (MoBA's choice, at its
               block size = block_k; or the blocks holding a token the indexer chose);
  bits_BTW     optional (B, T, ceil(S/32)) uint32: the chosen tokens themselves, 32 keys
               a word (attn.kernel.select.pack_bits), the mask inside a block (indexer).

Query block i visits the union, over its rows and heads, of their selected
blocks, in increasing order: the list is built once, (B, nq, N) int32, with a
count per (batch, query block); the loop runs to the largest count in the
batch, and a batch element with fewer masks the rest. Each visit gathers one
key block per batch element (a dynamic slice per element) and masks, inside
it, what the row did not select, the causal diagonal (bottom-right aligned)
and kv_lengths. Nothing of size T×S is built but the indexer's bits (T·S/8
bytes: 32 MiB per batch element at T = 16384) and no float score matrix.

The backward pass runs over the same visits, query-major (as the slab path of
attn.kernel.blocked): dq of a query block is final after its visits, and dk, dv
are added at the gathered blocks. Softmax only, with softcap; a call with sinks,
another probability function, a window or a dense mask takes the dense path
(attn.variants.selection). Fully masked rows give 0, in value and gradient.

A choice given as token indices too (idx_BTk: one choice for every head, the indexer's), with at
least TOKENS_MIN_SHARE query heads a kv head, does not come here: its indices run on
attn.kernel.tokens, each gathered key row serving every query head of its token, without
visiting the key blocks.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from attn.kernel.blocked import _block_grads, _dot, _logits, _pad, _rows, online_step, store_rows
from attn.kernel.plan import BLOCK_Q, Plan, block_sizes
from attn.kernel.products import XLA, Products
from attn.kernel import tokens
from attn.kernel.select import bits_at

Array = jax.Array

# Query heads a kv head serves (H // G) from which the indexer's choice runs on attn.kernel.tokens: its
# gathered rows cost 2·G·(K + V) bytes a chosen pair for 2·H·(K + V) FLOPs, so with few heads a kv head
# the gather is the bound. Measured (T 2048, top 256, 16 heads of 64, forward+backward, a loaded 2-core
# Xeon): G 1 0.27 s against 1.27 s blocked, G 2 0.34 against 2.07; G 4 2.6 against 1.9 and G 16 8.9
# against 1.5 (before the backward's token-major scatter, which halved those two).
TOKENS_MIN_SHARE = 8


@dataclasses.dataclass(frozen=True)
class SparsePlan:
  plan: Plan
  heads_sel: int  # 1: one selection for every head (indexer); H: one per head (MoBA)
  has_bits: bool


def _gather_keys(x_BSGX: Array, s0_B: Array, size: int) -> Array:
  """Keys [s0_b, s0_b + size) of each batch element b, as (B,G,s,X)."""
  blk = jax.vmap(lambda x, s: lax.dynamic_slice_in_dim(x, s, size, axis=0))(x_BSGX, s0_B)
  return blk.transpose(0, 2, 1, 3)


def _add_keys(acc_BSGX: Array, d_BGsX: Array, s0_B: Array) -> Array:
  """acc with d added at keys [s0_b, s0_b + s) of each batch element."""
  size = d_BGsX.shape[2]

  def one(acc, d, s):
    old = lax.dynamic_slice_in_dim(acc, s, size, axis=0)
    return lax.dynamic_update_slice_in_dim(acc, old + d.transpose(1, 0, 2), s, axis=0)
  return jax.vmap(one)(acc_BSGX, d_BGsX, s0_B)


def _keep(sp: SparsePlan, i, j_B, valid_B, limit_B, blocks_BHTN, bits_BTW, G: int, R: int,
          keys_first: bool) -> Array:
  """(B,G|1,M,s) (or (B,G|1,s,M) keys_first): the entries of query block i × key block j_b kept."""
  plan = sp.plan
  bq, bk = plan.bq, plan.bk
  t0 = i * bq
  s_pos = j_B[:, None] * bk + jnp.arange(bk)  # (B,s)
  t_pos = t0 + jnp.tile(jnp.arange(bq), R)  # (M,)
  keep = (s_pos < limit_B[:, None])[:, None, None, :] & valid_B[:, None, None, None]
  if plan.is_causal:
    keep = keep & ((t_pos[:, None] + plan.S - plan.T) >= s_pos[:, None, :])[:, None]
  sel = lax.dynamic_slice_in_dim(blocks_BHTN, t0, bq, axis=2)  # (B,Hs,bq,N)
  sel = jnp.take_along_axis(sel, j_B[:, None, None, None], axis=3)[..., 0]  # (B,Hs,bq)
  if sp.heads_sel == 1:
    sel_BGM = jnp.tile(sel, (1, 1, R))  # (B,1,M)
  else:
    sel_BGM = sel.reshape(sel.shape[0], G, R * bq)
  keep = keep & sel_BGM[..., None]
  if sp.has_bits:
    rows = lax.dynamic_slice_in_dim(bits_BTW, t0, bq, axis=1)  # (B,bq,W)
    keep = keep & jnp.tile(bits_at(rows, s_pos), (1, R, 1))[:, None]  # (B,1,M,s)
  return keep.swapaxes(-1, -2) if keys_first else keep


def _lists(blocks_BHTN: Array, bq: int, nq: int) -> tuple[Array, Array]:
  """Per (batch, query block): the key blocks any of its rows selected, ascending, and their count."""
  B, Hs, Tp, N = blocks_BHTN.shape
  any_BnN = blocks_BHTN.reshape(B, Hs, nq, bq, N).any(axis=(1, 3))
  order = jnp.argsort(~any_BnN, axis=-1, stable=True).astype(jnp.int32)
  return order, any_BnN.sum(-1).astype(jnp.int32)


def _forward(sp: SparsePlan, q_BTHK, k_BSGK, v_BSGV, limit_B, blocks_BHTN, bits_BTW):
  plan = sp.plan
  B, Tp, H, K = q_BTHK.shape
  G, V = k_BSGK.shape[2], v_BSGV.shape[3]
  R, M = H // G, (H // G) * plan.bq
  list_BnN, count_Bn = _lists(blocks_BHTN, plan.bq, plan.nq)

  def query_block(i, carry):
    out_BTHV, lse_BTH = carry
    q_BGMK = _rows(q_BTHK, i * plan.bq, plan.bq, G)

    def visit(l, state):
      j_B = list_BnN[:, i, l]
      s0_B = j_B * plan.bk
      k_BGsK = _gather_keys(k_BSGK, s0_B, plan.bk)
      v_BGsV = _gather_keys(v_BSGV, s0_B, plan.bk)
      s = _dot(plan, "BGMK,BGsK->BGMs", q_BGMK, k_BGsK)
      keep = _keep(sp, i, j_B, l < count_Bn[:, i], limit_B, blocks_BHTN, bits_BTW, G, R, False)
      s, _ = _logits(plan, s, keep)
      return online_step(plan, state, s, v_BGsV)

    init = (jnp.full((B, G, M), -jnp.inf, jnp.float32), jnp.zeros((B, G, M), jnp.float32),
            jnp.zeros((B, G, M, V), jnp.float32))
    m, l, acc = lax.fori_loop(0, jnp.max(count_Bn[:, i]), visit, init)
    return store_rows(plan, i, R, (out_BTHV, lse_BTH), (m, l, acc))

  init = (jnp.zeros((B, Tp, H, V), q_BTHK.dtype), jnp.zeros((B, Tp, H), jnp.float32))
  return lax.fori_loop(0, plan.nq, query_block, init)


def _backward(sp: SparsePlan, q_BTHK, k_BSGK, v_BSGV, limit_B, blocks_BHTN, bits_BTW, out_BTHV,
              lse_BTH, do_BTHV):
  """dq, dk, dv over the same visits, query-major: dq final per query block, dk, dv added."""
  plan = sp.plan
  B, Tp, H, K = q_BTHK.shape
  G, V = k_BSGK.shape[2], v_BSGV.shape[3]
  R = H // G
  dtype = q_BTHK.dtype
  list_BnN, count_Bn = _lists(blocks_BHTN, plan.bq, plan.nq)
  delta_BTH = jnp.einsum("BTHV,BTHV->BTH", do_BTHV.astype(jnp.float32),
                         out_BTHV.astype(jnp.float32))

  def query_block(i, carry):
    dq_BTHK, dk_BSGK, dv_BSGV = carry
    t0 = i * plan.bq
    rows = tuple(_rows(x, t0, plan.bq, G) for x in (q_BTHK, do_BTHV, lse_BTH, delta_BTH))

    def visit(l, state):
      dq_BtHK, dk_BSGK, dv_BSGV = state
      j_B = list_BnN[:, i, l]
      s0_B = j_B * plan.bk
      keep = _keep(sp, i, j_B, l < count_Bn[:, i], limit_B, blocks_BHTN, bits_BTW, G, R, True)
      dk, dv, dq = _block_grads(plan, *rows, None, _gather_keys(k_BSGK, s0_B, plan.bk),
                                _gather_keys(v_BSGV, s0_B, plan.bk), keep, R, dtype)
      return dq_BtHK + dq, _add_keys(dk_BSGK, dk, s0_B), _add_keys(dv_BSGV, dv, s0_B)

    init = (jnp.zeros((B, plan.bq, H, K), jnp.float32), dk_BSGK, dv_BSGV)
    dq_BtHK, dk_BSGK, dv_BSGV = lax.fori_loop(0, jnp.max(count_Bn[:, i]), visit, init)
    return lax.dynamic_update_slice_in_dim(dq_BTHK, dq_BtHK, t0, axis=1), dk_BSGK, dv_BSGV

  init = (jnp.zeros((B, Tp, H, K), jnp.float32), jnp.zeros(k_BSGK.shape, jnp.float32),
          jnp.zeros(v_BSGV.shape, jnp.float32))
  dq, dk, dv = lax.fori_loop(0, plan.nq, query_block, init)
  return dq.astype(dtype), (dk * plan.scale).astype(k_BSGK.dtype), dv.astype(v_BSGV.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _core(sp: SparsePlan, q_BTHK, k_BSGK, v_BSGV, limit_B, blocks_BHTN, bits_BTW):
  return _forward(sp, q_BTHK, k_BSGK, v_BSGV, limit_B, blocks_BHTN, bits_BTW)[0]


def _core_fwd(sp: SparsePlan, q_BTHK, k_BSGK, v_BSGV, limit_B, blocks_BHTN, bits_BTW):
  out_BTHV, lse_BTH = _forward(sp, q_BTHK, k_BSGK, v_BSGV, limit_B, blocks_BHTN, bits_BTW)
  return out_BTHV, (q_BTHK, k_BSGK, v_BSGV, limit_B, blocks_BHTN, bits_BTW, out_BTHV, lse_BTH)


def _core_bwd(sp: SparsePlan, res, do_BTHV):
  dq, dk, dv = _backward(sp, *res, do_BTHV)
  return dq, dk, dv, None, None, None


_core.defvjp(_core_fwd, _core_bwd)


def attention(q_BTHK: Array, k_BSGK: Array, v_BSGV: Array, blocks_BHTN: Array | None, *, block_k: int,
              scale: float, is_causal: bool = False, kv_lengths: Array | None = None,
              bits_BTW: Array | None = None, block_q: int | None = None,
              softcap: float | None = None, products: Products = XLA, idx_BTk: Array | None = None,
              idx_BGTk: Array | None = None, unit: int = 1) -> Array:
  """softmax(cap(scale · q kᵀ)) v over the selected key blocks only (module docstring).

  q (B,T,H,K), k (B,S,G,K) (one head is broadcast), v (B,S,G,V); blocks_BHTN at
  block_k's granularity. The selection is data, without gradient. idx_BGTk (B, 1|G, T, k): the
  choice as distinct token indices (the pooled selections'), run on attn.kernel.tokens with at least
  TOKENS_MIN_SHARE query heads a kv head or when blocks_BHTN is None; unit > 1: each index names
  unit contiguous keys from unit·i (attn.kernel.tokens).
  """
  B, T, H, K = q_BTHK.shape
  S, G = k_BSGK.shape[1], v_BSGV.shape[2]
  if idx_BTk is not None and idx_BGTk is None and (blocks_BHTN is None or blocks_BHTN.shape[1] == 1):
    idx_BGTk = idx_BTk[:, None]  # the indexer's own bits: one choice for every head
  if idx_BGTk is not None and (H // G >= TOKENS_MIN_SHARE or blocks_BHTN is None):  # on the token kernel
    return tokens.attention(q_BTHK, k_BSGK, v_BSGV, idx_BGTk, scale=scale, is_causal=is_causal,
                            kv_lengths=kv_lengths, softcap=softcap, unique=True, unit=unit)
  if k_BSGK.shape[2] != G:
    k_BSGK = jnp.broadcast_to(k_BSGK, (B, S, G, K))
  N = -(-S // block_k)
  if blocks_BHTN.shape[-1] != N or blocks_BHTN.shape[1] not in (1, H):
    raise ValueError(f"blocks_BHTN {blocks_BHTN.shape}: want (B, 1 or H={H}, T={T}, N={N})")
  bq, _ = block_sizes(T, S, block_q if block_q is not None else min(BLOCK_Q, T), None)
  nq = -(-T // bq)
  plan = Plan(T=T, S=S, bq=bq, bk=block_k, is_causal=bool(is_causal), scale=float(scale),
              softcap=None if softcap is None else float(softcap), products=products)
  sp = SparsePlan(plan, blocks_BHTN.shape[1], bits_BTW is not None)
  Tp, Sp = nq * bq, N * block_k
  limit_B = jnp.full((B,), S, jnp.int32)
  if kv_lengths is not None:
    limit_B = jnp.minimum(jnp.asarray(kv_lengths).astype(jnp.int32), S)
  blocks = _pad(lax.stop_gradient(blocks_BHTN).astype(bool), 2, Tp)
  bits = None if bits_BTW is None else _pad(lax.stop_gradient(bits_BTW), 1, Tp)
  out = _core(sp, _pad(q_BTHK, 1, Tp), _pad(k_BSGK, 1, Sp), _pad(v_BSGV, 1, Sp), limit_B,
              blocks, bits)
  return out[:, :T]


def visits(blocks_BHTN: Array, T: int, block_q: int | None = None) -> int:
  """Key blocks the forward pass visits in all (per batch element at most; the largest batch count)."""
  bq, _ = block_sizes(T, T, block_q if block_q is not None else min(BLOCK_Q, T), None)
  nq = -(-T // bq)
  _, count = _lists(_pad(blocks_BHTN.astype(bool), 2, nq * bq), bq, nq)
  return int(count.max(0).sum())
