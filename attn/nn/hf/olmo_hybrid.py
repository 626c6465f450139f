"""OLMo-Hybrid in and out: a hybrid DecoderLM of gated DeltaNet layers with negative eigenvalues and
OLMo 2 softmax layers.

Its layer_types map entry for entry. "linear_attention" -> attn.variants.gated_deltanet with
linear_head {num_heads: linear_num_value_heads, num_kv_heads: linear_num_key_heads, d_k, d_v:
linear_key/value_head_dim, conv_width: linear_conv_kernel_dim, gated_norm_eps: 1e-5 (its o_norm's,
fixed in transformers), linear_allow_neg_eigval: the config's (β = 2σ(x·W_b), in [0, 2])}: the
layer of Qwen3-Next with its projections apart (q_proj, k_proj, v_proj, a_proj, b_proj, g_proj: the
SiLU gate attn calls w_z, o_proj) and its one conv1d over [q | k | v]. Its block is pre-norm
(input_layernorm before it, post_attention_layernorm before the MLP: ModelConfig.linear_norm "pre").
"full_attention" -> OLMo 2's layer (attn.nn.hf.olmo2): per_head with QK-norm over the whole
projection (qk_norm "whole") and its norms after each sublayer (norm "after":
post_attention_layernorm, post_feedforward_layernorm). RoPE over the whole head when the config's
rope_parameters carry a rope_theta (absent: transformers' default base); the release's is None and
it runs without positions (positional "none", rope_dim 0), as transformers does then.

On disk (the release, and what transformers' save_pretrained writes: its conversion mapping for
olmo_hybrid, undone on save) every input_layernorm is attention_layer_norm and every
post_attention_layernorm feedforward_layer_norm (the softmax layers' too), and the convolution is
q_conv1d, k_conv1d and v_conv1d: `released` reads them back, concatenating the three in order
whatever their rows (transformers 5.25 splits conv1d into three near-equal parts on save, the
release by q, k and v: the same stack either way). transformers 5.3 to 5.14 hold the three in memory too:
to_hf splits conv1d by q, k and v for them (live_names).

Refused by name before any weight is read: a layer type other than full_attention or
linear_attention, attention biases, an activation other than silu (the convolution's too).
to_hf writes the same tensors back, bit for bit.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from attn.config import invalid
from attn.nn.hf import deepseek_v3, llama
from attn.nn.hf.base import Family, Weights, decoder_in, get
from attn.nn.hf.rope import rope_from_hf
from attn.nn.config import ModelConfig

KINDS = ("full_attention", "linear_attention")
GATED_NORM_EPS = 1e-5  # OlmoHybridGatedDeltaNet's o_norm, whatever rms_norm_eps says


def _has_rope(hf: dict[str, Any]) -> bool:
  """transformers builds no rotary embedding when rope_parameters hold rope_theta None (the release); a
  config without rope_parameters gets the default base, 10000."""
  rope = hf.get("rope_parameters")
  return not (isinstance(rope, dict) and "rope_theta" in rope and rope["rope_theta"] is None)


def _check(hf: dict[str, Any]) -> list[str]:
  L = get(hf, "num_hidden_layers")
  kinds = list(get(hf, "layer_types"))
  if len(kinds) != L or set(kinds) - set(KINDS):
    raise invalid("config.layer_types", kinds, f"{L} of {list(KINDS)}")
  if hf.get("attention_bias"):
    raise invalid("config.attention_bias", True, "False: attn's reader has no OLMo-Hybrid attention biases")
  if hf.get("hidden_act", "silu") != "silu":
    raise invalid("config.hidden_act", hf["hidden_act"], "'silu': it is the MLP's and the gated DeltaNet "
                  "convolution's activation, which attn's gated_deltanet fixes at SiLU")
  return kinds


def config_in(hf: dict[str, Any]) -> ModelConfig:
  kinds = _check(hf)
  rope = _has_rope(hf)
  base = llama.config_in(ROW, {**hf, "layer_types": ["full_attention"] * len(kinds),
                               "head_dim": hf.get("head_dim") or get(hf, "hidden_size") // get(hf, "num_attention_heads")})
  linear = {"num_heads": get(hf, "linear_num_value_heads"), "num_kv_heads": get(hf, "linear_num_key_heads"),
            "d_k": get(hf, "linear_key_head_dim"), "d_v": get(hf, "linear_value_head_dim"),
            "conv_width": get(hf, "linear_conv_kernel_dim"), "gated_norm_eps": GATED_NORM_EPS,
            "linear_allow_neg_eigval": bool(hf.get("linear_allow_neg_eigval", True))}
  cfg = base.replace(qk_norm="whole", layer_types=tuple(kinds), linear_head=linear, linear_norm="pre")
  return cfg if rope else cfg.replace(positional="none", rope_dim=0)


def _rope_in(hf: dict[str, Any]) -> dict[str, Any]:
  return rope_from_hf(hf) if _has_rope(hf) else {}


_CONVS = ("q_conv1d", "k_conv1d", "v_conv1d")
_RENAMES = ((re.compile(r"\.attention_layer_norm\."), ".input_layernorm."),
            (re.compile(r"\.feedforward_layer_norm\."), ".post_attention_layernorm."))


def released(arrays: dict[str, Any]) -> dict[str, Any]:
  """The names on disk -> transformers' in-memory ones: the block norms renamed and q/k/v_conv1d
  concatenated (rows in that order) into conv1d."""
  out = {}
  for name, a in arrays.items():
    for pattern, new in _RENAMES:
      name = pattern.sub(new, name)
    out[name] = a
  for name in [n for n in out if n.endswith(".linear_attn.q_conv1d.weight")]:
    at = name[:-len("q_conv1d.weight")]
    if all(f"{at}{c}.weight" in out for c in _CONVS) and f"{at}conv1d.weight" not in out:
      out[f"{at}conv1d.weight"] = np.concatenate([np.asarray(out.pop(f"{at}{c}.weight")) for c in _CONVS], 0)
  return out


def live_names(sd: dict[str, Any], cfg: ModelConfig, names: frozenset[str]) -> dict[str, Any]:
  """to_hf's tensors for a transformers that holds the convolution as q_conv1d, k_conv1d and v_conv1d (5.3 to
  5.14; 5.15 on hold one conv1d): conv1d's rows split [q | k | v], key_dim, key_dim and value_dim rows."""
  out = dict(sd)
  for name in [n for n in sd if n.endswith(".linear_attn.conv1d.weight") and n not in names]:
    at = name[:-len("conv1d.weight")]
    if all(f"{at}{c}.weight" in names for c in _CONVS):
      head = cfg.layer_head(int(name.split(".")[2]))
      K, conv = head.num_kv_heads * head.d_k, out.pop(name)
      out |= dict(zip((f"{at}{c}.weight" for c in _CONVS), (conv[:K], conv[K:2 * K], conv[2 * K:])))
  return out


def _linear(w: Weights, a: str, cfg: ModelConfig, l: int) -> dict[str, np.ndarray]:
  head = cfg.layer_head(l)
  D, H, G, K, V, W = head.d_model, head.num_heads, head.num_kv_heads, head.d_k, head.d_v, head.conv_width
  conv = w(f"{a}.conv1d.weight", (2 * G * K + H * V, 1, W))[:, 0].T
  return {"w_q": w(f"{a}.q_proj.weight", (G * K, D)).T.reshape(D, G, K),
          "w_k": w(f"{a}.k_proj.weight", (G * K, D)).T.reshape(D, G, K),
          "w_v": w(f"{a}.v_proj.weight", (H * V, D)).T.reshape(D, H, V),
          "w_z": w(f"{a}.g_proj.weight", (H * V, D)).T.reshape(D, H, V),
          "w_a": w(f"{a}.a_proj.weight", (H, D)).T, "w_b": w(f"{a}.b_proj.weight", (H, D)).T,
          "conv_q": conv[:, :G * K].reshape(W, G, K), "conv_k": conv[:, G * K:2 * G * K].reshape(W, G, K),
          "conv_v": conv[:, 2 * G * K:].reshape(W, H, V),
          "a_log": w(f"{a}.A_log", (H,)), "dt_bias": w(f"{a}.dt_bias", (H,)), "norm": w(f"{a}.o_norm.weight", (V,)),
          "w_o": w(f"{a}.o_proj.weight", (D, H * V)).T.reshape(H, V, D)}


def _full(w: Weights, a: str, cfg: ModelConfig) -> dict[str, np.ndarray]:
  D, H, G, K = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head.d_k
  return {"w_q": w(f"{a}.q_proj.weight", (H * K, D)).T.reshape(D, H, K),
          "w_k": w(f"{a}.k_proj.weight", (G * K, D)).T.reshape(D, G, K),
          "w_v": w(f"{a}.v_proj.weight", (G * K, D)).T.reshape(D, G, K),
          "w_o": w(f"{a}.o_proj.weight", (D, H * K)).T.reshape(H, K, D),
          "q_norm_whole": w(f"{a}.q_norm.weight", (H * K,)).reshape(H, K),
          "k_norm_whole": w(f"{a}.k_norm.weight", (G * K,)).reshape(G, K)}


def weights_in(w: Weights, cfg: ModelConfig) -> dict[str, Any]:
  D, F, N = cfg.d_model, cfg.d_ff, cfg.vocab_size
  norm = lambda name: {"scale": w(f"{name}.weight", (D,))}  # noqa: E731
  blocks = {}
  for l, kind in enumerate(cfg.layer_types):
    b = f"layers.{l}"
    mlp = deepseek_v3.mlp_in(w, f"{b}.mlp", D, F)
    if kind == "linear_attention":
      blocks[l] = {"attn": {"params": _linear(w, f"{b}.linear_attn", cfg, l)}, "mlp": mlp,
                   "attn_norm": norm(f"{b}.input_layernorm"), "mlp_norm": norm(f"{b}.post_attention_layernorm")}
    else:
      blocks[l] = {"attn": {"params": _full(w, f"{b}.self_attn", cfg)}, "mlp": mlp,
                   "attn_post_norm": norm(f"{b}.post_attention_layernorm"),
                   "mlp_post_norm": norm(f"{b}.post_feedforward_layernorm")}
  return decoder_in(w, blocks, norm, cfg, N, D)


def _linear_out(p: dict[str, np.ndarray], a: str, cfg: ModelConfig, l: int) -> dict[str, np.ndarray]:
  head = cfg.layer_head(l)
  D, H, V, W = head.d_model, head.num_heads, head.d_v, head.conv_width
  conv = np.concatenate([p["conv_q"].reshape(W, -1), p["conv_k"].reshape(W, -1), p["conv_v"].reshape(W, -1)], -1)
  return {f"{a}.q_proj.weight": p["w_q"].reshape(D, -1).T, f"{a}.k_proj.weight": p["w_k"].reshape(D, -1).T,
          f"{a}.v_proj.weight": p["w_v"].reshape(D, -1).T, f"{a}.g_proj.weight": p["w_z"].reshape(D, -1).T,
          f"{a}.a_proj.weight": p["w_a"].T, f"{a}.b_proj.weight": p["w_b"].T, f"{a}.conv1d.weight": conv.T[:, None, :],
          f"{a}.A_log": p["a_log"], f"{a}.dt_bias": p["dt_bias"], f"{a}.o_norm.weight": p["norm"],
          f"{a}.o_proj.weight": p["w_o"].reshape(H * V, D).T}


def _full_out(p: dict[str, np.ndarray], a: str, cfg: ModelConfig) -> dict[str, np.ndarray]:
  D = cfg.d_model
  return {f"{a}.q_proj.weight": p["w_q"].reshape(D, -1).T, f"{a}.k_proj.weight": p["w_k"].reshape(D, -1).T,
          f"{a}.v_proj.weight": p["w_v"].reshape(D, -1).T, f"{a}.o_proj.weight": p["w_o"].reshape(-1, D).T,
          f"{a}.q_norm.weight": p["q_norm_whole"].ravel(), f"{a}.k_norm.weight": p["k_norm_whole"].ravel()}


def weights_out(pure: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
  sd = {"model.embed_tokens.weight": pure["embed"]["token"], "model.norm.weight": pure["final_norm"]["scale"]}
  sd["lm_head.weight"] = (pure["embed"]["token"] if cfg.tie_embeddings
                          else np.asarray(pure["head"]["linear"]["kernel"]).T)
  for l, block in pure["blocks"].items():
    l, b = int(l), f"model.layers.{l}"
    p = {k: np.asarray(v) for k, v in block["attn"]["params"].items()}
    sd |= {f"{b}.mlp.{n}_proj.weight": np.asarray(block["mlp"][n]["kernel"]).T for n in ("gate", "up", "down")}
    if cfg.layer_types[l] == "linear_attention":
      sd |= _linear_out(p, f"{b}.linear_attn", cfg, l)
      sd |= {f"{b}.input_layernorm.weight": block["attn_norm"]["scale"],
             f"{b}.post_attention_layernorm.weight": block["mlp_norm"]["scale"]}
    else:
      sd |= _full_out(p, f"{b}.self_attn", cfg)
      sd |= {f"{b}.post_attention_layernorm.weight": block["attn_post_norm"]["scale"],
             f"{b}.post_feedforward_layernorm.weight": block["mlp_post_norm"]["scale"]}
  return sd


def config_out(cfg: ModelConfig) -> dict[str, Any]:
  kinds = list(cfg.layer_types)
  lin = cfg.layer_head(kinds.index("linear_attention"))
  kw = llama.config_out(ROW, "olmo_hybrid", cfg.replace(layer_types=None, linear_head=None, linear_norm=None,
                                                         positional="rope", rope_dim=cfg.head.d_k))
  kw.pop("head_dim")  # OLMo-Hybrid's attention is hidden_size / num_attention_heads wide (check_out)
  if cfg.positional != "rope":  # the release's NoPE: rope_theta None (transformers then builds no RoPE)
    kw = {k: v for k, v in kw.items() if k not in ("rope_theta", "rope_scaling")}
    kw["rope_parameters"] = {"rope_type": "default", "rope_theta": None}
  return kw | {"layer_types": kinds, "linear_num_value_heads": lin.num_heads, "linear_num_key_heads": lin.num_kv_heads,
               "linear_key_head_dim": lin.d_k, "linear_value_head_dim": lin.d_v,
               "linear_conv_kernel_dim": lin.conv_width, "linear_allow_neg_eigval": lin.linear_allow_neg_eigval,
               "attention_bias": False}


def check_out(cfg: ModelConfig) -> None:
  if cfg.linear_variant != "gated_deltanet" or not cfg.layer_types or "linear_attention" not in cfg.layer_types \
      or "full_attention" not in cfg.layer_types:
    raise invalid("linear_variant, layer_types", (cfg.linear_variant, cfg.layer_types), "'gated_deltanet' with both "
                  "linear_attention and full_attention layers: OLMo-Hybrid's")
  if cfg.linear_norm != "pre" or cfg.norm != "after":
    raise invalid("norm, linear_norm", (cfg.norm, cfg.linear_norm), "('after', 'pre'): OLMo-Hybrid's softmax "
                  "layers norm each sublayer's output, its linear layers each sublayer's input")
  if cfg.head.d_k * cfg.num_heads != cfg.d_model or cfg.head.d_v != cfg.head.d_k:
    raise invalid("d_k, d_v", (cfg.head.d_k, cfg.head.d_v), f"d_model/num_heads={cfg.d_model // cfg.num_heads} "
                  "each: OLMo-Hybrid's attention heads are hidden_size / num_attention_heads wide")
  if cfg.positional == "rope" and cfg.rope_dim != cfg.head.d_k:
    raise invalid("rope_dim", cfg.rope_dim, f"d_k={cfg.head.d_k} (or positional 'none'): OLMo-Hybrid rotates "
                  "whole heads or none")
  eps = {cfg.layer_head(i).gated_norm_eps for i, kind in enumerate(cfg.layer_types) if kind == "linear_attention"}
  if cfg.qk_norm_eps != cfg.norm_eps or eps != {GATED_NORM_EPS}:
    raise invalid("qk_norm_eps, linear_head.gated_norm_eps", (cfg.qk_norm_eps, sorted(eps)), f"(norm_eps="
                  f"{cfg.norm_eps}, {GATED_NORM_EPS}): OLMo-Hybrid's q/k norms read rms_norm_eps, its gated "
                  "norms a fixed 1e-5")
  if cfg.mlp != "gated" or cfg.use_bias:
    raise invalid("mlp, use_bias", (cfg.mlp, cfg.use_bias), "('gated', False): OLMo-Hybrid's")


ROW = llama.LlamaLike("OlmoHybridForCausalLM", qkv_bias=False, o_bias=False, norm="after",
                      norms={"attn_post_norm": "post_attention_layernorm",
                             "mlp_post_norm": "post_feedforward_layernorm"},
                      rope_in=_rope_in)

OLMO_HYBRID = Family(
    name="olmo_hybrid", model_types=("olmo_hybrid",), architectures=("OlmoHybridForCausalLM",),
    config_in=config_in, weights_in=weights_in, weights_out=weights_out, config_out=config_out, prefix="model.",
    released=released, live_names=live_names,
    refusals={"is_encoder_decoder": ((False,), "attn loads decoder-only models here")},
    fixed={"norm": "after", "norm_type": "rmsnorm", "final_norm": True, "layernorm": True, "num_segments": 0,
           "embed_norm": False, "embed_scale": False, "qk_norm": "whole", "use_bias": False, "mlp": "gated"},
    mapped=llama.MAPPED | {"layer_types", "linear_head", "linear_variant", "linear_norm", "positional"},
    check_out=check_out)
