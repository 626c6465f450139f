"""Cross-layer KV sharing: ModelConfig.kv_source, one entry per layer, the layer whose keys and
values it attends to (Brandon et al. 2024; Gemma 4's num_kv_shared_layers).

  kv_source = [0, 1, 1, 1]   layers 2 and 3 attend to layer 1's keys and values

Entry i is i for a layer with its own keys and values, or an earlier layer j < i that has its
own (kv_source[j] = j) and the same head (sizes, window, RoPE: ModelConfig.layer_head equal but
for the layer index). A sharing layer computes its queries from its own input and attends to
layer j's keys and values as layer j attends to them: rotated at their positions, under the
same masks. While decoding it holds no cache: it reads what layer j's cache gave layer j in the
same step, so the cache holds each shared pair once (attn.count.model counts no cache bytes for
a sharing layer). Nor does it hold key-side weights (KEY_SIDE: w_k, w_v, their biases, k_eq_v's w_kv,
the key norm's scale), as in Gemma 4's checkpoints: its module drops them (attn.nn.models._blocks)
and passes zeros in their place, which no output depends on (XLA drops their matmuls); counts leave
them out (dropped). A variant whose key-side weights have other names (fused's packed w_qkv) keeps
them, unused.

How: base.cached_kv's second hook (base.KV_SHARE), set by run_blocks around each layer:
a source layer records the keys and values it attends to, a sharing layer replaces its own
with them. Only variants whose keys and values reach base.cached_kv share in the full pass
and the cached one (reaches_cached_kv finds out on abstract arrays): per_head, fused, k_eq_v (its
rotated keys and normed values), ...; not mla or tpa, whose cached pass reads their own entries (the
absorbed latent, the factors), nor the fixed-state heads. 
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Any

import jax
import jax.numpy as jnp

from attn import api
from attn.config import HeadConfig, invalid
from attn.variants import cache as kv_cache
from attn.variants.base import KV_SHARE, Options

# The keys and values each source layer attended to in the current model call: layer -> (k, v).
SEEN: contextvars.ContextVar = contextvars.ContextVar("attn_kv_seen", default=None)


def normalize(value: Any) -> Any:
  """kv_source as a tuple (TOML and JSON give lists); other values are left for check()."""
  return tuple(value) if isinstance(value, list) else value


def source(m: Any, index: int) -> int:
  """The layer whose keys and values layer `index` attends to (itself without kv_source)."""
  return index if m.kv_source is None else m.kv_source[index]


def check(m: Any) -> None:
  """Refuses a schedule that shares with a later layer, a sharing layer, or another head."""
  src = m.kv_source
  if src is None:
    return
  if not isinstance(src, tuple) or not all(isinstance(s, int) and not isinstance(s, bool) for s in src):
    raise invalid("kv_source", src, f"None or a list of {m.num_layers} layer indices")
  if len(src) != m.num_layers:
    raise invalid("kv_source", f"{len(src)} entries", f"one per layer: num_layers={m.num_layers}")
  if m.num_decoder_layers:
    raise invalid("num_decoder_layers", m.num_decoder_layers, "0 with kv_source: a decoder-only stack")
  for i, s in enumerate(src):
    if s == i:
      continue
    where = f"kv_source[{i}]"
    name = m.layer_variant(i) if hasattr(m, "layer_variant") else m.variant
    if m.layer_head(i).qkv_conv is not None:
      raise invalid("qkv_conv", m.layer_head(i).qkv_conv, f"None with kv_source (layer {i} reads layer {s}'s "
                    "keys and values): a sharing layer holds no cache, so no convolution state to decode with")
    if m.layer_head(i).cca:
      raise invalid("cca", True, f"False with kv_source (layer {i} reads layer {s}'s keys and values): cca mixes "
                    "each layer's own queries and keys and keeps their convolution state, which a sharing layer lacks")
    if not reaches_cached_kv(name, m.layer_head(i).replace(layer=1)):
      raise invalid("variant", name, "one whose keys and values reach base.cached_kv for kv_source: "
                    f"{name} attends to its own cache entries or state, so no layer can read another's")
    if not 0 <= s < i:
      raise invalid(where, s, f"{i} (its own keys and values) or an earlier layer in [0, {i}): a layer "
                    "attends to keys and values already computed")
    if src[s] != s:
      raise invalid(where, s, f"a layer with its own keys and values: layer {s} reads layer {src[s]}'s")
    a, b = m.layer_head(i).replace(layer=1), m.layer_head(s).replace(layer=1)
    if hasattr(m, "layer_variant") and m.layer_variant(s) != name:
      raise invalid(where, s, f"a layer of the same variant: layer {s} is {m.layer_variant(s)}, layer {i} {name}")
    if a != b:
      diff = [n for n in a.to_dict() if getattr(a, n) != getattr(b, n)]
      raise invalid(where, s, f"a layer with the same head: layer {s} differs from layer {i} in {diff}")


# The parameters a sharing layer does not hold, where its variant has them: the key and value side's.
KEY_SIDE = ("w_k", "w_v", "b_k", "b_v", "w_kv", "b_kv", "k_norm", "k_norm_whole")


@functools.lru_cache(maxsize=256)
def dropped(name: str, head: HeadConfig) -> dict[str, jax.ShapeDtypeStruct]:
  """The KEY_SIDE parameters of variant `name` at `head` (their shapes): what a sharing layer drops."""
  shapes = jax.eval_shape(lambda: api.init(name, jax.random.key(0), head))
  return {n: s for n, s in shapes.items() if n in KEY_SIDE}


def dropped_count(name: str, head: HeadConfig) -> int:
  """How many numbers a sharing layer of variant `name` does not hold (dropped)."""
  total = 0
  for s in dropped(name, head).values():
    n = 1
    for d in s.shape:
      n *= d
    total += n
  return total


def with_dropped(params: dict, name: str, head: HeadConfig) -> dict:
  """A sharing layer's parameters with zeros in place of those it does not hold (apply reads them;
  the sharing hook discards what they compute)."""
  missing = {n: jnp.zeros(s.shape, next(iter(params.values())).dtype)
             for n, s in dropped(name, head).items() if n not in params}
  return dict(params) | missing


def last_layers(types: tuple[str, ...], n: int, field: str = "num_kv_shared_layers") -> tuple[int, ...] | None:
  """kv_source for Gemma 4's rule: the last n layers each read the last layer before them of the same
  type with its own keys and values (transformers' kv_sharing_modes); None for n = 0. A type among
  the last n that no earlier layer has, or n outside [0, len(types)), is refused by name (field)."""
  L = len(types)
  if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n < max(L, 1):
    raise invalid(field, n, f"an integer in [0, {L}): the last layers read earlier layers' keys and "
                  "values, so at least one layer computes its own")
  if n == 0:
    return None
  first = L - n
  out = list(range(L))
  for i in range(first, L):
    own = [j for j in range(first) if types[j] == types[i]]
    if not own:
      raise invalid(field, n, f"at most {L - i - 1}: layer {i} "
                    f"({types[i]}) would share with no earlier {types[i]} layer")
    out[i] = own[-1]
  return tuple(out)


@functools.lru_cache(maxsize=256)
def reaches_cached_kv(name: str, head: HeadConfig) -> bool:
  """Whether variant `name` hands the keys and values it attends to to base.cached_kv (where sharing
  acts) in its full pass and, if it caches its own entries, in its cached pass too; found by running
  both on abstract arrays (jax.eval_shape: no numbers computed)."""
  record = api.get_variant(name)
  if getattr(record, "step", None) is not None:
    return False
  seen = []

  def probe(k, v):
    seen.append(True)
    return k, v

  def run(use_cache: bool):
    params = api.init(name, jax.random.key(0), head)
    x_BTD = jnp.zeros((1, 2, head.d_model), jnp.float32)
    opts = Options(qk_positions=(jnp.arange(2), jnp.arange(2)))
    if not use_cache:
      return record.apply(params, x_BTD, cfg=head, opts=opts)
    return record.attend_cached(params, x_BTD, record.cache_entries(params, x_BTD, cfg=head, opts=opts),
                                cfg=head, opts=opts)

  token = KV_SHARE.set(probe)
  try:
    for use_cache in (False, True) if record.cache_entries is not None else (False,):
      seen.clear()
      jax.eval_shape(lambda: run(use_cache))
      if not seen:
        return False
  finally:
    KV_SHARE.reset(token)
  return True


def shared_layers(m: Any, n: int) -> int:
  """How many of the first n layers read another layer's keys and values."""
  return 0 if m.kv_source is None else sum(s != i for i, s in enumerate(m.kv_source[:n]))


@contextlib.contextmanager
def layer(module: Any, index: int):
  """Around layer `index`'s call: records its keys and values if others read them, or gives it
  its source's. A no-op outside a model call with sharing (SEEN unset)."""
  seen = SEEN.get()
  src = getattr(module, "kv_source", index)
  if seen is None or (src == index and index not in seen.get("sources", ())):
    yield
    return
  if src != index:
    hook = lambda k, v: seen[src]
  else:
    def hook(k, v):
      seen[index] = (k, v)
      return k, v
  token = KV_SHARE.set(hook)
  try:
    yield
  finally:
    KV_SHARE.reset(token)


@contextlib.contextmanager
def model_call(blocks):
  """Around one call of a stack of blocks: a fresh record of the source layers' keys and values."""
  sources = {getattr(b.attn, "kv_source", None) for b in blocks} - {None}
  if not sources:
    yield
    return
  token = SEEN.set({"sources": sources})
  try:
    yield
  finally:
    SEEN.reset(token)


def decode(module: Any, x_BTD: jax.Array, head_mask) -> jax.Array:
  """A sharing layer's decode step: its queries against the keys and values its source attended
  to in this step, under the same mask (attn.variants.cache.decode_step's)."""
  cfg, T = module.cfg, x_BTD.shape[1]
  index, max_len = module.cache_index[...], module.cache_max_len
  pos_T = index + jnp.arange(T)
  if cfg.window is None:
    mask, step_cfg = kv_cache.causal_mask(index, T, max_len), cfg
  else:
    n_slots = kv_cache.slots(cfg, max_len)
    mask, step_cfg = kv_cache.ring_mask(index, T, n_slots, cfg.window), cfg.replace(window=None)
  opts = Options(mask=mask, head_mask=head_mask, qk_positions=(pos_T, pos_T))
  params, x_BTD, _ = module._compute(x_BTD)
  y_BTD, _ = module.record.apply(params, x_BTD, cfg=step_cfg, opts=opts)
  module.cache_index[...] = index + T
  return y_BTD
