"""The variant contract, and the pieces every variant shares.

A variant is a parameterization of one multi-head attention layer over a plain
dict of arrays. Its `apply(params, x_BTD, context_BSD, *, cfg, mask,
return_weights)` returns `(y_BTD, weights_BHTS or None)`; `context_BSD` is
None for self-attention. Counts are per layer; FLOPs count a multiply-add as
2 and are per batch element, forward only, for T queries and S keys.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from attn.config import HeadConfig

Array = jax.Array
Params = dict[str, Array]


def _no_constraint(cfg: HeadConfig) -> None:
  del cfg


@dataclasses.dataclass(frozen=True)
class Variant:
  """One head parameterization: init / apply / analytic counts / FLOPs."""

  name: str
  doc: str
  init: Callable[[Array, HeadConfig, Any], Params]
  apply: Callable[..., tuple[Array, Array | None]]
  param_count: Callable[[HeadConfig], int]
  effective_param_count: Callable[[HeadConfig], int]
  flops: Callable[[HeadConfig, int, int], int]
  check: Callable[[HeadConfig], None] = _no_constraint


def normal(key: Array, shape: tuple[int, ...], fan_in: int, dtype=jnp.float32) -> Array:
  """Weights ~ N(0, 1/fan_in) (LeCun normal), the scale that keeps activations O(1)."""
  return (jax.random.normal(key, shape, jnp.float32) / jnp.sqrt(fan_in)).astype(dtype)


def zeros(shape: tuple[int, ...], dtype=jnp.float32) -> Array:
  return jnp.zeros(shape, dtype)


def add_bias(params: Params, cfg: HeadConfig, shapes: dict[str, tuple[int, ...]],
             dtype=jnp.float32) -> Params:
  """Adds zero biases of the given shapes when cfg.use_bias."""
  if cfg.use_bias:
    params.update({name: zeros(shape, dtype) for name, shape in shapes.items()})
  return params


def bias(params: Params, name: str):
  """The bias named, or 0 when the layer has none (use_bias=False)."""
  return params.get(name, 0.0)


def project_heads(x_BTD: Array, w_DHK: Array, b_HK) -> Array:
  """Per-head projection of all heads in one einsum: (B,T,H,K)."""
  return jnp.einsum("BTD,DHK->BTHK", x_BTD, w_DHK) + b_HK


def output_projection(o_BTHV: Array, w_HVD: Array, b_D) -> Array:
  """Concatenate heads and project back to d_model: sum over h of o_h W_O,h."""
  return jnp.einsum("BTHV,HVD->BTD", o_BTHV, w_HVD) + b_D


def standard_param_count(cfg: HeadConfig) -> int:
  """D(HK + GK + GV) + HVD weights, plus HK + GK + GV + D biases."""
  D, H, G, K, V = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_k, cfg.d_v
  weights = D * (H * K + G * K + G * V) + H * V * D
  biases = H * K + G * K + G * V + D
  return weights + (biases if cfg.use_bias else 0)


def core_flops(cfg: HeadConfig, T: int, S: int) -> int:
  """Scores 2·T·S·H·K plus weighted sum 2·T·S·H·V (softmax not counted)."""
  return 2 * T * S * cfg.num_heads * (cfg.d_k + cfg.d_v)


def standard_flops(cfg: HeadConfig, T: int, S: int) -> int:
  """Projections 2·D·(T·HK + S·GK + S·GV) + output 2·T·HV·D + attention core."""
  D, H, G, K, V = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_k, cfg.d_v
  proj = 2 * D * (T * H * K + S * G * K + S * G * V) + 2 * T * H * V * D
  return proj + core_flops(cfg, T, S)


def head_bias(params: Params, name: str, index: int):
  """Row `index` of a per-head bias (H,K)-like array, or 0 without biases."""
  return params[name][index] if name in params else 0.0


def head_mask(mask, h: int):
  """The slice of a (B,H or 1,T,S)-broadcastable mask that head h sees, keeping a head axis of 1."""
  if mask is None or mask.ndim < 4 or mask.shape[1] == 1:
    return mask
  return mask[:, h:h + 1]
