"""mla: multi-head latent attention (DeepSeek-V2, DeepSeek-AI 2024, §2.1).

Keys and values come from one latent c_s = x_s·W_DKV of width d_c =
cfg.latent_dim: kv head g reads k_g = c·W_UK,g and v_g = c·W_UV,g + b_v,g, so
a decoder caches d_c numbers per token instead of G·(d_k + d_v). With RoPE,
a decoupled key k^R = x·W_KR + b_KR of width rope_dim is shared by every head.
Each query/key head is d_k wide: its first rope_dim dims are the rotated part
(query head h's own, against the shared k^R), the other d_k − rope_dim the
content part against k_g. Queries are per_head's (w_q (D,H,K), b_q), or with
cfg.q_latent_dim a low-rank path x·W_DQ·W_UQ. DeepSeek's RMSNorms on the
latents are an option, off by default: with cfg.latent_norm_eps the latent is
c = RMSNorm(x·W_DKV)·latent_norm and the query latent RMSNorm(x·W_DQ)·q_latent_norm
(kv_a_layernorm, q_a_layernorm). Off, every piece is linear and the exact
converters hold; on, keys and values are still linear in the cached c, so the
absorbed form below stays exact, but the effective count has no closed form here
(it is measured: the Jacobian's rank).

Absorption (decode_apply, the inference path): q_h·k_gᵀ = (q_h·W_UK,gᵀ)·c, so
a query absorbed into the latent scores the cached c directly, and the
weighted sum of latents is projected by W_UV,g afterwards. This is seed
question 4's merge W_Q·W_Kᵀ, taken only as far as the latent; with RoPE the
rotated dims cannot be absorbed and stay apart (k^R is cached).

Params: [D·H·K, or D·Q' + Q'·H·K] + D·d_c + d_c·G·(K − r) + d_c·G·V + D·r + H·V·D
  [+ H·K + r + G·V + D] [+ d_c (+ Q') latent norm scales], r = rope_dim, Q' = q_latent_dim.
FLOPs (unabsorbed, as apply computes): 2·T·D·H·K (or 2·T·Q'·(D + H·K))
  + 2·S·D·(d_c + r) + 2·S·d_c·G·(K − r + V) + 2·T·S·H·(K + V) + 2·T·H·V·D.
Effective: the key/value inputs live in the latent subspace of R^D, of
  dimension c* = min(d_c, D, G·(K − r + V)) (ranks capped): c*·(D − c*) for
  the subspace, then per_head's count inside it: Σ_g lowrank(R·(d_q + b), c*;
  K − r) + base.value_output_dof(c*) (Σ_g lowrank(c*, R·D; V) + b·D), plus the RoPE part
  base.rope_score_dof with one key shared by all H query heads, and with
  q_latent_dim a query subspace of dimension q* = min(Q', D, H·K):
  q*·(D − q*), queries then reading d_q = q* inputs (d_q = D without).
KV cache: d_c + rope_dim per token (+ d_I with the deepseek-form indexer: its keys; none on a layer that
reuses another's choice, extra.indexer.shared; + 2·d_I with the deepseek-form K-pool indexer: keys and gates).
Score weights: the query weights + D·d_c +
  d_c·G·(K − r) + D·r [+ the norm scales, d_c (+ Q')].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attn.config import HeadConfig, invalid
from attn.variants import rope
from attn.variants.mechanisms import pooled, selection
from attn.variants.base import (Options, Params, Variant, add_bias, attend_and_project, bias,
                                core, dense, lowrank_dof, normal, project_heads, project_out,
                                rope_score_dof, value_output_dof)
from attn.variants.mechanisms.head_mechanisms import rms_norm


def check(cfg: HeadConfig) -> None:
  if cfg.rope_dim >= cfg.d_k:
    raise invalid("rope_dim", cfg.rope_dim,
                  f"less than d_k={cfg.d_k} for mla: the d_k − rope_dim content dims of each key "
                  "head are what the latent gives")


def init(key, cfg: HeadConfig, dtype=jnp.float32) -> Params:
  D, H, G, K, V = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_k, cfg.d_v
  C, Q, r = cfg.latent_dim, cfg.q_latent_dim, cfg.rope_dim
  kq, kuq, kd, kk, kv, kr, ko = jax.random.split(key, 7)
  if Q is None:
    params = {"w_q": normal(kq, (D, H, K), D, dtype)}
  else:
    params = {"w_dq": normal(kq, (D, Q), D, dtype), "w_uq": normal(kuq, (Q, H, K), Q, dtype)}
  params.update({
      "w_dkv": normal(kd, (D, C), D, dtype),
      "w_uk": normal(kk, (C, G, K - r), C, dtype),
      "w_uv": normal(kv, (C, G, V), C, dtype),
      "w_o": normal(ko, (H, V, D), H * V, dtype),
  })
  if cfg.latent_norm_eps is not None:
    params["latent_norm"] = jnp.ones((C,), dtype)
    if Q is not None:
      params["q_latent_norm"] = jnp.ones((Q,), dtype)
  biases = {"b_q": (H, K), "b_v": (G, V), "b_o": (D,)}
  if r:
    params["w_kr"] = normal(kr, (D, r), D, dtype)
    biases["b_kr"] = (r,)
  return add_bias(params, cfg, biases, dtype)


def queries(params: Params, x_BTD, cfg: HeadConfig) -> jax.Array:
  """q (B,T,H,K): x·W_Q + b_q, or x·W_DQ·W_UQ + b_q with the low-rank query path (its latent
  RMS-normalised with cfg.latent_norm_eps)."""
  return _queries(params, x_BTD, cfg)[0]


def _queries(params: Params, x_BTD, cfg: HeadConfig):
  """(q (B,T,H,K), the query latent (B,T,Q') as q reads it, or None without one)."""
  if "w_q" in params:
    return project_heads(x_BTD, params["w_q"], bias(params, "b_q")), None
  lat_BTQ = x_BTD @ params["w_dq"]
  if cfg.latent_norm_eps is not None:
    lat_BTQ = rms_norm(lat_BTQ, params["q_latent_norm"], cfg.latent_norm_eps)
  return project_heads(lat_BTQ, params["w_uq"], bias(params, "b_q")), lat_BTQ


def _with_index(params: Params, x_BTD, lat_BTQ, ki_BSI, q_positions, opts: Options, cfg: HeadConfig) -> Options:
  """opts with the deepseek-form indexer's inputs (attn.variants.selection) when the layer has it: index
  queries and weights from x and the query latent at q_positions (None: 0..T−1), the given index keys."""
  if ki_BSI is None:
    return opts
  if pooled.computes_index(cfg):  # GLM-5.3-Flash's K-pool indexer: position-free
    qi_BTJI, w_BTJ = pooled.index_queries(params, x_BTD, lat_BTQ, cfg)
  else:
    q_pos = jnp.arange(x_BTD.shape[1]) if q_positions is None else q_positions
    qi_BTJI, w_BTJ = selection.index_queries(params, x_BTD, lat_BTQ, q_pos, cfg)
  return opts.replace(index=(qi_BTJI, ki_BSI, w_BTJ))


def _computes_index(cfg: HeadConfig) -> bool:
  """Whether the layer computes and caches index keys: the deepseek-form indexer or K-pool indexer."""
  return selection.computes_index(cfg) or pooled.computes_index(cfg)


def _index_keys(params: Params, c_BSD, k_positions, cfg: HeadConfig):
  """The deepseek-form indexer's keys at k_positions (the K-pool indexer's keys and gates), or None without it."""
  if pooled.computes_index(cfg):
    return pooled.index_keys(params, c_BSD, cfg)
  return selection.index_keys(params, c_BSD, k_positions, cfg) if selection.computes_index(cfg) else None


def _latent_and_rope_key(params: Params, c_BSD, cfg: HeadConfig):
  lat_BSC = c_BSD @ params["w_dkv"]
  if cfg.latent_norm_eps is not None:
    lat_BSC = rms_norm(lat_BSC, params["latent_norm"], cfg.latent_norm_eps)
  kr_BSR = dense(c_BSD, params["w_kr"], bias(params, "b_kr")) if cfg.rope_dim else None
  return lat_BSC, kr_BSR


def apply(params: Params, x_BTD, context_BSD=None, *, cfg: HeadConfig,
          opts: Options = Options()):
  """Unabsorbed (training) form: keys and values up-projected from the latent, per kv head."""
  c_BSD = x_BTD if context_BSD is None else context_BSD
  B, S, _ = c_BSD.shape
  G, r = cfg.num_kv_heads, cfg.rope_dim
  q_BTHK, lat_BTQ = _queries(params, x_BTD, cfg)
  if _computes_index(cfg):
    q_pos, k_pos = opts.qk_positions or rope.qk_positions(None, x_BTD.shape[1], S, context_BSD is not None)
    opts = _with_index(params, x_BTD, lat_BTQ, _index_keys(params, c_BSD, k_pos, cfg), q_pos, opts, cfg)
  lat_BSC, kr_BSR = _latent_and_rope_key(params, c_BSD, cfg)
  k_BSGK = jnp.einsum("BSC,CGK->BSGK", lat_BSC, params["w_uk"])
  if r:  # the shared RoPE key fills the first r dims of every kv head; the base rotates them
    k_BSGK = jnp.concatenate([jnp.broadcast_to(kr_BSR[:, :, None], (B, S, G, r)), k_BSGK], -1)
  v_BSGV = jnp.einsum("BSC,CGV->BSGV", lat_BSC, params["w_uv"]) + bias(params, "b_v")
  return attend_and_project(params, x_BTD, q_BTHK, k_BSGK, v_BSGV, cfg=cfg, opts=opts)


def decode_apply(params: Params, x_BTD, context_BSD=None, *, cfg: HeadConfig,
                 opts: Options = Options()):
  """Absorbed (inference) form: the kernel reads only [k^R | c], d_c + rope_dim per token.

  Query head h becomes [q^R_h | q_h·W_UK,gᵀ] (r + d_c wide) against the one
  shared key [k^R_s | c_s]; the weights mix the latents c_s, and W_UV,g then
  gives head h's value. The value bias b_v is carried by a constant 1 column
  next to the latent (not cached: it is the same for every token), so a fully
  masked row still gets zero output.
  """
  c_BSD = x_BTD if context_BSD is None else context_BSD
  lat_BSC, kr_BSR = _latent_and_rope_key(params, c_BSD, cfg)
  q_pos, ki_BSI = None, None
  if cfg.rope_dim or _computes_index(cfg):
    q_pos, k_pos = opts.qk_positions or rope.qk_positions(None, x_BTD.shape[1],
                                                          c_BSD.shape[1], True)
    kr_BSR = rope.rotate(kr_BSR, k_pos, cfg) if cfg.rope_dim else kr_BSR
    ki_BSI = _index_keys(params, c_BSD, k_pos, cfg)
  return _attend_latent(params, x_BTD, lat_BSC, kr_BSR, q_pos, cfg=cfg, opts=opts, ki_BSI=ki_BSI)


def _attend_latent(params: Params, x_BTD, lat_BSC, kr_BSR, q_positions, *, cfg: HeadConfig,
                   opts: Options, ki_BSI=None):
  """decode_apply's kernel over latents and already rotated RoPE keys; queries at q_positions; the
  deepseek-form indexer's keys ki_BSI (None without it)."""
  B, S, _ = lat_BSC.shape
  R, r, C = cfg.group_size, cfg.rope_dim, cfg.latent_dim
  q_BTHK, lat_BTQ = _queries(params, x_BTD, cfg)
  opts = _with_index(params, x_BTD, lat_BTQ, ki_BSI, q_positions, opts, cfg)
  w_uk_CHK = jnp.repeat(params["w_uk"], R, axis=1)
  w_uv_CHV = jnp.repeat(params["w_uv"], R, axis=1)
  q_BTHC = jnp.einsum("BTHK,CHK->BTHC", q_BTHK[..., r:], w_uk_CHK)
  q_BTHW = jnp.concatenate([q_BTHK[..., :r], q_BTHC], -1)
  if r:
    q_pos = jnp.arange(x_BTD.shape[1]) if q_positions is None else q_positions
    q_BTHW = rope.rotate(q_BTHW, q_pos, cfg)
  k_BS1W = (lat_BSC if not r else jnp.concatenate([kr_BSR, lat_BSC], -1))[:, :, None]
  v_BS1C = lat_BSC[:, :, None]
  if cfg.use_bias:
    v_BS1C = jnp.concatenate([v_BS1C, jnp.ones((B, S, 1, 1), lat_BSC.dtype)], -1)
  o_BTHC, w_BHTS = core(params, q_BTHW, k_BS1W, v_BS1C, cfg=cfg, opts=opts, x_BTD=x_BTD)
  o_BTHV = jnp.einsum("BTHC,CHV->BTHV", o_BTHC[..., :C], w_uv_CHV)
  if cfg.use_bias:  # b_v times the row's total weight: 1, or 0 for a fully masked row
    o_BTHV = o_BTHV + o_BTHC[..., C:] * jnp.repeat(params["b_v"], R, axis=0)
  return project_out(params, x_BTD, o_BTHV, cfg=cfg, opts=opts), w_BHTS


def cache_entries(params: Params, x_BTD, *, cfg: HeadConfig, opts: Options) -> dict:
  """Per token: the latent c (d_c) and the RoPE key k^R (rope_dim), rotated at its position."""
  lat_BTC, kr_BTR = _latent_and_rope_key(params, x_BTD, cfg)
  _, k_pos = opts.qk_positions or rope.qk_positions(None, x_BTD.shape[1], x_BTD.shape[1], False)
  out = {"latent": lat_BTC}
  if cfg.rope_dim:
    out["k_rope"] = rope.rotate(kr_BTR, k_pos, cfg)
  if _computes_index(cfg):  # the indexer's keys, beside the latent (DeepSeek-V3.2's indexer cache)
    out["index_key"] = _index_keys(params, x_BTD, k_pos, cfg)
  return out


def attend_cached(params: Params, x_BTD, cache: dict, *, cfg: HeadConfig, opts: Options):
  """The absorbed form against a cache of latents and rotated RoPE keys; opts' query positions."""
  q_pos = None if opts.qk_positions is None else opts.qk_positions[0]
  y_BTD, _ = _attend_latent(params, x_BTD, cache["latent"], cache.get("k_rope"), q_pos, cfg=cfg,
                            opts=opts, ki_BSI=cache.get("index_key"))
  return y_BTD


def _query_params(cfg: HeadConfig) -> int:
  D, H, K, Q = cfg.d_model, cfg.num_heads, cfg.d_k, cfg.q_latent_dim
  return D * H * K if Q is None else D * Q + Q * H * K


def param_count(cfg: HeadConfig) -> int:
  D, H, G, K, V = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_k, cfg.d_v
  C, r = cfg.latent_dim, cfg.rope_dim
  weights = _query_params(cfg) + D * C + C * G * (K - r) + C * G * V + D * r + H * V * D
  biases = H * K + r + G * V + D
  return weights + (biases if cfg.use_bias else 0) + _norm_scales(cfg)


def _norm_scales(cfg: HeadConfig) -> int:
  """The latent norms' scales: d_c, and Q' with the query latent; 0 without latent_norm_eps."""
  if cfg.latent_norm_eps is None:
    return 0
  return cfg.latent_dim + (cfg.q_latent_dim or 0)


def effective_param_count(cfg: HeadConfig) -> int | None:
  if cfg.latent_norm_eps is not None:
    return None  # the norms are not linear: no closed form here, count.param_counts measures it
  D, H, G, R, K, V = (cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.group_size, cfg.d_k,
                      cfg.d_v)
  C, Q, r = cfg.latent_dim, cfg.q_latent_dim, cfg.rope_dim
  b = 1 if cfg.use_bias else 0
  Kc = K - r
  d_q = D if Q is None else min(Q, D, H * K)
  # The latent subspace: spanned by the kv groups' key (rank ≤ K − r) and value (≤ V) inputs.
  c_star = min(C, D, G * (min(Kc, R * (d_q + b)) + min(V, R * D)))
  if Q is not None:  # the query subspace: spanned by each head's content and rotated inputs
    d_q = min(d_q, H * (min(Kc, c_star) + r))
  total = c_star * (D - c_star) + (d_q * (D - d_q) if Q is not None else 0)
  total += G * lowrank_dof(R * (d_q + b), c_star, Kc) + value_output_dof(cfg, c_star)
  if r:
    total += rope_score_dof(cfg, H * (d_q + b), D)
  return total


def flops(cfg: HeadConfig, T: int, S: int) -> int:
  D, H, G, K, V = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_k, cfg.d_v
  C, r = cfg.latent_dim, cfg.rope_dim
  query = 2 * T * _query_params(cfg)
  kv = 2 * S * D * (C + r) + 2 * S * C * G * (K - r + V)
  return query + kv + 2 * T * S * H * (K + V) + 2 * T * H * V * D


def kv_cache_width(cfg: HeadConfig) -> int:
  """d_c + rope_dim, and the deepseek-form indexer's key (d_I) beside them (the K-pool indexer's key and gate,
  2·d_I)."""
  index = selection.options_of(cfg)["head_dim"] if selection.computes_index(cfg) else pooled.index_width(cfg)
  return cfg.latent_dim + cfg.rope_dim + index


def score_weights(cfg: HeadConfig) -> int:
  D, G, K, C, r = cfg.d_model, cfg.num_kv_heads, cfg.d_k, cfg.latent_dim, cfg.rope_dim
  return _query_params(cfg) + D * C + C * G * (K - r) + D * r + _norm_scales(cfg)


VARIANT = Variant(
    name="mla",
    sharding={"w_dq": "DQ", "w_uq": "QHK", "w_dkv": "DC", "w_uk": "CGK", "w_uv": "CGV",
              "w_kr": "DR", "b_kr": "R", "latent_norm": "C", "q_latent_norm": "Q"},
    init=init,
    apply=apply,
    param_count=param_count,
    effective_param_count=effective_param_count,
    flops=flops,
    kv_cache_width=kv_cache_width,
    score_weights=score_weights,
    check=check,
    lacks={"qkv_heads": "mla caches the latent, not the per-head keys and values a convolution over them needs",
           "qk_heads": "mla's absorbed (decoding) form scores q·W_UKᵀ against the cached latent, exact "
                       "because a key is linear in the latent: a normalised key is not, and the heads' "
                       "dims never reach the kernel"},
    decode_apply=decode_apply,
    cache_entries=cache_entries,
    attend_cached=attend_cached,
)
