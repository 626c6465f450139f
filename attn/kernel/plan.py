"""Blocked attention's plan: block sizes, the slab path for windows, and the blocks each pass visits.

attn.kernel.blocked computes; this module decides the static shape of a call (Plan)
and answers, without tracing, which blocks or slabs a pass visits (for the
tests and attn bench --account). Positions are bottom-right aligned: query t
sits at t + S - T.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from attn.kernel.products import XLA, Products


# Target block sizes, measured on a 2-core Zen 3 CPU (experiments/performance.md,
# Long sequences): 512 queries × 256 keys ran the core's forward+backward at
# T = 4096 in 0.65× the time of 256 × 256 (256 × 512 alike), whose batched
# block matmuls XLA runs slowly here. The actual blocks split T and S into
# equal parts no larger.
BLOCK_Q = 512
BLOCK_K = 256

# A window w takes the slab path: query blocks of SLAB_Q, each against one slab
# of SLAB_Q + w keys (2w without a causal mask), where the loop over 512 × 256
# blocks visits 3 key blocks per query block (experiments/performance.md,
# Sliding windows). Slabs wider than SLAB_MAX keys take the loop.
SLAB_Q = 128
SLAB_MAX = 1024


def block_sizes(T: int, S: int, block_q: int | None = None,
                block_k: int | None = None) -> tuple[int, int]:
  """(block_q, block_k) for T queries and S keys: the given sizes (at most T, S) or equal splits."""
  def pick(n, given, target):
    if given is not None:
      return min(given, n)
    parts = -(-n // target)
    return -(-n // parts)
  return pick(T, block_q, BLOCK_Q), pick(S, block_k, BLOCK_K)


@dataclasses.dataclass(frozen=True)
class Plan:
  """The static shape of one blocked call: lengths, block sizes, causality, scale."""

  T: int
  S: int
  bq: int
  bk: int
  is_causal: bool
  scale: float
  key_limit: bool = True  # compare keys with limit_B (kv_lengths given, or S padded)
  window: int | None = None  # at most max(T, S): wider is the same mask
  softcap: float | None = None
  slab: int = 0  # > 0: each query block sees this many keys from slab_start, in one step
  probability: str = "softmax"
  products: Products = XLA  # the block matmuls: XLA's dots or oneDNN's (attn.kernel.products)
  cm: int = 0  # > 0: compressed keys follow, entry n pooling the tokens before (n + 1)·cm
  N: int = 0  # compressed entries (unpadded)
  bc: int = 0  # compressed entries a block

  @property
  def nc(self) -> int:
    return -(-self.N // self.bc) if self.cm else 0

  @property
  def nq(self) -> int:
    return -(-self.T // self.bq)

  @property
  def nk(self) -> int:
    return -(-self.S // self.bk)


def slab_start(plan: Plan, i):
  """First key of query block i's slab: its window's first position, clamped to the padded keys."""
  start = i * plan.bq + plan.S - plan.T - plan.window + 1
  return jnp.clip(start, 0, plan.nk * plan.bk - plan.slab)


def key_blocks_for(plan: Plan, i, key_end):
  """Key blocks [lo, hi) that query block i may see: window, causal diagonal, longest kv length."""
  # Positions: query t sits at t + S - T; the block's real queries span [p0, p1].
  shift = plan.S - plan.T
  p0 = i * plan.bq + shift
  p1 = jnp.minimum((i + 1) * plan.bq, plan.T) - 1 + shift
  lo, hi = 0, (key_end + plan.bk - 1) // plan.bk
  if plan.is_causal:  # s <= p
    hi = jnp.minimum(hi, jnp.clip(p1 // plan.bk + 1, 0, plan.nk))
  if plan.window is not None:  # p - w < s < p + w
    lo = jnp.clip((p0 - plan.window + 1) // plan.bk, 0, plan.nk)
    hi = jnp.minimum(hi, jnp.clip((p1 + plan.window - 1) // plan.bk + 1, 0, plan.nk))
  return lo, jnp.maximum(lo, hi)


def query_blocks_for(plan: Plan, j):
  """Query blocks [lo, hi) that may see key block j: causal diagonal and window."""
  # Key block j's real keys span [s0, s1]; query t sits at position t + S - T.
  shift = plan.S - plan.T
  s0, s1 = j * plan.bk, jnp.minimum((j + 1) * plan.bk, plan.S) - 1
  lo, hi = 0, plan.nq
  if plan.is_causal:  # p >= s
    lo = jnp.clip((s0 - shift) // plan.bq, 0, plan.nq)
  if plan.window is not None:  # s - w < p < s + w
    lo = jnp.maximum(lo, jnp.clip((s0 - plan.window + 1 - shift) // plan.bq, 0, plan.nq))
    hi = jnp.clip((s1 + plan.window - 1 - shift) // plan.bq + 1, 0, plan.nq)
  return lo, jnp.maximum(lo, hi)


def comp_blocks_for(plan: Plan, i, key_end):
  """Compressed blocks [0, hi) that query block i may see: entries ending by its last query (causal)
  and by the longest kv length."""
  p1 = jnp.minimum((i + 1) * plan.bq, plan.T) - 1 + plan.S - plan.T
  n_hi = jnp.minimum(key_end // plan.cm, plan.N)
  if plan.is_causal:  # entry n ends at (n + 1)·cm - 1 <= p
    n_hi = jnp.minimum(n_hi, jnp.maximum((p1 + 1) // plan.cm, 0))
  return 0, (n_hi + plan.bc - 1) // plan.bc


def comp_query_blocks_for(plan: Plan, j):
  """Query blocks [lo, nq) that may see compressed block j (causal: from the first query its first
  entry has ended for)."""
  if not plan.is_causal:
    return 0, plan.nq
  t = (j * plan.bc + 1) * plan.cm - 1 - (plan.S - plan.T)
  return jnp.clip(t // plan.bq, 0, plan.nq), plan.nq


def plan_for(T: int, S: int, block_q: int | None, block_k: int | None, *, is_causal: bool,
             window: int | None, scale: float = 1.0, softcap: float | None = None,
             has_lengths: bool = False, probability: str = "softmax") -> Plan:
  """The static plan of one call: block sizes, or the slab path for a window that fits; masks."""
  window = None if window is None else min(window, max(T, S))
  slab, bq_slab = 0, block_q if block_q is not None else min(SLAB_Q, T)
  if window is not None and probability == "softmax":  # queries [t, t + bq) see (t - w, t + bq + w)
    slab = bq_slab + (window if is_causal else 2 * window)
    slab = slab if slab <= min(S, SLAB_MAX) else 0
  bq, bk = block_sizes(T, S, bq_slab if slab else block_q, block_k)
  return Plan(T=T, S=S, bq=bq, bk=bk, is_causal=bool(is_causal), scale=float(scale),
              key_limit=has_lengths or S % bk > 0, window=window,
              softcap=None if softcap is None else float(softcap), slab=slab,
              probability=probability)


def key_block_ranges(T: int, S: int, *, is_causal: bool = False, window: int | None = None,
                     block_q: int | None = None, block_k: int | None = None
                     ) -> list[tuple[int, int]]:
  """Per query block, the key blocks [lo, hi) the block loop visits (no kv_lengths; a window whose
  slab fits takes the slab path instead: block_steps)."""
  plan = plan_for(T, S, block_q, block_k, is_causal=is_causal, window=window)
  return [tuple(int(x) for x in key_blocks_for(plan, i, S)) for i in range(plan.nq)]


def query_block_ranges(T: int, S: int, *, is_causal: bool = False, window: int | None = None,
                       block_q: int | None = None, block_k: int | None = None
                       ) -> list[tuple[int, int]]:
  """Per key block, the query blocks [lo, hi) the block loop's backward pass visits (no kv_lengths)."""
  plan = plan_for(T, S, block_q, block_k, is_causal=is_causal, window=window)
  return [tuple(int(x) for x in query_blocks_for(plan, j)) for j in range(plan.nk)]


def block_steps(T: int, S: int, *, is_causal: bool = False, window: int | None = None,
                block_q: int | None = None, block_k: int | None = None) -> tuple[int, int]:
  """(steps, loop depth) of one pass: visited block pairs two loops deep, or slabs one loop deep."""
  plan = plan_for(T, S, block_q, block_k, is_causal=is_causal, window=window)
  if plan.slab:
    return plan.nq, 1
  return sum(int(hi - lo) for lo, hi in (key_blocks_for(plan, i, S) for i in range(plan.nq))), 2


def work_fraction(T: int, S: int, *, is_causal: bool, window: int | None = None,
                  block_q: int | None = None, block_k: int | None = None) -> float:
  """The share of the padded T×S scores the forward pass computes (1.0: no causal mask, no window)."""
  plan = plan_for(T, S, block_q, block_k, is_causal=is_causal, window=window)
  steps, depth = block_steps(T, S, is_causal=is_causal, window=window, block_q=block_q,
                             block_k=block_k)
  if depth == 1:  # slabs
    return plan.slab / (plan.nk * plan.bk)
  return steps / (plan.nq * plan.nk)


__all__ = ["BLOCK_K", "BLOCK_Q", "SLAB_MAX", "SLAB_Q", "Plan", "block_sizes", "block_steps",
           "comp_blocks_for", "comp_query_blocks_for", "key_block_ranges", "key_blocks_for", "plan_for", "query_block_ranges", "query_blocks_for",
           "slab_start", "work_fraction"]
