"""gpt-oss as a DecoderLM: learned sinks, alternating windows, YaRN, and a dense mixture of experts.

Attention is Llama's with q/k/v/o biases, one learned sink logit per query
head (attn's sinks) and layer_types alternating sliding and full (global_every
2); RoPE is YaRN without truncation (attn.nn.hf.rope). Each block's feed-forward
is attn.nn.moe with the softmax router over the top-k logits (moe_norm_topk) and
gpt-oss's clamped SwiGLU (swiglu_limit; swiglu_alpha must be 1.702). The
checkpoint stores the experts' gate and up projections interleaved in one
(E, D, 2F) tensor, gate in the even columns and up in the odd ones; they are
split on the way in and interleaved on the way out, bit for bit. attn computes
every expert on every token: E/k times the FLOPs of a real MoE (attn.nn.moe).

transformers 4.55 to 5.18 fix the clamp at 7.0 and alpha at 1.702 in GptOssExperts.__init__
(`self.limit = 7.0`), with no swiglu_limit in GptOssConfig: a config.json they save has none, and one
read without it clamps at 7.0, their value and 5.19's default. Those releases ignore a swiglu_limit
a config.json does hold (5.19 reads it: `self.limit = config.swiglu_limit`), so with one of them
installed, to_hf and to_hf_state refuse another limit.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
from typing import Any

import numpy as np

from attn.config import invalid
from attn.nn.hf import llama
from attn.nn.hf.base import Weights, get, zero
from attn.nn.moe import GPT_OSS_ALPHA, GPT_OSS_LIMIT
from attn.nn.config import ModelConfig


def config_in(hf: dict[str, Any]) -> ModelConfig:
  """Llama's reader with biases, then sinks and the experts (no swiglu_limit, as transformers 4.55-5.18 save:
  7.0, theirs)."""
  alpha = hf.get("swiglu_alpha", GPT_OSS_ALPHA)
  if alpha != GPT_OSS_ALPHA:
    raise invalid("config.swiglu_alpha", alpha, f"{GPT_OSS_ALPHA}: attn's clamped SwiGLU has gpt-oss's alpha")
  limit = hf.get("swiglu_limit", GPT_OSS_LIMIT)
  if not isinstance(limit, (int, float)) or isinstance(limit, bool) or not limit > 0:
    raise invalid("config.swiglu_limit", limit, f"a positive number (absent: {GPT_OSS_LIMIT}, transformers' own)")
  cfg = llama.config_in(ROW, hf)
  return cfg.replace(mlp="moe", sinks=True, moe_experts=get(hf, "num_local_experts"),
                     moe_top_k=get(hf, "num_experts_per_tok"), moe_swiglu_limit=float(limit))


def weights_in(w: Weights, cfg: ModelConfig) -> dict[str, Any]:
  D, H, G, K, F, N, E = (cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head.d_k, cfg.d_ff, cfg.vocab_size,
                         cfg.moe_experts)
  norm = lambda name: {"scale": w(f"{name}.weight", (D,))}  # noqa: E731
  blocks = {}
  for l in range(cfg.num_layers):
    a, m = f"layers.{l}.self_attn", f"layers.{l}.mlp"
    heads = {"w_q": w(f"{a}.q_proj.weight", (H * K, D)).T.reshape(D, H, K),
             "w_k": w(f"{a}.k_proj.weight", (G * K, D)).T.reshape(D, G, K),
             "w_v": w(f"{a}.v_proj.weight", (G * K, D)).T.reshape(D, G, K),
             "w_o": w(f"{a}.o_proj.weight", (D, H * K)).T.reshape(H, K, D),
             "b_q": w(f"{a}.q_proj.bias", (H * K,)).reshape(H, K), "b_k": w(f"{a}.k_proj.bias", (G * K,)).reshape(G, K),
             "b_v": w(f"{a}.v_proj.bias", (G * K,)).reshape(G, K), "b_o": w(f"{a}.o_proj.bias", (D,)),
             "sinks": w(f"{a}.sinks", (H,))}
    gate_up, b_gate_up = w(f"{m}.experts.gate_up_proj", (E, D, 2 * F)), w(f"{m}.experts.gate_up_proj_bias", (E, 2 * F))
    mlp = {"router_w": w(f"{m}.router.weight", (E, D)).T, "router_b": w(f"{m}.router.bias", (E,)),
           "w_gate": gate_up[..., 0::2], "w_up": gate_up[..., 1::2], "b_gate": b_gate_up[:, 0::2],
           "b_up": b_gate_up[:, 1::2], "w_down": w(f"{m}.experts.down_proj", (E, F, D)),
           "b_down": w(f"{m}.experts.down_proj_bias", (E, D))}
    blocks[l] = {"attn": {"params": heads}, "mlp": mlp, "attn_norm": norm(f"layers.{l}.input_layernorm"),
                 "mlp_norm": norm(f"layers.{l}.post_attention_layernorm")}
  out = {"embed": {"token": w("embed_tokens.weight", (N, D))}, "blocks": blocks, "final_norm": norm("norm")}
  if cfg.tie_embeddings:
    if "lm_head.weight" in w:
      w("lm_head.weight", (N, D))
  else:  # gpt-oss's lm_head has no bias: attn's (dense_bias) holds zeros
    out["head"] = {"linear": {"kernel": w("lm_head.weight", (N, D)).T, "bias": np.zeros(N, np.float32)}}
  return out


def _interleave(a: np.ndarray, b: np.ndarray) -> np.ndarray:
  out = np.empty(a.shape[:-1] + (2 * a.shape[-1],), np.result_type(a, b))
  out[..., 0::2], out[..., 1::2] = a, b
  return out


def weights_out(pure: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
  D, H, G, K = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head.d_k
  sd = {"model.embed_tokens.weight": pure["embed"]["token"], "model.norm.weight": pure["final_norm"]["scale"]}
  if cfg.tie_embeddings:
    sd["lm_head.weight"] = pure["embed"]["token"]
  else:
    zero(pure["head"]["linear"]["bias"], "output bias", "gpt_oss")
    sd["lm_head.weight"] = np.asarray(pure["head"]["linear"]["kernel"]).T
  for l, block in pure["blocks"].items():
    p = {k: np.asarray(v) for k, v in block["attn"]["params"].items()}
    e = {k: np.asarray(v) for k, v in block["mlp"].items()}
    a, m = f"model.layers.{l}.self_attn", f"model.layers.{l}.mlp"
    sd |= {f"{a}.q_proj.weight": p["w_q"].reshape(D, H * K).T, f"{a}.k_proj.weight": p["w_k"].reshape(D, G * K).T,
           f"{a}.v_proj.weight": p["w_v"].reshape(D, G * K).T, f"{a}.o_proj.weight": p["w_o"].reshape(H * K, D).T,
           f"{a}.q_proj.bias": p["b_q"].ravel(), f"{a}.k_proj.bias": p["b_k"].ravel(),
           f"{a}.v_proj.bias": p["b_v"].ravel(), f"{a}.o_proj.bias": p["b_o"], f"{a}.sinks": p["sinks"],
           f"{m}.router.weight": e["router_w"].T, f"{m}.router.bias": e["router_b"],
           f"{m}.experts.gate_up_proj": _interleave(e["w_gate"], e["w_up"]),
           f"{m}.experts.gate_up_proj_bias": _interleave(e["b_gate"], e["b_up"]),
           f"{m}.experts.down_proj": e["w_down"], f"{m}.experts.down_proj_bias": e["b_down"],
           f"model.layers.{l}.input_layernorm.weight": block["attn_norm"]["scale"],
           f"model.layers.{l}.post_attention_layernorm.weight": block["mlp_norm"]["scale"]}
  return sd


def _dense(cfg: ModelConfig) -> ModelConfig:
  """cfg as the Llama row's checks see it (a dense gated MLP, no sinks)."""
  return cfg.replace(mlp="gated", sinks=False, moe_experts=0, moe_top_k=0, moe_swiglu_limit=None)


def fixed_limit_release() -> str | None:
  """The installed transformers' version where its GptOssExperts clamps at 7.0 whatever config.swiglu_limit
  says (4.55 to 5.18), else None."""
  try:
    version = importlib.metadata.version("transformers")
  except importlib.metadata.PackageNotFoundError:
    return None
  return version if (4, 55) <= tuple(int(p) for p in version.split(".")[:2]) < (5, 19) else None


def check_out(cfg: ModelConfig) -> None:
  llama.check_out(ROW, "gpt_oss", _dense(cfg))
  if cfg.moe_swiglu_limit not in (None, GPT_OSS_LIMIT) and (release := fixed_limit_release()):
    raise invalid("moe_swiglu_limit", cfg.moe_swiglu_limit,
                  f"{GPT_OSS_LIMIT} with transformers {release}: its GptOssExperts clamps at {GPT_OSS_LIMIT} "
                  "whatever config.swiglu_limit says (5.19 reads it)")
  if not (cfg.use_bias and cfg.sinks and cfg.moe_router == "softmax" and cfg.moe_norm_topk and cfg.moe_swiglu_limit
          and cfg.moe_d_ff in (None, cfg.d_ff)):
    raise invalid("use_bias, sinks, moe_router, moe_norm_topk, moe_swiglu_limit, moe_d_ff",
                  (cfg.use_bias, cfg.sinks, cfg.moe_router, cfg.moe_norm_topk, cfg.moe_swiglu_limit, cfg.moe_d_ff),
                  "(True, True, 'softmax', True, a limit, None): gpt-oss's attention and experts")


def config_out(cfg: ModelConfig) -> dict[str, Any]:
  kw = llama.config_out(ROW, "gpt_oss", _dense(cfg))
  kw.pop("mlp_bias", None)
  return kw | {"num_local_experts": cfg.moe_experts, "num_experts_per_tok": cfg.moe_top_k,
               "swiglu_limit": cfg.moe_swiglu_limit, "swiglu_alpha": GPT_OSS_ALPHA}


def _alternating(hf: dict[str, Any], L: int) -> list[str]:
  """transformers' default: odd layers (from 1) sliding, even ones full."""
  return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(L)]


ROW = llama.LlamaLike("GptOssForCausalLM", mlp_bias=True, layer_types=_alternating,
                      windows_out=lambda cfg, types: {"sliding_window": cfg.window or cfg.max_len,
                                                      "layer_types": types})
_BASE = llama.family("gpt_oss", ROW)
GPT_OSS = dataclasses.replace(
    _BASE, config_in=config_in, weights_in=weights_in, weights_out=weights_out, config_out=config_out,
    check_out=check_out, fixed=dict(_BASE.fixed) | {"mlp": "moe"},
    mapped=_BASE.mapped | {"sinks", "moe_experts", "moe_top_k", "moe_swiglu_limit", "moe_norm_topk", "moe_router",
                           "moe_d_ff"},
    refusals=dict(_BASE.refusals) | {"output_router_logits": ((False,), "attn's MoE returns no router logits")})
