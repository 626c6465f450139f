"""Conversions between variants through the canonical per_head layout.

Each converter maps params of one variant to params of another for the same
HeadConfig. Exact ones give the same function (tests hold them to 1e-5);
lossy ones say so: `convert(..., return_error=True)` gives the relative
Frobenius error of what was discarded, and they warn with it.
A conversion not listed here is composed through per_head when both halves
exist; anything else is an error that lists what does exist.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax.numpy as jnp

from attn.api import check_config, check_params
from attn.config import HeadConfig, invalid
from attn.variants.base import Params


class LossyConversionWarning(UserWarning):
  """A conversion that could not keep the function exactly; the message gives the error."""


@dataclasses.dataclass(frozen=True)
class Converter:
  fn: Callable[[Params, HeadConfig], tuple[Params, float]]
  exact: bool


CONVERTERS: dict[tuple[str, str], Converter] = {}


def register(src: str, dst: str, *, exact: bool):
  def wrap(fn):
    CONVERTERS[(src, dst)] = Converter(fn, exact)
    return fn
  return wrap


@register("per_head", "fused", exact=True)
def per_head_to_fused(p: Params, cfg: HeadConfig) -> tuple[Params, float]:
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


def available() -> list[str]:
  """'src -> dst (exact|lossy)' for every direct converter."""
  return [f"{s} -> {d} ({'exact' if c.exact else 'lossy'})" for (s, d), c in sorted(CONVERTERS.items())]


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


def convert(params: Params, src: str, dst: str, cfg: HeadConfig, *,
            return_error: bool = False):
  """Params of variant `dst` computing the same function as `params` of `src` (exactly when possible)."""
  check_config(src, cfg)
  check_config(dst, cfg)
  check_params(src, params, cfg)
  steps = _path(src, dst)
  error = 0.0
  for step in steps:
    params, err = step.fn(params, cfg)
    error = max(error, float(err))
  return (params, error) if return_error else params
