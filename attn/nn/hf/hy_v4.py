"""Hunyuan HY-V4 (hy_v4, HYV4ForCausalLM): GLM-5's attention with sinks and an output gate, shared indexer
layers, independent hyper-connections.

What it shares with glm_moe_dsa is attn.nn.hf.deepseek_v32's: mla with the query latent, the deepseek-form
indexer (interleaved RoPE), DeepSeek's sigmoid-routed experts, the dense layers from mlp_layer_types, and
indexer_types "full" / "shared" (ModelConfig.indexer_types, attn.nn.index_sharing: a shared layer holds no
indexer and reuses the last full layer's top-k). What HY-V4 adds, read from transformers' modeling_hy_v4:

  attention   learned sinks (self_attn.sinks, one logit per head: HeadConfig sinks) and an elementwise
              output gate o_h ⊙ σ(x·gate_proj) of width v_head_dim (HeadConfig gate "elementwise", w_gate)
  indexer     the index heads rotate their *last* qk_rope_head_dim dims (extra.indexer.rope_dims "last"),
              and the index key's LayerNorm has eps rms_norm_eps (extra.indexer.norm_eps)
  residual    hc_mult streams with independent hyper-connections (attn.nn.hyper, hc_form "independent":
              pre and post gates, no comb; post scaled by hc_magnitude): attn_hc / ffn_hc (fn, base,
              scale) around each sublayer, hc_head (hc_fn, hc_base, hc_scale) before the final norm
  experts     the routed experts' SwiGLU clamped at swiglu_limit (min(g, ℓ), clip(u, ±ℓ)), the shared
              experts not (moe_swiglu_form "clamp_routed"); swiglu_limit <= 0 is no clamp

The multi-token-prediction layers (model.mtp_layers.*), which transformers ignores, are read and ignored
with a one-line warning. transformers added hy_v4 in 5.x:
on an older one the family still reads configs and checkpoints, and its tests skip where the model is
missing.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from typing import Any

import numpy as np

from attn.config import invalid
from attn.nn.config import ModelConfig
from attn.nn.hf import deepseek_v32
from attn.nn.hf.base import Weights, get

ARCHITECTURE = "HYV4ForCausalLM"
_glm_in = deepseek_v32.config_in_for("interleaved", glm=True)
_glm_out = deepseek_v32.config_out_for(ARCHITECTURE, glm=True)
_glm_check = deepseek_v32.check_out_for("hy_v4", "interleaved")


# HYV4Config's defaults for what deepseek_v3's reader requires (a config.json from save_pretrained has them all)
DEFAULTS = {"n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.827, "n_shared_experts": 1,
            "norm_topk_prob": True, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}


def config_in(hf: dict[str, Any]) -> ModelConfig:
  """glm_moe_dsa's reader, then the sinks, gate, hyper-connections, index RoPE dims and the experts' clamp."""
  hf = DEFAULTS | hf
  eps = float(hf.get("rms_norm_eps", 1e-5))
  base = _glm_in(hf | {"first_k_dense_replace": hf.get("first_k_dense_replace", 1)})
  n = get(hf, "hc_mult", default=4)
  if isinstance(n, bool) or not isinstance(n, int) or n < 1:
    raise invalid("config.hc_mult", n, "an integer >= 1 (residual streams)")
  limit = float(hf.get("swiglu_limit", 10.0))
  moe = {"moe_swiglu_limit": limit, "moe_swiglu_form": "clamp_routed"} if limit > 0 and base.mlp == "moe" else {}
  ix = dict(base.extra["indexer"]) | {"rope_dims": "last", "norm_eps": eps}
  return base.replace(gate="elementwise", sinks=True, extra={"indexer": ix}, hc_mult=n,
                      hc_eps=float(hf.get("hc_eps", 1e-6)), hc_form="independent",
                      hc_magnitude=float(hf.get("hc_magnitude", 2.0)), **moe)


# The names save_pretrained writes (the release's) -> transformers' module names: its conversion_mapping for
# hy_v4, written out (saving inverts it, so every gate_proj goes out as linear_gate, the MLPs' too).
_RENAMES = tuple((re.compile(a), b) for a, b in (
    (r"\.hc_pre\.hc_", ".hc_"), (r"\.learnable_sink_param", ".sinks"), (r"\.linear_gate", ".gate_proj"),
    (r"\.hc_attn_layer\.hc_(fn|base|scale)", r".attn_hc.\1"), (r"\.hc_mlp_layer\.hc_(fn|base|scale)", r".ffn_hc.\1"),
    (r"\.hc_head_(fn|base|scale)", r".hc_\1")))


def released(arrays: dict[str, Any]) -> dict[str, Any]:
  """The checkpoint's tensors under transformers' module names (names already so pass through)."""
  out = {}
  for name, a in arrays.items():
    for pattern, to in _RENAMES:
      name = pattern.sub(to, name)
    out[name] = a
  return out


def _hc_in(w: Weights, at: str, n: int, D: int, head: bool = False) -> dict[str, np.ndarray]:
  if head:
    return {"fn": w(f"{at}.hc_fn", (n, n * D)), "base": w(f"{at}.hc_base", (n,)), "scale": w(f"{at}.hc_scale", (1,))}
  return {"fn": w(f"{at}.fn", (2 * n, n * D)), "base": w(f"{at}.base", (2 * n,)), "scale": w(f"{at}.scale", (2,))}


def weights_in(w: Weights, cfg: ModelConfig) -> dict[str, Any]:
  mtp = sorted(n for n in w.names if n.startswith("mtp_layers."))
  for name in mtp:  # transformers ignores them (_keys_to_ignore_on_load_unexpected); attn too, saying so
    w(name)
  if mtp:
    warnings.warn(f"{len(mtp)} tensors of mtp_layers.* (the multi-token-prediction layers) read and ignored, as "
                  "transformers ignores them", stacklevel=2)
  out = deepseek_v32.weights_in(w, cfg)
  D, H, V, n = cfg.d_model, cfg.num_heads, cfg.head.d_v, cfg.hc_mult
  for l, block in out["blocks"].items():
    a = f"layers.{l}.self_attn"
    block["attn"]["params"] |= {"sinks": w(f"{a}.sinks", (H,)),
                                "w_gate": w(f"{a}.gate_proj.weight", (H * V, D)).T.reshape(D, H, V)}
    if n > 1:
      block["attn_hc"], block["mlp_hc"] = _hc_in(w, f"layers.{l}.attn_hc", n, D), _hc_in(w, f"layers.{l}.ffn_hc", n, D)
  if n > 1:
    out["hc_head"] = _hc_in(w, "hc_head", n, D, head=True)
  return out


def weights_out(pure: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
  sd = deepseek_v32.weights_out(pure, cfg)
  D, H, V = cfg.d_model, cfg.num_heads, cfg.head.d_v
  for l, block in pure["blocks"].items():
    p, a = block["attn"]["params"], f"model.layers.{l}.self_attn"
    sd |= {f"{a}.sinks": np.asarray(p["sinks"]), f"{a}.gate_proj.weight": np.asarray(p["w_gate"]).reshape(D, H * V).T}
    if cfg.hc_mult > 1:
      for name, at in (("attn_hc", "attn_hc"), ("mlp_hc", "ffn_hc")):
        sd |= {f"model.layers.{l}.{at}.{k}": np.asarray(block[name][k]) for k in ("fn", "base", "scale")}
  if cfg.hc_mult > 1:
    sd |= {f"model.hc_head.hc_{k}": np.asarray(pure["hc_head"][k]) for k in ("fn", "base", "scale")}
  return sd


def check_out(cfg: ModelConfig) -> None:
  _glm_check(cfg.replace(moe_swiglu_limit=None, moe_swiglu_form="gpt_oss"))  # glm's, but for the clamp (below)
  o = dict(cfg.extra["indexer"])
  want = ("elementwise", True, "last", cfg.norm_eps)
  got = (cfg.gate, cfg.sinks, o.get("rope_dims"), o.get("norm_eps"))
  if got != want:
    raise invalid("gate, sinks, extra.indexer.rope_dims, extra.indexer.norm_eps", got,
                  f"{want}: HY-V4's gated attention with sinks, its index heads rotating their last dims")
  if cfg.hc_mult > 1 and cfg.hc_form != "independent":
    raise invalid("hc_form", cfg.hc_form, "'independent': HY-V4's hyper-connections have no comb")
  if cfg.moe_swiglu_limit is not None and cfg.moe_swiglu_form != "clamp_routed":
    raise invalid("moe_swiglu_form", cfg.moe_swiglu_form, "'clamp_routed': HY-V4 clamps its routed experts only")


def config_out(cfg: ModelConfig) -> dict[str, Any]:
  out = _glm_out(cfg)
  out.pop("first_k_dense_replace")
  return out | {"hc_mult": cfg.hc_mult, "hc_eps": cfg.hc_eps, "hc_magnitude": cfg.hc_magnitude,
                "swiglu_limit": cfg.moe_swiglu_limit or 0.0, "rms_norm_eps": cfg.norm_eps,
                "learnable_sink_init": 0.0}


HY_V4 = dataclasses.replace(
    deepseek_v32.GLM_MOE_DSA, name="hy_v4", model_types=("hy_v4",), architectures=(ARCHITECTURE,),
    config_in=config_in, weights_in=weights_in, weights_out=weights_out, config_out=config_out, check_out=check_out,
    released=released,
    mapped=deepseek_v32.GLM_MOE_DSA.mapped | {"gate", "sinks", "hc_mult", "hc_eps", "hc_form", "hc_magnitude",
                                              "moe_swiglu_limit", "moe_swiglu_form"})
