"""Qwen3.5's text model in and out: Qwen3-Next's hybrid (attn.nn.hf.qwen3_next) with its linear layers'
projections held apart, a dense MLP in every layer, and multimodal RoPE that is plain RoPE on text.

transformers' qwen3_5 (Qwen3_5ForCausalLM, model_type "qwen3_5_text") differs from qwen3_next in
three places, each mapped here:
  a gated-delta layer holds in_proj_qkv ([q of all G key heads | k of them | v of all H value
    heads], the convolution's channel order) and in_proj_z, in_proj_b, in_proj_a apart, where
    Qwen3-Next interleaves them per key head (in_proj_qkvz, in_proj_ba);
  there are no experts (no num_experts, mlp_only_layers);
  its RoPE is multimodal (mrope_section over the rotated pairs): on text the three position rows
    are one, so every pair turns by the text position, which is attn's RoPE over the first
    int(partial_rotary_factor·head_dim) dims, half-split.
Attention layers (q_proj holding [query | gate] per head, zero-centred q/k norms), zero-centred
RMSNorms, one rms_norm_eps for every norm and the refusals (attention biases, a layer type other
than full_attention or linear_attention) are Qwen3-Next's; experts are refused by name. The vision-language wrapper
(model_type "qwen3_5", its text under text_config and model.language_model.) is not read here.
QWEN3_5_MOE (model_type "qwen3_5_moe_text", Qwen3_5MoeForCausalLM) is the same model with
Qwen3-Next's experts (attn.nn.hf.qwen3_next) in every layer.
The release's multi-token-prediction weights (mtp.*) are not read, as transformers does not read
them. to_hf writes the same tensors back, bit for bit.
Tensors under model.language_model. read as under model. (`released`): the released checkpoints hold
them so, and so does save_pretrained of transformers 5.2 to 5.5 (conversion_mapping's
WeightRenaming(r"^model.language_model", "model"), reverted on saving any model), and of 5.6 on for a
model loaded from such a checkpoint (PrefixChange(prefix_to_remove="language_model"), reverted only then).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np

from attn.config import invalid
from attn.nn.hf import qwen3_next
from attn.nn.hf.base import Weights
from attn.nn.config import ModelConfig


def _linear_in(w: Weights, a: str, cfg: ModelConfig, l: int) -> dict[str, np.ndarray]:
  head = cfg.layer_head(l)
  D, H, G, K, V, W = head.d_model, head.num_heads, head.num_kv_heads, head.d_k, head.d_v, head.conv_width
  qkv = w(f"{a}.in_proj_qkv.weight", (2 * G * K + H * V, D)).T
  conv = w(f"{a}.conv1d.weight", (2 * G * K + H * V, 1, W))[:, 0].T
  return {"w_q": qkv[:, :G * K].reshape(D, G, K), "w_k": qkv[:, G * K:2 * G * K].reshape(D, G, K),
          "w_v": qkv[:, 2 * G * K:].reshape(D, H, V), "w_z": w(f"{a}.in_proj_z.weight", (H * V, D)).T.reshape(D, H, V),
          "w_b": w(f"{a}.in_proj_b.weight", (H, D)).T, "w_a": w(f"{a}.in_proj_a.weight", (H, D)).T,
          "conv_q": conv[:, :G * K].reshape(W, G, K), "conv_k": conv[:, G * K:2 * G * K].reshape(W, G, K),
          "conv_v": conv[:, 2 * G * K:].reshape(W, H, V),
          "a_log": w(f"{a}.A_log", (H,)), "dt_bias": w(f"{a}.dt_bias", (H,)), "norm": w(f"{a}.norm.weight", (V,)),
          "w_o": w(f"{a}.out_proj.weight", (D, H * V)).T.reshape(H, V, D)}


def _linear_out(p: dict[str, np.ndarray], a: str, cfg: ModelConfig, l: int) -> dict[str, np.ndarray]:
  head = cfg.layer_head(l)
  D, H, V, W = head.d_model, head.num_heads, head.d_v, head.conv_width
  qkv = np.concatenate([p["w_q"].reshape(D, -1), p["w_k"].reshape(D, -1), p["w_v"].reshape(D, -1)], 1)
  conv = np.concatenate([p["conv_q"].reshape(W, -1), p["conv_k"].reshape(W, -1), p["conv_v"].reshape(W, -1)], -1)
  return {f"{a}.in_proj_qkv.weight": qkv.T, f"{a}.in_proj_z.weight": p["w_z"].reshape(D, H * V).T,
          f"{a}.in_proj_b.weight": p["w_b"].T, f"{a}.in_proj_a.weight": p["w_a"].T,
          f"{a}.conv1d.weight": conv.T[:, None, :], f"{a}.A_log": p["a_log"], f"{a}.dt_bias": p["dt_bias"],
          f"{a}.norm.weight": p["norm"], f"{a}.out_proj.weight": p["w_o"].reshape(H * V, D).T}


def released(arrays: dict[str, Any]) -> dict[str, Any]:
  """The checkpoint's tensors with model.language_model. read as model. (the module docstring)."""
  return {f"model.{k.removeprefix(_WRAPPED)}" if k.startswith(_WRAPPED) else k: a for k, a in arrays.items()}


_WRAPPED = "model.language_model."


def config_out(cfg: ModelConfig) -> dict[str, Any]:
  kw = qwen3_next.config_out(cfg)
  for key in ("num_experts", "mlp_only_layers"):
    del kw[key]
  return kw | {"architectures": ["Qwen3_5ForCausalLM"]}


def config_in(hf: dict[str, Any]) -> ModelConfig:
  if hf.get("num_experts"):
    raise invalid("config.num_experts", hf["num_experts"], "0 or absent: qwen3_5_text is Qwen3.5's dense text "
                  "model (its experts are qwen3_5_moe's)")
  return qwen3_next.config_in(hf)


def check_out(cfg: ModelConfig) -> None:
  qwen3_next.check_out(cfg)
  if cfg.mlp != "gated":
    raise invalid("mlp", cfg.mlp, "'gated': qwen3_5_text has no experts")


QWEN3_5 = dataclasses.replace(
    qwen3_next.QWEN3_NEXT, name="qwen3_5_text", fixed=qwen3_next.QWEN3_NEXT.fixed | {"mlp": "gated"}, model_types=("qwen3_5_text",),
    architectures=("Qwen3_5ForCausalLM",), config_in=config_in,
    weights_in=functools.partial(qwen3_next.weights_in, linear_in=_linear_in),
    weights_out=functools.partial(qwen3_next.weights_out, linear_out=_linear_out),
    config_out=config_out, check_out=check_out, released=released,
    ignored=("mtp.",))  # the release's multi-token-prediction layer, which transformers does not read either


def config_in_moe(hf: dict[str, Any]) -> ModelConfig:
  if not hf.get("num_experts"):
    raise invalid("config.num_experts", hf.get("num_experts"), "at least 1: qwen3_5_moe_text has experts in "
                  "every layer (the dense text model is qwen3_5_text)")
  # no layer is dense: d_ff (which only a dense layer reads) is the experts' width
  return qwen3_next.config_in({"intermediate_size": hf.get("moe_intermediate_size"), **hf})


def config_out_moe(cfg: ModelConfig) -> dict[str, Any]:
  kw = qwen3_next.config_out(cfg)
  for key in ("mlp_only_layers", "decoder_sparse_step", "norm_topk_prob", "intermediate_size"):
    del kw[key]
  return kw | {"architectures": ["Qwen3_5MoeForCausalLM"]}


def check_out_moe(cfg: ModelConfig) -> None:
  qwen3_next.check_out(cfg)
  if (cfg.mlp, cfg.moe_dense_first, cfg.moe_norm_topk) != ("moe", 0, True):
    raise invalid("mlp, moe_dense_first, moe_norm_topk", (cfg.mlp, cfg.moe_dense_first, cfg.moe_norm_topk),
                  "('moe', 0, True): qwen3_5_moe_text has experts in every layer, their weights renormalised")
  if cfg.d_ff != cfg.moe_d_ff:
    raise invalid("d_ff", cfg.d_ff, f"moe_d_ff={cfg.moe_d_ff}: qwen3_5_moe_text has no dense MLP to hold another")


# Qwen3.5's mixture-of-experts text model: these layers with Qwen3-Next's experts (softmax router, a
# gated shared expert) in every layer, always renormalised.
QWEN3_5_MOE = dataclasses.replace(
    QWEN3_5, name="qwen3_5_moe_text", model_types=("qwen3_5_moe_text",), architectures=("Qwen3_5MoeForCausalLM",),
    config_in=config_in_moe, config_out=config_out_moe, check_out=check_out_moe, fixed=qwen3_next.QWEN3_NEXT.fixed)
