"""Singular values, numerical rank and effective rank of a matrix or a stack of matrices.

Every function takes m (..., M, N) (one matrix, or a stack such as the (H,D,D)
circuits) and works under jit and vmap. Numerical rank counts the singular
values σ_i > max(M, N)·eps(dtype)·σ_max, the tolerance of numpy.linalg.matrix_rank
(eps of the input's float dtype: 1.19e-7 for float32). Effective rank is
exp(−Σ p_i log p_i) with p = σ/‖σ‖₁ (Roy & Vetterli 2007): r for r equal
nonzero singular values, and between 1 and the rank otherwise; 0 for a zero matrix.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attn.config import invalid

Array = jax.Array


def _as_float(name: str, m) -> Array:
  m = jnp.asarray(m)
  if m.ndim < 2:
    raise invalid(f"{name}.shape", tuple(m.shape),
                  "rank ≥ 2: a matrix (M, N) or a stack (..., M, N)")
  return m if jnp.issubdtype(m.dtype, jnp.floating) else m.astype(jnp.float32)


def _effective_rank(s: Array) -> Array:
  """exp of the entropy of σ/‖σ‖₁ over the last axis; 0 where every σ is 0."""
  total = s.sum(-1, keepdims=True)
  p = s / jnp.where(total > 0, total, 1.0)
  entropy = -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0), axis=-1)
  return jnp.where(total[..., 0] > 0, jnp.exp(entropy), 0.0)


def _summary(s: Array, M: int, N: int, dtype) -> dict[str, Array]:
  tol = max(M, N) * jnp.finfo(dtype).eps * s[..., :1]
  return {"singular_values": s, "rank": jnp.sum(s > tol, axis=-1),
          "effective_rank": _effective_rank(s)}


def spectrum(m) -> dict[str, Array]:
  """{"singular_values" (..., min(M,N)) descending, "rank" (...), "effective_rank" (...)} of m."""
  m = _as_float("m", m)
  s = jnp.linalg.svd(m, compute_uv=False)
  return _summary(s, m.shape[-2], m.shape[-1], m.dtype)


def spectrum_of_product(a, b) -> dict[str, Array]:
  """spectrum(a·bᵀ) for a (..., M, K), b (..., N, K) without forming the M×N product.

  a = Q_A R_A and b = Q_B R_B (reduced QR, Q with orthonormal columns), so
  a·bᵀ = Q_A (R_A R_Bᵀ) Q_Bᵀ has the singular values of the small R_A R_Bᵀ:
  a K×K SVD instead of an M×N one. Padded with zeros to min(M, N) values.
  """
  a, b = _as_float("a", a), _as_float("b", b)
  if a.shape[-1] != b.shape[-1] or a.shape[:-2] != b.shape[:-2]:
    raise invalid("b.shape", tuple(b.shape),
                  f"(..., N, K) with the leading axes and K of a.shape={tuple(a.shape)}")
  dtype = jnp.result_type(a, b)
  M, N = a.shape[-2], b.shape[-2]
  r_a = jnp.linalg.qr(a.astype(dtype), mode="r")
  r_b = jnp.linalg.qr(b.astype(dtype), mode="r")
  core = jnp.matmul(r_a, jnp.swapaxes(r_b, -1, -2), precision=jax.lax.Precision.HIGHEST)
  s = jnp.linalg.svd(core, compute_uv=False)
  pad = min(M, N) - s.shape[-1]
  s = jnp.pad(s, [(0, 0)] * (s.ndim - 1) + [(0, pad)])
  return _summary(s, M, N, dtype)


def effective_rank(m) -> Array:
  """Roy & Vetterli's effective rank exp(H(σ/‖σ‖₁)) of m (..., M, N): one value per matrix."""
  return spectrum(m)["effective_rank"]
