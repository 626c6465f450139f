"""MiMo-V2-Flash (model_type mimo_v2_flash) as a DecoderLM: narrow value heads with a value scale, sliding
layers with twice the kv heads and sinks, partial RoPE per layer type, DeepSeek-routed experts.

Attention is per_head with d_k = head_dim and d_v = v_head_dim (192 and 128 in the release), every
value times attention_value_scale (attn's value_scale; None in the config: 1), q/k/v biases by
attention_bias and no o_proj bias (attn's b_o held as zeros). layer_types (default: layer 0 and every
6th full, the rest sliding) maps entry for entry; the sliding layers have 2·num_key_value_heads kv
heads and a learned sink per query head (layer_heads.sliding_attention: num_kv_heads, sinks) and
rotate with their own base, unscaled (sliding_rope_theta); each type rotates the first
int(head_dim·partial_rotary_factor) dims of its heads (rope_dim, the sliding type's in layer_heads
where it differs). The window is sliding_window (sliding_window_size + 1 where the config has that:
transformers' rule, the reference attends to sliding_window_size earlier tokens and the query).
The feed-forward is a gated MLP in the first layers (mlp_layer_types "dense") and DeepSeek-V3's
sigmoid-routed experts (correction bias, n_group, topk_group) without shared experts after. On
disk the sinks are attention_sink_bias and the experts one tensor each (experts.{e}.gate_proj, the
release's names, which save_pretrained writes); both forms are read. The release's multi-token
prediction layers (model.mtp.*) are not run, as transformers does not: skipped by name; a quantized
checkpoint (quantization_config: the release's fp8) is refused from config.json. transformers has
MiMo-V2-Flash from 5.25.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from attn.config import invalid
from attn.nn.hf import deepseek_v3, llama
from attn.nn.hf.base import Family, Weights, activation_out, decoder_in, get, zero
from attn.nn.config import ModelConfig

_TYPES = ("full_attention", "sliding_attention")
VALUE_SCALE = 0.707  # transformers' default attention_value_scale


def _default_types(L: int) -> list[str]:
  """transformers' default: layer 0 and every 6th layer (from 1) full, the rest sliding."""
  return ["full_attention" if (i == 0 or not (i + 1) % 6) else "sliding_attention" for i in range(L)]


def _rope(hf: dict[str, Any], kind: str, K: int) -> tuple[float, int]:
  """(base, rotated dims) of one layer type, from rope_parameters[kind]."""
  params = (hf.get("rope_parameters") or {}).get(kind) or {}
  where = f"config.rope_parameters.{kind}"
  if params.get("rope_type", "default") != "default":
    raise invalid(f"{where}.rope_type", params["rope_type"], "'default': attn reads MiMo-V2-Flash's plain RoPE")
  theta = params.get("rope_theta", 5_000_000.0 if kind == "full_attention" else 10_000.0)
  f = params.get("partial_rotary_factor", 0.334)
  r = int(K * f)
  if isinstance(f, bool) or not isinstance(f, (int, float)) or r < 2 or r % 2:
    raise invalid(f"{where}.partial_rotary_factor", f, f"a fraction of head_dim={K} that rotates an even "
                  "number of dims, at least 2")
  return float(theta), r


def config_in(hf: dict[str, Any]) -> ModelConfig:
  """Llama's reader over full layers, then the value heads, the schedule, the bases and the experts."""
  L, K, G = get(hf, "num_hidden_layers"), get(hf, "head_dim"), get(hf, "num_key_value_heads")
  V = get(hf, "v_head_dim")
  types = list(hf.get("layer_types") or _default_types(L))
  if len(types) != L or set(types) - set(_TYPES):
    raise invalid("config.layer_types", types, f"{L} of 'full_attention' / 'sliding_attention'")
  (theta, r), (s_theta, s_r) = _rope(hf, "full_attention", K), _rope(hf, "sliding_attention", K)
  base = llama.config_in(ROW, {k: v for k, v in hf.items() if k != "rope_parameters"}
                         | {"layer_types": ["full_attention"] * L, "rope_theta": theta})
  sliding = "sliding_attention" in types
  window = hf.get("sliding_window")
  if hf.get("sliding_window_size") is not None:
    window = hf["sliding_window_size"] + 1
  if sliding and not window:
    raise invalid("config.sliding_window", window, "a window: layer_types has sliding layers")
  own = {"num_kv_heads": 2 * G, "sinks": True} | ({"rope_dim": s_r} if s_r != r else {})
  dense = list(hf.get("mlp_layer_types") or ["dense"] + ["sparse"] * (L - 1))
  first = next((i for i, t in enumerate(dense) if t != "dense"), L)
  if len(dense) != L or dense[first:] != ["sparse"] * (L - first):
    raise invalid("config.mlp_layer_types", dense, f"{L} entries, 'dense' layers first and 'sparse' after: "
                  "attn's moe_dense_first")
  moe = {}
  if first < L:
    moe = dict(mlp="moe", moe_experts=get(hf, "n_routed_experts", "num_local_experts"),
               moe_top_k=get(hf, "num_experts_per_tok"), moe_d_ff=get(hf, "moe_intermediate_size"),
               moe_router="sigmoid", moe_norm_topk=bool(hf.get("norm_topk_prob", True)),
               moe_groups=hf.get("n_group", 1), moe_topk_groups=hf.get("topk_group", 1),
               moe_routed_scaling=float(hf.get("routed_scaling_factor") or 1.0), moe_dense_first=first)
  scale = hf.get("attention_value_scale", VALUE_SCALE)
  return base.replace(
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)), d_v=V, num_kv_heads=G, rope_dim=r, layer_types=tuple(types), window=int(window) if sliding else None,
      global_every=0, sliding_rope_theta=s_theta if sliding else None,
      layer_heads={"sliding_attention": own} if sliding else None,
      value_scale=None if scale is None or float(scale) == 1.0 else float(scale), **moe)


def _sinks(w: Weights, a: str, H: int) -> np.ndarray:
  """A sliding layer's sinks: `sinks` in memory, `attention_sink_bias` on disk (the release's name)."""
  return w(f"{a}.sinks" if f"{a}.sinks" in w else f"{a}.attention_sink_bias", (H,))


def _experts_in(w: Weights, m: str, cfg: ModelConfig) -> dict[str, Any]:
  D, E, F = cfg.d_model, cfg.moe_experts, cfg.moe_d_ff
  out = {"router_w": w(f"{m}.gate.weight", (E, D)).T, "correction": w(f"{m}.gate.e_score_correction_bias", (E,))}
  return out | routed_in(w, m, E, D, F)


def routed_in(w: Weights, m: str, E: int, D: int, F: int) -> dict[str, Any]:
  """The routed experts' SwiGLU weights (E, D, F)/(E, F, D): transformers' fused gate_up_proj in memory, or one
  gate/up/down per expert on disk (the release's names); Laguna's read the same way."""
  if f"{m}.experts.gate_up_proj" in w:  # transformers' fused experts, in memory
    gate_up = w(f"{m}.experts.gate_up_proj", (E, 2 * F, D))
    return {"w_gate": gate_up[:, :F].transpose(0, 2, 1), "w_up": gate_up[:, F:].transpose(0, 2, 1),
            "w_down": w(f"{m}.experts.down_proj", (E, D, F)).transpose(0, 2, 1)}
  each = [deepseek_v3.mlp_in(w, f"{m}.experts.{e}", D, F) for e in range(E)]  # on disk, the release
  return {f"w_{n}": np.stack([x[n]["kernel"] for x in each]) for n in ("gate", "up", "down")}


def weights_in(w: Weights, cfg: ModelConfig) -> dict[str, Any]:
  D, H, N = cfg.d_model, cfg.num_heads, cfg.vocab_size
  norm = lambda name: {"scale": w(f"{name}.weight", (D,))}  # noqa: E731
  blocks = {}
  for l in range(cfg.num_layers):
    head, a, at = cfg.layer_head(l), f"layers.{l}.self_attn", f"layers.{l}"
    G, K, V = head.num_kv_heads, head.d_k, head.d_v
    p = {"w_q": w(f"{a}.q_proj.weight", (H * K, D)).T.reshape(D, H, K),
         "w_k": w(f"{a}.k_proj.weight", (G * K, D)).T.reshape(D, G, K),
         "w_v": w(f"{a}.v_proj.weight", (G * V, D)).T.reshape(D, G, V),
         "w_o": w(f"{a}.o_proj.weight", (D, H * V)).T.reshape(H, V, D)}
    if cfg.use_bias:  # no o_proj bias: attn's b_o holds zeros
      p |= {"b_q": w(f"{a}.q_proj.bias", (H * K,)).reshape(H, K), "b_k": w(f"{a}.k_proj.bias", (G * K,)).reshape(G, K),
            "b_v": w(f"{a}.v_proj.bias", (G * V,)).reshape(G, V), "b_o": np.zeros(D, np.float32)}
    if head.sinks:
      p["sinks"] = _sinks(w, a, H)
    mlp = _experts_in(w, f"{at}.mlp", cfg) if cfg.is_moe_layer(l) else deepseek_v3.mlp_in(w, f"{at}.mlp", D, cfg.d_ff)
    blocks[l] = {"attn": {"params": p}, "mlp": mlp, "attn_norm": norm(f"{at}.input_layernorm"),
                 "mlp_norm": norm(f"{at}.post_attention_layernorm")}
  return decoder_in(w, blocks, norm, cfg, N, D)


def weights_out(pure: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
  D, H = cfg.d_model, cfg.num_heads
  head_w = pure["embed"]["token"] if cfg.tie_embeddings else np.asarray(pure["head"]["linear"]["kernel"]).T
  sd = {"model.embed_tokens.weight": pure["embed"]["token"], "model.norm.weight": pure["final_norm"]["scale"],
        "lm_head.weight": head_w}
  for l, block in pure["blocks"].items():
    head, at = cfg.layer_head(int(l)), f"model.layers.{l}"
    G, K, V, a = head.num_kv_heads, head.d_k, head.d_v, f"{at}.self_attn"
    p = {k: np.asarray(v) for k, v in block["attn"]["params"].items()}
    sd |= {f"{a}.q_proj.weight": p["w_q"].reshape(D, H * K).T, f"{a}.k_proj.weight": p["w_k"].reshape(D, G * K).T,
           f"{a}.v_proj.weight": p["w_v"].reshape(D, G * V).T, f"{a}.o_proj.weight": p["w_o"].reshape(H * V, D).T}
    if cfg.use_bias:
      sd |= {f"{a}.{n}_proj.bias": p[f"b_{n}"].ravel() for n in ("q", "k", "v")}
      zero(p["b_o"], f"blocks.{l}.attn b_o", "mimo_v2_flash")
    if head.sinks:
      sd[f"{a}.sinks"] = p["sinks"]
    e = block["mlp"]
    if cfg.is_moe_layer(int(l)):
      m = f"{at}.mlp"
      sd |= {f"{m}.gate.weight": np.asarray(e["router_w"]).T, f"{m}.gate.e_score_correction_bias": e["correction"]}
      gate, up, down = (np.asarray(e[f"w_{n}"]) for n in ("gate", "up", "down"))
      sd |= {f"{m}.experts.gate_up_proj": np.concatenate([gate, up], -1).transpose(0, 2, 1),
             f"{m}.experts.down_proj": down.transpose(0, 2, 1)}
    else:
      sd |= {f"{at}.mlp.{n}_proj.weight": np.asarray(e[n]["kernel"]).T for n in ("gate", "up", "down")}
    sd |= {f"{at}.input_layernorm.weight": block["attn_norm"]["scale"],
           f"{at}.post_attention_layernorm.weight": block["mlp_norm"]["scale"]}
  return sd


def _types(cfg: ModelConfig) -> list[str]:
  return ["full_attention" if cfg.layer_head(i).window is None else "sliding_attention" for i in range(cfg.num_layers)]


def check_out(cfg: ModelConfig) -> None:
  for i, kind in enumerate(cfg.layer_types or ()):
    if kind not in _TYPES:
      raise invalid(f"layer_types[{i}]", kind, f"one of {list(_TYPES)}: mimo_v2_flash's layer types")
  G = cfg.num_kv_heads
  for i, kind in enumerate(_types(cfg)):
    head, sliding = cfg.layer_head(i), kind == "sliding_attention"
    want = (2 * G if sliding else G, sliding, cfg.head.d_k, cfg.head.d_v)
    if (head.num_kv_heads, head.sinks, head.d_k, head.d_v) != want:
      raise invalid(f"layer {i} num_kv_heads, sinks, d_k, d_v", (head.num_kv_heads, head.sinks, head.d_k, head.d_v),
                    f"{want}: mimo_v2_flash's {kind} layers (twice the kv heads and sinks when sliding)")
  if cfg.has_dense_bias:
    raise invalid("dense_bias", cfg.dense_bias, "False: mimo_v2_flash's MLPs have no biases")
  if cfg.mlp == "moe" and not (cfg.moe_router == "sigmoid" and cfg.moe_shared_experts == 0
                               and cfg.moe_swiglu_limit is None and cfg.moe_d_ff):
    raise invalid("moe_router, moe_shared_experts, moe_swiglu_limit", (cfg.moe_router, cfg.moe_shared_experts,
                                                                       cfg.moe_swiglu_limit),
                  "('sigmoid', 0, None): mimo_v2_flash's experts are DeepSeek-routed, without shared ones")
  if cfg.mlp not in ("gated", "moe"):
    raise invalid("mlp", cfg.mlp, "'gated' or 'moe'")


def _fraction(K: int, r: int) -> float:
  """A partial_rotary_factor f with int(K·f) = r, transformers' rotated width."""
  f = r / K
  return f if int(K * f) == r else (r + 0.5) / K


def config_out(cfg: ModelConfig) -> dict[str, Any]:
  L, K = cfg.num_layers, cfg.head.d_k
  types = _types(cfg)
  sliding = "sliding_attention" in types
  s_head = cfg.layer_head(types.index("sliding_attention")) if sliding else cfg.head
  s_theta = cfg.sliding_rope_theta if cfg.sliding_rope_theta is not None else cfg.rope_theta
  moe = cfg.mlp == "moe"
  first = cfg.moe_dense_first if moe else L
  return dict(
      architectures=["MiMoV2FlashForCausalLM"], vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
      intermediate_size=cfg.d_ff, num_hidden_layers=L, num_attention_heads=cfg.num_heads,
      num_key_value_heads=cfg.num_kv_heads, head_dim=K, v_head_dim=cfg.head.d_v,
      max_position_embeddings=cfg.max_len, rms_norm_eps=cfg.norm_eps,
      hidden_act=activation_out(cfg, ("silu", "gelu_pytorch_tanh", "gelu", "relu")),
      tie_word_embeddings=cfg.tie_embeddings, attention_bias=cfg.use_bias, attention_dropout=0.0,
      attention_value_scale=cfg.value_scale, layer_types=types, sliding_window=cfg.window or cfg.max_len,
      rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": cfg.rope_theta,
                                          "partial_rotary_factor": _fraction(K, cfg.rope_dim)},
                       "sliding_attention": {"rope_type": "default", "rope_theta": s_theta,
                                             "partial_rotary_factor": _fraction(K, s_head.rope_dim)}},
      mlp_layer_types=["dense"] * first + ["sparse"] * (L - first),
      n_routed_experts=cfg.moe_experts or 1, num_experts_per_tok=cfg.moe_top_k or 1,
      moe_intermediate_size=cfg.moe_d_ff or cfg.d_ff, n_group=cfg.moe_groups, topk_group=cfg.moe_topk_groups,
      norm_topk_prob=cfg.moe_norm_topk, routed_scaling_factor=cfg.moe_routed_scaling,
      pad_token_id=None, bos_token_id=None, eos_token_id=None)


ROW = llama.LlamaLike("MiMoV2FlashForCausalLM", qkv_bias="attention_bias", o_bias=False)
MIMO_V2_FLASH = Family(
    name="mimo_v2_flash", model_types=("mimo_v2_flash",), architectures=("MiMoV2FlashForCausalLM",),
    config_in=config_in, weights_in=weights_in, weights_out=weights_out, config_out=config_out, prefix="model.",
    ignored=("mtp.",),
    refusals={"is_encoder_decoder": ((False,), "attn loads decoder-only models here"),
              "output_router_logits": ((False,), "attn's MoE returns no router logits"),
              "quantization_config": ((None,), "float weights: attn does not dequantize quantized checkpoints (the "
                                               "release's fp8 blocks); dequantize them first")},
    fixed={"positional": "rope", "norm": "pre", "norm_type": "rmsnorm", "final_norm": True, "layernorm": True,
           "num_segments": 0, "embed_norm": False, "embed_scale": False, "qk_norm": False, "sinks": False},
    mapped=llama.MAPPED | {"layer_types", "layer_heads", "sliding_rope_theta", "value_scale", "mlp", "moe_experts",
                           "moe_top_k", "moe_d_ff", "moe_router", "moe_norm_topk", "moe_groups", "moe_topk_groups",
                           "moe_routed_scaling", "moe_dense_first"},
    check_out=check_out, held_zeros=lambda cfg: cfg.d_model if cfg.use_bias else 0)  # b_o
