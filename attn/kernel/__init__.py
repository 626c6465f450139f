"""Pure attention core: scores, masks, float32 softmax, weighted sum.

No parameters. Grouped heads: query head h reads key/value head h // R with
R = H // G. Masks are boolean, True where a query may attend a key, and
broadcast to (B,H,T,S). A fully masked row gives zero weights and zero output.
Structured masks travel as arguments (is_causal, kv_lengths, window), which the
blocked implementation never builds; attention's docstring defines sinks and
softcap, and attn.kernel.probability the probability functions besides softmax.

The package: call (the checked arguments), impls (the table of
implementations and "auto"'s order), dense (the einsum kernel), blocked and
plan (the blocked kernel), compressed (blocks of keys pooled into entries beside the tokens:
DeepSeek-V4's compressed attention, einsum or blocked), xla (jax.nn.dot_product_attention), splash (Pallas's
TPU splash attention), tokamax_kernel (tokamax's GPU kernels), selected (the key-selection
rows: a mechanism's key choice on gathered or sparse), entries (compressed entries on the einsum
row), products (the matmul backend: XLA's or oneDNN's), onednn, masks, probability.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax

from attn.config import invalid
from attn.kernel import blocked, dense, masks, onednn, probability
from attn.kernel.call import Call, KeyChoice, Refusal, check_options, make_call
from attn.kernel.dense import (masked_probabilities, masked_softmax, reference_attention,
                               structured_mask)
from attn.kernel.impls import AUTO, BLOCKED_MIN_SCORES, IMPLEMENTATIONS, Impl, is_long
from attn.kernel import impls as _impls
from attn.kernel.products import scores, weighted_sum

Array = jax.Array

# What impl= may name for a plain call (a model's, attn.apply's): the key-selection rows run choices only.
IMPLS = ("auto", *(name for name, row in IMPLEMENTATIONS.items() if not row.chooses))

# Set by record_picks: the dict attention counts the implementation of each call in (at trace time).
_PICKS: contextvars.ContextVar = contextvars.ContextVar("attn_kernel_picks", default=None)


@contextlib.contextmanager
def record_picks():
  """Yields a dict {implementation: calls}; each attention call traced inside adds the one it ran
  ("auto" resolved). The trainer records it in each trial's summary (attention_impls)."""
  seen: dict[str, int] = {}
  token = _PICKS.set(seen)
  try:
    yield seen
  finally:
    _PICKS.reset(token)


def check_impl(impl, *dtypes) -> None:
  """Raises ConfigError naming impl unless it is one of IMPLS that runs here on these dtypes."""
  if impl not in IMPLS and impl not in IMPLEMENTATIONS:
    raise invalid("impl", impl, f"one of {IMPLS}")
  if impl != "auto" and (why := _impls.why_not_here(IMPLEMENTATIONS[impl], dtypes)) is not None:
    raise invalid("impl", impl, f"an implementation that runs here ({why}); available: {available_impls()}")


def available_impls() -> list[str]:
  """The impls that can run on this machine's default backend ("onednn" builds its handlers to find out)."""
  return _impls.available()


def best_impl(q_BTHK: Array, k_BSGK: Array, v_BSGV: Array, *, return_weights: bool = False,
              logits_bias: Array | None = None, sinks: Array | None = None,
              softcap: float | None = None, probability: str = "softmax") -> str:
  """"auto"'s pick (impls.AUTO): on a GPU cuDNN, then tokamax, on a TPU splash, where they
  apply; the blocked kernel for T·S >= BLOCKED_MIN_SCORES without weights out or logits_bias;
  else "einsum"."""
  return _impls.pick(Call(q_BTHK, k_BSGK, v_BSGV, logits_bias=logits_bias,
                          return_weights=return_weights, sinks=sinks, softcap=softcap,
                          probability=probability))


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
    choice: KeyChoice | None = None,
    entries: tuple | None = None,
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
  visible (attn.kernel.probability; no sinks), in float32.

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

  impl names one implementation of the same function from
  attn.kernel.impls.IMPLEMENTATIONS: "einsum" (the default; materialises
  (B,H,T,S); every option), "blocked" (online softmax over blocks of block_q
  queries and block_k keys, a recomputing VJP, no T×S array, masked blocks
  skipped; no weights out, no logits_bias), "xla" or "cudnn"
  (jax.nn.dot_product_attention; d_v = d_k, no weights out, sinks, softcap,
  softmax only; cuDNN on a GPU in half precision), "onednn" (opt-in, CPU,
  float32: the structure "auto" picks on CPU with its products on oneDNN's
  sgemm through jax.ffi), "splash" (TPU, or anywhere with
  ATTN_PALLAS_INTERPRET=1: Pallas's splash attention; no weights out,
  logits_bias or dense mask), "tokamax" (GPU, the tokamax extra; no sinks,
  no weights out), or "auto" (the first of impls.AUTO for the backend
  that can run the call: cuDNN, then tokamax on a GPU, splash on a TPU, the
  blocked kernel from T·S >= BLOCKED_MIN_SCORES = 512², the crossover
  measured on CPU, else einsum). choice, a KeyChoice (a key-selecting mechanism's), restricts
  each query to the keys it names and runs on its row ("gathered" or "sparse", attn.kernel.selected;
  impl "auto" or the row's name); impls.selects is the rule for when a choice goes there.
  entries, (ck (B,N,G,K), cv (B,N,G,V), m, their mask or None), are compressed keys and values
  beside the tokens in the same softmax (attn.kernel.compressed builds them; einsum and blocked
  take them, "auto" counting them as keys). An
  implementation that cannot run the call is a ConfigError naming it, the
  option at fault and the implementations that can, before tracing.
  """
  call = make_call(q_BTHK, k_BSGK, v_BSGV, mask, is_causal=is_causal, kv_lengths=kv_lengths,
                   scale=scale, logits_bias=logits_bias, return_weights=return_weights,
                   block_q=block_q, block_k=block_k, window=window, sinks=sinks, softcap=softcap,
                   probability=probability, choice=choice, entries=entries)
  check_impl(impl, *call.dtypes)
  name = _impls.pick(call) if impl == "auto" else impl
  chosen = IMPLEMENTATIONS[name]
  if (no := _impls.refuses(chosen, call)) is not None:
    raise invalid(no.option, no.value, f'{no.needs} with impl="{name}" ({no.why}); '
                  f"the implementations that take this call here: {_impls.takers(call)}")
  if (seen := _PICKS.get()) is not None:
    seen[name] = seen.get(name, 0) + 1
  return chosen.run(call)


__all__ = [
    "AUTO", "BLOCKED_MIN_SCORES", "IMPLEMENTATIONS", "IMPLS", "Call", "Impl", "KeyChoice", "Refusal", "attention",
    "available_impls", "best_impl", "record_picks", "blocked", "check_impl", "check_options", "dense", "is_long",
    "masked_probabilities", "masked_softmax", "masks", "onednn", "probability",
    "reference_attention", "scores", "structured_mask", "weighted_sum",
]
