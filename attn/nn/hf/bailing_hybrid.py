"""Ling-3 (model_type bailing_hybrid) in and out: a hybrid DecoderLM of kda layers and gated mla layers,
DeepSeek's experts.

Its layer_types map entry for entry (a config.json without them: every layer_group_size-th layer
full, as transformers derives them). "linear_attention" -> attn.variants.kda with linear_head
{num_heads = num_kv_heads: linear_num_heads (num_attention_heads), d_k = d_v: linear_head_dim (the
release's head_dim), conv_width: short_conv_kernel_size, gated_norm_eps: rms_norm_eps,
kda_full_rank: True (f_proj and g_proj are full rank, not Kimi Linear's low-rank pairs),
kda_lower_bound: kda_lower_bound where kda_safe_gate (the bounded decay b·σ(·); without it the
softplus decay)}. "full_attention" -> DeepSeek-V3's latent attention (attn.nn.hf.deepseek_v3: its
widths, interleaved RoPE over qk_rope_head_dim, q_lora_rank or a plain q_proj, yarn's mscale) with
Ling's head-wise sigmoid output gate g_proj (D -> H): attn's gate "headwise". The feed-forward is
deepseek_v3's: mlp_layer_types "dense" for the first layers then "sparse", the sigmoid router
with its correction bias, group-limited top-k, routed_scaling_factor and shared experts; a
SwiGLU limit ℓ clips after the activation, min(silu(gate), ℓ)·clip(up, −ℓ, ℓ) (moe_swiglu_form
"clamp_after", or "clamp_after_routed" where the shared experts' limits are 0).

On disk (the release, and what transformers' save_pretrained writes: its conversion mapping for
bailing_hybrid, undone on save) the embedding is word_embeddings, every self_attn is attention,
o_proj is dense, the forget gate's f_proj, dt_bias and A_log sit directly under attention, the
convolution is q_conv1d, k_conv1d and v_conv1d, the correction bias is gate.expert_bias and the
experts are experts.{e}.gate_proj / up_proj / down_proj one matrix each: `released` reads them as
the in-memory names; a checkpoint holding either form loads. The multi-token-prediction layers
stored after the last (layers.{L} to layers.{L + num_nextn_predict_layers - 1}) are skipped by
name, as transformers skips them (every layers.{l} with l >= L).

Refused by name before any weight is read: a layer type other than full_attention or
linear_attention, an MLP schedule other than dense-then-sparse, SwiGLU limits
(expert_swiglu_limit_list, share_expert_swiglu_limit_list) that differ between expert layers or a
shared experts' limit other than the routed ones' or 0 (attn's moe_swiglu_limit is one number),
attention biases, kv heads other than the query heads, an activation
other than silu (it is also the short convolution's), and a kda_lower_bound that is not negative.
The head is never tied to the embedding, whatever tie_word_embeddings says (transformers ties
nothing here). to_hf writes the same tensors back, bit for bit. transformers has bailing_hybrid from 5.25.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np

from attn.config import invalid
from attn.nn.hf import deepseek_v3, kimi_linear
from attn.nn.hf.base import Weights, decoder_in, get
from attn.nn.config import ModelConfig

KINDS = ("full_attention", "linear_attention")


def layer_kinds(hf: dict[str, Any]) -> list[str]:
  """layer_types, or transformers' default: the last layer of every layer_group_size full, the rest kda."""
  L, group = get(hf, "num_hidden_layers"), hf.get("layer_group_size", 6)
  kinds = hf.get("layer_types")
  if kinds is None:
    if isinstance(group, bool) or not isinstance(group, int) or group < 1:
      raise invalid("config.layer_group_size", group, "a positive integer: every layer_group_size-th layer is full")
    kinds = ["full_attention" if (i + 1) % group == 0 else "linear_attention" for i in range(L)]
  if not isinstance(kinds, list) or len(kinds) != L or set(kinds) - set(KINDS):
    raise invalid("config.layer_types", kinds, f"{L} of {list(KINDS)}")
  return list(kinds)


def _check(hf: dict[str, Any]) -> tuple[list[str], float | None]:
  """The layer kinds and the kda decay's lower bound (None: the softplus decay); refusals by name."""
  kinds = layer_kinds(hf)
  if hf.get("attention_bias"):
    raise invalid("config.attention_bias", True, "False: Ling-3's attention has no biases in attn")
  if hf.get("hidden_act", "silu") not in ("silu", "swish"):
    raise invalid("config.hidden_act", hf.get("hidden_act"), "'silu': it is also the activation of kda's "
                  "short convolution, which attn fixes at SiLU")
  if not hf.get("kda_safe_gate", True):
    return kinds, None
  bound = hf.get("kda_lower_bound", -5.0)
  if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not -float("inf") < bound < 0:
    raise invalid("config.kda_lower_bound", bound, "a negative finite number with kda_safe_gate: the kda "
                  "decay b·σ(·) lies in (b, 0)")
  return kinds, float(bound)


def _limit(hf: dict[str, Any], names: tuple[str, str], L: int, dense: int) -> float:
  """The one SwiGLU limit of the expert layers (0: none); the dense layers' entries are not read (transformers
  builds their MLPs without one)."""
  limits = next((hf[n] for n in names if hf.get(n) is not None), [0] * L)
  if not isinstance(limits, list) or len(limits) != L or any(
      isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 <= x < float("inf") for x in limits):
    raise invalid(f"config.{names[0]}", limits, f"{L} limits >= 0, one per layer (0: no clip)")
  if len(set(limits[dense:])) > 1:
    raise invalid(f"config.{names[0]}", limits, "one limit on every expert layer (past the first "
                  f"{dense} dense ones): attn's moe_swiglu_limit is one number for the model")
  return float(limits[-1]) if dense < L else 0.0


def _experts_clip(hf: dict[str, Any], L: int, dense: int) -> dict[str, Any]:
  """moe_swiglu_limit and form of Ling-3's clip after the activation: routed and shared experts alike
  ("clamp_after"), or the routed ones only ("clamp_after_routed")."""
  routed = _limit(hf, ("expert_swiglu_limit_list", "swiglu_limits"), L, dense)
  shared = _limit(hf, ("share_expert_swiglu_limit_list", "swiglu_limits_shared"), L, dense)
  if shared not in (0.0, routed):
    raise invalid("config.share_expert_swiglu_limit_list", hf.get("share_expert_swiglu_limit_list"),
                  f"all 0 or the routed experts' limit {routed:g} on the expert layers: attn clips the shared "
                  "experts at moe_swiglu_limit or not at all")
  if not routed:
    return {}
  return {"moe_swiglu_limit": routed, "moe_swiglu_form": "clamp_after" if shared else "clamp_after_routed"}


def config_in(hf: dict[str, Any]) -> ModelConfig:
  kinds, bound = _check(hf)
  L = len(kinds)
  ds = {kimi_linear._NAMES.get(k, k): v for k, v in hf.items() if k != "layer_types"}
  dense = kimi_linear._dense_first({**hf, "first_k_dense_replace": hf.get("first_k_dense_replace", 2)}, L)
  ds |= {"first_k_dense_replace": dense, "rope_interleave": True}
  base = deepseek_v3.config_in(ds)
  H = hf.get("linear_num_heads") or get(hf, "num_attention_heads")
  K = hf.get("linear_head_dim") or hf.get("head_dim") or 128  # the release's head_dim is the kda heads' width
  W = hf.get("linear_conv_kernel_dim") or hf.get("short_conv_kernel_size", 4)
  linear = {"num_heads": H, "num_kv_heads": H, "d_k": K, "d_v": K, "gated_norm_eps": base.norm_eps,
            "conv_width": W, "kda_full_rank": True} | ({} if bound is None else {"kda_lower_bound": bound})
  hybrid = "linear_attention" in kinds
  clip = _experts_clip(hf, L, dense) if base.mlp == "moe" else {}
  # tie_embeddings False whatever tie_word_embeddings says: BailingHybridForCausalLM ties nothing (_tied_weights_keys)
  return base.replace(**clip, gate="headwise", layer_types=tuple(kinds), tie_embeddings=False,
                      linear_variant="kda" if hybrid else "gated_deltanet", linear_head=linear if hybrid else None)


# The release's names -> transformers' in-memory ones (transformers' conversion_mapping["bailing_hybrid"]).
_RENAMES = ((re.compile(r"^model\.word_embeddings\."), "model.embed_tokens."),
            (re.compile(r"\.attention\."), ".self_attn."),
            (re.compile(r"\.self_attn\.(f_proj\.|dt_bias$|A_log$)"), r".self_attn.forget_gate.\1"),
            (re.compile(r"\.self_attn\.dense\."), ".self_attn.o_proj."),
            (re.compile(r"\.mlp\.gate\.expert_bias$"), ".mlp.gate.e_score_correction_bias"))


def released(arrays: dict[str, Any]) -> dict[str, Any]:
  """A checkpoint under the names inclusionAI released (and save_pretrained writes) -> the in-memory ones:
  word_embeddings as embed_tokens, attention as self_attn, dense as o_proj, the forget gate's tensors
  under forget_gate., expert_bias as e_score_correction_bias, q/k/v_conv1d stacked into conv1d (q rows,
  then k, then v). The experts one matrix each are read as they are (deepseek_v3.experts_in)."""
  return kimi_linear.renamed(arrays, _RENAMES)


def weights_in(w: Weights, cfg: ModelConfig) -> dict[str, Any]:
  D, N, H = cfg.d_model, cfg.vocab_size, cfg.num_heads
  norm = lambda name: {"scale": w(f"{name}.weight", (D,))}  # noqa: E731
  blocks = {}
  for l, kind in enumerate(cfg.layer_types):
    at = f"layers.{l}"
    if kind == "linear_attention":
      attn = kimi_linear.kda_in(w, f"{at}.self_attn", cfg, l)
    else:
      attn = deepseek_v3.attention_in(w, f"{at}.self_attn", cfg) | {
          "w_gate": w(f"{at}.self_attn.g_proj.weight", (H, D)).T}
    mlp = (deepseek_v3.experts_in(w, f"{at}.mlp", cfg) if cfg.is_moe_layer(l)
           else deepseek_v3.mlp_in(w, f"{at}.mlp", D, cfg.d_ff))
    blocks[l] = {"attn": {"params": attn}, "mlp": mlp, "attn_norm": norm(f"{at}.input_layernorm"),
                 "mlp_norm": norm(f"{at}.post_attention_layernorm")}
  out = decoder_in(w, blocks, norm, cfg, N, D)
  for name in w.names:  # the multi-token-prediction layers after the last: not read, as transformers
    if (m := re.match(r"layers\.(\d+)\.", name)) and int(m.group(1)) >= cfg.num_layers:
      w(name)
  return out


def weights_out(pure: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
  head = pure["embed"]["token"] if cfg.tie_embeddings else np.asarray(pure["head"]["linear"]["kernel"]).T
  sd = {"model.embed_tokens.weight": pure["embed"]["token"], "model.norm.weight": pure["final_norm"]["scale"],
        "lm_head.weight": head}
  for l, block in pure["blocks"].items():
    l, p = int(l), {k: np.asarray(v) for k, v in block["attn"]["params"].items()}
    at = f"model.layers.{l}"
    if cfg.layer_types[l] == "linear_attention":
      sd |= kimi_linear.kda_out(p, f"{at}.self_attn", cfg, l)
    else:
      sd |= deepseek_v3.attention_out(p, f"{at}.self_attn", cfg) | {f"{at}.self_attn.g_proj.weight": p["w_gate"].T}
    sd |= deepseek_v3.mlp_out(block["mlp"], f"{at}.mlp", cfg, l)
    sd |= {f"{at}.input_layernorm.weight": block["attn_norm"]["scale"],
           f"{at}.post_attention_layernorm.weight": block["mlp_norm"]["scale"]}
  return sd


def check_out(cfg: ModelConfig) -> None:
  clip = cfg.moe_swiglu_limit is not None
  if clip and cfg.moe_swiglu_form not in ("clamp_after", "clamp_after_routed"):
    raise invalid("moe_swiglu_form", cfg.moe_swiglu_form, "'clamp_after' or 'clamp_after_routed' with "
                  "moe_swiglu_limit: Ling-3 clips its SwiGLU after the activation")
  deepseek_v3.check_out(cfg.replace(moe_swiglu_limit=None, moe_swiglu_form="gpt_oss") if clip else cfg)
  kinds = cfg.layer_types or ()
  if cfg.gate != "headwise" or cfg.gate_activation != "sigmoid" or cfg.rope_layout != "interleaved":
    raise invalid("gate, gate_activation, rope_layout", (cfg.gate, cfg.gate_activation, cfg.rope_layout),
                  "('headwise', 'sigmoid', 'interleaved'): Ling-3's MLA layers")
  if "linear_attention" not in kinds:
    return
  if cfg.linear_variant != "kda":
    raise invalid("linear_variant", cfg.linear_variant, "'kda': Ling-3's linear layers")
  head = cfg.layer_head(kinds.index("linear_attention"))
  if head.gated_norm_eps != cfg.norm_eps:
    raise invalid("linear_head.gated_norm_eps", head.gated_norm_eps, f"norm_eps={cfg.norm_eps}: Ling-3 has one "
                  "rms_norm_eps, its kda layers' gated norm's too")
  if head.num_kv_heads != head.num_heads or head.d_k != head.d_v or head.use_bias or not head.kda_full_rank:
    raise invalid("linear_head", cfg.linear_head, "num_kv_heads = num_heads, d_k = d_v, no biases, kda_full_rank: "
                  "Ling-3's kda layers have one linear_num_heads, one head_dim and full-rank f_proj and g_proj")


def config_out(cfg: ModelConfig) -> dict[str, Any]:
  kw = deepseek_v3.config_out(cfg)
  for name in ("rope_interleave", "n_routed_experts", "first_k_dense_replace"):
    kw.pop(name)
  kinds = list(cfg.layer_types or ["full_attention"] * cfg.num_layers)
  lin = cfg.layer_head(kinds.index("linear_attention")) if "linear_attention" in kinds else None
  moe = cfg.mlp == "moe"
  dense = cfg.moe_dense_first if moe else cfg.num_layers
  bound = lin.kda_lower_bound if lin else None
  limit = cfg.moe_swiglu_limit or 0
  shared = limit if cfg.moe_swiglu_form == "clamp_after" else 0
  return kw | dict(
      expert_swiglu_limit_list=[0] * dense + [limit] * (cfg.num_layers - dense),
      share_expert_swiglu_limit_list=[0] * dense + [shared] * (cfg.num_layers - dense),
      architectures=["BailingHybridForCausalLM"], layer_types=kinds, first_k_dense_replace=dense,
      mlp_layer_types=["dense"] * dense + ["sparse"] * (cfg.num_layers - dense),
      num_local_experts=cfg.moe_experts if moe else 2, head_dim=lin.d_k if lin else cfg.rope_dim,
      linear_head_dim=lin.d_k if lin else 1, linear_num_heads=lin.num_heads if lin else 1,
      linear_conv_kernel_dim=lin.conv_width if lin else 4, short_conv_kernel_size=lin.conv_width if lin else 4,
      kda_safe_gate=bound is not None, kda_lower_bound=-5.0 if bound is None else bound, num_mtp_layers=0)


BAILING_HYBRID = dataclasses.replace(
    kimi_linear.KIMI_LINEAR, name="bailing_hybrid", model_types=("bailing_hybrid",),
    architectures=("BailingHybridForCausalLM",), config_in=config_in, weights_in=weights_in,
    weights_out=weights_out, config_out=config_out, check_out=check_out, released=released,
    mapped=kimi_linear.KIMI_LINEAR.mapped | {"gate", "moe_swiglu_limit", "moe_swiglu_form"},
    refusals=dict(kimi_linear.KIMI_LINEAR.refusals) | {
        "quantization_config": ((None,), "float weights: attn does not dequantize quantized checkpoints")})
