"""Gemma 4's text model (model_type gemma4_text, Gemma4ForCausalLM): two head layouts in one model.

Sliding layers: per_head heads of head_dim with num_key_value_heads, RoPE over the whole head at
the sliding base. Full layers: heads of global_head_dim; with attention_k_eq_v, keys equal to values
(attn's k_eq_v, w_kv from k_proj; there is no v_proj) and num_global_key_value_heads kv heads.
Every layer: QK-norm (x̂·w, per head), a weightless value norm (attn's value_norm_eps), score scale
1, sandwich norms, a gated MLP, and each block's output times its stored layer_scalar. The last
num_kv_shared_layers layers read the keys and values of the last earlier layer of their type
(ModelConfig.kv_source, kv_sharing.last_layers) and hold no k_proj, v_proj or k_norm; with
use_double_wide_mlp their MLPs are 2·intermediate_size wide. Per-layer input embeddings
(hidden_size_per_layer_input P > 0) are ModelConfig.per_layer_dim (attn.nn.models.PerLayerInputs).

Proportional RoPE (the full layers' rope_type "proportional", partial_rotary_factor p): the pairs
(i, i + K/2) for i < r/2 rotate at θ^(-2i/K), r = 2·⌊p·K/2⌋, the rest not at all. attn's partial
RoPE rotates its first r dims in pairs (i, i + r/2) at θ'^(-2i/r), so with θ' = θ^(r/K) it is the
same rotation after one permutation of each head's K dims (PERM), applied to q_proj's and k_proj's
rows and the q/k-norm scales (and, for k_eq_v, whose values are the keys, to o_proj's columns):
scores and outputs are unchanged, and to_hf undoes it bit for bit.

Refused by name before any weight is read: the mixture-of-experts block (enable_moe_block), biases,
bidirectional attention ("all"; "vision", which the text model ignores, is read and ignored with a
note), RoPE types other than default/proportional or a RoPE factor. The vision and audio towers are
Gemma4ForConditionalGeneration's (model_type gemma4, refused with that reason), not this family's.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from attn.config import invalid
from attn.nn import kv_sharing
from attn.nn.config import ModelConfig
from attn.nn.hf.base import Family, Weights, activation, activation_out, get

_TYPES = ("sliding_attention", "full_attention")


def _layer_types(hf: dict[str, Any], L: int) -> list[str]:
  """config.json's layer_types, or transformers' default (every 6th full); the last layer full,
  as transformers forces it (with a note when the config says otherwise)."""
  types = list(hf.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention"
                                          for i in range(L)])
  if len(types) != L or set(types) - set(_TYPES):
    raise invalid("config.layer_types", types, f"{L} of {list(_TYPES)}")
  if types[-1] != "full_attention":
    warnings.warn("gemma4_text: the last layer is full_attention, as transformers forces it", stacklevel=3)
    types[-1] = "full_attention"
  return types


def _rope(hf: dict[str, Any], kind: str, K: int) -> tuple[int, float]:
  """(rotated width r, attn's base θ') of layer type `kind`'s RoPE (module docstring)."""
  params = (hf.get("rope_parameters") or {}).get(kind)
  defaults = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
              "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                 "rope_theta": 1_000_000.0}}
  params = params if params is not None else defaults[kind]
  where = f"config.rope_parameters.{kind}"
  kind_ = params.get("rope_type", "default")
  if kind_ not in ("default", "proportional"):
    raise invalid(f"{where}.rope_type", kind_, "'default' or 'proportional': the RoPE Gemma 4 uses")
  if params.get("factor", 1.0) != 1.0:
    raise invalid(f"{where}.factor", params["factor"], "1.0: attn's Gemma 4 reads unscaled RoPE")
  theta = float(params.get("rope_theta", defaults[kind]["rope_theta"]))
  if kind_ == "default":  # transformers' default for a layer type rotates the whole head
    return K, theta
  r = 2 * int(float(params.get("partial_rotary_factor", 1.0)) * K // 2)
  return r, theta ** (r / K) if r else theta


def perm(K: int, r: int) -> np.ndarray:
  """attn's dim j of a head is transformers' dim perm[j]: HF's rotated pairs (i, K/2 + i), i < r/2,
  first as attn's (i, r/2 + i), then the dims that do not rotate, in order."""
  h = r // 2
  return np.concatenate([np.arange(h), K // 2 + np.arange(h), np.arange(h, K // 2),
                         np.arange(K // 2 + h, K)]).astype(np.int64)


def _global_heads(hf: dict[str, Any], types: list[str], G: int, keqv: bool) -> tuple[int, int]:
  """(head width, kv heads) of the full layers: transformers 5's per_layer_config (what it saves), or
  the global_head_dim and num_global_key_value_heads it is built from (the kv heads only with k_eq_v)."""
  per_layer = hf.get("per_layer_config")
  if per_layer is None:
    return int(hf.get("global_head_dim") or 512), int(hf.get("num_global_key_value_heads") or G) if keqv else G
  rows = {int(k): dict(v) for k, v in dict(per_layer).items()}
  full = [i for i, t in enumerate(types) if t == "full_attention"]
  first = rows.get(full[0], {})
  for i in range(len(types)):
    row = rows.get(i, {})
    if set(row) - {"head_dim", "num_key_value_heads"} or row != (first if i in full else {}):
      raise invalid(f"config.per_layer_config[{i}]", row, f"{first if i in full else {}}: attn reads one head "
                    "width and kv-head count for all full_attention layers (head_dim, num_key_value_heads) and "
                    "none for the sliding ones")
  return int(first.get("head_dim", hf.get("head_dim") or 256)), int(first.get("num_key_value_heads", G))


def config_in(hf: dict[str, Any]) -> ModelConfig:
  if hf.get("use_bidirectional_attention") == "vision":
    warnings.warn("gemma4_text: use_bidirectional_attention='vision' read and ignored, as transformers' text "
                  "model ignores it (it makes image tokens attend both ways; text stays causal)", stacklevel=3)
  D, H, L = get(hf, "hidden_size"), get(hf, "num_attention_heads"), get(hf, "num_hidden_layers")
  K, G = int(hf.get("head_dim") or 256), int(hf.get("num_key_value_heads") or H)
  keqv = bool(hf.get("attention_k_eq_v", False))
  types = _layer_types(hf, L)
  Kg, Gg = _global_heads(hf, types, G, keqv)
  for name, g in (("num_key_value_heads", G), ("num_global_key_value_heads", Gg)):
    if H % g:
      raise invalid(f"config.{name}", g, f"a divisor of num_attention_heads={H}")
  shared = int(hf.get("num_kv_shared_layers") or 0)
  kv_source = kv_sharing.last_layers(tuple(types), shared, "config.num_kv_shared_layers")
  sliding = "sliding_attention" in types
  r_local, theta_local = _rope(hf, "sliding_attention", K)
  r_full, theta_full = _rope(hf, "full_attention", Kg)
  if sliding and r_local != K:
    raise invalid("config.rope_parameters.sliding_attention", hf["rope_parameters"]["sliding_attention"],
                  "a RoPE over the whole head (rope_type 'default')")
  full = {"d_k": Kg, "d_v": Kg, "num_kv_heads": Gg, "rope_dim": r_full} | ({"variant": "k_eq_v"} if keqv else {})
  eps = float(hf.get("rms_norm_eps", 1e-6))
  P = int(hf.get("hidden_size_per_layer_input") or 0)
  per_vocab = int(hf.get("vocab_size_per_layer_input") or 0) if P else 0
  N = get(hf, "vocab_size")
  return ModelConfig(
      vocab_size=N, d_model=D, num_layers=L, num_heads=H, d_ff=get(hf, "intermediate_size"),
      d_k=K, d_v=K, num_kv_heads=G, variant="per_head", max_len=get(hf, "max_position_embeddings"),
      positional="rope", rope_dim=K, rope_theta=theta_full, sliding_rope_theta=theta_local if sliding else None,
      layer_types=tuple(types), layer_heads={"full_attention": full}, kv_source=kv_source,
      window=int(get(hf, "sliding_window")) if sliding else None,
      norm="sandwich", norm_type="rmsnorm", final_norm=True, mlp="gated",
      activation=activation(hf, "hidden_activation", "gelu_pytorch_tanh"),
      tie_embeddings=bool(hf.get("tie_word_embeddings", True)), use_bias=False, norm_eps=eps,
      qk_norm=True, qk_norm_eps=eps, value_norm_eps=eps, scale=1.0, embed_scale=True,
      logit_softcap=hf.get("final_logit_softcapping"), per_layer_dim=P,
      per_layer_vocab=0 if per_vocab in (0, N) else per_vocab, layer_scalar=True,
      double_wide_mlp=bool(hf.get("use_double_wide_mlp", False)) and kv_source is not None)


def _layer(cfg: ModelConfig, l: int) -> tuple[int, int, int, str, bool]:
  """(K, G, r, variant, shared) of layer l."""
  head = cfg.layer_head(l)
  return head.d_k, head.num_kv_heads, head.rope_dim, cfg.layer_variant(l), kv_sharing.source(cfg, l) != l


def weights_in(w: Weights, cfg: ModelConfig) -> dict[str, Any]:
  D, H, F, N, L, P = cfg.d_model, cfg.num_heads, cfg.d_ff, cfg.vocab_size, cfg.num_layers, cfg.per_layer_dim
  norm = lambda name, n=D: {"scale": w(f"{name}.weight", (n,))}  # noqa: E731
  blocks = {}
  for l in range(L):
    K, G, r, variant, shared = _layer(cfg, l)
    j, a = perm(K, r), f"layers.{l}.self_attn"
    heads = {"w_q": w(f"{a}.q_proj.weight", (H * K, D)).T.reshape(D, H, K)[..., j],
             "q_norm": w(f"{a}.q_norm.weight", (K,))[j],
             "w_o": w(f"{a}.o_proj.weight", (D, H * K)).T.reshape(H, K, D)}
    if variant == "k_eq_v":  # the values are the (permuted) keys: W^O's rows follow them
      heads["w_o"] = heads["w_o"][:, j]
    if not shared:
      k = w(f"{a}.k_proj.weight", (G * K, D)).T.reshape(D, G, K)[..., j]
      heads |= {"k_norm": w(f"{a}.k_norm.weight", (K,))[j]}
      heads |= {"w_kv": k} if variant == "k_eq_v" else {
          "w_k": k, "w_v": w(f"{a}.v_proj.weight", (G * K, D)).T.reshape(D, G, K)}
    Fl = 2 * F if cfg.double_wide_mlp and shared else F
    mlp = {n: {"kernel": w(f"layers.{l}.mlp.{n}_proj.weight", s).T}
           for n, s in (("gate", (Fl, D)), ("up", (Fl, D)), ("down", (D, Fl)))}
    blocks[l] = {"attn": {"params": heads}, "mlp": mlp, "attn_norm": norm(f"layers.{l}.input_layernorm"),
                 "attn_post_norm": norm(f"layers.{l}.post_attention_layernorm"),
                 "mlp_norm": norm(f"layers.{l}.pre_feedforward_layernorm"),
                 "mlp_post_norm": norm(f"layers.{l}.post_feedforward_layernorm"),
                 "scalar": w(f"layers.{l}.layer_scalar", (1,))}
    if P:
      blocks[l] |= {"per_layer_gate": {"kernel": w(f"layers.{l}.per_layer_input_gate.weight", (P, D)).T},
                    "per_layer_out": {"kernel": w(f"layers.{l}.per_layer_projection.weight", (D, P)).T},
                    "per_layer_norm": norm(f"layers.{l}.post_per_layer_input_norm")}
  out = {"embed": {"token": w("embed_tokens.weight", (N, D))}, "blocks": blocks, "final_norm": norm("norm")}
  if P:
    out["per_layer"] = {"token": w("embed_tokens_per_layer.weight", (cfg.per_layer_vocab or N, L * P)),
                        "proj": {"kernel": w("per_layer_model_projection.weight", (L * P, D)).T},
                        "norm": norm("per_layer_projection_norm", P)}
  if cfg.tie_embeddings:
    if "lm_head.weight" in w:  # a live model's state_dict lists the tied head too
      w("lm_head.weight", (N, D))
  else:
    out["head"] = {"linear": {"kernel": w("lm_head.weight", (N, D)).T}}
  return out


def weights_out(pure: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
  D, H, P = cfg.d_model, cfg.num_heads, cfg.per_layer_dim
  a_ = lambda x: np.asarray(x)  # noqa: E731
  sd = {"model.embed_tokens.weight": pure["embed"]["token"], "model.norm.weight": pure["final_norm"]["scale"]}
  sd["lm_head.weight"] = pure["embed"]["token"] if cfg.tie_embeddings else a_(pure["head"]["linear"]["kernel"]).T
  if P:
    p = pure["per_layer"]
    sd |= {"model.embed_tokens_per_layer.weight": p["token"],
           "model.per_layer_model_projection.weight": a_(p["proj"]["kernel"]).T,
           "model.per_layer_projection_norm.weight": p["norm"]["scale"]}
  for l, block in pure["blocks"].items():
    K, G, r, variant, shared = _layer(cfg, int(l))
    inv = np.argsort(perm(K, r))
    p, a = {k: a_(v) for k, v in block["attn"]["params"].items()}, f"model.layers.{l}.self_attn"
    w_o = p["w_o"][:, inv] if variant == "k_eq_v" else p["w_o"]
    sd |= {f"{a}.q_proj.weight": p["w_q"][..., inv].reshape(D, H * K).T, f"{a}.q_norm.weight": p["q_norm"][inv],
           f"{a}.o_proj.weight": w_o.reshape(H * K, D).T}
    if not shared:
      k = p["w_kv"] if variant == "k_eq_v" else p["w_k"]
      sd |= {f"{a}.k_proj.weight": k[..., inv].reshape(D, G * K).T, f"{a}.k_norm.weight": p["k_norm"][inv]}
      if variant != "k_eq_v":
        sd[f"{a}.v_proj.weight"] = p["w_v"].reshape(D, G * K).T
    b = f"model.layers.{l}"
    sd |= {f"{b}.mlp.{n}_proj.weight": a_(block["mlp"][n]["kernel"]).T for n in ("gate", "up", "down")}
    sd |= {f"{b}.{theirs}.weight": block[ours]["scale"] for ours, theirs in (
        ("attn_norm", "input_layernorm"), ("attn_post_norm", "post_attention_layernorm"),
        ("mlp_norm", "pre_feedforward_layernorm"), ("mlp_post_norm", "post_feedforward_layernorm"))}
    sd[f"{b}.layer_scalar"] = block["scalar"]
    if P:
      sd |= {f"{b}.per_layer_input_gate.weight": a_(block["per_layer_gate"]["kernel"]).T,
             f"{b}.per_layer_projection.weight": a_(block["per_layer_out"]["kernel"]).T,
             f"{b}.post_per_layer_input_norm.weight": block["per_layer_norm"]["scale"]}
  return sd


def check_out(cfg: ModelConfig) -> None:
  """What a Gemma 4 text config cannot hold, refused by name."""
  types = tuple(cfg.layer_types or ())
  if not types or set(types) - set(_TYPES) or types[-1] != "full_attention":
    raise invalid("layer_types", cfg.layer_types, f"a list of {list(_TYPES)} ending in full_attention")
  shared = kv_sharing.shared_layers(cfg, cfg.num_layers)
  if cfg.kv_source != kv_sharing.last_layers(types, shared, "kv_source"):
    raise invalid("kv_source", cfg.kv_source, f"{kv_sharing.last_layers(types, shared)}: Gemma 4's last "
                  "layers read the last earlier layer of their type (num_kv_shared_layers)")
  table = dict(cfg.layer_heads or {})
  if set(table) - {"full_attention"}:
    raise invalid("layer_heads", {k: dict(v) for k, v in table.items()}, "sizes for full_attention only: "
                  "the sliding layers' are the model's")
  full = dict(table.get("full_attention", {}))
  if full.get("variant", "per_head") not in ("per_head", "k_eq_v"):
    raise invalid("layer_heads.full_attention.variant", full["variant"], "'per_head' or 'k_eq_v'")
  i = types.index("full_attention")
  head = cfg.layer_head(i)
  if full.get("variant") != "k_eq_v" and head.num_kv_heads != cfg.num_kv_heads:
    raise invalid("layer_heads.full_attention.num_kv_heads", head.num_kv_heads, f"num_kv_heads={cfg.num_kv_heads} "
                  "without k_eq_v: Gemma 4 gives its global layers their own kv heads only with attention_k_eq_v")
  if head.d_v != head.d_k or cfg.head.d_v != cfg.head.d_k or cfg.rope_dim != cfg.head.d_k:
    raise invalid("d_v, rope_dim", (cfg.head.d_v, cfg.rope_dim), f"d_k={cfg.head.d_k}: Gemma 4's values are "
                  "as wide as its keys and its sliding layers rotate whole heads")
  for name in ("qk_norm_eps", "value_norm_eps"):
    if getattr(cfg, name) != cfg.norm_eps:
      raise invalid(name, getattr(cfg, name), f"norm_eps={cfg.norm_eps}: Gemma 4 has one rms_norm_eps")
  if "sliding_attention" in types and cfg.sliding_rope_theta is None:
    raise invalid("sliding_rope_theta", None, "a base for the sliding layers' RoPE")


def _factor(r: int, K: int) -> float:
  """A partial_rotary_factor that transformers turns back into r rotated dims (2·⌊p·K/2⌋ = r)."""
  p = r / K
  return p if 2 * int(p * K // 2) == r else (r + 0.5) / K


def config_out(cfg: ModelConfig) -> dict[str, Any]:
  types = list(cfg.layer_types)
  i = types.index("full_attention")
  head = cfg.layer_head(i)
  Kg, r = head.d_k, head.rope_dim
  full = ({"rope_type": "default", "rope_theta": cfg.rope_theta} if r == Kg else
          {"rope_type": "proportional", "partial_rotary_factor": _factor(r, Kg),
           "rope_theta": cfg.rope_theta ** (Kg / r) if r else cfg.rope_theta})
  local = cfg.rope_theta if cfg.sliding_rope_theta is None else cfg.sliding_rope_theta
  keqv = cfg.layer_variant(i) == "k_eq_v"
  return dict(
      architectures=["Gemma4ForCausalLM"], vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
      intermediate_size=cfg.d_ff, num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
      num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head.d_k, global_head_dim=Kg,
      num_global_key_value_heads=head.num_kv_heads if keqv else None, attention_k_eq_v=keqv,
      max_position_embeddings=cfg.max_len, rms_norm_eps=cfg.norm_eps,
      hidden_activation=activation_out(cfg, ("gelu_pytorch_tanh", "gelu", "silu", "relu")),
      tie_word_embeddings=cfg.tie_embeddings, attention_bias=False, sliding_window=cfg.window or cfg.max_len,
      layer_types=types, rope_parameters={"full_attention": full,
                                          "sliding_attention": {"rope_type": "default", "rope_theta": local}},
      final_logit_softcapping=cfg.logit_softcap, hidden_size_per_layer_input=cfg.per_layer_dim,
      vocab_size_per_layer_input=cfg.per_layer_vocab or cfg.vocab_size,
      num_kv_shared_layers=kv_sharing.shared_layers(cfg, cfg.num_layers), use_double_wide_mlp=cfg.double_wide_mlp,
      enable_moe_block=False, attention_dropout=0.0, pad_token_id=None, bos_token_id=None, eos_token_id=None)


GEMMA4 = Family(
    name="gemma4_text", model_types=("gemma4_text",), architectures=("Gemma4ForCausalLM",),
    config_in=config_in, weights_in=weights_in, weights_out=weights_out, config_out=config_out,
    prefix="model.",
    refusals={"enable_moe_block": ((False,), "attn does not run Gemma 4's parallel dense and expert MLPs"),
              "attention_bias": ((False,), "attn's Gemma 4 has no attention biases"),
              "use_bidirectional_attention": ((None, "vision"), "attn's DecoderLM is causal (\"vision\" acts on "
                                              "image tokens only, which the text model never sees)")},
    fixed={"positional": "rope", "norm": "sandwich", "norm_type": "rmsnorm", "mlp": "gated", "final_norm": True,
           "layernorm": True, "num_segments": 0, "embed_norm": False, "embed_scale": True, "qk_norm": True,
           "qk_norm_plus_one": False, "use_bias": False, "scale": 1.0, "layer_scalar": True},
    mapped=frozenset({"rope_theta", "rope_dim", "tie_embeddings", "window", "layer_types", "layer_heads",
                      "kv_source", "value_norm_eps", "qk_norm_eps", "logit_softcap", "sliding_rope_theta",
                      "per_layer_dim", "per_layer_vocab", "double_wide_mlp"}),
    check_out=check_out)
