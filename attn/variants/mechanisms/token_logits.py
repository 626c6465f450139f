"""Mechanisms that read each query token and its position (Inkling-2's): per-token sinks, a relative position
bias mixed from the token, log-position scaling of the queries.

They act through one point of the shared path, `on_tokens(params, x_BTD, q_BTHK, *, cfg, positions)` ->
(q, logits_bias or None), called by attn.variants.base.core right before the kernel with the layer's
query-side input x, the queries as the scores read them (after QK-norm, the clip and RoPE) and positions =
(the queries' (T,)|(B,T), the keys' (S,)|(B,S): 0..T−1 and 0..S−1 in a full pass, the cache slots' while
decoding, Options.key_positions). The biases of the active records add up and join kernel.attention's
logits_bias (after a soft-cap, before the masks).

  token_sinks         w_sink (D,H): the sink logit of query t in head h is z = x_t·w_sink[:, h] (Inkling-2's
      sink_proj), one more logit with no value in its softmax. The same function as a sink logit 0 and
      −z added to every logit of the row (multiply the row's numerator and denominator by e^(−z)), which is
      how it reaches the kernel: sinks zeros (H,) and logits_bias −z (B,H,T,1).
  rel_bias_dim d      w_rel (D,H,d), rel_scale (H,d), rel_proj (d,E), E = rel_bias_extent: query t's state
      r = clip(x_t·w_rel ⊙ rel_scale) per head (L2 clip to rel_bias_clip, Inkling-2's; times the log
      scaling where log_scaling_alpha is set), its bias toward key s b = (r·rel_proj)[t − s] for
      0 ≤ t − s < E and 0 beyond (Inkling-2's relative_position_bias: wr_du, rel_logits_proj).
  log_scaling_alpha α no parameters: the queries at position p times τ(p) = 1 + α·log(max((p + 1)/f, 1)),
      f = log_scaling_floor (Inkling-2's full layers, after the clip): 1 up to position f − 1.

Decoding needs nothing more: each reads the new tokens and their positions, and the keys' positions are
the cache's (attn.variants.cache sets Options.key_positions). Variants offering "qkv_heads" run them (the
others do not reach base.core with their queries as such); a key-selecting mechanism refuses them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attn.config import HeadConfig
from attn.variants.mechanisms.head_mechanisms import l2_clip
from attn.variants.mechanisms.record import Mechanism

Array = jax.Array
Params = dict[str, Array]

_NEEDS = {"qkv_heads": "it reads each query token and position beside the per-head projections that "
                       "attend_and_project hands to the core"}


def _zero(cfg: HeadConfig, *lengths) -> int:
  del cfg, lengths
  return 0


def log_scale(positions: Array, alpha: float, floor: int) -> Array:
  """τ(p) = 1 + α·log(max((p + 1)/floor, 1)) in float32, the shape of positions."""
  p = positions.astype(jnp.float32)
  return 1.0 + alpha * jnp.log(jnp.maximum((p + 1.0) / floor, 1.0))


def _per_query(scale_T: Array, x: Array) -> Array:
  """x (B,T,H,·) times a per-position factor (T,) or (B,T), in float32, returned in x's dtype."""
  s = scale_T[None, :] if scale_T.ndim == 1 else scale_T
  return (x.astype(jnp.float32) * s[:, :, None, None]).astype(x.dtype)


# token_sinks

def _sinks_init(key: Array, cfg: HeadConfig, dtype=jnp.float32) -> Params:
  D, H = cfg.d_model, cfg.num_heads
  return {"w_sink": (jax.random.normal(key, (D, H), jnp.float32) / jnp.sqrt(D)).astype(dtype)}


def _sinks(params: Params, x_BTD: Array, q_BTHK: Array, *, cfg: HeadConfig, positions) -> tuple[Array, Array]:
  del positions
  z_BTH = jnp.einsum("BTD,DH->BTH", x_BTD, params["w_sink"], preferred_element_type=jnp.float32)
  return q_BTHK, -jnp.transpose(z_BTH, (0, 2, 1))[..., None]


TOKEN_SINKS = Mechanism(
    name="token_sinks", fields=("token_sinks",), init=_sinks_init, sharding={"w_sink": "DH"},
    on_tokens=_sinks, kernel=lambda params, cfg: {"sinks": jnp.zeros((cfg.num_heads,), jnp.float32)},
    param_count=lambda cfg: cfg.d_model * cfg.num_heads,  # effective count measured: the sink frees b_v as sinks do
    flops=lambda cfg, T, S: 2 * T * cfg.d_model * cfg.num_heads, score_weights=_zero, needs=_NEEDS,
    examples=(("token_sinks", {"token_sinks": True}, "D·H", "2·T·D·H"),),
    help="token_sinks: each query token's own sink logit per head, x·w_sink (Inkling-2's sink_proj)")


# rel_bias

def _rel_init(key: Array, cfg: HeadConfig, dtype=jnp.float32) -> Params:
  D, H, d, E = cfg.d_model, cfg.num_heads, cfg.rel_bias_dim, cfg.rel_bias_extent
  kw, kp = jax.random.split(key)
  return {"w_rel": (jax.random.normal(kw, (D, H, d), jnp.float32) / jnp.sqrt(D)).astype(dtype),
          "rel_scale": jnp.ones((H, d), dtype),
          "rel_proj": (jax.random.normal(kp, (d, E), jnp.float32) / jnp.sqrt(d)).astype(dtype)}


def relative_bias(params: Params, x_BTD: Array, q_pos: Array, k_pos: Array, *, cfg: HeadConfig) -> Array:
  """(B,H,T,S) float32: each query's relative state against the bank of profiles, read at t − s."""
  r_BTHd = jnp.einsum("BTD,DHd->BTHd", x_BTD, params["w_rel"], preferred_element_type=jnp.float32)
  r_BTHd = r_BTHd * params["rel_scale"].astype(jnp.float32)
  if cfg.rel_bias_clip is not None:
    r_BTHd = l2_clip(r_BTHd, cfg.rel_bias_clip)
  if cfg.log_scaling_alpha is not None:
    r_BTHd = _per_query(log_scale(q_pos, cfg.log_scaling_alpha, cfg.log_scaling_floor), r_BTHd)
  logits_BHTE = jnp.einsum("BTHd,dE->BHTE", r_BTHd, params["rel_proj"].astype(jnp.float32))
  q_BT = q_pos[None] if q_pos.ndim == 1 else q_pos
  k_BS = k_pos[None] if k_pos.ndim == 1 else k_pos
  dist_BTS = q_BT[:, :, None] - k_BS[:, None, :]
  E = cfg.rel_bias_extent
  B, H, T, _ = logits_BHTE.shape
  index_BHTS = jnp.broadcast_to(jnp.clip(dist_BTS, 0, E - 1)[:, None], (B, H, T, dist_BTS.shape[-1]))
  bias_BHTS = jnp.take_along_axis(logits_BHTE, index_BHTS, axis=-1)
  inside = ((dist_BTS >= 0) & (dist_BTS < E))[:, None]
  return jnp.where(inside, bias_BHTS, 0.0)


def _rel(params: Params, x_BTD: Array, q_BTHK: Array, *, cfg: HeadConfig, positions) -> tuple[Array, Array]:
  return q_BTHK, relative_bias(params, x_BTD, *positions, cfg=cfg)


def _rel_params(cfg: HeadConfig) -> int:
  H, d = cfg.num_heads, cfg.rel_bias_dim
  return cfg.d_model * H * d + H * d + d * cfg.rel_bias_extent


REL_BIAS = Mechanism(
    name="rel_bias", fields=("rel_bias_dim", "rel_bias_extent", "rel_bias_clip"), init=_rel_init,
    sharding={"w_rel": "DHX", "rel_scale": "HX", "rel_proj": None}, on_tokens=_rel, param_count=_rel_params,
    flops=lambda cfg, T, S: 2 * T * cfg.num_heads * cfg.rel_bias_dim * (cfg.d_model + cfg.rel_bias_extent),
    score_weights=_rel_params, needs=_NEEDS,
    examples=(("rel_bias", {"rel_bias_dim": 3, "rel_bias_extent": 5, "rel_bias_clip": 2.0},
               "D·H·d + H·d + d·E", "2·T·H·d·(D + E)"),),
    help="rel_bias_dim: d > 0, a relative position bias over distances < rel_bias_extent mixed from each query "
         "token (Inkling-2's rel_logits_proj)")


# log_scaling: the queries (after the clip) times τ(p)

def _log_scaling(params: Params, x_BTD: Array, q_BTHK: Array, *, cfg: HeadConfig, positions) -> tuple[Array, None]:
  del params, x_BTD
  return _per_query(log_scale(positions[0], cfg.log_scaling_alpha, cfg.log_scaling_floor), q_BTHK), None


LOG_SCALING = Mechanism(
    name="log_scaling", fields=("log_scaling_alpha", "log_scaling_floor"), on_tokens=_log_scaling, absolute=True,
    param_count=_zero, effective_param_count=_zero, flops=_zero, score_weights=_zero, needs=_NEEDS,
    examples=(("log_scaling", {"log_scaling_alpha": 0.5, "log_scaling_floor": 2}, "0", "0"),),
    help="log_scaling_alpha: the queries at position p times 1 + α·log(max((p + 1)/log_scaling_floor, 1)) "
         "(Inkling-2's full layers)")

# log_scaling before rel_bias makes no difference (each reads the unscaled inputs it needs)
RECORDS = (TOKEN_SINKS, LOG_SCALING, REL_BIAS)
