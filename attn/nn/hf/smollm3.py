"""SmolLM3 as a Llama-like DecoderLM whose every 4th layer drops RoPE (NoPE).

Llama's mapping (q/k/v/o and mlp biases by switch, RMSNorm, gated MLP, GQA)
plus config.json's no_rope_layers (one 0/1 per layer, 1 = rotate; default:
layer l from 1 is NoPE when no_rope_layer_interval divides it), read as
attn's layer_types: full_attention, or full_attention_nope where the list has
0 (sliding_attention[_nope] where layer_types, with use_sliding_window, says
so). Written back as no_rope_layers and layer_types. transformers has SmolLM3
from 4.53.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from attn.config import invalid
from attn.nn import layer_types
from attn.nn.hf import llama
from attn.nn.hf.base import get
from attn.nn.config import ModelConfig


def _schedule(hf: dict[str, Any], L: int) -> list[str]:
  """transformers' default layer_types: sliding where use_sliding_window and the layer is NoPE."""
  rope = _rope_layers(hf, L)
  slide = hf.get("use_sliding_window") and hf.get("sliding_window")
  return ["sliding_attention" if slide and not r else "full_attention" for r in rope]


def _rope_layers(hf: dict[str, Any], L: int) -> list[bool]:
  """Which layers rotate: no_rope_layers, or every layer but each no_rope_layer_interval-th."""
  flags = hf.get("no_rope_layers")
  if flags is None:
    k = hf.get("no_rope_layer_interval", 4)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
      raise invalid("config.no_rope_layer_interval", k, "a positive integer")
    return [(l + 1) % k != 0 for l in range(L)]
  if not isinstance(flags, list) or len(flags) != L or any(f not in (0, 1) or isinstance(f, float) for f in flags):
    raise invalid("config.no_rope_layers", flags, f"a list of {L} flags, 1 (RoPE) or 0 (NoPE)")
  return [bool(f) for f in flags]


def config_in(hf: dict[str, Any]) -> ModelConfig:
  """Llama's config reader, then each layer's type from layer_types and no_rope_layers."""
  L = get(hf, "num_hidden_layers")
  types = list(hf.get("layer_types") or _schedule(hf, L))
  if len(types) != L or set(types) - {"full_attention", "sliding_attention"}:
    raise invalid("config.layer_types", types, f"{L} of 'full_attention' / 'sliding_attention'")
  base = llama.config_in(ROW, hf | {"layer_types": ["full_attention"] * L})
  kinds = tuple(t + ("" if r else "_nope") for t, r in zip(types, _rope_layers(hf, L)))
  sliding = any(layer_types.LAYER_TYPES[k].sliding for k in kinds)
  if sliding and not hf.get("sliding_window"):
    raise invalid("config.sliding_window", hf.get("sliding_window"), "a window: layer_types has sliding layers")
  return base.replace(layer_types=kinds, window=int(hf["sliding_window"]) if sliding else None, global_every=0)


def _windows_out(cfg: ModelConfig, types: list[str]) -> dict[str, Any]:
  sliding = "sliding_attention" in types
  return {"layer_types": types, "use_sliding_window": sliding, "sliding_window": cfg.window if sliding else None}


def _extra_out(cfg: ModelConfig) -> dict[str, Any]:
  kinds = layer_types.schedule(cfg)
  return {"no_rope_layers": [int(layer_types.LAYER_TYPES[k].rope) for k in kinds]}


ROW = llama.LlamaLike("SmolLM3ForCausalLM", mlp_bias="mlp_bias", windows_out=_windows_out, extra_out=_extra_out,
                      extra_mapped=frozenset({"layer_types"}))
SMOLLM3 = dataclasses.replace(llama.family("smollm3", ROW), config_in=config_in)
