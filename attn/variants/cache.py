"""KV-cache decoding over any variant: what a layer caches per token, and one decode step.

A cache is a dict of (B, max_len, ...) arrays plus a fill index shared by the
batch. By default (base.Variant's docstring) it holds "k" and "v", the keys
(already rotated at their own positions) and values that the variant's apply
hands to attend_and_project: `decode_step` runs apply on the new tokens with a
hook (base.KV_HOOK) that writes their k and v into the cache and returns the
whole cache to attend to. A variant with `cache_entries` and `attend_cached`
(mla: the latent and the RoPE key) is called through those instead.

The mask of a decode step is causal against the cache fill: the query at
position p sees cache slots s ≤ p; slots past the fill are never seen.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attn.config import HeadConfig
from attn.variants.base import KV_HOOK, Options, Params, Variant

Array = jax.Array


def _with_hook(hook, f, *args, **kwargs):
  token = KV_HOOK.set(hook)
  try:
    return f(*args, **kwargs)
  finally:
    KV_HOOK.reset(token)


def entries(variant: Variant, params: Params, x_BTD: Array, *, cfg: HeadConfig,
            positions: Array) -> dict[str, Array]:
  """What the layer caches for x's tokens at `positions` (T,): a dict of (B,T,...) arrays."""
  opts = Options(qk_positions=(positions, positions))
  if variant.cache_entries is not None:
    return variant.cache_entries(params, x_BTD, cfg=cfg, opts=opts)
  seen = {}

  def capture(k_BTGK, v_BTGV):
    seen.update(k=k_BTGK, v=v_BTGV)
    return k_BTGK, v_BTGV

  _with_hook(capture, variant.apply, params, x_BTD, cfg=cfg, opts=opts)
  return seen


def init(variant: Variant, params: Params, cfg: HeadConfig, batch_size: int, max_len: int,
         dtype=jnp.float32) -> dict[str, Array]:
  """An empty cache: zeros of (batch_size, max_len, ...) for each entry the layer caches."""
  x_shape = jax.ShapeDtypeStruct((batch_size, 1, cfg.d_model), dtype)
  shapes = jax.eval_shape(lambda x: entries(variant, params, x, cfg=cfg,
                                            positions=jnp.zeros((1,), jnp.int32)), x_shape)
  return {name: jnp.zeros((batch_size, max_len, *s.shape[2:]), s.dtype)
          for name, s in shapes.items()}


def width(cache: dict[str, Array]) -> int:
  """Numbers cached per token: the sum over entries of their per-token sizes."""
  total = 0
  for a in cache.values():
    n = 1
    for d in a.shape[2:]:
      n *= d
    total += n
  return total


def causal_mask(index, T: int, max_len: int) -> Array:
  """(1,1,T,max_len): the query at position index + t sees cache slots s ≤ index + t."""
  pos_T = index + jnp.arange(T)
  return (jnp.arange(max_len)[None, :] <= pos_T[:, None])[None, None]


def decode_step(variant: Variant, params: Params, x_BTD: Array, cache: dict[str, Array], index,
                *, cfg: HeadConfig, head_mask=None) -> tuple[Array, dict[str, Array]]:
  """y (B,T,D) for x's tokens at positions index..index+T−1, and the cache with them written.

  The caller checks index + T ≤ max_len (under jit, index is traced and
  dynamic_update_slice would clamp instead of failing).
  """
  T = x_BTD.shape[1]
  max_len = next(iter(cache.values())).shape[1]
  pos_T = index + jnp.arange(T)
  opts = Options(mask=causal_mask(index, T, max_len), head_mask=head_mask,
                 qk_positions=(pos_T, pos_T))

  def write(name, new):
    return jax.lax.dynamic_update_slice_in_dim(cache[name], new.astype(cache[name].dtype),
                                               index, axis=1)

  if variant.cache_entries is not None:
    new = entries(variant, params, x_BTD, cfg=cfg, positions=pos_T)
    full = {name: write(name, a) for name, a in new.items()}
    y_BTD = variant.attend_cached(params, x_BTD, full, cfg=cfg, opts=opts)
    return y_BTD, full
  full = {}

  def swap(k_BTGK, v_BTGV):
    full.update(k=write("k", k_BTGK), v=write("v", v_BTGV))
    return full["k"], full["v"]

  y_BTD, _ = _with_hook(swap, variant.apply, params, x_BTD, cfg=cfg, opts=opts)
  return y_BTD, full
