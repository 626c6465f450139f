"""Per-layer attention types: ModelConfig.layer_types, one entry per self-attention layer.

A type fixes what differs between the layers of one model; everything else
is the model's HeadConfig (ModelConfig.head):

  full_attention          every earlier key (window None), RoPE as the model's
  sliding_attention       the model's window, RoPE at sliding_rope_theta if set
  full_attention_nope     every earlier key, no rotation (NoPE: SmolLM3's every
                          4th layer; Cohere 2's, EXAONE 4's and Llama 4's global ones)
  sliding_attention_nope  the window, no rotation

The first two are transformers' `layer_types` values, so a checkpoint's list
maps entry for entry. sliding_rope_theta is Gemma 3's rope_local_base_freq:
its sliding layers rotate with their own base and without the model's
rope_scaling (transformers builds their rotary embedding with rope_type
"default"). global_every = k is the shorthand for a list: with a window, layer
l (from 1) is full_attention when k divides l, else sliding_attention (k = 0:
all sliding); without a window every layer is full_attention.

Each layer keeps its own KV cache (attn.variants.cache): a sliding layer a
ring of `window` slots, a full one max_len slots, whatever its RoPE (unless it
reads another layer's: ModelConfig.kv_source, attn.nn.kv_sharing). A type's
own head sizes (d_k, d_v, num_kv_heads) are ModelConfig.layer_heads
(attn.nn.layer_heads), applied first by head_for.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from attn import api
from attn.config import ConfigError, HeadConfig, invalid
from attn.nn import layer_heads


@dataclasses.dataclass(frozen=True)
class LayerType:
  """What a layer type sets in its layers' HeadConfig."""

  sliding: bool  # the model's window (else window None)
  rope: bool  # the model's rotary positions (else rope_dim 0: NoPE)


LAYER_TYPES = {
    "full_attention": LayerType(sliding=False, rope=True),
    "sliding_attention": LayerType(sliding=True, rope=True),
    "full_attention_nope": LayerType(sliding=False, rope=False),
    "sliding_attention_nope": LayerType(sliding=True, rope=False),
}

# RoPE fields a NoPE layer sets to their defaults (rope_dim 0 and no scaling), and those a
# sliding layer with its own base resets (its scaling) while keeping rope_dim and the layout.
_ROPE_FIELDS = tuple(f.name for f in dataclasses.fields(HeadConfig) if f.name.startswith("rope_"))
_KEPT_BY_OWN_BASE = ("rope_dim", "rope_layout", "rope_theta")
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(HeadConfig)}


def layer_type(m: Any, index: int) -> str:
  """The type of self-attention layer `index` (0-based) of a stack of model config m."""
  if m.layer_types is not None:
    return m.layer_types[index]
  if m.window is None:
    return "full_attention"
  return "full_attention" if m.global_every and (index + 1) % m.global_every == 0 else "sliding_attention"


def head_for(m: Any, kind: str, head: HeadConfig) -> HeadConfig:
  """head (the model's, for one layer) with the settings of layer type `kind` (and its sizes in
  m.layer_heads, attn.nn.layer_heads)."""
  head = layer_heads.apply(m, kind, head)
  t = LAYER_TYPES[kind]
  if not t.sliding:
    head = head.replace(window=None)
  if not t.rope:
    return head.replace(**{n: _DEFAULTS[n] for n in _ROPE_FIELDS})
  if t.sliding and m.sliding_rope_theta is not None:
    reset = {n: _DEFAULTS[n] for n in _ROPE_FIELDS if n not in _KEPT_BY_OWN_BASE}
    return head.replace(**reset, rope_theta=float(m.sliding_rope_theta))
  return head


def normalize(value: Any) -> tuple[str, ...] | None:
  """layer_types as a tuple (TOML and JSON give lists); other values are left for check()."""
  return tuple(value) if isinstance(value, list) else value


def check(m: Any) -> None:
  """Refuses a schedule the model cannot express, naming layer_types[i] (or the field) and the value."""
  kinds, w = m.layer_types, m.window
  if kinds is not None:
    if not isinstance(kinds, tuple) or not all(isinstance(k, str) for k in kinds):
      raise invalid("layer_types", kinds, f"None or a list of {m.num_layers} type names")
    if len(kinds) != m.num_layers:
      raise invalid("layer_types", f"{len(kinds)} entries", f"one per layer: num_layers={m.num_layers}")
    if m.global_every:
      raise invalid("global_every", m.global_every, "0 when layer_types is given (global_every is its "
                    "shorthand)")
    if m.num_decoder_layers not in (0, m.num_layers):
      raise invalid("num_decoder_layers", m.num_decoder_layers, f"num_layers={m.num_layers} with "
                    "layer_types: the decoder stack follows the same list")
    for i, k in enumerate(kinds):
      if k not in LAYER_TYPES:
        raise invalid(f"layer_types[{i}]", k, f"one of {list(LAYER_TYPES)}")
      if LAYER_TYPES[k].sliding and w is None:
        raise invalid(f"layer_types[{i}]", k, "a full_attention type when window=None: set the "
                      "model's window for its sliding layers")
      if not LAYER_TYPES[k].rope and m.positional != "rope":
        raise invalid(f"layer_types[{i}]", k, f"a type with RoPE when positional={m.positional!r}: "
                      "there are no rotary positions to drop (every layer is position-free already)")
    if w is not None and not any(LAYER_TYPES[k].sliding for k in kinds):
      raise invalid("window", w, "None: no entry of layer_types is a sliding type, so none would read it")
  theta = m.sliding_rope_theta
  if theta is not None:
    types = [layer_type(m, i) for i in range(m.num_layers)]
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0 < theta < float("inf"):
      raise invalid("sliding_rope_theta", theta, "None or a positive finite number (Gemma 3's "
                    "rope_local_base_freq)")
    if not any(LAYER_TYPES[k].sliding and LAYER_TYPES[k].rope for k in types):
      raise invalid("sliding_rope_theta", theta, "None: no layer is sliding with RoPE, so none would "
                    "read it")
  layer_heads.check(m, schedule(m))
  seen = set()
  for i in range(m.num_layers):
    kind = layer_type(m, i)
    if kind in seen:
      continue
    seen.add(kind)
    try:
      api.check_config(m.variant, head_for(m, kind, m.head))
    except ConfigError as e:
      raise ConfigError(f"layer_types[{i}]={kind!r}: {e}") from None


def schedule(m: Any, n: int | None = None) -> tuple[str, ...]:
  """The type of each of the n (default num_layers) self-attention layers of a stack."""
  return tuple(layer_type(m, i) for i in range(m.num_layers if n is None else n))
