"""Muse Spark (model_type muse_spark) as a DecoderLM: its text model, read from under text_config and
model.language_model.; the vision and audio towers are left out.

Attention is per_head with QK-norm without a learned scale, the queries times qk_scale_factor (attn's
qk_norm "fixed"), RoPE over whole heads where layer_rope_theta is not 0 (NoPE where it is: attn's
layer_rope_theta; transformers rotates every RoPE layer at rope_parameters' base and reads only whether
an entry is 0, so a nonzero entry is read as that base), sliding layers by layer_types (attn's window
sliding_window), each head's output RMS-normalised without a scale (o_norm: attn's output_norm_eps) then
gated elementwise by σ(x·W_g) (gate_proj: attn's gate "elementwise"), no biases. The block is a sandwich
of RMSNorms in Muse Spark's forms (attn.nn.norms): x̂·(1 + w) before each sublayer, a weightless norm after
the attention and an input-scaled one after the feed-forward (post_norm_eps), and each residual a gate
α⊙x + β⊙y (residual_gate_temperature: attn's residual_gate). The token embeddings go through a weightless
RMSNorm, the final norm is x̂·w, the logits are c·tanh(z·output_multiplier/c) (attn's logit_divisor
1/output_multiplier and logit_softcap c). The feed-forward is a SwiGLU where mlp_layer_types says "dense"
and experts where "sparse" (attn's moe_layer_types): a sigmoid router on x whose logits are times
output_multiplier (moe_router_scale), its correction bias moving the choice only, the kept weights
renormalised times routed_scaling_factor; the experts run at moe_hidden_size between pre_expert_proj
(with a x̂·(1 + w) norm) and post_expert_proj, each expert's output input-scale-normed (moe_pool_width).

to_hf writes MuseSparkForConditionalGeneration with the text model's tensors under the checkpoint's own
names; attn holds no tower, so the towers it writes are transformers' smallest (one layer, width 8) at
their initial values: placeholders that keep the class whole, not the release's. `attn count --hf` counts
the text model (model.language_model. and lm_head) and says it left the towers out. A text model saved
alone (muse_spark_text, MuseSparkTextModel) has no LM head in transformers and is refused by name
(attn.nn.hf.load.REFUSED). MuseSparkModel embeds the image, video and audio placeholder ids
(image_token_id, video_token_id, audio_token_id) as token 0 before writing the towers' features there;
attn's model embeds every id as itself, so the two agree on text that holds no placeholder (the towers'
inputs are what attn leaves out). transformers has Muse Spark from 5.25.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from attn.config import invalid
from attn.nn.hf.base import Family, Weights, activation, activation_out, get
from attn.nn.hf.rope import rope_from_hf, rope_to_hf
from attn.nn.config import ModelConfig

_TYPES = ("full_attention", "sliding_attention")
PREFIX = "model.language_model."
# What the wrapper holds beside its text model: attn reads none of it.
TOWERS = ("model.vision_tower.", "model.audio_tower.", "model.vision_adapter.", "model.vision_projection.")
NORM_FORMS = {"embed": "none", "attn_post": "none", "mlp_post": "input_scaled", "final": "scale"}


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
  """The text model's config: text_config of a muse_spark config.json."""
  text = hf.get("text_config")
  if not isinstance(text, dict):
    raise invalid("config.text_config", text, "the text model's config (a muse_spark config.json has one)")
  return text


def _every_fourth_from_last(L: int, first: Any, other: Any) -> list[Any]:
  """transformers' default schedules: `first` at every 4th layer counted back from the last, else `other`."""
  return [first if (L - 1 - i) % 4 == 0 else other for i in range(L)]


def config_in(hf: dict[str, Any]) -> ModelConfig:
  """The text model's DecoderLM; what attn cannot run is refused by name."""
  t = text_config(hf)
  D, H, L = get(t, "hidden_size"), get(t, "num_attention_heads"), get(t, "num_hidden_layers")
  K, G = get(t, "head_dim"), t.get("num_key_value_heads") or H
  if H % G:
    raise invalid("config.text_config.num_key_value_heads", G, f"a divisor of num_attention_heads={H}")
  for key in ("attention_bias", "tie_word_embeddings"):
    if t.get(key) or (key == "tie_word_embeddings" and hf.get(key)):
      raise invalid(f"config.text_config.{key}", True, "False: Muse Spark's text model has no attention biases "
                    "and an untied lm_head")
  types = list(t.get("layer_types") or _every_fourth_from_last(L, "full_attention", "sliding_attention"))
  if len(types) != L or set(types) - set(_TYPES):
    raise invalid("config.text_config.layer_types", types, f"{L} of 'full_attention' / 'sliding_attention'")
  sliding = "sliding_attention" in types
  if sliding and not t.get("sliding_window"):
    raise invalid("config.text_config.sliding_window", t.get("sliding_window"),
                  "a window: layer_types has sliding layers")
  if not (t.get("rope_parameters") or t.get("rope_scaling") or "rope_theta" in t):  # transformers' default
    t = {**t, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}
  rope = rope_from_hf(t)
  theta = rope.get("rope_theta", 500000.0)
  thetas = t.get("layer_rope_theta")
  thetas = _every_fourth_from_last(L, 0, theta) if thetas is None else thetas
  if not isinstance(thetas, list) or len(thetas) != L:
    raise invalid("config.text_config.layer_rope_theta", thetas, f"a list of {L} RoPE bases, one per layer (0: NoPE)")
  thetas = tuple(0.0 if not x else float(theta) for x in thetas)  # transformers reads only whether it is 0
  kinds = list(t.get("mlp_layer_types") or ["sparse"] * L)
  if len(kinds) != L or set(kinds) - {"dense", "sparse"}:
    raise invalid("config.text_config.mlp_layer_types", kinds, f"{L} of 'dense' / 'sparse'")
  eps, mult = float(t.get("rms_norm_eps", 1e-5)), t.get("output_multiplier", 0.1767766952966369)
  if isinstance(mult, bool) or not isinstance(mult, (int, float)) or not 0 < mult < float("inf"):
    raise invalid("config.text_config.output_multiplier", mult, "a positive finite number: the logits' and the "
                  "router's multiplier")
  mult = float(mult)
  cap = t.get("final_logit_softcapping", 20.0)  # transformers' default
  moe = {"mlp": "gated"}
  if "sparse" in kinds:
    moe = dict(mlp="moe", moe_experts=get(t, "num_local_experts"), moe_top_k=get(t, "num_experts_per_tok"),
               moe_d_ff=get(t, "moe_intermediate_size"), moe_router="sigmoid", moe_norm_topk=True,
               moe_routed_scaling=float(t.get("routed_scaling_factor", 1.0)), moe_layer_types=tuple(kinds),
               moe_pool_width=get(t, "moe_hidden_size"), moe_router_scale=mult)
  return ModelConfig(
      vocab_size=get(t, "vocab_size"), d_model=D, num_layers=L, num_heads=H, d_ff=get(t, "intermediate_size"),
      d_k=K, d_v=K, num_kv_heads=G, variant="per_head", max_len=get(t, "max_position_embeddings"),
      positional="rope", rope_dim=K, **rope, layer_rope_theta=thetas if 0.0 in thetas else None,
      layer_types=tuple(types), window=int(t["sliding_window"]) if sliding else None,
      norm="sandwich", norm_type="rmsnorm_plus_one", norm_eps=eps, embed_norm=True, final_norm=True,
      norm_forms=NORM_FORMS, post_norm_eps=float(t.get("post_norm_eps", 1e-8)),
      residual_gate=float(t.get("residual_gate_temperature", 0.3)),
      activation=activation(t, "hidden_act", "silu"), tie_embeddings=False, use_bias=False, dense_bias=False,
      qk_norm="fixed", qk_norm_eps=eps, qk_scale_factor=float(t.get("qk_scale_factor", 5.4730064863875)),
      output_norm_eps=eps, gate="elementwise", logit_softcap=float(cap), logit_divisor=1.0 / mult, **moe)


def _linear(w: Weights, name: str, rows: int, cols: int) -> np.ndarray:
  """A torch Linear's (out, in) weight as (in, out)."""
  return w(f"{name}.weight", (rows, cols)).T


def _experts_in(w: Weights, m: str, cfg: ModelConfig) -> dict[str, Any]:
  D, E, F, M = cfg.d_model, cfg.moe_experts, cfg.moe_d_ff, cfg.moe_pool_width
  gate_up = w(f"{m}.experts.gate_up_proj", (E, 2 * F, M))
  return {"router_w": _linear(w, f"{m}.gate", E, D), "correction": w(f"{m}.gate.e_score_correction_bias", (E,)),
          "pool_in": _linear(w, f"{m}.pre_expert_proj", M, D), "pool_norm": w(f"{m}.pre_expert_norm.weight", (M,)),
          "w_gate": gate_up[:, :F].transpose(0, 2, 1), "w_up": gate_up[:, F:].transpose(0, 2, 1),
          "w_down": w(f"{m}.experts.down_proj", (E, M, F)).transpose(0, 2, 1),
          "expert_norm": w(f"{m}.experts.post_expert_norm.weight", (M,)),
          "pool_out": _linear(w, f"{m}.post_expert_proj", D, M)}


def weights_in(w: Weights, cfg: ModelConfig) -> dict[str, Any]:
  D, H, G, K, F, N = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head.d_k, cfg.d_ff, cfg.vocab_size
  blocks = {}
  for l in range(cfg.num_layers):
    at, a = f"layers.{l}", f"layers.{l}.self_attn"
    p = {"w_q": _linear(w, f"{a}.q_proj", H * K, D).reshape(D, H, K),
         "w_k": _linear(w, f"{a}.k_proj", G * K, D).reshape(D, G, K),
         "w_v": _linear(w, f"{a}.v_proj", G * K, D).reshape(D, G, K),
         "w_o": _linear(w, f"{a}.o_proj", D, H * K).reshape(H, K, D),
         "w_gate": _linear(w, f"{a}.gate_proj", H * K, D).reshape(D, H, K)}
    mlp = _experts_in(w, f"{at}.mlp", cfg) if cfg.is_moe_layer(l) else {
        n: {"kernel": _linear(w, f"{at}.mlp.{n}_proj", *shape)} for n, shape in (("gate", (F, D)), ("up", (F, D)),
                                                                                ("down", (D, F)))}
    blocks[l] = {"attn": {"params": p}, "mlp": mlp,
                 "attn_norm": {"scale": w(f"{at}.input_layernorm.weight", (D,))},
                 "mlp_norm": {"scale": w(f"{at}.pre_feedforward_layernorm.weight", (D,))},
                 "mlp_post_norm": {"scale": w(f"{at}.post_feedforward_layernorm.weight", (D,))},
                 "attn_residual_gate": w(f"{at}.post_attention_residual_gate.gate", (D,)),
                 "mlp_residual_gate": w(f"{at}.post_feedforward_residual_gate.gate", (D,))}
  return {"embed": {"token": w("embed_tokens.weight", (N, D))}, "blocks": blocks,
          "final_norm": {"scale": w("norm.weight", (D,))},
          "head": {"linear": {"kernel": w("lm_head.weight", (N, D)).T}}}


def weights_out(pure: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
  D, H, G, K = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head.d_k
  T = lambda a: np.asarray(a).T  # noqa: E731  (in, out) -> torch's (out, in)
  sd = {f"{PREFIX}embed_tokens.weight": pure["embed"]["token"], f"{PREFIX}norm.weight": pure["final_norm"]["scale"],
        "lm_head.weight": T(pure["head"]["linear"]["kernel"])}
  for l, block in pure["blocks"].items():
    at = f"{PREFIX}layers.{l}"
    a, p = f"{at}.self_attn", {k: np.asarray(v) for k, v in block["attn"]["params"].items()}
    sd |= {f"{a}.q_proj.weight": p["w_q"].reshape(D, H * K).T, f"{a}.k_proj.weight": p["w_k"].reshape(D, G * K).T,
           f"{a}.v_proj.weight": p["w_v"].reshape(D, G * K).T, f"{a}.o_proj.weight": p["w_o"].reshape(H * K, D).T,
           f"{a}.gate_proj.weight": p["w_gate"].reshape(D, H * K).T}
    e, m = block["mlp"], f"{at}.mlp"
    if cfg.is_moe_layer(int(l)):
      gate, up, down = (np.asarray(e[f"w_{n}"]) for n in ("gate", "up", "down"))
      sd |= {f"{m}.gate.weight": T(e["router_w"]), f"{m}.gate.e_score_correction_bias": e["correction"],
             f"{m}.pre_expert_proj.weight": T(e["pool_in"]), f"{m}.pre_expert_norm.weight": e["pool_norm"],
             f"{m}.experts.gate_up_proj": np.concatenate([gate, up], -1).transpose(0, 2, 1),
             f"{m}.experts.down_proj": down.transpose(0, 2, 1),
             f"{m}.experts.post_expert_norm.weight": e["expert_norm"], f"{m}.post_expert_proj.weight": T(e["pool_out"])}
    else:
      sd |= {f"{m}.{n}_proj.weight": T(e[n]["kernel"]) for n in ("gate", "up", "down")}
    sd |= {f"{at}.input_layernorm.weight": block["attn_norm"]["scale"],
           f"{at}.pre_feedforward_layernorm.weight": block["mlp_norm"]["scale"],
           f"{at}.post_feedforward_layernorm.weight": block["mlp_post_norm"]["scale"],
           f"{at}.post_attention_residual_gate.gate": block["attn_residual_gate"],
           f"{at}.post_feedforward_residual_gate.gate": block["mlp_residual_gate"]}
  return sd


def check_out(cfg: ModelConfig) -> None:
  """Refuses what MuseSparkTextModel cannot hold (the fixed fields aside)."""
  K = cfg.head.d_k
  if cfg.head.d_v != K or cfg.rope_dim != K:
    raise invalid("d_v, rope_dim", (cfg.head.d_v, cfg.rope_dim),
                  f"d_k={K}: muse_spark rotates whole heads of one width")
  eps = cfg.norm_eps
  if (cfg.qk_norm_eps, cfg.output_norm_eps) != (eps, eps):
    raise invalid("qk_norm_eps, output_norm_eps", (cfg.qk_norm_eps, cfg.output_norm_eps),
                  f"norm_eps={eps} each: muse_spark has one rms_norm_eps")
  for i, kind in enumerate(cfg.layer_types or ()):
    if kind not in _TYPES:
      raise invalid(f"layer_types[{i}]", kind, f"one of {list(_TYPES)}: muse_spark drops RoPE by layer_rope_theta 0")
  if cfg.layer_rope_theta is not None and set(cfg.layer_rope_theta) - {0.0, float(cfg.rope_theta)}:
    raise invalid("layer_rope_theta", cfg.layer_rope_theta, f"entries 0 or rope_theta={cfg.rope_theta}: muse_spark "
                  "rotates every RoPE layer at one base")
  if cfg.mlp not in ("gated", "moe"):
    raise invalid("mlp", cfg.mlp, "'gated' or 'moe': muse_spark's feed-forward is a SwiGLU or pooled experts")
  if cfg.mlp == "moe" and (cfg.moe_layer_types is None or cfg.moe_pool_width is None
                           or cfg.moe_router != "sigmoid" or not cfg.moe_norm_topk or cfg.moe_groups != 1
                           or cfg.moe_router_scale != 1.0 / cfg.logit_divisor):
    raise invalid("moe_layer_types, moe_pool_width, moe_router, moe_router_scale",
                  (cfg.moe_layer_types, cfg.moe_pool_width, cfg.moe_router, cfg.moe_router_scale),
                  "set, set, 'sigmoid' (no groups, renormalised) and 1/logit_divisor: muse_spark's experts are pooled, "
                  "sigmoid-routed, their router's logits times output_multiplier as the output's are")


def config_out(cfg: ModelConfig) -> dict[str, Any]:
  L, D = cfg.num_layers, cfg.d_model
  moe = cfg.mlp == "moe"
  thetas = list(cfg.layer_rope_theta) if cfg.layer_rope_theta is not None else [cfg.rope_theta] * L
  text = dict(
      model_type="muse_spark_text", vocab_size=cfg.vocab_size, hidden_size=D, intermediate_size=cfg.d_ff,
      num_hidden_layers=L, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
      head_dim=cfg.head.d_k, max_position_embeddings=cfg.max_len, rms_norm_eps=cfg.norm_eps,
      rope_parameters=rope_to_hf(cfg)["rope_parameters"],
      hidden_act=activation_out(cfg, ("silu", "gelu_pytorch_tanh", "gelu", "relu")), tie_word_embeddings=False,
      attention_bias=False, attention_dropout=0.0,
      layer_types=["full_attention" if cfg.layer_head(i).window is None else "sliding_attention" for i in range(L)],
      sliding_window=cfg.window or cfg.max_len, final_logit_softcapping=cfg.logit_softcap,
      qk_scale_factor=cfg.qk_scale_factor, output_multiplier=1.0 / cfg.logit_divisor, post_norm_eps=cfg.post_norm_eps,
      layer_rope_theta=[0 if not x else x for x in thetas], residual_gate_temperature=cfg.residual_gate,
      mlp_layer_types=list(cfg.moe_layer_types) if moe else ["dense"] * L,
      num_local_experts=cfg.moe_experts or 1, num_experts_per_tok=cfg.moe_top_k or 1,
      moe_intermediate_size=cfg.moe_d_ff or cfg.d_ff, moe_hidden_size=cfg.moe_pool_width or D,
      routed_scaling_factor=cfg.moe_routed_scaling, pad_token_id=None, bos_token_id=None, eos_token_id=None)
  # Placeholder towers, the smallest transformers builds (module docstring): attn holds none.
  vision = dict(hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1, patch_size=2,
                pos_emb_height=2, pos_emb_width=2)
  audio = dict(hidden_sizes=[8], depths=[1], patch_sizes=[2], num_hidden_layers=1, out_hidden_size=D)
  return dict(architectures=["MuseSparkForConditionalGeneration"], text_config=text, vision_config=vision,
              audio_config=audio, out_hidden_size=8, projector_hidden_size=8)


def left_out(hf: dict[str, Any]) -> list[str]:
  """What `attn count --hf` does not count: the towers beside the text model."""
  del hf
  return ["the vision tower, its adapter and projection, and the audio tower left out: attn counts Muse Spark's "
          "text model (text_config: model.language_model. and lm_head)"]


MUSE_SPARK = Family(
    name="muse_spark", model_types=("muse_spark",), architectures=("MuseSparkForConditionalGeneration",),
    config_in=config_in, weights_in=weights_in, weights_out=weights_out, config_out=config_out, prefix=PREFIX,
    ignored=TOWERS, unheld=TOWERS,
    refusals={"quantization_config": ((None,), "float weights: attn does not dequantize quantized checkpoints")},
    fixed={"positional": "rope", "norm": "sandwich", "norm_type": "rmsnorm_plus_one", "final_norm": True,
           "layernorm": True, "num_segments": 0, "embed_norm": True, "embed_scale": False, "qk_norm": "fixed",
           "gate": "elementwise", "gate_activation": "sigmoid", "use_bias": False, "dense_bias": False,
           "tie_embeddings": False, "norm_forms": NORM_FORMS, "sinks": False},
    mapped=frozenset({"rope_theta", "rope_dim", "rope_scaling", "rope_factor", "rope_low_freq_factor",
                      "rope_high_freq_factor", "rope_original_max_len", "rope_beta_fast", "rope_beta_slow",
                      "rope_attention_factor", "rope_truncate", "qk_norm_eps", "qk_scale_factor", "output_norm_eps",
                      "window", "layer_types", "layer_rope_theta", "logit_softcap", "logit_divisor", "post_norm_eps",
                      "residual_gate", "mlp", "moe_experts", "moe_top_k", "moe_d_ff", "moe_router", "moe_norm_topk",
                      "moe_routed_scaling", "moe_layer_types", "moe_pool_width", "moe_router_scale"}),
    check_out=check_out, left_out=left_out)
