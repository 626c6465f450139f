"""The linear-attention core: one recurrence, a chunked form for training and a recurrent one.

Every head this package serves (gated_deltanet, kda, mamba2, linear, gla) keeps a state S of
d_k × d_v per value head and updates it token by token:

  S_t = diag(α_t)·S_{t−1} + k_t·δ_tᵀ,   o_t = S_tᵀ·q_t,   α_t = exp(g_t) ∈ (0, 1]

with the written value δ_t either β_t·v_t (plain: causal linear attention, GLA, Mamba-2's SSD
with k = B, v = Δ·x, g = Δ·A) or, under the delta rule, β_t·(v_t − k_tᵀ·diag(α_t)·S_{t−1}),
what the decayed state does not already predict (Yang et al. 2024, "Gated Delta Networks"). g is
None (no decay), one log-decay per value head (B,T,H) (Mamba-2, Gated DeltaNet) or one per key
channel (B,T,H,K) (Kimi Delta Attention, GLA). Queries and keys have G heads; value head h reads
query/key head h // (H/G) (grouped value heads: Qwen3-Next's 16 key heads against 32 value heads).

chunked(...) splits the sequence into chunks of `chunk` tokens and runs a lax.scan over them
carrying S, as MaxText's and fla's chunked kernels do. Inside a chunk of length C, with
γ_t = Σ_{s≤t} g_s (from the chunk's start) and S_0 the state it starts from,

  δ = (I + M)⁻¹·β⊙(V − (K⊙e^γ)·S_0),  M_ts = β_t·Σ_k k_tk·k_sk·e^{γ_tk − γ_sk} (s < t)
  o = (Q⊙e^γ)·S_0 + A·δ,               A_ts = Σ_k q_tk·k_sk·e^{γ_tk − γ_sk}      (s ≤ t)
  S_C = diag(e^{γ_C})·S_0 + (K⊙e^{γ_C − γ})ᵀ·δ

(the UT transform: one unit lower-triangular solve per chunk, by forward substitution; plain
heads skip it, δ = β⊙V).
Every exponent is a sum of log-decays over a forward span, so ≤ 0: nothing overflows, however
strong the decay. A per-key-channel decay materialises e^{γ_tk − γ_sk} as (C,C,K) per head and
chunk, so its chunk should stay small (fla uses sub-chunks of 16 for the same reason). The body
is rematerialised (jax.checkpoint): the backward pass keeps only the state at each chunk's start.

A length that is not a multiple of the chunk is padded with tokens that write nothing and do not
decay; kv_lengths (B,) does the same to each example's tokens s ≥ kv_lengths[b], so its later
queries read the state its last real token left (the structured mask of attn.apply, for a head
that has no keys to mask). All arithmetic is float32 whatever the inputs' dtype; outputs and
states are float32.

recurrent(...) is the same recurrence one token at a time (decoding; tests/test_linear_core.py
checks both against a per-token loop in numpy written apart).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attn.config import invalid

Array = jax.Array

_HI = jax.lax.Precision.HIGHEST


def _einsum(spec: str, *arrays) -> Array:
  return jnp.einsum(spec, *arrays, precision=_HI)


def check_chunk(chunk) -> int:
  """chunk: a positive integer, the tokens of one step of the scan."""
  if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
    raise invalid("chunk", chunk, "a positive integer: the tokens one step of the chunked scan "
                  "covers (64 in MaxText and fla)")
  return chunk


def _inputs(q_BTGK, k_BTGK, v_BTHV, g, beta_BTH, kv_lengths):
  """float32 q, k (repeated to the H value heads), v, g (B,T,H) or (B,T,H,K), β (B,T,H)."""
  B, T, G, K = q_BTGK.shape
  H = v_BTHV.shape[2]
  if k_BTGK.shape != q_BTGK.shape or v_BTHV.shape[:2] != (B, T) or H % G:
    raise invalid("k.shape, v.shape", (k_BTGK.shape, v_BTHV.shape),
                  f"k as q {q_BTGK.shape}, v (B={B}, T={T}, H, V) with H a multiple of G={G}")
  f32 = lambda a: a.astype(jnp.float32)
  q_BTHK = jnp.repeat(f32(q_BTGK), H // G, axis=2)
  k_BTHK = jnp.repeat(f32(k_BTGK), H // G, axis=2)
  g = jnp.zeros((B, T, H), jnp.float32) if g is None else f32(g)
  if g.shape not in ((B, T, H), (B, T, H, K)):
    raise invalid("g.shape", g.shape, f"(B,T,H)={(B, T, H)} or (B,T,H,K)={(B, T, H, K)}")
  beta_BTH = jnp.ones((B, T, H), jnp.float32) if beta_BTH is None else f32(beta_BTH)
  if kv_lengths is not None:  # tokens past an example's length write nothing and do not decay
    valid_BT = (jnp.arange(T)[None, :] < jnp.asarray(kv_lengths)[:, None]).astype(jnp.float32)
    k_BTHK = k_BTHK * valid_BT[:, :, None, None]
    beta_BTH = beta_BTH * valid_BT[:, :, None]
    g = g * valid_BT.reshape(B, T, *([1] * (g.ndim - 2)))
  return q_BTHK, k_BTHK, f32(v_BTHV), g, beta_BTH


def _state(state, B, H, K, V) -> Array:
  if state is None:
    return jnp.zeros((B, H, K, V), jnp.float32)
  if state.shape != (B, H, K, V):
    raise invalid("state.shape", state.shape, f"(B,H,K,V)={(B, H, K, V)}")
  return state.astype(jnp.float32)


def _unit_lower_solve(M_BHTS: Array, rhs_BHTV: Array) -> Array:
  """δ with (I + M)·δ = rhs, M strictly lower triangular: forward substitution, a row a step.

  Plain matmuls in a loop rather than LAPACK's triangular solve: XLA's CPU runtime deadlocked
  (multithreaded Eigen) running that custom call inside several concurrent scans of one program.
  """
  def row(t, d_BHTV):
    d_BHV = rhs_BHTV[:, :, t] - _einsum("BHS,BHSV->BHV", M_BHTS[:, :, t], d_BHTV)
    return d_BHTV.at[:, :, t].set(d_BHV)

  return jax.lax.fori_loop(0, M_BHTS.shape[-1], row, jnp.zeros_like(rhs_BHTV))


def chunked(q_BTGK: Array, k_BTGK: Array, v_BTHV: Array, *, g: Array | None = None,
            beta_BTH: Array | None = None, delta: bool = False, chunk: int = 64,
            state_BHKV: Array | None = None, kv_lengths: Array | None = None
            ) -> tuple[Array, Array]:
  """(o (B,T,H,V), final state (B,H,K,V)), both float32: the recurrence, chunk tokens a step."""
  check_chunk(chunk)
  q, k, v, g, beta = _inputs(q_BTGK, k_BTGK, v_BTHV, g, beta_BTH, kv_lengths)
  B, T, H, K = q.shape
  C = max(1, min(chunk, T))  # a chunk longer than the sequence would only add padding
  V = v.shape[-1]
  S0 = _state(state_BHKV, B, H, K, V)
  N = -(-T // C)
  pad = N * C - T

  def chunks(a):  # (B,T,H,...) -> (N,B,C,H,...), zeros past T: they write nothing, decay nothing
    a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
    return jnp.moveaxis(a.reshape(B, N, C, *a.shape[2:]), 1, 0)

  per_channel = g.ndim == 4
  lower_TS = jnp.tril(jnp.ones((C, C), bool))
  strict_TS = jnp.tril(jnp.ones((C, C), bool), -1)

  def pair_decay(gam, mask_TS):
    """e^{γ_t − γ_s} where mask_TS, else 0: (B,H,T,S), or (B,H,T,S,K) per key channel."""
    if per_channel:
      d = gam[:, :, None] - gam[:, None, :]  # (B,T,S,H,K)
      d = jnp.where(mask_TS[None, :, :, None, None], d, -jnp.inf)
      return jnp.exp(jnp.moveaxis(d, 3, 1))
    d = gam[:, :, None] - gam[:, None, :]  # (B,T,S,H)
    d = jnp.where(mask_TS[None, :, :, None], d, -jnp.inf)
    return jnp.exp(jnp.moveaxis(d, 3, 1))

  def scores(a_BCHK, b_BCHK, decay):
    if per_channel:
      return _einsum("BTHK,BSHK,BHTSK->BHTS", a_BCHK, b_BCHK, decay)
    return _einsum("BTHK,BSHK->BHTS", a_BCHK, b_BCHK) * decay

  def step(S_BHKV, xs):
    q_c, k_c, v_c, g_c, beta_c = xs
    gam = jnp.cumsum(g_c, axis=1)  # (B,C,H) or (B,C,H,K)
    e_gam = jnp.exp(gam) if per_channel else jnp.exp(gam)[..., None]  # (B,C,H,K)-broadcastable
    if delta:
      rhs_BCHV = beta_c[..., None] * (v_c - _einsum("BCHK,BHKV->BCHV", k_c * e_gam, S_BHKV))
      M_BHTS = beta_c.transpose(0, 2, 1)[..., None] * scores(k_c, k_c, pair_decay(gam, strict_TS))
      d_BHCV = _unit_lower_solve(M_BHTS, rhs_BCHV.transpose(0, 2, 1, 3))
    else:
      d_BHCV = (beta_c[..., None] * v_c).transpose(0, 2, 1, 3)
    A_BHTS = scores(q_c, k_c, pair_decay(gam, lower_TS))
    o_BCHV = (_einsum("BCHK,BHKV->BCHV", q_c * e_gam, S_BHKV)
              + _einsum("BHTS,BHSV->BTHV", A_BHTS, d_BHCV))
    last = gam[:, -1:]
    to_end = jnp.exp(last - gam) if per_channel else jnp.exp(last - gam)[..., None]
    decay_end = jnp.exp(last[:, 0]) if per_channel else jnp.exp(last[:, 0])[..., None]  # (B,H,K|1)
    S_BHKV = decay_end[..., None] * S_BHKV + _einsum("BCHK,BHCV->BHKV", k_c * to_end, d_BHCV)
    return S_BHKV, o_BCHV

  S_BHKV, o_NBCHV = jax.lax.scan(jax.checkpoint(step), S0,
                                 tuple(chunks(a) for a in (q, k, v, g, beta)))
  o_BTHV = jnp.moveaxis(o_NBCHV, 0, 1).reshape(B, N * C, H, V)[:, :T]
  return o_BTHV, S_BHKV


def chunked_flops(T: int, chunk: int, H: int, K: int, V: int, *, delta: bool,
                  decay: str | None) -> int:
  """FLOPs of chunked(...) for one sequence of T tokens (multiply-add 2, other arithmetic 1).

  decay None (no g), "head" ((B,T,H)) or "channel" ((B,T,H,K)). Each of the N = ⌈T/C⌉ chunks
  (C = min(chunk, T), the last padded) of each of the H value heads computes, as chunked's body:
    A = (Q·Kᵀ) ⊙ e^{γ_t − γ_s}        2C²K, plus C² for the decay (none: 0) or, per key channel,
                                     the (C,C,K) decay formed and multiplied in: 4C²K in all;
    o = (Q⊙e^γ)·S_0 + A·δ             2CKV + 2C²V;
    S_C = e^{γ_C}·S_0 + (K⊙e^{γ_C−γ})ᵀ·δ   2CKV;
  and with the delta rule also M = β⊙(K·Kᵀ ⊙ decay) (as A, plus C² for β), the right-hand side
  β⊙(V − (K⊙e^γ)·S_0) (2CKV + 2CV) and the forward substitution (I + M)·δ = rhs, a full row of M
  against δ per row (2C²V + CV). The elementwise O(CK + CV + KV) terms (q⊙e^γ, k⊙e^γ, the
  state's decay and sum, the cumulative log-decay) are counted as 3CK + CV + 2KV + C·(K or 1).
  """
  C = max(1, min(chunk, T))
  N = -(-T // C)
  pair = 4 * C * C * K if decay == "channel" else 2 * C * C * K + (C * C if decay else 0)
  per_chunk = pair + 2 * C * C * V + 4 * C * K * V
  per_chunk += 3 * C * K + C * V + 2 * K * V + C * (K if decay == "channel" else 1)
  if delta:
    per_chunk += pair + C * C + 2 * C * K * V + 2 * C * V + 2 * C * C * V + C * V
  return N * H * per_chunk


def recurrent(q_BTGK: Array, k_BTGK: Array, v_BTHV: Array, *, g: Array | None = None,
              beta_BTH: Array | None = None, delta: bool = False,
              state_BHKV: Array | None = None, kv_lengths: Array | None = None
              ) -> tuple[Array, Array]:
  """chunked's result one token at a time: the decoding form (a fixed-size state per sequence)."""
  q, k, v, g, beta = _inputs(q_BTGK, k_BTGK, v_BTHV, g, beta_BTH, kv_lengths)
  B, T, H, K = q.shape
  S0 = _state(state_BHKV, B, H, K, v.shape[-1])
  alpha = jnp.exp(g) if g.ndim == 4 else jnp.exp(g)[..., None]  # (B,T,H,K|1)

  def token(S_BHKV, xs):
    q_t, k_t, v_t, a_t, b_t = xs
    S_BHKV = a_t[..., None] * S_BHKV
    if delta:
      v_t = v_t - _einsum("BHK,BHKV->BHV", k_t, S_BHKV)
    S_BHKV = S_BHKV + _einsum("BHK,BHV->BHKV", k_t, b_t[..., None] * v_t)
    return S_BHKV, _einsum("BHK,BHKV->BHV", q_t, S_BHKV)

  S_BHKV, o_TBHV = jax.lax.scan(token, S0, tuple(jnp.moveaxis(a, 1, 0)
                                                 for a in (q, k, v, alpha, beta)))
  return jnp.moveaxis(o_TBHV, 0, 1), S_BHKV
