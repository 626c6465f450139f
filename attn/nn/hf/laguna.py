"""Laguna (model_type laguna) as a DecoderLM: a softplus output gate, query heads per layer, per-head
QK-norm, partial RoPE per layer type, sigmoid-routed experts with a shared expert.

Attention is per_head with QK-norm (q_norm and k_norm over each head, before RoPE: attn's qk_norm) and
an output gate softplus(x·W_g) before o_proj (attn's gate with gate_activation "softplus": "headwise"
for gating True or "per-head", one gate per head; "elementwise" for "per-element", and for False,
which transformers reads as per-element too), no biases (attention_bias True is refused: attn's gate
would add one the checkpoint lacks). num_attention_heads_per_layer gives each layer its own query
heads (attn's layer_num_heads), over the same kv heads. layer_types maps entry for entry; each type
rotates the first int(head_dim·partial_rotary_factor) dims at its own base (the full layers' as
rope_theta and rope_dim, the sliding ones' as sliding_rope_theta and layer_heads' rope_dim). The
feed-forward is a gated MLP where mlp_layer_types says "dense" (the first layers) and experts after:
a sigmoid router whose correction bias moves the choice only, the kept weights renormalised, times
moe_routed_scaling_factor, beside one shared expert of width shared_expert_intermediate_size (attn's
moe_router "sigmoid", moe_shared_d_ff). On disk (save_pretrained, the release) the correction bias
is experts.e_score_correction_bias, the shared expert shared_expert and the experts one tensor each;
in memory gate.e_score_correction_bias, shared_experts and fused experts: both are read. A router
soft-cap (moe_router_logit_softcapping) and a quantized checkpoint (quantization_config) are refused by
name. transformers has Laguna from 5.25.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from attn.config import invalid
from attn.nn.hf import deepseek_v3, llama, mimo_v2_flash
from attn.nn.hf.base import Family, Weights, activation_out, decoder_in, get
from attn.nn.config import ModelConfig

_TYPES = ("full_attention", "sliding_attention")
_GATES = {True: "headwise", "per-head": "headwise", "per-element": "elementwise", False: "elementwise"}


def config_in(hf: dict[str, Any]) -> ModelConfig:
  """Llama's reader over full layers, then the gate, the heads per layer, the bases and the experts."""
  L, K, H = get(hf, "num_hidden_layers"), get(hf, "head_dim"), get(hf, "num_attention_heads")
  types = list(hf.get("layer_types") or ["full_attention"] * L)
  if len(types) != L or set(types) - set(_TYPES):
    raise invalid("config.layer_types", types, f"{L} of 'full_attention' / 'sliding_attention'")
  gating = hf.get("gating", True)
  if gating not in _GATES or isinstance(gating, int) and not isinstance(gating, bool):
    raise invalid("config.gating", gating, "True, False, 'per-head' or 'per-element': Laguna's softplus gate")
  params = hf.get("rope_parameters") or {}
  full = params.get("full_attention") or {"partial_rotary_factor": 0.5, "rope_theta": 500000.0}
  slide = params.get("sliding_attention") or {"partial_rotary_factor": 1.0, "rope_theta": 10000.0}
  ropes = {"full_attention": {"partial_rotary_factor": 1.0} | full,
           "sliding_attention": {"partial_rotary_factor": 1.0} | slide}
  (theta, r), (s_theta, s_r) = (mimo_v2_flash._rope({"rope_parameters": ropes}, kind, K) for kind in _TYPES)
  base = llama.config_in(ROW, {k: v for k, v in hf.items() if k != "rope_parameters"}
                         | {"layer_types": ["full_attention"] * L, "rope_theta": theta})
  sliding = "sliding_attention" in types
  if sliding and not hf.get("sliding_window"):
    raise invalid("config.sliding_window", hf.get("sliding_window"), "a window: layer_types has sliding layers")
  per_layer = hf.get("num_attention_heads_per_layer")
  if per_layer is not None and (not isinstance(per_layer, list) or len(per_layer) != L):
    raise invalid("config.num_attention_heads_per_layer", per_layer, f"a list of {L} counts of query heads")
  heads = None if per_layer is None or all(n == H for n in per_layer) else tuple(per_layer)
  dense = list(hf.get("mlp_layer_types") or ["dense"] + ["sparse"] * (L - 1))
  first = next((i for i, t in enumerate(dense) if t != "dense"), L)
  if len(dense) != L or dense[first:] != ["sparse"] * (L - first):
    raise invalid("config.mlp_layer_types", dense, f"{L} entries, 'dense' layers first and 'sparse' after: "
                  "attn's moe_dense_first")
  moe = {}
  if first < L:
    moe = dict(mlp="moe", moe_experts=get(hf, "num_experts"), moe_top_k=get(hf, "num_experts_per_tok"),
               moe_d_ff=get(hf, "moe_intermediate_size"), moe_router="sigmoid", moe_norm_topk=True,
               moe_routed_scaling=float(hf.get("moe_routed_scaling_factor", 1.0)), moe_shared_experts=1,
               moe_shared_d_ff=get(hf, "shared_expert_intermediate_size"), moe_dense_first=first)
  return base.replace(
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)), rope_dim=r, layer_types=tuple(types), window=int(hf["sliding_window"]) if sliding else None, global_every=0,
      sliding_rope_theta=s_theta if sliding else None,
      layer_heads={"sliding_attention": {"rope_dim": s_r}} if sliding and s_r != r else None,
      layer_num_heads=heads, gate=_GATES[gating], gate_activation="softplus", **moe)


def _experts_in(w: Weights, m: str, cfg: ModelConfig) -> dict[str, Any]:
  D, E, F = cfg.d_model, cfg.moe_experts, cfg.moe_d_ff
  bias = f"{m}.gate.e_score_correction_bias"
  shared = f"{m}.shared_experts" if f"{m}.shared_experts.gate_proj.weight" in w else f"{m}.shared_expert"
  out = {"router_w": w(f"{m}.gate.weight", (E, D)).T,
         "correction": w(bias if bias in w else f"{m}.experts.e_score_correction_bias", (E,)),
         "shared": deepseek_v3.mlp_in(w, shared, D, cfg.moe_shared_d_ff)}
  return out | mimo_v2_flash.routed_in(w, m, E, D, F)


def weights_in(w: Weights, cfg: ModelConfig) -> dict[str, Any]:
  D, N = cfg.d_model, cfg.vocab_size
  norm = lambda name: {"scale": w(f"{name}.weight", (D,))}  # noqa: E731
  blocks = {}
  for l in range(cfg.num_layers):
    head, a, at = cfg.layer_head(l), f"layers.{l}.self_attn", f"layers.{l}"
    H, G, K = head.num_heads, head.num_kv_heads, head.d_k
    gate = (H,) if head.gate == "headwise" else (H, K)
    p = {"w_q": w(f"{a}.q_proj.weight", (H * K, D)).T.reshape(D, H, K),
         "w_k": w(f"{a}.k_proj.weight", (G * K, D)).T.reshape(D, G, K),
         "w_v": w(f"{a}.v_proj.weight", (G * K, D)).T.reshape(D, G, K),
         "w_o": w(f"{a}.o_proj.weight", (D, H * K)).T.reshape(H, K, D),
         "q_norm": w(f"{a}.q_norm.weight", (K,)), "k_norm": w(f"{a}.k_norm.weight", (K,)),
         "w_gate": w(f"{a}.g_proj.weight", (int(np.prod(gate)), D)).T.reshape(D, *gate)}
    mlp = _experts_in(w, f"{at}.mlp", cfg) if cfg.is_moe_layer(l) else deepseek_v3.mlp_in(w, f"{at}.mlp", D, cfg.d_ff)
    blocks[l] = {"attn": {"params": p}, "mlp": mlp, "attn_norm": norm(f"{at}.input_layernorm"),
                 "mlp_norm": norm(f"{at}.post_attention_layernorm")}
  return decoder_in(w, blocks, norm, cfg, N, D)


def weights_out(pure: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
  D = cfg.d_model
  head_w = pure["embed"]["token"] if cfg.tie_embeddings else np.asarray(pure["head"]["linear"]["kernel"]).T
  sd = {"model.embed_tokens.weight": pure["embed"]["token"], "model.norm.weight": pure["final_norm"]["scale"],
        "lm_head.weight": head_w}
  for l, block in pure["blocks"].items():
    head, at = cfg.layer_head(int(l)), f"model.layers.{l}"
    H, G, K, a = head.num_heads, head.num_kv_heads, head.d_k, f"{at}.self_attn"
    p = {k: np.asarray(v) for k, v in block["attn"]["params"].items()}
    sd |= {f"{a}.q_proj.weight": p["w_q"].reshape(D, H * K).T, f"{a}.k_proj.weight": p["w_k"].reshape(D, G * K).T,
           f"{a}.v_proj.weight": p["w_v"].reshape(D, G * K).T, f"{a}.o_proj.weight": p["w_o"].reshape(H * K, D).T,
           f"{a}.q_norm.weight": p["q_norm"], f"{a}.k_norm.weight": p["k_norm"],
           f"{a}.g_proj.weight": p["w_gate"].reshape(D, -1).T}
    e, m = block["mlp"], f"{at}.mlp"
    if cfg.is_moe_layer(int(l)):
      gate, up, down = (np.asarray(e[f"w_{n}"]) for n in ("gate", "up", "down"))
      sd |= {f"{m}.gate.weight": np.asarray(e["router_w"]).T, f"{m}.gate.e_score_correction_bias": e["correction"],
             f"{m}.experts.gate_up_proj": np.concatenate([gate, up], -1).transpose(0, 2, 1),
             f"{m}.experts.down_proj": down.transpose(0, 2, 1),
             **{f"{m}.shared_experts.{n}_proj.weight": np.asarray(e["shared"][n]["kernel"]).T
                for n in ("gate", "up", "down")}}
    else:
      sd |= {f"{m}.{n}_proj.weight": np.asarray(e[n]["kernel"]).T for n in ("gate", "up", "down")}
    sd |= {f"{at}.input_layernorm.weight": block["attn_norm"]["scale"],
           f"{at}.post_attention_layernorm.weight": block["mlp_norm"]["scale"]}
  return sd


def check_out(cfg: ModelConfig) -> None:
  for i, kind in enumerate(cfg.layer_types or ()):
    if kind not in _TYPES:
      raise invalid(f"layer_types[{i}]", kind, f"one of {list(_TYPES)}: laguna's layer types")
  if cfg.gate is None or cfg.gate_activation != "softplus":
    raise invalid("gate, gate_activation", (cfg.gate, cfg.gate_activation),
                  "('headwise' or 'elementwise', 'softplus'): every laguna layer has its softplus gate")
  if cfg.qk_norm_eps != cfg.norm_eps:
    raise invalid("qk_norm_eps", cfg.qk_norm_eps, f"norm_eps={cfg.norm_eps}: laguna has one rms_norm_eps")
  if cfg.head.d_v != cfg.head.d_k:
    raise invalid("d_v", cfg.head.d_v, f"d_k={cfg.head.d_k}: laguna's heads have one width")
  if cfg.has_dense_bias:
    raise invalid("dense_bias", cfg.dense_bias, "False: laguna's MLPs have no biases")
  if cfg.mlp == "moe" and not (cfg.moe_router == "sigmoid" and cfg.moe_shared_experts == 1 and cfg.moe_norm_topk
                               and cfg.moe_groups == 1 and cfg.moe_swiglu_limit is None and cfg.moe_d_ff
                               and cfg.moe_shared_d_ff and not cfg.moe_shared_gate):
    raise invalid("moe_router, moe_shared_experts, moe_groups", (cfg.moe_router, cfg.moe_shared_experts, cfg.moe_groups),
                  "('sigmoid', 1, 1) with moe_shared_d_ff set: laguna's router and one ungated shared expert")
  if cfg.mlp not in ("gated", "moe"):
    raise invalid("mlp", cfg.mlp, "'gated' or 'moe'")


def config_out(cfg: ModelConfig) -> dict[str, Any]:
  L, K = cfg.num_layers, cfg.head.d_k
  types = ["full_attention" if cfg.layer_head(i).window is None else "sliding_attention" for i in range(L)]
  sliding = "sliding_attention" in types
  s_head = cfg.layer_head(types.index("sliding_attention")) if sliding else cfg.head
  s_theta = cfg.sliding_rope_theta if cfg.sliding_rope_theta is not None else cfg.rope_theta
  moe = cfg.mlp == "moe"
  first = cfg.moe_dense_first if moe else L
  return dict(
      architectures=["LagunaForCausalLM"], vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
      intermediate_size=cfg.d_ff, num_hidden_layers=L, num_attention_heads=cfg.num_heads,
      num_key_value_heads=cfg.num_kv_heads, head_dim=K, max_position_embeddings=cfg.max_len,
      rms_norm_eps=cfg.norm_eps, hidden_act=activation_out(cfg, ("silu", "gelu_pytorch_tanh", "gelu", "relu")),
      tie_word_embeddings=cfg.tie_embeddings, attention_bias=False, attention_dropout=0.0,
      gating="per-head" if cfg.gate == "headwise" else "per-element",
      num_attention_heads_per_layer=[cfg.layer_head(i).num_heads for i in range(L)], layer_types=types,
      sliding_window=cfg.window or cfg.max_len,
      rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": cfg.rope_theta,
                                          "partial_rotary_factor": mimo_v2_flash._fraction(K, cfg.rope_dim)},
                       "sliding_attention": {"rope_type": "default", "rope_theta": s_theta,
                                             "partial_rotary_factor": mimo_v2_flash._fraction(K, s_head.rope_dim)}},
      mlp_layer_types=["dense"] * first + ["sparse"] * (L - first), num_experts=cfg.moe_experts or 1,
      num_experts_per_tok=cfg.moe_top_k or 1, moe_intermediate_size=cfg.moe_d_ff or cfg.d_ff,
      shared_expert_intermediate_size=cfg.moe_shared_d_ff or cfg.d_ff,
      moe_routed_scaling_factor=cfg.moe_routed_scaling, moe_router_logit_softcapping=0.0,
      pad_token_id=None, bos_token_id=None, eos_token_id=None)


ROW = llama.LlamaLike("LagunaForCausalLM", qkv_bias=False, o_bias=False, qk_norm=True)
LAGUNA = Family(
    name="laguna", model_types=("laguna",), architectures=("LagunaForCausalLM",),
    config_in=config_in, weights_in=weights_in, weights_out=weights_out, config_out=config_out, prefix="model.",
    refusals={"is_encoder_decoder": ((False,), "attn loads decoder-only models here"),
              "output_router_logits": ((False,), "attn's MoE returns no router logits"),
              "quantization_config": ((None,), "float weights: attn does not dequantize quantized checkpoints (the "
                                               "release's fp8 blocks); dequantize them first"),
              "attention_bias": ((False,), "attn's softplus gate would hold a bias the checkpoint lacks"),
              "moe_router_logit_softcapping": ((0.0, 0), "attn's sigmoid router has no logit soft-cap"),
              "moe_apply_router_weight_on_input": ((False,), "transformers does not run it either")},
    fixed={"positional": "rope", "norm": "pre", "norm_type": "rmsnorm", "final_norm": True, "layernorm": True,
           "num_segments": 0, "embed_norm": False, "embed_scale": False, "qk_norm": True, "use_bias": False,
           "qk_norm_plus_one": False, "sinks": False},
    mapped=llama.MAPPED | {"layer_types", "layer_heads", "sliding_rope_theta", "layer_num_heads", "gate",
                           "gate_activation", "mlp", "moe_experts", "moe_top_k", "moe_d_ff", "moe_router",
                           "moe_norm_topk", "moe_routed_scaling", "moe_shared_experts", "moe_shared_d_ff",
                           "moe_dense_first"},
    check_out=check_out,
    counted_buffers=lambda cfg: cfg.moe_experts * sum(cfg.is_moe_layer(l) for l in range(cfg.num_layers)))
