"""Conversions between variants through the canonical per_head layout.

The function is `attn.convert` (README); the module is attn.conversion, named apart so that
importing it never rebinds `attn.convert`.

Each converter maps params of one variant to params of another for the same
HeadConfig, or, for regrouping kv heads, to a dst_cfg that differs only in
num_kv_heads. Exact ones give the same function (tests hold them to 1e-5);
lossy ones (SVD of merged matrices, mean-pooled kv heads, a narrow mla latent)
say so: they warn with LossyConversionWarning and `convert(..., return_error=True)`
returns the relative Frobenius error of what was discarded (below TOLERANCE a
lossy step was in fact exact and stays silent). A lossy converter may name
the configs where it is exact (`exact_when`); there its error is 0.
RoPE (rope_dim > 0): converters between variants that both have it hold
exactly, rotations acting on the same head dims on both sides; merged and
collaborative refuse RoPE, and with them the conversions into them. A
conversion not listed here is composed through per_head when both halves
exist; anything else is an error that lists what does exist.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Callable

import jax
import jax.numpy as jnp

from attn.api import check_config, check_params, config_for, get_variant
from attn.config import HeadConfig, invalid
from attn.variants import grouped_lowrank, mechanisms
from attn.variants.base import Params

# Relative error under which a lossy step counts as exact (float32 round-off).
TOLERANCE = 1e-5


class LossyConversionWarning(UserWarning):
  """A conversion that could not keep the function exactly; the message gives the error."""


def _no_check(cfg: HeadConfig) -> None:
  del cfg


@dataclasses.dataclass(frozen=True)
class Converter:
  fn: Callable[..., tuple[Params, float]]
  exact: bool
  name: str = ""
  check: Callable[[HeadConfig], None] = _no_check  # raises ConfigError before any tracing
  exact_when: Callable[[HeadConfig], bool] | None = None  # a lossy converter's exact configs

  def is_exact(self, cfg: HeadConfig) -> bool:
    """Whether this conversion keeps the function exactly at cfg."""
    return self.exact or (self.exact_when is not None and self.exact_when(cfg))


CONVERTERS: dict[tuple[str, str], Converter] = {}
# per_head -> per_head with a different num_kv_heads: fn(params, cfg, dst_cfg).
REGROUPERS: dict[str, Converter] = {}


def register(src: str, dst: str, *, exact: bool, kv_heads: str | None = None,
             check: Callable[[HeadConfig], None] = _no_check,
             exact_when: Callable[[HeadConfig], bool] | None = None):
  """Registers fn(params, cfg), or with kv_heads='more'/'fewer' a fn(params, cfg, dst_cfg)."""
  def wrap(fn):
    if kv_heads is None:
      CONVERTERS[(src, dst)] = Converter(fn, exact, f"{src} -> {dst}", check, exact_when)
    else:
      REGROUPERS[kv_heads] = Converter(fn, exact, f"{src} -> {dst} with {kv_heads} kv heads", check)
    return fn
  return wrap


@register("per_head", "fused", exact=True)
def per_head_to_fused(p: Params, cfg: HeadConfig) -> tuple[Params, float]:
  """The per-head columns packed into one QKV matrix (Q1: a linear layer per head is fused)."""
  D = cfg.d_model
  out = {
      "w_qkv": jnp.concatenate([p["w_q"].reshape(D, -1), p["w_k"].reshape(D, -1),
                                p["w_v"].reshape(D, -1)], axis=1),
      "w_o": p["w_o"].reshape(-1, D),
  }
  if cfg.use_bias:
    out["b_qkv"] = jnp.concatenate([p["b_q"].ravel(), p["b_k"].ravel(), p["b_v"].ravel()])
    out["b_o"] = p["b_o"]
  return out, 0.0


@register("fused", "per_head", exact=True)
def fused_to_per_head(p: Params, cfg: HeadConfig) -> tuple[Params, float]:
  """The packed QKV matrix split back into its per-head column blocks."""
  D, H, G, K, V = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_k, cfg.d_v
  sizes = [H * K, G * K]
  w_q, w_k, w_v = jnp.split(p["w_qkv"], [sizes[0], sizes[0] + sizes[1]], axis=1)
  out = {"w_q": w_q.reshape(D, H, K), "w_k": w_k.reshape(D, G, K),
         "w_v": w_v.reshape(D, G, V), "w_o": p["w_o"].reshape(H, V, D)}
  if cfg.use_bias:
    b_q, b_k, b_v = jnp.split(p["b_qkv"], [sizes[0], sizes[0] + sizes[1]])
    out.update(b_q=b_q.reshape(H, K), b_k=b_k.reshape(G, K), b_v=b_v.reshape(G, V),
               b_o=p["b_o"])
  return out, 0.0


@register("two_stage", "per_head", exact=True)
def two_stage_to_per_head(p: Params, cfg: HeadConfig) -> tuple[Params, float]:
  """W_h = W¹·W_h and b_h = b¹·W_h + b_h: the first stage collapses into the second (Q2)."""
  out = {"w_o": p["w_o"]}
  for n in "qkv":
    out[f"w_{n}"] = jnp.einsum("DE,EHK->DHK", p[f"w_{n}1"], p[f"w_{n}"])
    if cfg.use_bias:
      out[f"b_{n}"] = jnp.einsum("E,EHK->HK", p[f"b_{n}1"], p[f"w_{n}"]) + p[f"b_{n}"]
  return out | ({"b_o": p["b_o"]} if cfg.use_bias else {}), 0.0


def _key_bias_drops_out(dst: str) -> Callable[[HeadConfig], None]:
  """Refuses biases with sinks, softcap or a probability other than softmax for a conversion that
  drops the key bias (into dst)."""
  def check(cfg: HeadConfig) -> None:
    if cfg.use_bias and (cfg.sinks or cfg.softcap is not None or cfg.probability != "softmax"):
      raise invalid("use_bias", True,
                    f"False for per_head -> {dst} with sinks, softcap or probability "
                    f"{cfg.probability!r}: a row's constant x·W_Q,h·b_k + b_q,h·b_k then changes the "
                    "weights (against the sink, inside the cap, unnormalised), and "
                    f"{dst} has no parameter for it")
  return check


@register("per_head", "merged", exact=True, check=_key_bias_drops_out("merged"))
def per_head_to_merged(p: Params, cfg: HeadConfig) -> tuple[Params, float]:
  """W_h = W_Q,h·W_K,gᵀ; the query bias becomes a key-side content term b_kc,h = W_K,g·b_q,h (Q4).

  (x W_Q + b_q)(c W_K + b_k)ᵀ = x W_Q W_Kᵀ cᵀ + b_q W_Kᵀ cᵀ + [x W_Q b_kᵀ + b_q b_kᵀ]: the
  bracket is constant along s, so the softmax drops it, and with it the key bias.
  """
  w_k_DHK = jnp.repeat(p["w_k"], cfg.group_size, axis=1)
  out = {"w_qk": jnp.einsum("DHK,EHK->HDE", p["w_q"], w_k_DHK),
         "w_v": p["w_v"], "w_o": p["w_o"]}
  if cfg.use_bias:
    out.update(b_kc=jnp.einsum("EHK,HK->HE", w_k_DHK, p["b_q"]), b_v=p["b_v"], b_o=p["b_o"])
  return out, 0.0


@register("merged", "per_head", exact=False)
def merged_to_per_head(p: Params, cfg: HeadConfig) -> tuple[Params, float]:
  """Truncated SVD to rank d_k of each kv group's stacked [W_h]; b_q by least squares, b_k = 0.

  The R query heads of a group share W_K,g, so their matrices stacked along
  rows are one (R·D)×D matrix U S Vᵀ: W_Q = U_r S_r^½, W_K = V_r S_r^½,
  r = min(d_k, D). Exact when that matrix has rank ≤ d_k and b_kc lies in
  the span of W_K (both hold for matrices made by per_head -> merged).
  """
  D, H, G, R, K = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.group_size, cfg.d_k
  r = min(K, D)
  w_GME = p["w_qk"].reshape(G, R * D, D)
  u_GMN, s_GN, vt_GNE = jnp.linalg.svd(w_GME, full_matrices=False)
  root_GN = jnp.sqrt(s_GN[:, :r])
  pad = [(0, 0), (0, 0), (0, K - r)]
  w_q_GMK = jnp.pad(u_GMN[:, :, :r] * root_GN[:, None], pad)
  w_k_GDK = jnp.pad(jnp.swapaxes(vt_GNE[:, :r], 1, 2) * root_GN[:, None], pad)
  out = {"w_q": w_q_GMK.reshape(G, R, D, K).transpose(2, 0, 1, 3).reshape(D, H, K),
         "w_k": w_k_GDK.transpose(1, 0, 2), "w_v": p["w_v"], "w_o": p["w_o"]}
  lost = jnp.sum(s_GN[:, r:] ** 2)
  total = jnp.sum(s_GN ** 2)
  if cfg.use_bias:
    # Least squares W_K,g b = b_kc,h through the SVD: b = S_r^-½ V_rᵀ b_kc.
    b_kc_GRD = p["b_kc"].reshape(G, R, D)
    inv_GN = jnp.where(root_GN > 0, 1.0 / jnp.where(root_GN > 0, root_GN, 1.0), 0.0)
    b_q_GRN = jnp.einsum("GNE,GRE->GRN", vt_GNE[:, :r], b_kc_GRD) * inv_GN[:, None]
    fit_GRD = jnp.einsum("GNE,GRN->GRE", vt_GNE[:, :r], b_q_GRN * root_GN[:, None])
    lost = lost + jnp.sum((b_kc_GRD - fit_GRD) ** 2)
    total = total + jnp.sum(b_kc_GRD ** 2)
    out.update(b_q=jnp.pad(b_q_GRN, pad).reshape(H, K), b_k=jnp.zeros((G, K), p["b_kc"].dtype),
               b_v=p["b_v"], b_o=p["b_o"])
  return out, jnp.sqrt(lost / jnp.maximum(total, 1e-30))


def _concatenated_width(cfg: HeadConfig) -> None:
  if cfg.collab_width != cfg.num_heads * cfg.d_k:
    raise invalid("collab_width", cfg.collab_width,
                  f"num_heads·d_k = {cfg.num_heads * cfg.d_k} for the exact "
                  "per_head -> collaborative conversion")


@register("per_head", "collaborative", exact=True, check=_concatenated_width)
def per_head_to_collaborative(p: Params, cfg: HeadConfig) -> tuple[Params, float]:
  """Concatenated heads: W̃_Q = [W_Q,h]_h, W̃_K = [W_K,g(h)]_h, m_h = indicator of block h."""
  D, H, K, R = cfg.d_model, cfg.num_heads, cfg.d_k, cfg.group_size
  out = {"w_q": p["w_q"].reshape(D, H * K),
         "w_k": jnp.repeat(p["w_k"], R, axis=1).reshape(D, H * K),
         "m": jnp.repeat(jnp.eye(H, dtype=p["w_q"].dtype), K, axis=1),
         "w_v": p["w_v"], "w_o": p["w_o"]}
  if cfg.use_bias:
    out.update(b_q=p["b_q"].reshape(H * K), b_k=jnp.repeat(p["b_k"], R, axis=0).reshape(H * K),
               b_v=p["b_v"], b_o=p["b_o"])
  return out, 0.0


@register("split_input", "per_head", exact=True)
def split_input_to_per_head(p: Params, cfg: HeadConfig) -> tuple[Params, float]:
  """Head h's (D/H)×K block in zero rows: a block-diagonal per_head layer (Q3: a smaller model)."""
  D = cfg.d_model

  def block_diagonal(w_NEK):
    n = w_NEK.shape[0]
    eye_NN = jnp.eye(n, dtype=w_NEK.dtype)
    return (w_NEK[:, :, None, :] * eye_NN[:, None, :, None]).reshape(D, n, w_NEK.shape[-1])

  out = {name: block_diagonal(p[name]) for name in ("w_q", "w_k", "w_v")}
  out["w_o"] = p["w_o"]
  return out | {n: p[n] for n in ("b_q", "b_k", "b_v", "b_o") if n in p}, 0.0


@register("per_head", "talking_heads", exact=True)
def per_head_to_talking_heads(p: Params, cfg: HeadConfig) -> tuple[Params, float]:
  """Identity mixing P_l = P_w = I (mix_l = mix_w = 0): heads that do not talk are per_head (Q5)."""
  zeros = jnp.zeros((cfg.num_heads, cfg.num_heads), p["w_q"].dtype)
  return p | {"mix_l": zeros, "mix_w": zeros}, 0.0


def _linear_latents(cfg: HeadConfig) -> None:
  """Refuses mla's latent norms: RMSNorm(x·W_DKV) is no linear map of x, so no W_K or W_V holds it."""
  if cfg.latent_norm_eps is not None:
    raise invalid("latent_norm_eps", cfg.latent_norm_eps, "None to convert mla to or from another variant: "
                  "the RMS-normalised latents (DeepSeek's) make keys and values nonlinear in x")


@register("mla", "per_head", exact=True, check=_linear_latents)
def mla_to_per_head(p: Params, cfg: HeadConfig) -> tuple[Params, float]:
  """W_K,g = [W_KR | W_DKV·W_UK,g], W_V,g = W_DKV·W_UV,g (W_Q = W_DQ·W_UQ): exact, RoPE or not.

  The shared RoPE key becomes the first rope_dim dims of every kv head's key,
  which per_head rotates the same way; the key bias is [b_KR | 0].
  """
  D, G, K, r = cfg.d_model, cfg.num_kv_heads, cfg.d_k, cfg.rope_dim
  w_q = p["w_q"] if "w_q" in p else jnp.einsum("DQ,QHK->DHK", p["w_dq"], p["w_uq"])
  w_k = jnp.einsum("DC,CGK->DGK", p["w_dkv"], p["w_uk"])
  if r:
    w_k = jnp.concatenate([jnp.broadcast_to(p["w_kr"][:, None], (D, G, r)), w_k], -1)
  out = {"w_q": w_q, "w_k": w_k, "w_v": jnp.einsum("DC,CGV->DGV", p["w_dkv"], p["w_uv"]),
         "w_o": p["w_o"]}
  if cfg.use_bias:
    b_k = jnp.zeros((G, K), p["b_q"].dtype)
    if r:
      b_k = b_k.at[:, :r].set(p["b_kr"])
    out.update(b_q=p["b_q"], b_k=b_k, b_v=p["b_v"], b_o=p["b_o"])
  return out, 0.0


def _factor(m_DN: jax.Array, rank: int):
  """(a (D,rank), b (rank,N), lost, total) with a·b = m: exact when rank >= min(D, N), else SVD.

  rank >= N: a is m itself and b selects its columns (the latent is m's output);
  rank >= D: a is the identity (the latent is the input); otherwise the
  truncated SVD split as a = U_r·S_r^½, b = S_r^½·V_rᵀ, losing Σ_{i>rank} s_i².
  """
  D, N = m_DN.shape
  total = jnp.sum(m_DN ** 2)
  if rank >= N:
    return jnp.pad(m_DN, ((0, 0), (0, rank - N))), jnp.eye(rank, N, dtype=m_DN.dtype), 0.0, total
  if rank >= D:
    return jnp.eye(D, rank, dtype=m_DN.dtype), jnp.pad(m_DN, ((0, rank - D), (0, 0))), 0.0, total
  u_DN, s_N, vt_NN = jnp.linalg.svd(m_DN, full_matrices=False)
  root = jnp.sqrt(s_N[:rank])
  return u_DN[:, :rank] * root, root[:, None] * vt_NN[:rank], jnp.sum(s_N[rank:] ** 2), total


def _mla_exact(cfg: HeadConfig) -> bool:
  """The latent holds every kv head's content key and value (d_c >= min(D, G·(K − r + V))), the
  query latent every query (q_latent_dim >= min(D, H·K)), and the kv heads share one RoPE key."""
  D, H, G, K, V, r = (cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_k, cfg.d_v,
                      cfg.rope_dim)
  q = cfg.q_latent_dim
  return (cfg.latent_dim >= min(D, G * (K - r + V)) and (q is None or q >= min(D, H * K))
          and (r == 0 or G == 1))


def _to_mla(cfg: HeadConfig) -> None:
  _key_bias_drops_out("mla")(cfg)
  _linear_latents(cfg)


@register("per_head", "mla", exact=False, exact_when=_mla_exact, check=_to_mla)
def per_head_to_mla(p: Params, cfg: HeadConfig) -> tuple[Params, float]:
  """Latent = every kv head's stacked [W_K,g content | W_V,g], truncated by SVD when too narrow.

  Exact where _mla_exact holds (the latent is the concatenated K and V). The
  content key bias drops out of the softmax; with RoPE and G > 1 the kv heads'
  rotated key dims become one shared RoPE key, their mean. The error is the
  relative Frobenius norm of all that is discarded (SVD tails, RoPE keys minus
  their mean) over the matrices it came from.
  """
  D, H, G, K, V, r = (cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_k, cfg.d_v,
                      cfg.rope_dim)
  Kc, C = K - r, cfg.latent_dim
  m_DN = jnp.concatenate([p["w_k"][:, :, r:].reshape(D, G * Kc), p["w_v"].reshape(D, G * V)], 1)
  w_dkv, w_ukv, lost, total = _factor(m_DN, C)
  out = {"w_dkv": w_dkv, "w_uk": w_ukv[:, :G * Kc].reshape(C, G, Kc),
         "w_uv": w_ukv[:, G * Kc:].reshape(C, G, V), "w_o": p["w_o"]}
  if cfg.q_latent_dim is None:
    out["w_q"] = p["w_q"]
  else:
    w_dq, w_uq, q_lost, q_total = _factor(p["w_q"].reshape(D, H * K), cfg.q_latent_dim)
    out.update(w_dq=w_dq, w_uq=w_uq.reshape(-1, H, K))
    lost, total = lost + q_lost, total + q_total
  rope_keys = [("w_kr", p["w_k"][:, :, :r], 1)] + (
      [("b_kr", p["b_k"][:, :r], 0)] if cfg.use_bias else [])
  for name, a, axis in rope_keys if r else []:
    mean = a.mean(axis)
    out[name] = mean
    lost = lost + jnp.sum((a - jnp.expand_dims(mean, axis)) ** 2)
    total = total + jnp.sum(a ** 2)
  if cfg.use_bias:
    out.update(b_q=p["b_q"], b_v=p["b_v"], b_o=p["b_o"])
  return out, jnp.sqrt(lost / jnp.maximum(total, 1e-30))


def _value_norm(src: str, dst: str, cfg: HeadConfig) -> None:
  """Refuses the values' weightless RMSNorm (value_norm_eps) where dst has none: RMSNorm(x·W_V) is
  no linear map of x, so no variant without the norm holds it (per_head and k_eq_v carry it)."""
  if cfg.value_norm_eps is not None and "value_norm_eps" not in get_variant(dst).fields:
    raise invalid("value_norm_eps", cfg.value_norm_eps, f"None to convert {src} to {dst}: the "
                  "weightless value norm makes each value RMSNorm(x·W_V,g), no linear map of x, so "
                  f"{dst} cannot hold it (per_head and k_eq_v can)")


@register("k_eq_v", "per_head", exact=True)
def k_eq_v_to_per_head(p: Params, cfg: HeadConfig) -> tuple[Params, float]:
  """W_K = W_V = W_KV and b_k = b_v = b_kv: the one projection written twice (the value norm, if
  any, is per_head's too)."""
  out = {"w_q": p["w_q"], "w_k": p["w_kv"], "w_v": p["w_kv"], "w_o": p["w_o"]}
  if cfg.use_bias:
    out.update(b_q=p["b_q"], b_k=p["b_kv"], b_v=p["b_kv"], b_o=p["b_o"])
  return out, 0.0


@register("grouped_lowrank", "per_head", exact=True)
def grouped_lowrank_to_per_head(p: Params, cfg: HeadConfig) -> tuple[Params, float]:
  """W^O = blockdiag(A_1..A_g)·B: group i's rows are A_i·B_i, B_i the i-th r rows of B."""
  H, V, D, g, r = cfg.num_heads, cfg.d_v, cfg.d_model, cfg.o_groups, grouped_lowrank.rank(cfg)
  w_ob_grD = p["w_ob"].reshape(g, r, D)
  w_o = jnp.einsum("gNr,grD->gND", p["w_oa"], w_ob_grD).reshape(H, V, D)
  return {n: a for n, a in p.items() if n not in ("w_oa", "w_ob")} | {"w_o": w_o}, 0.0


def _grouped_exact(cfg: HeadConfig) -> bool:
  """Every group's block of W^O (H/g·V, D) fits rank o_rank."""
  return grouped_lowrank.rank(cfg) >= min(cfg.num_heads // cfg.o_groups * cfg.d_v, cfg.d_model)


@register("per_head", "grouped_lowrank", exact=False, exact_when=_grouped_exact)
def per_head_to_grouped_lowrank(p: Params, cfg: HeadConfig) -> tuple[Params, float]:
  """Each group's block W_i of W^O factored A_i·B_i (its truncated SVD where rank W_i > o_rank).

  The error is the relative Frobenius norm of the discarded singular values of all blocks
  over W^O's; exact (0) where every block has rank ≤ o_rank.
  """
  H, V, D, g, r = cfg.num_heads, cfg.d_v, cfg.d_model, cfg.o_groups, grouped_lowrank.rank(cfg)
  w_gND = p["w_o"].reshape(g, H // g * V, D)
  parts = [_factor(w_gND[i], r) for i in range(g)]
  lost = sum(part[2] for part in parts)
  total = sum(part[3] for part in parts)
  out = {n: a for n, a in p.items() if n != "w_o"}
  out.update(w_oa=jnp.stack([part[0] for part in parts]),
             w_ob=jnp.concatenate([part[1] for part in parts], axis=0))
  return out, jnp.sqrt(lost / jnp.maximum(total, 1e-30))


_KV_NAMES = ("w_k", "w_v", "b_k", "b_v")


def _kv_axis(name: str) -> int:
  return 1 if name.startswith("w_") else 0


@register("per_head", "per_head", exact=True, kv_heads="more")
def repeat_kv_heads(p: Params, cfg: HeadConfig, dst_cfg: HeadConfig) -> tuple[Params, float]:
  """Each kv head repeated G'/G times: every new group lies inside one old group."""
  f = dst_cfg.num_kv_heads // cfg.num_kv_heads
  return p | {n: jnp.repeat(p[n], f, axis=_kv_axis(n)) for n in _KV_NAMES if n in p}, 0.0


@register("per_head", "per_head", exact=False, kv_heads="fewer")
def mean_pool_kv_heads(p: Params, cfg: HeadConfig, dst_cfg: HeadConfig) -> tuple[Params, float]:
  """Mean of the G/G' kv heads that merge into one (Ainslie et al. 2023, GQA uptraining)."""
  G, f = dst_cfg.num_kv_heads, cfg.num_kv_heads // dst_cfg.num_kv_heads
  out, lost, total = dict(p), 0.0, 0.0
  for n in (n for n in _KV_NAMES if n in p):
    a, axis = p[n], _kv_axis(n)
    pooled = a.reshape(a.shape[:axis] + (G, f) + a.shape[axis + 1:]).mean(axis + 1)
    out[n] = pooled
    lost += jnp.sum((a - jnp.repeat(pooled, f, axis=axis)) ** 2)
    total += jnp.sum(a ** 2)
  return out, jnp.sqrt(lost / jnp.maximum(total, 1e-30))


def available() -> list[str]:
  """'src -> dst (exact|lossy)' for every direct converter and regrouper."""
  found = list(CONVERTERS.values()) + list(REGROUPERS.values())
  return sorted(f"{c.name} ({'exact' if c.exact else 'lossy'})" for c in found)


def _path(src: str, dst: str) -> list[Converter]:
  if src == dst:
    return []
  if (src, dst) in CONVERTERS:
    return [CONVERTERS[(src, dst)]]
  if (src, "per_head") in CONVERTERS and ("per_head", dst) in CONVERTERS:
    return [CONVERTERS[(src, "per_head")], CONVERTERS[("per_head", dst)]]
  raise invalid("conversion", f"{src} -> {dst}",
                "one of the direct conversions " + "; ".join(available())
                + ", or two of them composed through per_head")


def _check_dst_cfg(cfg: HeadConfig, dst_cfg: HeadConfig) -> None:
  """dst_cfg may differ from cfg only in num_kv_heads, by a whole factor."""
  if not isinstance(dst_cfg, HeadConfig):
    raise invalid("dst_cfg", type(dst_cfg).__name__, "an attn.HeadConfig or None")
  for field in dataclasses.fields(HeadConfig):
    a, b = getattr(cfg, field.name), getattr(dst_cfg, field.name)
    if field.name != "num_kv_heads" and a != b:
      raise invalid(f"dst_cfg.{field.name}", b,
                    f"equal to cfg.{field.name}={a!r}: only num_kv_heads may change")
  G, G2 = cfg.num_kv_heads, dst_cfg.num_kv_heads
  if G2 % G and G % G2:
    raise invalid("dst_cfg.num_kv_heads", G2,
                  f"a multiple (repeat) or a divisor (mean-pool) of cfg.num_kv_heads={G}")


@functools.lru_cache(maxsize=256)
def _jitted(fn: Callable, **configs: HeadConfig) -> Callable:
  """fn with its configs bound, compiled once: one XLA program instead of many eager ops."""
  return jax.jit(functools.partial(fn, **configs))


def _step(c: Converter, **configs: HeadConfig) -> tuple[str, Callable, bool]:
  c.check(configs["cfg"])
  return c.name, _jitted(c.fn, **configs), c.is_exact(configs["cfg"])


def _plan(src: str, dst: str, cfg: HeadConfig,
          dst_cfg: HeadConfig) -> list[tuple[str, Callable, bool]]:
  """(name, params -> (params, error), exact) for each step from src at cfg to dst at dst_cfg."""
  if cfg.num_kv_heads == dst_cfg.num_kv_heads:
    return [_step(c, cfg=cfg) for c in _path(src, dst)]
  regroup = REGROUPERS["more" if dst_cfg.num_kv_heads > cfg.num_kv_heads else "fewer"]
  return ([_step(c, cfg=cfg) for c in _path(src, "per_head")]
          + [_step(regroup, cfg=cfg, dst_cfg=dst_cfg)]
          + [_step(c, cfg=dst_cfg) for c in _path("per_head", dst)])


def convert(params: Params, src: str, dst: str, cfg: HeadConfig, *,
            dst_cfg: HeadConfig | None = None, return_error: bool = False):
  """Params of variant `dst` (for dst_cfg, default cfg) computing the function of `params` of `src`.

  Exact when every step is; a lossy step warns. With return_error, returns
  (params, error), error being the largest relative error of any step.
  """
  dst_cfg = cfg if dst_cfg is None else dst_cfg
  check_config(src, config_for(src, cfg))  # a field only dst reads (o_groups) is not src's to refuse
  _value_norm(src, dst, config_for(src, cfg))
  _check_dst_cfg(cfg, dst_cfg)
  check_config(dst, config_for(dst, dst_cfg))
  check_params(src, params, config_for(src, cfg))
  # Head mechanisms (gates, sinks, QK-norm scales) act on query heads, d_k-wide heads or the
  # core, the same in every variant: they cross unchanged, and the steps see the rest.
  params, carried = mechanisms.split(params)
  error = 0.0
  for name, step, exact in _plan(src, dst, cfg, dst_cfg):
    params, err = step(params)
    err = float(err)
    if not exact and err > TOLERANCE:
      warnings.warn(f"{name} is lossy here: relative error {err:.3g}",
                    LossyConversionWarning, stacklevel=2)
    error = max(error, err)
  params = dict(params) | _regroup_carried(carried, cfg.num_kv_heads, dst_cfg.num_kv_heads)
  return (params, error) if return_error else params


def _regroup_carried(carried: Params, G: int, G2: int) -> Params:
  """Mechanism parameters with a kv-head axis first (letters "G...": qk_norm "whole"'s k scales)
  follow the kv heads: repeated (more; exact, as the repeated keys) or mean-pooled (fewer)."""
  out = dict(carried)
  for n, axes in mechanisms.letters().items():
    if n in out and axes and axes[0] == "G" and G != G2:
      a = out[n]
      out[n] = jnp.repeat(a, G2 // G, axis=0) if G2 > G else a.reshape((G2, G // G2) + a.shape[1:]).mean(1)
  return out
