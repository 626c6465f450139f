"""Native Sparse Attention (Yuan et al. 2025, DeepSeek) as a head mechanism on any softmax variant.

Three branches over the queries, keys and values as the kernel receives them (after
QK-norm and RoPE, or the cache's while decoding), mixed per head by gates from the
query token: o = g_cmp·o_cmp + g_slc·o_slc + g_win·o_win, g = sigmoid(x·W_g + b_g),
x the layer's input at the query (the paper's gate MLP, one linear layer here).

  compressed  attention over the keys and values pooled over blocks of compress_block
              every compress_stride keys (attn.kernel.nsa: a learned weighted
              pooling over intra-block positions, k~ = Σ_j a_j k_j, v~ = Σ_j b_j v_j; the
              paper's φ is an MLP with an intra-block position encoding: the pooling is
              chosen linear so that it commutes with mla's latent absorption and the
              cache, and starts as the mean). A query uses a compressed block once all of
              its keys are visible (it has ended).
  selected    attention over the select_count blocks of select_block keys its kv group's
              compressed probabilities rank highest, the initial block and the two local
              blocks (its own and the one before) always among them (attn.kernel.nsa
              defines the choice; no gradient through it).
  window      attention over the last `window` keys up to the query.

Options in HeadConfig.extra: {"nsa": {"compress_block": 32, "compress_stride": 16,
"select_block": 64, "select_count": 16, "window": 512}} (the paper's). Parameters:
w_gate (D, H, 3), b_gate (H, 3), w_compress_k and w_compress_v (compress_block,).

Where the work is saved: at T·S >= kernel.BLOCKED_MIN_SCORES, causal, "auto" or
"blocked", no dense mask: the compressed branch and the choice run 256 queries at a
time (recomputed in the backward pass), the selected branch on attn.kernel.gathered
(each chosen (query, block) pair once) and the window on the blocked kernel's window
(skipping the blocks outside it): no T×S array. Elsewhere each branch is a dense
mask ANDed into the call's (the definition). return_weights gives the selected
branch's weights (a softmax over the chosen keys); at long T it is refused.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from attn import kernel
from attn.config import HeadConfig, invalid
from attn.kernel import nsa as cmp
from attn.kernel import impls, masks, select
from attn.kernel.impls import BLOCKED_MIN_SCORES, is_long
from attn.variants.mechanisms.record import Mechanism
from attn.variants.mechanisms.selection import SELECTORS, _positive

Array = jax.Array
Params = dict[str, Array]

DEFAULTS = {"compress_block": 32, "compress_stride": 16, "select_block": 64, "select_count": 16,
            "window": 512}
CHUNK = 256  # queries whose compressed scores are alive at once on the long path


def options(cfg: HeadConfig) -> dict:
  return {**DEFAULTS, **dict((cfg.extra or {}).get("nsa") or {})}


def check(cfg: HeadConfig) -> None:
  """Options positive integers, stride <= compress_block; one selector a layer; softmax heads,
  no layer window, no sinks."""
  o = options(cfg)
  for key in DEFAULTS:
    _positive("nsa", key, o[key])
  unknown = sorted(set(o) - set(DEFAULTS))
  if unknown:
    raise invalid(f"extra.nsa.{unknown[0]}", o[unknown[0]], f"one of {sorted(DEFAULTS)}")
  if o["compress_stride"] > o["compress_block"]:
    raise invalid("extra.nsa.compress_stride", o["compress_stride"],
                  f"at most compress_block={o['compress_block']}: the compressed blocks must cover every key")
  others = [n for n in SELECTORS if n != "nsa" and n in (cfg.extra or {})]
  if others:
    raise invalid(f"extra.{others[0]}", dict(cfg.extra[others[0]]), "absent with extra.nsa: one key "
                  "selection a layer")
  if cfg.probability != "softmax":
    raise invalid("probability", cfg.probability, '"softmax" with extra.nsa: its three branches are '
                  "softmax attentions")
  if cfg.window is not None:
    raise invalid("window", cfg.window, "None with extra.nsa: its own window is extra.nsa.window, and "
                  "a layer window's decoding ring holds slots, not the positions its blocks need")
  if cfg.sinks:
    raise invalid("sinks", cfg.sinks, "False with extra.nsa: a sink joins one softmax, nsa has three")


def init(key: Array, cfg: HeadConfig, dtype=jnp.float32) -> Params:
  D, H, L = cfg.d_model, cfg.num_heads, options(cfg)["compress_block"]
  w = jax.random.normal(key, (D, H, 3), jnp.float32) / jnp.sqrt(D)
  mean = jnp.full((L,), 1.0 / L, jnp.float32)
  return {"w_gate": w.astype(dtype), "b_gate": jnp.zeros((H, 3), dtype),
          "w_compress_k": mean.astype(dtype), "w_compress_v": mean.astype(dtype)}


def param_count(cfg: HeadConfig) -> int:
  """3·H·(D + 1) gate weights and biases, 2·compress_block pooling weights."""
  return 3 * cfg.num_heads * (cfg.d_model + 1) + 2 * options(cfg)["compress_block"]


def flops(cfg: HeadConfig, T: int, S: int) -> int:
  """What nsa adds to the layer's one dense core on the dense path: its selector (selector_flops),
  the compressed core 2·T·N_c·H·(K + V) and a second dense core (the window's) 2·T·S·H·(K + V)."""
  o = options(cfg)
  H, KV = cfg.num_heads, cfg.d_k + cfg.d_v
  N = cmp.num_compressed(S, o["compress_block"], o["compress_stride"])
  return selector_flops(cfg, T, S) + 2 * T * N * H * KV + 2 * T * S * H * KV


def selector_flops(cfg: HeadConfig, T: int, S: int) -> int:
  """Gates 2·T·D·3H, pooling 2·N_c·l·G·(K + V), block scores 2·T·G·W·N_s over the band of W
  compressed blocks a selection block overlaps (attn.kernel.nsa.overlaps); the compressed
  branch's own attention is the core's (keys), not counted here."""
  o = options(cfg)
  H, G, D, KV = cfg.num_heads, cfg.num_kv_heads, cfg.d_model, cfg.d_k + cfg.d_v
  N = cmp.num_compressed(S, o["compress_block"], o["compress_stride"])
  W, Ns = cmp.overlaps(S, o["compress_block"], o["compress_stride"], o["select_block"])[0].shape
  return 2 * T * D * 3 * H + 2 * N * o["compress_block"] * G * KV + (2 * T * G * W * Ns if N else 0)


def gates(params: Params, x_BTD: Array) -> Array:
  """(B,T,H,3) float32: sigmoid gates of the compressed, selected and window branches."""
  z = jnp.einsum("BTD,DHC->BTHC", x_BTD.astype(jnp.float32), params["w_gate"].astype(jnp.float32))
  return jax.nn.sigmoid(z + params["b_gate"].astype(jnp.float32))


def _compressed_kv(params: Params, k_BSGK, v_BSGV, o: dict):
  kw = dict(block=o["compress_block"], stride=o["compress_stride"])
  return cmp.compress(k_BSGK, params["w_compress_k"], **kw), cmp.compress(v_BSGV, params["w_compress_v"], **kw)


def _selected_blocks(idx_BGTk: Array, chosen_BGTk: Array, N: int) -> Array:
  """(B,G,T,N) bool from the chosen indices."""
  return (jax.nn.one_hot(idx_BGTk, N, dtype=jnp.bool_) & chosen_BGTk[..., None]).any(-2)


def branches(params: Params, q_BTHK: Array, k_BSGK: Array, v_BSGV: Array, *, cfg: HeadConfig,
             is_causal: bool, kv_lengths=None, mask=None, impl: str = "auto", softcap=None,
             return_weights: bool = False, long: bool = False):
  """The three branches' outputs (B,T,H,V) each, ungated, and the selected branch's weights (or None).

  long: the path without T×S arrays (causal, no mask); else the dense masks (the definition).
  """
  o = options(cfg)
  B, T, H, _ = q_BTHK.shape
  S = k_BSGK.shape[1]
  G, sb, w = cfg.num_kv_heads, o["select_block"], o["window"]
  R = H // G
  kc, vc = _compressed_kv(params, k_BSGK, v_BSGV, o)
  band = tuple(map(jnp.asarray, cmp.overlaps(S, o["compress_block"], o["compress_stride"], sb)))
  limit_B = jnp.full((B,), S) if kv_lengths is None else jnp.minimum(jnp.asarray(kv_lengths), S)
  geo = dict(T=T, S=S, is_causal=is_causal, limit_B=limit_B)
  cgeo = dict(block=o["compress_block"], stride=o["compress_stride"])
  run = dict(groups=G, band=band, count=o["select_count"], scale=cfg.score_scale, softcap=softcap)
  call = dict(is_causal=is_causal, kv_lengths=kv_lengths, scale=cfg.score_scale, softcap=softcap)
  if long:
    chunk = min(CHUNK, T)
    n = -(-T // chunk)
    q_pad = jnp.pad(q_BTHK, ((0, 0), (0, n * chunk - T), (0, 0), (0, 0)))

    @jax.checkpoint
    def one(i):
      t = i * chunk + jnp.arange(chunk)
      qc = lax.dynamic_slice_in_dim(q_pad, i * chunk, chunk, axis=1)
      return cmp.branch(qc, kc, vc, cmp.compressed_visible(t, **geo, **cgeo, vis_BHcS=None),
                        cmp.selection_visible(t, **geo, select_block=sb, vis_BHcS=None), **run)
    o_c, idx, chosen = lax.map(one, jnp.arange(n))
    o_c = jnp.moveaxis(o_c, 0, 1).reshape(B, n * chunk, H, -1)[:, :T]
    idx, chosen = (jnp.moveaxis(a, 0, 2).reshape(B, G, n * chunk, -1)[:, :, :T] for a in (idx, chosen))
    choice = kernel.KeyChoice("gathered", {"idx_BHTk": jnp.repeat(idx, R, axis=1),
                                           "valid_BHTk": jnp.repeat(chosen, R, axis=1), "block": sb})
    o_s = kernel.attention(q_BTHK, k_BSGK, v_BSGV, impl="gathered", choice=choice, **call)
    o_w = kernel.attention(q_BTHK, k_BSGK, v_BSGV, None, impl=impl, window=w, **call)
    return o_c, o_s, o_w, None
  vis = select.visible(T, S, is_causal, kv_lengths, B)[:, None]
  if mask is not None:
    vis = vis & jnp.asarray(mask, bool)
  t = jnp.arange(T)
  o_c, idx, chosen = cmp.branch(q_BTHK, kc, vc, cmp.compressed_visible(t, **geo, **cgeo, vis_BHcS=vis),
                                cmp.selection_visible(t, **geo, select_block=sb, vis_BHcS=vis), **run)
  sel = jnp.repeat(_selected_blocks(idx, chosen, select.num_blocks(S, sb)), R, axis=1)
  sel_mask = masks.combine_masks(mask, select.blocks_to_mask(sel, sb, S))
  out = kernel.attention(q_BTHK, k_BSGK, v_BSGV, sel_mask, impl=impl, return_weights=return_weights, **call)
  o_s, w_s = out if return_weights else (out, None)
  p_t = cmp.query_positions(t, T, S, is_causal, vis)
  win = jnp.arange(S) > (p_t[..., None] - w)
  o_w = kernel.attention(q_BTHK, k_BSGK, v_BSGV, masks.combine_masks(mask, win), impl=impl, **call)
  return o_c, o_s, o_w, w_s


def attend(params: Params, x_BTD: Array | None, q_BTHK: Array, k_BSGK: Array, v_BSGV: Array, *,
           cfg: HeadConfig, opts, kernel_args: dict, explicit: bool):
  """(o (B,T,H,V), the selected branch's weights or None): the gated sum of the three branches."""
  T, S = q_BTHK.shape[1], k_BSGK.shape[1]
  if x_BTD is None:
    raise invalid("extra.nsa", dict(cfg.extra["nsa"]), "a variant whose core call passes the layer's "
                  "input (base.core(..., x_BTD=...)): nsa's gates read it")
  if explicit:
    raise invalid("extra.nsa", dict(cfg.extra["nsa"]), "absent with a mechanism acting on the logits "
                  "outside the kernel: nsa's branches run the kernel")
  long = is_long(T, S)
  if opts.return_weights and long:
    raise invalid("return_weights", True, f"False with key selection (extra.nsa) at T·S >= "
                  f"{BLOCKED_MIN_SCORES}: the weights are the (B,H,T,S) array a selection avoids")
  impl = opts.impl or "auto"
  # The table's rule (kernel.impls.selects), and causal: the long branches place queries by is_causal.
  call = kernel.make_call(q_BTHK, k_BSGK, v_BSGV, opts.mask, is_causal=opts.is_causal,
                          kv_lengths=opts.kv_lengths, scale=cfg.score_scale, return_weights=opts.return_weights,
                          softcap=kernel_args["softcap"])
  sparse = opts.is_causal and impls.selects(call, impl)
  o_c, o_s, o_w, w_s = branches(params, q_BTHK, k_BSGK, v_BSGV, cfg=cfg, is_causal=opts.is_causal,
                                kv_lengths=opts.kv_lengths, mask=opts.mask, impl=impl,
                                softcap=kernel_args["softcap"], return_weights=opts.return_weights,
                                long=sparse)
  g = gates(params, x_BTD)
  out = g[..., 0:1] * o_c + g[..., 1:2] * o_s.astype(jnp.float32) + g[..., 2:3] * o_w.astype(jnp.float32)
  return out.astype(q_BTHK.dtype), w_s


NSA = Mechanism(
    name="nsa", defaults=DEFAULTS, check=check, init=init, attend=attend,
    needs={"key_heads": "its compressed branch pools d_k-wide key heads and its counts read them",
           "one_map": "its three branches and gates replace one softmax map per head"},
    sharding={"w_gate": "DHJ", "b_gate": "HJ", "w_compress_k": None, "w_compress_v": None},
    param_count=param_count, flops=flops, score_weights=lambda cfg: 0,
    examples=(("nsa compress 4 every 2, 2 blocks of 4, window 3",
               {"extra": {"nsa": {"compress_block": 4, "compress_stride": 2, "select_block": 4,
                                  "select_count": 2, "window": 3}}},
               "3·H·(D + 1) + 2·l",
               "2·T·D·3H + 2·N_c·l·G·(K+V) + 2·T·G·W·N_s + 2·T·N_c·H·(K+V) + 2·T·S·H·(K+V) "
               "(dense path; the core: N_c + n·l' + w keys a query)"),),
    help="nsa: {compress_block, compress_stride, select_block, select_count, window}: Native Sparse "
         "Attention's compressed, selected-blocks and sliding-window branches, gated per head")


def keys(cfg: HeadConfig, T: int) -> dict[str, int]:
  """Keys attended over T causal queries (S = T, no padding), per branch: compressed blocks ended by
  each query, its selected blocks' keys (its own block up to itself, min(select_count, own + 1) - 1
  whole earlier ones) and its window min(window, t + 1)."""
  o = options(cfg)
  l, d, sb, n, w = (o[k] for k in ("compress_block", "compress_stride", "select_block", "select_count", "window"))
  t = np.arange(T)
  compressed = np.where(t >= l - 1, (t - l + 1) // d + 1, 0)
  own = t // sb
  selected = (t - own * sb + 1) + (np.minimum(n, own + 1) - 1) * sb
  return {"compressed": int(compressed.sum()), "selected": int(selected.sum()),
          "window": int(np.minimum(w, t + 1).sum())}
