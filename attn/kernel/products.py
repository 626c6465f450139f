"""The matmul backend of the attention core: XLA's dots, or oneDNN's products.

One object serves both structures that compute the core: the einsum kernel
(attn.kernel.dense) takes its scores q·kᵀ and its weighted sum p·v from it, and
the blocked kernel (attn.kernel.blocked) its block products. An implementation
in attn.kernel.impls runs a structure with one of these objects.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from attn.kernel import onednn

Array = jax.Array


def _group_queries(q_BTHK: Array, G: int) -> Array:
  """(B,T,H,K) -> (B,G,M,K) with M = R·T: the queries of a kv group's R heads, stacked.

  One batched matmul per (batch, kv group) then serves every head of the group;
  the result reshapes to (B,H,T,S) for free. This layout (rather than
  (B,T,G,R,K)) is the one the CPU matmul runs fastest on (experiments/performance.md).
  """
  B, T, H, K = q_BTHK.shape
  q_BTGRK = q_BTHK.reshape(B, T, G, H // G, K)
  return q_BTGRK.transpose(0, 2, 3, 1, 4).reshape(B, G, (H // G) * T, K)


def scores(q_BTHK: Array, k_BSGK: Array) -> Array:
  """Raw logits q·k in float32, (B,H,T,S), with G key heads shared by H query heads.

  A key with one head (G = 1: merged's raw context, collaborative's shared key)
  meets all H query heads in one batched matmul per batch element, M = H·T rows.
  """
  B, T, H, K = q_BTHK.shape
  S, G = k_BSGK.shape[1], k_BSGK.shape[2]
  q_BGMK = _group_queries(q_BTHK, G)
  k_BGSK = k_BSGK.transpose(0, 2, 1, 3)
  logits_BGMS = jnp.einsum("BGMK,BGSK->BGMS", q_BGMK, k_BGSK,
                           preferred_element_type=jnp.float32)
  return logits_BGMS.reshape(B, H, T, S)


def weighted_sum(probs_BHTS: Array, v_BSGV: Array) -> Array:
  """Mixes values with the attention weights: (B,T,H,V) in v's dtype."""
  B, H, T, S = probs_BHTS.shape
  G, V = v_BSGV.shape[2], v_BSGV.shape[3]
  probs_BGMS = probs_BHTS.reshape(B, G, (H // G) * T, S).astype(v_BSGV.dtype)
  out_BGMV = jnp.einsum("BGMS,BGSV->BGMV", probs_BGMS, v_BSGV.transpose(0, 2, 1, 3))
  out_BGRTV = out_BGMV.reshape(B, G, H // G, T, V)
  return out_BGRTV.transpose(0, 3, 1, 2, 4).reshape(B, T, H, V)


def _xla_block(spec: str, a: Array, b: Array) -> Array:
  return jnp.einsum(spec, a, b)


def _onednn_block(spec: str, a: Array, b: Array) -> Array:
  lhs, rhs = spec.split("->")[0].split(",")
  c = onednn.bmm(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]), transb=rhs[-1] == lhs[-1])
  return c.reshape(*a.shape[:-2], *c.shape[-2:])


@dataclasses.dataclass(frozen=True)
class Products:
  """The core's three products. scores(q (B,T,H,K), k (B,S,G,K)) -> float32 (B,H,T,S);
  mix(p (B,H,T,S), v (B,S,G,V)) -> (B,T,H,V); block(spec, a, b): one float32 block
  matmul "...MK,...KN->...MN" or "...MK,...NK->...MN" of the blocked kernel."""

  name: str
  scores: Callable[[Array, Array], Array]
  mix: Callable[[Array, Array], Array]
  block: Callable[[str, Array, Array], Array]
  float32_only: bool = False  # mix then needs float32 weights and values


XLA = Products("xla", scores, weighted_sum, _xla_block)
ONEDNN = Products("onednn", onednn.nt, onednn.nn, _onednn_block, float32_only=True)
