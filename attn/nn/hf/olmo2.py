"""OLMo 2 as a Llama-like DecoderLM: QK-norm over the whole projection, norms after each sublayer.

q_norm is one RMSNorm over all H·K query dims and k_norm over all G·K key dims,
applied to q_proj(x) and k_proj(x) before the split into heads and before RoPE:
attn's qk_norm "whole" (q_norm_whole (H,K), k_norm_whole (G,K)), which couples
the heads (attn.analysis.circuits says so in place of their W_QK). A block is
x + post_attention_layernorm(attn(x)), then x + post_feedforward_layernorm(mlp(x)),
with no norm on a sublayer's input: ModelConfig norm "after".
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from attn.nn.hf import llama
from attn.nn.hf.base import Weights
from attn.nn.config import ModelConfig


def config_in(hf: dict[str, Any]) -> ModelConfig:
  return llama.config_in(ROW, hf).replace(qk_norm="whole")


def weights_in(w: Weights, cfg: ModelConfig) -> dict[str, Any]:
  H, G, K = cfg.num_heads, cfg.num_kv_heads, cfg.head.d_k
  pure = llama.weights_in(ROW, w, cfg.replace(qk_norm=False))
  for l, block in pure["blocks"].items():
    a = f"layers.{l}.self_attn"
    block["attn"]["params"] |= {"q_norm_whole": w(f"{a}.q_norm.weight", (H * K,)).reshape(H, K),
                                "k_norm_whole": w(f"{a}.k_norm.weight", (G * K,)).reshape(G, K)}
  return pure


def weights_out(pure: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
  sd = llama.weights_out(ROW, "olmo2", pure, cfg.replace(qk_norm=False))
  for l, block in pure["blocks"].items():
    p, a = block["attn"]["params"], f"model.layers.{l}.self_attn"
    sd |= {f"{a}.{n}.weight": llama.qk_scale_out(ROW, cfg, np.asarray(p[f"{n}_whole"])).ravel()
           for n in ("q_norm", "k_norm")}
  return sd


ROW = llama.LlamaLike("Olmo2ForCausalLM", norm="after",
                      norms={"attn_post_norm": "post_attention_layernorm",
                             "mlp_post_norm": "post_feedforward_layernorm"},
                      layer_types=lambda hf, L: ["full_attention"] * L)
_BASE = llama.family("olmo2", ROW)
OLMO2 = dataclasses.replace(_BASE, config_in=config_in, weights_in=weights_in, weights_out=weights_out,
                            fixed=dict(_BASE.fixed) | {"qk_norm": "whole"})
