"""talking_heads: per_head with the H attention maps mixed across heads (Shazeer et al. 2020).

Talking-heads attention: logits'_h = Σ_i P_l[i,h]·logits_i before the softmax
and weights'_h = Σ_i P_w[i,h]·softmax(logits')_i after it, then head h's
weights' mix kv head g(h)'s values as in per_head (seed question 5's "h
attention matrices", now talking to each other). P_l = I + mix_l and
P_w = I + mix_w are (H,H) and start at the identity (mix_l = mix_w = 0), so
per_head -> talking_heads is exact. Storing the difference from the identity
makes weight decay pull towards per_head, not towards no attention at all.
With the same number of logit, softmax and value heads (H), and grouped kv
heads as in per_head. After P_w the mask is applied again, so a key masked
for head h gets no weight in it even if another head's mask differs.

The kernel: mixing needs every head's explicit (B,H,T,S) logits, so this
variant runs the einsum path (kernel.scores, base.probabilities, weighted_sum);
the per-head fused kernels ("blocked", "xla", "cudnn") never hold all heads'
logits at once and are refused by name. Returned weights are each head's
softmax output, before P_w: distributions over the keys.

Params: per_head's + 2·H².
FLOPs: per_head's + 2·2·T·S·H² (the two mixes).
Effective: a group's R query heads share W_K,g, so mixing within a group stays
  in per_head's class: P_l adds H² − G·R² to the scores' count, capped at the
  dimension of all H score functions (base.score_space_dim); P_w likewise to
  the Σ_g lowrank(D, R·D; V) of W_V·W_O (base.value_output_dof), capped at
  H·D²; + b·D. With QK-norm, W_Q absorbs no mix of normalised queries: P_l adds
  H² − 1 (one scale trades with the norm scales). With an output gate, W_O,h
  absorbs only P_w's column scales: P_w adds H² − H, capped at H²·(D + b)·D.
KV cache: G·(K + V) per token. Score weights: D·(H + G)·K + H² (mix_l).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attn import kernel
from attn.config import HeadConfig, invalid
from attn.variants import factors, per_head
from attn.variants.base import (Options, Params, Variant, bias, cached_kv, factored_score_dof,
                                full_mask, probabilities, project_heads, project_out,
                                queries_and_keys, score_space_dim, standard_flops,
                                standard_kv_cache_width, standard_param_count,
                                standard_score_weights, value_output_dof)


def check(cfg: HeadConfig) -> None:
  if cfg.qk_norm == "whole":
    raise invalid("qk_norm", "whole", "False or True for talking_heads: its effective count assumes per-head QK-norm; a norm over the whole projection is not counted")
  for name in ("moba", "indexer", "nsa"):
    if cfg.extra and name in cfg.extra:
      raise invalid(f"extra.{name}", dict(cfg.extra[name]), "absent for talking_heads: it mixes the "
                    "logits across heads before the softmax on its own path, which a key selection "
                    "(attn.variants.selection) does not reach")


def init(key, cfg: HeadConfig, dtype=jnp.float32) -> Params:
  H = cfg.num_heads
  return per_head.init(key, cfg, dtype) | {"mix_l": jnp.zeros((H, H), dtype), "mix_w": jnp.zeros((H, H), dtype)}


def mixing(params: Params, name: str) -> jax.Array:
  """P_l (name "mix_l") or P_w ("mix_w"): the identity plus the stored difference, float32."""
  m = params[name].astype(jnp.float32)
  return m + jnp.eye(m.shape[0], dtype=jnp.float32)


def apply(params: Params, x_BTD, context_BSD=None, *, cfg: HeadConfig,
          opts: Options = Options()):
  """Per-head projections, logits mixed across heads, softmax, weights mixed, values."""
  if opts.impl not in (None, "auto", "einsum"):
    raise invalid("impl", opts.impl, '"einsum" or "auto" for talking_heads: mixing logits across '
                  "heads needs all H score matrices, which the per-head fused kernels never hold")
  c_BSD = x_BTD if context_BSD is None else context_BSD
  q_BTHK = project_heads(x_BTD, params["w_q"], bias(params, "b_q"))
  k_BSGK = project_heads(c_BSD, params["w_k"], bias(params, "b_k"))
  v_BSGV = project_heads(c_BSD, params["w_v"], bias(params, "b_v"))
  q_BTHK, k_BSGK = queries_and_keys(params, q_BTHK, k_BSGK, cfg=cfg, opts=opts)
  k_BSGK, v_BSGV = cached_kv(k_BSGK, v_BSGV)
  T, S = x_BTD.shape[1], k_BSGK.shape[1]
  logits_BITS = kernel.scores(q_BTHK, k_BSGK) * cfg.score_scale
  logits_BHTS = jnp.einsum("BITS,IH->BHTS", logits_BITS, mixing(params, "mix_l"))
  mask = full_mask(T, S, cfg=cfg, opts=opts)
  probs_BITS = probabilities(params, logits_BHTS, mask, cfg=cfg)
  mixed_BHTS = jnp.einsum("BITS,IH->BHTS", probs_BITS, mixing(params, "mix_w"))
  if mask is not None:
    mixed_BHTS = jnp.where(mask, mixed_BHTS, 0.0)
  out_BTHV = kernel.weighted_sum(mixed_BHTS, v_BSGV).astype(x_BTD.dtype)
  y_BTD = project_out(params, x_BTD, out_BTHV, cfg=cfg, opts=opts)
  return y_BTD, (probs_BITS if opts.return_weights else None)


def param_count(cfg: HeadConfig) -> int:
  return standard_param_count(cfg) + 2 * cfg.num_heads ** 2


def effective_param_count(cfg: HeadConfig) -> int:
  D, H, G, R = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.group_size
  b = 1 if cfg.use_bias else 0
  mixing = H * H - G * R * R
  if cfg.qk_norm == "fixed":  # no learned scale trades against the mixing's: all of it is free
    scores = factored_score_dof(cfg, D, D) + H * H
  elif cfg.qk_norm:
    scores = factored_score_dof(cfg, D, D) + H * H - 1
  else:
    scores = min(factored_score_dof(cfg, D, D) + mixing, score_space_dim(cfg, D, D))
  values = value_output_dof(cfg, D) - b * D
  if cfg.gate is None:
    values = min(values + mixing, H * (D + (b if cfg.sinks else 0)) * D)
  else:
    values = min(values + H * H - H, H * H * (D + b) * D)
  return scores + values + b * D


def flops(cfg: HeadConfig, T: int, S: int) -> int:
  return standard_flops(cfg, T, S) + 4 * T * S * cfg.num_heads ** 2


def score_weights(cfg: HeadConfig) -> int:
  return standard_score_weights(cfg) + cfg.num_heads ** 2


def circuits(p: Params, cfg: HeadConfig) -> dict:
  """Per_head's circuits mixed, qk[h] = Σ_i P_l[i,h]·qk_i and ov[i] = Σ_h P_w[i,h]·ov_h, so that the
  circuit formulas hold with the returned (pre-P_w) weights: qk width H·d_k, ov H·d_v."""
  mix = factors.einsum
  H, D = cfg.num_heads, cfg.d_model
  heads = factors.from_per_head(p, cfg)
  w_q_IDK, w_k_IDK = heads["qk"]
  w_v_IDV, w_o_IDV = heads["ov"]
  eye = jnp.eye(H, dtype=p["mix_l"].dtype)
  p_l, p_w = eye + p["mix_l"], eye + p["mix_w"]

  def stacked(a_IDW):  # (D, I·W), the same for every head
    return jnp.broadcast_to(a_IDW.transpose(1, 0, 2).reshape(D, -1), (H, D, a_IDW.size // D))

  out = {"qk": (mix("IH,IDK->HDIK", p_l, w_q_IDK).reshape(H, D, -1), stacked(w_k_IDK)),
         "ov": (mix("IH,HDV->IDHV", p_w, w_v_IDV).reshape(H, D, -1), stacked(w_o_IDV))}
  if cfg.use_bias:
    out.update({n: mix("IH,I...->H...", p_l, heads[n]) for n in ("qk_key_bias", "qk_query_bias", "qk_const")})
    out.update(ov_bias=mix("IH,H...->I...", p_w, heads["ov_bias"]), b_o=heads["b_o"])
  return out


VARIANT = Variant(
    name="talking_heads",
    lacks={"qkv_heads": "talking_heads computes its logits itself, not through attend_and_project"},
    check=check,
    sharding={"mix_l": None, "mix_w": None},
    init=init,
    apply=apply,
    param_count=param_count,
    effective_param_count=effective_param_count,
    flops=flops,
    kv_cache_width=standard_kv_cache_width,
    score_weights=score_weights,
    circuits=circuits,
)
