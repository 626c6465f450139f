"""Hugging Face GPT-2, BERT, Llama, Mistral, Qwen2, Qwen3 and Gemma 2 weights in and out (`hf` extra).

The Llama-like families map onto a DecoderLM through one row each of FAMILIES
(RoPE over the whole head, half-split; RMSNorm; gated MLP; GQA; head_dim free;
Qwen2's q/k/v biases with b_o held as zeros; Qwen3's QK-norm; Mistral's window
in every layer; Gemma 2's sandwich norms, (1 + w) RMSNorm, √D embedding scale,
attention and final soft-caps, query_pre_attn_scalar and layer_types mapped
onto window + global_every). RoPE types "default", "linear" and "llama3"
(Llama 3.1/3.2's frequency scaling) map onto HeadConfig's rope_scaling
fields, from transformers 5's rope_parameters or 4's rope_scaling, and go
back out in both; other rope types (dynamic, yarn, longrope, ...), gpt_oss
(mixture of experts) and layer schedules global_every cannot express are
refused by name. to_hf(model, cfg, model_type) writes
any of them back; an Encoder goes out as BertModel, or BertForMaskedLM when
it holds the MLM head (mlm_head).

from_hf(source, variant="per_head", num_kv_heads=None) reads a transformers
GPT2LMHeadModel, GPT2Model or BertModel object, or a local directory as
save_pretrained writes it (config.json + model.safetensors, or a sharded
model.safetensors.index.json), and returns (model, model_config): a DecoderLM
for "gpt2", an Encoder (embedding LayerNorm, token types, post-norm, pooler)
for "bert". A directory is read with safetensors' numpy API: no torch, no
transformers, never pickle (pytorch_model.bin is refused). variant= converts
every layer through attn.convert; a lossy conversion warns with its error
(LossyConversionWarning). With num_kv_heads it returns (model, model_config,
error): the key/value heads are mean-pooled (Ainslie et al. 2023) and error is
the largest relative Frobenius error of any layer (attn.convert's
return_error); convert_model gives every layer's. to_hf(model, model_config)
builds a GPT2LMHeadModel with the same logits; from_hf(to_hf(m)) gives m's
parameters back exactly.

Layouts: GPT-2's Conv1D weights are (in, out), y = x W + b, and c_attn packs
[q | k | v] column blocks, head h in columns h·K..(h+1)·K of each; BERT's
Linear weights are (out, in), y = x Wᵀ + b. GPT-2's "gelu_new" is jax's tanh
gelu (attn's "gelu"); BERT's "gelu" is the erf form ("gelu_exact").

Padding: attn's models take right padding as lengths (B,), which is Hugging
Face's attention_mask with its ones first (lengths_from_attention_mask): keys
past the length are masked, as HF masks them, so outputs agree at every
position, padded ones included. Left padding is refused: HF numbers positions
from the first pad token, which attn's models cannot express.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import os
import warnings
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from attn.config import ROPE_SCALINGS, invalid
from attn.convert import CONVERTERS, TOLERANCE, LossyConversionWarning, convert
from attn.nn.models import MODELS, DecoderLM, Encoder, ModelConfig

# The Llama-like decoders: one row each, how the family's config and weights map onto a
# DecoderLM (RoPE over the whole head, RMSNorm, gated MLP). qkv_bias/o_bias/mlp_bias: a
# config key (its value, default False) or a constant; norms: the checkpoint's name of each
# of the block's norms (Gemma 2's post_attention_layernorm is after the attention, Llama's is
# before the MLP).
_LLAMA_NORMS = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
FAMILIES = {
    "llama": dict(qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias="mlp_bias",
                  norm_type="rmsnorm", norm="pre", act="hidden_act", norms=_LLAMA_NORMS),
    "mistral": dict(qkv_bias=False, o_bias=False, mlp_bias=False, norm_type="rmsnorm", norm="pre",
                    act="hidden_act", norms=_LLAMA_NORMS, all_local=True),
    "qwen2": dict(qkv_bias=True, o_bias=False, mlp_bias=False, norm_type="rmsnorm", norm="pre",
                  act="hidden_act", norms=_LLAMA_NORMS),
    "qwen3": dict(qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias=False,
                  norm_type="rmsnorm", norm="pre", act="hidden_act", norms=_LLAMA_NORMS, qk_norm=True),
    "gemma2": dict(qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias=False,
                   norm_type="rmsnorm_plus_one", norm="sandwich", act="hidden_activation",
                   norms={"attn_norm": "input_layernorm", "attn_post_norm": "post_attention_layernorm",
                          "mlp_norm": "pre_feedforward_layernorm",
                          "mlp_post_norm": "post_feedforward_layernorm"},
                   embed_scale=True),
}
# Families attn refuses, with the reason.
REFUSED = {"gpt_oss": "its feed-forward is a mixture of experts (a router and experts in every "
                      "block); attn's models have one dense MLP per block",
           "mixtral": "its feed-forward is a mixture of experts; attn's models have one dense MLP"}
SUPPORTED = {"gpt2": "decoder_lm", "bert": "encoder", **dict.fromkeys(FAMILIES, "decoder_lm")}
_CLASSES = {"GPT2LMHeadModel": "gpt2", "GPT2Model": "gpt2", "BertModel": "bert", "BertForMaskedLM": "bert",
            "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
            "Qwen3ForCausalLM": "qwen3", "Gemma2ForCausalLM": "gemma2"}
# HF activation name -> attn's: tanh forms are "gelu", the erf form "gelu_exact".
_ACTIVATIONS = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "gelu_fast": "gelu",
                "gelu": "gelu_exact", "gelu_python": "gelu_exact", "relu": "relu", "silu": "silu",
                "swish": "silu"}
_TO_HF_ACTIVATION = {"gelu": "gelu_new", "gelu_exact": "gelu", "relu": "relu", "silu": "silu"}
# Checkpoint keys that hold no weights attn needs: buffers (causal masks, ids), the tied LM head, task heads.
_SKIPPED_ENDS = (".attn.bias", ".attn.masked_bias", "embeddings.position_ids", "embeddings.token_type_ids",
                 "rotary_emb.inv_freq", "embed_tokens.embed_scale")
_SKIPPED_STARTS = ("lm_head.", "cls.seq_relationship.")  # BERT's next-sentence head is not read


def require(module: str) -> Any:
  """An optional module of the hf extra, imported; its absence is refused with how to install it."""
  try:
    return importlib.import_module(module)
  except ImportError:
    raise invalid("import", module, "an installed module: pip install -e '.[hf]' (transformers, "
                  "safetensors, tokenizers; to_hf and live transformers models also need torch)") from None


_REQUIRED = object()


def _get(hf: dict[str, Any], *names: str, default: Any = _REQUIRED) -> Any:
  """The first of names in the config; a missing required one is refused by name."""
  for name in names:
    if name in hf:
      return hf[name]
  if default is _REQUIRED:
    raise invalid(f"config.{names[0]}", None, f"a value: a {hf.get('model_type')} config.json has one")
  return default


def _refuse(hf: dict[str, Any], name: str, allowed: Any, why: str) -> None:
  """Refuses config[name] unless it is `allowed` (or absent: older configs lack newer switches)."""
  value = hf.get(name, allowed)
  if value != allowed:
    raise invalid(f"config.{name}", value, f"{allowed!r}: {why}")


def _activation(hf: dict[str, Any], name: str, default: str) -> str:
  act = hf.get(name, default)
  if act not in _ACTIVATIONS:
    raise invalid(f"config.{name}", act, f"one of {sorted(_ACTIVATIONS)}")
  return _ACTIVATIONS[act]


def _divisible(D: int, H: int, field: str) -> None:
  if D % H:
    raise invalid(field, H, f"a divisor of the width {D}")


def model_config(hf: dict[str, Any], variant: str = "per_head",
                 num_kv_heads: int | None = None) -> ModelConfig:
  """The ModelConfig of a Hugging Face config dict; unsupported settings are refused by name."""
  kind = hf.get("model_type")
  if kind in REFUSED:
    raise invalid("config.model_type", kind, f"one of {sorted(SUPPORTED)}: {kind} is refused, "
                  + REFUSED[kind])
  if kind not in SUPPORTED:
    raise invalid("config.model_type", kind, f"one of {sorted(SUPPORTED)}")
  if variant != "per_head" and ("per_head", variant) not in CONVERTERS:
    known = sorted(f"{dst} ({'exact' if c.exact else 'lossy'})" for (src, dst), c in CONVERTERS.items()
                   if src == "per_head")
    raise invalid("variant", variant, f"per_head or one converted from it: {', '.join(known)}")
  if kind in FAMILIES:
    return _family_config(hf, kind, variant, num_kv_heads)
  if kind == "gpt2":
    _refuse(hf, "scale_attn_weights", True, "attn scales scores by 1/sqrt(d_k)")
    _refuse(hf, "scale_attn_by_inverse_layer_idx", False, "attn has no per-layer score scale")
    _refuse(hf, "add_cross_attention", False, "cross-attention GPT-2 is not supported")
    _refuse(hf, "tie_word_embeddings", True, "attn's DecoderLM with biases ties its output to wte")
    D, H = _get(hf, "n_embd", "hidden_size"), _get(hf, "n_head", "num_attention_heads")
    _divisible(D, H, "config.n_head")
    return ModelConfig(
        vocab_size=_get(hf, "vocab_size"), d_model=D, num_layers=_get(hf, "n_layer", "num_hidden_layers"),
        num_heads=H, d_ff=hf.get("n_inner") or 4 * D, num_kv_heads=num_kv_heads, variant=variant,
        max_len=_get(hf, "n_positions", "max_position_embeddings"), norm="pre", final_norm=True,
        activation=_activation(hf, "activation_function", "gelu_new"), tie_embeddings=True,
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)))
  _refuse(hf, "position_embedding_type", "absolute", "attn has learned absolute positions only")
  _refuse(hf, "is_decoder", False, "a causal BERT is not supported")
  _refuse(hf, "add_cross_attention", False, "cross-attention BERT is not supported")
  D, H = _get(hf, "hidden_size"), _get(hf, "num_attention_heads")
  _divisible(D, H, "config.num_attention_heads")
  return ModelConfig(
      vocab_size=_get(hf, "vocab_size"), d_model=D, num_layers=_get(hf, "num_hidden_layers"), num_heads=H,
      d_ff=_get(hf, "intermediate_size"), num_kv_heads=num_kv_heads, variant=variant,
      max_len=_get(hf, "max_position_embeddings"), num_segments=hf.get("type_vocab_size", 2),
      embed_norm=True, norm="post", final_norm=False, activation=_activation(hf, "hidden_act", "gelu"),
      pooler=True, norm_eps=float(hf.get("layer_norm_eps", 1e-12)))


def _flag(hf: dict[str, Any], rule: Any) -> bool:
  """A family's bias rule: a constant, or the config key holding it (absent: False)."""
  return bool(hf.get(rule) or False) if isinstance(rule, str) else rule


ROPE_TYPES = ("default", *(k for k in ROPE_SCALINGS if k))  # transformers' rope_type values attn implements


def rope_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
  """The HeadConfig RoPE fields (rope_theta, and rope_scaling with its parameters) of a config.

  transformers 5 reads rope_parameters; 4 reads rope_scaling ("type" in older
  files, "rope_type" in newer) beside a top-level rope_theta. A rope_scaling,
  where present, wins, as in both (5 takes it over rope_parameters). Types
  other than ROPE_TYPES (dynamic, yarn, longrope, ...) are refused by name.
  """
  where = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
  params = hf.get(where) or {}
  if params and all(isinstance(v, dict) for v in params.values()):  # one per layer type
    kinds = {json.dumps(v, sort_keys=True) for v in params.values()}
    if len(kinds) > 1:
      raise invalid(f"config.{where}", params, "the same RoPE for every layer type")
    params = next(iter(params.values()))
  kind = params.get("rope_type", params.get("type", "default"))
  if kind not in ROPE_TYPES:
    raise invalid(f"config.{where}.rope_type", kind, f"one of {list(ROPE_TYPES)}: attn implements "
                  "plain RoPE and its linear and llama3 scaling (not dynamic, yarn, longrope, ...)")
  _refuse(hf, "partial_rotary_factor", 1.0, "attn's loader rotates the whole head")
  if params.get("partial_rotary_factor", 1.0) != 1.0:
    raise invalid(f"config.{where}.partial_rotary_factor", params["partial_rotary_factor"],
                  "1.0: attn's loader rotates the whole head")
  out = {"rope_theta": float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))}
  if kind == "default":
    return out

  def number(key: str, value: Any, integer: bool = False) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
        or (integer and value != int(value)):
      raise invalid(f"config.{key}", value, f"{'an integer' if integer else 'a number'}: {kind} RoPE reads it")
    return int(value) if integer else float(value)

  out |= {"rope_scaling": kind, "rope_factor": number(f"{where}.factor", params.get("factor"))}
  if kind == "llama3":
    # As transformers 5: a top-level original_max_position_embeddings first (Phi-3 keeps it
    # there), else the rope dict's, else max_position_embeddings.
    key = "original_max_position_embeddings"
    orig = (key, hf[key]) if key in hf else (f"{where}.{key}", params.get(key, hf.get("max_position_embeddings")))
    out |= {"rope_low_freq_factor": number(f"{where}.low_freq_factor", params.get("low_freq_factor")),
            "rope_high_freq_factor": number(f"{where}.high_freq_factor", params.get("high_freq_factor")),
            "rope_original_max_len": number(*orig, integer=True)}
  return out


def rope_to_hf(cfg: ModelConfig) -> dict[str, Any]:
  """rope_from_hf's inverse: the keys transformers 4 reads (rope_theta, rope_scaling) and 5's rope_parameters.

  transformers 5 takes a rope_scaling over rope_parameters; the two hold the same here.
  """
  rope = {"rope_type": cfg.rope_scaling or "default"}
  if cfg.rope_scaling:
    rope["factor"] = cfg.rope_factor
  if cfg.rope_scaling == "llama3":
    rope |= {"low_freq_factor": cfg.rope_low_freq_factor, "high_freq_factor": cfg.rope_high_freq_factor,
             "original_max_position_embeddings": cfg.rope_original_max_len}
  out = {"rope_theta": cfg.rope_theta, "rope_parameters": rope | {"rope_theta": cfg.rope_theta}}
  return out | ({"rope_scaling": rope} if cfg.rope_scaling else {})


def _layer_types(hf: dict[str, Any], kind: str, L: int) -> list[str]:
  """Each layer's "full_attention" or "sliding_attention", as transformers derives them."""
  if hf.get("layer_types"):
    return list(hf["layer_types"])
  if kind == "mistral":
    return ["sliding_attention" if hf.get("sliding_window") else "full_attention"] * L
  if kind == "gemma2":
    return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(L)]
  first = hf.get("max_window_layers", L) if hf.get("use_sliding_window") else L
  return ["sliding_attention" if i >= first else "full_attention" for i in range(L)]


def _window(hf: dict[str, Any], kind: str, L: int) -> tuple[int | None, int]:
  """(window, global_every) of the layer schedule: all full, all local, or every k-th global.

  transformers keeps key s for query t when t − sliding_window < s ≤ t, as attn's window does.
  """
  types = _layer_types(hf, kind, L)
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


def _family_config(hf: dict[str, Any], kind: str, variant: str, num_kv_heads: int | None) -> ModelConfig:
  """The ModelConfig of a Llama-like family (FAMILIES[kind])."""
  fam = FAMILIES[kind]
  _refuse(hf, "is_encoder_decoder", False, "attn loads decoder-only models here")
  if hf.get("use_bidirectional_attention"):
    raise invalid("config.use_bidirectional_attention", True, "False: attn's DecoderLM is causal")
  D, H, L = _get(hf, "hidden_size"), _get(hf, "num_attention_heads"), _get(hf, "num_hidden_layers")
  K = hf.get("head_dim") or None
  if K is None:
    _divisible(D, H, "config.num_attention_heads")
    K = D // H
  G = hf.get("num_key_value_heads") or H
  if H % G:
    raise invalid("config.num_key_value_heads", G, f"a divisor of num_attention_heads={H}")
  qkv, o = _flag(hf, fam["qkv_bias"]), _flag(hf, fam["o_bias"])
  if o and not qkv:
    raise invalid("config.attention_bias", "an output bias without q/k/v biases",
                  "both or neither, or q/k/v biases only (Qwen2)")
  window, global_every = _window(hf, kind, L)
  eps = float(hf.get("rms_norm_eps", 1e-6))
  scale = None
  if kind == "gemma2":
    scalar = float(_get(hf, "query_pre_attn_scalar"))
    scale = None if scalar == K else scalar ** -0.5
  extra = {}
  if kind == "gemma2":
    extra = dict(softcap=hf.get("attn_logit_softcapping"), logit_softcap=hf.get("final_logit_softcapping"),
                 embed_scale=True)
  return ModelConfig(
      vocab_size=_get(hf, "vocab_size"), d_model=D, num_layers=L, num_heads=H, d_ff=_get(hf, "intermediate_size"),
      d_k=K, d_v=K, num_kv_heads=G if num_kv_heads is None else num_kv_heads, variant=variant,
      max_len=_get(hf, "max_position_embeddings"), positional="rope", rope_dim=K, **rope_from_hf(hf),
      norm=fam["norm"], norm_type=fam["norm_type"], final_norm=True, mlp="gated",
      activation=_activation(hf, fam["act"], "silu"), tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
      use_bias=qkv, dense_bias=_flag(hf, fam["mlp_bias"]), norm_eps=eps, qk_norm=fam.get("qk_norm", False),
      qk_norm_eps=eps, window=window, global_every=global_every, scale=scale, **extra)


# ---- reading: a directory (numpy only) or a live transformers object (torch tensors).

def read_config(path: str) -> dict[str, Any]:
  """config.json of a local Hugging Face checkpoint directory, refusing anything else."""
  where = os.path.join(path, "config.json") if isinstance(path, (str, os.PathLike)) else None
  if where is None or not os.path.isdir(path) or not os.path.isfile(where):
    raise invalid("source", str(path), "a Hugging Face checkpoint directory holding config.json and "
                  "model.safetensors (as save_pretrained writes it), or a GPT2LMHeadModel or BertModel")
  try:
    with open(where, encoding="utf-8") as f:
      return json.load(f)
  except (OSError, ValueError) as e:
    raise invalid("source", where, f"a readable JSON config.json ({e})") from None


def read_weights(path: str) -> dict[str, np.ndarray]:
  """Every tensor of model.safetensors (or its shards) as numpy, through safetensors' numpy API."""
  load_file = require("safetensors.numpy").load_file
  index = os.path.join(path, "model.safetensors.index.json")
  if os.path.isfile(index):
    with open(index, encoding="utf-8") as f:
      files = sorted(set(json.load(f)["weight_map"].values()))
  elif os.path.isfile(os.path.join(path, "model.safetensors")):
    files = ["model.safetensors"]
  else:
    found = sorted(n for n in os.listdir(path) if n.endswith((".bin", ".safetensors", ".h5", ".msgpack")))
    raise invalid("source", str(path), "a directory with model.safetensors (or its index); found "
                  f"{found or 'no weights'}: attn reads safetensors only, never pickle "
                  "(re-save with save_pretrained)")
  out = {}
  for name in files:
    try:
      out.update(load_file(os.path.join(path, name)))
    except Exception as e:  # a truncated file, or a dtype numpy lacks (bfloat16)
      raise invalid("source", os.path.join(path, name), f"a safetensors file numpy can read ({e})") from None
  return out


def _read_object(obj: Any) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  name = type(obj).__name__
  if name not in _CLASSES or not hasattr(obj, "state_dict"):
    raise invalid("source", name, f"one of {sorted(_CLASSES)}, or a local checkpoint directory")
  weights = {k: t.detach().cpu().float().numpy() for k, t in obj.state_dict().items()}
  return obj.config.to_dict(), weights


def _strip(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Keys without the task model's prefix (transformer., bert.), minus buffers and heads."""
  out = {}
  for k, a in weights.items():
    for prefix in ("transformer.", "bert."):
      k = k[len(prefix):] if k.startswith(prefix) else k
    if not k.endswith(_SKIPPED_ENDS) and not k.startswith(_SKIPPED_STARTS):
      out[k.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")] = a
  return out


class _Weights:
  """Named checkpoint arrays as float32; a missing name is refused with the checkpoint's names."""

  def __init__(self, weights: dict[str, np.ndarray]):
    self.arrays, self.used = _strip(weights), set()

  def __call__(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
    """The tensor `name`; with shape, one of another shape is refused with both shapes."""
    if name not in self.arrays:
      raise invalid("checkpoint", f"no tensor {name!r}",
                    f"a checkpoint of the config's model; it has {sorted(self.arrays)[:8]}...")
    self.used.add(name)
    a = np.asarray(self.arrays[name], np.float32)
    if shape is not None and tuple(a.shape) != tuple(shape):
      raise invalid(f"checkpoint {name}.shape", tuple(a.shape), f"{tuple(shape)} from config.json")
    return a

  def norm(self, name: str) -> dict[str, np.ndarray]:
    return {"scale": self(f"{name}.weight"), "bias": self(f"{name}.bias")}

  def unused(self) -> list[str]:
    return sorted(set(self.arrays) - self.used)


def _gpt2_pure(w: _Weights, cfg: ModelConfig) -> dict[str, Any]:
  D, H = cfg.d_model, cfg.num_heads
  blocks = {}
  for l in range(cfg.num_layers):
    p = f"h.{l}"
    w_q, w_k, w_v = np.split(w(f"{p}.attn.c_attn.weight"), 3, axis=1)
    b_q, b_k, b_v = np.split(w(f"{p}.attn.c_attn.bias"), 3)
    heads = {"w_q": w_q.reshape(D, H, -1), "w_k": w_k.reshape(D, H, -1), "w_v": w_v.reshape(D, H, -1),
             "w_o": w(f"{p}.attn.c_proj.weight").reshape(H, -1, D), "b_q": b_q.reshape(H, -1),
             "b_k": b_k.reshape(H, -1), "b_v": b_v.reshape(H, -1), "b_o": w(f"{p}.attn.c_proj.bias")}
    blocks[l] = {"attn": {"params": heads}, "attn_norm": w.norm(f"{p}.ln_1"),
                 "mlp_norm": w.norm(f"{p}.ln_2"),
                 "mlp": {"up": {"kernel": w(f"{p}.mlp.c_fc.weight"), "bias": w(f"{p}.mlp.c_fc.bias")},
                         "down": {"kernel": w(f"{p}.mlp.c_proj.weight"), "bias": w(f"{p}.mlp.c_proj.bias")}}}
  return {"embed": {"token": w("wte.weight"), "position": w("wpe.weight")}, "blocks": blocks,
          "final_norm": w.norm("ln_f")}


def _linear(w: _Weights, name: str) -> dict[str, np.ndarray]:
  return {"kernel": w(f"{name}.weight").T, "bias": w(f"{name}.bias")}


def _bert_pure(w: _Weights, cfg: ModelConfig) -> dict[str, Any]:
  D, H = cfg.d_model, cfg.num_heads
  blocks = {}
  for l in range(cfg.num_layers):
    p = f"encoder.layer.{l}"
    heads = {f"w_{n}": w(f"{p}.attention.self.{full}.weight").T.reshape(D, H, -1)
             for n, full in (("q", "query"), ("k", "key"), ("v", "value"))}
    heads |= {f"b_{n}": w(f"{p}.attention.self.{full}.bias").reshape(H, -1)
              for n, full in (("q", "query"), ("k", "key"), ("v", "value"))}
    heads |= {"w_o": w(f"{p}.attention.output.dense.weight").T.reshape(H, -1, D),
              "b_o": w(f"{p}.attention.output.dense.bias")}
    blocks[l] = {"attn": {"params": heads}, "attn_norm": w.norm(f"{p}.attention.output.LayerNorm"),
                 "mlp": {"up": _linear(w, f"{p}.intermediate.dense"), "down": _linear(w, f"{p}.output.dense")},
                 "mlp_norm": w.norm(f"{p}.output.LayerNorm")}
  e = "embeddings"
  embed = {"token": w(f"{e}.word_embeddings.weight"), "position": w(f"{e}.position_embeddings.weight"),
           "norm": w.norm(f"{e}.LayerNorm")}
  if cfg.num_segments:
    embed["segment"] = w(f"{e}.token_type_embeddings.weight")
  out = {"embed": embed, "blocks": blocks}
  if cfg.pooler:
    out["pooler"] = _linear(w, "pooler.dense")
  if cfg.mlm_head:  # BertForMaskedLM: its decoder is the word embeddings, its bias predictions.bias
    c = "cls.predictions"
    out["mlm"] = {"transform": _linear(w, f"{c}.transform.dense"), "norm": w.norm(f"{c}.transform.LayerNorm"),
                  "bias": w(f"{c}.bias", (cfg.vocab_size,))}
    for tied in (f"{c}.decoder.weight", f"{c}.decoder.bias"):
      if tied in w.arrays:
        w(tied)
  return out


def _family_keys(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """A Llama-like checkpoint's names without "model."; its lm_head as "output" (read when untied)."""
  out = {}
  for k, a in weights.items():
    k = k[len("model."):] if k.startswith("model.") else k
    out["output.weight" if k == "lm_head.weight" else k] = a
  return out


def _family_pure(w: _Weights, cfg: ModelConfig, kind: str) -> dict[str, Any]:
  """A Llama-like checkpoint as DecoderLM arrays: nn.Linear (out, in) weights transposed,
  heads split from the columns (head h in rows h·K..(h+1)·K of q_proj)."""
  fam = FAMILIES[kind]
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
      heads["b_o"] = w(f"{a}.o_proj.bias", (D,)) if fam["o_bias"] is not False else np.zeros(D, np.float32)
    if cfg.qk_norm:
      heads |= {"q_norm": w(f"{a}.q_norm.weight", (K,)), "k_norm": w(f"{a}.k_norm.weight", (K,))}
    mlp = {}
    for name, shape in (("gate", (F, D)), ("up", (F, D)), ("down", (D, F))):
      mlp[name] = {"kernel": w(f"layers.{l}.mlp.{name}_proj.weight", shape).T}
      if cfg.has_dense_bias:
        mlp[name]["bias"] = w(f"layers.{l}.mlp.{name}_proj.bias", shape[:1])
    blocks[l] = {"attn": {"params": heads}, "mlp": mlp,
                 **{ours: norm(f"layers.{l}.{theirs}") for ours, theirs in fam["norms"].items()}}
  out = {"embed": {"token": w("embed_tokens.weight", (N, D))}, "blocks": blocks, "final_norm": norm("norm")}
  if cfg.tie_embeddings:
    if "output.weight" in w.arrays:  # a live model's state_dict lists the tied head too
      w("output.weight", (N, D))
  else:
    out["head"] = {"linear": {"kernel": w("output.weight", (N, D)).T}}
    if cfg.has_dense_bias:  # Llama's lm_head has no bias even with mlp_bias: attn's holds zeros
      out["head"]["linear"]["bias"] = w("output.bias", (N,)) if "output.bias" in w.arrays \
          else np.zeros(N, np.float32)
  return out


def _flat(tree: dict[str, Any], prefix: tuple = ()) -> dict[tuple, Any]:
  out = {}
  for k, v in tree.items():
    out |= _flat(v, prefix + (k,)) if isinstance(v, dict) else {prefix + (k,): v}
  return out


def _unflat(flat: dict[tuple, Any]) -> dict[str, Any]:
  out: dict = {}
  for key, a in flat.items():
    node = out
    for k in key[:-1]:
      node = node.setdefault(k, {})
    node[key[-1]] = a
  return out


def build(kind: str, cfg: ModelConfig, pure: dict[str, Any]) -> nnx.Module:
  """The attn model of `kind` holding exactly the arrays of `pure` (shapes checked, nothing random)."""
  abstract = nnx.eval_shape(lambda: MODELS[kind](cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  want, got = _flat(nnx.to_pure_dict(state)), _flat(pure)
  if set(want) != set(got):
    raise invalid("checkpoint", sorted(set(want) ^ set(got))[:4], f"the parameters of {kind}")
  for key, a in got.items():
    if tuple(a.shape) != tuple(want[key].shape):
      raise invalid(f"checkpoint {'.'.join(map(str, key))}.shape", tuple(a.shape),
                    f"{tuple(want[key].shape)} from config.json")
  nnx.replace_by_pure_dict(state, _unflat({k: jnp.asarray(a) for k, a in got.items()}))
  return nnx.merge(graphdef, state)


def convert_model(model: nnx.Module, cfg: ModelConfig, variant: str, num_kv_heads: int | None = None,
                  latent_dim: int | None = None) -> tuple[nnx.Module, ModelConfig, list[float]]:
  """The same model in another variant and/or with fewer kv heads; (model, cfg, per-layer error).

  Each layer's attention goes through attn.convert: exact conversions give
  error 0; mean-pooled kv heads (Ainslie et al. 2023) give the relative
  Frobenius error of the key/value weights they discard. Only parameters are read, so
  a model that has decoded converts too; the converted one starts without KV caches.
  """
  dst_cfg = cfg.replace(variant=variant, num_kv_heads=cfg.num_kv_heads if num_kv_heads is None else num_kv_heads,
                        latent_dim=cfg.latent_dim if latent_dim is None else latent_dim)
  # The KV caches that init_cache or generate leave in a model hold the source's layout (its
  # kv heads, its variant's entries): build would take them for parameters and refuse them.
  pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  blocks = pure["blocks"] if "blocks" in pure else pure["encoder"]["blocks"]
  errors = []
  with warnings.catch_warnings():  # one warning for the model below, not one per layer
    warnings.simplefilter("ignore", LossyConversionWarning)
    for l in sorted(blocks):
      # latent_dim is mla's alone: the source carries the target's, as attn.convert wants.
      params, err = convert(blocks[l]["attn"]["params"], cfg.variant, variant,
                            cfg.head.replace(latent_dim=dst_cfg.head.latent_dim),
                            dst_cfg=dst_cfg.head, return_error=True)
      blocks[l]["attn"]["params"] = dict(params)
      errors.append(float(err))
  if max(errors, default=0.0) > TOLERANCE:
    warnings.warn(f"{cfg.variant} -> {variant} with {dst_cfg.head.num_kv_heads} kv heads is lossy: relative "
                  f"error up to {max(errors):.3g} (layer {int(np.argmax(errors))})", LossyConversionWarning,
                  stacklevel=2)
  kind = next(k for k, cls in MODELS.items() if type(model) is cls)
  return build(kind, dst_cfg, pure), dst_cfg, errors


def from_hf(source: Any, variant: str = "per_head", num_kv_heads: int | None = None,
            latent_dim: int | None = None):
  """(model, model_config) from a HF object or local directory; + the error with num_kv_heads.

  variant="mla" with latent_dim=d_c converts every layer's heads to latent attention as
  TransMLA and MHA2MLA do (attn.convert: a truncated SVD of [W_K | W_V] per layer, exact when
  d_c ≥ min(D, G·(d_k + d_v))) and returns (model, model_config, [each layer's relative error]).
  """
  is_dir = isinstance(source, (str, os.PathLike))
  hf, weights = (read_config(source), None) if is_dir else _read_object(source)
  cfg = model_config(hf, "per_head")
  if latent_dim is not None and variant != "mla":
    raise invalid("latent_dim", latent_dim, 'None unless variant="mla" (the latent width d_c of mla)')
  dst = model_config(hf, variant, num_kv_heads)  # a bad variant or G is refused before any weights are read
  if latent_dim is not None:
    dst.replace(latent_dim=latent_dim)  # a bad d_c, or RoPE over the whole head, refused here
  weights = read_weights(source) if is_dir else weights
  kind = SUPPORTED[hf["model_type"]]
  if hf["model_type"] in FAMILIES:
    w = _Weights(_family_keys(weights))
    pure = _family_pure(w, cfg, hf["model_type"])
  elif kind == "encoder":
    w = _Weights(weights)
    cfg = cfg.replace(pooler=any(k.startswith("pooler.") for k in w.arrays),
                      mlm_head=any(k.startswith("cls.predictions.") for k in w.arrays))
    pure = _bert_pure(w, cfg)
  else:
    w = _Weights(weights)
    pure = _gpt2_pure(w, cfg)
  if w.unused():
    raise invalid("checkpoint", w.unused()[:4], f"only the tensors of a plain {hf['model_type']} model")
  model = build(kind, cfg, pure)
  if variant == "per_head" and num_kv_heads in (None, cfg.num_kv_heads):
    return (model, cfg) if num_kv_heads is None else (model, cfg, 0.0)
  model, cfg, errors = convert_model(model, cfg, variant, num_kv_heads, latent_dim)
  if latent_dim is not None:
    return model, cfg, errors
  return (model, cfg) if num_kv_heads is None else (model, cfg, max(errors))


def lengths_from_attention_mask(attention_mask: Any) -> np.ndarray:
  """(B,) lengths of a right-padded HF attention_mask (B,T) of ones then zeros; others refused."""
  m = np.asarray(attention_mask)
  if m.ndim != 2:
    raise invalid("attention_mask.shape", m.shape, "(B, T)")
  lengths = m.astype(bool).sum(-1)
  if not (m.astype(bool) == (np.arange(m.shape[1]) < lengths[:, None])).all():
    raise invalid("attention_mask", "not right-padded",
                  "ones then zeros in every row (right padding); attn cannot express left padding")
  return lengths.astype(np.int32)


# ---- saving: a DecoderLM as a transformers GPT2LMHeadModel (needs torch).

_GPT2_FIELDS = {"positional": "learned", "norm": "pre", "final_norm": True, "use_bias": True,
                "layernorm": True, "tie_embeddings": True, "num_segments": 0}
# Fields to_hf maps itself or that a DecoderLM ignores; any other must keep its default.
# A variant's own widths (collab_width, latent_dim, q_latent_dim) are gone once its heads are
# converted to per_head on the way out, so they are mapped: that conversion refuses what it can't.
_MAPPED = {"vocab_size", "d_model", "num_layers", "num_heads", "d_ff", "d_k", "d_v", "num_kv_heads",
           "collab_width", "latent_dim", "q_latent_dim", "variant", "max_len", "activation", "embed_init_std", "norm_eps",
           "pooling", "share_src_tgt_embeddings", *_GPT2_FIELDS}


def _check_gpt2(model: Any, cfg: ModelConfig) -> None:
  if not isinstance(model, DecoderLM) or not isinstance(cfg, ModelConfig):
    raise invalid("model", type(model).__name__, "an attn.nn.DecoderLM and its ModelConfig")
  for name, want in _GPT2_FIELDS.items():
    if getattr(cfg, name) != want:
      raise invalid(name, getattr(cfg, name), f"{want!r}: GPT-2 has it so")
  for f in dataclasses.fields(ModelConfig):
    if f.name not in _MAPPED and getattr(cfg, f.name) != f.default:
      raise invalid(f.name, getattr(cfg, f.name), f"{f.default!r}: GPT-2 has no such setting")
  D, H = cfg.d_model, cfg.num_heads
  if cfg.head.d_k * H != D or cfg.head.d_v * H != D:
    raise invalid("d_k, d_v", (cfg.head.d_k, cfg.head.d_v), f"d_model / num_heads = {D / H:g}: "
                  "GPT-2's heads are D/H wide")


def _load(hf: Any, sd: dict[str, Any], name: str) -> Any:
  """hf with the arrays of sd (float32), every parameter set and nothing left over; eval mode."""
  torch, transformers = require("torch"), require("transformers")
  tensors = {k: torch.from_numpy(np.array(v, np.float32)) for k, v in sd.items()}
  missing, unexpected = hf.load_state_dict(tensors, strict=False)
  tied = set(getattr(hf, "_tied_weights_keys", None) or {})
  left = [k for k in missing if not k.endswith((".attn.bias", ".attn.masked_bias")) and k not in tied]
  if left or unexpected:  # a transformers release whose names differ from these
    raise invalid(f"transformers.{name}", transformers.__version__,
                  f"a release with the usual parameter names (missing {left}, unexpected {unexpected})")
  return hf.eval()


def _check_fields(cfg: ModelConfig, family: str, wanted: dict[str, Any], mapped: set[str]) -> None:
  """Refuses a field the HF family cannot hold: `wanted` values, and defaults outside `mapped`."""
  for name, want in wanted.items():
    if getattr(cfg, name) != want:
      raise invalid(name, getattr(cfg, name), f"{want!r}: {family} has it so")
  for f in dataclasses.fields(ModelConfig):
    if f.name not in mapped and f.name not in wanted and getattr(cfg, f.name) != f.default:
      raise invalid(f.name, getattr(cfg, f.name), f"{f.default!r}: {family} has no such setting")


_FAMILY_MAPPED = {"vocab_size", "d_model", "num_layers", "num_heads", "d_ff", "d_k", "d_v", "num_kv_heads",
                  "collab_width", "latent_dim", "variant", "max_len", "activation", "embed_init_std", "norm_eps",
                  "pooling", "share_src_tgt_embeddings", "rope_theta", "rope_dim", "rope_scaling", "rope_factor",
                  "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_len", "tie_embeddings",
                  "use_bias", "dense_bias", "qk_norm_eps", "window", "global_every", "q_rank", "kv_rank", "dtype",
                  "param_dtype"}


def _zero(a: Any, name: str, family: str) -> None:
  if np.any(np.asarray(a) != 0):
    raise invalid(name, "nonzero", f"zeros: {family} has no such bias")


def _family_to_hf(model: DecoderLM, cfg: ModelConfig, kind: str):
  """A transformers <Family>ForCausalLM with the same weights as a DecoderLM of FAMILIES[kind]."""
  require("torch")  # transformers' models hold torch tensors
  transformers = require("transformers")
  fam = FAMILIES[kind]
  wanted = {"positional": "rope", "norm": fam["norm"], "norm_type": fam["norm_type"], "mlp": "gated",
            "final_norm": True, "layernorm": True, "num_segments": 0, "embed_norm": False,
            "embed_scale": bool(fam.get("embed_scale")), "qk_norm": bool(fam.get("qk_norm"))}
  mapped = set(_FAMILY_MAPPED) | ({"scale", "softcap", "logit_softcap"} if kind == "gemma2" else set())
  _check_fields(cfg, kind, wanted, mapped)
  D, H, G, K, L = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head.d_k, cfg.num_layers
  if cfg.head.d_v != K or cfg.rope_dim != K:
    raise invalid("d_v, rope_dim", (cfg.head.d_v, cfg.rope_dim), f"d_k={K}: {kind} rotates whole heads of one width")
  if cfg.qk_norm and cfg.qk_norm_eps != cfg.norm_eps:
    raise invalid("qk_norm_eps", cfg.qk_norm_eps, f"norm_eps={cfg.norm_eps}: {kind} has one rms_norm_eps")
  for name, ok in (("qkv", fam["qkv_bias"]), ("o", fam["o_bias"]), ("mlp", fam["mlp_bias"])):
    on = cfg.use_bias if name != "mlp" else cfg.has_dense_bias
    if on and ok is False and name != "o":
      raise invalid("use_bias" if name != "mlp" else "dense_bias", True, f"False: {kind} has no {name} biases")
  types = ["full_attention" if cfg.layer_head(i).window is None else "sliding_attention" for i in range(L)]
  if "sliding_attention" in types and kind not in ("mistral", "gemma2"):
    raise invalid("window", cfg.window, "None: attn maps windows onto mistral and gemma2 only")
  if kind == "mistral" and cfg.global_every:
    raise invalid("global_every", cfg.global_every, "0: mistral's window is in every layer")
  per_head = cfg.head
  pure = nnx.to_pure_dict(nnx.state(model))
  sd = {"model.embed_tokens.weight": pure["embed"]["token"], "model.norm.weight": pure["final_norm"]["scale"]}
  sd["lm_head.weight"] = pure["embed"]["token"] if cfg.tie_embeddings else np.asarray(pure["head"]["linear"]["kernel"]).T
  if not cfg.tie_embeddings and cfg.has_dense_bias:
    _zero(pure["head"]["linear"]["bias"], "output bias", kind)
  o_bias = cfg.use_bias and _flag({"attention_bias": True}, fam["o_bias"])
  for l, block in pure["blocks"].items():
    p = convert(block["attn"]["params"], cfg.variant, "per_head", cfg.head, dst_cfg=per_head)
    a = f"model.layers.{l}.self_attn"
    sd |= {f"{a}.q_proj.weight": p["w_q"].reshape(D, H * K).T, f"{a}.k_proj.weight": p["w_k"].reshape(D, G * K).T,
           f"{a}.v_proj.weight": p["w_v"].reshape(D, G * K).T, f"{a}.o_proj.weight": p["w_o"].reshape(H * K, D).T}
    if cfg.use_bias:
      sd |= {f"{a}.{n}_proj.bias": p[f"b_{n}"].ravel() for n in ("q", "k", "v")}
      if o_bias:
        sd[f"{a}.o_proj.bias"] = p["b_o"]
      else:
        _zero(p["b_o"], f"blocks.{l}.attn b_o", kind)
    if cfg.qk_norm:
      sd |= {f"{a}.q_norm.weight": p["q_norm"], f"{a}.k_norm.weight": p["k_norm"]}
    for n in ("gate", "up", "down"):
      sd[f"model.layers.{l}.mlp.{n}_proj.weight"] = np.asarray(block["mlp"][n]["kernel"]).T
      if cfg.has_dense_bias:
        sd[f"model.layers.{l}.mlp.{n}_proj.bias"] = block["mlp"][n]["bias"]
    sd |= {f"model.layers.{l}.{theirs}.weight": block[ours]["scale"] for ours, theirs in fam["norms"].items()}
  act = {v: k for k, v in _ACTIVATIONS.items() if k in ("silu", "gelu_pytorch_tanh", "gelu", "relu")}
  kw = dict(vocab_size=cfg.vocab_size, hidden_size=D, intermediate_size=cfg.d_ff, num_hidden_layers=L,
            num_attention_heads=H, num_key_value_heads=G, head_dim=K, max_position_embeddings=cfg.max_len,
            rms_norm_eps=cfg.norm_eps, **rope_to_hf(cfg),
            tie_word_embeddings=cfg.tie_embeddings, attention_dropout=0.0, pad_token_id=None,
            bos_token_id=None, eos_token_id=None)
  kw["hidden_activation" if kind == "gemma2" else "hidden_act"] = act[cfg.activation]
  if kind == "llama":
    kw |= dict(attention_bias=cfg.use_bias, mlp_bias=cfg.has_dense_bias)
  elif kind in ("qwen3", "gemma2"):
    kw |= dict(attention_bias=cfg.use_bias)
  if kind == "mistral":
    kw |= dict(sliding_window=cfg.window)
  if kind == "gemma2":
    scalar = K if cfg.scale is None else 1.0 / cfg.scale ** 2
    kw |= dict(sliding_window=cfg.window or cfg.max_len, layer_types=types,
               query_pre_attn_scalar=round(scalar) if abs(scalar - round(scalar)) < 1e-6 else scalar,
               attn_logit_softcapping=cfg.softcap, final_logit_softcapping=cfg.logit_softcap)
  names = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "gemma2": "Gemma2"}
  hf_cfg = getattr(transformers, f"{names[kind]}Config")(**kw)
  hf_cfg._attn_implementation = "eager"  # Gemma 2's soft-cap needs it; exact for the others
  cls = f"{names[kind]}ForCausalLM"
  return _load(getattr(transformers, cls)(hf_cfg), sd, cls)


_BERT_FIELDS = {"positional": "learned", "norm": "post", "final_norm": False, "use_bias": True,
                "layernorm": True, "embed_norm": True, "norm_type": "layernorm", "mlp": "plain",
                "tie_embeddings": True}


def _bert_to_hf(model: Encoder, cfg: ModelConfig):
  """A transformers BertModel (BertForMaskedLM with cfg.mlm_head) holding the Encoder's weights."""
  require("torch")  # transformers' models hold torch tensors
  transformers = require("transformers")
  _check_fields(cfg, "bert", _BERT_FIELDS, set(_MAPPED) | {"num_segments", "pooler", "mlm_head"})
  D, H = cfg.d_model, cfg.num_heads
  if cfg.head.d_k * H != D or cfg.head.d_v * H != D:
    raise invalid("d_k, d_v", (cfg.head.d_k, cfg.head.d_v), f"d_model / num_heads = {D / H:g}: BERT's heads "
                  "are D/H wide")
  if cfg.mlm_head and cfg.pooler:
    raise invalid("pooler", True, "False with mlm_head: BertForMaskedLM has no pooler")
  per_head = dataclasses.replace(cfg.head, num_kv_heads=H)
  pure = nnx.to_pure_dict(nnx.state(model))
  pre = "bert." if cfg.mlm_head else ""
  ln = lambda n, t: {f"{n}.weight": t["scale"], f"{n}.bias": t["bias"]}
  lin = lambda n, t: {f"{n}.weight": np.asarray(t["kernel"]).T, f"{n}.bias": t["bias"]}
  e = f"{pre}embeddings"
  sd = {f"{e}.word_embeddings.weight": pure["embed"]["token"],
        f"{e}.position_embeddings.weight": pure["embed"]["position"], **ln(f"{e}.LayerNorm", pure["embed"]["norm"])}
  if cfg.num_segments:
    sd[f"{e}.token_type_embeddings.weight"] = pure["embed"]["segment"]
  for l, block in pure["blocks"].items():
    p = convert(block["attn"]["params"], cfg.variant, "per_head", cfg.head, dst_cfg=per_head)
    b = f"{pre}encoder.layer.{l}"
    for n, full in (("q", "query"), ("k", "key"), ("v", "value")):
      sd |= {f"{b}.attention.self.{full}.weight": p[f"w_{n}"].reshape(D, D).T,
             f"{b}.attention.self.{full}.bias": p[f"b_{n}"].ravel()}
    sd |= {f"{b}.attention.output.dense.weight": p["w_o"].reshape(D, D).T, f"{b}.attention.output.dense.bias": p["b_o"],
           **ln(f"{b}.attention.output.LayerNorm", block["attn_norm"]), **lin(f"{b}.intermediate.dense", block["mlp"]["up"]),
           **lin(f"{b}.output.dense", block["mlp"]["down"]), **ln(f"{b}.output.LayerNorm", block["mlp_norm"])}
  if cfg.pooler:
    sd |= lin("pooler.dense", pure["pooler"])
  if cfg.mlm_head:
    c = "cls.predictions"
    sd |= {**lin(f"{c}.transform.dense", pure["mlm"]["transform"]), **ln(f"{c}.transform.LayerNorm", pure["mlm"]["norm"]),
           f"{c}.bias": pure["mlm"]["bias"], f"{c}.decoder.weight": pure["embed"]["token"],
           f"{c}.decoder.bias": pure["mlm"]["bias"]}
  hf_cfg = transformers.BertConfig(
      vocab_size=cfg.vocab_size, hidden_size=D, num_hidden_layers=cfg.num_layers, num_attention_heads=H,
      intermediate_size=cfg.d_ff, hidden_act=_TO_HF_ACTIVATION[cfg.activation], max_position_embeddings=cfg.max_len,
      type_vocab_size=cfg.num_segments, layer_norm_eps=cfg.norm_eps, hidden_dropout_prob=0.0,
      attention_probs_dropout_prob=0.0, pad_token_id=0)
  hf_cfg._attn_implementation = "eager"
  if cfg.mlm_head:
    return _load(transformers.BertForMaskedLM(hf_cfg), sd, "BertForMaskedLM")
  return _load(transformers.BertModel(hf_cfg, add_pooling_layer=cfg.pooler), sd, "BertModel")


def to_hf(model: DecoderLM | Encoder, model_config: ModelConfig, model_type: str | None = None):
  """A transformers model (eval mode, no dropout) with the same weights and outputs as `model`.

  An Encoder gives a BertModel (BertForMaskedLM with mlm_head); a DecoderLM a
  GPT2LMHeadModel, or with model_type one of FAMILIES that family's ForCausalLM.
  """
  if isinstance(model, Encoder) and isinstance(model_config, ModelConfig) and model_type in (None, "bert"):
    return _bert_to_hf(model, model_config)
  if model_type is None and isinstance(model_config, ModelConfig) and model_config.positional == "rope":
    raise invalid("model_type", None, f"one of {sorted(FAMILIES)}: a DecoderLM with RoPE is not GPT-2")
  if model_type in FAMILIES:
    if not isinstance(model, DecoderLM) or not isinstance(model_config, ModelConfig):
      raise invalid("model", type(model).__name__, "an attn.nn.DecoderLM and its ModelConfig")
    return _family_to_hf(model, model_config, model_type)
  if model_type not in (None, "gpt2"):
    raise invalid("model_type", model_type, f"one of {sorted(SUPPORTED)}")
  return _gpt2_to_hf(model, model_config)


def _gpt2_to_hf(model: DecoderLM, model_config: ModelConfig):
  """A transformers GPT2LMHeadModel (eval mode, no dropout) with the same logits as `model`."""
  _check_gpt2(model, model_config)
  torch, transformers = require("torch"), require("transformers")
  cfg = model_config
  D, H = cfg.d_model, cfg.num_heads
  per_head = cfg.head if cfg.head.num_kv_heads == H else dataclasses.replace(cfg.head, num_kv_heads=H)
  pure = nnx.to_pure_dict(nnx.state(model))
  sd = {"transformer.wte.weight": pure["embed"]["token"], "transformer.wpe.weight": pure["embed"]["position"],
        "transformer.ln_f.weight": pure["final_norm"]["scale"],
        "transformer.ln_f.bias": pure["final_norm"]["bias"], "lm_head.weight": pure["embed"]["token"]}
  for l, block in pure["blocks"].items():
    p = convert(block["attn"]["params"], cfg.variant, "per_head", cfg.head, dst_cfg=per_head)
    h = f"transformer.h.{l}"
    sd |= {f"{h}.attn.c_attn.weight": jnp.concatenate([p[n].reshape(D, D) for n in ("w_q", "w_k", "w_v")], 1),
           f"{h}.attn.c_attn.bias": jnp.concatenate([p[n].ravel() for n in ("b_q", "b_k", "b_v")]),
           f"{h}.attn.c_proj.weight": p["w_o"].reshape(D, D), f"{h}.attn.c_proj.bias": p["b_o"],
           f"{h}.ln_1.weight": block["attn_norm"]["scale"], f"{h}.ln_1.bias": block["attn_norm"]["bias"],
           f"{h}.ln_2.weight": block["mlp_norm"]["scale"], f"{h}.ln_2.bias": block["mlp_norm"]["bias"],
           f"{h}.mlp.c_fc.weight": block["mlp"]["up"]["kernel"], f"{h}.mlp.c_fc.bias": block["mlp"]["up"]["bias"],
           f"{h}.mlp.c_proj.weight": block["mlp"]["down"]["kernel"],
           f"{h}.mlp.c_proj.bias": block["mlp"]["down"]["bias"]}
  hf_cfg = transformers.GPT2Config(
      vocab_size=cfg.vocab_size, n_positions=cfg.max_len, n_embd=D, n_layer=cfg.num_layers, n_head=H,
      n_inner=cfg.d_ff, activation_function=_TO_HF_ACTIVATION[cfg.activation],
      layer_norm_epsilon=cfg.norm_eps, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
      tie_word_embeddings=True, bos_token_id=None, eos_token_id=None)
  hf = transformers.GPT2LMHeadModel(hf_cfg)
  tensors = {k: torch.from_numpy(np.array(v, np.float32)) for k, v in sd.items()}
  missing, unexpected = hf.load_state_dict(tensors, strict=False)
  left = [k for k in missing if not k.endswith((".attn.bias", ".attn.masked_bias"))]
  if left or unexpected:  # a transformers release whose GPT-2 names differ from these
    raise invalid("transformers.GPT2LMHeadModel", transformers.__version__,
                  f"a release with GPT-2's usual parameter names (missing {left}, unexpected {unexpected})")
  return hf.eval()
