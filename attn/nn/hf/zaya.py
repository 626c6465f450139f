"""ZAYA1 (model_type zaya): its attention, which attn runs (per_head with the cca mechanism); the rest of its
decoder, which attn does not, is why from_hf refuses the family by name (load.REFUSED["zaya"]).

A ZAYA layer's attention (transformers 5.25's ZayaAttention) is attn's per_head with cca
(attn.variants.mechanisms.cca), biases with attention_bias: q_proj and k_proj as w_q and w_k; v_proj_current and
v_proj_delayed concatenated (that order) as w_v's G·K channels, flattened head-major; conv_qk_depthwise and
conv_qk_grouped (channels: the H query heads, then the G key heads) as cca_dw_* and cca_gc_*, their biases as
cca_dw_bias_* and cca_gc_bias_*; qk_norm.temp as cca_temp; o_proj as w_o. Each layer type ("hybrid",
"hybrid_sliding") rotates the first int(head_dim·partial_rotary_factor) dims of a head (the halves layout) at its
own rope_theta; a hybrid_sliding layer keeps sliding_window keys. head_config reads a layer's HeadConfig;
attention_in and attention_out move its tensors (tests/test_hf_zaya.py: equal to transformers' layer, in a full
pass under right padding and decoding through transformers' cache).

What attn lacks for the whole model (the reason in REFUSED): the router of its mixture of experts carries its
hidden state from layer to layer (EDA: router_states_scale), runs an MLP of its own (router_mlp) and may choose a
skip expert that computes nothing; each sub-layer's residual is rescaled, (f(x) + b)·s + (h + b')·s'
(post_attention_residual_scale, post_mlp_residual_scale), and the embeddings too (input_hidden_states_scale, _bias).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from attn.config import HeadConfig, invalid
from attn.nn.hf.base import Weights, get

TYPES = ("hybrid", "hybrid_sliding")
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
