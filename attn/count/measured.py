"""Figures of a layer measured rather than given in closed form, for records that do not declare them.

attn.count uses these when a variant (or an active head mechanism) leaves a
closed form out, and labels each such figure "measured":

  stored       the elements of attn.init's tree, from its shapes (always measured);
  flops        XLA's cost analysis of the jitted forward (and forward+backward) pass before
               optimisation, batch 1: it also counts bias adds and softmax, a few ops per score;
  kv width     the numbers decoding caches per token (attn.variants.cache.init's entries);
  score weights  the non-bias weights whose gradient through the attention weights is nonzero;
  effective    the rank of the Jacobian of the outputs on random inputs w.r.t. every
               parameter; only for layers of at most JACOBIAN_MAX_PARAMS parameters (None above).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from attn import api
from attn.config import HeadConfig
from attn.variants import cache, mechanisms

JACOBIAN_MAX_PARAMS = 1500
RANK_TOL = 1e-6  # singular values below this fraction of the largest are round-off (float32)


def stored(variant: str, cfg: HeadConfig) -> int:
  """Elements of the parameter tree attn.init makes (read from its shapes)."""
  return sum(math.prod(shape) for shape in api.param_shapes(variant, cfg).values())


def _shaped_params(variant: str, cfg: HeadConfig) -> dict[str, jax.ShapeDtypeStruct]:
  return {n: jax.ShapeDtypeStruct(s, jnp.float32) for n, s in api.param_shapes(variant, cfg).items()}


def _flops_of(cost) -> int | None:
  cost = cost[0] if isinstance(cost, (list, tuple)) and cost else cost
  return int(cost["flops"]) if isinstance(cost, dict) and "flops" in cost else None


def xla_flops(f, *args) -> int:
  """XLA's count of floating-point operations of f(*args), from the HLO before optimisation.

  Not compiled: the optimised module counts an elementwise producer once per fusion it is
  duplicated into (the fixed-state heads' norms and gates: up to 30% over, tests/
  test_linear_flops.py), while every softmax variant's two counts agree within 1%. The compiled
  count where a backend gives none before optimisation.
  """
  lowered = jax.jit(f).lower(*args)
  flops = _flops_of(lowered.cost_analysis())
  return flops if flops is not None else _flops_of(lowered.compile().cost_analysis())


def flops(variant: str, cfg: HeadConfig, T: int, S: int, backward: bool = False) -> int:
  """XLA's FLOPs of one layer's forward (or forward+backward) pass, per batch element."""
  v = api.get_variant(variant)
  x = jax.ShapeDtypeStruct((1, T, cfg.d_model), jnp.float32)
  c = jax.ShapeDtypeStruct((1, S, cfg.d_model), jnp.float32)
  f = lambda p, x, c: _call(v, p, x, c, cfg)
  if not backward:
    return xla_flops(f, _shaped_params(variant, cfg), x, c)

  def fwd_bwd(p, x, c):
    y, vjp = jax.vjp(f, p, x, c)
    return y, vjp(y)

  return xla_flops(fwd_bwd, _shaped_params(variant, cfg), x, c)


def kv_cache_width(variant: str, cfg: HeadConfig) -> int:
  """Numbers a decoder caches per token: the entries of attn.variants.cache.init, per slot."""
  v = api.get_variant(variant)
  if v.init_state is not None:
    return 0  # a fixed-size state (state_size below), nothing per token
  shapes = jax.eval_shape(lambda p: cache.init(v, p, cfg.replace(window=None), 1, 1),
                          _shaped_params(variant, cfg))
  state = mechanisms.state_shapes(cfg)  # a mechanism's per-sequence state (qkv_conv), not per token
  return sum(math.prod(s.shape[2:]) for name, s in shapes.items() if name not in state)


def state_size(variant: str, cfg: HeadConfig) -> int:
  """Numbers of one sequence's decoding state (0 for a head with a KV cache instead)."""
  v = api.get_variant(variant)
  if v.init_state is None:
    return 0
  shapes = jax.eval_shape(lambda: v.init_state(cfg, 1))
  return sum(math.prod(s.shape[1:]) for s in shapes.values())


def _call(v, p, x, c, cfg: HeadConfig):
  """y of one layer; a fixed-state head (causal self-attention only) without the context."""
  if v.init_state is not None:
    return v.apply(p, x, None, cfg=cfg, opts=api.Options(is_causal=True))[0]
  return v.apply(p, x, c, cfg=cfg, opts=api.Options())[0]


def score_weights(variant: str, cfg: HeadConfig) -> int:
  """Non-bias weights (names not starting with b) that move the attention weights."""
  v = api.get_variant(variant)
  # A generic point: every leaf random at its fan-in's scale, drawn on the host (attn.init's eager draws
  # compile a program per leaf shape).
  rng = np.random.default_rng(7)
  draw = lambda shape, scale=1.0: jnp.asarray((scale * rng.standard_normal(shape)).astype(np.float32))
  params = {n: draw(s, 1.0 / math.sqrt(math.prod(s) // s[-1] if s else 1))
            for n, s in sorted(api.param_shapes(variant, cfg).items())}
  x, r = draw((1, 5, cfg.d_model)), draw((1, cfg.num_heads, 5, 5))
  opts = api.Options(return_weights=True)
  grads = jax.jit(jax.grad(lambda p: (v.apply(p, x, None, cfg=cfg, opts=opts)[1] * r).sum()))(params)
  return sum(int((jnp.abs(g) > 0).sum()) for k, g in grads.items() if not k.startswith("b"))


def jacobian_rank(variant: str, cfg: HeadConfig, seed: int = 1) -> int:
  """Rank of d(outputs on random inputs)/d(parameters) at random parameters: the local dimension
  of the function class, i.e. the effective count."""
  v = api.get_variant(variant)
  rng = np.random.default_rng(seed)
  # Every leaf N(0, 0.2²): small weights keep the softmax unsaturated and products well conditioned.
  params = {k: jnp.asarray(0.2 * rng.standard_normal(s), jnp.float32)
            for k, s in sorted(api.param_shapes(variant, cfg).items())}
  flat, unravel = ravel_pytree(params)
  batch = max(12, -(-3 * flat.size // (5 * cfg.d_model)))  # 3x more outputs than parameters
  x_BTD = jnp.asarray(rng.standard_normal((batch, 5, cfg.d_model)), jnp.float32)
  f = lambda w: _call(v, unravel(w), x_BTD, None, cfg).ravel()
  J = np.asarray(jax.jit(jax.jacfwd(f))(flat), np.float64)
  s = np.sqrt(np.clip(np.linalg.eigvalsh(J.T @ J)[::-1], 0.0, None))  # singular values, P×P work
  return int((s > RANK_TOL * s[0]).sum())


def effective(variant: str, cfg: HeadConfig) -> int | None:
  """The Jacobian's rank, for layers small enough to measure it; None above JACOBIAN_MAX_PARAMS."""
  if stored(variant, cfg) > JACOBIAN_MAX_PARAMS:
    return None
  return jacobian_rank(variant, cfg)
