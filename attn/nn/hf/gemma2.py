"""Gemma 2 as a Llama-like DecoderLM with more fields: sandwich norms, (1 + w) RMSNorm, √D embedding
scale, query_pre_attn_scalar as attn's score scale, attention and final soft-caps, and local/global
layers (layer_types) mapped onto window + global_every.
"""

from __future__ import annotations

from typing import Any

from attn.nn.hf.base import get
from attn.nn.hf.llama import LlamaLike, family
from attn.nn.config import ModelConfig


def _alternating(hf: dict[str, Any], L: int) -> list[str]:
  """transformers' Gemma 2 default: odd layers (from 1) sliding, even ones full."""
  return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(L)]


def _extra_in(hf: dict[str, Any], K: int) -> dict[str, Any]:
  scalar = float(get(hf, "query_pre_attn_scalar"))
  return dict(scale=None if scalar == K else scalar ** -0.5, softcap=hf.get("attn_logit_softcapping"),
              logit_softcap=hf.get("final_logit_softcapping"))


def _extra_out(cfg: ModelConfig) -> dict[str, Any]:
  scalar = cfg.head.d_k if cfg.scale is None else 1.0 / cfg.scale ** 2
  return dict(query_pre_attn_scalar=round(scalar) if abs(scalar - round(scalar)) < 1e-6 else scalar,
              attn_logit_softcapping=cfg.softcap, final_logit_softcapping=cfg.logit_softcap)


GEMMA2 = family("gemma2", LlamaLike(
    "Gemma2ForCausalLM", norm="sandwich", norm_type="rmsnorm_plus_one", activation="hidden_activation",
    norms={"attn_norm": "input_layernorm", "attn_post_norm": "post_attention_layernorm",
           "mlp_norm": "pre_feedforward_layernorm", "mlp_post_norm": "post_feedforward_layernorm"},
    embed_scale=True, layer_types=_alternating,
    windows_out=lambda cfg, types: {"sliding_window": cfg.window or cfg.max_len, "layer_types": types},
    extra_in=_extra_in, extra_out=_extra_out, extra_mapped=frozenset({"scale", "softcap", "logit_softcap"})))
