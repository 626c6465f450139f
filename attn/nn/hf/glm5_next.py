"""GLM-5.3-Flash's text model (glm5_next, glm5_next_text) in and out: a hybrid DecoderLM of kda layers and NoPE mla
layers that choose their keys with the K-pool indexer, hc_mult residual streams, DeepSeek's experts with a clamp.

Read from transformers 5.25's modeling_glm5_next (there is no text-only causal LM class: a checkpoint is the
image-text wrapper Glm5NextForConditionalGeneration, its text under text_config and model.language_model.):

  layers      layer_types "linear_attention" -> attn.variants.kda (Kimi Linear's low-rank decay and gate:
              linear_num_heads heads of linear_head_dim, conv_width linear_conv_kernel_dim, gated_norm_eps
              rms_norm_eps, kda_lower_bound linear_lower_bound: the bounded decay b·σ(·), transformers'
              safe_gate_lower_bound; None: the softplus decay); "indexed_attention" (or "full_attention", 5.16's
              "deepseek_sparse_attention") ->
              deepseek_v3's mla without positions (qk_rope_head_dim 0: rope_dim 0, positional "none"), its
              latent norms at rms_norm_eps, and the K-pool indexer in its deepseek form (extra.kpool: heads
              index_n_heads, head_dim index_head_dim, top_k index_topk, kpool index_kpool,
              always_select_tail index_kpool_always_select_tail; indexer.wq_b -> w_idq, wk -> w_idk,
              k_norm -> idk_norm / idk_bias, weights_proj -> w_idw, index_kpool_compress_gate -> w_idg,
              index_kpool_compress_ape -> ape); indexer_types "shared" on an indexed layer reuses the
              previous indexed layer's choice (ModelConfig.indexer_types, attn.nn.index_sharing: no indexer
              there, in transformers and in attn; one a checkpoint holds anyway is read, named and not used)
  residual    hc_mult streams with DeepSeek-V4's mHC (attn.nn.hyper, hc_form "mhc": attn_hc / ffn_hc fn, base,
              scale, hc_sinkhorn_iters, hc_eps), closed by the unweighted mean of the streams (hc_head
              "mean": Glm5NextTextHyperHead has no weights)
  mlp         mlp_layer_types "dense" first then "sparse"; every SwiGLU (dense MLPs, shared and routed experts)
              clamps before its activation, min(g, ℓ) and clip(u, ±ℓ) at swiglu_limit ℓ (moe_swiglu_form
              "clamp"); DeepSeek's sigmoid router with its correction bias, groups and routed_scaling_factor

On disk (save_pretrained inverts transformers' conversion mapping for glm5_next) a kda layer's forget gate
(f_a_proj, f_b_proj, dt_bias, A_log) sits directly under self_attn, its convolution is q_conv1d, k_conv1d and
v_conv1d, the hyper-connections are hc_attn_fn / hc_attn_base / hc_attn_scale (ffn alike) and every expert is
one matrix each: `released` reads those names as the in-memory ones, under model.language_model. or model.
The vision tower (vision_config; model.visual.*) is not read: attn reads the text model and says so in one
line. to_hf writes Glm5NextForConditionalGeneration: its text model bit for bit and a one-block vision tower at
transformers' initialisation (attn holds no vision weights; Family.unheld).

Refused by name before any weight is read: "shared" on an indexed layer not right after a full indexed one (no
choice reaches it: transformers passes a top-k on to the next layer only, and raises there too), a RoPE dim,
attention biases, kv heads other than the query heads, an activation other than silu (it is the short
convolution's too), an MLP schedule other than dense-then-sparse, and a swiglu_limit on a model without
experts (attn clamps dense MLPs only beside experts). transformers has glm5_next from 5.25.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from typing import Any

import numpy as np

from attn.config import invalid
from attn.nn import index_sharing
from attn.nn.config import ModelConfig
from attn.nn.hf import deepseek_v3, deepseek_v32, kimi_linear
from attn.nn.hf.base import Weights, decoder_in, get, refuse

ARCHITECTURE = "Glm5NextForConditionalGeneration"
# The indexed layers' names: 5.25's "indexed_attention", 5.16's "deepseek_sparse_attention" (each release's
# save_pretrained writes its own), and "full_attention", which every release maps to its own name before its
# validate_layer_type (5.16 refuses "indexed_attention", later releases "deepseek_sparse_attention"): config_out
# writes "full_attention", so that what to_hf writes loads on each release.
KINDS = {"linear_attention": "linear_attention", "indexed_attention": "full_attention",
         "deepseek_sparse_attention": "full_attention", "full_attention": "full_attention"}
# Glm5NextTextConfig's defaults for what the readers need (a config.json from save_pretrained has them all).
DEFAULTS = {"n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5, "n_shared_experts": 1, "norm_topk_prob": True,
            "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "swiglu_limit": 10.0, "hc_mult": 4, "hc_eps": 1e-6,
            "hc_sinkhorn_iters": 20, "linear_head_dim": 128, "linear_num_heads": 64, "linear_conv_kernel_dim": 4,
            "linear_lower_bound": -5.0, "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 32,
            "index_kpool": 16, "index_kpool_always_select_tail": True, "qk_rope_head_dim": 0,
            "max_position_embeddings": 1048576, "hidden_act": "silu"}
REFUSALS = {k: v for k, v in deepseek_v3.DEEPSEEK_V3.refusals.items() if k != "scoring_func" and k != "topk_method"}
# A one-block vision tower for to_hf (attn holds no vision weights): the smallest Glm5NextVisionConfig.
VISION = {"depth": 1, "hidden_size": 16, "num_heads": 2, "intermediate_size": 16, "patch_size": 2,
          "projection_intermediate_size": 16, "image_size": 4, "spatial_merge_size": 1, "temporal_patch_size": 1}


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
  """The text model's config: text_config of the wrapper (glm5_next), or the flat one (glm5_next_text, or a flat
  release config.json, as Glm5NextConfig forwards it), with transformers' defaults and its linear_attn_config."""
  text = DEFAULTS | dict(hf.get("text_config") or {k: v for k, v in hf.items() if k != "vision_config"})
  lin = text.get("linear_attn_config") or {}
  for key, name in (("head_dim", "linear_head_dim"), ("num_heads", "linear_num_heads"),
                    ("short_conv_kernel_size", "linear_conv_kernel_dim"), ("gate_lower_bound", "linear_lower_bound")):
    if key in lin:
      text[name] = lin[key]
  if lin and lin.get("safe_gate", True) and text.get("linear_lower_bound") is None:
    text["linear_lower_bound"] = -5.0
  return text


def layer_kinds(text: dict[str, Any]) -> list[str]:
  """layer_types as attn names them, or transformers' default (every fourth layer, from the fourth, indexed)."""
  L = get(text, "num_hidden_layers")
  kinds = text.get("layer_types")
  if kinds is None:
    kinds = ["indexed_attention" if i % 4 == 3 else "linear_attention" for i in range(L)]
  if not isinstance(kinds, list) or len(kinds) != L or set(kinds) - set(KINDS):
    raise invalid("config.layer_types", kinds, f"{L} of ['linear_attention', 'indexed_attention']")
  return [KINDS[k] for k in kinds]


def _number(text: dict[str, Any], name: str, ok, what: str) -> float:
  value = text.get(name)
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
    raise invalid(f"config.{name}", value, what)
  return float(value)


def _check(text: dict[str, Any], kinds: list[str]) -> None:
  refuse(text, REFUSALS)
  L = len(kinds)
  if text.get("qk_rope_head_dim"):
    raise invalid("config.qk_rope_head_dim", text["qk_rope_head_dim"], "0: GLM-5.3-Flash's indexed layers have no "
                  "positions (transformers refuses a RoPE dim too)")
  if text.get("hidden_act", "silu") not in ("silu", "swish"):
    raise invalid("config.hidden_act", text.get("hidden_act"), "'silu': it is also the activation of kda's short "
                  "convolution, which attn fixes at SiLU")
  if text.get("q_lora_rank") is None:
    raise invalid("config.q_lora_rank", None, "an integer >= 1: the K-pool indexer reads the query latent")
  shared = indexer_kinds(text, kinds)
  for i, k in enumerate(shared):
    if k == "shared" and (i == 0 or kinds[i - 1] == "linear_attention" or shared[i - 1] == "shared"):
      raise invalid(f"config.indexer_types[{i}]", k, f"'full': layer {i} has no full indexed layer right before it, "
                    "so no choice reaches it (transformers passes a top-k on from a full layer to the next only)")


def indexer_kinds(text: dict[str, Any], kinds: list[str]) -> list[str]:
  """Per layer "full" or "shared" as transformers derives them (deepseek_v32.indexer_types), "full" on the linear
  layers (they have no indexer: their entry is never read)."""
  got = deepseek_v32.indexer_types(text, len(kinds))
  if len(got) != len(kinds) or set(got) - {"full", "shared"}:
    raise invalid("config.indexer_types", got, f"{len(kinds)} entries (num_hidden_layers), each 'full' or 'shared'")
  return ["full" if kind == "linear_attention" else k for k, kind in zip(got, kinds)]


def config_in(hf: dict[str, Any]) -> ModelConfig:
  """The text model as a hybrid DecoderLM (module docstring); the vision tower named as not read."""
  if hf.get("vision_config") is not None:
    warnings.warn("glm5_next: the vision tower (vision_config, model.visual.*) is not read: attn reads the text "
                  "model (text_config, model.language_model.*)", stacklevel=2)
  text = text_config(hf)
  kinds = layer_kinds(text)
  _check(text, kinds)
  L = len(kinds)
  dense = deepseek_v32._dense_first(text)
  nope = get(text, "qk_nope_head_dim")
  # deepseek_v3's reader wants a RoPE dim: read with a placeholder of 2, then no positions (rope_dim 0, d_k nope)
  ds = {k: v for k, v in text.items() if k not in ("layer_types", "mlp_layer_types", "head_dim")}
  base = deepseek_v3.config_in(ds | {"qk_rope_head_dim": 2, "first_k_dense_replace": dense, "rope_interleave": True})
  eps = base.norm_eps
  ix = {"heads": get(text, "index_n_heads"), "head_dim": get(text, "index_head_dim"), "top_k": get(text, "index_topk"),
        "kpool": get(text, "index_kpool"), "always_select_tail": text["index_kpool_always_select_tail"],
        "form": "deepseek"}
  bound = text.get("linear_lower_bound")
  if bound is not None:
    bound = _number(text, "linear_lower_bound", lambda b: -float("inf") < b < 0, "None (the softplus decay) or a "
                    "negative finite number: the kda decay b·σ(·) lies in (b, 0)")
  linear = {"num_heads": get(text, "linear_num_heads"), "num_kv_heads": get(text, "linear_num_heads"),
            "d_k": get(text, "linear_head_dim"), "d_v": get(text, "linear_head_dim"), "gated_norm_eps": eps,
            "conv_width": get(text, "linear_conv_kernel_dim")} | ({} if bound is None else {"kda_lower_bound": bound})
  hybrid = "linear_attention" in kinds
  limit = _number(text, "swiglu_limit", lambda v: 0 <= v < float("inf"), "a finite number >= 0 (0: no clamp)")
  if limit and base.mlp != "moe":
    raise invalid("config.swiglu_limit", limit, "0 without experts (mlp_layer_types all 'dense'): attn clamps "
                  "the dense MLPs' SwiGLU only beside experts (moe_swiglu_form 'clamp')")
  n = get(text, "hc_mult")
  if isinstance(n, bool) or not isinstance(n, int) or n < 1:
    raise invalid("config.hc_mult", n, "an integer >= 1 (residual streams)")
  hc = {} if n == 1 else {"hc_mult": n, "hc_eps": float(text["hc_eps"]), "hc_sinkhorn_iters": text["hc_sinkhorn_iters"],
                          "hc_head": "mean"}
  clamp = {"moe_swiglu_limit": limit, "moe_swiglu_form": "clamp"} if limit else {}
  shared = indexer_kinds(text, kinds)
  return base.replace(indexer_types=tuple(shared) if "shared" in shared else None,
                      d_k=nope, rope_dim=0, positional="none", rope_scaling=None, latent_norm_eps=eps,
                      extra={"kpool": ix}, layer_types=tuple(kinds), tie_embeddings=bool(text["tie_word_embeddings"]),
                      linear_variant="kda" if hybrid else "gated_deltanet", linear_head=linear if hybrid else None,
                      **hc, **clamp)


# The release's (and save_pretrained's) names -> transformers' in-memory ones (its conversion_mapping["glm5_next"]).
_RENAMES = tuple((re.compile(a), b) for a, b in (
    (r"^model\.language_model\.", "model."), (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2")))


def released(arrays: dict[str, Any]) -> dict[str, Any]:
  """The checkpoint's tensors under transformers' text-model names: model.language_model. as model., the
  hyper-connections' hc_attn_* / hc_ffn_* as attn_hc.* / ffn_hc.*, and kimi_linear's (the forget gate under
  forget_gate., q/k/v_conv1d stacked into conv1d)."""
  out = {}
  for name, a in arrays.items():
    for pattern, to in _RENAMES:
      name = pattern.sub(to, name)
    out[name] = a
  return kimi_linear.released(out)


def _hc_in(w: Weights, at: str, n: int, D: int) -> dict[str, np.ndarray]:
  return {"fn": w(f"{at}.fn", ((2 + n) * n, n * D)), "base": w(f"{at}.base", ((2 + n) * n,)),
          "scale": w(f"{at}.scale", (3,))}


def attention_in(w: Weights, a: str, cfg: ModelConfig, l: int, ignored: list[str]) -> dict[str, np.ndarray]:
  """Layer l's mla tensors (no RoPE key) and its K-pool indexer's (none on a shared layer: the names of those a
  checkpoint holds anyway are read and appended to `ignored`)."""
  head = cfg.layer_head(l)
  D, Q, o = cfg.d_model, cfg.q_latent_dim, dict(head.extra["kpool"])
  J, I, P = o["heads"], o["head_dim"], o["kpool"]
  p = deepseek_v3.attention_in(w, a, cfg)
  p.pop("w_kr")  # (D, 0): mla holds no RoPE key without positions
  x = f"{a}.indexer"
  if index_sharing.is_shared(cfg, l):
    for name in sorted(n for n in w.names if n.startswith(f"{x}.")):
      w(name)
      ignored.append(name)
    return p
  return p | {"w_idq": w(f"{x}.wq_b.weight", (J * I, Q)).T.reshape(Q, J, I), "w_idk": w(f"{x}.wk.weight", (I, D)).T,
              "idk_norm": w(f"{x}.k_norm.weight", (I,)), "idk_bias": w(f"{x}.k_norm.bias", (I,)),
              "w_idw": w(f"{x}.weights_proj.weight", (J, D)).T,
              "w_idg": w(f"{x}.index_kpool_compress_gate", (I, D)).T, "ape": w(f"{x}.index_kpool_compress_ape", (P, I))}


def weights_in(w: Weights, cfg: ModelConfig) -> dict[str, Any]:
  D, N, n = cfg.d_model, cfg.vocab_size, cfg.hc_mult
  norm = lambda name: {"scale": w(f"{name}.weight", (D,))}  # noqa: E731
  blocks, ignored = {}, []
  for l, kind in enumerate(cfg.layer_types):
    at = f"layers.{l}"
    attn = (kimi_linear.kda_in(w, f"{at}.self_attn", cfg, l, flat_a_log=True) if kind == "linear_attention"
            else attention_in(w, f"{at}.self_attn", cfg, l, ignored))
    mlp = (deepseek_v3.experts_in(w, f"{at}.mlp", cfg) if cfg.is_moe_layer(l)
           else deepseek_v3.mlp_in(w, f"{at}.mlp", D, cfg.d_ff))
    blocks[l] = {"attn": {"params": attn}, "mlp": mlp, "attn_norm": norm(f"{at}.input_layernorm"),
                 "mlp_norm": norm(f"{at}.post_attention_layernorm")}
    if n > 1:
      blocks[l] |= {"attn_hc": _hc_in(w, f"{at}.attn_hc", n, D), "mlp_hc": _hc_in(w, f"{at}.ffn_hc", n, D)}
  if ignored:
    warnings.warn(f"{len(ignored)} indexer tensors of shared layers (indexer_types 'shared': {ignored[0]}, ...) read "
                  "and ignored: a shared layer reuses the previous indexed layer's choice, as transformers does",
                  stacklevel=2)
  out = decoder_in(w, blocks, norm, cfg, N, D)
  for name in w.names:  # a multi-token-prediction layer after the last: not read, as transformers ignores it
    if (m := re.match(r"layers\.(\d+)\.", name)) and int(m.group(1)) >= cfg.num_layers or ".shared_head." in name:
      w(name)
  return out


def weights_out(pure: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
  head = pure["embed"]["token"] if cfg.tie_embeddings else np.asarray(pure["head"]["linear"]["kernel"]).T
  at = "model.language_model"
  sd = {f"{at}.embed_tokens.weight": pure["embed"]["token"], f"{at}.norm.weight": pure["final_norm"]["scale"],
        "lm_head.weight": head}
  Q = cfg.q_latent_dim
  for l, block in pure["blocks"].items():
    l, p = int(l), {k: np.asarray(v) for k, v in block["attn"]["params"].items()}
    a = f"{at}.layers.{l}"
    if cfg.layer_types[l] == "linear_attention":
      sd |= kimi_linear.kda_out(p, f"{a}.self_attn", cfg, l, flat_a_log=True)
    else:
      x = f"{a}.self_attn.indexer"
      sd |= deepseek_v3.attention_out(p | {"w_kr": np.zeros((cfg.d_model, 0), np.float32)}, f"{a}.self_attn", cfg)
      if "w_idq" in p:  # not on a shared layer (indexer_types): no indexer there
        sd |= {f"{x}.wq_b.weight": p["w_idq"].reshape(Q, -1).T, f"{x}.wk.weight": p["w_idk"].T,
               f"{x}.k_norm.weight": p["idk_norm"], f"{x}.k_norm.bias": p["idk_bias"],
               f"{x}.weights_proj.weight": p["w_idw"].T, f"{x}.index_kpool_compress_gate": p["w_idg"].T,
               f"{x}.index_kpool_compress_ape": p["ape"]}
    sd |= deepseek_v3.mlp_out(block["mlp"], f"{a}.mlp", cfg, l)
    sd |= {f"{a}.input_layernorm.weight": block["attn_norm"]["scale"],
           f"{a}.post_attention_layernorm.weight": block["mlp_norm"]["scale"]}
    if cfg.hc_mult > 1:
      for name, to in (("attn_hc", "attn_hc"), ("mlp_hc", "ffn_hc")):
        sd |= {f"{a}.{to}.{k}": np.asarray(block[name][k]) for k in ("fn", "base", "scale")}
  return sd


def check_out(cfg: ModelConfig) -> None:
  kinds = list(cfg.layer_types or ())
  if "full_attention" not in kinds and "linear_attention" not in kinds:
    raise invalid("layer_types", cfg.layer_types, "linear_attention and full_attention layers: GLM-5.3-Flash's")
  o = dict((cfg.head.extra or {}).get("kpool") or {})
  if set(cfg.head.extra or {}) != {"kpool"} or o.get("form") != "deepseek" or cfg.q_latent_dim is None:
    raise invalid("extra", dict(cfg.head.extra or {}), "{'kpool': {..., 'form': 'deepseek'}} with q_latent_dim: "
                  "GLM-5.3-Flash's indexed layers run the K-pool indexer on x and the query latent")
  if cfg.rope_dim or cfg.positional != "none" or cfg.latent_norm_eps != cfg.norm_eps or cfg.use_bias:
    raise invalid("rope_dim, positional, latent_norm_eps, use_bias",
                  (cfg.rope_dim, cfg.positional, cfg.latent_norm_eps, cfg.use_bias),
                  f"(0, 'none', norm_eps={cfg.norm_eps}, False): GLM-5.3-Flash's NoPE latent attention")
  if cfg.num_kv_heads != cfg.num_heads:
    raise invalid("num_kv_heads", cfg.num_kv_heads, f"{cfg.num_heads}: one kv head per query head")
  if cfg.mlp == "moe" and (cfg.moe_router != "sigmoid" or cfg.moe_shared_experts < 1 or (
      cfg.moe_swiglu_limit is not None and cfg.moe_swiglu_form != "clamp")):
    raise invalid("moe_router, moe_shared_experts, moe_swiglu_form",
                  (cfg.moe_router, cfg.moe_shared_experts, cfg.moe_swiglu_form),
                  "('sigmoid', >= 1, 'clamp'): GLM-5.3-Flash's experts, every SwiGLU clamped before its activation")
  if cfg.hc_mult > 1 and (cfg.hc_form, cfg.hc_head, cfg.hc_magnitude) != ("mhc", "mean", 2.0):
    raise invalid("hc_form, hc_head, hc_magnitude", (cfg.hc_form, cfg.hc_head, cfg.hc_magnitude),
                  "('mhc', 'mean', 2.0): GLM-5.3-Flash's hyper-connections, closed by the mean of the streams")
  if "linear_attention" in kinds:
    head = cfg.layer_head(kinds.index("linear_attention"))
    if cfg.linear_variant != "kda" or head.kda_full_rank or head.num_kv_heads != head.num_heads or \
        head.d_k != head.d_v or head.gated_norm_eps != cfg.norm_eps or head.use_bias:
      raise invalid("linear_variant, linear_head", (cfg.linear_variant, cfg.linear_head),
                    "kda with low-rank gates, num_kv_heads = num_heads, d_k = d_v, gated_norm_eps = norm_eps, no "
                    "biases: GLM-5.3-Flash's linear layers")


def config_out(cfg: ModelConfig) -> dict[str, Any]:
  kinds = list(cfg.layer_types)
  lin = cfg.layer_head(kinds.index("linear_attention")) if "linear_attention" in kinds else None
  o = dict(cfg.head.extra["kpool"])
  moe = cfg.mlp == "moe"
  dense = cfg.moe_dense_first if moe else cfg.num_layers
  text = dict(
      vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff, num_hidden_layers=cfg.num_layers,
      num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_heads, q_lora_rank=cfg.q_latent_dim,
      kv_lora_rank=cfg.latent_dim, qk_rope_head_dim=0, qk_nope_head_dim=cfg.head.d_k, v_head_dim=cfg.head.d_v,
      max_position_embeddings=cfg.max_len, rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings,
      attention_bias=False, hidden_act="silu", pad_token_id=None, bos_token_id=None, eos_token_id=None,
      layer_types=["linear_attention" if k == "linear_attention" else "full_attention" for k in kinds],  # KINDS
      indexer_types=list(cfg.indexer_types or ["full"] * cfg.num_layers),
      mlp_layer_types=["dense"] * dense + ["sparse"] * (cfg.num_layers - dense),
      n_routed_experts=cfg.moe_experts if moe else 2, num_experts_per_tok=cfg.moe_top_k if moe else 1,
      moe_intermediate_size=cfg.moe_d_ff if moe else 1, n_group=cfg.moe_groups, topk_group=cfg.moe_topk_groups,
      routed_scaling_factor=cfg.moe_routed_scaling, n_shared_experts=cfg.moe_shared_experts if moe else 1,
      norm_topk_prob=cfg.moe_norm_topk, swiglu_limit=cfg.moe_swiglu_limit or 0.0,
      index_n_heads=o["heads"], index_head_dim=o["head_dim"], index_topk=o["top_k"], index_kpool=o["kpool"],
      index_kpool_always_select_tail=o["always_select_tail"],
      linear_head_dim=lin.d_k if lin else 1, linear_num_heads=lin.num_heads if lin else 1,
      linear_conv_kernel_dim=lin.conv_width if lin else 4, linear_lower_bound=lin.kda_lower_bound if lin else -5.0,
      hc_mult=cfg.hc_mult, hc_eps=cfg.hc_eps, hc_sinkhorn_iters=cfg.hc_sinkhorn_iters)
  return {"architectures": [ARCHITECTURE], "text_config": text, "tie_word_embeddings": cfg.tie_embeddings,
          "vision_config": VISION | {"out_hidden_size": cfg.d_model}}


GLM5_NEXT = dataclasses.replace(
    deepseek_v3.DEEPSEEK_V3, name="glm5_next", model_types=("glm5_next", "glm5_next_text"),
    architectures=(ARCHITECTURE,), config_in=config_in, weights_in=weights_in, weights_out=weights_out,
    config_out=config_out, check_out=check_out, released=released, ignored=("visual.",), unheld=("model.visual.",),
    refusals={}, fixed={k: v for k, v in deepseek_v3.DEEPSEEK_V3.fixed.items() if k != "positional"},
    mapped=kimi_linear.KIMI_LINEAR.mapped | {"positional", "extra", "indexer_types", "hc_mult", "hc_eps",
                                             "hc_sinkhorn_iters", "hc_head", "moe_swiglu_limit", "moe_swiglu_form",
                                             "tie_embeddings"})
