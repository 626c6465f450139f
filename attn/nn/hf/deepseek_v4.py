"""DeepSeek-V4 (model_type deepseek_v4, DeepseekV4ForCausalLM): compressed_shared layers, hyper-connections,
DeepSeek-V4's experts.

Attention is attn.variants.compressed_shared in every layer: one kv head of head_dim whose rotated key
is also the value (kv_proj, kv_norm), the query through q_lora_rank (q_a_proj, q_a_norm, q_b_proj,
the weightless q_b_norm), sinks, the sliding window, the grouped low-rank output (o_a_proj: o_groups
groups of rank o_lora_rank, o_b_proj). The layer types map one to one: sliding_attention (no entries,
RoPE at rope_theta: attn's sliding_rope_theta), heavily_compressed_attention (entries of
compress_rates' m, one series) and compressed_sparse_attention (m with two series, V4's overlap),
both at compress_rope_theta (with its yarn, if any: the model's RoPE), the latter with the indexer. V4 rotates the last
qk_rope_head_dim dims of a head in interleaved pairs, attn the first: every per-head axis (q_b_proj's
rows, kv_proj's, the compressor's kv_proj, gate_proj and position_bias, both kv_norms, o_a_proj's
columns: the values are the keys) is permuted by PERM on the way in and back on the way out, bit for
bit. Residual streams: hc_mult (attn.nn.hyper; attn_hc, ffn_hc and hc_head). Experts: the
sqrtsoftplus router with the correction bias, routed_scaling_factor, the clamped SwiGLU
(swiglu_limit, moe_swiglu_form "clamp") on the routed and the one shared expert.

compressed_sparse_attention layers run their lightning indexer (compressed_shared's
compress_index_heads, _dim, _topk: index_n_heads, index_head_dim, index_topk; its compressor, q_b_proj
from the query latent and weights_proj, its dims permuted as the heads'). Refused by name before any
weight is read: mlp_layer_types other than k "hash_moe" then "moe" (the hash layers are attn's
moe_hash_first: experts from the table tid2eid[token], a buffer), num_key_value_heads other than 1,
hc_mult 1 (V4 still has weights there; attn's hc_mult 1 is the plain residual), a quantization_config
(fp8 / fp4 experts: dequantize first), scoring functions other than sqrtsoftplus and sigmoid, RoPE
types attn does not run. Read and ignored, with a one-line note, as transformers ignores them: the
multi-token-prediction module's tensors (mtp.*), norm_topk_prob False (V4's router always
renormalises), n_shared_experts other than 1 (V4 builds one shared expert of moe_intermediate_size).

The indexer's head weights: transformers 5.8 and 5.9 (DeepSeek-V4's first releases) hold them on the indexer,
compressor.indexer.weights_proj (and their save_pretrained writes that name); 5.10 on (5.25 read) hold them in a
DeepseekV4IndexerScorer submodule, compressor.indexer.scorer.weights_proj, and map the older name onto it on
load (conversion_mapping). DeepSeek's release names them indexer.weights_proj. module_name reads all three as
the current name (`released`, and weights_in itself), so a checkpoint of any of these releases loads; to_hf
writes the name the installed release's model holds (live_names), so to_hf(...).save_pretrained then from_hf
round-trips on each; a name neither layout has is still refused by name, the family named. 5.8's save_pretrained
writes the experts as experts..{e}.w1 / w2 / w3 (its conversion_mapping's escaped source patterns reversed;
5.8 loads them back, 5.9 fixed the patterns): read as experts.{e}.w1, DeepSeek's names. 5.8 and 5.9 also
compute the shared expert's SwiGLU unclamped (their DeepseekV4MLP has no swiglu_limit; 5.10 on clamp it as the
routed experts, as attn does): to_hf there warns that its model computes otherwise where the shared expert's
activations pass swiglu_limit.
"""

from __future__ import annotations

import importlib.metadata
import re
import warnings
from typing import Any

import numpy as np

from attn.config import invalid
from attn.nn.config import ModelConfig
from attn.nn.hf import deepseek_v3
from attn.nn.hf.base import Family, Weights, activation, activation_out, decoder_in, get
from attn.nn.hf.rope import rope_from_hf, rope_to_hf

CSA, HCA, SWA = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
_RATES = {CSA: 4, HCA: 128}


def perm(K: int, r: int) -> np.ndarray:
  """attn's dim i of a head is V4's dim perm[i]: V4's trailing rope slice first, then the rest."""
  return np.concatenate([np.arange(K - r, K), np.arange(K - r)]).astype(np.int64)


def _rope_dim(hf: dict[str, Any], K: int) -> int:
  p = hf.get("partial_rotary_factor")
  if p is None:
    r = hf.get("qk_rope_head_dim")
    return int(r) if r is not None else K // 8
  return int(K * float(p))


def _ropes(hf: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
  """(main, compress) rope dicts as DeepseekV4Config.__post_init__ nests them."""
  rp = dict(hf.get("rope_parameters") or {})
  if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
    return dict(rp["main"]), dict(rp["compress"])
  main = {"rope_type": "default", "rope_theta": hf.get("rope_theta", 10000.0)}
  comp = {k: v for k, v in rp.items() if k not in ("main", "compress")}
  return main, {"rope_type": "default", **comp, "rope_theta": hf.get("compress_rope_theta", 160000.0)}


def config_in(hf: dict[str, Any]) -> ModelConfig:
  D, H, L = get(hf, "hidden_size"), get(hf, "num_attention_heads"), get(hf, "num_hidden_layers")
  K, Q = get(hf, "head_dim"), get(hf, "q_lora_rank")
  if hf.get("quantization_config"):
    raise invalid("config.quantization_config", hf["quantization_config"], "absent: attn reads bf16 or float32 "
                  "weights, not DeepSeek-V4's fp8 / fp4 experts; dequantize the checkpoint first")
  if hf.get("num_key_value_heads", 1) != 1:
    raise invalid("config.num_key_value_heads", hf["num_key_value_heads"], "1: V4's kv_proj is one head, "
                  "shared by every query head as keys and values")
  n = get(hf, "hc_mult")
  if isinstance(n, bool) or not isinstance(n, int) or n < 2:
    raise invalid("config.hc_mult", n, "an integer >= 2: V4's hyper-connections hold weights even with one "
                  "stream, and attn's hc_mult=1 is the plain residual")
  types = list(hf.get("layer_types") or [])
  if len(types) != L or set(types) - {CSA, HCA, SWA}:
    raise invalid("config.layer_types", types, f"{L} entries of {[SWA, CSA, HCA]}")
  mlp_types = list(hf.get("mlp_layer_types") or [])
  n_hash = next((i for i, t in enumerate(mlp_types) if t != "hash_moe"), len(mlp_types))
  if len(mlp_types) != L or mlp_types[n_hash:] != ["moe"] * (L - n_hash):
    raise invalid("config.mlp_layer_types", mlp_types, f"{L} entries, the first k 'hash_moe' and the rest 'moe': "
                  "attn's moe_hash_first expresses only that pattern")
  scoring = hf.get("scoring_func", "sqrtsoftplus")
  if scoring not in ("sqrtsoftplus", "sigmoid"):
    raise invalid("config.scoring_func", scoring, "'sqrtsoftplus' or 'sigmoid': the routers attn's MoE has")
  if hf.get("norm_topk_prob", True) is False:
    warnings.warn("deepseek_v4: norm_topk_prob=False read and ignored, as transformers' V4 router always "
                  "renormalises the kept weights", stacklevel=3)
  if hf.get("n_shared_experts", 1) != 1:
    warnings.warn(f"deepseek_v4: n_shared_experts={hf['n_shared_experts']} read and ignored, as transformers "
                  "builds one shared expert of moe_intermediate_size", stacklevel=3)
  main, comp = _ropes(hf)
  if main.get("rope_type", "default") != "default":
    raise invalid("config.rope_parameters.main.rope_type", main["rope_type"], "'default': the sliding layers' "
                  "RoPE is plain in V4")
  rope = rope_from_hf({"rope_parameters": {k: v for k, v in comp.items() if k != "partial_rotary_factor"},
                       "max_position_embeddings": hf.get("max_position_embeddings")}, partial=True)
  r = _rope_dim(hf, K)
  rates = {**_RATES, **dict(hf.get("compress_rates") or {})}
  heads = {}
  if HCA in types:
    heads[HCA] = {"compress_block": int(rates[HCA])}
  if CSA in types:
    index = {f"compress_index_{k}": get(hf, name) for k, name in (("heads", "index_n_heads"),
                                                                  ("dim", "index_head_dim"), ("topk", "index_topk"))}
    for k, v in index.items():
      if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise invalid(f"config.index_{k.split('_')[-1]}", v, "an integer >= 1: the CSA layers' indexer reads it")
    if index["compress_index_dim"] < r:
      raise invalid("config.index_head_dim", index["compress_index_dim"], f">= the rotated width {r}: the "
                    "indexer rotates its keys' last qk_rope_head_dim dims")
    heads[CSA] = {"compress_block": int(rates[CSA]), "compress_overlap": True, **index}
  eps = float(hf.get("rms_norm_eps", 1e-6))
  return ModelConfig(
      vocab_size=get(hf, "vocab_size"), d_model=D, num_layers=L, num_heads=H, d_ff=get(hf, "moe_intermediate_size"),
      d_k=K, d_v=K, num_kv_heads=1, variant="compressed_shared", max_len=get(hf, "max_position_embeddings"),
      positional="rope", rope_dim=r, rope_layout="interleaved", **rope,
      sliding_rope_theta=float(main.get("rope_theta", 10000.0)) if SWA in types else None,
      layer_types=tuple(types), layer_heads=heads or None, window=int(get(hf, "sliding_window")),
      q_latent_dim=Q, latent_norm_eps=eps, sinks=True, o_groups=get(hf, "o_groups"), o_rank=get(hf, "o_lora_rank"),
      norm="pre", norm_type="rmsnorm", final_norm=True, use_bias=False, norm_eps=eps,
      activation=activation(hf, "hidden_act", "silu"), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      mlp="moe", moe_experts=get(hf, "n_routed_experts"), moe_top_k=get(hf, "num_experts_per_tok"),
      moe_d_ff=get(hf, "moe_intermediate_size"), moe_router=scoring, moe_norm_topk=True,
      moe_routed_scaling=float(hf.get("routed_scaling_factor", 1.5)), moe_shared_experts=1,
      moe_swiglu_limit=float(get(hf, "swiglu_limit")), moe_swiglu_form="clamp", moe_hash_first=n_hash,
      hc_mult=n, hc_sinkhorn_iters=int(hf.get("hc_sinkhorn_iters", 20)), hc_eps=float(hf.get("hc_eps", 1e-6)))


def _experts_in(w: Weights, m: str, cfg: ModelConfig, l: int) -> dict[str, Any]:
  """deepseek_v3's experts; a hash layer has the table tid2eid (vocab, k) in place of the correction bias."""
  if not cfg.is_hash_layer(l):
    return deepseek_v3.experts_in(w, m, cfg)
  table = w(f"{m}.gate.tid2eid", (cfg.vocab_size, cfg.moe_top_k))
  if table.min() < 0 or table.max() >= cfg.moe_experts:
    raise invalid(f"checkpoint {m}.gate.tid2eid", f"[{int(table.min())}, {int(table.max())}]",
                  f"expert ids in [0, {cfg.moe_experts})")
  out = deepseek_v3.experts_in(_NoCorrection(w), m, cfg)
  del out["correction"]
  return out | {"tid2eid": table.astype(np.int32)}


class _NoCorrection:
  """w, answering the correction bias a hash layer lacks with zeros (dropped by the caller)."""

  def __init__(self, w: Weights):
    self.w = w

  def __contains__(self, name: str) -> bool:
    return name in self.w

  def __call__(self, name: str, shape=None):
    return np.zeros(shape, np.float32) if name.endswith("e_score_correction_bias") else self.w(name, shape)


def _hc_in(w: Weights, at: str, n: int, D: int, head: bool = False) -> dict[str, np.ndarray]:
  if head:
    return {"fn": w(f"{at}.hc_fn", (n, n * D)), "base": w(f"{at}.hc_base", (n,)), "scale": w(f"{at}.hc_scale", (1,))}
  width = (2 + n) * n
  return {"fn": w(f"{at}.fn", (width, n * D)), "base": w(f"{at}.base", (width,)), "scale": w(f"{at}.scale", (3,))}


def attention_in(w: Weights, a: str, cfg: ModelConfig, l: int) -> dict[str, np.ndarray]:
  head = cfg.layer_head(l)
  D, H, K, Q, r = cfg.d_model, cfg.num_heads, head.d_k, head.q_latent_dim, head.rope_dim
  g, R = head.o_groups, head.o_rank
  j = perm(K, r)
  p = {"w_dq": w(f"{a}.q_a_proj.weight", (Q, D)).T, "q_latent_norm": w(f"{a}.q_a_norm.weight", (Q,)),
       "w_uq": w(f"{a}.q_b_proj.weight", (H * K, Q)).T.reshape(Q, H, K)[..., j],
       "w_kv": w(f"{a}.kv_proj.weight", (K, D)).T.reshape(D, 1, K)[..., j],
       "kv_norm": w(f"{a}.kv_norm.weight", (K,))[j][None],
       "w_oa": w(f"{a}.o_a_proj.weight", (g * R, H * K // g)).reshape(g, R, H // g, K)[..., j]
       .reshape(g, R, H * K // g).transpose(0, 2, 1),
       "w_ob": w(f"{a}.o_b_proj.weight", (D, g * R)).T, "sinks": w(f"{a}.sinks", (H,))}
  m = head.compress_block
  if m is not None:
    P = 2 if head.compress_overlap else 1
    c = f"{a}.compressor"
    p |= {"w_ck": w(f"{c}.kv_proj.weight", (P * K, D)).T.reshape(D, P, 1, K)[..., j],
          "w_zk": w(f"{c}.gate_proj.weight", (P * K, D)).T.reshape(D, P, 1, K)[..., j],
          "b_ck": w(f"{c}.position_bias", (m, P * K)).reshape(m, P, 1, K).transpose(1, 0, 2, 3)[..., j],
          "n_ck": w(f"{c}.kv_norm.weight", (K,))[j][None]}
  if head.compress_index_heads:
    n, I, i = head.compress_index_heads, head.compress_index_dim, f"{a}.compressor.indexer"
    ji = perm(I, r)
    p |= {"w_ic": w(f"{i}.kv_proj.weight", (P * I, D)).T.reshape(D, P, 1, I)[..., ji],
          "w_iz": w(f"{i}.gate_proj.weight", (P * I, D)).T.reshape(D, P, 1, I)[..., ji],
          "b_ic": w(f"{i}.position_bias", (m, P * I)).reshape(m, P, 1, I).transpose(1, 0, 2, 3)[..., ji],
          "n_ic": w(f"{i}.kv_norm.weight", (I,))[ji][None],
          "w_iq": w(f"{i}.q_b_proj.weight", (n * I, Q)).T.reshape(Q, n, I)[..., ji],
          "w_iw": w(f"{i}.scorer.weights_proj.weight", (n, D)).T}
  return p


# DeepSeek's names (the release's, and what transformers' save_pretrained writes back) -> transformers' module
# names, in order (transformers' conversion_mapping for deepseek_v4 of 5.15 on, written out; the first rule is
# 5.10 to 5.14's, for what 5.8 and 5.9 hold and save).
_RENAMES = tuple((re.compile(a), b) for a, b in (
    (r"\.compressor\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),  # 5.8 and 5.9's
    (r"\.experts\.\.(\d+)\.", r".experts.\1."),  # what 5.8's save_pretrained writes (experts..{e}.w1)
    (r"\.attn\.", ".self_attn."), (r"\.ffn\.", ".mlp."), (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight", "embed_tokens.weight"), (r"^head\.weight", "lm_head.weight"),
    (r"^hc_head_(fn|base|scale)", r"hc_head.hc_\1"), (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."), (r"\.hc_attn_(fn|base|scale)", r".attn_hc.\1"),
    (r"\.hc_ffn_(fn|base|scale)", r".ffn_hc.\1"), (r"\.attn_sink", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."), (r"\.norm\.", ".kv_norm."), (r"\.ape", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."), (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."), (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."), (r"\.wo_a\.", ".o_a_proj."), (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."), (r"\.gate\.bias", ".gate.e_score_correction_bias"),
    (r"\.w1\.", ".gate_proj."), (r"\.w3\.", ".up_proj."), (r"\.w2\.", ".down_proj.")))


def module_name(name: str) -> str:
  """A checkpoint tensor's name as transformers' DeepseekV4ForCausalLM names it (the same if it is already)."""
  for pattern, to in _RENAMES:
    name = pattern.sub(to, name)
  return name


def released(arrays: dict[str, Any]) -> dict[str, Any]:
  """A checkpoint's tensors under transformers' current module names (module_name), the prefix model. dropped
  first (DeepSeek's names have none, and module_name's rules read names without it)."""
  return {module_name(name.removeprefix("model.")): a for name, a in arrays.items()}


def weights_in(w: Weights, cfg: ModelConfig) -> dict[str, Any]:
  """Reads a checkpoint under DeepSeek's names or transformers' (module_name), every tensor marked read in w."""
  scales = sorted(n for n in w.names if n.endswith(("scale_inv", ".scale")) and "hc_" not in n and "_hc." not in n)
  if scales:  # quantized experts: refused on the names, before a weight is read
    raise invalid("checkpoint", scales[:2], "bf16 or float32 weights: attn does not dequantize DeepSeek-V4's "
                  "fp8 / fp4 blocks; convert them first")
  back = {module_name(n): n for n in w.names}
  named = Weights({new: w.arrays[old] for new, old in back.items()}, family=w.family)
  out = _weights_in(named, cfg)
  w.used |= {back[n] for n in named.used}
  return out


def _weights_in(w: Weights, cfg: ModelConfig) -> dict[str, Any]:
  mtp = sorted(n for n in w.names if n.startswith("mtp."))
  if mtp:
    warnings.warn(f"deepseek_v4: {len(mtp)} tensors of mtp.* (the multi-token-prediction module) read and "
                  "ignored, as transformers ignores them", stacklevel=3)
    for name in mtp:
      w(name)
  D, N, n = cfg.d_model, cfg.vocab_size, cfg.hc_mult
  norm = lambda name: {"scale": w(f"{name}.weight", (D,))}  # noqa: E731
  blocks = {}
  for l in range(cfg.num_layers):
    at = f"layers.{l}"
    blocks[l] = {"attn": {"params": attention_in(w, f"{at}.self_attn", cfg, l)},
                 "mlp": _experts_in(w, f"{at}.mlp", cfg, l),
                 "attn_norm": norm(f"{at}.input_layernorm"), "mlp_norm": norm(f"{at}.post_attention_layernorm"),
                 "attn_hc": _hc_in(w, f"{at}.attn_hc", n, D), "mlp_hc": _hc_in(w, f"{at}.ffn_hc", n, D)}
  out = {**decoder_in(w, blocks, norm, cfg, N, D), "hc_head": _hc_in(w, "hc_head", n, D, head=True)}
  return out


def attention_out(p: dict[str, np.ndarray], a: str, cfg: ModelConfig, l: int) -> dict[str, np.ndarray]:
  head = cfg.layer_head(l)
  D, H, K, Q, r = cfg.d_model, cfg.num_heads, head.d_k, head.q_latent_dim, head.rope_dim
  g, R = head.o_groups, head.o_rank
  inv = np.argsort(perm(K, r))
  w_oa = p["w_oa"].transpose(0, 2, 1).reshape(g, R, H // g, K)[..., inv].reshape(g * R, H * K // g)
  sd = {f"{a}.q_a_proj.weight": p["w_dq"].T, f"{a}.q_a_norm.weight": p["q_latent_norm"],
        f"{a}.q_b_proj.weight": p["w_uq"][..., inv].reshape(Q, H * K).T,
        f"{a}.kv_proj.weight": p["w_kv"][..., inv].reshape(D, K).T, f"{a}.kv_norm.weight": p["kv_norm"][0][inv],
        f"{a}.o_a_proj.weight": w_oa, f"{a}.o_b_proj.weight": p["w_ob"].T, f"{a}.sinks": p["sinks"]}
  m = head.compress_block
  if m is not None:
    P, c = (2 if head.compress_overlap else 1), f"{a}.compressor"
    sd |= {f"{c}.kv_proj.weight": p["w_ck"][..., inv].reshape(D, P * K).T,
           f"{c}.gate_proj.weight": p["w_zk"][..., inv].reshape(D, P * K).T,
           f"{c}.position_bias": p["b_ck"][..., inv].transpose(1, 0, 2, 3).reshape(m, P * K),
           f"{c}.kv_norm.weight": p["n_ck"][0][inv]}
  if head.compress_index_heads:
    n, I, i = head.compress_index_heads, head.compress_index_dim, f"{a}.compressor.indexer"
    iv = np.argsort(perm(I, r))
    sd |= {f"{i}.kv_proj.weight": p["w_ic"][..., iv].reshape(D, P * I).T,
           f"{i}.gate_proj.weight": p["w_iz"][..., iv].reshape(D, P * I).T,
           f"{i}.position_bias": p["b_ic"][..., iv].transpose(1, 0, 2, 3).reshape(m, P * I),
           f"{i}.kv_norm.weight": p["n_ic"][0][iv], f"{i}.q_b_proj.weight": p["w_iq"][..., iv].reshape(Q, n * I).T,
           f"{i}.scorer.weights_proj.weight": p["w_iw"].T}
  return sd


def _unclamped_shared_expert() -> bool:
  """Whether the installed transformers is 5.8 or 5.9 (deepseek_v4's first releases), whose shared expert
  computes its SwiGLU without swiglu_limit."""
  try:
    major, minor = (int(x) for x in importlib.metadata.version("transformers").split(".")[:2])
  except (importlib.metadata.PackageNotFoundError, ValueError):
    return False
  return (major, minor) < (5, 10)


def live_names(sd: dict[str, Any], cfg: ModelConfig, names: frozenset[str]) -> dict[str, Any]:
  """to_hf's tensors for a transformers that holds the indexer's weights_proj on the indexer itself (5.8 and
  5.9; 5.10 on in its scorer submodule); a warning where the release leaves the shared expert unclamped."""
  if _unclamped_shared_expert():
    warnings.warn(f"deepseek_v4: transformers {importlib.metadata.version('transformers')}'s DeepseekV4MLP does "
                  f"not clamp the shared expert at swiglu_limit={cfg.moe_swiglu_limit} (5.10 on does, as attn): the "
                  "model to_hf builds computes otherwise where its activations pass the limit", stacklevel=3)
  out = {}
  for name, a in sd.items():
    old = name.replace(".compressor.indexer.scorer.weights_proj.", ".compressor.indexer.weights_proj.")
    out[old if name not in names and old in names else name] = a
  return out


def _mlp_out(e: dict[str, Any], m: str, cfg: ModelConfig, l: int) -> dict[str, np.ndarray]:
  if not cfg.is_hash_layer(l):
    return deepseek_v3.mlp_out(e, m, cfg, l)
  sd = deepseek_v3.mlp_out(e | {"correction": None}, m, cfg, l)
  del sd[f"{m}.gate.e_score_correction_bias"]
  return sd | {f"{m}.gate.tid2eid": np.asarray(e["tid2eid"]).astype(np.float32)}  # as every tensor of to_hf_state


def _hc_out(h: dict[str, Any], at: str, head: bool = False) -> dict[str, np.ndarray]:
  pre = "hc_" if head else ""
  return {f"{at}.{pre}{k}": np.asarray(h[k]) for k in ("fn", "base", "scale")}


def weights_out(pure: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
  head = pure["embed"]["token"] if cfg.tie_embeddings else np.asarray(pure["head"]["linear"]["kernel"]).T
  sd = {"model.embed_tokens.weight": pure["embed"]["token"], "model.norm.weight": pure["final_norm"]["scale"],
        "lm_head.weight": head, **_hc_out(pure["hc_head"], "model.hc_head", head=True)}
  for l, block in pure["blocks"].items():
    p = {k: np.asarray(v) for k, v in block["attn"]["params"].items()}
    at = f"model.layers.{l}"
    sd |= attention_out(p, f"{at}.self_attn", cfg, int(l)) | _mlp_out(block["mlp"], f"{at}.mlp", cfg, int(l))
    sd |= {f"{at}.input_layernorm.weight": block["attn_norm"]["scale"],
           f"{at}.post_attention_layernorm.weight": block["mlp_norm"]["scale"],
           **_hc_out(block["attn_hc"], f"{at}.attn_hc"), **_hc_out(block["mlp_hc"], f"{at}.ffn_hc")}
  return sd


def check_out(cfg: ModelConfig) -> None:
  types = tuple(cfg.layer_types or ())
  if not types or set(types) - {SWA, HCA, CSA}:
    raise invalid("layer_types", cfg.layer_types, f"a list of {[SWA, HCA, CSA]}: deepseek_v4's layer types")
  table = {k: dict(v) for k, v in (cfg.layer_heads or {}).items()}
  csa = {"compress_block", "compress_overlap", "compress_index_heads", "compress_index_dim", "compress_index_topk"}
  if (set(table) - {HCA, CSA} or (HCA in types and set(table.get(HCA, {})) != {"compress_block"})
      or (CSA in types and (set(table.get(CSA, {})) != csa or not table[CSA]["compress_overlap"]))):
    raise invalid("layer_heads", table, f"{{{HCA!r}: {{'compress_block': m}}, {CSA!r}: {{'compress_block': m, "
                  "'compress_overlap': True, 'compress_index_heads', '_dim', '_topk': ...}}: V4's layer types "
                  "differ by their compression and the CSA layers' indexer only")
  if cfg.num_kv_heads != 1 or cfg.head.d_v != cfg.head.d_k or not cfg.sinks or cfg.window is None:
    raise invalid("num_kv_heads, d_v, sinks, window", (cfg.num_kv_heads, cfg.head.d_v, cfg.sinks, cfg.window),
                  f"(1, d_k={cfg.head.d_k}, True, a window): V4's one shared kv head, sinks and sliding window")
  if cfg.compress_block is not None or cfg.o_rank is None:
    raise invalid("compress_block, o_rank", (cfg.compress_block, cfg.o_rank), "(None, a rank): the sliding "
                  "layers have no entries (the compressed types set theirs), o_lora_rank is stored")
  if cfg.hc_mult < 2:
    raise invalid("hc_mult", cfg.hc_mult, "an integer >= 2: V4's blocks are hyper-connected")
  if not (cfg.moe_router in ("sqrtsoftplus", "sigmoid") and cfg.moe_norm_topk and cfg.moe_groups == 1
          and cfg.moe_dense_first == 0 and cfg.moe_shared_experts == 1 and cfg.moe_shared_d_ff is None
          and cfg.moe_swiglu_form == "clamp" and cfg.moe_d_ff == cfg.d_ff):
    raise invalid("moe_router, moe_norm_topk, moe_groups, moe_dense_first, moe_shared_experts, moe_swiglu_form",
                  (cfg.moe_router, cfg.moe_norm_topk, cfg.moe_groups, cfg.moe_dense_first, cfg.moe_shared_experts,
                   cfg.moe_swiglu_form), "('sqrtsoftplus' or 'sigmoid', True, 1, 0, 1, 'clamp') with moe_d_ff = "
                  "d_ff: V4's router and experts in every layer")
  if cfg.latent_norm_eps != cfg.norm_eps:
    raise invalid("latent_norm_eps", cfg.latent_norm_eps, f"norm_eps={cfg.norm_eps}: V4 has one rms_norm_eps")


def _factor(r: int, K: int) -> float:
  """A partial_rotary_factor that transformers turns back into r rotated dims (int(p·K) = r)."""
  p = r / K
  return p if int(K * p) == r else (r + 0.5) / K


def config_out(cfg: ModelConfig) -> dict[str, Any]:
  types = list(cfg.layer_types)
  K, r = cfg.head.d_k, cfg.rope_dim
  comp = rope_to_hf(cfg)["rope_parameters"] | {"partial_rotary_factor": _factor(r, K)}
  main_theta = cfg.rope_theta if cfg.sliding_rope_theta is None else cfg.sliding_rope_theta
  main = {"rope_type": "default", "rope_theta": main_theta, "partial_rotary_factor": _factor(r, K)}
  rates = dict(_RATES)
  index = {"index_n_heads": 1, "index_head_dim": max(r, 2), "index_topk": 1}  # unread without CSA layers
  for kind in (HCA, CSA):
    if kind in types:
      rates[kind] = dict(cfg.layer_heads)[kind]["compress_block"]
  if CSA in types:
    row = dict(cfg.layer_heads)[CSA]
    index = {f"index_{k}": row[f"compress_index_{j}"] for k, j in (("n_heads", "heads"), ("head_dim", "dim"),
                                                                   ("topk", "topk"))}
  return dict(**index,
      architectures=["DeepseekV4ForCausalLM"], vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
      moe_intermediate_size=cfg.moe_d_ff, num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
      num_key_value_heads=1, head_dim=K, q_lora_rank=cfg.q_latent_dim, partial_rotary_factor=_factor(r, K),
      num_experts_per_tok=cfg.moe_top_k, n_routed_experts=cfg.moe_experts, n_shared_experts=1,
      scoring_func=cfg.moe_router, norm_topk_prob=True, routed_scaling_factor=cfg.moe_routed_scaling,
      max_position_embeddings=cfg.max_len, rope_theta=main_theta, compress_rope_theta=cfg.rope_theta,
      rope_parameters={"main": main, "compress": comp}, layer_types=types, compress_rates=rates,
      hc_mult=cfg.hc_mult, hc_sinkhorn_iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps,
      mlp_layer_types=["hash_moe"] * cfg.moe_hash_first + ["moe"] * (cfg.num_layers - cfg.moe_hash_first),
      swiglu_limit=cfg.moe_swiglu_limit, sliding_window=cfg.window,
      o_groups=cfg.o_groups, o_lora_rank=cfg.o_rank, num_nextn_predict_layers=0,
      hidden_act=activation_out(cfg, ("silu", "gelu_pytorch_tanh", "gelu", "relu")), rms_norm_eps=cfg.norm_eps,
      tie_word_embeddings=cfg.tie_embeddings, attention_bias=False, attention_dropout=0.0,
      pad_token_id=None, bos_token_id=None, eos_token_id=None)


DEEPSEEK_V4 = Family(
    name="deepseek_v4", model_types=("deepseek_v4",), architectures=("DeepseekV4ForCausalLM",),
    config_in=config_in, weights_in=weights_in, weights_out=weights_out, config_out=config_out,
    variant="compressed_shared", prefix="model.",
    refusals={"attention_bias": ((False,), "V4's projections have no biases"),
              "mlp_bias": ((False,), "V4's experts have no biases"),
              "output_router_logits": ((False,), "attn's MoE returns no router logits")},
    fixed={"positional": "rope", "norm": "pre", "norm_type": "rmsnorm", "mlp": "moe", "final_norm": True,
           "use_bias": False, "rope_layout": "interleaved", "num_segments": 0, "embed_scale": False,
           "embed_norm": False},
    mapped=frozenset({"rope_theta", "rope_dim", "rope_scaling", "rope_factor", "rope_original_max_len",
                      "rope_truncate", "rope_attention_factor", "rope_beta_fast", "rope_beta_slow",
                      "sliding_rope_theta", "layer_types", "layer_heads", "window", "sinks", "latent_norm_eps",
                      "o_groups", "o_rank", "tie_embeddings", "moe_experts", "moe_top_k", "moe_d_ff", "moe_router",
                      "moe_norm_topk", "moe_routed_scaling", "moe_shared_experts", "moe_swiglu_limit",
                      "moe_swiglu_form", "moe_hash_first", "hc_mult", "hc_sinkhorn_iters", "hc_eps"}),
    check_out=check_out, released=released, live_names=live_names)
