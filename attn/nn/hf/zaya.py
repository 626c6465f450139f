"""ZAYA1 (model_type zaya) as a DecoderLM: CCA attention, a router network with its state carried across
layers and a skip expert, residuals rescaled with learned scales and biases.

Attention (transformers 5.25's ZayaAttention) is attn's per_head with cca (attn.variants.mechanisms.cca),
biases with attention_bias: q_proj and k_proj as w_q and w_k; v_proj_current and v_proj_delayed
concatenated (that order) as w_v's G·K channels, flattened head-major; conv_qk_depthwise and conv_qk_grouped
(channels: the H query heads, then the G key heads) as cca_dw_* and cca_gc_*, their biases as cca_dw_bias_*
and cca_gc_bias_*; qk_norm.temp as cca_temp; o_proj as w_o. Each layer type ("hybrid": attn's full_attention,
"hybrid_sliding": sliding_attention) rotates the first int(head_dim·partial_rotary_factor) dims of a head (the
halves layout) at its own rope_theta (the hybrid layers' as rope_theta and rope_dim, the sliding ones' as
sliding_rope_theta and layer_heads' rope_dim); a hybrid_sliding layer keeps sliding_window keys. head_config
reads a layer type's HeadConfig; attention_in and attention_out move one layer's tensors.

The block is pre-norm RMSNorm (input_layernorm, post_attention_layernorm; norm at the end), each residual
ZayaResidualScaling's (f(x) + b)·s + (x + b')·s' (post_attention_residual_scale, post_mlp_residual_scale:
hidden_states_* on the sublayer's output, residual_* on the stream) and the embeddings (e + b)·s
(input_hidden_states_bias, _scale): attn's residual_scale. Every layer's feed-forward is experts
(ZayaSparseMoeBlock): the router (mlp.gate) is a network of its own, down_proj D -> router_hidden_size R,
plus the previous layer's state times router_states_scale in every layer but the first (EDA: attn's
moe_router_carry), then router_mlp (RMSNorm, fc1, GELU, fc2, GELU, out_proj to num_experts + 1 classes:
attn's moe_router_mlp); a softmax over the classes, the choice made on the probabilities plus
balancing_biases (a buffer: attn's correction), the weights the chosen probabilities unrenormalised
(moe_norm_topk False); the last class is the skip expert that computes nothing (moe_skip_expert). The
experts are SwiGLUs of moe_intermediate_size, gate_up_proj fused.
The output is tied to the embeddings (tie_word_embeddings) or an lm_head without a bias.

Decided here: lm_head_bias True is refused by name (attn's untied output bias comes with the MLPs' biases,
which ZAYA's experts lack), as are output_router_logits (attn's MoE returns none) and a quantized checkpoint.
transformers computes ZAYA's residual stream in float32 whatever the weights' dtype (residual_in_fp32); attn
computes it in ModelConfig.dtype, the same in float32. Under right padding transformers zeros a padded token
before the CCA convolutions (its conv mask) where attn reads the token itself: the two agree at every real
token, which is where attn.testing.check_family compares cca models. The router state is per token along depth: decoding
needs no cache for it (attn.nn.moe), and tests/test_hf_zaya.py checks cached greedy decoding against generate.
transformers writes ZAYA under the names it holds in memory (it has no conversion mapping for zaya): those are
the names read. transformers has ZAYA from 5.25.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from attn.config import HeadConfig, invalid
from attn.nn.config import ModelConfig
from attn.nn.hf.base import Family, Weights, activation, activation_out, decoder_in, get
from attn.nn.hf.mimo_v2_flash import _fraction

TYPES = ("hybrid", "hybrid_sliding")
ATTN_TYPES = {"hybrid": "full_attention", "hybrid_sliding": "sliding_attention"}  # attn's name of each
_SCALES = {"hidden_states_scale": "out_scale", "hidden_states_bias": "out_bias", "residual_scale": "res_scale",
           "residual_bias": "res_bias"}  # ZayaResidualScaling's tensors -> attn.nn.models.ResidualScale's
_DEFAULT_ROPE = {"hybrid": 5_000_000.0, "hybrid_sliding": 10_000.0}


def _width(hf: dict[str, Any], name: str) -> int:
  w = hf.get(name, 2)
  if isinstance(w, bool) or not isinstance(w, int) or w < 1:
    raise invalid(f"config.{name}", w, "an integer >= 1: the taps of one of CCA's causal convolutions")
  return w


def head_config(hf: dict[str, Any], layer_type: str = "hybrid") -> HeadConfig:
  """One layer type's attention as a HeadConfig (refused by name: a width below 1, heads that do not group, a
  rope type other than default), read from config.json alone."""
  if layer_type not in TYPES:
    raise invalid("layer_type", layer_type, f"one of {list(TYPES)}: ZAYA's layer types")
  D, H, G = get(hf, "hidden_size"), get(hf, "num_attention_heads"), get(hf, "num_key_value_heads")
  K = hf.get("head_dim", 128)
  if H % G:
    raise invalid("config.num_key_value_heads", G, f"a divisor of num_attention_heads={H}: each kv head serves "
                  "a group of query heads, and CCA's key residual is its group's mean")
  rope = dict((hf.get("rope_parameters") or {}).get(layer_type) or {})
  if rope.get("rope_type", "default") != "default":
    raise invalid(f"config.rope_parameters.{layer_type}.rope_type", rope["rope_type"], "'default': attn reads "
                  "ZAYA's plain partial RoPE")
  r = int(K * rope.get("partial_rotary_factor", 0.5))
  window = None
  if layer_type == "hybrid_sliding":
    window = hf.get("sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
      raise invalid("config.sliding_window", window, "a positive integer: layer_types has hybrid_sliding layers")
  return HeadConfig(d_model=D, num_heads=H, num_kv_heads=G, d_k=K, d_v=K, use_bias=bool(hf.get("attention_bias")),
                    rope_dim=r, rope_theta=float(rope.get("rope_theta", _DEFAULT_ROPE[layer_type])), window=window,
                    cca=True, cca_depthwise_width=_width(hf, "cca_time0"), cca_grouped_width=_width(hf, "cca_time1"))


def _split(a: np.ndarray, head: HeadConfig) -> tuple[np.ndarray, np.ndarray]:
  """Conv channels (C, ...) as (query heads (H, K, ...), key heads (G, K, ...))."""
  H, G, K = head.num_heads, head.num_kv_heads, head.d_k
  return a[:H * K].reshape(H, K, *a.shape[1:]), a[H * K:].reshape(G, K, *a.shape[1:])


def attention_in(w: Weights, prefix: str, head: HeadConfig) -> dict[str, np.ndarray]:
  """A ZAYA layer's attention tensors under prefix (…self_attn) as per_head's and cca's parameters."""
  D, H, G, K = head.d_model, head.num_heads, head.num_kv_heads, head.d_k
  C, W0, W1, p = (H + G) * K, head.cca_depthwise_width, head.cca_grouped_width, f"{prefix}.qkv_proj"
  halves = ("v_proj_current", "v_proj_delayed")
  out = {"w_q": w(f"{p}.q_proj.weight", (H * K, D)).T.reshape(D, H, K),
         "w_k": w(f"{p}.k_proj.weight", (G * K, D)).T.reshape(D, G, K),
         "w_v": np.concatenate([w(f"{p}.{n}.weight", (G * K // 2, D)) for n in halves]).T.reshape(D, G, K),
         "w_o": w(f"{prefix}.o_proj.weight", (D, H * K)).T.reshape(H, K, D),
         "cca_temp": w(f"{prefix}.qk_norm.temp", (G,))}
  dw_q, dw_k = _split(w(f"{p}.conv_qk_depthwise.weight", (C, 1, W0))[:, 0], head)  # (N, K, W0)
  gc_q, gc_k = _split(w(f"{p}.conv_qk_grouped.weight", (C, K, W1)), head)  # (N, K_out, K_in, W1)
  for c, dw, gc in (("q", dw_q, gc_q), ("k", dw_k, gc_k)):
    out[f"cca_dw_{c}"], out[f"cca_gc_{c}"] = dw.transpose(2, 0, 1), gc.transpose(3, 0, 2, 1)
  for stage in ("dw", "gc"):
    name = "depthwise" if stage == "dw" else "grouped"
    out[f"cca_{stage}_bias_q"], out[f"cca_{stage}_bias_k"] = _split(w(f"{p}.conv_qk_{name}.bias", (C,)), head)
  if head.use_bias:
    out |= {"b_q": w(f"{p}.q_proj.bias", (H * K,)).reshape(H, K), "b_k": w(f"{p}.k_proj.bias", (G * K,)).reshape(G, K),
            "b_v": np.concatenate([w(f"{p}.{n}.bias", (G * K // 2,)) for n in halves]).reshape(G, K),
            "b_o": w(f"{prefix}.o_proj.bias", (D,))}
  left = sorted(n for n in w.names - w.used if n.startswith(f"{prefix}."))
  if left:
    raise invalid("checkpoint", left[0], f"a tensor of ZAYA's attention (family 'zaya'): {left[0]!r} is none of the "
                  f"names attn reads under {prefix!r} (q_proj, k_proj, v_proj_current, v_proj_delayed, "
                  "conv_qk_depthwise, conv_qk_grouped, qk_norm.temp, o_proj; biases with attention_bias)")
  return out


def attention_out(params: dict[str, Any], prefix: str, head: HeadConfig) -> dict[str, np.ndarray]:
  """attention_in's inverse: per_head's and cca's parameters as a ZAYA layer's tensors under prefix."""
  p = {k: np.asarray(v) for k, v in params.items()}
  D, H, G, K = head.d_model, head.num_heads, head.num_kv_heads, head.d_k
  q, half = f"{prefix}.qkv_proj", G * K // 2
  v = p["w_v"].reshape(D, G * K).T
  sd = {f"{q}.q_proj.weight": p["w_q"].reshape(D, H * K).T, f"{q}.k_proj.weight": p["w_k"].reshape(D, G * K).T,
        f"{q}.v_proj_current.weight": v[:half], f"{q}.v_proj_delayed.weight": v[half:],
        f"{prefix}.o_proj.weight": p["w_o"].reshape(H * K, D).T, f"{prefix}.qk_norm.temp": p["cca_temp"],
        f"{q}.conv_qk_depthwise.weight": np.concatenate(
            [p[f"cca_dw_{c}"].transpose(1, 2, 0).reshape(-1, p[f"cca_dw_{c}"].shape[0]) for c in "qk"])[:, None],
        f"{q}.conv_qk_grouped.weight": np.concatenate(
            [p[f"cca_gc_{c}"].transpose(1, 3, 2, 0).reshape(-1, K, p[f"cca_gc_{c}"].shape[0]) for c in "qk"]),
        **{f"{q}.conv_qk_{name}.bias": np.concatenate([p[f"cca_{stage}_bias_{c}"].reshape(-1) for c in "qk"])
           for stage, name in (("dw", "depthwise"), ("gc", "grouped"))}}
  if head.use_bias:
    b_v = p["b_v"].reshape(-1)
    sd |= {f"{q}.q_proj.bias": p["b_q"].reshape(-1), f"{q}.k_proj.bias": p["b_k"].reshape(-1),
           f"{q}.v_proj_current.bias": b_v[:half], f"{q}.v_proj_delayed.bias": b_v[half:],
           f"{prefix}.o_proj.bias": p["b_o"]}
  return sd


def config_in(hf: dict[str, Any]) -> ModelConfig:
  """The DecoderLM of a zaya config.json: each layer type's heads (head_config), the experts, the scales."""
  L = get(hf, "num_hidden_layers")
  types = list(hf.get("layer_types") or ["hybrid"] * L)
  if len(types) != L or set(types) - set(TYPES):
    raise invalid("config.layer_types", types, f"{L} of {list(TYPES)}")
  full = head_config(hf, "hybrid")
  sliding = head_config(hf, "hybrid_sliding") if "hybrid_sliding" in types else None
  # transformers' ZayaConfig defaults where config.json leaves a key out (save_pretrained writes them all)
  E, k, R = hf.get("num_experts", 16), hf.get("num_experts_per_tok", 1), hf.get("router_hidden_size", 256)
  F = hf.get("moe_intermediate_size", 2048)
  return ModelConfig(
      vocab_size=get(hf, "vocab_size"), d_model=full.d_model, num_layers=L, num_heads=full.num_heads, d_ff=F,
      d_k=full.d_k, d_v=full.d_v, num_kv_heads=full.num_kv_heads, variant="per_head",
      max_len=hf.get("max_position_embeddings", 131072), positional="rope", rope_dim=full.rope_dim,
      rope_theta=full.rope_theta, layer_types=tuple(ATTN_TYPES[t] for t in types),
      window=None if sliding is None else sliding.window,
      sliding_rope_theta=None if sliding is None else sliding.rope_theta,
      layer_heads={"sliding_attention": {"rope_dim": sliding.rope_dim}}
      if sliding is not None and sliding.rope_dim != full.rope_dim else None,
      norm="pre", norm_type="rmsnorm", norm_eps=float(hf.get("rms_norm_eps", 1e-5)), final_norm=True,
      activation=activation(hf, "hidden_act", "silu"), tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
      use_bias=full.use_bias, dense_bias=False, cca=True, cca_depthwise_width=full.cca_depthwise_width,
      cca_grouped_width=full.cca_grouped_width, mlp="moe", moe_experts=E, moe_top_k=k, moe_d_ff=F,
      moe_router="softmax", moe_norm_topk=False, moe_router_mlp=R, moe_router_carry=True, moe_skip_expert=True,
      residual_scale=True)


def _linear(w: Weights, name: str, rows: int, cols: int) -> np.ndarray:
  """A torch Linear's (out, in) weight as (in, out)."""
  return w(f"{name}.weight", (rows, cols)).T


def _experts_in(w: Weights, m: str, cfg: ModelConfig, carried: bool) -> dict[str, Any]:
  """A layer's ZayaSparseMoeBlock under m (…mlp) as attn.nn.moe.MoE's arrays."""
  D, E, F, R = cfg.d_model, cfg.moe_experts, cfg.moe_d_ff, cfg.moe_router_mlp
  g, n = f"{m}.gate", f"{m}.gate.router_mlp"
  net = {"down": _linear(w, f"{g}.down_proj", R, D), "down_b": w(f"{g}.down_proj.bias", (R,)),
         "norm": w(f"{n}.norm.weight", (R,)), "fc1": _linear(w, f"{n}.fc1", R, R), "fc1_b": w(f"{n}.fc1.bias", (R,)),
         "fc2": _linear(w, f"{n}.fc2", R, R), "fc2_b": w(f"{n}.fc2.bias", (R,)),
         "out": _linear(w, f"{n}.out_proj", E + 1, R)}
  if carried:
    net["carry_scale"] = w(f"{g}.router_states_scale", (R,))
  gate_up = w(f"{m}.experts.gate_up_proj", (E, 2 * F, D))
  return {"router_net": net, "correction": w(f"{g}.balancing_biases", (E + 1,)),
          "w_gate": gate_up[:, :F].transpose(0, 2, 1), "w_up": gate_up[:, F:].transpose(0, 2, 1),
          "w_down": w(f"{m}.experts.down_proj", (E, D, F)).transpose(0, 2, 1)}


def weights_in(w: Weights, cfg: ModelConfig) -> dict[str, Any]:
  D, N = cfg.d_model, cfg.vocab_size
  norm = lambda name: {"scale": w(f"{name}.weight", (D,))}  # noqa: E731
  scale = lambda name: {ours: w(f"{name}.{theirs}", (D,)) for theirs, ours in _SCALES.items()}  # noqa: E731
  blocks = {}
  for l in range(cfg.num_layers):
    at = f"layers.{l}"
    blocks[l] = {"attn": {"params": attention_in(w, f"{at}.self_attn", cfg.layer_head(l))},
                 "mlp": _experts_in(w, f"{at}.mlp", cfg, cfg.router_carried(l)),
                 "attn_norm": norm(f"{at}.input_layernorm"), "mlp_norm": norm(f"{at}.post_attention_layernorm"),
                 "attn_scale": scale(f"{at}.post_attention_residual_scale"),
                 "mlp_scale": scale(f"{at}.post_mlp_residual_scale")}
  out = decoder_in(w, blocks, norm, cfg, N, D)
  out["embed"] |= {"input_scale": w("input_hidden_states_scale", (D,)), "input_bias": w("input_hidden_states_bias",
                                                                                          (D,))}
  return out


def weights_out(pure: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
  T = lambda a: np.asarray(a).T  # noqa: E731  (in, out) -> torch's (out, in)
  head_w = pure["embed"]["token"] if cfg.tie_embeddings else T(pure["head"]["linear"]["kernel"])
  sd = {"model.embed_tokens.weight": pure["embed"]["token"], "model.norm.weight": pure["final_norm"]["scale"],
        "model.input_hidden_states_scale": pure["embed"]["input_scale"],
        "model.input_hidden_states_bias": pure["embed"]["input_bias"], "lm_head.weight": head_w}
  for l, block in pure["blocks"].items():
    at = f"model.layers.{l}"
    sd |= attention_out(block["attn"]["params"], f"{at}.self_attn", cfg.layer_head(int(l)))
    e, m = block["mlp"], f"{at}.mlp"
    net, g, n = e["router_net"], f"{m}.gate", f"{m}.gate.router_mlp"
    sd |= {f"{g}.down_proj.weight": T(net["down"]), f"{g}.down_proj.bias": net["down_b"],
           f"{n}.norm.weight": net["norm"], f"{n}.fc1.weight": T(net["fc1"]), f"{n}.fc1.bias": net["fc1_b"],
           f"{n}.fc2.weight": T(net["fc2"]), f"{n}.fc2.bias": net["fc2_b"], f"{n}.out_proj.weight": T(net["out"]),
           f"{g}.balancing_biases": e["correction"],
           f"{m}.experts.gate_up_proj": np.concatenate([np.asarray(e["w_gate"]), np.asarray(e["w_up"])],
                                                       -1).transpose(0, 2, 1),
           f"{m}.experts.down_proj": np.asarray(e["w_down"]).transpose(0, 2, 1)}
    if "carry_scale" in net:
      sd[f"{g}.router_states_scale"] = net["carry_scale"]
    sd |= {f"{at}.input_layernorm.weight": block["attn_norm"]["scale"],
           f"{at}.post_attention_layernorm.weight": block["mlp_norm"]["scale"]}
    for sub, name in (("attn_scale", "post_attention_residual_scale"), ("mlp_scale", "post_mlp_residual_scale")):
      sd |= {f"{at}.{name}.{theirs}": block[sub][ours] for theirs, ours in _SCALES.items()}
  return sd


def check_out(cfg: ModelConfig) -> None:
  """Refuses what ZayaForCausalLM cannot hold (the fixed fields aside)."""
  K = cfg.head.d_k
  if cfg.head.d_v != K:
    raise invalid("d_v", cfg.head.d_v, f"d_k={K}: zaya's heads have one width (half of each value delayed)")
  for i, kind in enumerate(cfg.layer_types or ()):
    if kind not in ATTN_TYPES.values():
      raise invalid(f"layer_types[{i}]", kind, f"one of {list(ATTN_TYPES.values())}: zaya's layer types")
  extra = {t: dict(v) for t, v in (cfg.layer_heads or {}).items()}
  if extra and (set(extra) != {"sliding_attention"} or set(extra["sliding_attention"]) != {"rope_dim"}):
    raise invalid("layer_heads", extra, "None or {'sliding_attention': {'rope_dim': r}}: zaya's layer types differ "
                  "only in their rotated width")
  if (cfg.moe_router_mlp is None or cfg.moe_top_k != 1 or cfg.moe_routed_scaling != 1.0 or cfg.moe_shared_experts
      or cfg.moe_dense_first or cfg.moe_layer_types is not None or cfg.moe_swiglu_limit is not None
      or cfg.activation != "silu"):
    raise invalid("moe_router_mlp, moe_top_k, moe_routed_scaling", (cfg.moe_router_mlp, cfg.moe_top_k,
                                                                   cfg.moe_routed_scaling),
                  "(R, 1, 1.0) with SiLU experts in every layer and no shared ones: zaya's router keeps one class "
                  "(transformers refuses num_experts_per_tok != 1)")


def config_out(cfg: ModelConfig) -> dict[str, Any]:
  L, K = cfg.num_layers, cfg.head.d_k
  types = ["hybrid" if cfg.layer_head(i).window is None else "hybrid_sliding" for i in range(L)]
  s_head = cfg.layer_head(types.index("hybrid_sliding")) if "hybrid_sliding" in types else cfg.head
  s_theta = cfg.sliding_rope_theta if cfg.sliding_rope_theta is not None else _DEFAULT_ROPE["hybrid_sliding"]
  rope = lambda theta, r: {"rope_type": "default", "rope_theta": theta,  # noqa: E731
                           "partial_rotary_factor": _fraction(K, r)}
  return dict(
      architectures=["ZayaForCausalLM"], vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=L,
      num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads, head_dim=K,
      max_position_embeddings=cfg.max_len, rms_norm_eps=cfg.norm_eps, hidden_act=activation_out(cfg, ("silu",)),
      tie_word_embeddings=cfg.tie_embeddings, attention_bias=cfg.use_bias, attention_dropout=0.0,
      layer_types=types, sliding_window=cfg.window,
      rope_parameters={"hybrid": rope(cfg.rope_theta, cfg.rope_dim), "hybrid_sliding": rope(s_theta, s_head.rope_dim)},
      num_experts=cfg.moe_experts, num_experts_per_tok=cfg.moe_top_k, moe_intermediate_size=cfg.moe_d_ff or cfg.d_ff,
      router_hidden_size=cfg.moe_router_mlp, cca_time0=cfg.cca_depthwise_width, cca_time1=cfg.cca_grouped_width,
      lm_head_bias=False, pad_token_id=None, bos_token_id=None, eos_token_id=None)


ZAYA = Family(
    name="zaya", model_types=("zaya",), architectures=("ZayaForCausalLM",), config_in=config_in,
    weights_in=weights_in, weights_out=weights_out, config_out=config_out, prefix="model.",
    refusals={"lm_head_bias": ((False,), "attn's untied output bias comes with the MLPs' biases, which ZAYA's "
                                         "experts lack"),
              "output_router_logits": ((False,), "attn's MoE returns no router logits"),
              "quantization_config": ((None,), "float weights: attn does not dequantize quantized checkpoints")},
    fixed={"positional": "rope", "norm": "pre", "norm_type": "rmsnorm", "final_norm": True, "layernorm": True,
           "num_segments": 0, "embed_norm": False, "embed_scale": False, "dense_bias": False, "cca": True,
           "mlp": "moe", "moe_router": "softmax", "moe_norm_topk": False, "moe_router_carry": True,
           "moe_skip_expert": True, "residual_scale": True, "sinks": False},
    mapped=frozenset({"rope_theta", "rope_dim", "window", "layer_types", "sliding_rope_theta", "layer_heads",
                      "tie_embeddings", "use_bias", "cca_depthwise_width", "cca_grouped_width", "moe_experts",
                      "moe_top_k", "moe_d_ff", "moe_router_mlp"}),
    check_out=check_out)
