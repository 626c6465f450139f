"""Granite-SWA (model_type granite_swa) as a Llama-like DecoderLM with sinks, per-layer RoPE bases and
Granite's multipliers.

Granite's attention is Llama's (q/k/v/o biases by attention_bias, mlp biases by mlp_bias) with
attention_multiplier as the score scale (attn's scale), one learned sink logit per query head in
every layer (transformers computes the output times σ(logsumexp(logits) − sink), which is attn's
sinks: one more logit in the softmax denominator), layer_types of full and sliding layers in any
order (attn's layer_types, the window sliding_window) and layer_rope_theta, one RoPE base per layer
with 0 for a layer without positions (attn's layer_rope_theta: transformers builds each base's
rotary embedding from rope_parameters with rope_theta replaced, scaling kept). The model around it
is Granite's: token embeddings times embedding_multiplier, each sublayer's output times
residual_multiplier before the residual add, the logits divided by logits_scaling (attn's
embed_multiplier, residual_multiplier, logit_divisor). transformers has Granite-SWA from 5.25.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from attn.config import invalid
from attn.nn.hf import llama
from attn.nn.hf.base import Weights, get
from attn.nn.config import ModelConfig

_TYPES = ("full_attention", "sliding_attention")


def _every_fourth(hf: dict[str, Any], L: int) -> list[str]:
  """transformers' default: layer i (from 0) full when 4 divides it, else sliding."""
  return ["full_attention" if i % 4 == 0 else "sliding_attention" for i in range(L)]


def config_in(hf: dict[str, Any]) -> ModelConfig:
  """Llama's reader over full layers, then the schedule, the bases, the sinks and the multipliers."""
  L = get(hf, "num_hidden_layers")
  types = list(hf.get("layer_types") or _every_fourth(hf, L))
  if len(types) != L or set(types) - set(_TYPES):
    raise invalid("config.layer_types", types, f"{L} of 'full_attention' / 'sliding_attention'")
  base = llama.config_in(ROW, hf | {"layer_types": ["full_attention"] * L})
  sliding = "sliding_attention" in types
  if sliding and not hf.get("sliding_window"):
    raise invalid("config.sliding_window", hf.get("sliding_window"), "a window: layer_types has sliding layers")
  thetas = hf.get("layer_rope_theta")
  if thetas is None:
    thetas = [base.rope_theta] * L
  if not isinstance(thetas, list) or len(thetas) != L:
    raise invalid("config.layer_rope_theta", thetas, f"a list of {L} RoPE bases, one per layer (0: NoPE)")
  return base.replace(
      layer_types=tuple(types), window=int(hf["sliding_window"]) if sliding else None, global_every=0,
      layer_rope_theta=tuple(thetas), sinks=True, scale=float(hf.get("attention_multiplier", 1.0)),
      embed_multiplier=float(hf.get("embedding_multiplier", 1.0)),
      residual_multiplier=float(hf.get("residual_multiplier", 1.0)),
      logit_divisor=float(hf.get("logits_scaling", 1.0)))


def weights_in(w: Weights, cfg: ModelConfig) -> dict[str, Any]:
  out = llama.weights_in(ROW, w, cfg)
  for l, block in out["blocks"].items():
    block["attn"]["params"]["sinks"] = w(f"layers.{l}.self_attn.sinks", (cfg.num_heads,))
  return out


def weights_out(pure: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
  sd = llama.weights_out(ROW, "granite_swa", pure, cfg)
  for l, block in pure["blocks"].items():
    sd[f"model.layers.{l}.self_attn.sinks"] = np.asarray(block["attn"]["params"]["sinks"])
  return sd


def check_out(cfg: ModelConfig) -> None:
  llama.check_out(ROW, "granite_swa", cfg)
  if not cfg.sinks:
    raise invalid("sinks", cfg.sinks, "True: every granite_swa layer has a learned sink per head")
  kinds = cfg.layer_types or ()
  for i, kind in enumerate(kinds):
    if kind not in _TYPES:
      raise invalid(f"layer_types[{i}]", kind, f"one of {list(_TYPES)}: granite_swa drops RoPE by "
                    "layer_rope_theta 0, not by a layer type")


def _extra_out(cfg: ModelConfig) -> dict[str, Any]:
  L = cfg.num_layers
  thetas = list(cfg.layer_rope_theta) if cfg.layer_rope_theta is not None else [cfg.rope_theta] * L
  scale = cfg.scale if cfg.scale is not None else cfg.head.d_k ** -0.5
  return {"layer_rope_theta": thetas, "attention_multiplier": float(scale),
          "embedding_multiplier": cfg.embed_multiplier, "residual_multiplier": cfg.residual_multiplier,
          "logits_scaling": cfg.logit_divisor}


ROW = llama.LlamaLike("GraniteSWAForCausalLM", mlp_bias="mlp_bias", layer_types=_every_fourth,
                      windows_out=lambda cfg, types: {"sliding_window": cfg.window or cfg.max_len,
                                                      "layer_types": types},
                      extra_out=_extra_out)
_BASE = llama.family("granite_swa", ROW)
GRANITE_SWA = dataclasses.replace(
    _BASE, config_in=config_in, weights_in=weights_in, weights_out=weights_out, check_out=check_out,
    refusals=dict(_BASE.refusals) | {"quantization_config": ((None,), "float weights: attn does not dequantize "
                                                                      "quantized checkpoints")},
    mapped=_BASE.mapped | {"sinks", "scale", "layer_types", "layer_rope_theta", "embed_multiplier",
                           "residual_multiplier", "logit_divisor"})
