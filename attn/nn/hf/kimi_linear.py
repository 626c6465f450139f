"""Kimi Linear in and out: a hybrid DecoderLM of kda (Kimi Delta Attention) and mla layers, DeepSeek's experts.

Its layer_types map entry for entry: "linear_attention" -> attn.variants.kda with linear_head
{num_heads = num_kv_heads: linear_num_heads, d_k = d_v: linear_head_dim, conv_width:
linear_conv_kernel_dim} (the checkpoint's linear_attn_config, as transformers reads it, where a
config.json has no layer_types); "full_attention" -> DeepSeek-V3's latent attention
(attn.nn.hf.deepseek_v3, the same weight names) without positions: Kimi Linear keeps the
decoupled key of qk_rope_head_dim dims shared by all heads but turns nothing, which is attn's
rope_layout "none" (attn.variants.rope). The feed-forward is deepseek_v3's: mlp_layer_types
"dense" for the first layers then "sparse" (first_k_dense_replace), the sigmoid router with its
correction bias, group-limited top-k, routed_scaling_factor and shared experts.

A kda layer's tensors: q_proj, k_proj, v_proj (H·K, D); conv1d (3·H·K, 1, W) over [q | k | v];
forget_gate.f_a_proj (K, D), f_b_proj (H·K, K), dt_bias (H·K,) and A_log (1, 1, H, 1) (kda's
w_fa, w_fb, dt_bias (H, K), a_log (H,)); b_proj (H, D); g_a_proj (K, D), g_b_proj (H·K, K) (the
low-rank sigmoid gate); o_norm (K,) at rms_norm_eps (linear_head's gated_norm_eps) and o_proj
(D, H·K). to_hf writes them back bit for bit.

On disk (Moonshot's releases, and what transformers' save_pretrained writes: its conversion mapping
for kimi_linear, undone on save) a kda layer holds q_conv1d, k_conv1d and v_conv1d (H·K, 1, W) apart
and f_a_proj, f_b_proj, dt_bias and A_log directly under self_attn; every feed-forward is
block_sparse_moe (its dense layers too), the experts experts.{e}.w1 (gate), w3 (up) and w2 (down).
`released` reads those names as the in-memory ones above; a checkpoint holding either form loads.

Refused by name before any weight is read: a layer type other than full_attention or
linear_attention, an MLP schedule other than dense-then-sparse, attention biases, kv heads
other than the query heads, an activation other than silu (it is the short convolution's too), and
mla_use_nope false (transformers runs the MLA without RoPE whatever it says).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np

from attn.config import invalid
from attn.nn.hf import deepseek_v3
from attn.nn.hf.base import Weights, decoder_in, get
from attn.nn.config import ModelConfig

KINDS = ("full_attention", "linear_attention")
# transformers' attribute_map: the names a saved KimiLinearConfig writes -> DeepSeek-V3's.
_NAMES = {"num_experts": "n_routed_experts", "num_local_experts": "n_routed_experts",
          "num_experts_per_token": "num_experts_per_tok", "num_expert_group": "n_group",
          "num_shared_experts": "n_shared_experts", "moe_renormalize": "norm_topk_prob",
          "model_max_length": "max_position_embeddings"}


def _linear_config(hf: dict[str, Any]) -> dict[str, Any]:
  return hf.get("linear_attn_config") or {}


def layer_kinds(hf: dict[str, Any]) -> list[str]:
  """layer_types, or the checkpoint's linear_attn_config (1-based layer lists), or transformers' default."""
  L, lin = get(hf, "num_hidden_layers"), _linear_config(hf)
  if hf.get("layer_types"):
    kinds = list(hf["layer_types"])
  elif "full_attn_layers" in lin and "kda_layers" in lin:
    kinds = [None] * L
    for key, kind in (("full_attn_layers", "full_attention"), ("kda_layers", "linear_attention")):
      for i in lin[key]:
        if isinstance(i, int) and 1 <= i <= L:
          kinds[i - 1] = kind
  else:
    kinds = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(L)]
  if len(kinds) != L or set(kinds) - set(KINDS):
    raise invalid("config.layer_types", kinds, f"{L} of {list(KINDS)}")
  return kinds


def _dense_first(hf: dict[str, Any], L: int) -> int:
  """How many first layers are dense: mlp_layer_types must be dense ones then sparse ones."""
  mlp = hf.get("mlp_layer_types")
  if mlp is None:
    return hf.get("first_k_dense_replace", 1)
  k = next((i for i, t in enumerate(mlp) if t != "dense"), len(mlp))
  if len(mlp) != L or any(t != "sparse" for t in mlp[k:]):
    raise invalid("config.mlp_layer_types", mlp, f"{L} entries, 'dense' ones then 'sparse' ones: attn's "
                  "experts start after the first moe_dense_first layers")
  return k


def _check(hf: dict[str, Any]) -> list[str]:
  kinds = layer_kinds(hf)
  if hf.get("attention_bias"):
    raise invalid("config.attention_bias", True, "False: Kimi Linear's attention has no biases in attn")
  if hf.get("hidden_act", "silu") not in ("silu", "swish"):
    raise invalid("config.hidden_act", hf.get("hidden_act"), "'silu': it is also the activation of kda's "
                  "short convolution, which attn fixes at SiLU")
  if hf.get("mla_use_nope", True) is not True:
    raise invalid("config.mla_use_nope", hf.get("mla_use_nope"), "True: transformers' kimi_linear (and attn) "
                  "run the MLA layers without RoPE")
  return kinds


def config_in(hf: dict[str, Any]) -> ModelConfig:
  kinds = _check(hf)
  L, lin = len(kinds), _linear_config(hf)
  ds = {_NAMES.get(k, k): v for k, v in hf.items() if k != "layer_types"}
  ds |= {"first_k_dense_replace": _dense_first(hf, L), "rope_interleave": False,
         "topk_group": hf.get("topk_group") or 1, "n_group": ds.get("n_group") or 1}
  base = deepseek_v3.config_in(ds)
  K = lin.get("head_dim", hf.get("linear_head_dim", 128))
  H = lin.get("num_heads", hf.get("linear_num_heads", 32))
  linear = {"num_heads": H, "num_kv_heads": H, "d_k": K, "d_v": K, "gated_norm_eps": base.norm_eps,
            "conv_width": lin.get("short_conv_kernel_size", hf.get("linear_conv_kernel_dim", 4))}
  hybrid = "linear_attention" in kinds
  return base.replace(rope_layout="none", rope_scaling=None, layer_types=tuple(kinds),
                      linear_variant="kda" if hybrid else "gated_deltanet", linear_head=linear if hybrid else None)


# The release's names -> transformers' in-memory ones (transformers' conversion_mapping["kimi_linear"]).
_RENAMES = ((re.compile(r"\.self_attn\.(f_a_proj|f_b_proj|dt_bias|A_log)\b"), r".self_attn.forget_gate.\1"),
            (re.compile(r"\.block_sparse_moe\."), ".mlp."),
            (re.compile(r"\.experts\.(\d+)\.w1\.weight$"), r".experts.\1.gate_proj.weight"),
            (re.compile(r"\.experts\.(\d+)\.w3\.weight$"), r".experts.\1.up_proj.weight"),
            (re.compile(r"\.experts\.(\d+)\.w2\.weight$"), r".experts.\1.down_proj.weight"))
_CONVS = ("q_conv1d", "k_conv1d", "v_conv1d")


def renamed(arrays: dict[str, Any], renames) -> dict[str, Any]:
  """arrays under the names `renames` ((pattern, replacement), applied in order) gives, and each layer's
  q/k/v_conv1d stacked into conv1d (q rows, then k, then v): the KDA layers' release names read (Kimi Linear's,
  Ling-3's)."""
  out = {}
  for name, a in arrays.items():
    for pattern, new in renames:
      name = pattern.sub(new, name)
    out[name] = a
  for name in [n for n in out if n.endswith(".self_attn.q_conv1d.weight")]:
    at = name[:-len("q_conv1d.weight")]
    if all(f"{at}{c}.weight" in out for c in _CONVS) and f"{at}conv1d.weight" not in out:
      out[f"{at}conv1d.weight"] = np.concatenate([np.asarray(out.pop(f"{at}{c}.weight")) for c in _CONVS], 0)
  return out


def released(arrays: dict[str, Any]) -> dict[str, Any]:
  """A checkpoint under the names Moonshot released (and save_pretrained writes) -> the in-memory ones:
  the forget gate's tensors under forget_gate., block_sparse_moe as mlp, experts' w1/w3/w2 as
  gate/up/down, and q/k/v_conv1d stacked into conv1d (q rows, then k, then v)."""
  return renamed(arrays, _RENAMES)


def kda_in(w: Weights, a: str, cfg: ModelConfig, l: int, flat_a_log: bool = False) -> dict[str, np.ndarray]:
  """Layer l's kda tensors under transformers' in-memory names; with kda_full_rank Ling-3's (bailing_hybrid):
  forget_gate.f_proj and g_proj (H·K, D) in place of the low-rank pairs, A_log (H,); flat_a_log: A_log (H,)
  beside the low-rank pairs (GLM-5.3-Flash's, glm5_next)."""
  head = cfg.layer_head(l)
  D, H, K, W = head.d_model, head.num_heads, head.d_k, head.conv_width
  proj = lambda n: w(f"{a}.{n}.weight", (H * K, D)).T.reshape(D, H, K)  # noqa: E731
  conv = w(f"{a}.conv1d.weight", (3 * H * K, 1, W))[:, 0].T.reshape(W, 3, H, K)
  f = f"{a}.forget_gate"
  p = {"w_q": proj("q_proj"), "w_k": proj("k_proj"), "w_v": proj("v_proj"),
       "conv_q": conv[:, 0], "conv_k": conv[:, 1], "conv_v": conv[:, 2], "w_b": w(f"{a}.b_proj.weight", (H, D)).T,
       "dt_bias": w(f"{f}.dt_bias", (H * K,)).reshape(H, K),
       "norm": w(f"{a}.o_norm.weight", (K,)), "w_o": w(f"{a}.o_proj.weight", (D, H * K)).T.reshape(H, K, D)}
  if head.kda_full_rank:
    return p | {"w_f": proj("forget_gate.f_proj"), "w_g": proj("g_proj"), "a_log": w(f"{f}.A_log", (H,))}
  low = lambda n: w(f"{n}.weight", (H * K, K)).T.reshape(K, H, K)  # noqa: E731
  return p | {"w_fa": w(f"{f}.f_a_proj.weight", (K, D)).T, "w_fb": low(f"{f}.f_b_proj"),
              "a_log": w(f"{f}.A_log", (H,) if flat_a_log else (1, 1, H, 1)).reshape(H),
              "w_ga": w(f"{a}.g_a_proj.weight", (K, D)).T, "w_gb": low(f"{a}.g_b_proj")}


def weights_in(w: Weights, cfg: ModelConfig) -> dict[str, Any]:
  D, N = cfg.d_model, cfg.vocab_size
  norm = lambda name: {"scale": w(f"{name}.weight", (D,))}  # noqa: E731
  blocks = {}
  for l, kind in enumerate(cfg.layer_types):
    at = f"layers.{l}"
    attn = (kda_in(w, f"{at}.self_attn", cfg, l) if kind == "linear_attention"
            else deepseek_v3.attention_in(w, f"{at}.self_attn", cfg))
    mlp = (deepseek_v3.experts_in(w, f"{at}.mlp", cfg) if cfg.is_moe_layer(l)
           else deepseek_v3.mlp_in(w, f"{at}.mlp", D, cfg.d_ff))
    blocks[l] = {"attn": {"params": attn}, "mlp": mlp, "attn_norm": norm(f"{at}.input_layernorm"),
                 "mlp_norm": norm(f"{at}.post_attention_layernorm")}
  out = decoder_in(w, blocks, norm, cfg, N, D)
  return out


def kda_out(p: dict[str, np.ndarray], a: str, cfg: ModelConfig, l: int,
            flat_a_log: bool = False) -> dict[str, np.ndarray]:
  """kda_in's inverse: layer l's kda tensors under transformers' names."""
  head = cfg.layer_head(l)
  D, H, K, W = head.d_model, head.num_heads, head.d_k, head.conv_width
  conv = np.stack([p["conv_q"], p["conv_k"], p["conv_v"]], 1).reshape(W, 3 * H * K)
  f = f"{a}.forget_gate"
  sd = {f"{a}.q_proj.weight": p["w_q"].reshape(D, H * K).T, f"{a}.k_proj.weight": p["w_k"].reshape(D, H * K).T,
        f"{a}.v_proj.weight": p["w_v"].reshape(D, H * K).T, f"{a}.conv1d.weight": conv.T[:, None, :],
        f"{a}.b_proj.weight": p["w_b"].T, f"{f}.dt_bias": p["dt_bias"].reshape(H * K),
        f"{a}.o_norm.weight": p["norm"], f"{a}.o_proj.weight": p["w_o"].reshape(H * K, D).T}
  if head.kda_full_rank:
    return sd | {f"{f}.f_proj.weight": p["w_f"].reshape(D, H * K).T, f"{a}.g_proj.weight": p["w_g"].reshape(D, H * K).T,
                 f"{f}.A_log": p["a_log"]}
  return sd | {f"{f}.f_a_proj.weight": p["w_fa"].T, f"{f}.f_b_proj.weight": p["w_fb"].reshape(K, H * K).T,
               f"{f}.A_log": p["a_log"].reshape((H,) if flat_a_log else (1, 1, H, 1)),
               f"{a}.g_a_proj.weight": p["w_ga"].T,
               f"{a}.g_b_proj.weight": p["w_gb"].reshape(K, H * K).T}


def weights_out(pure: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
  head = pure["embed"]["token"] if cfg.tie_embeddings else np.asarray(pure["head"]["linear"]["kernel"]).T
  sd = {"model.embed_tokens.weight": pure["embed"]["token"], "model.norm.weight": pure["final_norm"]["scale"],
        "lm_head.weight": head}
  for l, block in pure["blocks"].items():
    l, p = int(l), {k: np.asarray(v) for k, v in block["attn"]["params"].items()}
    at = f"model.layers.{l}"
    sd |= (kda_out(p, f"{at}.self_attn", cfg, l) if cfg.layer_types[l] == "linear_attention"
           else deepseek_v3.attention_out(p, f"{at}.self_attn", cfg))
    sd |= deepseek_v3.mlp_out(block["mlp"], f"{at}.mlp", cfg, l)
    sd |= {f"{at}.input_layernorm.weight": block["attn_norm"]["scale"],
           f"{at}.post_attention_layernorm.weight": block["mlp_norm"]["scale"]}
  return sd


def check_out(cfg: ModelConfig) -> None:
  deepseek_v3.check_out(cfg)
  if cfg.rope_layout != "none":
    raise invalid("rope_layout", cfg.rope_layout, "'none': Kimi Linear's MLA layers carry no positions")
  if cfg.linear_variant != "kda" and "linear_attention" in (cfg.layer_types or ()):
    raise invalid("linear_variant", cfg.linear_variant, "'kda': Kimi Linear's linear layers")
  if "linear_attention" in (cfg.layer_types or ()):
    head = cfg.layer_head(cfg.layer_types.index("linear_attention"))
    if head.gated_norm_eps != cfg.norm_eps:
      raise invalid("linear_head.gated_norm_eps", head.gated_norm_eps, f"norm_eps={cfg.norm_eps}: Kimi Linear "
                    "has one rms_norm_eps, its kda layers' gated norm's too")
    if head.num_kv_heads != head.num_heads or head.d_k != head.d_v or head.use_bias:
      raise invalid("linear_head", cfg.linear_head, "num_kv_heads = num_heads, d_k = d_v, no biases: Kimi "
                    "Linear's kda layers have one linear_num_heads and one linear_head_dim")


def config_out(cfg: ModelConfig) -> dict[str, Any]:
  moe = cfg.mlp == "moe"
  kinds = list(cfg.layer_types or ["full_attention"] * cfg.num_layers)
  lin = cfg.layer_head(kinds.index("linear_attention")) if "linear_attention" in kinds else None
  dense = cfg.moe_dense_first if moe else cfg.num_layers
  return dict(
      architectures=["KimiLinearForCausalLM"], vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
      intermediate_size=cfg.d_ff, num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
      num_key_value_heads=cfg.num_heads, q_lora_rank=cfg.q_latent_dim, kv_lora_rank=cfg.latent_dim,
      qk_rope_head_dim=cfg.rope_dim, qk_nope_head_dim=cfg.head.d_k - cfg.rope_dim, v_head_dim=cfg.head.d_v,
      max_position_embeddings=cfg.max_len, rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings,
      attention_bias=False, attention_dropout=0.0, hidden_act="silu", layer_types=kinds,
      mlp_layer_types=["dense"] * dense + ["sparse"] * (cfg.num_layers - dense),
      num_local_experts=cfg.moe_experts if moe else 2, num_experts_per_tok=cfg.moe_top_k if moe else 1,
      moe_intermediate_size=cfg.moe_d_ff if moe else 1, n_group=cfg.moe_groups, topk_group=cfg.moe_topk_groups,
      routed_scaling_factor=cfg.moe_routed_scaling, n_shared_experts=cfg.moe_shared_experts if moe else 1,
      norm_topk_prob=cfg.moe_norm_topk, linear_num_heads=lin.num_heads if lin else 1,
      linear_head_dim=lin.d_k if lin else 1, linear_conv_kernel_dim=lin.conv_width if lin else 4,
      pad_token_id=None, bos_token_id=None, eos_token_id=None)


KIMI_LINEAR = dataclasses.replace(
    deepseek_v3.DEEPSEEK_V3, name="kimi_linear", model_types=("kimi_linear",),
    architectures=("KimiLinearForCausalLM",), config_in=config_in, weights_in=weights_in,
    weights_out=weights_out, config_out=config_out, check_out=check_out, released=released,
    mapped=deepseek_v3.DEEPSEEK_V3.mapped | {"layer_types", "linear_head", "linear_variant"},
    refusals={k: v for k, v in deepseek_v3.DEEPSEEK_V3.refusals.items()
              if k in ("is_encoder_decoder", "use_bidirectional_attention", "output_router_logits")})
