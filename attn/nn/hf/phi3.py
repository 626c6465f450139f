"""Phi-3 (and Phi-4-mini's layout) as a Llama-like DecoderLM: fused projections and partial RoPE.

The checkpoint fuses q, k and v into qkv_proj (rows: H·K queries, then G·K
keys, then G·K values) and gate and up into gate_up_proj (F gate rows, then F
up rows); they are split on the way in and concatenated on the way out, so the
weights come back bit for bit. partial_rotary_factor f rotates the first
int(f·K) dims of each head (half layout), as attn's rope_dim. A sliding_window
applies to every layer (Mistral's). Longrope (Phi-3-*-128k, Phi-4-mini) is
refused by name with the other RoPE types attn does not implement.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np

from attn.config import invalid
from attn.nn.hf import llama
from attn.nn.hf.base import Weights
from attn.nn.hf.rope import rope_from_hf, rotary_fraction
from attn.nn.config import ModelConfig


def config_in(hf: dict[str, Any]) -> ModelConfig:
  """Llama's reader, with the rotary width of partial_rotary_factor."""
  cfg = llama.config_in(ROW, hf)
  K, f = cfg.head.d_k, rotary_fraction(hf)
  r = int(K * f)
  if r < 2 or r % 2:
    raise invalid("config.partial_rotary_factor", f, f"a fraction of head_dim={K} that gives an even rotary "
                  f"width of at least 2 (it gives {r})")
  return cfg.replace(rope_dim=r)


def _split(w: Weights, cfg: ModelConfig) -> Weights:
  """The checkpoint with qkv_proj and gate_up_proj split into Llama's names (every tensor read)."""
  H, G, K, F = cfg.num_heads, cfg.num_kv_heads, cfg.head.d_k, cfg.d_ff
  out = {}
  for name in sorted(w.names):
    if name.endswith(".qkv_proj.weight"):
      a, at = w(name, ((H + 2 * G) * K, cfg.d_model)), name[:-len("qkv_proj.weight")]
      out |= {f"{at}q_proj.weight": a[:H * K], f"{at}k_proj.weight": a[H * K:(H + G) * K],
              f"{at}v_proj.weight": a[(H + G) * K:]}
    elif name.endswith(".gate_up_proj.weight"):
      a, at = w(name, (2 * F, cfg.d_model)), name[:-len("gate_up_proj.weight")]
      out |= {f"{at}gate_proj.weight": a[:F], f"{at}up_proj.weight": a[F:]}
    else:
      out[name] = w(name)
  return Weights(out, family=w.family)


def weights_in(w: Weights, cfg: ModelConfig) -> dict[str, Any]:
  split = _split(w, cfg)
  pure = llama.weights_in(ROW, split, cfg)
  if split.unused():
    raise invalid("checkpoint", [w.stored.get(n, n) for n in split.unused()[:4]],
                  "only tensors family 'phi3' reads (the names transformers and the releases of phi3 use); "
                  "it does not know these")
  return pure


def weights_out(pure: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
  sd = llama.weights_out(ROW, "phi3", pure, cfg)
  for l in pure["blocks"]:
    a, m = f"model.layers.{l}.self_attn", f"model.layers.{l}.mlp"
    sd[f"{a}.qkv_proj.weight"] = np.concatenate([sd.pop(f"{a}.{n}_proj.weight") for n in ("q", "k", "v")])
    sd[f"{m}.gate_up_proj.weight"] = np.concatenate([sd.pop(f"{m}.{n}_proj.weight") for n in ("gate", "up")])
  return sd


def _whole(cfg: ModelConfig) -> ModelConfig:
  return cfg.replace(rope_dim=cfg.head.d_k)


def check_out(cfg: ModelConfig) -> None:
  llama.check_out(ROW, "phi3", _whole(cfg))


def config_out(cfg: ModelConfig) -> dict[str, Any]:
  kw = llama.config_out(ROW, "phi3", _whole(cfg))
  f = cfg.rope_dim / cfg.head.d_k
  kw["rope_parameters"] = kw["rope_parameters"] | {"partial_rotary_factor": f}
  return kw | {"partial_rotary_factor": f}


ROW = llama.LlamaLike("Phi3ForCausalLM", qkv_bias=False, o_bias=False,
                      rope_in=functools.partial(rope_from_hf, partial=True),
                      windows_out=llama._mistral_windows,
                      layer_types=lambda hf, L: ["sliding_attention" if hf.get("sliding_window") else
                                                 "full_attention"] * L)
PHI3 = dataclasses.replace(llama.family("phi3", ROW), config_in=config_in, weights_in=weights_in,
                           weights_out=weights_out, config_out=config_out, check_out=check_out)
