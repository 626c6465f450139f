"""KV-cache decoding over any variant: what a layer caches per token, and one decode step.

A cache is a dict of (B, max_len, ...) arrays plus a fill index shared by the
batch. By default (base.Variant's docstring) it holds "k" and "v", the keys
(already rotated at their own positions) and values that the variant's apply
hands to attend_and_project: `decode_step` runs apply on the new tokens with a
hook (base.KV_HOOK) that writes their k and v into the cache and returns the
whole cache to attend to. A variant with `cache_entries` and `attend_cached`
(mla: the latent and the RoPE key) is called through those instead; attend_cached's
opts.qk_positions are (the new tokens' positions, the position each cache slot holds),
so a variant that caches keys unrotated (k_eq_v) rotates them there.

The mask of a decode step is causal against the cache fill: the query at
position p sees cache slots s ≤ p; slots past the fill are never seen.

A layer with a window (cfg.window = W) needs only the last W tokens: its
cache is a ring of min(W, max_len) slots, position p in slot p mod slots. A
step attends to the ring as it was plus its own new tokens (ring_mask gives
what each query sees, by position), then writes the new tokens over the
oldest slots, so a step longer than the ring (a prompt) is exact too. The
variant then runs with window=None: the mask already holds the window.

A mechanism with a decoding state (Mechanism.state: qkv_conv's last projections) adds its entries
after the per-token ones, (B, ...) arrays whatever max_len; a step runs with them in
mechanisms.DECODE_STATE and returns them replaced (width(cache, cfg) leaves them out).

A variant with its own cache (Variant.init_cache and decode_cached: compressed) is called
through those. A head with a fixed-size state (Variant.init_state and step; attn.variants.linear) has no
per-token cache: init gives its state, (B, ...) arrays whatever max_len, and decode_step runs
`step` from it; the index only counts tokens (the model's bound on max_len).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attn.config import HeadConfig, invalid
from attn.variants import mechanisms
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


def slots(cfg: HeadConfig, max_len: int) -> int:
  """Token slots a layer's cache holds for max_len positions: max_len, or its window's ring."""
  return max_len if cfg.window is None else min(cfg.window, max_len)


def init(variant: Variant, params: Params, cfg: HeadConfig, batch_size: int, max_len: int,
         dtype=jnp.float32) -> dict[str, Array]:
  """An empty cache: zeros of (batch_size, slots(cfg, max_len), ...) for each entry it caches
  (a fixed-state head: its state before the first token)."""
  if variant.cache_kind == "state":
    return variant.init_state(cfg, batch_size, dtype)
  if variant.cache_kind == "own":
    return variant.init_cache(params, cfg, batch_size, max_len, dtype)
  x_shape = jax.ShapeDtypeStruct((batch_size, 1, cfg.d_model), dtype)
  shapes = jax.eval_shape(lambda x: entries(variant, params, x, cfg=cfg,
                                            positions=jnp.zeros((1,), jnp.int32)), x_shape)
  out = {name: jnp.zeros((batch_size, slots(cfg, max_len), *s.shape[2:]), s.dtype)
         for name, s in shapes.items()}
  # A mechanism's decoding state (qkv_conv's last projections), after the per-token entries.
  return out | {name: jnp.zeros((batch_size, *shape), dtype) for name, shape in mechanisms.state_shapes(cfg).items()}


def _with_state(layer_cfg: HeadConfig, cache: dict[str, Array], f, *args, **kwargs):
  """(f's result, the mechanisms' decoding state after it): f runs with the cache's state entries in
  mechanisms.DECODE_STATE, which the hooks (on_qkv) replace."""
  names = mechanisms.state_shapes(layer_cfg)
  if not names:
    return f(*args, **kwargs), {}
  state = {name: cache[name] for name in names}
  token = mechanisms.DECODE_STATE.set(state)
  try:
    return f(*args, **kwargs), state
  finally:
    mechanisms.DECODE_STATE.reset(token)


def width(cache: dict[str, Array], cfg: HeadConfig | None = None) -> int:
  """Numbers cached per token: the sum over entries of their per-token sizes (with cfg, its mechanisms'
  per-sequence decoding state left out)."""
  state = mechanisms.state_shapes(cfg) if cfg is not None else {}
  total = 0
  for name, a in cache.items():
    if name in state:
      continue
    n = 1
    for d in a.shape[2:]:
      n *= d
    total += n
  return total


def causal_mask(index, T: int, max_len: int) -> Array:
  """(1,1,T,max_len): the query at position index + t sees cache slots s ≤ index + t."""
  pos_T = index + jnp.arange(T)
  return (jnp.arange(max_len)[None, :] <= pos_T[:, None])[None, None]


def ring_positions(index, n_slots: int) -> Array:
  """(n_slots,): the position slot j holds before the step at `index` (negative: none yet)."""
  j = jnp.arange(n_slots)
  return j + n_slots * jnp.floor_divide(index - 1 - j, n_slots)


def ring_mask(index, T: int, n_slots: int, window: int) -> Array:
  """(1,1,T,n_slots+T): what the queries at index..index+T−1 see of [the ring | the new tokens].

  Slot j holds the latest position P_j < index with P_j ≡ j (mod n_slots),
  none when P_j < 0; a query at q sees it when q − P_j < window, and new
  token k when k ≤ its own t and t − k < window.
  """
  held_S = ring_positions(index, n_slots)
  q_T = index + jnp.arange(T)
  old_TS = (held_S >= 0)[None, :] & (q_T[:, None] - held_S[None, :] < window)
  t = jnp.arange(T)
  new_TT = (t[None, :] <= t[:, None]) & (t[:, None] - t[None, :] < window)
  return jnp.concatenate([old_TS, new_TT], axis=1)[None, None]


def _ring_step(variant: Variant, params: Params, x_BTD: Array, cache: dict[str, Array], index,
               *, cfg: HeadConfig, head_mask, kv_inputs=None) -> tuple[Array, dict[str, Array]]:
  """decode_step for a window layer: attend to [ring | new tokens], then write them in the ring."""
  T = x_BTD.shape[1]
  n_slots = token_slots(cache, cfg)
  pos_T = index + jnp.arange(T)
  step_cfg = cfg.replace(window=None)  # the ring's mask holds the window, by position
  opts = Options(mask=ring_mask(index, T, n_slots, cfg.window), head_mask=head_mask,
                 qk_positions=(pos_T, pos_T), kv_inputs=kv_inputs)
  m = min(T, n_slots)  # only the last m new tokens stay in the ring
  slot_M = (index + T - m + jnp.arange(m)) % n_slots

  def seen(name, new):
    return jnp.concatenate([cache[name], new.astype(cache[name].dtype)], axis=1)

  def write(name, new):
    return cache[name].at[:, slot_M].set(new[:, T - m:].astype(cache[name].dtype))

  if variant.cache_entries is not None:
    new = entries(variant, params, x_BTD, cfg=step_cfg, positions=pos_T)
    held = jnp.concatenate([ring_positions(index, n_slots), pos_T])
    y_BTD = variant.attend_cached(params, x_BTD, {n: seen(n, a) for n, a in new.items()},
                                  cfg=step_cfg, opts=opts.replace(qk_positions=(pos_T, held)))
    return y_BTD, {name: write(name, a) for name, a in new.items()}
  ring = {}

  def swap(k_BTGK, v_BTGV):
    ring.update(k=write("k", k_BTGK), v=write("v", v_BTGV))
    return seen("k", k_BTGK), seen("v", v_BTGV)

  held_S = jnp.concatenate([ring_positions(index, n_slots), pos_T])  # what the keys swap reads hold
  (y_BTD, _), state = _with_state(cfg, cache, _with_hook, swap, variant.apply, params, x_BTD, cfg=step_cfg,
                                  opts=opts.replace(key_positions=held_S))
  return y_BTD, ring | state


def token_slots(cache: dict[str, Array], cfg: HeadConfig) -> int:
  """The token slots of a cache's per-token entries (a mechanism's state, which jit may put first in the
  dict by its name, holds no tokens)."""
  state = mechanisms.state_shapes(cfg)
  return next(a for name, a in cache.items() if name not in state).shape[1]


def decode_step(variant: Variant, params: Params, x_BTD: Array, cache: dict[str, Array], index,
                *, cfg: HeadConfig, head_mask=None, kv_inputs=None) -> tuple[Array, dict[str, Array]]:
  """y (B,T,D) for x's tokens at positions index..index+T−1, and the cache with them written.

  The caller checks index + T ≤ max_len (under jit, index is traced and
  dynamic_update_slice would clamp instead of failing). A window layer's
  cache is a ring (module docstring).
  """
  if variant.step is not None:
    return variant.step(params, x_BTD, cache, cfg=cfg, opts=Options(is_causal=True,
                                                                     head_mask=head_mask))
  if variant.decode_cached is not None:
    return variant.decode_cached(params, x_BTD, cache, index, cfg=cfg, head_mask=head_mask)
  if kv_inputs is not None and (variant.step is not None or variant.decode_cached is not None
                                or variant.cache_entries is not None):
    raise invalid("kv_inputs", "given", f"None for {variant.name}: per_head alone reads them")
  if cfg.window is not None:
    return _ring_step(variant, params, x_BTD, cache, index, cfg=cfg, head_mask=head_mask, kv_inputs=kv_inputs)
  T = x_BTD.shape[1]
  max_len = token_slots(cache, cfg)
  pos_T = index + jnp.arange(T)
  opts = Options(mask=causal_mask(index, T, max_len), head_mask=head_mask,
                 qk_positions=(pos_T, pos_T), kv_inputs=kv_inputs)

  def write(name, new):
    return jax.lax.dynamic_update_slice_in_dim(cache[name], new.astype(cache[name].dtype),
                                               index, axis=1)

  if variant.cache_entries is not None:
    new = entries(variant, params, x_BTD, cfg=cfg, positions=pos_T)
    full = {name: write(name, a) for name, a in new.items()}
    y_BTD = variant.attend_cached(params, x_BTD, full, cfg=cfg,
                                  opts=opts.replace(qk_positions=(pos_T, jnp.arange(max_len))))
    return y_BTD, full
  full = {}

  def swap(k_BTGK, v_BTGV):
    full.update(k=write("k", k_BTGK), v=write("v", v_BTGV))
    return full["k"], full["v"]

  (y_BTD, _), state = _with_state(cfg, cache, _with_hook, swap, variant.apply, params, x_BTD, cfg=cfg,
                                  opts=opts.replace(key_positions=jnp.arange(max_len)))
  return y_BTD, full | state
