"""Per-layer attention types: ModelConfig.layer_types, one entry per self-attention layer.

A type fixes what differs between the layers of one model; everything else
is the model's HeadConfig (ModelConfig.head):

  full_attention          every earlier key (window None), RoPE as the model's
  sliding_attention       the model's window, RoPE at sliding_rope_theta if set
  full_attention_nope     every earlier key, no rotation (NoPE: SmolLM3's every
                          4th layer; Cohere 2's, EXAONE 4's and Llama 4's global ones)
  sliding_attention_nope  the window, no rotation
  compressed_sparse_attention, heavily_compressed_attention
                          DeepSeek-V4's: the window and the model's RoPE (never
                          sliding_rope_theta, which is then its sliding layers'); the
                          entries' sizes are the type's layer_heads (compress_block,
                          compress_overlap) with variant compressed_shared

  linear_attention        a head with a fixed-size state instead of softmax attention:
                          the variant ModelConfig.linear_variant (gated_deltanet by
                          default; kda, mamba2, linear, gla), or layer_heads'
                          linear_attention.variant (one of the two), with ModelConfig.linear_head's
                          HeadConfig fields over the model's d_model, num_heads, d_k,
                          d_v, num_kv_heads, use_bias, conv_width, chunk and
                          gated_norm_eps; none of the
                          model's RoPE, window or head mechanisms (Qwen3-Next's linear
                          layers: 16 key heads, 32 value heads of 128); with no
                          RoPE to drop it stands beside any positional (NemotronH's
                          mamba2 layers beside attention without positions)

layer_rope_theta (one number per layer, 0 = NoPE: Granite-SWA's and Muse Spark's) sets each
layer's RoPE base beside its type, the model's rope_scaling and rope_dim kept; 0 drops the rotation
as a _nope type does. It goes with the model's rope_theta (unread where every entry is set) and
refuses sliding_rope_theta (one of the two says a sliding layer's base) and a base for a layer
without RoPE. layer_num_heads (one count per layer: Laguna's num_attention_heads_per_layer) sets each
layer's query heads, each a multiple of its kv heads; the layer's parameters, FLOPs and counts follow
(its KV cache does not change: the kv heads are the type's).

The first two and linear_attention are transformers' `layer_types` values, so a checkpoint's
list maps entry for entry. sliding_rope_theta is Gemma 3's rope_local_base_freq:
its sliding layers rotate with their own base and without the model's
rope_scaling (transformers builds their rotary embedding with rope_type
"default"). global_every = k is the shorthand for a list: with a window, layer
l (from 1) is full_attention when k divides l, else sliding_attention (k = 0:
all sliding); without a window every layer is full_attention.

Each layer keeps its own KV cache (attn.variants.cache): a sliding layer a
ring of `window` slots, a full one max_len slots, whatever its RoPE; a linear
layer its fixed-size state (a hybrid decodes with both). A layer reading another
layer's keys and values holds none (ModelConfig.kv_source, attn.nn.kv_sharing). A
type's own head sizes (d_k, d_v, num_kv_heads) are ModelConfig.layer_heads
(attn.nn.layer_heads), applied first by head_for.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from attn import api
from attn.config import ConfigError, HeadConfig, invalid
from attn.nn import layer_heads
from attn.variants import VARIANTS


@dataclasses.dataclass(frozen=True)
class LayerType:
  """What a layer type sets in its layers' HeadConfig."""

  sliding: bool  # the model's window (else window None)
  rope: bool  # the model's rotary positions (else rope_dim 0: NoPE)
  linear: bool = False  # ModelConfig.linear_variant with linear_head, in place of the model's variant
  compressed: bool = False  # DeepSeek-V4's compressed layers: the window and the model's RoPE (not sliding_rope_theta)


LAYER_TYPES = {
    "full_attention": LayerType(sliding=False, rope=True),
    "sliding_attention": LayerType(sliding=True, rope=True),
    "full_attention_nope": LayerType(sliding=False, rope=False),
    "sliding_attention_nope": LayerType(sliding=True, rope=False),
    "linear_attention": LayerType(sliding=False, rope=False, linear=True),
    # DeepSeek-V4: the window beside compressed entries (their sizes: layer_heads' compress_block)
    "compressed_sparse_attention": LayerType(sliding=True, rope=True, compressed=True),
    "heavily_compressed_attention": LayerType(sliding=True, rope=True, compressed=True),
}

# The model's HeadConfig fields a linear layer keeps (linear_head overrides any of them); every
# other field (RoPE, window, mechanisms, mla's and tpa's options) takes HeadConfig's default.
_LINEAR_KEEPS = ("d_model", "num_heads", "d_k", "d_v", "num_kv_heads", "use_bias", "conv_width",
                 "chunk", "gated_norm_eps", "layer")

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


def variant_for(m: Any, kind: str) -> str:
  """The variant of the layers of type `kind`: the type's own (layer_heads[kind]["variant"]), else
  linear_variant for a linear type and the model's variant for the others."""
  return layer_heads.variant(m, kind) or (m.linear_variant if LAYER_TYPES[kind].linear else m.variant)


def head_for(m: Any, kind: str, head: HeadConfig) -> HeadConfig:
  """head (the model's, for one layer) with the settings of layer type `kind` (and its sizes in
  m.layer_heads, attn.nn.layer_heads)."""
  head = layer_heads.apply(m, kind, head)
  t = LAYER_TYPES[kind]
  if t.linear:
    kept = {n: getattr(head, n) for n in _LINEAR_KEEPS}
    return HeadConfig(**{**kept, **dict(m.linear_head or {})})
  if not t.sliding:
    head = head.replace(window=None)
  if not t.rope:
    return head.replace(**{n: _DEFAULTS[n] for n in _ROPE_FIELDS})
  if t.sliding and m.sliding_rope_theta is not None and not t.compressed:
    reset = {n: _DEFAULTS[n] for n in _ROPE_FIELDS if n not in _KEPT_BY_OWN_BASE}
    return head.replace(**reset, rope_theta=float(m.sliding_rope_theta))
  return head


def normalize_thetas(value: Any) -> Any:
  """layer_rope_theta as a tuple of floats (TOML and JSON give lists, maybe of integers): 1 and 1.0 are
  one config; other values are left for check()."""
  if not isinstance(value, (list, tuple)):
    return value
  return tuple(float(t) if isinstance(t, int) and not isinstance(t, bool) else t for t in value)


def _check_layer_theta(m: Any) -> None:
  """layer_rope_theta: one base per layer, each 0 (NoPE) or positive, where the layer rotates."""
  thetas, L = m.layer_rope_theta, m.num_layers
  allowed = f"None or a list of {L} RoPE bases, one per layer (0: NoPE)"
  if not isinstance(thetas, tuple):
    raise invalid("layer_rope_theta", thetas, allowed)
  if len(thetas) != L:
    raise invalid("layer_rope_theta", f"{len(thetas)} entries", f"one per layer: num_layers={L}")
  for i, t in enumerate(thetas):
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t < float("inf"):
      raise invalid(f"layer_rope_theta[{i}]", t, "0 (NoPE) or a positive finite RoPE base")
  if m.positional != "rope":
    raise invalid("layer_rope_theta", list(thetas), f"None when positional={m.positional!r}: there are no "
                  "rotary positions to set a base for")
  if m.sliding_rope_theta is not None:
    raise invalid("sliding_rope_theta", m.sliding_rope_theta, "None with layer_rope_theta: each layer's "
                  "base is there")
  for i, t in enumerate(thetas):
    kind = layer_type(m, i)
    if t and not LAYER_TYPES[kind].rope:
      raise invalid(f"layer_rope_theta[{i}]", t, f"0: layer_types[{i}]={kind!r} has no RoPE to set a base for")


def _check_layer_heads(m: Any) -> None:
  """layer_num_heads: one positive count of query heads per layer, each a multiple of the layer's kv heads."""
  heads, L = m.layer_num_heads, m.num_layers
  if not isinstance(heads, tuple):
    raise invalid("layer_num_heads", heads, f"None or a list of {L} counts of query heads, one per layer")
  if len(heads) != L:
    raise invalid("layer_num_heads", f"{len(heads)} entries", f"one per layer: num_layers={L}")
  for i, n in enumerate(heads):
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
      raise invalid(f"layer_num_heads[{i}]", n, "a positive integer (the layer's query heads)")
    kind = layer_type(m, i)
    if LAYER_TYPES[kind].linear:
      raise invalid(f"layer_num_heads[{i}]", n, f"layer_types[{i}]={kind!r} takes its heads from linear_head: "
                    "layer_num_heads is for softmax layers only (a model without linear layers)")
    G = head_for(m, kind, m.head).num_kv_heads
    if n % G:
      raise invalid(f"layer_num_heads[{i}]", n, f"a multiple of the layer's num_kv_heads={G} (grouped heads)")


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
      if not LAYER_TYPES[k].rope and not LAYER_TYPES[k].linear and m.positional != "rope":
        raise invalid(f"layer_types[{i}]", k, f"a type with RoPE when positional={m.positional!r}: "
                      "there are no rotary positions to drop (every layer is position-free already)")
    if w is not None and not any(LAYER_TYPES[k].sliding for k in kinds):
      raise invalid("window", w, "None: no entry of layer_types is a sliding type, so none would read it")
  if m.layer_rope_theta is not None:
    _check_layer_theta(m)
  if m.layer_num_heads is not None:
    _check_layer_heads(m)
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
  linear = [i for i, k in enumerate(kinds or ()) if LAYER_TYPES[k].linear]
  if linear:
    _check_linear(m, linear[0])
  seen = set()
  for i in range(m.num_layers):
    kind = layer_type(m, i)
    nope = m.layer_rope_theta is not None and not m.layer_rope_theta[i]
    heads = None if m.layer_num_heads is None else m.layer_num_heads[i]
    if (kind, nope, heads) in seen:
      continue
    seen.add((kind, nope, heads))
    try:
      api.check_config(variant_for(m, kind), layer_heads.per_layer(m, i, head_for(m, kind, m.head)))
    except ConfigError as e:
      raise ConfigError(f"layer_types[{i}]={kind!r}: {e}") from None


def _check_linear(m: Any, i: int) -> None:
  """The linear layers' variant (linear_variant, or layer_heads.linear_attention.variant: one of the
  two) a head with a fixed-size state; linear_head a table of HeadConfig fields; layer_heads'
  table for them only the fields a linear layer keeps (others would be dropped unread)."""
  own = (m.layer_heads or {}).get("linear_attention", {})
  where, name = "linear_variant", m.linear_variant
  if "variant" in own:
    where, name = "layer_heads.linear_attention.variant", own["variant"]
    if m.linear_variant not in ("gated_deltanet", name):
      raise invalid(where, name, f"unset, or {m.linear_variant!r} (linear_variant={m.linear_variant!r} "
                    "already names the linear layers' variant): set one of the two")
  v = VARIANTS.resolve(name, where)
  if v.init_state is None:
    names = sorted(n for n, r in VARIANTS.items() if r.init_state is not None)
    raise invalid(where, name, f"a variant with a fixed-size state for "
                  f"layer_types[{i}]='linear_attention': one of {names}")
  for key, value in own.items():
    if key != "variant" and key not in _LINEAR_KEEPS:
      raise invalid(f"layer_heads.linear_attention.{key}", value, "left out: a linear_attention layer "
                    f"keeps only {[k for k in layer_heads.KEYS if k == 'variant' or k in _LINEAR_KEEPS]} of "
                    "its layer_heads entry (no RoPE, window or value norm); its other HeadConfig fields "
                    "go in linear_head")
    if key in (m.linear_head or {}):
      raise invalid(f"layer_heads.linear_attention.{key}", value, f"unset: linear_head.{key}="
                    f"{m.linear_head[key]!r} sets it for the linear layers; set one of the two")
  fields = {f.name for f in dataclasses.fields(HeadConfig)}
  for name in m.linear_head or {}:
    if name not in fields or name == "layer":
      raise invalid(f"linear_head.{name}", m.linear_head[name], "a HeadConfig field of the "
                    "linear layers (num_heads, num_kv_heads, d_k, d_v, conv_width, chunk, ...)")


def check_linear_fields(m: Any) -> None:
  """linear_variant and linear_head left at their defaults when no layer is linear_attention."""
  if any(LAYER_TYPES[k].linear for k in m.layer_types or ()):
    return
  if m.linear_head is not None:
    raise invalid("linear_head", dict(m.linear_head), "None: no entry of layer_types is "
                  "'linear_attention', so no layer would read it")
  if m.linear_variant != "gated_deltanet":
    raise invalid("linear_variant", m.linear_variant, "'gated_deltanet' (the default): no entry "
                  "of layer_types is 'linear_attention', so no layer would read it")


def check_bidirectional(m: Any, why: str) -> None:
  """Refuses a layer whose variant is causal by construction (a fixed-state head: its record has
  init_state) in a stack that attends both ways (an encoder; `why` says whose), naming the setting
  that put it there: its layer type, its type's variant or the model's."""
  for i in range(m.num_layers):
    variant, kind = m.layer_variant(i), layer_type(m, i)
    if not getattr(m, "has_attention", lambda i: True)(i) or VARIANTS[variant].init_state is None:
      continue
    if layer_heads.variant(m, kind):
      field, value, allowed = f"layer_heads.{kind}.variant", variant, "a softmax variant"
    elif LAYER_TYPES[kind].linear:
      field, value, allowed = f"layer_types[{i}]", kind, "a softmax layer type"
    else:
      field, value, allowed = "variant", variant, "a softmax variant"
    raise invalid(field, value, f"{allowed}: {why} attends both ways, and layer {i}'s {variant} head is "
                  "causal by construction (a fixed-size state read in order; it has no bidirectional form)")


def schedule(m: Any, n: int | None = None) -> tuple[str, ...]:
  """The type of each of the n (default num_layers) self-attention layers of a stack."""
  return tuple(layer_type(m, i) for i in range(m.num_layers if n is None else n))
