"""The one hook through which a mechanism that chooses keys or replaces the attention hands its work to
the attention core (base.core calls `attend` and never names a mechanism).

A record (attn.variants.mechanisms.record.Mechanism) sets one of two fields:

  select(params, q_BTHK, k_BSGK, *, cfg, is_causal, kv_lengths, mask, dense, index)
      chooses, per query, the keys it may attend to; q and k as the kernel receives them (after
      QK-norm and RoPE, or the cache's while decoding). dense=True: a boolean mask
      broadcastable to (B,H,T,S), True where a query may attend (mask: the call's dense mask and
      window, which the choice must respect; ANDed in afterwards too). dense=False (the call has
      no dense mask, window, sinks or weights out, and kernel.impls.selects sent it to the
      key-selection rows): a kernel.KeyChoice naming the row that computes only the chosen keys
      ("gathered" blocks per (query, head), "sparse" tokens), or a mask as above, which then runs
      on the dense path. The choice should carry no gradient (wrap it in stop_gradient).
      index: Options.index (the deepseek-form indexer's inputs), else None.
  attend(params, x_BTD, q_BTHK, k_BSGK, v_BSGV, *, cfg, opts, kernel_args, explicit)
      replaces the attention core: returns (o (B,T,H,V), weights (B,H,T,S) or None), or an
      Options to go on along the shared path with (e.g. with its mask ANDed in). x_BTD is the
      layer's query-side input (None where a variant does not pass it); kernel_args the
      mechanisms' kernel keywords (window, sinks, softcap, probability); explicit: an outside
      mechanism acts on the logits outside the kernel (the explicit path). nsa's three branches.

One such mechanism a layer (the built-ins refuse a second in their checks).
"""

from __future__ import annotations

from typing import Any

import jax

from attn import kernel
from attn.config import HeadConfig, invalid
from attn.kernel import impls, masks
from attn.variants.mechanisms.record import HookError

Array = jax.Array
Params = dict[str, Array]


def selected(m, params: Params, q_BTHK: Array, k_BSGK: Array, v_BSGV: Array, *, cfg: HeadConfig, opts,
             kernel_args: dict, explicit: bool):
  """m's select at the core: (o (B,T,H,V), None) from the choice's kernel row, or the opts with the
  choice's mask ANDed into the call's (the dense path; the definition the rows equal)."""
  T, S = q_BTHK.shape[1], k_BSGK.shape[1]
  if opts.return_weights and impls.is_long(T, S):
    raise invalid("return_weights", True, f"False with key selection (extra.{m.name}) at T·S >= "
                  f"{impls.BLOCKED_MIN_SCORES}: the weights are the (B,H,T,S) array a selection avoids")
  call = kernel.make_call(q_BTHK, k_BSGK, v_BSGV, opts.mask, is_causal=opts.is_causal,
                          kv_lengths=opts.kv_lengths, scale=cfg.score_scale, return_weights=opts.return_weights,
                          window=kernel_args["window"], sinks=kernel_args["sinks"],
                          softcap=kernel_args["softcap"], probability=kernel_args["probability"])
  if not explicit and impls.selects(call, opts.impl or "auto"):
    choice = m.select(params, q_BTHK, k_BSGK, cfg=cfg, is_causal=opts.is_causal, kv_lengths=opts.kv_lengths,
                      mask=None, dense=False, index=opts.index)
    if isinstance(choice, kernel.KeyChoice):
      o = kernel.attention(q_BTHK, k_BSGK, v_BSGV, is_causal=opts.is_causal, kv_lengths=opts.kv_lengths,
                           scale=cfg.score_scale, softcap=kernel_args["softcap"], impl=choice.impl, choice=choice)
      return o, None
    return _and(m, opts, choice)
  window = kernel_args["window"]
  seen = masks.combine_masks(opts.mask, None if window is None else masks.window_mask(T, S, window))
  keep = m.select(params, q_BTHK, k_BSGK, cfg=cfg, is_causal=opts.is_causal, kv_lengths=opts.kv_lengths,
                  mask=seen, dense=True, index=opts.index)
  return _and(m, opts, keep)


def _and(m, opts, keep: Any):
  if getattr(keep, "ndim", None) != 4:
    raise HookError(m.name, "select", f"returned {getattr(keep, 'shape', type(keep).__name__)}: a select "
                    "returns a boolean mask broadcastable to (B,H,T,S) or a kernel.KeyChoice")
  return opts.replace(mask=masks.combine_masks(opts.mask, keep))


def attend(m, params: Params, x_BTD: Array | None, q_BTHK: Array, k_BSGK: Array, v_BSGV: Array, *,
           cfg: HeadConfig, opts, kernel_args: dict, explicit: bool):
  """m's work at the core: ((o, weights), opts) when it attended, or (None, the opts to go on with)."""
  if m.attend is not None:
    out = m.attend(params, x_BTD, q_BTHK, k_BSGK, v_BSGV, cfg=cfg, opts=opts, kernel_args=kernel_args,
                   explicit=explicit)
  else:
    out = selected(m, params, q_BTHK, k_BSGK, v_BSGV, cfg=cfg, opts=opts, kernel_args=kernel_args,
                   explicit=explicit)
  if isinstance(out, tuple):
    return out, opts
  return None, out
