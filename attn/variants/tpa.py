"""tpa: tensor product attention, queries, keys and values as sums of outer products (Zhang et al. 2025).

"Tensor Product Attention Is All You Need" (arXiv:2501.06425). Each
token's H×K queries, G×K keys and G×V values are low-rank sums of a head factor
and a dim factor, all linear in the token (plus biases under use_bias):

  Q_t = (1/R_q)·Σ_r a^q_r(x_t) ⊗ b^q_r(x_t),   a^q_r ∈ R^H, b^q_r ∈ R^K,  r < R_q = cfg.q_rank,
  K_s = (1/R_kv)·Σ_r a^k_r(c_s) ⊗ b^k_r(c_s),  a^k_r ∈ R^G, b^k_r ∈ R^K,  r < R_kv = cfg.kv_rank,
  V_s = (1/R_kv)·Σ_r a^v_r(c_s) ⊗ b^v_r(c_s),  a^v_r ∈ R^G, b^v_r ∈ R^V,

then attention as in per_head (query head h reads kv head h // R) and W^O.
RoPE rotates the dim factors b^q and b^k at their token's position before the
outer product, as the paper does (rotation is linear, so Q and K rotate).

Layout: w_aq (D,R_q,H), w_bq (D,R_q,K), w_ak (D,R_kv,G), w_bk (D,R_kv,K),
w_av (D,R_kv,G), w_bv (D,R_kv,V), w_o (H,V,D); biases b_aq (R_q,H), b_bq
(R_q,K), b_ak (R_kv,G), b_bk (R_kv,K), b_av (R_kv,G), b_bv (R_kv,V), b_o (D,).

Decoding caches the factors, not K and V (cache_entries / attend_cached): per
token k_heads a^k, k_dims b^k (rotated at its position), v_heads a^v and
v_dims b^v; the keys and values are rebuilt from them at each step. RoPE is
applied here, not through base.queries_and_keys: a head feature that acts on
whole query and key heads would not reach the cached factors.

Params: D·(R_q·(H + K) + R_kv·(G + K) + R_kv·(G + V)) + H·V·D
  [+ R_q·(H + K) + R_kv·(G + K) + R_kv·(G + V) + D].
FLOPs: 2·T·D·R_q·(H + K) + 2·S·D·R_kv·(2·G + K + V) (factors)
  + 2·T·R_q·H·K + 2·S·R_kv·G·(K + V) (outer products) + 2·T·S·H·(K + V) + 2·T·H·V·D.
Effective (n = D + b inputs, N = n(n+1)/2 quadratic forms of them): each of
  Q, K, V is a family of quadratic maps of the token, F(width_a, width_b, rank)
  dims (factor_dof: a rank-R matrix less the GL(R) between a and b factors,
  capped at the quadratic forms); the scores then lose the gauge between q and
  k (GL(K); with RoPE its part commuting with the rotations) and G − 1 kv-head
  scales, the values GL(V) against W^O and G − 1 scales; key and value
  constants drop where the family reaches them (effective_param_count). An
  elementwise gate cuts the values' GL(V) to its diagonal (V) and sees all V
  dims; sinks or a softcap keep the key constants, sinks or a gate the value
  constants (as base.value_output_dof, base.kept_key_bias). Equals
  the Jacobian's rank at every shape checked with d_model ≥ 3 (an upper bound
  at d_model = 2). Without those caps: stored − R_q² − 2·R_kv² − K² − V² − 2·(G − 1).
KV cache: R_kv·(G + K) + R_kv·(G + V) per token.
Score weights: D·R_q·(H + K) + D·R_kv·(G + K).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attn.config import HeadConfig, invalid
from attn.variants import rope
from attn.variants.base import (Options, Params, Variant, add_bias, bias, core, kept_key_bias,
                                no_circuits, normal, project_heads, project_out)


def _shapes(cfg: HeadConfig) -> dict[str, tuple[int, int]]:
  """Factor name -> (rank, width): aq (R_q, H), bq (R_q, K), ak, bk, av, bv."""
  H, G, K, V, Rq, Rk = (cfg.num_heads, cfg.num_kv_heads, cfg.d_k, cfg.d_v, cfg.q_rank,
                        cfg.kv_rank)
  return {"aq": (Rq, H), "bq": (Rq, K), "ak": (Rk, G), "bk": (Rk, K), "av": (Rk, G),
          "bv": (Rk, V)}


def check(cfg: HeadConfig) -> None:
  if cfg.qk_norm:
    raise invalid("qk_norm", cfg.qk_norm, "False for tpa: a key's norm is a function of the whole head "
                  "it rebuilds from factors, which its cache keeps apart (kv_rank·(G + K) per token)")


def init(key, cfg: HeadConfig, dtype=jnp.float32) -> Params:
  D, H, V = cfg.d_model, cfg.num_heads, cfg.d_v
  shapes = _shapes(cfg)
  keys = jax.random.split(key, len(shapes) + 1)
  params = {f"w_{n}": normal(k, (D, *s), D, dtype) for k, (n, s) in zip(keys, shapes.items())}
  params["w_o"] = normal(keys[-1], (H, V, D), H * V, dtype)
  return add_bias(params, cfg, {**{f"b_{n}": s for n, s in shapes.items()}, "b_o": (D,)}, dtype)


def factor(params: Params, x_BTD, name: str) -> jax.Array:
  """The factor `name` (aq, bq, ak, bk, av, bv) of every token: (B,T,rank,width)."""
  return project_heads(x_BTD, params[f"w_{name}"], bias(params, f"b_{name}"))


def _positions(positions, length: int):
  return jnp.arange(length) if positions is None else positions


def kv_factors(params: Params, c_BSD, k_positions, *, cfg: HeadConfig) -> dict:
  """Per token: k_heads a^k (R_kv,G), k_dims b^k (R_kv,K) rotated at k_positions (None: 0..S−1),
  v_heads a^v (R_kv,G), v_dims b^v (R_kv,V)."""
  bk_BSRK = rope.rotate(factor(params, c_BSD, "bk"), _positions(k_positions, c_BSD.shape[1]), cfg)
  return {"k_heads": factor(params, c_BSD, "ak"), "k_dims": bk_BSRK,
          "v_heads": factor(params, c_BSD, "av"), "v_dims": factor(params, c_BSD, "bv")}


def _attend(params: Params, x_BTD, q_positions, kv: dict, *, cfg: HeadConfig, opts: Options):
  """Queries of x's tokens at q_positions against keys and values rebuilt from their factors."""
  bq_BTRK = rope.rotate(factor(params, x_BTD, "bq"), _positions(q_positions, x_BTD.shape[1]), cfg)
  q_BTHK = jnp.einsum("BTRH,BTRK->BTHK", factor(params, x_BTD, "aq"), bq_BTRK) / cfg.q_rank
  k_BSGK = jnp.einsum("BSRG,BSRK->BSGK", kv["k_heads"], kv["k_dims"]) / cfg.kv_rank
  v_BSGV = jnp.einsum("BSRG,BSRV->BSGV", kv["v_heads"], kv["v_dims"]) / cfg.kv_rank
  o_BTHV, w_BHTS = core(params, q_BTHK, k_BSGK, v_BSGV, cfg=cfg, opts=opts, x_BTD=x_BTD)
  return project_out(params, x_BTD, o_BTHV, cfg=cfg, opts=opts), w_BHTS


def apply(params: Params, x_BTD, context_BSD=None, *, cfg: HeadConfig,
          opts: Options = Options()):
  """Factors of every token, their outer products as queries, keys and values, then attention."""
  c_BSD = x_BTD if context_BSD is None else context_BSD
  q_pos, k_pos = opts.qk_positions or (None, None)
  kv = kv_factors(params, c_BSD, k_pos, cfg=cfg)
  return _attend(params, x_BTD, q_pos, kv, cfg=cfg, opts=opts)


def cache_entries(params: Params, x_BTD, *, cfg: HeadConfig, opts: Options) -> dict:
  """Per token the key and value factors a^k, b^k (rotated), a^v, b^v: kv_cache_width numbers."""
  k_pos = None if opts.qk_positions is None else opts.qk_positions[1]
  return kv_factors(params, x_BTD, k_pos, cfg=cfg)


def attend_cached(params: Params, x_BTD, cache: dict, *, cfg: HeadConfig, opts: Options):
  """x's queries (at opts' query positions) against the keys and values the cached factors give."""
  q_pos = None if opts.qk_positions is None else opts.qk_positions[0]
  y_BTD, _ = _attend(params, x_BTD, q_pos, cache, cfg=cfg, opts=opts)
  return y_BTD


def _factor_width(cfg: HeadConfig) -> int:
  """R_q·(H + K) + R_kv·(G + K) + R_kv·(G + V): the factors of one token, per input dim."""
  return sum(r * w for r, w in _shapes(cfg).values())


def param_count(cfg: HeadConfig) -> int:
  D, H, V = cfg.d_model, cfg.num_heads, cfg.d_v
  n = _factor_width(cfg)
  return D * n + H * V * D + ((n + D) if cfg.use_bias else 0)


def factor_dof(n: int, A: int, W: int, R: int) -> int:
  """Dim of the maps x̃ ↦ Σ_r a_r(x̃) ⊗ b_r(x̃) (a_r: A, b_r: W, linear in x̃ ∈ R^n), r < R.

  Entry (a, w) is the quadratic form x̃ᵀ·sym(Σ_r α_r,a β_r,wᵀ)·x̃: a rank-R
  (n·A)×(n·W) matrix (GL(R) between the a and b factors removed), capped at
  A·W·n(n+1)/2 quadratic forms. With A = 1 or W = 1 the antisymmetric part of
  each Σ_r α_r β_r,wᵀ is lost as well, and with both 1 the form is a symmetric
  matrix of signature (R, R).
  """
  forms = A * W * n * (n + 1) // 2
  if A == 1 and W == 1:
    s = min(2 * R, n)
    return s * n - s * (s - 1) // 2
  if A == 1 or W == 1:
    r, M = min(R, n), max(A, W)
    return min(M * (n * r - r * (r - 1) // 2) + r * (n - r), forms)
  r = min(R, n * A, n * W)
  return min(r * (n * A + n * W - r), forms)


def effective_param_count(cfg: HeadConfig) -> int:
  """The dimension of the function class (module docstring); checked against the Jacobian's rank.

  Scores: F_q + F_k less the pair gauge (q -> q·M, k -> k·M⁻ᵀ: GL(K), with RoPE
  only the M that commute with every rotation, GL(K − r) and a complex scalar
  per rotated pair) and the G − 1 kv head scales against their query heads
  (the common one is in GL(K)). Without RoPE q and k live in
  K_e = min(K, n·R_q, n·R_kv) dims. With biases, key terms constant along s drop
  out of the softmax where the key family reaches them: F_k + G·(K − r) − G·K·N.
  Values: F_v + H·V_e·D less GL(V_e) (v -> v·M, W^O -> M⁻¹·W^O) and G − 1 scales,
  V_e = min(V, n·R_kv, H·D); with biases value constants fold into b_o where
  the value family reaches them: F_v + G·V_e − G·V_e·N. An elementwise gate
  (o_h ⊙ σ(·) before W^O) commutes only with diagonal M: V_e = V, less V.
  The constants stay where the softmax or W^O no longer cancels them: key
  constants with sinks or a softcap, value constants with sinks or a gate. Plus b·D.
  """
  D, H, G, K, V, Rq, Rk = (cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_k, cfg.d_v,
                           cfg.q_rank, cfg.kv_rank)
  b, r = (1 if cfg.use_bias else 0), cfg.rope_dim
  n = D + b
  forms = n * (n + 1) // 2
  if r == 0:
    K = min(K, n * Rq, n * Rk)
  elementwise = cfg.gate == "elementwise"
  if not elementwise:  # a gate per value dim sees every dim apart: all V count
    V = min(V, n * Rk, H * D)
  f_q, f_k, f_v = factor_dof(n, H, K, Rq), factor_dof(n, G, K, Rk), factor_dof(n, G, V, Rk)
  # Constants drop only where softmax and W^O make them inert: sinks or a softcap keep the key's,
  # sinks or a gate the value's.
  key_constants = 0 if kept_key_bias(cfg) else b * max(0, f_k + G * (K - r) - G * K * forms)
  keeps_values = cfg.sinks or cfg.gate is not None
  value_constants = 0 if keeps_values else b * max(0, f_v + G * V - G * V * forms)
  scores = f_q + f_k - key_constants - ((K - r) ** 2 + r) - (G - 1)
  values = f_v - value_constants + H * V * D - (V if elementwise else V * V) - (G - 1)
  return scores + values + b * D


def flops(cfg: HeadConfig, T: int, S: int) -> int:
  D, H, G, K, V, Rq, Rk = (cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_k, cfg.d_v,
                           cfg.q_rank, cfg.kv_rank)
  factors = 2 * T * D * Rq * (H + K) + 2 * S * D * Rk * (2 * G + K + V)
  outer = 2 * T * Rq * H * K + 2 * S * Rk * G * (K + V)
  return factors + outer + 2 * T * S * H * (K + V) + 2 * T * H * V * D


def kv_cache_width(cfg: HeadConfig) -> int:
  G, K, V, Rk = cfg.num_kv_heads, cfg.d_k, cfg.d_v, cfg.kv_rank
  return Rk * (G + K) + Rk * (G + V)


def score_weights(cfg: HeadConfig) -> int:
  D, H, G, K = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_k
  return D * cfg.q_rank * (H + K) + D * cfg.kv_rank * (G + K)


VARIANT = Variant(
    name="tpa",
    lacks={"qkv_heads": "tpa caches its factors, not the per-head keys and values"},
    sharding={"w_aq": "DXH", "w_bq": "DXK", "w_ak": "DXG", "w_bk": "DXK", "w_av": "DXG",
              "w_bv": "DXV", "b_aq": "XH", "b_bq": "XK", "b_ak": "XG", "b_bk": "XK", "b_av": "XG",
              "b_bv": "XV"},  # X: the factor ranks
    init=init,
    apply=apply,
    param_count=param_count,
    effective_param_count=effective_param_count,
    flops=flops,
    kv_cache_width=kv_cache_width,
    score_weights=score_weights,
    cache_entries=cache_entries,
    attend_cached=attend_cached,
    circuits=no_circuits(
        "tpa",
        "a variant with a fixed W_QK,h per head: tpa's query and key head factors "
        "a^q(x_t), a^k(c_s) depend on the token, so head h's score q_h·k_g is a quartic "
        "form of (x_t, c_s), not x_t W_QK,h c_sᵀ with one fixed matrix"),
    check=check,
)
