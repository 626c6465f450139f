"""Gemma 3's text model (model_type gemma3_text) as Gemma 2 with per-head QK-norm and two RoPE bases.

Beyond Gemma 2 (sandwich norms, (1 + w) RMSNorm, √D embedding scale,
query_pre_attn_scalar): q_norm and k_norm over each head, (1 + w) like its
other norms (attn holds w, ModelConfig.qk_norm_plus_one: written back bit for
bit at any dtype); sliding layers rotate
with rope_local_base_freq (attn's sliding_rope_theta) and no scaling, full
layers with rope_theta and the checkpoint's rope_scaling (linear in 4B-27B).
transformers 5 writes both as rope_parameters by layer type, 4 as rope_theta,
rope_local_base_freq and rope_scaling: both are read and both written. The
schedule is layer_types (default: every 6th layer full), no soft-caps unless set.
"""

from __future__ import annotations

from typing import Any

from attn.config import invalid
from attn.nn.hf.gemma2 import _extra_in, _extra_out
from attn.nn.hf.llama import LlamaLike, family
from attn.nn.hf.rope import rope_from_hf, rope_to_hf
from attn.nn.config import ModelConfig

_TYPES = ("full_attention", "sliding_attention")


def _every_sixth(hf: dict[str, Any], L: int) -> list[str]:
  """transformers' default: layer l (from 1) full when sliding_window_pattern (6) divides it."""
  k = int(hf.get("sliding_window_pattern", 6))
  return ["sliding_attention" if (i + 1) % k else "full_attention" for i in range(L)]


def _rope_in(hf: dict[str, Any]) -> dict[str, Any]:
  """Full layers' RoPE (with its scaling) and the sliding layers' own base, in either release's spelling."""
  out = _rope_by_type(hf)
  types = hf.get("layer_types") or _every_sixth(hf, int(hf.get("num_hidden_layers", 0)))
  if not hf.get("sliding_window") or "sliding_attention" not in types:
    out["sliding_rope_theta"] = None  # no sliding layer reads it
  return out


def _rope_by_type(hf: dict[str, Any]) -> dict[str, Any]:
  params = hf.get("rope_parameters") or {}
  if not any(t in params for t in _TYPES):  # transformers 4: rope_theta, rope_scaling, rope_local_base_freq
    return rope_from_hf(hf) | {"sliding_rope_theta": float(hf.get("rope_local_base_freq", 10000.0))}
  local = params.get("sliding_attention") or {}
  if local.get("rope_type", "default") != "default":
    raise invalid("config.rope_parameters.sliding_attention.rope_type", local["rope_type"],
                  "'default': attn's sliding layers rotate without scaling")
  full = {k: v for k, v in hf.items() if k != "rope_parameters"} | {"rope_parameters": params.get("full_attention") or {}}
  return rope_from_hf(full) | {"sliding_rope_theta": float(local.get("rope_theta", hf.get("rope_local_base_freq",
                                                                                         10000.0)))}


def _rope_out(cfg: ModelConfig) -> dict[str, Any]:
  """Both releases' keys: 4's rope_theta, rope_scaling and rope_local_base_freq, 5's per-type rope_parameters."""
  out = rope_to_hf(cfg)
  local = cfg.rope_theta if cfg.sliding_rope_theta is None else cfg.sliding_rope_theta
  return out | {"rope_local_base_freq": local, "rope_parameters": {
      "full_attention": out["rope_parameters"], "sliding_attention": {"rope_type": "default", "rope_theta": local}}}


GEMMA3 = family("gemma3_text", LlamaLike(
    "Gemma3ForCausalLM", norm="sandwich", norm_type="rmsnorm_plus_one", activation="hidden_activation",
    norms={"attn_norm": "input_layernorm", "attn_post_norm": "post_attention_layernorm",
           "mlp_norm": "pre_feedforward_layernorm", "mlp_post_norm": "post_feedforward_layernorm"},
    qk_norm=True, qk_norm_plus_one=True, embed_scale=True, layer_types=_every_sixth,
    windows_out=lambda cfg, types: {"sliding_window": cfg.window or cfg.max_len, "layer_types": types},
    extra_in=_extra_in, extra_out=_extra_out, rope_in=_rope_in, rope_out=_rope_out,
    extra_mapped=frozenset({"scale", "softcap", "logit_softcap", "sliding_rope_theta"})))
