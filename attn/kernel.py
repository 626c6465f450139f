"""Pure attention core: scores, masks, float32 softmax, weighted sum.

No parameters. Grouped heads: query head h reads key/value head h // R with
R = H // G. Masks are boolean, True where a query may attend a key, and
broadcast to (B,H,T,S). A fully masked row gives zero weights and zero output.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from attn.config import check_mask, invalid

Array = jax.Array


def _check_qkv(q_BTHK, k_BSGK, v_BSGV) -> None:
  for name, a in (("q", q_BTHK), ("k", k_BSGK), ("v", v_BSGV)):
    if getattr(a, "ndim", None) != 4:
      raise invalid(f"{name}.shape", getattr(a, "shape", None), "rank 4")
  B, T, H, K = q_BTHK.shape
  Bk, S, G, Kk = k_BSGK.shape
  if Bk != B or Kk != K:
    raise invalid("k.shape", k_BSGK.shape, f"(B={B}, S, G, K={K}) to match q {q_BTHK.shape}")
  if H % G:
    raise invalid("k.shape[2]", G, f"a divisor of the query heads H={H}")
  if v_BSGV.shape[:3] != (B, S, G):
    raise invalid("v.shape", v_BSGV.shape, f"(B={B}, S={S}, G={G}, V) to match k")


def _group_queries(q_BTHK: Array, G: int) -> Array:
  """(B,T,H,K) -> (B,G,M,K) with M = R·T: the queries of a kv group's R heads, stacked.

  One batched matmul per (batch, kv group) then serves every head of the group;
  the result reshapes to (B,H,T,S) for free. This layout (rather than
  (B,T,G,R,K)) is the one the CPU matmul runs fastest on (README, Performance).
  """
  B, T, H, K = q_BTHK.shape
  q_BTGRK = q_BTHK.reshape(B, T, G, H // G, K)
  return q_BTGRK.transpose(0, 2, 3, 1, 4).reshape(B, G, (H // G) * T, K)


def scores(q_BTHK: Array, k_BSGK: Array) -> Array:
  """Raw logits q·k in float32, (B,H,T,S), with G key/value heads shared by H query heads."""
  B, T, H, K = q_BTHK.shape
  S, G = k_BSGK.shape[1], k_BSGK.shape[2]
  q_BGMK = _group_queries(q_BTHK, G)
  k_BGSK = k_BSGK.transpose(0, 2, 1, 3)
  logits_BGMS = jnp.einsum("BGMK,BGSK->BGMS", q_BGMK, k_BGSK,
                           preferred_element_type=jnp.float32)
  return logits_BGMS.reshape(B, H, T, S)


def masked_softmax(logits_BHTS: Array, mask: Array | None = None) -> Array:
  """Softmax over S in float32; masked entries and fully masked rows get weight 0."""
  logits_BHTS = logits_BHTS.astype(jnp.float32)
  if mask is None:
    return jax.nn.softmax(logits_BHTS, axis=-1)
  mask = jnp.broadcast_to(mask, logits_BHTS.shape)
  # A finite fill (not -inf) keeps a fully masked row finite: its softmax is
  # uniform, and the final where() zeroes it, in value and in gradient.
  logits_BHTS = jnp.where(mask, logits_BHTS, jnp.finfo(jnp.float32).min)
  return jnp.where(mask, jax.nn.softmax(logits_BHTS, axis=-1), 0.0)


def weighted_sum(probs_BHTS: Array, v_BSGV: Array) -> Array:
  """Mixes values with the attention weights: (B,T,H,V) in v's dtype."""
  B, H, T, S = probs_BHTS.shape
  G, V = v_BSGV.shape[2], v_BSGV.shape[3]
  probs_BGMS = probs_BHTS.reshape(B, G, (H // G) * T, S).astype(v_BSGV.dtype)
  out_BGMV = jnp.einsum("BGMS,BGSV->BGMV", probs_BGMS, v_BSGV.transpose(0, 2, 1, 3))
  out_BGRTV = out_BGMV.reshape(B, G, H // G, T, V)
  return out_BGRTV.transpose(0, 3, 1, 2, 4).reshape(B, T, H, V)


IMPLS = ("auto", "einsum", "xla", "cudnn")


def best_impl(q_BTHK: Array, k_BSGK: Array, v_BSGV: Array, *, return_weights: bool = False,
              logits_bias: Array | None = None) -> str:
  """"cudnn" on a GPU for half-precision heads it supports (d_v = d_k, no weights out); else "einsum"."""
  K, V = q_BTHK.shape[-1], v_BSGV.shape[-1]
  fits_cudnn = (K == V and K % 8 == 0 and K <= 128 and not return_weights
                and logits_bias is None
                and q_BTHK.dtype in (jnp.bfloat16, jnp.float16)
                and q_BTHK.dtype == k_BSGK.dtype == v_BSGV.dtype)
  return "cudnn" if fits_cudnn and jax.default_backend() == "gpu" else "einsum"


def _dot_product_attention(q_BTHK, k_BSGK, v_BSGV, mask, scale, logits_bias, impl):
  """The same function through jax.nn.dot_product_attention ("xla" or "cudnn")."""
  out_BTHV = jax.nn.dot_product_attention(
      q_BTHK, k_BSGK, v_BSGV, bias=logits_bias, mask=mask, scale=scale,
      implementation=impl)
  if mask is None:
    return out_BTHV
  # jax gives a fully masked row uniform weights; attn's contract is zeros.
  B, T, H, _ = q_BTHK.shape
  has_key_BHT = jnp.broadcast_to(mask, (B, H, T, k_BSGK.shape[1])).any(-1)
  return jnp.where(has_key_BHT.transpose(0, 2, 1)[..., None], out_BTHV, 0).astype(out_BTHV.dtype)


def attention(
    q_BTHK: Array,
    k_BSGK: Array,
    v_BSGV: Array,
    mask: Array | None = None,
    *,
    scale: float | None = None,
    logits_bias: Array | None = None,
    return_weights: bool = False,
    impl: str = "einsum",
) -> Array | tuple[Array, Array]:
  """softmax(scale · q kᵀ + logits_bias, masked) v for already projected heads.

  q (B,T,H,K), k (B,S,G,K), v (B,S,G,V) with H a multiple of G. scale defaults
  to 1/sqrt(K). logits_bias, if given, is added to the scaled logits and must
  broadcast to (B,H,T,S). Returns (B,T,H,V), and the weights (B,H,T,S) in
  float32 when return_weights is set. impl picks the implementation of the
  same function: "einsum" (this module, the default), "xla" or "cudnn"
  (jax.nn.dot_product_attention; need d_v = d_k and no weights out), or
  "auto" (best_impl: cuDNN flash attention on a GPU where it applies).
  """
  _check_qkv(q_BTHK, k_BSGK, v_BSGV)
  B, T, H, K = q_BTHK.shape
  S = k_BSGK.shape[1]
  if mask is not None:
    check_mask(mask, (B, H, T, S))
  if impl not in IMPLS:
    raise invalid("impl", impl, f"one of {IMPLS}")
  if scale is None:
    scale = 1.0 / math.sqrt(K)
  if impl == "auto":
    impl = best_impl(q_BTHK, k_BSGK, v_BSGV, return_weights=return_weights,
                     logits_bias=logits_bias)
  if impl != "einsum":
    if return_weights:
      raise invalid("impl", impl, '"einsum" or "auto" when return_weights=True')
    if v_BSGV.shape[-1] != K:
      raise invalid("impl", impl, f'"einsum" or "auto" when d_v={v_BSGV.shape[-1]} != d_k={K}')
    return _dot_product_attention(q_BTHK, k_BSGK, v_BSGV, mask, scale, logits_bias, impl)
  if q_BTHK.dtype == jnp.float32:
    # Scaling q (T·K values) rather than the logits (T·S) is the same product
    # up to rounding, and keeps XLA's CPU matmul fusion from materialising a
    # (B,H,T,S) array of the scale (README, Performance). In half precision
    # the scale stays on the float32 logits so q loses no bits.
    logits_BHTS = scores(q_BTHK * jnp.float32(scale), k_BSGK)
  else:
    logits_BHTS = scores(q_BTHK, k_BSGK) * scale
  if logits_bias is not None:
    logits_BHTS = logits_BHTS + logits_bias.astype(jnp.float32)
  probs_BHTS = masked_softmax(logits_BHTS, mask)
  out_BTHV = weighted_sum(probs_BHTS, v_BSGV).astype(q_BTHK.dtype)
  return (out_BTHV, probs_BHTS) if return_weights else out_BTHV


def reference_attention(q_BTHK, k_BSGK, v_BSGV, mask=None, *, scale=None):
  """A second, deliberately naive implementation (repeat kv heads, one head at a time) for tests."""
  B, T, H, K = q_BTHK.shape
  G = k_BSGK.shape[2]
  k_BSHK = jnp.repeat(k_BSGK, H // G, axis=2)
  v_BSHV = jnp.repeat(v_BSGV, H // G, axis=2)
  scale = 1.0 / math.sqrt(K) if scale is None else scale
  outs = []
  for h in range(H):
    logits_BTS = jnp.einsum("btk,bsk->bts", q_BTHK[:, :, h].astype(jnp.float32),
                            k_BSHK[:, :, h].astype(jnp.float32)) * scale
    if mask is not None:
      m = jnp.broadcast_to(mask, (B, H) + logits_BTS.shape[1:])[:, h]
      logits_BTS = jnp.where(m, logits_BTS, -jnp.inf)
      p = jnp.exp(logits_BTS - jnp.max(jnp.where(m, logits_BTS, -1e30), -1, keepdims=True))
      p = jnp.where(m, p, 0.0)
      denom = p.sum(-1, keepdims=True)
      p = jnp.where(denom > 0, p / jnp.where(denom > 0, denom, 1.0), 0.0)
    else:
      p = jax.nn.softmax(logits_BTS, axis=-1)
    outs.append(jnp.einsum("bts,bsv->btv", p, v_BSHV[:, :, h].astype(jnp.float32)))
  return jnp.stack(outs, axis=2)
