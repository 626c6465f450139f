"""The public functional API: init, apply and variant lookup, with checks before tracing."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from attn import kernel
from attn.config import (ConfigError, HeadConfig, check_head_mask, check_inputs, check_positions,
                         check_structured, invalid, kept_at)
from attn.variants import VARIANTS, mechanisms, rope
from attn.variants.base import Options, Params, Variant, check_offers

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(HeadConfig)}


def get_variant(name: str | Variant) -> Variant:
  """The registered variant `name` (a record is itself); an unknown name lists the known ones."""
  if isinstance(name, Variant):
    return name
  return VARIANTS.resolve(name, "variant")


def check_config(variant: str, cfg: HeadConfig) -> Variant:
  """The variant, once cfg is a HeadConfig that meets the variant's constraints."""
  v = get_variant(variant)
  if not isinstance(cfg, HeadConfig):
    raise invalid("cfg", type(cfg).__name__, "an attn.HeadConfig")
  mechanisms.check(cfg)
  _check_owned_fields(v, cfg)
  check_offers(v, cfg, VARIANTS.values())
  v.check(cfg)
  return v


def config_for(variant: str | Variant, cfg: HeadConfig) -> HeadConfig:
  """cfg with the fields other variants own (Variant.fields) and this one does not back at their
  unset values: the config of the same layer as this variant reads it (attn.convert's other side)."""
  v = get_variant(variant)
  names = {n for other in VARIANTS.values() for n in other.fields if n not in v.fields}
  return cfg.replace(**{n: _DEFAULTS[n] for n in sorted(names)}) if names else cfg


@functools.lru_cache(maxsize=1024)
def _check_owned_fields(v: Variant, cfg: HeadConfig) -> None:
  """Refuses a field another variant owns (Variant.fields), set away from its unset value: v ignores it."""
  for other in VARIANTS.values():
    for name in other.fields:
      if name in v.fields:
        continue
      if getattr(cfg, name) != _DEFAULTS[name]:
        owners = " and ".join(o.name for o in VARIANTS.values() if name in o.fields)
        raise invalid(name, getattr(cfg, name), f"{kept_at(_DEFAULTS[name])} for variant {v.name!r}: only "
                      f"{owners} read{'s' if ' and ' not in owners else ''} it, so it would be ignored")


def _init(v: Variant, key: jax.Array, cfg: HeadConfig, dtype) -> Params:
  # The mechanisms' parameters (cfg.gate, sinks, qk_norm) from a key of their own, so that
  # the variant's own parameters are the same with or without them.
  own = v.init(key, cfg, dtype)
  if not isinstance(own, dict) or not all(hasattr(a, "shape") for a in own.values()):
    raise invalid(f"{v.name}.init(...)", type(own).__name__, "a dict of arrays (name -> array)")
  return own | mechanisms.init(jax.random.fold_in(key, 1), cfg, dtype)


def init(variant: str | Variant, key: jax.Array, cfg: HeadConfig, dtype=jnp.float32) -> Params:
  """Fresh parameters of `variant` for cfg, as a plain dict of arrays (its head mechanisms' too)."""
  return _init(check_config(variant, cfg), key, cfg, dtype)


def param_shapes(variant: str | Variant, cfg: HeadConfig) -> dict[str, tuple[int, ...]]:
  """Name -> shape of the parameters `init` creates, without allocating them."""
  return dict(_param_shapes(check_config(variant, cfg), cfg))


@functools.lru_cache(maxsize=256)
def _param_shapes(v: Variant, cfg: HeadConfig) -> dict[str, tuple[int, ...]]:
  # Keyed by the record (records hash by identity), so a name registered again is read afresh.
  tree = jax.eval_shape(lambda k: _init(v, k, cfg, jnp.float32),
                        jax.ShapeDtypeStruct((2,), jnp.uint32))
  return {name: tuple(s.shape) for name, s in tree.items()}


def check_params(variant: str, params: Params, cfg: HeadConfig) -> None:
  """Params must have exactly the names and shapes `init` would create for cfg."""
  if not isinstance(params, dict):
    raise invalid("params", type(params).__name__, f"a dict of arrays made by attn.init({variant!r}, ...)")
  want = param_shapes(get_variant(variant), cfg)
  got = {name: tuple(getattr(a, "shape", ())) for name, a in params.items()}
  if set(got) != set(want):
    raise invalid("params", sorted(got), f"the keys {sorted(want)} of variant {variant!r} for this cfg")
  for name, shape in want.items():
    if got[name] != shape:
      raise invalid(f"params[{name!r}].shape", got[name], f"{shape} for variant {variant!r} and this cfg")


def options(cfg: HeadConfig, x, context=None, *, mask=None, return_weights: bool = False,
            head_mask=None, is_causal: bool = False, kv_lengths=None, positions=None,
            impl: str | None = None, kv_inputs=None) -> Options:
  """The validated Options of one call with attn.apply's keywords, checked before tracing.

  RoPE positions become (query positions, key positions): `positions` (or
  0..T−1) for the queries and, in self-attention, the keys; 0..S−1 for
  cross-attention keys.
  """
  check_inputs(cfg, x, context, mask)
  S = (x if context is None else context).shape[1]
  check_structured(is_causal, kv_lengths, x.shape[0], S)
  check_head_mask(head_mask, x.shape[0], cfg.num_heads)
  check_positions(positions, x.shape[0], x.shape[1])
  if not isinstance(return_weights, bool):
    raise invalid("return_weights", return_weights, "True or False")
  if impl is not None and impl not in kernel.IMPLS:
    raise invalid("impl", impl, f"None or one of {list(kernel.IMPLS)}")
  if impl is not None:
    kernel.check_impl(impl, x.dtype)
  qk = rope.qk_positions(positions, x.shape[1], S, cross=context is not None) \
      if cfg.rope_dim else None
  check_kv_inputs(kv_inputs, x, context)
  return Options(mask=mask, is_causal=is_causal, kv_lengths=kv_lengths, qk_positions=qk,
                 head_mask=head_mask, return_weights=return_weights, impl=impl,
                 kv_inputs=None if kv_inputs is None else tuple(kv_inputs))


def check_kv_inputs(kv_inputs, x, context) -> None:
  """kv_inputs: None, or (key input, value input) of x's shape, in self-attention (context None)."""
  if kv_inputs is None:
    return
  shapes = [getattr(a, "shape", None) for a in kv_inputs] if isinstance(kv_inputs, (tuple, list)) else None
  if context is not None or shapes is None or len(shapes) != 2 or any(s != x.shape for s in shapes):
    raise invalid("kv_inputs", "given" if shapes is None else shapes,
                  f"None, or (the key projection's input, the value projection's input) of x's shape "
                  f"{tuple(x.shape)} in self-attention (context None)")


def apply(variant: str, params: Params, x, context=None, *, cfg: HeadConfig, mask=None,
          return_weights: bool = False, head_mask=None, is_causal: bool = False,
          kv_lengths=None, positions=None, impl: str | None = None, kv_inputs=None):
  """y (B,T,D) of the attention layer; with return_weights, (y, weights (B,H,T,S)).

  context (B,S,D) gives cross-attention; None means self-attention. mask is
  boolean, True where a query may attend, broadcastable to (B,H,T,S).
  is_causal (query t sees keys s <= t + S - T) and kv_lengths (B,) (keys
  s >= kv_lengths[b] masked) are structured masks, ANDed with mask; the
  blocked kernel that long sequences use never builds them as arrays.
  head_mask, float (H,) or (B,H), multiplies each query head's output before
  W^O (Michel et al. 2019): all ones is the layer itself, ξ_h = 0 removes head
  h, and ∂loss/∂ξ is the head's importance. None means no gates.
  positions, integer (T,) or (B,T), are the positions of x's tokens for RoPE
  (cfg.rope_dim > 0; ignored otherwise), used for the queries and, in
  self-attention, for the keys; cross-attention keys sit at 0..S−1. None
  means 0..T−1. impl picks the attention core's implementation (attn.kernel.attention:
  "einsum", "blocked", "xla", "cudnn", "onednn"); None is the variant's default, "auto".
  kv_inputs (per_head only): (key input, value input), each of x's shape, the key and value projections'
  own inputs in self-attention (Inkling-2's hybrid layers); None: x.
  """
  v = check_config(variant, cfg)
  if kv_inputs is not None and v.name != "per_head":
    raise invalid("kv_inputs", "given", f"None for {v.name}: per_head alone projects keys and values from "
                  "inputs of their own")
  opts = options(cfg, x, context, mask=mask, return_weights=return_weights, head_mask=head_mask,
                 is_causal=is_causal, kv_lengths=kv_lengths, positions=positions, impl=impl, kv_inputs=kv_inputs)
  check_params(v, params, cfg)
  y, w = v.apply(params, x, context, cfg=cfg, opts=opts)
  if getattr(y, "shape", None) != x.shape:
    raise invalid(f"{v.name}.apply(...)[0].shape", getattr(y, "shape", type(y).__name__),
                  f"{tuple(x.shape)}: (B, T, d_model), the shape of x")
  return (y, w) if return_weights else y


__all__ = ["ConfigError", "Options", "apply", "check_config", "check_params", "get_variant", "init",
           "options", "param_shapes"]
