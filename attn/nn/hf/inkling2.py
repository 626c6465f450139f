"""Inkling-2 (transformers 5.25's inkling2_text, Inkling2ForCausalLM, and the image-text wrapper inkling2,
Inkling2ForConditionalGeneration, whose text model attn reads: the vision tower is left out) as a DecoderLM.

Its heads are per_head with no RoPE: the queries times a learned scale per head and dim then L2-clipped
(q_proj.norm: qk_l2_clip_threshold, qk_clip_scale), the keys clipped, the values RMS-normalised without a
scale (value_norm_eps) after the keys' and values' short convolutions in Inkling-2's form (qkv_conv "kv",
qkv_conv_residual: (conv(x) + x)/sqrt(W + 1)), an elementwise sigmoid gate on x (o_proj.gate_proj), a sink
logit per token (sink_proj: token_sinks) and a relative position bias mixed from each query token
(relative_position_bias: rel_bias_dim d_rel, rel_bias_clip). Its two layer types: "hybrid_sliding" (attn's
sliding_attention: swa_* sizes as layer_num_heads and layer_heads, the window sliding_window_size, the bias over
the window) and "hybrid" (full_attention: the bias over rel_extent, the queries and relative states scaled by
log-position, log_scaling_alpha and _floor, the convolutions with per-token taps, qkv_conv_dynamic, and the
queries, keys and values read from three mixes with their own input norms, attn_res_kv_types).

The block (attn.nn.attn_res): block attention residuals over every n_layers_per_attn_res_block layers
(attention_input, mlp_input, final_input: attn_res_block), each attention's and MLP's output through a short
convolution with its residual (post_attention_convolution, post_mlp_convolution: residual_conv), RMSNorms
x̂·w (the embeddings' too: embed_norm), experts only: a sigmoid router with a correction bias, renormalised
times route_scale, each expert a SwiGLU whose linear gate factor and up projection are soft-capped
(moe_gate_softcap, moe_up_softcap). The unembedding has unpadded_vocab_size rows (output_vocab): checkpoints
store it padded to vocab_size, which `released` and weights_in drop and transformers' save_pretrained restores
as zeros; the logits are soft-capped (final_logit_softcapping).

The names save_pretrained writes are the release's (model.llm.*: wq_du, attn_sink_proj, rel_logits_proj,
k_sconv.static_w, attn_res.attn_queries.N, the interleaved experts.w13_weight, the padded unembed, ...);
`released` reads them as transformers' in-memory names, so a live model, its save_pretrained directory and a
release read the same. to_hf writes the in-memory names (transformers renames them on saving). The wrapper's
tower is left out (Family.left_out, unheld); a directory of it holds its tensors, which from_hf does not read.
transformers has Inkling-2 from 5.25.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from attn.config import invalid
from attn.nn.config import ModelConfig
from attn.nn.hf.base import Family, Weights, activation, get

TEXT_PREFIX, WRAPPER_PREFIX = "model.", "model.language_model."
TOWER = ("model.vision_tower.", "model.visual.")
_TYPES = {"hybrid_sliding": "sliding_attention", "hybrid": "full_attention"}
_BACK = {v: k for k, v in _TYPES.items()}

# The release's names (under model.llm.) -> transformers' in-memory ones, in order (transformers 5.25's
# conversion_mapping "inkling2_text" and "inkling2"; the experts' interleaved w13 and the attention residuals'
# queries are moved by `released` itself).
_RENAMES = tuple((re.compile(p), r) for p, r in (
    (r"\.attn\.", ".self_attn."), (r"self_attn\.wq_du\.", "self_attn.q_proj.linear."),
    (r"self_attn\.wk_dv\.", "self_attn.k_proj.linear."), (r"self_attn\.wv_dv\.", "self_attn.v_proj.linear."),
    (r"self_attn\.k_sconv\.", "self_attn.k_proj.sconv."), (r"self_attn\.v_sconv\.", "self_attn.v_proj.sconv."),
    (r"self_attn\.rel_logits_proj\.", "self_attn.relative_position_bias."),
    (r"self_attn\.wr_du\.", "self_attn.relative_position_bias.linear."),
    (r"self_attn\.q_l2_clip\.", "self_attn.q_proj.norm."),
    (r"self_attn\.rel_l2_clip\.", "self_attn.relative_position_bias.norm."),
    (r"self_attn\.wo_ud\.", "self_attn.o_proj.linear."), (r"self_attn\.gate_attn\.", "self_attn.o_proj.gate_proj."),
    (r"self_attn\.attn_sink_proj\.", "self_attn.sink_proj."), (r"attn_sconv\.", "post_attention_convolution."),
    (r"mlp_sconv\.", "post_mlp_convolution."), (r"(convolution|sconv)\.weight$", r"\1.conv1d.weight"),
    (r"(convolution|sconv)\.static_w$", r"\1.static_weight"),
    (r"(convolution|sconv)\.weight_proj$", r"\1.weight_proj.weight"), (r"mlp_norm\.", "post_attention_layernorm."),
    (r"attn_norm\.", "input_layernorm."), (r"(q|k|v)_input_norm\.", r"\1_input_layernorm."),
    (r"mlp\.experts\.w2_weight$", "mlp.experts.down_proj"),
    (r"mlp\.gate\.bias$", "mlp.gate.e_score_correction_bias"),
    (r"attn_res\.mlp_queries\.(\d+)$", r"layers.\1.mlp_input.query"),
    (r"attn_res\.output_query$", "final_input.query")))


def _released(arrays: dict[str, Any], llm: str) -> dict[str, Any]:
  """The release's names -> transformers' in-memory ones, llm the text model's prefix there."""
  out = {}
  for name, a in arrays.items():
    if name.startswith("model.llm.unembed."):
      out["lm_head." + name[len("model.llm.unembed."):]] = a  # padded: weights_in keeps unpadded_vocab_size rows
      continue
    if name.startswith("model.visual."):
      out["model.vision_tower." + name[len("model.visual."):]] = a
      continue
    if not name.startswith("model.llm."):
      out[name] = a  # transformers' own names already (a live model's state dict)
      continue
    k = name[len("model.llm."):]
    k = {"embed.weight": "embed_tokens.weight", "embed_norm.weight": "embed_tokens.embed_norm.weight"}.get(k, k)
    if (m := re.fullmatch(r"attn_res\.attn_queries\.(\d+)", k)) is not None:
      k = f"layers.{int(m.group(1)) + 1}.attention_input.query"  # the first layer has none
    for pattern, new in _RENAMES:
      k = pattern.sub(new, k)
    if k.endswith("mlp.experts.w13_weight"):  # gate and up rows interleaved -> gate rows, then up rows
      a = np.asarray(a)
      E, F2, D = a.shape
      a, k = a.reshape(E, F2 // 2, 2, D).transpose(0, 2, 1, 3).reshape(E, F2, D), k[:-len("w13_weight")] + "gate_up_proj"
    out[llm + k] = a
  return out


def released_text(arrays: dict[str, Any]) -> dict[str, Any]:
  return _released(arrays, TEXT_PREFIX)


def released_wrapper(arrays: dict[str, Any]) -> dict[str, Any]:
  return _released(arrays, WRAPPER_PREFIX)


def _default_types(L: int) -> list[str]:
  """transformers' default: every 6th layer (counted from 1) hybrid, the rest hybrid_sliding."""
  return ["hybrid" if (i + 1) % 6 == 0 else "hybrid_sliding" for i in range(L)]


def _positive(t: dict, key: str, default: Any) -> float:
  v = t.get(key, default)
  if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
    raise invalid(f"config.{key}", v, "a positive finite number")
  return float(v)


def config_in_text(t: dict[str, Any]) -> ModelConfig:
  """The text model's DecoderLM from an inkling2_text config (the wrapper's text_config); what attn cannot run is
  refused by name."""
  D, L = get(t, "hidden_size"), get(t, "num_hidden_layers")
  H, G, K = get(t, "num_attention_heads"), get(t, "num_key_value_heads"), get(t, "head_dim")
  SH, SG, SK = get(t, "swa_num_attention_heads"), get(t, "swa_num_key_value_heads"), get(t, "swa_head_dim")
  for heads, kv, key in ((H, G, "num_key_value_heads"), (SH, SG, "swa_num_key_value_heads")):
    if kv < 1 or heads % kv:
      raise invalid(f"config.{key}", kv, f"a divisor of its query heads ({heads})")
  kinds = list(t.get("layer_types") or _default_types(L))
  if len(kinds) != L or set(kinds) - set(_TYPES):
    raise invalid("config.layer_types", kinds, f"{L} of {sorted(_TYPES)}")
  if t.get("scoring_func", "sigmoid") != "sigmoid":
    raise invalid("config.scoring_func", t.get("scoring_func"), "'sigmoid': Inkling-2's router (attn's moe_router)")
  types = tuple(_TYPES[k] for k in kinds)
  sliding = "sliding_attention" in types
  N, window, W = get(t, "vocab_size"), get(t, "sliding_window_size"), get(t, "conv_kernel_size")
  eps = float(t.get("rms_norm_eps", 1e-6))
  swa = {"d_k": SK, "d_v": SK, "num_kv_heads": SG, "rel_bias_extent": window, "log_scaling_alpha": None,
         "log_scaling_floor": 1, "qkv_conv_dynamic": False}
  heads = tuple(SH if k == "sliding_attention" else H for k in types)
  full = "full_attention" in types
  return ModelConfig(
      vocab_size=N, output_vocab=get(t, "unpadded_vocab_size"), d_model=D, num_layers=L, num_heads=H,
      num_kv_heads=G, d_k=K, d_v=K, d_ff=get(t, "moe_intermediate_size"), variant="per_head",
      max_len=get(t, "max_position_embeddings"), positional="none", norm_type="rmsnorm", norm_eps=eps,
      embed_norm=True, final_norm=True, tie_embeddings=False, use_bias=False, dense_bias=False,
      activation=activation(t, "hidden_act", "silu"), layer_types=types,
      layer_num_heads=heads if len(set(heads)) > 1 else None, layer_heads={"sliding_attention": swa} if sliding else None,
      window=window if sliding else None, qk_l2_clip_threshold=_positive(t, "qk_l2_clip_threshold", 22.627416997969522),
      qk_clip_scale=True, value_norm_eps=eps, qkv_conv="kv", qkv_conv_width=W, qkv_conv_residual=True,
      qkv_conv_dynamic=True, gate="elementwise", token_sinks=True, rel_bias_dim=get(t, "d_rel"),
      rel_bias_extent=get(t, "rel_extent"), rel_bias_clip=_positive(t, "rel_l2_clip_threshold", 8.0),
      log_scaling_alpha=_positive(t, "log_scaling_alpha", 0.1), log_scaling_floor=int(get(t, "log_scaling_n_floor")),
      mlp="moe", moe_experts=get(t, "n_routed_experts"), moe_top_k=get(t, "num_experts_per_tok"),
      moe_d_ff=get(t, "moe_intermediate_size"), moe_router="sigmoid", moe_norm_topk=True,
      moe_routed_scaling=_positive(t, "route_scale", 8.0), moe_gate_softcap=_positive(t, "mlp_gate_softcap", 4.0),
      moe_up_softcap=_positive(t, "mlp_up_softcap", 25.0), residual_conv=W,
      attn_res_block=get(t, "n_layers_per_attn_res_block"), attn_res_kv_types=("full_attention",) if full else (),
      logit_softcap=_positive(t, "final_logit_softcapping", 30.0))


def config_in_wrapper(hf: dict[str, Any]) -> ModelConfig:
  text = hf.get("text_config")
  if not isinstance(text, dict):
    raise invalid("config.text_config", text, "the text model's config (an inkling2 config.json has one)")
  return config_in_text(text)


def _T(w: Weights, name: str, rows: int, cols: int) -> np.ndarray:
  """A torch Linear's (out, in) weight as (in, out)."""
  return w(name, (rows, cols)).T


def _attention(w: Weights, a: str, cfg: ModelConfig, l: int) -> dict[str, np.ndarray]:
  head = cfg.layer_head(l)
  D, H, G, K, W, d, E = (head.d_model, head.num_heads, head.num_kv_heads, head.d_k, head.qkv_conv_width,
                         head.rel_bias_dim, head.rel_bias_extent)
  p = {"w_q": _T(w, f"{a}.q_proj.linear.weight", H * K, D).reshape(D, H, K),
       "q_clip_scale": w(f"{a}.q_proj.norm.scale", (H, K)),
       "w_k": _T(w, f"{a}.k_proj.linear.weight", G * K, D).reshape(D, G, K),
       "w_v": _T(w, f"{a}.v_proj.linear.weight", G * K, D).reshape(D, G, K),
       "w_o": _T(w, f"{a}.o_proj.linear.weight", D, H * K).reshape(H, K, D),
       "w_gate": _T(w, f"{a}.o_proj.gate_proj.weight", H * K, D).reshape(D, H, K),
       "w_sink": _T(w, f"{a}.sink_proj.weight", H, D),
       "w_rel": _T(w, f"{a}.relative_position_bias.linear.weight", H * d, D).reshape(D, H, d),
       "rel_scale": w(f"{a}.relative_position_bias.norm.scale", (H, d)),
       "rel_proj": w(f"{a}.relative_position_bias.proj", (d, E))}
  for c in "kv":
    s = f"{a}.{c}_proj.sconv"
    if head.qkv_conv_dynamic:  # static_weight[lag] and weight_proj rows by lag: reversed to Conv1d's order
      p[f"qkv_conv_{c}"] = w(f"{s}.static_weight", (W, G * K))[::-1].reshape(W, G, K)
      p[f"qkv_conv_dyn_{c}"] = _T(w, f"{s}.weight_proj.weight", G * W, D).reshape(D, G, W)[..., ::-1]
    else:
      p[f"qkv_conv_{c}"] = w(f"{s}.conv1d.weight", (G * K, 1, W))[:, 0].T.reshape(W, G, K)
  return {k: np.ascontiguousarray(v) for k, v in p.items()}


def weights_in(w: Weights, cfg: ModelConfig) -> dict[str, Any]:
  D, N, W = cfg.d_model, cfg.vocab_size, cfg.residual_conv
  E, F = cfg.moe_experts, cfg.moe_d_ff
  blocks = {}
  for l in range(cfg.num_layers):
    at = f"layers.{l}"
    split = cfg.layer_types[l] in cfg.attn_res_kv_types
    gate_up = w(f"{at}.mlp.experts.gate_up_proj", (E, 2 * F, D))
    b = {"attn": {"params": _attention(w, f"{at}.self_attn", cfg, l)},
         "attn_norm": {"scale": w(f"{at}.{'q_input' if split else 'input'}_layernorm.weight", (D,))},
         "mlp_norm": {"scale": w(f"{at}.post_attention_layernorm.weight", (D,))},
         "attn_out_conv": {"w": w(f"{at}.post_attention_convolution.conv1d.weight", (D, 1, W))[:, 0].T},
         "mlp_out_conv": {"w": w(f"{at}.post_mlp_convolution.conv1d.weight", (D, 1, W))[:, 0].T},
         "mlp_input": {"query": w(f"{at}.mlp_input.query", (D,))[None]},
         "mlp": {"router_w": _T(w, f"{at}.mlp.gate.weight", E, D),
                 "correction": w(f"{at}.mlp.gate.e_score_correction_bias", (E,)),
                 "w_gate": gate_up[:, :F].transpose(0, 2, 1), "w_up": gate_up[:, F:].transpose(0, 2, 1),
                 "w_down": w(f"{at}.mlp.experts.down_proj", (E, D, F)).transpose(0, 2, 1)}}
    if split:
      b["attn_k_norm"] = {"scale": w(f"{at}.k_input_layernorm.weight", (D,))}
      b["attn_v_norm"] = {"scale": w(f"{at}.v_input_layernorm.weight", (D,))}
    if l > 0:
      b["attn_input"] = {"query": w(f"{at}.attention_input.query", (3, D) if split else (D,)).reshape(-1, D)}
    blocks[l] = b
  rows = w("lm_head.weight")
  if rows.shape not in ((cfg.output_rows, D), (N, D)):
    raise invalid("checkpoint lm_head.weight.shape", rows.shape, f"({cfg.output_rows}, {D}) or padded ({N}, {D})")
  return {"embed": {"token": w("embed_tokens.weight", (N, D)), "norm": {"scale": w("embed_tokens.embed_norm.weight",
                                                                                   (D,))}},
          "blocks": blocks, "final_norm": {"scale": w("norm.weight", (D,))},
          "final_input": {"query": w("final_input.query", (D,))[None]},
          "head": {"linear": {"kernel": np.ascontiguousarray(rows[:cfg.output_rows].T)}}}


def _weights_out(pure: dict[str, Any], cfg: ModelConfig, prefix: str) -> dict[str, Any]:
  D = cfg.d_model
  A = lambda a: np.asarray(a)  # noqa: E731
  T = lambda a: np.ascontiguousarray(np.asarray(a).T)  # noqa: E731  (in, out) -> torch's (out, in)
  sd = {f"{prefix}embed_tokens.weight": A(pure["embed"]["token"]),
        f"{prefix}embed_tokens.embed_norm.weight": A(pure["embed"]["norm"]["scale"]),
        f"{prefix}norm.weight": A(pure["final_norm"]["scale"]),
        f"{prefix}final_input.query": A(pure["final_input"]["query"])[0], "lm_head.weight": T(pure["head"]["linear"]["kernel"])}
  for l, b in pure["blocks"].items():
    l = int(l)
    at, head = f"{prefix}layers.{l}", cfg.layer_head(l)
    a, p = f"{at}.self_attn", {k: A(v) for k, v in b["attn"]["params"].items()}
    H, G, K, W, d = head.num_heads, head.num_kv_heads, head.d_k, head.qkv_conv_width, head.rel_bias_dim
    sd |= {f"{a}.q_proj.linear.weight": T(p["w_q"].reshape(D, H * K)), f"{a}.q_proj.norm.scale": p["q_clip_scale"],
           f"{a}.k_proj.linear.weight": T(p["w_k"].reshape(D, G * K)),
           f"{a}.v_proj.linear.weight": T(p["w_v"].reshape(D, G * K)),
           f"{a}.o_proj.linear.weight": T(p["w_o"].reshape(H * K, D)),
           f"{a}.o_proj.gate_proj.weight": T(p["w_gate"].reshape(D, H * K)), f"{a}.sink_proj.weight": T(p["w_sink"]),
           f"{a}.relative_position_bias.linear.weight": T(p["w_rel"].reshape(D, H * d)),
           f"{a}.relative_position_bias.norm.scale": p["rel_scale"], f"{a}.relative_position_bias.proj": p["rel_proj"]}
    for c in "kv":
      s = f"{a}.{c}_proj.sconv"
      if head.qkv_conv_dynamic:
        sd[f"{s}.static_weight"] = np.ascontiguousarray(p[f"qkv_conv_{c}"].reshape(W, G * K)[::-1])
        sd[f"{s}.weight_proj.weight"] = T(p[f"qkv_conv_dyn_{c}"][..., ::-1].reshape(D, G * W))
      else:
        sd[f"{s}.conv1d.weight"] = np.ascontiguousarray(p[f"qkv_conv_{c}"].reshape(W, G * K).T[:, None])
    split = cfg.layer_types[l] in cfg.attn_res_kv_types
    sd[f"{at}.{'q_input' if split else 'input'}_layernorm.weight"] = A(b["attn_norm"]["scale"])
    if split:
      sd[f"{at}.k_input_layernorm.weight"] = A(b["attn_k_norm"]["scale"])
      sd[f"{at}.v_input_layernorm.weight"] = A(b["attn_v_norm"]["scale"])
    if l > 0:
      q = A(b["attn_input"]["query"])
      sd[f"{at}.attention_input.query"] = q if split else q[0]
    m = b["mlp"]
    sd |= {f"{at}.post_attention_layernorm.weight": A(b["mlp_norm"]["scale"]),
           f"{at}.post_attention_convolution.conv1d.weight": np.ascontiguousarray(A(b["attn_out_conv"]["w"]).T[:, None]),
           f"{at}.post_mlp_convolution.conv1d.weight": np.ascontiguousarray(A(b["mlp_out_conv"]["w"]).T[:, None]),
           f"{at}.mlp_input.query": A(b["mlp_input"]["query"])[0],
           f"{at}.mlp.gate.weight": T(m["router_w"]), f"{at}.mlp.gate.e_score_correction_bias": A(m["correction"]),
           f"{at}.mlp.experts.gate_up_proj": np.ascontiguousarray(
               np.concatenate([A(m["w_gate"]), A(m["w_up"])], -1).transpose(0, 2, 1)),
           f"{at}.mlp.experts.down_proj": np.ascontiguousarray(A(m["w_down"]).transpose(0, 2, 1))}
  return sd


def weights_out_text(pure: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
  return _weights_out(pure, cfg, TEXT_PREFIX)


def weights_out_wrapper(pure: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
  return _weights_out(pure, cfg, WRAPPER_PREFIX)


def check_out(cfg: ModelConfig) -> None:
  """Refuses what Inkling2TextModel cannot hold (the fixed fields aside): its two layer types and their heads."""
  for i, kind in enumerate(cfg.layer_types or ()):
    if kind not in _BACK:
      raise invalid(f"layer_types[{i}]", kind, f"one of {sorted(_BACK)}: Inkling-2's hybrid_sliding and hybrid")
  if cfg.layer_types is None:
    raise invalid("layer_types", None, "one per layer: Inkling-2 names each layer's type")
  W = cfg.qkv_conv_width
  if cfg.residual_conv != W:
    raise invalid("residual_conv", cfg.residual_conv, f"qkv_conv_width={W}: Inkling-2 has one conv_kernel_size")
  want_kv = ("full_attention",) if "full_attention" in cfg.layer_types else ()
  if cfg.attn_res_block is None or cfg.attn_res_kv_types != want_kv:
    raise invalid("attn_res_block, attn_res_kv_types", (cfg.attn_res_block, cfg.attn_res_kv_types),
                  f"set, and {want_kv}: Inkling-2's hybrid layers read three mixes, its sliding ones one")
  for i in range(cfg.num_layers):
    h, sliding = cfg.layer_head(i), cfg.layer_types[i] == "sliding_attention"
    want = (cfg.window, None, 1, False) if sliding else (cfg.rel_bias_extent, cfg.log_scaling_alpha,
                                                          cfg.log_scaling_floor, True)
    got = (h.rel_bias_extent, h.log_scaling_alpha, h.log_scaling_floor, h.qkv_conv_dynamic)
    if got != want or h.d_v != h.d_k:
      raise invalid(f"layer {i}'s (rel_bias_extent, log_scaling_alpha, log_scaling_floor, qkv_conv_dynamic)", got,
                    f"{want} with d_v = d_k: Inkling-2's {'sliding' if sliding else 'hybrid'} layers")
  for name in ("moe_gate_softcap", "moe_up_softcap", "logit_softcap", "rel_bias_clip", "log_scaling_alpha"):
    if getattr(cfg, name) is None:
      raise invalid(name, None, "a value: Inkling-2 always has it")


def config_out_text(cfg: ModelConfig) -> dict[str, Any]:
  L = cfg.num_layers
  sliding = [i for i in range(L) if cfg.layer_types[i] == "sliding_attention"]
  full = [i for i in range(L) if i not in sliding]
  s = cfg.layer_head(sliding[0]) if sliding else cfg.head
  f = cfg.layer_head(full[0]) if full else cfg.head
  return dict(
      architectures=["Inkling2ForCausalLM"], model_type="inkling2_text", vocab_size=cfg.vocab_size,
      unpadded_vocab_size=cfg.output_rows, hidden_size=cfg.d_model, num_hidden_layers=L,
      num_attention_heads=f.num_heads, num_key_value_heads=f.num_kv_heads, head_dim=f.d_k,
      swa_num_attention_heads=s.num_heads, swa_num_key_value_heads=s.num_kv_heads, swa_head_dim=s.d_k,
      sliding_window_size=cfg.window or s.rel_bias_extent, d_rel=cfg.rel_bias_dim, rel_extent=cfg.rel_bias_extent,
      log_scaling_n_floor=cfg.log_scaling_floor, log_scaling_alpha=cfg.log_scaling_alpha,
      layer_types=[_BACK[k] for k in cfg.layer_types], max_position_embeddings=cfg.max_len,
      rms_norm_eps=cfg.norm_eps, conv_kernel_size=cfg.qkv_conv_width, hidden_act="silu",
      moe_intermediate_size=cfg.moe_d_ff, n_routed_experts=cfg.moe_experts, num_experts_per_tok=cfg.moe_top_k,
      route_scale=cfg.moe_routed_scaling, qk_l2_clip_threshold=cfg.qk_l2_clip_threshold,
      rel_l2_clip_threshold=cfg.rel_bias_clip, n_layers_per_attn_res_block=cfg.attn_res_block,
      mlp_gate_softcap=cfg.moe_gate_softcap, mlp_up_softcap=cfg.moe_up_softcap,
      final_logit_softcapping=cfg.logit_softcap, scoring_func="sigmoid", pad_token_id=None, bos_token_id=None,
      eos_token_id=None, tie_word_embeddings=False)


def config_out_wrapper(cfg: ModelConfig) -> dict[str, Any]:
  text = config_out_text(cfg)
  del text["architectures"]
  # A placeholder tower, the smallest transformers builds: attn holds none (module docstring).
  vision = dict(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, patch_size=4, projection_hidden_dim=8,
                text_hidden_size=cfg.d_model, posemb_grid_size=2,
                rope_parameters={"rope_type": "axial", "rope_theta": 100.0})
  return dict(architectures=["Inkling2ForConditionalGeneration"], text_config=text, vision_config=vision)


def left_out(hf: dict[str, Any]) -> list[str]:
  """What `attn count --hf` does not count: the wrapper's vision tower."""
  del hf
  return ["the vision tower left out (model.vision_tower. / model.visual.): attn counts Inkling-2's text model "
          "(text_config: model.language_model. and lm_head)"]


_FIXED = {"positional": "none", "norm": "pre", "norm_type": "rmsnorm", "final_norm": True, "layernorm": True,
          "num_segments": 0, "embed_norm": True, "embed_scale": False, "use_bias": False, "dense_bias": False,
          "tie_embeddings": False, "gate": "elementwise", "gate_activation": "sigmoid", "sinks": False,
          "token_sinks": True, "qk_clip_scale": True, "qkv_conv": "kv", "qkv_conv_residual": True,
          "qkv_conv_dynamic": True, "mlp": "moe", "moe_router": "sigmoid", "moe_norm_topk": True, "activation": "silu",
          "rope_dim": 0}
_MAPPED = frozenset({"output_vocab", "layer_types", "layer_num_heads", "layer_heads", "window", "qk_l2_clip_threshold",
                     "value_norm_eps", "qkv_conv_width", "rel_bias_dim", "rel_bias_extent", "rel_bias_clip",
                     "log_scaling_alpha", "log_scaling_floor", "moe_experts", "moe_top_k", "moe_d_ff",
                     "moe_routed_scaling", "moe_gate_softcap", "moe_up_softcap", "residual_conv", "attn_res_block",
                     "attn_res_kv_types", "logit_softcap"})
_REFUSALS = {"quantization_config": ((None,), "float weights: attn does not dequantize quantized checkpoints")}

INKLING2_TEXT = Family(
    name="inkling2_text", model_types=("inkling2_text",), architectures=("Inkling2ForCausalLM",),
    config_in=config_in_text, weights_in=weights_in, weights_out=weights_out_text, config_out=config_out_text,
    prefix=TEXT_PREFIX, released=released_text, refusals=_REFUSALS, fixed=_FIXED, mapped=_MAPPED,
    check_out=check_out)

INKLING2 = Family(
    name="inkling2", model_types=("inkling2",), architectures=("Inkling2ForConditionalGeneration",),
    config_in=config_in_wrapper, weights_in=weights_in, weights_out=weights_out_wrapper,
    config_out=config_out_wrapper, prefix=WRAPPER_PREFIX, released=released_wrapper, ignored=TOWER, unheld=TOWER,
    refusals=_REFUSALS, fixed=_FIXED, mapped=_MAPPED, check_out=check_out, left_out=left_out)
