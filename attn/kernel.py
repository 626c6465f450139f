"""Pure attention core: scores, masks, float32 softmax, weighted sum.

No parameters. Grouped heads: query head h reads key/value head h // R with
R = H // G. Masks are boolean, True where a query may attend a key, and
broadcast to (B,H,T,S). A fully masked row gives zero weights and zero output.
Structured masks travel as arguments: is_causal, kv_lengths and window
(attention's docstring); the blocked implementation (attn.blocked) never
builds them. attention's docstring also defines sinks and softcap, and
attn.probability the probability functions besides softmax (sigmoid, relu).
"""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
from jax import lax

from attn import blocked, masks, onednn, probability as prob
from attn.config import check_mask, check_structured, invalid

Array = jax.Array


def _check_qkv(q_BTHK, k_BSGK, v_BSGV) -> None:
  for name, a in (("q", q_BTHK), ("k", k_BSGK), ("v", v_BSGV)):
    if getattr(a, "ndim", None) != 4:
      raise invalid(f"{name}.shape", getattr(a, "shape", None), "rank 4")
  B, T, H, K = q_BTHK.shape
  Bk, S, Gk, Kk = k_BSGK.shape
  if Bk != B or Kk != K:
    raise invalid("k.shape", k_BSGK.shape, f"(B={B}, S, G, K={K}) to match q {q_BTHK.shape}")
  if H % Gk:
    raise invalid("k.shape[2]", Gk, f"a divisor of the query heads H={H}")
  # A key with one head is shared by every kv head: v may then have any G dividing H.
  G = v_BSGV.shape[2] if Gk == 1 and getattr(v_BSGV, "ndim", 0) == 4 else Gk
  if H % G:
    raise invalid("v.shape[2]", G, f"a divisor of the query heads H={H}")
  if v_BSGV.shape[:3] != (B, S, G):
    raise invalid("v.shape", v_BSGV.shape, f"(B={B}, S={S}, G={G}, V) to match k"
                  + (" (a one-head k is shared by every kv head)" if Gk == 1 else ""))


def _group_queries(q_BTHK: Array, G: int) -> Array:
  """(B,T,H,K) -> (B,G,M,K) with M = R·T: the queries of a kv group's R heads, stacked.

  One batched matmul per (batch, kv group) then serves every head of the group;
  the result reshapes to (B,H,T,S) for free. This layout (rather than
  (B,T,G,R,K)) is the one the CPU matmul runs fastest on (README, Performance).
  """
  B, T, H, K = q_BTHK.shape
  q_BTGRK = q_BTHK.reshape(B, T, G, H // G, K)
  return q_BTGRK.transpose(0, 2, 3, 1, 4).reshape(B, G, (H // G) * T, K)


def scores(q_BTHK: Array, k_BSGK: Array) -> Array:
  """Raw logits q·k in float32, (B,H,T,S), with G key heads shared by H query heads.

  A key with one head (G = 1: merged's raw context, collaborative's shared key)
  meets all H query heads in one batched matmul per batch element, M = H·T rows.
  """
  B, T, H, K = q_BTHK.shape
  S, G = k_BSGK.shape[1], k_BSGK.shape[2]
  q_BGMK = _group_queries(q_BTHK, G)
  k_BGSK = k_BSGK.transpose(0, 2, 1, 3)
  logits_BGMS = jnp.einsum("BGMK,BGSK->BGMS", q_BGMK, k_BGSK,
                           preferred_element_type=jnp.float32)
  return logits_BGMS.reshape(B, H, T, S)


def masked_softmax(logits_BHTS: Array, mask: Array | None = None,
                   sinks: Array | None = None) -> Array:
  """Softmax over S in float32; masked entries and fully masked rows get weight 0.

  sinks (H,), if given, join every row's denominator as one more logit per
  query head with no value: the weights then sum to 1 - the sink's share.
  """
  logits_BHTS = logits_BHTS.astype(jnp.float32)
  if sinks is not None:
    return _softmax_with_sinks(logits_BHTS, mask, sinks)
  if mask is None:
    return jax.nn.softmax(logits_BHTS, axis=-1)
  mask = jnp.broadcast_to(mask, logits_BHTS.shape)
  # A finite fill (not -inf) keeps a fully masked row finite: its softmax is
  # uniform, and the final where() zeroes it, in value and in gradient.
  logits_BHTS = jnp.where(mask, logits_BHTS, jnp.finfo(jnp.float32).min)
  return jnp.where(mask, jax.nn.softmax(logits_BHTS, axis=-1), 0.0)


def masked_probabilities(logits_BHTS: Array, mask: Array | None = None, sinks: Array | None = None,
                         probability: str = "softmax") -> Array:
  """The weights of the logits under a dense mask: masked_softmax, or attn.probability's sigmoid/relu."""
  if probability == "softmax":
    return masked_softmax(logits_BHTS, mask, sinks)
  return prob.weights(logits_BHTS, mask, probability)


def _softmax_with_sinks(logits_BHTS: Array, mask: Array | None, sinks: Array) -> Array:
  """exp(l_ts) / (exp(sink_h) + Σ_s' exp(l_ts')); a fully masked row is all zeros."""
  sink_1H11 = sinks.astype(jnp.float32).reshape(1, -1, 1, 1)
  if mask is not None:
    mask = jnp.broadcast_to(mask, logits_BHTS.shape)
    logits_BHTS = jnp.where(mask, logits_BHTS, jnp.finfo(jnp.float32).min)
  # The sink bounds the max from below, so a fully masked row's exps underflow to 0.
  m_BHT1 = lax.stop_gradient(jnp.maximum(logits_BHTS.max(-1, keepdims=True), sink_1H11))
  e_BHTS = jnp.exp(logits_BHTS - m_BHT1)
  if mask is not None:
    e_BHTS = jnp.where(mask, e_BHTS, 0.0)
  return e_BHTS / (jnp.exp(sink_1H11 - m_BHT1) + e_BHTS.sum(-1, keepdims=True))


def weighted_sum(probs_BHTS: Array, v_BSGV: Array) -> Array:
  """Mixes values with the attention weights: (B,T,H,V) in v's dtype."""
  B, H, T, S = probs_BHTS.shape
  G, V = v_BSGV.shape[2], v_BSGV.shape[3]
  probs_BGMS = probs_BHTS.reshape(B, G, (H // G) * T, S).astype(v_BSGV.dtype)
  out_BGMV = jnp.einsum("BGMS,BGSV->BGMV", probs_BGMS, v_BSGV.transpose(0, 2, 1, 3))
  out_BGRTV = out_BGMV.reshape(B, G, H // G, T, V)
  return out_BGRTV.transpose(0, 3, 1, 2, 4).reshape(B, T, H, V)


IMPLS = ("auto", "einsum", "blocked", "xla", "cudnn", "onednn")


def check_impl(impl, *dtypes) -> None:
  """Raises ConfigError naming impl unless it is one of IMPLS that runs here on these dtypes."""
  if impl not in IMPLS:
    raise invalid("impl", impl, f"one of {IMPLS}")
  if impl == "onednn" and (why := onednn.why_not(*dtypes)) is not None:
    raise invalid("impl", impl, f"an implementation that runs here ({why}); available: {available_impls()}")


def available_impls() -> list[str]:
  """The impls that can run on this machine's default backend ("onednn" builds its handlers to find out)."""
  out = ["auto", "einsum", "blocked", "xla"]
  if jax.default_backend() == "gpu":
    out.append("cudnn")
  if onednn.why_not() is None:
    out.append("onednn")
  return out

# impl="auto" off cuDNN: the blocked kernel from T·S >= 512² scores per (batch,
# head). Measured forward+backward on a 2-core Zen 3, H=8, K=V=64, float32,
# blocks of 512 × 256 (python scripts/blocked_crossover.py; experiments/
# performance.md, Long sequences): blocked ÷ einsum at B=8 1.57 for T=S=256,
# 1.01 for 384, 0.88 for 512; at B=1 1.03, 1.10 and 0.86.
BLOCKED_MIN_SCORES = 512 * 512


def is_long(T: int, S: int) -> bool:
  """T queries by S keys is where the blocked kernel beats the einsum one on CPU."""
  return T * S >= BLOCKED_MIN_SCORES


def best_impl(q_BTHK: Array, k_BSGK: Array, v_BSGV: Array, *, return_weights: bool = False,
              logits_bias: Array | None = None, sinks: Array | None = None,
              softcap: float | None = None, probability: str = "softmax") -> str:
  """"cudnn" on a GPU where it applies; "blocked" for T·S >= BLOCKED_MIN_SCORES; else "einsum".

  cuDNN: half-precision heads with d_v = d_k (a multiple of 8, at most 128),
  no weights out, no logits_bias, no sinks, no softcap, softmax. The blocked kernel
  needs no weights out and no logits_bias either.
  """
  K, V = q_BTHK.shape[-1], v_BSGV.shape[-1]
  plain = not return_weights and logits_bias is None
  fits_cudnn = (K == V and K % 8 == 0 and K <= 128 and plain
                and sinks is None and softcap is None and probability == "softmax"
                and q_BTHK.dtype in (jnp.bfloat16, jnp.float16)
                and q_BTHK.dtype == k_BSGK.dtype == v_BSGV.dtype)
  if fits_cudnn and jax.default_backend() == "gpu":
    return "cudnn"
  return "blocked" if plain and is_long(q_BTHK.shape[1], k_BSGK.shape[1]) else "einsum"


def structured_mask(T: int, S: int, is_causal: bool = False, kv_lengths: Array | None = None,
                    window: int | None = None) -> Array | None:
  """The dense mask of is_causal (bottom-right aligned), kv_lengths and window: (1|B,1,T|1,S)."""
  causal = masks.causal_mask(T, S) if is_causal else None
  padding = None if kv_lengths is None else masks.padding_mask(kv_lengths, S)
  local = None if window is None else masks.window_mask(T, S, window)
  return masks.combine_masks(causal, padding, local)


def _dot_product_attention(q_BTHK, k_BSGK, v_BSGV, mask, scale, logits_bias, impl,
                           is_causal, kv_lengths, window):
  """The same function through jax.nn.dot_product_attention ("xla" or "cudnn")."""
  B, T, H, _ = q_BTHK.shape
  S = k_BSGK.shape[1]
  # jax's is_causal and local_window_size are top-left aligned (key s visible
  # iff s <= t, and t - left <= s <= t + right); attn's are bottom-right, so
  # for T != S they travel as a dense mask. At T == S a causal window w is
  # jax's (w - 1, 0), which cuDNN runs as its sliding window.
  jax_causal = is_causal and T == S
  jax_window = None
  if window is not None and jax_causal:
    jax_window = (min(window, S) - 1, 0)
  elif window is not None:
    mask = masks.combine_masks(mask, masks.window_mask(T, S, window))
  if is_causal and T != S:
    mask = masks.combine_masks(mask, masks.causal_mask(T, S))
  out_BTHV = jax.nn.dot_product_attention(
      q_BTHK, k_BSGK, v_BSGV, bias=logits_bias, mask=mask, scale=scale, is_causal=jax_causal,
      key_value_seq_lengths=None if kv_lengths is None else kv_lengths.astype(jnp.int32),
      local_window_size=jax_window, implementation=impl)
  full = masks.combine_masks(mask, structured_mask(T, S, jax_causal, kv_lengths,
                                                   window if jax_window else None))
  if full is None:
    return out_BTHV
  # jax gives a fully masked row uniform weights; attn's contract is zeros.
  has_key_BHT = jnp.broadcast_to(full, (B, H, T, S)).any(-1)
  return jnp.where(has_key_BHT.transpose(0, 2, 1)[..., None], out_BTHV, 0).astype(out_BTHV.dtype)


def _check_block(name: str, value) -> None:
  if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
    raise invalid(name, value, "a positive integer or None (chosen from the shapes)")


def check_options(window, sinks, softcap, num_heads: int, probability: str = "softmax") -> None:
  """window a positive int, sinks (H,) floats, softcap a positive finite number, each or None;
  probability one of attn.probability.PROBABILITIES, softmax with sinks."""
  if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                             or window <= 0):
    raise invalid("window", window, "a positive integer (keys closer than it to the query) or None")
  if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, numbers.Real)
                              or not math.isfinite(softcap) or softcap <= 0):
    raise invalid("softcap", softcap, "a positive finite Python number or None")
  if sinks is not None:
    shape = getattr(sinks, "shape", None)
    if shape is None or tuple(shape) != (num_heads,):
      raise invalid("sinks.shape", None if shape is None else tuple(shape),
                    f"(H,)=({num_heads},): one sink logit per query head")
    if "float" not in str(getattr(sinks, "dtype", None)):
      raise invalid("sinks.dtype", str(sinks.dtype), "a float dtype: sinks are learned logits")
  prob.check_probability(probability, sinks)


def attention(
    q_BTHK: Array,
    k_BSGK: Array,
    v_BSGV: Array,
    mask: Array | None = None,
    *,
    is_causal: bool = False,
    kv_lengths: Array | None = None,
    scale: float | None = None,
    logits_bias: Array | None = None,
    return_weights: bool = False,
    impl: str = "einsum",
    block_q: int | None = None,
    block_k: int | None = None,
    window: int | None = None,
    sinks: Array | None = None,
    softcap: float | None = None,
    probability: str = "softmax",
) -> Array | tuple[Array, Array]:
  """softmax(cap(scale · q kᵀ) + logits_bias, masked, sinks) v for already projected heads.

  q (B,T,H,K), k (B,S,G,K), v (B,S,G,V) with H a multiple of G; k may have one
  head shared by every kv head (the einsum kernel then runs one matmul for all
  H query heads instead of G copies of it; the others broadcast it). scale defaults
  to 1/sqrt(K). softcap c, if given, caps the scaled logits to c·tanh(l / c)
  (Gemma 2) before the bias, the masks and the softmax. logits_bias, if given,
  is added to the (capped) logits and must broadcast to (B,H,T,S). sinks (H,),
  if given, is one learned logit per query head that joins every row's softmax
  denominator and carries no value (gpt-oss): p_ts = exp(l_ts) / (exp(sink_h)
  + Σ_s' exp(l_ts')), in float32. Returns (B,T,H,V), and the weights (B,H,T,S)
  in float32 when return_weights is set (without the sink's share: a row sums
  to 1 - its sink weight). probability "sigmoid" or "relu" replaces the softmax
  by σ(l − log n_t) or max(l, 0)/n_t, n_t the keys the row's masks leave
  visible (attn.probability; no sinks), in float32.

  Masks combine by AND: mask (dense boolean, True = may attend), is_causal,
  kv_lengths and window. is_causal is bottom-right aligned, as
  attn.causal_mask(T, S): query t sees key s iff s <= t + (S - T), so with
  S > T (a cache of S - T earlier keys) the last query sees every key, and
  with S < T the first T - S queries see none (zero output).
  (jax.nn.dot_product_attention's and torch's is_causal are top-left aligned,
  s <= t; the two agree when T == S.) kv_lengths (B,) integers in [0, S] mask
  keys s >= kv_lengths[b]. window w (a positive int) keeps keys s with
  |t + (S - T) - s| < w, aligned as is_causal: with is_causal that is the w
  keys ending at the query itself, without it w - 1 on each side; a window of
  max(T, S) or more masks nothing.

  impl picks the implementation of the same function: "einsum" (this module,
  the default; materialises (B,H,T,S)), "blocked" (attn.blocked: online
  softmax over blocks of block_q queries and block_k keys, a recomputing VJP,
  no T×S array, masked blocks skipped; no weights out, no logits_bias), "xla"
  or "cudnn" (jax.nn.dot_product_attention; need d_v = d_k, no weights out,
  no sinks, no softcap, softmax only), "auto" (best_impl: cuDNN on a GPU where it applies, else blocked
  from T·S >= BLOCKED_MIN_SCORES = 512², the crossover measured on CPU, else
  einsum), or "onednn" (attn.onednn; opt-in, CPU, float32: the structure "auto"
  picks on CPU, einsum or blocked, with its matmuls on oneDNN's sgemm through
  jax.ffi; "auto" never picks it: experiments/performance.md says where it wins).
  """
  _check_qkv(q_BTHK, k_BSGK, v_BSGV)
  B, T, H, K = q_BTHK.shape
  S = k_BSGK.shape[1]
  if mask is not None:
    check_mask(mask, (B, H, T, S))
  check_structured(is_causal, kv_lengths, B, S)
  _check_block("block_q", block_q)
  _check_block("block_k", block_k)
  check_options(window, sinks, softcap, H, probability)
  check_impl(impl, q_BTHK.dtype, k_BSGK.dtype, v_BSGV.dtype)
  if scale is None:
    scale = 1.0 / math.sqrt(K)
  if impl == "auto":
    impl = best_impl(q_BTHK, k_BSGK, v_BSGV, return_weights=return_weights,
                     logits_bias=logits_bias, sinks=sinks, softcap=softcap,
                     probability=probability)
  products = "xla"
  if impl == "onednn" and return_weights is False and logits_bias is None and is_long(T, S):
    impl, products = "blocked", "onednn"  # the structure "auto" picks, its products on oneDNN
  dense = impl in ("einsum", "onednn")  # the (B,H,T,S) logits materialised: every option applies
  if not dense and return_weights:
    raise invalid("impl", impl, '"einsum", "onednn" or "auto" when return_weights=True')
  if not dense and k_BSGK.shape[2] != v_BSGV.shape[2]:  # one key head shared by every kv head
    k_BSGK = jnp.broadcast_to(k_BSGK, (*k_BSGK.shape[:2], v_BSGV.shape[2], K))
  if impl == "blocked":
    if logits_bias is not None:
      raise invalid("impl", impl, '"einsum", "xla" or "auto" with a logits_bias')
    return blocked.attention(q_BTHK, k_BSGK, v_BSGV, mask, is_causal=is_causal,
                             kv_lengths=kv_lengths, scale=scale, block_q=block_q,
                             block_k=block_k, window=window, sinks=sinks, softcap=softcap,
                             probability=probability, products=products)
  if not dense:
    for name, value in (("sinks", sinks), ("softcap", softcap)):
      if value is not None:
        raise invalid(name, value if name == "softcap" else "an array",
                      f'None with impl="{impl}" (jax.nn.dot_product_attention has no {name}): '
                      'impl "einsum", "blocked" or "auto" take it')
    if probability != "softmax":
      raise invalid("probability", probability, f'"softmax" with impl="{impl}" '
                    '(jax.nn.dot_product_attention has only softmax): impl "einsum", "blocked" or "auto" take it')
    if v_BSGV.shape[-1] != K:
      raise invalid("impl", impl, f'"einsum" or "auto" when d_v={v_BSGV.shape[-1]} != d_k={K}')
    return _dot_product_attention(q_BTHK, k_BSGK, v_BSGV, mask, scale, logits_bias, impl,
                                  is_causal, kv_lengths, window)
  mask = masks.combine_masks(mask, structured_mask(T, S, is_causal, kv_lengths, window))
  if impl == "onednn":  # float32 only (checked above): the same function, its two products on oneDNN
    logits_BHTS = onednn.nt(q_BTHK * jnp.float32(scale), k_BSGK)
  elif q_BTHK.dtype == jnp.float32:
    # Scaling q (T·K values) rather than the logits (T·S) is the same product
    # up to rounding, and keeps XLA's CPU matmul fusion from materialising a
    # (B,H,T,S) array of the scale (README, Performance). In half precision
    # the scale stays on the float32 logits so q loses no bits.
    logits_BHTS = scores(q_BTHK * jnp.float32(scale), k_BSGK)
  else:
    logits_BHTS = scores(q_BTHK, k_BSGK) * scale
  if softcap is not None:
    logits_BHTS = softcap * jnp.tanh(logits_BHTS / softcap)
  if logits_bias is not None:
    logits_BHTS = logits_BHTS + logits_bias.astype(jnp.float32)
  probs_BHTS = masked_probabilities(logits_BHTS, mask, sinks, probability)
  mix = onednn.nn if impl == "onednn" else weighted_sum  # probs are float32 there
  out_BTHV = mix(probs_BHTS, v_BSGV).astype(q_BTHK.dtype)
  return (out_BTHV, probs_BHTS) if return_weights else out_BTHV


def reference_attention(q_BTHK, k_BSGK, v_BSGV, mask=None, *, scale=None):
  """A second, deliberately naive implementation (repeat kv heads, one head at a time) for tests."""
  B, T, H, K = q_BTHK.shape
  k_BSHK = jnp.repeat(k_BSGK, H // k_BSGK.shape[2], axis=2)
  v_BSHV = jnp.repeat(v_BSGV, H // v_BSGV.shape[2], axis=2)
  scale = 1.0 / math.sqrt(K) if scale is None else scale
  outs = []
  for h in range(H):
    logits_BTS = jnp.einsum("btk,bsk->bts", q_BTHK[:, :, h].astype(jnp.float32),
                            k_BSHK[:, :, h].astype(jnp.float32)) * scale
    if mask is not None:
      m = jnp.broadcast_to(mask, (B, H) + logits_BTS.shape[1:])[:, h]
      logits_BTS = jnp.where(m, logits_BTS, -jnp.inf)
      p = jnp.exp(logits_BTS - jnp.max(jnp.where(m, logits_BTS, -1e30), -1, keepdims=True))
      p = jnp.where(m, p, 0.0)
      denom = p.sum(-1, keepdims=True)
      p = jnp.where(denom > 0, p / jnp.where(denom > 0, denom, 1.0), 0.0)
    else:
      p = jax.nn.softmax(logits_BTS, axis=-1)
    outs.append(jnp.einsum("bts,bsv->btv", p, v_BSHV[:, :, h].astype(jnp.float32)))
  return jnp.stack(outs, axis=2)
