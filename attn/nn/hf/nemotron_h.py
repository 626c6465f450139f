"""NemotronH in and out: a hybrid DecoderLM whose layers are single mixers (Mamba-2, attention or an MLP),
each with its own pre-norm residual: ModelConfig.block_kinds.

transformers' nemotron_h (NemotronHForCausalLM) holds one mixer per layer, x + mixer(RMSNorm(x)), by
layers_block_type (hybrid_override_pattern in older configs: "M" Mamba-2, "*" attention, "-" MLP,
"E" experts; "mamba" and "attention", earlier names of the first two, read as transformers reads
them). Each maps onto one attn block:
  "M" / linear_attention   block_kinds "attention", layer_types "linear_attention", linear_variant
                           mamba2 (attn.variants.mamba2) with linear_head {num_heads: mamba_num_heads,
                           d_v: mamba_head_dim, d_k: ssm_state_size, num_kv_heads: n_groups,
                           conv_width: conv_kernel}; in_proj holds [z | x | B | C | dt], conv1d's
                           channels are [x | B | C], the gated norm is over each group's H/G·P dims;
  "*" / full_attention     block_kinds "attention", a per_head layer without positions (NemotronH's
                           attention has no RoPE: positional "none"), no biases;
  "-" / mlp                block_kinds "mlp", up then down with relu² (activation "relu2"), mlp_bias
                           as dense_bias; its layer_types entry is full_attention (unread).
The block norm is the layer's `norm` (the attention norm of an attention block, the MLP norm of an
MLP one), the final one norm_f, every RMSNorm's epsilon layer_norm_epsilon.

Refused by name before any weight is read: experts ("E" / moe: NemotronH's experts are ungated relu²
MLPs behind a latent projection, which attn.nn.moe's gated experts do not express), multi-token
prediction layers (num_nextn_predict_layers), a sliding window, attention or Mamba projection biases
(attention_bias, use_bias), a Mamba convolution without its bias (use_conv_bias), a Mamba activation
other than silu, and a layer_norm_epsilon other than 1e-5 where there are Mamba layers (the mamba2
variant's gated norm has Mamba2Config's 1e-5). Not expressed, and not refused as every release sets it:
transformers floors Mamba's Δ at time_step_min (0.001 by default) in a full pass (not in a cached
step); attn does not, so the two differ only where softplus(x·W_dt + dt_bias) < time_step_min.
tie_word_embeddings is not read: transformers never ties NemotronH's lm_head to its embeddings (its
_tied_weights_keys is empty), so attn's output layer is always its own (with mlp_bias, attn's untied
output layer has a bias: read as zeros, refused unless zero on the way out). chunk_size is how
transformers blocks its scan, not a weight: attn keeps its own chunk.
to_hf writes the layers as hybrid_override_pattern, the string every release reads (and the releases' own
config.json holds): a layers_block_type list is refused by the releases of the other names (transformers 5.3 to
5.12 validate "mamba" and "attention", 5.13 on "linear_attention" and "full_attention").
A live model's state dict names the body model.*; save_pretrained's files and the releases name it
backbone.* (transformers renames on load): attn reads both, and to_hf builds the live model.
to_hf writes the same tensors back, bit for bit.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from attn.config import invalid
from attn.nn.config import ModelConfig
from attn.nn.hf.base import Family, Weights, get, zero
from attn.variants import mamba2

PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
PATTERN_OF = {v: k for k, v in PATTERN.items()}
LEGACY = {"mamba": "linear_attention", "attention": "full_attention"}  # earlier configs' layer type names
# NemotronH's layer type -> (block_kinds, layer_types) entries.
KINDS = {"linear_attention": ("attention", "linear_attention"), "full_attention": ("attention", "full_attention"),
         "mlp": ("mlp", "full_attention")}


def _types(hf: dict[str, Any]) -> list[str]:
  kinds = hf.get("layers_block_type") or hf.get("layer_types")
  if kinds is None:
    pattern = get(hf, "hybrid_override_pattern")
    if not isinstance(pattern, str) or set(pattern) - set(PATTERN):
      raise invalid("config.hybrid_override_pattern", pattern, f"a string of {list(PATTERN)}")
    kinds = [PATTERN[c] for c in pattern]
  kinds = [LEGACY.get(k, k) for k in kinds]
  for i, k in enumerate(kinds):
    if k == "moe":
      raise invalid(f"config.layers_block_type[{i}]", k, "linear_attention, full_attention or mlp: NemotronH's "
                    "experts are ungated relu² MLPs behind a latent projection, which attn's experts do not express")
    if k not in KINDS:
      raise invalid(f"config.layers_block_type[{i}]", k, f"one of {list(KINDS)}")
  if not kinds:
    raise invalid("config.layers_block_type", kinds, "at least one layer")
  return kinds


def config_in(hf: dict[str, Any]) -> ModelConfig:
  kinds = _types(hf)
  mamba = "linear_attention" in kinds
  eps = hf.get("layer_norm_epsilon", 1e-5)
  if mamba:
    if hf.get("use_conv_bias", hf.get("mamba_conv_bias", True)) is not True:
      raise invalid("config.use_conv_bias", False, "True: attn's mamba2 convolution always has its bias")
    if hf.get("mamba_hidden_act", "silu") != "silu":
      raise invalid("config.mamba_hidden_act", hf["mamba_hidden_act"], "'silu': attn's mamba2")
    if eps != mamba2.NORM_EPS:
      raise invalid("config.layer_norm_epsilon", eps, f"{mamba2.NORM_EPS}: attn's mamba2 gated norm has "
                    "Mamba2Config's epsilon, and NemotronH's norms share one")
  H = get(hf, "num_attention_heads")
  K = hf.get("head_dim") or get(hf, "hidden_size") // H
  linear = {"num_heads": get(hf, "mamba_num_heads"), "d_v": get(hf, "mamba_head_dim"),
            "d_k": get(hf, "ssm_state_size"), "num_kv_heads": hf.get("n_groups", hf.get("mamba_n_groups", 8)),
            "conv_width": hf.get("conv_kernel", hf.get("mamba_d_conv", 4))} if mamba else None
  return ModelConfig(
      vocab_size=get(hf, "vocab_size"), d_model=get(hf, "hidden_size"), num_layers=len(kinds), num_heads=H,
      d_ff=get(hf, "intermediate_size"), d_k=K, d_v=K, num_kv_heads=hf.get("num_key_value_heads") or H,
      variant="per_head", max_len=get(hf, "max_position_embeddings"), positional="none", norm_type="rmsnorm",
      norm_eps=eps, activation="relu2", use_bias=False, dense_bias=bool(hf.get("mlp_bias", False)),
      tie_embeddings=False,  # transformers never ties NemotronH's lm_head (no _tied_weights_keys)
      block_kinds=tuple(KINDS[k][0] for k in kinds), layer_types=tuple(KINDS[k][1] for k in kinds),
      linear_variant="mamba2" if mamba else "gated_deltanet", linear_head=linear)


def _mamba_in(w: Weights, a: str, cfg: ModelConfig, l: int) -> dict[str, np.ndarray]:
  head = cfg.layer_head(l)
  D, H, G, K, V, W = head.d_model, head.num_heads, head.num_kv_heads, head.d_k, head.d_v, head.conv_width
  C = H * V + 2 * G * K
  proj = w(f"{a}.in_proj.weight", (H * V + C + H, D)).T
  conv = w(f"{a}.conv1d.weight", (C, 1, W))[:, 0].T
  bias = w(f"{a}.conv1d.bias", (C,))
  xs = (slice(0, H * V), slice(H * V, H * V + G * K), slice(H * V + G * K, C))
  out = {"w_z": proj[:, :H * V].reshape(D, H, V), "w_dt": proj[:, H * V + C:],
         "a_log": w(f"{a}.A_log", (H,)), "dt_bias": w(f"{a}.dt_bias", (H,)), "d_skip": w(f"{a}.D", (H,)),
         "norm": w(f"{a}.norm.weight", (H * V,)).reshape(H, V),
         "w_o": w(f"{a}.out_proj.weight", (D, H * V)).T.reshape(H, V, D)}
  for name, s, shape in zip(("v", "k", "q"), xs, ((H, V), (G, K), (G, K))):
    out[f"w_{name}"] = proj[:, H * V:][:, s].reshape(D, *shape)
    out[f"conv_{name}"] = conv[:, s].reshape(W, *shape)
    out[f"conv_{name}_bias"] = bias[s].reshape(shape)
  return out


def _attention_in(w: Weights, a: str, cfg: ModelConfig) -> dict[str, np.ndarray]:
  D, H, G, K = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head.d_k
  return {"w_q": w(f"{a}.q_proj.weight", (H * K, D)).T.reshape(D, H, K),
          "w_k": w(f"{a}.k_proj.weight", (G * K, D)).T.reshape(D, G, K),
          "w_v": w(f"{a}.v_proj.weight", (G * K, D)).T.reshape(D, G, K),
          "w_o": w(f"{a}.o_proj.weight", (D, H * K)).T.reshape(H, K, D)}


def _linear_in(w: Weights, name: str, shape: tuple[int, int], bias: bool) -> dict[str, np.ndarray]:
  out = {"kernel": w(f"{name}.weight", shape).T}
  return out | ({"bias": w(f"{name}.bias", shape[:1])} if bias else {})


def released(arrays: dict[str, Any]) -> dict[str, Any]:
  """The embedding as save_pretrained of transformers 5.3 to 5.15 names it (backbone.embedding.weight; their
  conversion mapping renames it embeddings.weight on load) -> embeddings.weight."""
  return {re.sub(r"^(backbone\.|model\.)?embedding\.weight$", r"\1embeddings.weight", k): a for k, a in arrays.items()}


def weights_in(w: Weights, cfg: ModelConfig) -> dict[str, Any]:
  """The model's arrays, from model.* (a live model's state dict) or backbone.* (save_pretrained's and the
  releases' files) names."""
  D, F, N = cfg.d_model, cfg.d_ff, cfg.vocab_size
  b = "backbone." if "backbone.embeddings.weight" in w else ""
  blocks = {}
  for l, kind in enumerate(cfg.block_kinds):
    m, norm = f"{b}layers.{l}.mixer", {"scale": w(f"{b}layers.{l}.norm.weight", (D,))}
    if kind == "mlp":
      blocks[l] = {"mlp": {"up": _linear_in(w, f"{m}.up_proj", (F, D), cfg.has_dense_bias),
                           "down": _linear_in(w, f"{m}.down_proj", (D, F), cfg.has_dense_bias)}, "mlp_norm": norm}
    else:
      params = (_mamba_in(w, m, cfg, l) if cfg.layer_types[l] == "linear_attention" else _attention_in(w, m, cfg))
      blocks[l] = {"attn": {"params": params}, "attn_norm": norm}
  out = {"embed": {"token": w(f"{b}embeddings.weight", (N, D))}, "blocks": blocks,
         "final_norm": {"scale": w(f"{b}norm_f.weight", (D,))}}
  out["head"] = {"linear": {"kernel": w("lm_head.weight", (N, D)).T}}
  if cfg.has_dense_bias:  # mlp_bias gives attn's untied output layer a bias; lm_head has none: zeros
    out["head"]["linear"]["bias"] = np.zeros((N,), np.float32)
  return out


def _mamba_out(p: dict[str, np.ndarray], a: str, cfg: ModelConfig, l: int) -> dict[str, np.ndarray]:
  head = cfg.layer_head(l)
  D, H, V, W = head.d_model, head.num_heads, head.d_v, head.conv_width
  flat = lambda x, n: x.reshape(n, -1)  # noqa: E731
  proj = np.concatenate([flat(p["w_z"], D), flat(p["w_v"], D), flat(p["w_k"], D), flat(p["w_q"], D), p["w_dt"]], 1)
  conv = np.concatenate([flat(p["conv_v"], W), flat(p["conv_k"], W), flat(p["conv_q"], W)], 1)
  bias = np.concatenate([p["conv_v_bias"].reshape(-1), p["conv_k_bias"].reshape(-1), p["conv_q_bias"].reshape(-1)])
  return {f"{a}.in_proj.weight": proj.T, f"{a}.conv1d.weight": conv.T[:, None, :], f"{a}.conv1d.bias": bias,
          f"{a}.A_log": p["a_log"], f"{a}.dt_bias": p["dt_bias"], f"{a}.D": p["d_skip"],
          f"{a}.norm.weight": p["norm"].reshape(-1), f"{a}.out_proj.weight": p["w_o"].reshape(H * V, D).T}


def weights_out(pure: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
  D = cfg.d_model
  sd = {"model.embeddings.weight": pure["embed"]["token"], "model.norm_f.weight": pure["final_norm"]["scale"],
        "lm_head.weight": np.asarray(pure["head"]["linear"]["kernel"]).T}
  if "bias" in pure["head"]["linear"]:
    zero(pure["head"]["linear"]["bias"], "head.linear.bias", "nemotron_h's lm_head")
  for l, block in pure["blocks"].items():
    l = int(l)
    m = f"model.layers.{l}.mixer"
    if cfg.block_kinds[l] == "mlp":
      sd[f"model.layers.{l}.norm.weight"] = block["mlp_norm"]["scale"]
      for n in ("up", "down"):
        sd[f"{m}.{n}_proj.weight"] = np.asarray(block["mlp"][n]["kernel"]).T
        if "bias" in block["mlp"][n]:
          sd[f"{m}.{n}_proj.bias"] = block["mlp"][n]["bias"]
      continue
    sd[f"model.layers.{l}.norm.weight"] = block["attn_norm"]["scale"]
    p = {k: np.asarray(v) for k, v in block["attn"]["params"].items()}
    if cfg.layer_types[l] == "linear_attention":
      sd |= _mamba_out(p, m, cfg, l)
    else:
      H, G, K = cfg.num_heads, cfg.num_kv_heads, cfg.head.d_k
      sd |= {f"{m}.q_proj.weight": p["w_q"].reshape(D, H * K).T, f"{m}.k_proj.weight": p["w_k"].reshape(D, G * K).T,
             f"{m}.v_proj.weight": p["w_v"].reshape(D, G * K).T, f"{m}.o_proj.weight": p["w_o"].reshape(H * K, D).T}
  return sd


def _layer_types_out(cfg: ModelConfig) -> list[str]:
  kinds = cfg.block_kinds or ("attention",) * cfg.num_layers
  types = cfg.layer_types or ("full_attention",) * cfg.num_layers
  return ["mlp" if k == "mlp" else t for k, t in zip(kinds, types)]


def config_out(cfg: ModelConfig) -> dict[str, Any]:
  kinds = _layer_types_out(cfg)
  lin = cfg.layer_head(kinds.index("linear_attention")) if "linear_attention" in kinds else None
  mamba = {} if lin is None else {"mamba_num_heads": lin.num_heads, "mamba_head_dim": lin.d_v,
                                  "ssm_state_size": lin.d_k, "n_groups": lin.num_kv_heads,
                                  "conv_kernel": lin.conv_width}
  return {"architectures": ["NemotronHForCausalLM"], "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
          "hybrid_override_pattern": "".join(PATTERN_OF[k] for k in kinds), "num_attention_heads": cfg.num_heads,
          "num_key_value_heads": cfg.num_kv_heads,
          "head_dim": cfg.head.d_k, "max_position_embeddings": cfg.max_len, "intermediate_size": cfg.d_ff,
          "mlp_hidden_act": "relu2", "mlp_bias": cfg.has_dense_bias, "layer_norm_epsilon": cfg.norm_eps,
          "tie_word_embeddings": False, "attention_bias": False, "use_bias": False,
          "use_conv_bias": True, "num_nextn_predict_layers": 0} | mamba


def check_out(cfg: ModelConfig) -> None:
  if cfg.block_kinds is None or "attention_mlp" in cfg.block_kinds:
    raise invalid("block_kinds", cfg.block_kinds, "'attention' or 'mlp' per layer: NemotronH's layers are "
                  "single mixers")
  if cfg.head.d_k != cfg.head.d_v:
    raise invalid("d_k, d_v", (cfg.head.d_k, cfg.head.d_v), "equal: NemotronH's heads are head_dim wide")
  types = _layer_types_out(cfg)
  if "linear_attention" in types:
    if cfg.linear_variant != "mamba2":
      raise invalid("linear_variant", cfg.linear_variant, "'mamba2': NemotronH's linear layers")
    if cfg.norm_eps != mamba2.NORM_EPS:
      raise invalid("norm_eps", cfg.norm_eps, f"{mamba2.NORM_EPS}: NemotronH's one epsilon, the mamba2 gated norm's")
    if cfg.layer_head(types.index("linear_attention")).use_bias:
      raise invalid("linear_head.use_bias", True, "False: attn writes NemotronH's Mamba layers without biases")


NEMOTRON_H = Family(
    name="nemotron_h", model_types=("nemotron_h",), architectures=("NemotronHForCausalLM",),
    config_in=config_in, weights_in=weights_in, weights_out=weights_out, config_out=config_out, prefix="model.",
    released=released,
    refusals={"num_nextn_predict_layers": ((0,), "attn reads no multi-token-prediction layers"),
              "sliding_window": ((None,), "NemotronH's attention reads every earlier key in attn's reader"),
              "attention_bias": ((False,), "attn's reader has no NemotronH attention biases"),
              "use_bias": ((False,), "attn's reader has no NemotronH Mamba projection biases"),
              "is_encoder_decoder": ((False,), "attn loads decoder-only models here")},
    fixed={"positional": "none", "norm": "pre", "norm_type": "rmsnorm", "final_norm": True, "layernorm": True,
           "num_segments": 0, "embed_norm": False, "embed_scale": False, "use_bias": False, "mlp": "plain",
           "tie_embeddings": False,
           "activation": "relu2"},
    mapped=frozenset({"block_kinds", "layer_types", "linear_variant", "linear_head", "dense_bias"}),
    check_out=check_out)
