"""Rotary position embeddings (RoPE, Su et al. 2021) at the head level.

The first rope_dim dims of a query or key head rotate by position p: dim i
pairs with dim i + rope_dim/2 (the half-split convention of GPT-NeoX and
Hugging Face's rotate_half, not the interleaved pairs (2i, 2i+1) of the
paper), and pair i turns by the angle p·ω_i, ω_i = rope_theta^(-2i/rope_dim).
The remaining d_k − rope_dim dims are left as they are. A query at t and a key
at s then score (q R(t))·(k R(s)) = q R(t − s) kᵀ (row vectors): only t − s matters.

Frequency scaling (HeadConfig.rope_scaling, for contexts longer than the
training one; the rope_type names and rules of Hugging Face transformers'
modeling_rope_utils):
  "linear"  ω_i / rope_factor for every i: position interpolation (Chen et
            al. 2023), the angle of position p/factor.
  "llama3"  Meta's Llama 3.1 rule. With L = rope_original_max_len and the
            wavelength λ_i = 2π/ω_i: λ_i > L/low_freq_factor (slow pairs;
            with low = 1 those that never turned once within the training
            length) get ω_i / factor; λ_i < L/high_freq_factor (fast pairs)
            keep ω_i; between, s = (L/λ_i − low)/(high − low) ∈ [0, 1] mixes
            the two, (1 − s)·ω_i/factor + s·ω_i. Clipping s to [0, 1] gives
            all three bands in one expression, continuous at both ends.
  "yarn"    YaRN (Peng et al. 2023; transformers' _compute_yarn_parameters).
            Pair i turns r_i = L·ω_i/2π times within L; the pairs with
            r_i > beta_fast keep ω_i, those with r_i < beta_slow get
            ω_i/factor, and a linear ramp in i mixes the two between (the
            band's ends, in dims, rounded outward when rope_truncate).
linear and llama3 leave the scores alone (transformers' attention_factor is
1.0 for both); yarn multiplies the rotated dims of every query and key by
`attention_factor(cfg)` (transformers scales cos and sin), so the rotated
part of each score by its square: a softmax temperature.
`frequencies(cfg)` is the one place the ω_i are computed: every rotation here,
and mla's and tpa's through `rotate`, reads them from the HeadConfig.

Layouts (cfg.rope_layout): "half" pairs dim i with i + rope_dim/2
(rotate_half); "interleaved" pairs 2i with 2i + 1 (the paper's, and how
DeepSeek stores its RoPE dims). Either way only the first rope_dim dims turn; "none" turns
nothing (every ω_i is 0: Kimi Linear's MLA, whose decoupled key carries no position).

Seed question 4 with RoPE: the score x W_Q R(t − s) W_Kᵀ c has no single
position-free W_h; `position_free_fit` gives the best one in least squares and
its relative error.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from attn.config import HeadConfig

Array = jax.Array


def frequencies(cfg: HeadConfig) -> np.ndarray:
  """ω_i of the rope_dim/2 pairs, float64: rope_theta^(-2i/rope_dim), scaled by cfg.rope_scaling."""
  r = cfg.rope_dim
  if cfg.rope_layout == "none":  # nothing turns
    return np.zeros(r // 2)
  omega = cfg.rope_theta ** (-np.arange(0, r, 2, dtype=np.float64) / r) if r else np.zeros(0)
  if cfg.rope_scaling == "linear":
    return omega / cfg.rope_factor
  if cfg.rope_scaling == "llama3":
    lo, hi = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    ratio = cfg.rope_original_max_len * omega / (2 * np.pi)  # L / λ_i
    s = np.clip((ratio - lo) / (hi - lo), 0.0, 1.0)  # 0: divided, 1: kept
    return (1 - s) * omega / cfg.rope_factor + s * omega
  if cfg.rope_scaling == "yarn":
    lo, hi = _yarn_band(cfg)
    keep = 1.0 - np.clip((np.arange(r // 2) - lo) / ((hi + 0.001 if hi == lo else hi) - lo), 0.0, 1.0)
    return omega / cfg.rope_factor * (1 - keep) + omega * keep
  return omega


def _yarn_band(cfg: HeadConfig) -> tuple[float, float]:
  """YaRN's correction range (low, high) in dims: where the pairs turn beta_fast, beta_slow times in L."""
  r, base, L = cfg.rope_dim, cfg.rope_theta, cfg.rope_original_max_len

  def dim(turns):  # the dim index whose pair turns `turns` times within L
    return r * math.log(L / (turns * 2 * math.pi)) / (2 * math.log(base))

  lo, hi = dim(cfg.rope_beta_fast), dim(cfg.rope_beta_slow)
  if cfg.rope_truncate:
    lo, hi = math.floor(lo), math.ceil(hi)
  return max(lo, 0), min(hi, r - 1)


def attention_factor(cfg: HeadConfig) -> float:
  """What yarn multiplies the rotated query and key dims by: rope_attention_factor, else
  0.1·ln(rope_factor) + 1 (1 for factor ≤ 1); 1.0 for every other scaling."""
  if cfg.rope_scaling != "yarn":
    return 1.0
  if cfg.rope_attention_factor is not None:
    return float(cfg.rope_attention_factor)
  return 1.0 if cfg.rope_factor <= 1 else 0.1 * math.log(cfg.rope_factor) + 1.0


def pair_indices(cfg: HeadConfig) -> tuple[np.ndarray, np.ndarray]:
  """(first, second) dims of each rotated pair: (i, i + rope_dim/2) half, (2i, 2i + 1) interleaved."""
  half = cfg.rope_dim // 2
  i = np.arange(half)
  return (2 * i, 2 * i + 1) if cfg.rope_layout == "interleaved" else (i, i + half)


def rotate(x_BTNK: Array, positions, cfg: HeadConfig) -> Array:
  """x with its first cfg.rope_dim dims rotated by position; positions (T,) or (B,T) integers.

  x is (B,T,N,K) (N heads) or (B,T,K), K >= rope_dim; the angles are computed
  in float32 from `frequencies(cfg)`, the rotated dims are multiplied by
  `attention_factor(cfg)`, and the result has x's dtype.
  """
  rope_dim = cfg.rope_dim
  if rope_dim == 0 or cfg.rope_layout == "none":
    return x_BTNK
  heads = x_BTNK.ndim == 4
  half = rope_dim // 2
  pos_BT = jnp.asarray(positions)
  pos_BT = pos_BT[None] if pos_BT.ndim == 1 else pos_BT
  omega = jnp.asarray(frequencies(cfg), jnp.float32)
  angle_BTP = pos_BT.astype(jnp.float32)[..., None] * omega
  if heads:
    angle_BTP = angle_BTP[:, :, None, :]
  factor = attention_factor(cfg)
  cos, sin = factor * jnp.cos(angle_BTP), factor * jnp.sin(angle_BTP)
  x = x_BTNK.astype(jnp.float32)
  rest = x[..., rope_dim:]
  if cfg.rope_layout == "interleaved":
    pairs = x[..., :rope_dim].reshape(*x.shape[:-1], half, 2)
    x1, x2 = pairs[..., 0], pairs[..., 1]
    turned = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    out = jnp.concatenate([turned.reshape(*x.shape[:-1], rope_dim), rest], axis=-1)
  else:
    x1, x2 = x[..., :half], x[..., half:rope_dim]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)
  return out.astype(x_BTNK.dtype)


def qk_positions(positions, T: int, S: int, cross: bool):
  """(query positions, key positions): given or 0..T−1; keys the same, or 0..S−1 if cross."""
  q_pos = jnp.arange(T) if positions is None else jnp.asarray(positions)
  return q_pos, (jnp.arange(S) if cross else q_pos)


def rotate_qk(q_BTHK: Array, k_BSGK: Array, cfg: HeadConfig, qk_positions=None):
  """q and k with RoPE applied to every head (cfg.rope_dim = 0: unchanged).

  qk_positions None means queries at 0..T−1 and keys at 0..S−1.
  """
  if cfg.rope_dim == 0:
    return q_BTHK, k_BSGK
  if qk_positions is None:
    qk_positions = (jnp.arange(q_BTHK.shape[1]), jnp.arange(k_BSGK.shape[1]))
  q_pos, k_pos = qk_positions
  return rotate(q_BTHK, q_pos, cfg), rotate(k_BSGK, k_pos, cfg)


def rotation_matrices(offsets, cfg: HeadConfig) -> np.ndarray:
  """R(δ) (len(offsets), d_k, d_k) in float64: k ↦ rotate(k, δ, cfg) as a matrix acting on row vectors."""
  out = np.tile(np.eye(cfg.d_k), (len(offsets), 1, 1))
  angle = np.asarray(offsets, np.float64)[:, None] * frequencies(cfg)
  f = attention_factor(cfg)
  c, s = f * np.cos(angle), f * np.sin(angle)
  i, j = pair_indices(cfg)
  # Row vector k times R: (k R)[i] = k_i cos − k_j sin, (k R)[j] = k_j cos + k_i sin.
  out[:, i, i] = c
  out[:, j, i] = -s
  out[:, i, j] = s
  out[:, j, j] = c
  return out


def position_free_fit(w_q_DHK, w_k_DGK, cfg: HeadConfig, length: int, causal: bool = True):
  """The best position-free W_h for a RoPE layer, and its relative error.

  Query head h at t scores key s through M_h(Δ) = W_Q,h R(Δ) W_K,gᵀ, Δ = t − s
  (biases left out). Over the pairs of a length-`length` sequence (causal:
  every s <= t, so Δ = d occurs length − d times; else every pair), the
  W_h minimising Σ_pairs ‖M_h(Δ) − W_h‖²_F is the weighted mean of M_h(Δ); with
  isotropic inputs x, c it is also the least-squares fit of the scores
  themselves. Returns (W (H,D,D), relative error sqrt(Σ‖M − W‖² / Σ‖M‖²) over
  all heads and pairs), in float64.
  """
  w_q = np.asarray(w_q_DHK, np.float64)
  w_k = np.repeat(np.asarray(w_k_DGK, np.float64), cfg.group_size, axis=1)
  if cfg.rope_dim == 0:
    return np.einsum("DHK,EHK->HDE", w_q, w_k), 0.0
  d = np.arange(length)
  offsets = d if causal else np.concatenate([-d[:0:-1], d])
  weights = (length - np.abs(offsets)).astype(np.float64)
  weights /= weights.sum()
  R_NKK = rotation_matrices(offsets, cfg)
  R_bar = np.einsum("N,NKL->KL", weights, R_NKK)
  # ‖W_Q R W_Kᵀ‖² = tr(Gq R Gk Rᵀ) with the K×K Gram matrices Gq = W_QᵀW_Q, Gk = W_KᵀW_K;
  # E‖M − M̄‖² = E‖M‖² − ‖M̄‖² since M is linear in R.
  Gq_HKK = np.einsum("DHK,DHL->HKL", w_q, w_q)
  Gk_HKK = np.einsum("DHK,DHL->HKL", w_k, w_k)
  second = 0.0
  for i in range(0, len(offsets), 64):  # R Gk Rᵀ for 64 offsets at a time, as batched matmuls
    R = R_NKK[i:i + 64, None]
    second += np.einsum("N,NHKL,HKL->", weights[i:i + 64], R @ Gk_HKK @ np.swapaxes(R, -1, -2),
                        Gq_HKK)
  first = np.sum(Gq_HKK * (R_bar @ Gk_HKK @ R_bar.T))
  w_HDD = np.einsum("DHK,KL,EHL->HDE", w_q, R_bar, w_k)
  return w_HDD, float(np.sqrt(max(second - first, 0.0) / second))
