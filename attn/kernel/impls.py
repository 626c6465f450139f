"""The attention core's implementations, one record each, and the order "auto" tries them in.

An Impl names the backends it runs on, why it cannot run on this machine at all
(a missing wheel), why it cannot run a given call (an option, a shape, a dtype),
whether "auto" should prefer it for a call it can run, and the function that
runs it. Adding an implementation is one record here and one row of AUTO where
"auto" should consider it. kernel.attention checks a call, asks the record,
and turns a refusal into a ConfigError that names the implementation, the
option at fault and the implementations that take the call.

Every attention path is a row: the key-selection rows (attn.kernel.selected: gathered, sparse)
run a call that carries a key choice (call.KeyChoice) only, and `selects` is the one rule that
decides, before a mechanism chooses, whether its choice runs on them or becomes a dense mask;
compressed entries beside the tokens (call.entries, attn.kernel.compressed) run on the rows that
take them (Impl.entries: einsum, blocked), `refuses` turning them away from the others.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax

from attn.kernel import blocked, dense, entries, onednn, selected, splash, tokamax_kernel, xla
from attn.kernel.call import Call, Refusal
from attn.kernel.products import ONEDNN, XLA, Products

Array = jax.Array


def _never(*_) -> None:
  return None


def _always(_: Call) -> bool:
  return True


def _compiled() -> bool:
  return False


@dataclasses.dataclass(frozen=True)
class Impl:
  """One implementation of kernel.attention's function."""

  name: str
  backends: tuple[str, ...]  # jax.default_backend() values it runs on
  run: Callable[[Call], Array | tuple[Array, Array]]
  why_not: Callable[[Call], Refusal | None] = _never  # what of a call it cannot run, or None
  unavailable: Callable[[], str | None] = _never  # why it cannot run on this machine at all, or None
  dtypes: tuple[str, ...] | None = None  # the input dtypes it takes (None: any float)
  prefers: Callable[[Call], bool] = _always  # "auto" picks it, where it can run, only for these calls
  help: str = ""
  interpreted: Callable[[], bool] = _compiled  # True: runs on any backend now (Pallas interpret mode)
  chooses: bool = False  # runs a call with a key choice only (attn.kernel.selected), never a plain one
  entries: bool = False  # takes compressed entries beside the tokens (call.entries; attn.kernel.entries)


# "auto" on CPU: the blocked kernel from T·S >= 512² scores per (batch, head).
# Measured forward+backward on a 2-core Zen 3, H=8, K=V=64, float32, blocks of
# 512 × 256 (python scripts/blocked_crossover.py; experiments/performance.md,
# Long sequences): blocked ÷ einsum at B=8 1.57 for T=S=256, 1.01 for 384, 0.88
# for 512; at B=1 1.03, 1.10 and 0.86.
BLOCKED_MIN_SCORES = 512 * 512


def is_long(T: int, S: int) -> bool:
  """T queries by S keys is where the blocked kernel beats the einsum one on CPU."""
  return T * S >= BLOCKED_MIN_SCORES


def _long(call: Call) -> bool:
  return is_long(call.T, call.S + call.N)  # the compressed entries are keys too


def _run_dense(call: Call, products: Products = XLA):
  if call.entries is not None:
    return entries.run_dense(call, products)
  return dense.attention(call.q_BTHK, call.k_BSGK, call.v_BSGV, call.mask, is_causal=call.is_causal,
                         kv_lengths=call.kv_lengths, scale=call.scale, logits_bias=call.logits_bias,
                         return_weights=call.return_weights, window=call.window, sinks=call.sinks,
                         softcap=call.softcap, probability=call.probability, products=products)


def _run_blocked(call: Call, products: Products = XLA) -> Array:
  c = call.with_shared_key()
  return blocked.attention(c.q_BTHK, c.k_BSGK, c.v_BSGV, c.mask, is_causal=c.is_causal,
                           kv_lengths=c.kv_lengths, scale=c.scale, block_q=c.block_q,
                           block_k=c.block_k, window=c.window, sinks=c.sinks, softcap=c.softcap,
                           probability=c.probability, products=products,
                           **({} if c.entries is None else {"compressed": c.entries}))


def _why_not_blocked(call: Call) -> Refusal | None:
  if call.return_weights:
    return Refusal("return_weights", True, "False", "the blocked kernel never builds the weights")
  if call.logits_bias is not None:
    return Refusal("logits_bias", "an array", "None", "the blocked kernel takes structured masks only")
  return None


def _run_onednn(call: Call):
  """The structure "auto" picks on CPU (einsum, or blocked for long plain calls), its products on oneDNN."""
  if call.plain and _long(call):
    return _run_blocked(call, ONEDNN)
  return _run_dense(call, ONEDNN)


def _onednn_unavailable() -> str | None:
  return onednn.why_not()


ALL_BACKENDS = ("cpu", "gpu", "tpu")

IMPLEMENTATIONS: dict[str, Impl] = {impl.name: impl for impl in (
    Impl("einsum", ALL_BACKENDS, _run_dense, entries=True,
         help="the (B,H,T,S) logits materialised; every option (attn.kernel.dense; entries: attn.kernel.entries)"),
    Impl("blocked", ALL_BACKENDS, _run_blocked, why_not=_why_not_blocked, prefers=_long, entries=True,
         help="online softmax over blocks, masked blocks skipped, no T×S array (attn.kernel.blocked)"),
    Impl("xla", ALL_BACKENDS, lambda call: xla.attention(call, "xla"), why_not=xla.why_not,
         prefers=lambda call: False, help="jax.nn.dot_product_attention's XLA path"),
    Impl("cudnn", ("gpu",), lambda call: xla.attention(call, "cudnn"), why_not=xla.why_not_cudnn,
         dtypes=("bfloat16", "float16"), prefers=lambda call: call.K <= 128,
         help="cuDNN's flash attention through jax.nn.dot_product_attention"),
    Impl("onednn", ("cpu",), _run_onednn, unavailable=_onednn_unavailable, dtypes=("float32",),
         prefers=lambda call: False,
         help="the einsum or blocked structure with its products on oneDNN's sgemm (attn.kernel.onednn)"),
    Impl("splash", ("tpu",), splash.attention, why_not=splash.why_not, unavailable=splash.unavailable,
         dtypes=("float32", "bfloat16"), prefers=lambda call: call.T >= splash.LANES,
         interpreted=splash.interpret,
         help="Pallas's TPU splash attention (attn.kernel.splash; ATTN_PALLAS_INTERPRET=1 runs it anywhere)"),
    Impl("tokamax", ("gpu",), lambda call: tokamax_kernel.attention(call), why_not=tokamax_kernel.why_not,
         unavailable=tokamax_kernel.unavailable, prefers=lambda call: call.T >= 128,
         help="tokamax.dot_product_attention's Mosaic/Triton GPU kernels (attn.kernel.tokamax_kernel; extra [tokamax])"),
    Impl("gathered", ALL_BACKENDS, selected.run_gathered, why_not=lambda call: selected.why_not(call, "gathered"),
         prefers=_long, chooses=True,
         help="a key choice of blocks per (query, head): each chosen (query, block) pair once (attn.kernel.gathered)"),
    Impl("sparse", ALL_BACKENDS, selected.run_sparse, why_not=lambda call: selected.why_not(call, "sparse"),
         prefers=_long, chooses=True,
         help="a key choice of tokens: the blocked kernel over the blocks holding one (attn.kernel.sparse)"),
)}

# The order "auto" tries, per backend: the first that runs here, can run the
# call and prefers it. einsum takes every call, so each list ends with it.
# The GPU and TPU rows are not measured yet (no accelerator has run attn):
# they follow MaxText's rule (the backend's flash kernel except for short
# queries and decoding) until scripts/device_check.sh's numbers say otherwise.
AUTO: dict[str, tuple[str, ...]] = {
    "cpu": ("blocked", "einsum"),
    "gpu": ("cudnn", "tokamax", "blocked", "einsum"),
    "tpu": ("splash", "blocked", "einsum"),
}


# Key choices, on every backend: a call whose keys a mechanism chooses runs on the choice's row
# (gathered, sparse) when impl is "auto" or "blocked" (the rows are blocked kernels; naming another
# implementation asks for the dense path), the rows take the call and it is long (T·S >=
# BLOCKED_MIN_SCORES, where the blocked kernel beats einsum on CPU); else the choice is a dense mask
# ANDed into the call's, on the implementation the call names. Not measured on an accelerator yet.
CHOICE_IMPLS = ("auto", "blocked")


def selects(call: Call, impl: str) -> bool:
  """Whether a key choice for this call (without it yet) runs on its row: the one sparse-or-dense rule."""
  return impl in CHOICE_IMPLS and selected.why_not(call) is None and _long(call)


def refuses(impl: Impl, call: Call) -> Refusal | None:
  """What of a call impl cannot run: compressed entries where it takes none, else its own why_not."""
  if call.entries is not None and not impl.entries:
    return Refusal("entries", "compressed entries", "None", "it attends to tokens only (einsum and blocked "
                   "take entries)")
  return impl.why_not(call)


def backend() -> str:
  return jax.default_backend()


def why_not_here(impl: Impl, dtypes=()) -> str | None:
  """Why impl cannot run on this machine's default backend with these input dtypes, or None."""
  here = backend()
  if here not in impl.backends and not impl.interpreted():
    names = "/".join(b.upper() for b in impl.backends)
    hint = (f"; {splash.INTERPRET_ENV}=1 runs it in Pallas interpret mode anywhere, slowly"
            if impl.interpreted is not _compiled else "")
    return f'it runs on the {names} backend only (the default backend is "{here}"{hint})'
  if impl.dtypes is not None:
    bad = sorted({str(d) for d in dtypes} - set(impl.dtypes))
    if bad:
      return f"it takes {', '.join(impl.dtypes)} only, got {', '.join(bad)}"
  return impl.unavailable()


def available() -> list[str]:
  """"auto" and the implementations that run on this machine's default backend."""
  return ["auto"] + [name for name, impl in IMPLEMENTATIONS.items()
                     if not impl.chooses and why_not_here(impl) is None]


def pick(call: Call) -> str:
  """"auto"'s choice for a call: its key choice's row, or the first of AUTO[backend] that can run it
  and prefers it."""
  if call.choice is not None:
    return call.choice.impl
  for name in AUTO.get(backend(), AUTO["cpu"]):
    impl = IMPLEMENTATIONS[name]
    if why_not_here(impl, call.dtypes) is None and refuses(impl, call) is None and impl.prefers(call):
      return name
  return "einsum"


def takers(call: Call) -> list[str]:
  """The implementations that run here and can run this call ("auto" always can)."""
  return ["auto"] + [name for name, impl in IMPLEMENTATIONS.items()
                     if why_not_here(impl, call.dtypes) is None and refuses(impl, call) is None]
