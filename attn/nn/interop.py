"""Weights to and from flax.nnx.MultiHeadAttention and torch.nn.MultiheadAttention.

Every function speaks the canonical per_head layout (attn.variants.per_head); any other
variant goes through attn.convert. Flax's kernels are already that layout:
query (D,H,K), key (D,G,K), value (D,G,K), out (H,K,D). Flax has one head
width, so d_k = d_v. torch packs in_proj_weight as the rows [W_q; W_k; W_v],
each (D_out, D_in) with heads as consecutive row blocks, and computes x Wᵀ + b;
it has no grouped heads and its head width is D / H, so G = H and
d_k = d_v = D / H. torch is optional and imported only inside the torch
functions. from_hf and to_hf (Hugging Face checkpoints, one family per module)
live in the package attn/nn/hf/ and are re-exported here.
"""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from attn.api import check_params
from attn.config import HeadConfig, invalid
from attn.conversion import convert
from attn.nn.hf import from_hf, to_hf  # noqa: F401  (Hugging Face checkpoints: attn/nn/hf/)
from attn.variants.base import Params


def _default_scale(cfg: HeadConfig, library: str) -> None:
  if cfg.scale is not None and not math.isclose(cfg.scale, 1.0 / math.sqrt(cfg.d_k)):
    raise invalid("scale", cfg.scale,
                  f"None or 1/sqrt(d_k): {library} always scales by 1/sqrt(d_k)")
  if cfg.rope_mscale_all_dim is not None:  # yarn's softmax mscale changes score_scale too
    raise invalid("rope_mscale_all_dim", cfg.rope_mscale_all_dim,
                  f"None: {library} always scales by 1/sqrt(d_k)")


def _check_flax_cfg(cfg: HeadConfig) -> None:
  if cfg.d_v != cfg.d_k:
    raise invalid("d_v", cfg.d_v,
                  f"equal to d_k={cfg.d_k}: flax MultiHeadAttention has one head width")
  _default_scale(cfg, "flax")


def _same(field: str, got: Any, want: Any, why: str) -> None:
  if got != want:
    raise invalid(field, got, f"{want!r} ({why})")


def _per_head(params: Params, cfg: HeadConfig, variant: str) -> Params:
  """params in the per_head layout; attn.convert warns if the variant's conversion is lossy."""
  check_params(variant, params, cfg)
  return convert(params, variant, "per_head", cfg) if variant != "per_head" else params


def from_flax(mha: nnx.MultiHeadAttention, cfg: HeadConfig) -> Params:
  """per_head params computing what `mha` computes (self- or cross-attention, same masks)."""
  if not isinstance(mha, nnx.MultiHeadAttention):
    raise invalid("mha", type(mha).__name__, "a flax.nnx.MultiHeadAttention")
  _check_flax_cfg(cfg)
  _same("mha.in_features", mha.in_features, cfg.d_model, "cfg.d_model")
  _same("mha.in_kv_features", mha.in_kv_features, cfg.d_model, "cfg.d_model")
  _same("mha.out_features", mha.out_features, cfg.d_model, "cfg.d_model")
  _same("mha.num_heads", mha.num_heads, cfg.num_heads, "cfg.num_heads")
  _same("mha.num_kv_heads", mha.num_kv_heads, cfg.num_kv_heads, "cfg.num_kv_heads")
  _same("mha.head_dim", mha.head_dim, cfg.d_k, "cfg.d_k")
  _same("mha.use_bias", mha.use_bias, cfg.use_bias, "cfg.use_bias")
  _same("mha.normalize_qk", mha.normalize_qk, False, "attn has no QK LayerNorm")
  params = {"w_q": mha.query.kernel[...], "w_k": mha.key.kernel[...],
            "w_v": mha.value.kernel[...], "w_o": mha.out.kernel[...]}
  if cfg.use_bias:
    params.update(b_q=mha.query.bias[...], b_k=mha.key.bias[...], b_v=mha.value.bias[...],
                  b_o=mha.out.bias[...])
  check_params("per_head", params, cfg)
  return params


def to_flax(params: Params, cfg: HeadConfig, *, rngs: nnx.Rngs,
            variant: str = "per_head") -> nnx.MultiHeadAttention:
  """A flax.nnx.MultiHeadAttention with the same weights (params of `variant`, via per_head)."""
  _check_flax_cfg(cfg)
  p = _per_head(params, cfg, variant)
  H, K = cfg.num_heads, cfg.d_k
  mha = nnx.MultiHeadAttention(
      num_heads=H, in_features=cfg.d_model, qkv_features=H * K, out_features=cfg.d_model,
      num_kv_heads=cfg.num_kv_heads, use_bias=cfg.use_bias, param_dtype=p["w_q"].dtype,
      decode=False, rngs=rngs)
  for layer, w, b in ((mha.query, "w_q", "b_q"), (mha.key, "w_k", "b_k"),
                      (mha.value, "w_v", "b_v"), (mha.out, "w_o", "b_o")):
    layer.kernel[...] = jnp.asarray(p[w])
    if cfg.use_bias:
      layer.bias[...] = jnp.asarray(p[b])
  return mha


def _check_torch_cfg(cfg: HeadConfig) -> None:
  D, H = cfg.d_model, cfg.num_heads
  if cfg.num_kv_heads != H:
    raise invalid("num_kv_heads", cfg.num_kv_heads,
                  f"num_heads={H}: torch MultiheadAttention has no grouped heads")
  if cfg.d_k * H != D:
    raise invalid("d_k", cfg.d_k,
                  f"d_model / num_heads = {D / H:g}: torch packs heads of width D/H")
  if cfg.d_v != cfg.d_k:
    raise invalid("d_v", cfg.d_v, f"equal to d_k={cfg.d_k}: torch has one head width")
  _default_scale(cfg, "torch")


def _numpy(t) -> np.ndarray:
  return t.detach().cpu().numpy()


def from_torch(m: Any, cfg: HeadConfig) -> Params:
  """per_head params computing what torch `m` computes (masks converted: torch True = blocked)."""
  import torch  # pylint: disable=g-import-not-at-top
  if not isinstance(m, torch.nn.MultiheadAttention):
    raise invalid("m", type(m).__name__, "a torch.nn.MultiheadAttention")
  _check_torch_cfg(cfg)
  D, H, K = cfg.d_model, cfg.num_heads, cfg.d_k
  _same("m.embed_dim", m.embed_dim, D, "cfg.d_model")
  _same("m.num_heads", m.num_heads, H, "cfg.num_heads")
  _same("m.kdim, m.vdim", (m.kdim, m.vdim), (D, D),
        "cfg.d_model; separate key/value input widths are not supported")
  _same("m.in_proj_bias is not None", m.in_proj_bias is not None, cfg.use_bias, "cfg.use_bias")
  _same("m.bias_k is None", m.bias_k is None, True, "add_bias_kv is not supported")
  _same("m.add_zero_attn", m.add_zero_attn, False, "add_zero_attn is not supported")
  w_in = _numpy(m.in_proj_weight)
  w_o = _numpy(m.out_proj.weight)
  params = {name: jnp.asarray(w.T.reshape(D, H, K))
            for name, w in zip(("w_q", "w_k", "w_v"), np.split(w_in, 3))}
  params["w_o"] = jnp.asarray(w_o.T.reshape(H, K, D))
  if cfg.use_bias:
    b_in = _numpy(m.in_proj_bias)
    params.update({name: jnp.asarray(b.reshape(H, K))
                   for name, b in zip(("b_q", "b_k", "b_v"), np.split(b_in, 3))})
    params["b_o"] = jnp.asarray(_numpy(m.out_proj.bias))
  return params


def to_torch(params: Params, cfg: HeadConfig, *, variant: str = "per_head"):
  """A torch.nn.MultiheadAttention (batch_first=True, no dropout) with the same weights."""
  import torch  # pylint: disable=g-import-not-at-top
  _check_torch_cfg(cfg)
  p = {name: np.array(a, np.float32) for name, a in _per_head(params, cfg, variant).items()}
  D = cfg.d_model
  m = torch.nn.MultiheadAttention(D, cfg.num_heads, bias=cfg.use_bias, batch_first=True)
  w_in = np.concatenate([p[name].reshape(D, D).T for name in ("w_q", "w_k", "w_v")])
  with torch.no_grad():
    m.in_proj_weight.copy_(torch.from_numpy(w_in))
    m.out_proj.weight.copy_(torch.from_numpy(np.ascontiguousarray(p["w_o"].reshape(D, D).T)))
    if cfg.use_bias:
      b_in = np.concatenate([p[name].ravel() for name in ("b_q", "b_k", "b_v")])
      m.in_proj_bias.copy_(torch.from_numpy(b_in))
      m.out_proj.bias.copy_(torch.from_numpy(p["b_o"]))
  return m

