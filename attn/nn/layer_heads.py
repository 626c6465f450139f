"""Per-layer-type heads: ModelConfig.layer_heads, a table from a layer type to the head fields
its layers set, and the variant they run (Gemma 4: its global layers have a wider head, 512, fewer
kv heads than its sliding ones and, with attention_k_eq_v, keys equal to values; transformers'
global_head_dim and num_global_key_value_heads).

  layer_heads = {"full_attention": {"d_k": 32, "d_v": 32, "num_kv_heads": 1}}
  TOML: [model.layer_heads.full_attention] with d_k = 32, d_v = 32, num_kv_heads = 1
  layer_heads = {"full_attention": {"variant": "k_eq_v", "value_norm_eps": 1e-6, "d_k": 32, "d_v": 32,
                                    "num_kv_heads": 1, "rope_dim": 8}}   Gemma 4's global layers

"variant" is the layers' variant in place of ModelConfig.variant (layer_types.variant_for; for a
linear_attention type in place of linear_variant, which it may not contradict, and only d_k, d_v
and num_kv_heads beside it: layer_types._check_linear); value_norm_eps and rope_dim are the HeadConfig fields
of the same names (the values' weightless RMSNorm; the rotated width), as are compress_block, compress_overlap and
compress_index_heads, _dim, _topk (DeepSeek-V4's compressed layer types and the CSA layers' indexer), and sinks
(a learned logit per head in that type's layers only: MiMo-V2-Flash's sliding layers), rel_bias_extent,
log_scaling_alpha, log_scaling_floor and qkv_conv_dynamic (Inkling-2's sliding layers: a relative bias over
the window, no log scaling, no per-token taps). Each type's head is then
checked as that variant's (k_eq_v refuses d_v != d_k by name, layer_types.check).

The fields a type may set are FIELDS; a type not in the table keeps the model's head. The
override is applied first in layer_types.head_for, so a layer's HeadConfig
(ModelConfig.layer_head) carries it, and with it the layer's parameters, its KV cache and its
counts (attn.count.model's layer_type_table groups layers by type, each row its own head). A
head field the model leaves to be derived (collab_width, latent_dim: None) is derived
again from the layer's own sizes. A type no layer has, a field outside FIELDS or a size the
variant refuses is refused by name (layer_types.check runs every type's head through the
variant's check).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from attn.config import PER_LAYER_FIELDS, FrozenDict, HeadConfig, invalid
from attn.variants import VARIANTS

FIELDS = ("d_k", "d_v", "num_kv_heads", "value_norm_eps", "rope_dim", "compress_block",
          "compress_overlap", "compress_index_heads", "compress_index_dim",
          "compress_index_topk", "sinks", "rel_bias_extent", "log_scaling_alpha", "log_scaling_floor",
          "qkv_conv_dynamic")  # HeadConfig fields
KEYS = (*FIELDS, "variant")  # what a type may set


def normalize(value: Any) -> Any:
  """A table of tables, frozen (ModelConfig stays hashable); {} is None; other values left for check."""
  if isinstance(value, dict) and all(isinstance(v, dict) for v in value.values()):
    return FrozenDict({k: FrozenDict(v) for k, v in value.items()}) if value else None
  return value


def apply(m: Any, kind: str, head: HeadConfig) -> HeadConfig:
  """head with the sizes layer type `kind` sets (m.layer_heads), its derived fields derived again."""
  table = getattr(m, "layer_heads", None)
  if not table or kind not in table:
    return head
  sizes = {k: v for k, v in table[kind].items() if k in FIELDS}
  derived = {f.name: None for f in dataclasses.fields(HeadConfig)
             if f.name not in PER_LAYER_FIELDS and f.name not in sizes
             and getattr(m, f.name, 0) is None and getattr(head, f.name) is not None}
  return head.replace(**derived, **sizes)


# What a NoPE layer resets (as layer_types' _nope types do): every RoPE field to its default.
_ROPE_FIELDS = tuple(f.name for f in dataclasses.fields(HeadConfig) if f.name.startswith("rope_"))
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(HeadConfig)}


def per_layer(m: Any, index: int, head: HeadConfig) -> HeadConfig:
  """head with layer `index`'s own query heads (m.layer_num_heads: Laguna's num_attention_heads_per_layer)
  and its own RoPE base from m.layer_rope_theta (0: no rotation, NoPE); the
  model's scaling and rope_dim are kept (Granite-SWA's and Muse Spark's layer_rope_theta: transformers
  builds each base's rotary embedding from the model's rope_parameters with rope_theta replaced)."""
  heads = getattr(m, "layer_num_heads", None)
  if heads is not None and head.num_heads != heads[index]:
    head = head.replace(num_heads=heads[index], collab_width=None if m.collab_width is None else head.collab_width)
  thetas = getattr(m, "layer_rope_theta", None)
  if thetas is None or not head.rope_dim:  # a linear or NoPE layer (check() refused a base there)
    return head
  if not thetas[index]:
    return head.replace(**{n: _DEFAULTS[n] for n in _ROPE_FIELDS})
  return head.replace(rope_theta=float(thetas[index]))


def variant(m: Any, kind: str) -> str | None:
  """The variant layer type `kind` sets (m.layer_heads[kind]["variant"]), or None: the model's."""
  table = getattr(m, "layer_heads", None)
  return table[kind].get("variant") if table and kind in table else None


def check(m: Any, kinds: tuple[str, ...]) -> None:
  """Refuses a table that is not {type: {field: positive int}}, or names a type none of `kinds` is."""
  table = m.layer_heads
  if table is None:
    return
  allowed = f"None or a table {{layer type: {{field: value}}}} with fields among {list(KEYS)}"
  if not isinstance(table, dict):
    raise invalid("layer_heads", table, allowed)
  for kind, sizes in table.items():
    if kind not in kinds:
      raise invalid(f"layer_heads.{kind}", dict(sizes), f"a layer type the model has: one of "
                    f"{sorted(set(kinds))} (a type no layer has would be ignored)")
    for name, value in sizes.items():
      where = f"layer_heads.{kind}.{name}"
      if name not in KEYS:
        raise invalid(where, value, f"one of {list(KEYS)}: the head sizes and variant a layer type sets")
      if name == "variant":
        VARIANTS.resolve(value, where)
      elif name == "sinks":
        if not isinstance(value, bool):
          raise invalid(where, value, "True or False (a learned sink logit per head in this type's layers: "
                        "MiMo-V2-Flash's sliding layers)")
      elif name in ("log_scaling_alpha", "qkv_conv_dynamic"):
        pass  # HeadConfig checks them in the type's head (layer_types.check), against the fields beside them
      elif name == "compress_overlap":
        if not isinstance(value, bool):
          raise invalid(where, value, "True or False (two series per token: DeepSeek-V4's CSA)")
      elif name == "value_norm_eps":
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not 0 < value < float("inf")):
          raise invalid(where, value, "None or a positive finite number (the values' RMSNorm epsilon)")
      elif isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "rope_dim" else 1):
        raise invalid(where, value, "a non-negative integer" if name == "rope_dim" else "a positive integer")
