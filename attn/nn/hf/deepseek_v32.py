"""DeepSeek-V3.2 (deepseek_v32) and GLM-5 (glm_moe_dsa): DeepSeek-V3 with the lightning indexer.

Everything but the indexer is attn.nn.hf.deepseek_v3's: mla with the query latent (q_lora_rank is
required: the indexer reads it), DeepSeek's experts. transformers' DeepseekV32Attention always
rotates the main heads' RoPE dims in the interleaved layout (rope_interleave is not read there),
so the layout is "interleaved" whatever the config says, as transformers does. Which layers keep
the dense MLP is mlp_layer_types (the first k "dense", the rest "sparse"; transformers derives it
from first_k_dense_replace when absent); any other pattern is refused by name.

The indexer is attn's in its "deepseek" form (attn.variants.selection, docs/key_selection.md):
index_n_heads, index_head_dim, index_topk are heads, head_dim, top_k; per layer wq_b (n_I·d_I,
Q') is w_idq, wk (d_I, D) w_idk, k_norm (LayerNorm) idk_norm and idk_bias, weights_proj (n_I, D)
w_idw. DeepSeek-V3.2 rotates the index heads' first qk_rope_head_dim dims in the half layout
(rotate_half), GLM-5 in the interleaved one: the family's rope_layout. GLM-5 can reuse a previous
layer's choice (indexer_types "shared", cross-layer top-k sharing, read from indexer_types,
index_topk_pattern or index_topk_freq / index_skip_topk_offset as GlmMoeDsaConfig derives them):
ModelConfig.indexer_types (attn.nn.index_sharing; None when every layer is "full"). A shared layer
holds no indexer, in transformers and in attn; a checkpoint that has one there anyway is read with a
one-line warning and its tensors ignored, as transformers ignores them (never used). "shared" on
layer 0 is refused by name (transformers raises there too). The released checkpoints' fp8 weights are refused on their names (deepseek_v3),
and their multi-token-prediction layer (layer num_hidden_layers) is read and ignored with a one-line
warning, as transformers ignores it. DeepSeek's reference inference code keeps the indexer's key cache in fp8 with a
Hadamard rotation; transformers (and attn) keep it in the model's dtype and skip the rotation (an
orthogonal map: it leaves every q·k as it is).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import numpy as np

from attn.config import invalid
from attn.nn import index_sharing
from attn.nn.config import ModelConfig
from attn.nn.hf import deepseek_v3
from attn.nn.hf.base import Family, Weights, get
from attn.variants.mechanisms import selection


def _indexer_in(hf: dict[str, Any], layout: str) -> dict[str, Any]:
  out = {}
  for key, name in (("heads", "index_n_heads"), ("head_dim", "index_head_dim"), ("top_k", "index_topk")):
    value = get(hf, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise invalid(f"config.{name}", value, "an integer >= 1")
    out[key] = value
  r = hf.get("qk_rope_head_dim")
  if isinstance(r, int) and (out["head_dim"] < r or out["head_dim"] % 2):
    raise invalid("config.index_head_dim", out["head_dim"], f"an even number >= qk_rope_head_dim={r}: the "
                  "indexer rotates its first qk_rope_head_dim dims")
  return out | {"form": "deepseek", "rope_layout": layout}


def _dense_first(hf: dict[str, Any]) -> int:
  """The number of leading dense layers that mlp_layer_types (or first_k_dense_replace) gives."""
  L = get(hf, "num_hidden_layers")
  types = hf.get("mlp_layer_types")
  if types is None:
    return min(deepseek_v3._count(hf, "first_k_dense_replace", 0, default=3), L)
  types = list(types)
  k = next((i for i, t in enumerate(types) if t != "dense"), len(types))
  if len(types) != L or types[k:] != ["sparse"] * (L - k):
    raise invalid("config.mlp_layer_types", types, f"{L} entries, the first k 'dense' and the rest 'sparse': "
                  "attn's moe_dense_first expresses only that pattern")
  return k


def indexer_types(hf: dict[str, Any], L: int) -> list[str]:
  """GLM-5's per-layer "full" / "shared" as transformers' GlmMoeDsaConfig derives them: indexer_types, else
  index_topk_pattern ("F"/"S" per layer), else index_topk_freq and index_skip_topk_offset."""
  if hf.get("indexer_types") is not None:
    return list(hf["indexer_types"])
  pattern = hf.get("index_topk_pattern")
  if pattern is not None:
    return [{"F": "full", "S": "shared"}.get(c, c) for c in pattern] if isinstance(pattern, str) else list(pattern)
  freq, offset = max(hf.get("index_topk_freq", 1), 1), hf.get("index_skip_topk_offset", 2)
  return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(L)]


def config_in_for(layout: str, glm: bool):
  def config_in(hf: dict[str, Any]) -> ModelConfig:
    """deepseek_v3's reader (interleaved RoPE, the dense layers from mlp_layer_types), then the indexer."""
    L = get(hf, "num_hidden_layers")
    types = hf.get("layer_types")
    if types is not None:  # transformers 5.11 to 5.17 write the earlier name; later releases read it as indexed
      types = ["indexed_attention" if t == "deepseek_sparse_attention" else t for t in types]
    if types is not None and types != ["indexed_attention"] * L:
      raise invalid("config.layer_types", types, f"{L} of 'indexed_attention': every layer runs the indexer")
    kinds = indexer_types(hf, L) if glm else ["full"] * L
    if len(kinds) != L or any(k not in ("full", "shared") for k in kinds):
      raise invalid("config.indexer_types", kinds, f"{L} entries (num_hidden_layers), each 'full' or 'shared'")
    if kinds and kinds[0] == "shared":
      raise invalid("config.indexer_types[0]", "shared", "'full': the first layer has no earlier choice to reuse "
                    "(GLM-5's 'shared', from indexer_types, index_topk_pattern or index_topk_freq)")
    if hf.get("q_lora_rank") is None:
      raise invalid("config.q_lora_rank", None, "an integer >= 1: the indexer reads the query latent")
    ix = _indexer_in(hf, layout)
    inner = {k: v for k, v in hf.items() if k not in ("layer_types", "mlp_layer_types")}
    base = deepseek_v3.config_in(inner | {"rope_interleave": True, "first_k_dense_replace": _dense_first(hf)})
    return base.replace(extra={"indexer": ix}, indexer_types=tuple(kinds) if "shared" in kinds else None)
  return config_in


def weights_in(w: Weights, cfg: ModelConfig) -> dict[str, Any]:
  mtp = sorted(n for n in w.names if n.startswith(f"layers.{cfg.num_layers}."))
  if mtp:  # deepseek_v3.weights_in reads them and drops them, as transformers does: say so in one line
    warnings.warn(f"{len(mtp)} tensors of layers.{cfg.num_layers}.* (the multi-token-prediction module) read "
                  "and ignored, as transformers ignores them", stacklevel=2)
  out = deepseek_v3.weights_in(w, cfg)
  D, Q = cfg.d_model, cfg.q_latent_dim
  o = selection.options_of(cfg.head)
  J, I = o["heads"], o["head_dim"]
  ignored = []
  for l in range(cfg.num_layers):
    a = f"layers.{l}.self_attn.indexer"
    if index_sharing.is_shared(cfg, l):  # no indexer here: tensors a checkpoint has anyway are read, not used
      for name in sorted(n for n in w.names if n.startswith(f"{a}.")):
        w(name)
        ignored.append(name)
      continue
    out["blocks"][l]["attn"]["params"] |= {
        "w_idq": w(f"{a}.wq_b.weight", (J * I, Q)).T.reshape(Q, J, I), "w_idk": w(f"{a}.wk.weight", (I, D)).T,
        "idk_norm": w(f"{a}.k_norm.weight", (I,)), "idk_bias": w(f"{a}.k_norm.bias", (I,)),
        "w_idw": w(f"{a}.weights_proj.weight", (J, D)).T}
  if ignored:
    warnings.warn(f"{len(ignored)} indexer tensors of shared layers (indexer_types 'shared': {ignored[0]}, ...) read "
                  "and ignored: a shared layer reuses the previous full layer's choice, as transformers does",
                  stacklevel=2)
  return out


def weights_out(pure: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
  sd = deepseek_v3.weights_out(pure, cfg)
  Q = cfg.q_latent_dim
  for l, block in pure["blocks"].items():
    p, a = block["attn"]["params"], f"model.layers.{l}.self_attn.indexer"
    if "w_idq" not in p:  # a shared layer (indexer_types): no indexer
      continue
    w_idq = np.asarray(p["w_idq"])
    sd |= {f"{a}.wq_b.weight": w_idq.reshape(Q, -1).T, f"{a}.wk.weight": np.asarray(p["w_idk"]).T,
           f"{a}.k_norm.weight": np.asarray(p["idk_norm"]), f"{a}.k_norm.bias": np.asarray(p["idk_bias"]),
           f"{a}.weights_proj.weight": np.asarray(p["w_idw"]).T}
  return sd


def check_out_for(name: str, layout: str):
  def check_out(cfg: ModelConfig) -> None:
    deepseek_v3.check_out(cfg)
    extra = dict(cfg.head.extra or {})
    if set(extra) != {"indexer"} or not selection.is_deepseek(cfg.head) or cfg.q_latent_dim is None:
      raise invalid("extra", extra, f"{{'indexer': {{..., 'form': 'deepseek'}}}} with q_latent_dim: {name}'s "
                    "attention runs DeepSeek-V3.2's indexer on the query latent")
    if selection.options_of(cfg.head)["rope_layout"] != layout or cfg.rope_layout != "interleaved":
      raise invalid("extra.indexer.rope_layout, rope_layout",
                    (selection.options_of(cfg.head)["rope_layout"], cfg.rope_layout),
                    f"({layout!r}, 'interleaved'): {name}'s index heads and attention heads rotate so")
  return check_out


def config_out_for(architecture: str, glm: bool):
  def config_out(cfg: ModelConfig) -> dict[str, Any]:
    out = deepseek_v3.config_out(cfg)
    o = selection.options_of(cfg.head)
    out.pop("rope_interleave")
    k = out["first_k_dense_replace"]
    out |= {"architectures": [architecture], "index_n_heads": o["heads"], "index_head_dim": o["head_dim"],
            "index_topk": o["top_k"], "mlp_layer_types": ["dense"] * k + ["sparse"] * (cfg.num_layers - k)}
    if glm:
      out["indexer_types"] = list(cfg.indexer_types or ["full"] * cfg.num_layers)
    else:  # DeepseekV32Config of transformers 5.11 and 5.12 builds its experts from num_experts (256 unless given)
      out["num_experts"] = out["n_routed_experts"]
    return out
  return config_out


def _family(name: str, architecture: str, layout: str, glm: bool) -> Family:
  return dataclasses.replace(
      deepseek_v3.DEEPSEEK_V3, name=name, model_types=(name,), architectures=(architecture,),
      config_in=config_in_for(layout, glm), weights_in=weights_in, weights_out=weights_out,
      config_out=config_out_for(architecture, glm), check_out=check_out_for(name, layout),
      mapped=deepseek_v3.DEEPSEEK_V3.mapped | {"extra"} | ({"indexer_types"} if glm else set()))


DEEPSEEK_V32 = _family("deepseek_v32", "DeepseekV32ForCausalLM", "half", glm=False)
GLM_MOE_DSA = _family("glm_moe_dsa", "GlmMoeDsaForCausalLM", "interleaved", glm=True)
