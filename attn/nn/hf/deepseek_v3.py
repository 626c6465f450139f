"""DeepSeek-V3 as a DecoderLM: latent attention (mla) with a low-rank query, and DeepSeek's experts.

Attention is attn's mla (attn.variants.mla) with the checkpoint's widths:
d_c = kv_lora_rank, Q' = q_lora_rank (None: a plain q_proj), rope_dim =
qk_rope_head_dim, d_k = qk_nope_head_dim + qk_rope_head_dim, d_v = v_head_dim,
one kv head per query head (kv_b_proj holds H of each), and the RMSNorms on
both latents (latent_norm_eps 1e-6, transformers' DeepseekV3RMSNorm default).
kv_a_proj_with_mqa's rows are the latent (d_c) then the RoPE key shared by
all heads (rope_dim): w_dkv and w_kr. A query head is [q_nope, q_rope] in the
checkpoint and [q_rope, q_nope] in attn (mla rotates the first rope_dim dims):
q_b_proj's rows are permuted on the way in and back on the way out, bit for
bit. rope_interleave (default True) is rope_layout "interleaved". YaRN's
mscale_all_dim multiplies the softmax scale by mscale(factor, mscale_all_dim)²
(rope_mscale_all_dim), and mscale / mscale_all_dim set the rotated dims'
attention factor (attn.nn.hf.rope).

The feed-forward is attn.nn.moe with the sigmoid router: correction bias
(e_score_correction_bias, a buffer), group-limited top-k (n_group, topk_group),
routed_scaling_factor, n_shared_experts, and dense MLPs in the first
first_k_dense_replace layers. transformers 5 fuses each layer's experts into
gate_up_proj (E, 2F, D; gate rows first) and down_proj (E, D, F); transformers 4
and the released checkpoints hold experts.{e}.gate_proj / up_proj / down_proj.
Both are read; to_hf writes the installed transformers' layout (5's without
one). The multi-token-prediction module (layer 61 of the release) is not read,
as transformers does not read it. Routers other than DeepSeek-V3's
(scoring_func, topk_method), attention biases and an expert stride
(moe_layer_freq) are refused by name before any weight is read.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
from typing import Any

import numpy as np

from attn.config import invalid
from attn.nn.hf import llama
from attn.nn.hf.base import Weights, decoder_in, get
from attn.nn.hf.rope import rope_to_hf
from attn.nn.config import ModelConfig

LATENT_NORM_EPS = 1e-6  # DeepseekV3RMSNorm's default: q_a_layernorm and kv_a_layernorm are built without eps


def config_in(hf: dict[str, Any]) -> ModelConfig:
  """Llama's reader for the sizes, norms and RoPE; then mla's widths and the experts."""
  H = get(hf, "num_attention_heads")
  G = hf.get("num_key_value_heads") or H
  if G != H:
    raise invalid("config.num_key_value_heads", G, f"num_attention_heads={H}: kv_b_proj gives every query head "
                  "its own key and value")
  r, nope, V, C = (_count(hf, name, 1) for name in ("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                                                     "kv_lora_rank"))
  Q, dense_first = hf.get("q_lora_rank"), _count(hf, "first_k_dense_replace", 0, default=0)
  base = llama.config_in(ROW, hf | {"head_dim": r, "num_key_value_heads": H})
  rope, where = {}, "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
  m_all = (hf.get(where) or {}).get("mscale_all_dim")
  if m_all and base.rope_scaling != "yarn":  # transformers would scale the softmax: attn does with yarn only
    raise invalid(f"config.{where}.mscale_all_dim", m_all, f"0 or absent with rope_type {base.rope_scaling!r}: "
                  "attn applies DeepSeek's softmax mscale with yarn only")
  if m_all:
    if isinstance(m_all, bool) or not isinstance(m_all, (int, float)):
      raise invalid(f"config.{where}.mscale_all_dim", m_all, "a number: DeepSeek's softmax mscale reads it")
    rope["rope_mscale_all_dim"] = float(m_all)
  moe = dense_first < base.num_layers  # else every layer keeps its dense MLP
  return base.replace(
      variant="mla", d_k=nope + r, d_v=V, num_kv_heads=H, rope_dim=r, latent_dim=C, q_latent_dim=Q,
      latent_norm_eps=LATENT_NORM_EPS, rope_layout="interleaved" if hf.get("rope_interleave", True) else "half",
      mlp="moe" if moe else "gated", **rope, **(_experts(hf) if moe else {}))


def _count(hf: dict[str, Any], name: str, minimum: int, **default: Any) -> int:
  """An integer field of at least `minimum`, refused by name otherwise."""
  value = get(hf, name, **default)
  if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
    raise invalid(f"config.{name}", value, f"an integer >= {minimum}")
  return value


def _experts(hf: dict[str, Any]) -> dict[str, Any]:
  return dict(moe_experts=get(hf, "n_routed_experts", "num_local_experts"), moe_top_k=get(hf, "num_experts_per_tok"),
              moe_d_ff=get(hf, "moe_intermediate_size"), moe_router="sigmoid",
              moe_norm_topk=bool(hf.get("norm_topk_prob", True)), moe_groups=get(hf, "n_group"),
              moe_topk_groups=get(hf, "topk_group"), moe_routed_scaling=float(get(hf, "routed_scaling_factor")),
              moe_shared_experts=get(hf, "n_shared_experts"), moe_dense_first=get(hf, "first_k_dense_replace"))


def _rope_first(a: np.ndarray, nope: int) -> np.ndarray:
  """The last axis [q_nope, q_rope] -> [q_rope, q_nope] (attn's mla rotates the first dims)."""
  return np.concatenate([a[..., nope:], a[..., :nope]], -1)


def _nope_first(a: np.ndarray, r: int) -> np.ndarray:
  return np.concatenate([a[..., r:], a[..., :r]], -1)


def attention_in(w: Weights, a: str, cfg: ModelConfig) -> dict[str, np.ndarray]:
  D, H, K, V, r, C, Q = (cfg.d_model, cfg.num_heads, cfg.head.d_k, cfg.head.d_v, cfg.rope_dim, cfg.latent_dim,
                         cfg.q_latent_dim)
  nope = K - r
  kv_a = w(f"{a}.kv_a_proj_with_mqa.weight", (C + r, D))
  kv_b = w(f"{a}.kv_b_proj.weight", (H * (nope + V), C)).reshape(H, nope + V, C)
  p = {"w_dkv": kv_a[:C].T, "w_kr": kv_a[C:].T, "latent_norm": w(f"{a}.kv_a_layernorm.weight", (C,)),
       "w_uk": kv_b[:, :nope].transpose(2, 0, 1), "w_uv": kv_b[:, nope:].transpose(2, 0, 1),
       "w_o": w(f"{a}.o_proj.weight", (D, H * V)).T.reshape(H, V, D)}
  if Q is None:
    p["w_q"] = _rope_first(w(f"{a}.q_proj.weight", (H * K, D)).T.reshape(D, H, K), nope)
  else:
    p |= {"w_dq": w(f"{a}.q_a_proj.weight", (Q, D)).T, "q_latent_norm": w(f"{a}.q_a_layernorm.weight", (Q,)),
          "w_uq": _rope_first(w(f"{a}.q_b_proj.weight", (H * K, Q)).T.reshape(Q, H, K), nope)}
  return p


def experts_in(w: Weights, m: str, cfg: ModelConfig) -> dict[str, Any]:
  D, E, F = cfg.d_model, cfg.moe_experts, cfg.moe_d_ff
  out = {"router_w": w(f"{m}.gate.weight", (E, D)).T, "correction": w(f"{m}.gate.e_score_correction_bias", (E,)),
         "shared": mlp_in(w, f"{m}.shared_experts", D, F * cfg.moe_shared_experts)}
  if f"{m}.experts.gate_up_proj" in w:  # transformers 5
    gate_up = w(f"{m}.experts.gate_up_proj", (E, 2 * F, D))
    return out | {"w_gate": gate_up[:, :F].transpose(0, 2, 1), "w_up": gate_up[:, F:].transpose(0, 2, 1),
                  "w_down": w(f"{m}.experts.down_proj", (E, D, F)).transpose(0, 2, 1)}
  each = [mlp_in(w, f"{m}.experts.{e}", D, F) for e in range(E)]  # transformers 4, the release
  return out | {f"w_{n}": np.stack([x[n]["kernel"] for x in each]) for n in ("gate", "up", "down")}


def mlp_in(w: Weights, at: str, D: int, F: int) -> dict[str, Any]:
  return {n: {"kernel": w(f"{at}.{n}_proj.weight", shape).T}
          for n, shape in (("gate", (F, D)), ("up", (F, D)), ("down", (D, F)))}


def weights_in(w: Weights, cfg: ModelConfig) -> dict[str, Any]:
  scales = sorted(n for n in w.names if n.endswith("weight_scale_inv"))
  if scales:  # the release's fp8 blocks: refused on the names, before a weight is read
    raise invalid("checkpoint", scales[:2], "bf16 or float32 weights: attn does not dequantize DeepSeek's fp8 "
                  "blocks (weight_scale_inv); convert them first (DeepSeek's inference/fp8_cast_bf16.py)")
  D, N = cfg.d_model, cfg.vocab_size
  norm = lambda name: {"scale": w(f"{name}.weight", (D,))}  # noqa: E731
  blocks = {}
  for l in range(cfg.num_layers):
    at = f"layers.{l}"
    mlp = experts_in(w, f"{at}.mlp", cfg) if cfg.is_moe_layer(l) else mlp_in(w, f"{at}.mlp", D, cfg.d_ff)
    blocks[l] = {"attn": {"params": attention_in(w, f"{at}.self_attn", cfg)}, "mlp": mlp,
                 "attn_norm": norm(f"{at}.input_layernorm"), "mlp_norm": norm(f"{at}.post_attention_layernorm")}
  out = decoder_in(w, blocks, norm, cfg, N, D)
  for name in w.names:  # the release's multi-token-prediction layer, after the last: not read, as transformers
    if name.startswith(f"layers.{cfg.num_layers}."):
      w(name)
  return out


def fused_experts() -> bool:
  """Whether the installed transformers (5 and later, or none) holds each layer's experts fused."""
  try:
    return int(importlib.metadata.version("transformers").split(".")[0]) >= 5
  except importlib.metadata.PackageNotFoundError:
    return True


def weights_out(pure: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
  head = pure["embed"]["token"] if cfg.tie_embeddings else np.asarray(pure["head"]["linear"]["kernel"]).T
  sd = {"model.embed_tokens.weight": pure["embed"]["token"], "model.norm.weight": pure["final_norm"]["scale"],
        "lm_head.weight": head}
  for l, block in pure["blocks"].items():
    p = {k: np.asarray(v) for k, v in block["attn"]["params"].items()}
    at = f"model.layers.{l}"
    sd |= attention_out(p, f"{at}.self_attn", cfg) | mlp_out(block["mlp"], f"{at}.mlp", cfg, int(l))
    sd |= {f"{at}.input_layernorm.weight": block["attn_norm"]["scale"],
           f"{at}.post_attention_layernorm.weight": block["mlp_norm"]["scale"]}
  return sd


def attention_out(p: dict[str, np.ndarray], a: str, cfg: ModelConfig) -> dict[str, np.ndarray]:
  """One mla layer's tensors under the checkpoint's names (kimi_linear's full-attention layers too)."""
  D, H, K, V, r, Q = cfg.d_model, cfg.num_heads, cfg.head.d_k, cfg.head.d_v, cfg.rope_dim, cfg.q_latent_dim
  nope = K - r
  kv_b = np.concatenate([p["w_uk"], p["w_uv"]], -1).transpose(1, 2, 0).reshape(H * (nope + V), -1)
  sd = {f"{a}.kv_a_proj_with_mqa.weight": np.concatenate([p["w_dkv"], p["w_kr"]], 1).T,
        f"{a}.kv_a_layernorm.weight": p["latent_norm"], f"{a}.kv_b_proj.weight": kv_b,
        f"{a}.o_proj.weight": p["w_o"].reshape(H * V, D).T}
  if Q is None:
    sd[f"{a}.q_proj.weight"] = _nope_first(p["w_q"], r).reshape(D, H * K).T
  else:
    sd |= {f"{a}.q_a_proj.weight": p["w_dq"].T, f"{a}.q_a_layernorm.weight": p["q_latent_norm"],
           f"{a}.q_b_proj.weight": _nope_first(p["w_uq"], r).reshape(Q, H * K).T}
  return sd


def mlp_out(e: dict[str, Any], m: str, cfg: ModelConfig, l: int) -> dict[str, np.ndarray]:
  """Layer l's dense MLP or experts (router, correction bias, shared experts) under the checkpoint's names,
  in the installed transformers' layout."""
  if not cfg.is_moe_layer(l):
    return _mlp_out(e, m)
  sd = {f"{m}.gate.weight": np.asarray(e["router_w"]).T, f"{m}.gate.e_score_correction_bias": e["correction"],
        **_mlp_out(e["shared"], f"{m}.shared_experts")}
  gate, up, down = (np.asarray(e[f"w_{n}"]) for n in ("gate", "up", "down"))
  if fused_experts():
    return sd | {f"{m}.experts.gate_up_proj": np.concatenate([gate, up], -1).transpose(0, 2, 1),
                 f"{m}.experts.down_proj": down.transpose(0, 2, 1)}
  for i in range(cfg.moe_experts):
    sd |= _mlp_out({"gate": {"kernel": gate[i]}, "up": {"kernel": up[i]}, "down": {"kernel": down[i]}},
                   f"{m}.experts.{i}")
  return sd


def _mlp_out(mlp: dict[str, Any], at: str) -> dict[str, np.ndarray]:
  return {f"{at}.{n}_proj.weight": np.asarray(mlp[n]["kernel"]).T for n in ("gate", "up", "down")}


def check_out(cfg: ModelConfig) -> None:
  K = cfg.head.d_k
  if cfg.num_kv_heads != cfg.num_heads or cfg.latent_norm_eps != LATENT_NORM_EPS or not 0 < cfg.rope_dim < K:
    raise invalid("num_kv_heads, latent_norm_eps, rope_dim", (cfg.num_kv_heads, cfg.latent_norm_eps, cfg.rope_dim),
                  f"({cfg.num_heads}, {LATENT_NORM_EPS}, in (0, d_k={K})): deepseek_v3's kv heads, latent norms "
                  "and decoupled RoPE key")
  if cfg.use_bias or cfg.has_dense_bias:
    raise invalid("use_bias, dense_bias", (cfg.use_bias, cfg.dense_bias), "False: deepseek_v3 has no biases here")
  if cfg.mlp == "moe" and not (cfg.moe_router == "sigmoid" and cfg.moe_swiglu_limit is None and cfg.moe_d_ff
                               and cfg.moe_shared_experts >= 1):
    raise invalid("moe_router, moe_swiglu_limit, moe_d_ff, moe_shared_experts",
                  (cfg.moe_router, cfg.moe_swiglu_limit, cfg.moe_d_ff, cfg.moe_shared_experts),
                  "('sigmoid', None, a width, >= 1): DeepSeek-V3's router and experts")
  if cfg.window is not None:
    raise invalid("window", cfg.window, "None: deepseek_v3 has no sliding windows")
  if cfg.mlp not in ("gated", "moe"):
    raise invalid("mlp", cfg.mlp, "'gated' or 'moe': deepseek_v3's feed-forward is gated")


def config_out(cfg: ModelConfig) -> dict[str, Any]:
  rope = rope_to_hf(cfg)
  if cfg.rope_mscale_all_dim is not None:
    for key in ("rope_parameters", "rope_scaling"):
      rope[key] = rope[key] | {"mscale_all_dim": cfg.rope_mscale_all_dim}
  moe = cfg.mlp == "moe"
  return dict(
      architectures=["DeepseekV3ForCausalLM"], vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
      intermediate_size=cfg.d_ff, num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
      num_key_value_heads=cfg.num_heads, q_lora_rank=cfg.q_latent_dim, kv_lora_rank=cfg.latent_dim,
      qk_rope_head_dim=cfg.rope_dim, qk_nope_head_dim=cfg.head.d_k - cfg.rope_dim, v_head_dim=cfg.head.d_v,
      head_dim=cfg.rope_dim, rope_interleave=cfg.rope_layout == "interleaved",
      max_position_embeddings=cfg.max_len, rms_norm_eps=cfg.norm_eps, **rope,
      tie_word_embeddings=cfg.tie_embeddings, attention_bias=False, attention_dropout=0.0,
      hidden_act=llama.activation_out(cfg, ("silu", "gelu_pytorch_tanh", "gelu", "relu")),
      first_k_dense_replace=cfg.moe_dense_first if moe else cfg.num_layers,
      n_routed_experts=cfg.moe_experts if moe else 2, num_experts_per_tok=cfg.moe_top_k if moe else 1,
      moe_intermediate_size=cfg.moe_d_ff if moe else 1, n_group=cfg.moe_groups, topk_group=cfg.moe_topk_groups,
      routed_scaling_factor=cfg.moe_routed_scaling, n_shared_experts=cfg.moe_shared_experts if moe else 1,
      norm_topk_prob=cfg.moe_norm_topk, pad_token_id=None, bos_token_id=None, eos_token_id=None)


ROW = llama.LlamaLike("DeepseekV3ForCausalLM", qkv_bias=False, o_bias=False,
                      layer_types=lambda hf, L: ["full_attention"] * L)
_BASE = llama.family("deepseek_v3", ROW)
DEEPSEEK_V3 = dataclasses.replace(
    _BASE, config_in=config_in, weights_in=weights_in, weights_out=weights_out, config_out=config_out,
    check_out=check_out, variant="mla",
    fixed={k: v for k, v in _BASE.fixed.items() if k != "mlp"},
    mapped=_BASE.mapped | {"mlp", "latent_norm_eps", "rope_layout", "rope_mscale_all_dim", "moe_experts", "moe_top_k",
                           "moe_d_ff", "moe_router", "moe_norm_topk", "moe_groups", "moe_topk_groups",
                           "moe_routed_scaling", "moe_shared_experts", "moe_dense_first"},
    refusals=dict(_BASE.refusals) | {
        "attention_bias": ((False,), "attn's mla has no bias on q_a_proj / kv_a_proj_with_mqa"),
        "scoring_func": (("sigmoid",), "DeepSeek-V3's router scores experts with a sigmoid"),
        "topk_method": (("noaux_tc",), "DeepSeek-V3's group-limited top-k with a correction bias"),
        "moe_layer_freq": ((1,), "experts in every layer past first_k_dense_replace"),
        "output_router_logits": ((False,), "attn's MoE returns no router logits")})
