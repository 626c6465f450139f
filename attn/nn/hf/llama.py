"""The Llama-like decoders (Llama, Mistral, Qwen2, Qwen3; Gemma 2 in gemma2.py) as attn DecoderLMs.

They share one mapping (RoPE over the whole head, half-split; RMSNorm; a gated
MLP; grouped heads; head_dim free) and differ only in the fields of one
LlamaLike row each: Qwen2's q/k/v biases with b_o held as zeros, Qwen3's
QK-norm, Mistral's window in every layer. nn.Linear weights are (out, in):
transposed, heads split from the rows (head h in rows h·K..(h+1)·K of q_proj).

Windows: transformers keeps key s for query t when t − sliding_window < s ≤ t,
as attn's window does. A layer schedule of all full, all sliding, or every k-th
layer full maps onto window + global_every; any other is refused by name.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping

import numpy as np

from attn.config import invalid
from attn.nn.hf.base import Family, Weights, activation, activation_out, divisible, get, zero
from attn.nn.hf.rope import rope_from_hf, rope_to_hf
from attn.nn.config import ModelConfig

_NO_EXTRA = lambda *_: {}  # noqa: E731


def qwen_layer_types(hf: dict[str, Any], L: int) -> list[str]:
  """transformers' default schedule: layers from max_window_layers on slide when use_sliding_window."""
  first = hf.get("max_window_layers", L) if hf.get("use_sliding_window") else L
  return ["sliding_attention" if i >= first else "full_attention" for i in range(L)]


@dataclasses.dataclass(frozen=True)
class LlamaLike:
  """How one Llama-like family's config and weights map onto a DecoderLM.

  qkv_bias, o_bias, mlp_bias: the config key holding the switch (absent: False), or a constant.
  norms: attn's name of each of a block's norms -> the checkpoint's (Gemma 2's
  post_attention_layernorm is after the attention, Llama's before the MLP).
  layer_types: each layer's "full_attention" / "sliding_attention" when config.json has no layer_types.
  windows_out: the config keys of a windowed model (None: the family has no windows).
  extra_in / extra_out / extra_mapped: more ModelConfig fields read from / written to the config.
  rope_in / rope_out: the RoPE fields of a config and back (Gemma 3: one base per layer type).
  qk_norm_plus_one: the q/k-norm weights are w in x̂·(1 + w) (Gemma 3), held by attn as w
  (ModelConfig.qk_norm_plus_one), so they are written back bit for bit.
  """

  architecture: str
  qkv_bias: str | bool = "attention_bias"
  o_bias: str | bool = "attention_bias"
  mlp_bias: str | bool = False
  norm: str = "pre"
  norm_type: str = "rmsnorm"
  activation: str = "hidden_act"
  norms: Mapping[str, str] = dataclasses.field(default_factory=lambda: {
      "attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"})
  qk_norm: bool = False
  embed_scale: bool = False
  layer_types: Callable[[dict[str, Any], int], list[str]] = qwen_layer_types
  windows_out: Callable[[ModelConfig, list[str]], dict[str, Any]] | None = None
  extra_in: Callable[[dict[str, Any], int], dict[str, Any]] = _NO_EXTRA
  extra_out: Callable[[ModelConfig], dict[str, Any]] = _NO_EXTRA
  extra_mapped: frozenset[str] = frozenset()
  rope_in: Callable[[dict[str, Any]], dict[str, Any]] = rope_from_hf
  rope_out: Callable[[ModelConfig], dict[str, Any]] = rope_to_hf
  qk_norm_plus_one: bool = False


def _flag(hf: dict[str, Any], rule: str | bool) -> bool:
  """A bias rule: a constant, or the config key holding it (absent: False)."""
  return bool(hf.get(rule) or False) if isinstance(rule, str) else rule


def _window(hf: dict[str, Any], row: LlamaLike, L: int) -> tuple[int | None, int]:
  """(window, global_every) of the layer schedule: all full, all local, or every k-th global."""
  types = list(hf["layer_types"]) if hf.get("layer_types") else row.layer_types(hf, L)
  if len(types) != L or set(types) - {"full_attention", "sliding_attention"}:
    raise invalid("config.layer_types", types, f"{L} of 'full_attention' / 'sliding_attention'")
  local = [t == "sliding_attention" for t in types]
  if not any(local) or not hf.get("sliding_window"):
    return None, 0
  if all(local):
    return int(hf["sliding_window"]), 0
  for k in range(2, L + 1):  # ModelConfig.layer_head: layer l = i + 1 is global when k divides l
    if all(local[i] == bool((i + 1) % k) for i in range(L)):
      return int(hf["sliding_window"]), k
  raise invalid("config.layer_types", types, "all full, all sliding, or every k-th layer full "
                "(the others sliding): attn's global_every expresses only that schedule")


def config_in(row: LlamaLike, hf: dict[str, Any]) -> ModelConfig:
  """The DecoderLM of a Llama-like config.json."""
  D, H, L = get(hf, "hidden_size"), get(hf, "num_attention_heads"), get(hf, "num_hidden_layers")
  K = hf.get("head_dim") or None
  if K is None:
    divisible(D, H, "config.num_attention_heads")
    K = D // H
  G = hf.get("num_key_value_heads") or H
  if H % G:
    raise invalid("config.num_key_value_heads", G, f"a divisor of num_attention_heads={H}")
  qkv, o = _flag(hf, row.qkv_bias), _flag(hf, row.o_bias)
  if o and not qkv:
    raise invalid("config.attention_bias", "an output bias without q/k/v biases",
                  "both or neither, or q/k/v biases only (Qwen2)")
  window, global_every = _window(hf, row, L)
  eps = float(hf.get("rms_norm_eps", 1e-6))
  return ModelConfig(
      vocab_size=get(hf, "vocab_size"), d_model=D, num_layers=L, num_heads=H, d_ff=get(hf, "intermediate_size"),
      d_k=K, d_v=K, num_kv_heads=G, variant="per_head", max_len=get(hf, "max_position_embeddings"),
      positional="rope", rope_dim=K, **row.rope_in(hf), norm=row.norm, norm_type=row.norm_type, final_norm=True,
      mlp="gated", activation=activation(hf, row.activation, "silu"),
      tie_embeddings=bool(hf.get("tie_word_embeddings", True)), use_bias=qkv, dense_bias=_flag(hf, row.mlp_bias),
      norm_eps=eps, qk_norm=row.qk_norm, qk_norm_eps=eps, window=window, global_every=global_every,
      embed_scale=row.embed_scale, qk_norm_plus_one=row.qk_norm_plus_one, **row.extra_in(hf, K))


def weights_in(row: LlamaLike, w: Weights, cfg: ModelConfig) -> dict[str, Any]:
  D, H, G, K, F, N = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head.d_k, cfg.d_ff, cfg.vocab_size
  norm = lambda name: {"scale": w(f"{name}.weight", (D,))}
  blocks = {}
  for l in range(cfg.num_layers):
    a = f"layers.{l}.self_attn"
    heads = {"w_q": w(f"{a}.q_proj.weight", (H * K, D)).T.reshape(D, H, K),
             "w_k": w(f"{a}.k_proj.weight", (G * K, D)).T.reshape(D, G, K),
             "w_v": w(f"{a}.v_proj.weight", (G * K, D)).T.reshape(D, G, K),
             "w_o": w(f"{a}.o_proj.weight", (D, H * K)).T.reshape(H, K, D)}
    if cfg.use_bias:
      heads |= {"b_q": w(f"{a}.q_proj.bias", (H * K,)).reshape(H, K),
                "b_k": w(f"{a}.k_proj.bias", (G * K,)).reshape(G, K),
                "b_v": w(f"{a}.v_proj.bias", (G * K,)).reshape(G, K)}
      # Qwen2 has no o_proj bias: attn's b_o holds zeros (the same function, D more parameters).
      heads["b_o"] = w(f"{a}.o_proj.bias", (D,)) if row.o_bias is not False else np.zeros(D, np.float32)
    if cfg.qk_norm:  # config_in set cfg.qk_norm_plus_one to the row's: the checkpoint's w as it is
      heads |= {"q_norm": w(f"{a}.q_norm.weight", (K,)), "k_norm": w(f"{a}.k_norm.weight", (K,))}
    mlp = {}
    for name, shape in (("gate", (F, D)), ("up", (F, D)), ("down", (D, F))):
      mlp[name] = {"kernel": w(f"layers.{l}.mlp.{name}_proj.weight", shape).T}
      if cfg.has_dense_bias:
        mlp[name]["bias"] = w(f"layers.{l}.mlp.{name}_proj.bias", shape[:1])
    blocks[l] = {"attn": {"params": heads}, "mlp": mlp,
                 **{ours: norm(f"layers.{l}.{theirs}") for ours, theirs in row.norms.items()}}
  out = {"embed": {"token": w("embed_tokens.weight", (N, D))}, "blocks": blocks, "final_norm": norm("norm")}
  if cfg.tie_embeddings:
    if "lm_head.weight" in w:  # a live model's state_dict lists the tied head too
      w("lm_head.weight", (N, D))
  else:
    out["head"] = {"linear": {"kernel": w("lm_head.weight", (N, D)).T}}
    if cfg.has_dense_bias:  # Llama's lm_head has no bias even with mlp_bias: attn's holds zeros
      out["head"]["linear"]["bias"] = w("lm_head.bias", (N,)) if "lm_head.bias" in w else np.zeros(N, np.float32)
  return out


def _layer_types_out(cfg: ModelConfig) -> list[str]:
  return ["full_attention" if cfg.layer_head(i).window is None else "sliding_attention"
          for i in range(cfg.num_layers)]


def _windows_out(row: LlamaLike, name: str, cfg: ModelConfig) -> dict[str, Any]:
  types = _layer_types_out(cfg)
  if row.windows_out is None:
    if "sliding_attention" in types:
      raise invalid("window", cfg.window, f"None: {name} has no sliding windows")
    return {}
  return row.windows_out(cfg, types)


def check_out(row: LlamaLike, name: str, cfg: ModelConfig) -> None:
  K = cfg.head.d_k
  if cfg.head.d_v != K or cfg.rope_dim != K:
    raise invalid("d_v, rope_dim", (cfg.head.d_v, cfg.rope_dim), f"d_k={K}: {name} rotates whole heads of one width")
  if cfg.qk_norm and cfg.qk_norm_eps != cfg.norm_eps:
    raise invalid("qk_norm_eps", cfg.qk_norm_eps, f"norm_eps={cfg.norm_eps}: {name} has one rms_norm_eps")
  if cfg.use_bias and row.qkv_bias is False:
    raise invalid("use_bias", True, f"False: {name} has no qkv biases")
  if cfg.has_dense_bias and row.mlp_bias is False:
    raise invalid("dense_bias", True, f"False: {name} has no mlp biases")
  _windows_out(row, name, cfg)


def weights_out(row: LlamaLike, name: str, pure: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
  D, H, G, K = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head.d_k
  sd = {"model.embed_tokens.weight": pure["embed"]["token"], "model.norm.weight": pure["final_norm"]["scale"]}
  sd["lm_head.weight"] = pure["embed"]["token"] if cfg.tie_embeddings else np.asarray(pure["head"]["linear"]["kernel"]).T
  if not cfg.tie_embeddings and cfg.has_dense_bias:
    zero(pure["head"]["linear"]["bias"], "output bias", name)
  for l, block in pure["blocks"].items():
    p, a = {k: np.asarray(v) for k, v in block["attn"]["params"].items()}, f"model.layers.{l}.self_attn"
    sd |= {f"{a}.q_proj.weight": p["w_q"].reshape(D, H * K).T, f"{a}.k_proj.weight": p["w_k"].reshape(D, G * K).T,
           f"{a}.v_proj.weight": p["w_v"].reshape(D, G * K).T, f"{a}.o_proj.weight": p["w_o"].reshape(H * K, D).T}
    if cfg.use_bias:
      sd |= {f"{a}.{n}_proj.bias": p[f"b_{n}"].ravel() for n in ("q", "k", "v")}
      if row.o_bias is not False:
        sd[f"{a}.o_proj.bias"] = p["b_o"]
      else:
        zero(p["b_o"], f"blocks.{l}.attn b_o", name)
    if cfg.qk_norm:
      sd |= {f"{a}.{n}.weight": qk_scale_out(row, cfg, p[n]) for n in ("q_norm", "k_norm")}
    for n in ("gate", "up", "down"):
      sd[f"model.layers.{l}.mlp.{n}_proj.weight"] = np.asarray(block["mlp"][n]["kernel"]).T
      if cfg.has_dense_bias:
        sd[f"model.layers.{l}.mlp.{n}_proj.bias"] = block["mlp"][n]["bias"]
    sd |= {f"model.layers.{l}.{theirs}.weight": block[ours]["scale"] for ours, theirs in row.norms.items()}
  return sd


def qk_scale_out(row: LlamaLike, cfg: ModelConfig, scale: np.ndarray) -> np.ndarray:
  """A QK-norm scale as the family holds it: as attn holds it when both add the same 1 (bit for
  bit), else with 1 added or taken away (a Qwen3-style model written as Gemma 3, rounded in float32)."""
  shift = float(cfg.qk_norm_plus_one) - float(row.qk_norm_plus_one)
  return scale if not shift else (scale + np.float32(shift)).astype(scale.dtype)


def config_out(row: LlamaLike, name: str, cfg: ModelConfig) -> dict[str, Any]:
  kw = dict(architectures=[row.architecture], vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
            intermediate_size=cfg.d_ff, num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
            num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head.d_k, max_position_embeddings=cfg.max_len,
            rms_norm_eps=cfg.norm_eps, **row.rope_out(cfg), tie_word_embeddings=cfg.tie_embeddings,
            attention_dropout=0.0, pad_token_id=None, bos_token_id=None, eos_token_id=None)
  kw[row.activation] = activation_out(cfg, ("silu", "gelu_pytorch_tanh", "gelu", "relu"))
  for rule, on in ((row.qkv_bias, cfg.use_bias), (row.mlp_bias, cfg.has_dense_bias)):
    if isinstance(rule, str):
      kw[rule] = on
  return kw | _windows_out(row, name, cfg) | row.extra_out(cfg)


# ModelConfig fields a Llama-like config holds, beyond the sizes every family maps.
MAPPED = frozenset({"rope_theta", "rope_dim", "rope_scaling", "rope_factor", "rope_low_freq_factor",
                    "rope_high_freq_factor", "rope_original_max_len", "rope_beta_fast", "rope_beta_slow",
                    "rope_attention_factor", "rope_truncate", "tie_embeddings", "use_bias", "dense_bias",
                    "qk_norm_eps", "qk_norm_plus_one", "window", "global_every"})


def family(name: str, row: LlamaLike, model_types: tuple[str, ...] | None = None) -> Family:
  """The Family record of one LlamaLike row."""
  return Family(
      name=name, model_types=model_types or (name,), architectures=(row.architecture,),
      config_in=functools.partial(config_in, row), weights_in=functools.partial(weights_in, row),
      weights_out=functools.partial(weights_out, row, name), config_out=functools.partial(config_out, row, name),
      prefix="model.",
      refusals={"is_encoder_decoder": ((False,), "attn loads decoder-only models here"),
                "use_bidirectional_attention": ((False, None), "attn's DecoderLM is causal")},
      fixed={"positional": "rope", "norm": row.norm, "norm_type": row.norm_type, "mlp": "gated", "final_norm": True,
             "layernorm": True, "num_segments": 0, "embed_norm": False, "embed_scale": row.embed_scale,
             "qk_norm": row.qk_norm},
      mapped=MAPPED | row.extra_mapped, check_out=functools.partial(check_out, row, name))


def _mistral_windows(cfg: ModelConfig, types: list[str]) -> dict[str, Any]:
  if cfg.global_every:
    raise invalid("global_every", cfg.global_every, "0: mistral's window is in every layer")
  return {"sliding_window": cfg.window}


LLAMA = family("llama", LlamaLike("LlamaForCausalLM", mlp_bias="mlp_bias"))
MISTRAL = family("mistral", LlamaLike(
    "MistralForCausalLM", qkv_bias=False, o_bias=False, windows_out=_mistral_windows,
    layer_types=lambda hf, L: ["sliding_attention" if hf.get("sliding_window") else "full_attention"] * L))
QWEN2 = family("qwen2", LlamaLike("Qwen2ForCausalLM", qkv_bias=True, o_bias=False))
QWEN3 = family("qwen3", LlamaLike("Qwen3ForCausalLM", qk_norm=True))
