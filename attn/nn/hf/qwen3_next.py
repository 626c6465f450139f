"""Qwen3-Next (text) in and out: a hybrid DecoderLM of gated_deltanet and gated softmax layers.

Its layer_types map entry for entry ("linear_attention" -> attn.variants.gated_deltanet with
linear_head {num_heads: linear_num_value_heads, num_kv_heads: linear_num_key_heads, d_k, d_v:
linear_key/value_head_dim, conv_width: linear_conv_kernel_dim}); a full-attention layer is a
Llama-like per_head layer with three Qwen3-Next changes: q_proj holds each head's query and its
output gate side by side ([query | gate] per head, transformers' torch.chunk), which is attn's
elementwise gate σ(x·W_gate) on o_h; q_norm and k_norm are zero-centred RMSNorms (x̂·(1 + w),
held by attn as w: ModelConfig.qk_norm_plus_one); partial_rotary_factor rotates the first int(f·head_dim) dims. Every
RMSNorm of the blocks and the final one is zero-centred too: norm_type "rmsnorm_plus_one".

Experts (num_experts > 0) are attn.nn.moe's: the softmax router (gate.weight), top
num_experts_per_tok renormalised with norm_topk_prob, experts of moe_intermediate_size (fused
gate_up_proj / down_proj in transformers 5, experts.{e}.* in the release: both read, the installed
transformers' layout written), and one shared expert of shared_expert_intermediate_size scaled by
σ(x·shared_expert_gate) (ModelConfig.moe_shared_d_ff, moe_shared_gate). The layers in
mlp_only_layers keep a dense MLP: they must be the first ones (moe_dense_first), with
decoder_sparse_step 1 after them.

Refused by name before any weight is read: a layer type other than full_attention or
linear_attention, experts in any other schedule of layers, attention biases and router logits
out. rms_norm_eps is every norm's, the linear layers' gated norms' too (linear_head's
gated_norm_eps). to_hf writes the same tensors back, bit for bit.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from attn.config import invalid
from attn.nn.hf import deepseek_v3, llama
from attn.nn.hf.base import Family, Weights, decoder_in, get
from attn.nn.hf.rope import rope_from_hf, rotary_fraction
from attn.nn.config import ModelConfig

KINDS = ("full_attention", "linear_attention")


def _check(hf: dict[str, Any]) -> list[str]:
  L = get(hf, "num_hidden_layers")
  kinds = list(get(hf, "layer_types"))
  if len(kinds) != L or set(kinds) - set(KINDS):
    raise invalid("config.layer_types", kinds, f"{L} of {list(KINDS)}")
  if hf.get("attention_bias"):
    raise invalid("config.attention_bias", True, "False: attn's reader has no Qwen3-Next attention biases")
  return kinds


def dense_first(hf: dict[str, Any], L: int) -> int:
  """How many first layers keep a dense MLP (L: no experts); experts must be in every layer after them."""
  dense = set(hf.get("mlp_only_layers") or ())
  step = hf.get("decoder_sparse_step", 1) or 1
  experts = [i for i in range(L) if i not in dense and (hf.get("num_experts") or 0) > 0 and (i + 1) % step == 0]
  if experts != list(range(L - len(experts), L)):
    raise invalid("config.mlp_only_layers, decoder_sparse_step", (sorted(dense), step), "experts in every layer "
                  f"after the first dense ones (layers {experts} have experts): attn's experts start after "
                  "moe_dense_first dense layers")
  return L - len(experts)


def _experts(hf: dict[str, Any], first: int) -> dict[str, Any]:
  """The MoE fields: softmax router, top-k renormalised, one shared expert of its own width, gated by σ(x·w)."""
  return dict(mlp="moe", moe_experts=get(hf, "num_experts"), moe_top_k=get(hf, "num_experts_per_tok"),
              moe_d_ff=get(hf, "moe_intermediate_size"), moe_router="softmax",
              moe_norm_topk=bool(hf.get("norm_topk_prob", True)), moe_shared_experts=1,
              moe_shared_d_ff=get(hf, "shared_expert_intermediate_size"), moe_shared_gate=True, moe_dense_first=first)


def config_in(hf: dict[str, Any]) -> ModelConfig:
  kinds = _check(hf)
  first = dense_first(hf, len(kinds))
  base = llama.config_in(ROW, {**hf, "layer_types": ["full_attention"] * len(kinds)})
  K = base.head.d_k
  linear = {"num_heads": get(hf, "linear_num_value_heads"), "num_kv_heads": get(hf, "linear_num_key_heads"),
            "d_k": get(hf, "linear_key_head_dim"), "d_v": get(hf, "linear_value_head_dim"),
            "conv_width": get(hf, "linear_conv_kernel_dim"), "gated_norm_eps": base.norm_eps}
  return base.replace(rope_dim=int(rotary_fraction(hf) * K), gate="elementwise", layer_types=tuple(kinds),
                      linear_head=linear if "linear_attention" in kinds else None,
                      **(_experts(hf, first) if first < len(kinds) else {}))


def _full(w: Weights, a: str, cfg: ModelConfig) -> dict[str, np.ndarray]:
  D, H, G, K = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head.d_k
  q_and_gate = w(f"{a}.q_proj.weight", (H * 2 * K, D)).T.reshape(D, H, 2 * K)
  return {"w_q": q_and_gate[..., :K], "w_gate": q_and_gate[..., K:],
          "w_k": w(f"{a}.k_proj.weight", (G * K, D)).T.reshape(D, G, K),
          "w_v": w(f"{a}.v_proj.weight", (G * K, D)).T.reshape(D, G, K),
          "w_o": w(f"{a}.o_proj.weight", (D, H * K)).T.reshape(H, K, D),
          # config_in set cfg.qk_norm_plus_one (ROW's): the checkpoint's w as it is, x̂·(1 + w) in the model
          "q_norm": w(f"{a}.q_norm.weight", (K,)), "k_norm": w(f"{a}.k_norm.weight", (K,))}


def _linear(w: Weights, a: str, cfg: ModelConfig, l: int) -> dict[str, np.ndarray]:
  """in_proj_qkvz holds, per key head g, [q_g | k_g | v of its R value heads | z of them]; in_proj_ba
  [b of its R value heads | a of them]; conv1d's channels are [q | k | v] (attn.variants.gated_deltanet)."""
  head = cfg.layer_head(l)
  D, H, G, K, V, W = head.d_model, head.num_heads, head.num_kv_heads, head.d_k, head.d_v, head.conv_width
  R = H // G
  qkvz = w(f"{a}.in_proj_qkvz.weight", (G * (2 * K + 2 * R * V), D)).T.reshape(D, G, 2 * K + 2 * R * V)
  ba = w(f"{a}.in_proj_ba.weight", (2 * H, D)).T.reshape(D, G, 2 * R)
  conv = w(f"{a}.conv1d.weight", (2 * G * K + H * V, 1, W))[:, 0].T
  return {"w_q": qkvz[..., :K], "w_k": qkvz[..., K:2 * K],
          "w_v": qkvz[..., 2 * K:2 * K + R * V].reshape(D, H, V), "w_z": qkvz[..., 2 * K + R * V:].reshape(D, H, V),
          "w_b": ba[..., :R].reshape(D, H), "w_a": ba[..., R:].reshape(D, H),
          "conv_q": conv[:, :G * K].reshape(W, G, K), "conv_k": conv[:, G * K:2 * G * K].reshape(W, G, K),
          "conv_v": conv[:, 2 * G * K:].reshape(W, H, V),
          "a_log": w(f"{a}.A_log", (H,)), "dt_bias": w(f"{a}.dt_bias", (H,)), "norm": w(f"{a}.norm.weight", (V,)),
          "w_o": w(f"{a}.out_proj.weight", (D, H * V)).T.reshape(H, V, D)}


def weights_in(w: Weights, cfg: ModelConfig, linear_in=None) -> dict[str, Any]:
  """The model's arrays; linear_in(w, at, cfg, l) reads a linear layer (default: Qwen3-Next's tensors)."""
  linear_in = linear_in or _linear
  D, F, N = cfg.d_model, cfg.d_ff, cfg.vocab_size
  norm = lambda name: {"scale": w(f"{name}.weight", (D,))}
  blocks = {}
  for l, kind in enumerate(cfg.layer_types):
    params = (linear_in(w, f"layers.{l}.linear_attn", cfg, l) if kind == "linear_attention"
              else _full(w, f"layers.{l}.self_attn", cfg))
    mlp = (_experts_in(w, f"layers.{l}.mlp", cfg) if cfg.is_moe_layer(l)
           else deepseek_v3.mlp_in(w, f"layers.{l}.mlp", D, F))
    blocks[l] = {"attn": {"params": params}, "mlp": mlp, "attn_norm": norm(f"layers.{l}.input_layernorm"),
                 "mlp_norm": norm(f"layers.{l}.post_attention_layernorm")}
  out = decoder_in(w, blocks, norm, cfg, N, D)
  return out


def _experts_in(w: Weights, m: str, cfg: ModelConfig) -> dict[str, Any]:
  """Router, experts (transformers 5's fused gate_up_proj / down_proj, or experts.{e}.* as transformers 4
  and the release hold them), the shared expert and its gate."""
  D, E, F = cfg.d_model, cfg.moe_experts, cfg.moe_d_ff
  out = {"router_w": w(f"{m}.gate.weight", (E, D)).T, "shared_gate": w(f"{m}.shared_expert_gate.weight", (1, D)).T,
         "shared": deepseek_v3.mlp_in(w, f"{m}.shared_expert", D, cfg.moe_shared_d_ff)}
  if f"{m}.experts.gate_up_proj" in w:
    gate_up = w(f"{m}.experts.gate_up_proj", (E, 2 * F, D))
    return out | {"w_gate": gate_up[:, :F].transpose(0, 2, 1), "w_up": gate_up[:, F:].transpose(0, 2, 1),
                  "w_down": w(f"{m}.experts.down_proj", (E, D, F)).transpose(0, 2, 1)}
  each = [deepseek_v3.mlp_in(w, f"{m}.experts.{e}", D, F) for e in range(E)]
  return out | {f"w_{n}": np.stack([x[n]["kernel"] for x in each]) for n in ("gate", "up", "down")}


def _mlp_out(e: dict[str, Any], m: str, cfg: ModelConfig, l: int) -> dict[str, np.ndarray]:
  dense = lambda mlp, at: {f"{at}.{n}_proj.weight": np.asarray(mlp[n]["kernel"]).T  # noqa: E731
                           for n in ("gate", "up", "down")}
  if not cfg.is_moe_layer(l):
    return dense(e, m)
  sd = {f"{m}.gate.weight": np.asarray(e["router_w"]).T, f"{m}.shared_expert_gate.weight": np.asarray(e["shared_gate"]).T,
        **dense(e["shared"], f"{m}.shared_expert")}
  gate, up, down = (np.asarray(e[f"w_{n}"]) for n in ("gate", "up", "down"))
  if deepseek_v3.fused_experts():
    return sd | {f"{m}.experts.gate_up_proj": np.concatenate([gate, up], -1).transpose(0, 2, 1),
                 f"{m}.experts.down_proj": down.transpose(0, 2, 1)}
  for i in range(cfg.moe_experts):
    sd |= dense({"gate": {"kernel": gate[i]}, "up": {"kernel": up[i]}, "down": {"kernel": down[i]}},
                f"{m}.experts.{i}")
  return sd


def _full_out(p: dict[str, np.ndarray], a: str, cfg: ModelConfig) -> dict[str, np.ndarray]:
  D, H, G, K = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head.d_k
  q_and_gate = np.concatenate([p["w_q"], p["w_gate"]], -1).reshape(D, H * 2 * K)
  return {f"{a}.q_proj.weight": q_and_gate.T, f"{a}.k_proj.weight": p["w_k"].reshape(D, G * K).T,
          f"{a}.v_proj.weight": p["w_v"].reshape(D, G * K).T, f"{a}.o_proj.weight": p["w_o"].reshape(H * K, D).T,
          f"{a}.q_norm.weight": llama.qk_scale_out(ROW, cfg, p["q_norm"]),
          f"{a}.k_norm.weight": llama.qk_scale_out(ROW, cfg, p["k_norm"])}


def _linear_out(p: dict[str, np.ndarray], a: str, cfg: ModelConfig, l: int) -> dict[str, np.ndarray]:
  head = cfg.layer_head(l)
  D, H, G, K, V, W = head.d_model, head.num_heads, head.num_kv_heads, head.d_k, head.d_v, head.conv_width
  R = H // G
  qkvz = np.concatenate([p["w_q"], p["w_k"], p["w_v"].reshape(D, G, R * V), p["w_z"].reshape(D, G, R * V)], -1)
  ba = np.concatenate([p["w_b"].reshape(D, G, R), p["w_a"].reshape(D, G, R)], -1)
  conv = np.concatenate([p["conv_q"].reshape(W, -1), p["conv_k"].reshape(W, -1), p["conv_v"].reshape(W, -1)], -1)
  return {f"{a}.in_proj_qkvz.weight": qkvz.reshape(D, -1).T, f"{a}.in_proj_ba.weight": ba.reshape(D, -1).T,
          f"{a}.conv1d.weight": conv.T[:, None, :], f"{a}.A_log": p["a_log"], f"{a}.dt_bias": p["dt_bias"],
          f"{a}.norm.weight": p["norm"], f"{a}.out_proj.weight": p["w_o"].reshape(H * V, D).T}


def weights_out(pure: dict[str, Any], cfg: ModelConfig, linear_out=None) -> dict[str, Any]:
  """The state dict; linear_out(p, at, cfg, l) writes a linear layer (default: Qwen3-Next's tensors)."""
  linear_out = linear_out or _linear_out
  sd = {"model.embed_tokens.weight": pure["embed"]["token"], "model.norm.weight": pure["final_norm"]["scale"]}
  sd["lm_head.weight"] = (pure["embed"]["token"] if cfg.tie_embeddings
                          else np.asarray(pure["head"]["linear"]["kernel"]).T)
  for l, block in pure["blocks"].items():
    l = int(l)
    p = {k: np.asarray(v) for k, v in block["attn"]["params"].items()}
    sd |= (linear_out(p, f"model.layers.{l}.linear_attn", cfg, l) if cfg.layer_types[l] == "linear_attention"
           else _full_out(p, f"model.layers.{l}.self_attn", cfg))
    sd |= _mlp_out(block["mlp"], f"model.layers.{l}.mlp", cfg, l)
    sd[f"model.layers.{l}.input_layernorm.weight"] = block["attn_norm"]["scale"]
    sd[f"model.layers.{l}.post_attention_layernorm.weight"] = block["mlp_norm"]["scale"]
  return sd


def config_out(cfg: ModelConfig) -> dict[str, Any]:
  kw = llama.config_out(ROW, "qwen3_next", cfg.replace(layer_types=None, linear_head=None,
                                                        rope_dim=cfg.head.d_k))
  kinds = list(cfg.layer_types or ["full_attention"] * cfg.num_layers)
  lin = cfg.layer_head(kinds.index("linear_attention")) if "linear_attention" in kinds else cfg.head
  return kw | {"partial_rotary_factor": cfg.rope_dim / cfg.head.d_k, "layer_types": kinds,
               "linear_num_value_heads": lin.num_heads, "linear_num_key_heads": lin.num_kv_heads,
               "linear_key_head_dim": lin.d_k, "linear_value_head_dim": lin.d_v,
               "linear_conv_kernel_dim": lin.conv_width, "attention_bias": False} | _experts_out(cfg)


def _experts_out(cfg: ModelConfig) -> dict[str, Any]:
  if cfg.mlp != "moe":
    return {"num_experts": 0, "mlp_only_layers": list(range(cfg.num_layers))}
  return {"num_experts": cfg.moe_experts, "num_experts_per_tok": cfg.moe_top_k, "moe_intermediate_size": cfg.moe_d_ff,
          "shared_expert_intermediate_size": cfg.moe_shared_d_ff or cfg.moe_d_ff, "norm_topk_prob": cfg.moe_norm_topk,
          "decoder_sparse_step": 1, "mlp_only_layers": list(range(cfg.moe_dense_first))}


def check_out(cfg: ModelConfig) -> None:
  if cfg.gate != "elementwise":
    raise invalid("gate", cfg.gate, "'elementwise': Qwen3-Next gates every full-attention head's output")
  if cfg.linear_variant != "gated_deltanet":
    raise invalid("linear_variant", cfg.linear_variant, "'gated_deltanet': Qwen3-Next's linear layers")
  eps = {cfg.layer_head(i).gated_norm_eps for i, kind in enumerate(cfg.layer_types or ()) if kind == "linear_attention"}
  if cfg.qk_norm_eps != cfg.norm_eps or eps - {cfg.norm_eps}:
    raise invalid("qk_norm_eps, linear_head.gated_norm_eps", (cfg.qk_norm_eps, sorted(eps)), f"norm_eps="
                  f"{cfg.norm_eps}: Qwen3-Next has one rms_norm_eps, its q/k norms' and gated norms' too")
  if cfg.mlp not in ("gated", "moe"):
    raise invalid("mlp", cfg.mlp, "'gated' or 'moe': Qwen3-Next's feed-forward is gated")
  moe = (cfg.moe_router, cfg.moe_shared_experts, cfg.moe_shared_gate, cfg.moe_groups, cfg.moe_routed_scaling,
         cfg.moe_swiglu_limit, bool(cfg.moe_d_ff))
  if cfg.mlp == "moe" and moe != ("softmax", 1, True, 1, 1.0, None, True):
    raise invalid("moe_router, moe_shared_experts, moe_shared_gate, moe_groups, moe_routed_scaling, "
                  "moe_swiglu_limit, moe_d_ff set", moe, "('softmax', 1, True, 1, 1.0, None, True): Qwen3-Next's "
                  "router and its one gated shared expert")


ROW = llama.LlamaLike("Qwen3NextForCausalLM", qkv_bias=False, o_bias=False, norm_type="rmsnorm_plus_one",
                      qk_norm=True, qk_norm_plus_one=True,
                      rope_in=lambda hf: rope_from_hf(hf, partial=True))

QWEN3_NEXT = Family(
    name="qwen3_next", model_types=("qwen3_next",), architectures=("Qwen3NextForCausalLM",),
    config_in=config_in, weights_in=weights_in, weights_out=weights_out, config_out=config_out, prefix="model.",
    refusals={"is_encoder_decoder": ((False,), "attn loads decoder-only models here"),
              "output_router_logits": ((False,), "attn's MoE returns no router logits")},
    fixed={"positional": "rope", "norm": "pre", "norm_type": "rmsnorm_plus_one", "final_norm": True,
           "layernorm": True, "num_segments": 0, "embed_norm": False, "embed_scale": False, "qk_norm": True,
           "use_bias": False},
    mapped=llama.MAPPED | {"layer_types", "linear_head", "linear_variant", "gate", "mlp", "moe_experts", "moe_top_k",
                           "moe_d_ff", "moe_router", "moe_norm_topk", "moe_shared_experts", "moe_shared_d_ff",
                           "moe_shared_gate", "moe_dense_first"}, check_out=check_out)
