"""The Mechanism record: one head mechanism (attn.variants.mechanisms documents the fields and the
registry; attn.variants.mechanisms.head_mechanisms holds the built-ins)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import jax

from attn.config import HeadConfig

Array = jax.Array
Params = dict[str, Array]


@dataclasses.dataclass(frozen=True, eq=False)
class Mechanism:
  """One head mechanism (module docstring); only name is required."""

  name: str
  fields: tuple[str, ...] = ()
  defaults: Mapping[str, Any] | None = None
  check: Callable[[HeadConfig], None] | None = None
  init: Callable[[Array, HeadConfig, Any], Params] | None = None
  sharding: Mapping[str, str | None] | None = None
  on_qk: Callable[..., tuple[Array, Array]] | None = None
  on_qkv: Callable[..., tuple[Array, Array, Array]] | None = None  # the projections, before on_qk
  # on_qkv also takes inputs=(the query, key and value projections' inputs (B,T|S,D)), None where not handed
  reads_inputs: bool = False
  # Its decoding state: cfg -> {name: per-sequence shape} (the cache holds (B, *shape) zeros at the start)
  state: Callable[[HeadConfig], Mapping[str, tuple[int, ...]]] | None = None
  on_logits: Callable[..., Array] | None = None
  # Reads the layer's query tokens and positions: (params, x_BTD, q_BTHK, *, cfg, positions) -> (q, logits_bias
  # or None), right before the kernel (attn.variants.mechanisms.token_logits)
  on_tokens: Callable[..., tuple[Array, Array | None]] | None = None
  absolute: bool = False  # it reads absolute positions: shifting every position changes it (the kit's rope check)
  on_output: Callable[..., Array] | None = None
  kernel: Callable[[Params, HeadConfig], dict[str, Any]] | None = None
  select: Callable[..., Any] | None = None  # chooses keys: a mask or a kernel.KeyChoice (attn.variants.mechanisms)
  attend: Callable[..., Any] | None = None  # replaces the attention core (nsa; attn.variants.mechanisms)
  param_count: Callable[[HeadConfig], int] | None = None
  effective_param_count: Callable[[HeadConfig], int] | None = None
  flops: Callable[[HeadConfig, int, int], int] | None = None
  score_weights: Callable[[HeadConfig], int] | None = None
  kv_tokens: Callable[[HeadConfig, int], int] | None = None
  # What it reads of the variant (attn.variants.base.OFFERS) -> why; or cfg -> that. A variant that
  # lacks one refuses the mechanism there (base.check_offers), its reason beside the mechanism's.
  needs: Mapping[str, str] | Callable[[HeadConfig], Mapping[str, str]] | None = None
  examples: tuple[tuple[str, Mapping[str, Any], str, str], ...] = ()
  help: str = ""


class HookError(ValueError):
  """A mechanism's hook returned something the shared path cannot go on with; names the hook."""

  def __init__(self, mechanism: str, hook: str, message: str):
    super().__init__(f"mechanism {mechanism!r}.{hook}: {message}")
    self.mechanism, self.hook = mechanism, hook
