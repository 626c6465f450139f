"""One attention call, checked: the record every implementation's refusal and run read.

kernel.attention validates its arguments here, before any tracing, and hands
the implementations a Call: the arrays, the options, and the shape letters.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp

from attn.config import check_mask, check_structured, invalid
from attn.kernel import probability as prob

Array = jax.Array


def check_qkv(q_BTHK, k_BSGK, v_BSGV) -> None:
  """q (B,T,H,K), k (B,S,G,K), v (B,S,G,V), H a multiple of G (k may have one head)."""
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


def check_block(name: str, value) -> None:
  if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
    raise invalid(name, value, "a positive integer or None (chosen from the shapes)")


def check_options(window, sinks, softcap, num_heads: int, probability: str = "softmax") -> None:
  """window a positive int, sinks (H,) floats, softcap a positive finite number, each or None;
  probability one of attn.kernel.probability.PROBABILITIES, softmax with sinks."""
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


@dataclasses.dataclass(frozen=True)
class Refusal:
  """Why an implementation cannot run a call: the option at fault, its value, what it needs, why."""

  option: str
  value: object
  needs: str
  why: str


@dataclasses.dataclass(frozen=True)
class KeyChoice:
  """The keys each query may attend to, as a key-selection row of the table runs them: the row's name
  (impls.IMPLEMENTATIONS: "gathered" blocks per (query, head), "sparse" tokens in key blocks) and its
  arguments (the arrays of the choice, without gradient). A mechanism's select returns one
  (attn.variants.mechanisms); kernel.attention(..., choice=) runs it."""

  impl: str
  args: dict


@dataclasses.dataclass(frozen=True)
class Call:
  """kernel.attention's arguments after its checks; scale resolved (1/sqrt(K) by default)."""

  q_BTHK: Array
  k_BSGK: Array
  v_BSGV: Array
  mask: Array | None = None
  is_causal: bool = False
  kv_lengths: Array | None = None
  scale: float = 1.0
  logits_bias: Array | None = None
  return_weights: bool = False
  block_q: int | None = None
  block_k: int | None = None
  window: int | None = None
  sinks: Array | None = None
  softcap: float | None = None
  probability: str = "softmax"
  choice: KeyChoice | None = None  # the keys a key-selection row attends to (None: every visible key)
  entries: tuple | None = None  # compressed entries beside the tokens: (ck, cv, m, entry mask) (kernel.entries)

  @property
  def T(self) -> int:
    return self.q_BTHK.shape[1]

  @property
  def S(self) -> int:
    return self.k_BSGK.shape[1]

  @property
  def H(self) -> int:
    return self.q_BTHK.shape[2]

  @property
  def K(self) -> int:
    return self.q_BTHK.shape[3]

  @property
  def N(self) -> int:
    """Compressed entries beside the S tokens (0 without)."""
    return 0 if self.entries is None else self.entries[0].shape[1]

  @property
  def V(self) -> int:
    return self.v_BSGV.shape[3]

  @property
  def dtypes(self) -> set[str]:
    return {str(jnp.dtype(a.dtype)) for a in (self.q_BTHK, self.k_BSGK, self.v_BSGV)}

  @property
  def plain(self) -> bool:
    """No weights out and no logits_bias: what every implementation but the dense ones needs."""
    return not self.return_weights and self.logits_bias is None

  def with_shared_key(self) -> "Call":
    """A one-head key broadcast to v's kv heads, for the implementations that do not share it."""
    k, G = self.k_BSGK, self.v_BSGV.shape[2]
    if k.shape[2] == G:
      return self
    return dataclasses.replace(self, k_BSGK=jnp.broadcast_to(k, (*k.shape[:2], G, k.shape[3])))


def make_call(q_BTHK, k_BSGK, v_BSGV, mask=None, *, is_causal=False, kv_lengths=None, scale=None,
              logits_bias=None, return_weights=False, block_q=None, block_k=None, window=None,
              sinks=None, softcap=None, probability="softmax", choice=None, entries=None) -> Call:
  """Checks kernel.attention's arguments (ConfigError naming the first bad one) into a Call."""
  check_qkv(q_BTHK, k_BSGK, v_BSGV)
  B, T, H, K = q_BTHK.shape
  S = k_BSGK.shape[1]
  if mask is not None:
    check_mask(mask, (B, H, T, S))
  check_structured(is_causal, kv_lengths, B, S)
  check_block("block_q", block_q)
  check_block("block_k", block_k)
  check_options(window, sinks, softcap, H, probability)
  if choice is not None and not isinstance(choice, KeyChoice):
    raise invalid("choice", type(choice).__name__, "None or a kernel.KeyChoice (a key-selection row and "
                  "its arguments)")
  return Call(q_BTHK, k_BSGK, v_BSGV, mask, is_causal, kv_lengths,
              1.0 / math.sqrt(K) if scale is None else scale, logits_bias, return_weights,
              block_q, block_k, window, sinks, softcap, probability, choice, entries)
