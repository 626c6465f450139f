"""Counting per attention layer: parameters three ways, FLOPs and KV-cache bytes.

Per attention layer (HeadConfig, any registered variant), each the variant's
own plus its head mechanisms' (attn.variants.mechanisms: gates, sinks, QK-norm):
  analytic   the variant's closed form (one line of math in its file), or, for a
             record without one, the stored count, labelled measured;
  stored     the elements of the tree `attn.init` creates (read from its shapes);
  effective  the degrees of freedom of the function class (≤ stored); without a
             closed form, the Jacobian's rank at small sizes (attn.count.measured).
FLOPs, KV-cache width and score weights without a closed form are measured too
(XLA's cost analysis; what decoding caches; gradients); layer_table marks every
measured figure, and `attn count` prints "(measured)" beside it.
FLOPs count a multiply-add as 2, per batch element, softmax and elementwise
ops not counted (the fixed-state heads count their chunked core's, gates' and
norms' elementwise work too, as XLA does: attn.variants.linear.core.chunked_flops). The backward pass of a matmul y = a·b is two matmuls of the
same size (da = dy·bᵀ, db = aᵀ·dy), so forward+backward = 3 × forward.

A layer is checked once (`check_layer`: api.check_config) into a `Layer` record and every figure is
derived from it; the functions of (variant, cfg) below check and ask the record.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax.numpy as jnp

from attn import api
from attn.count import measured
from attn.config import ConfigError, HeadConfig, invalid
from attn.variants import mechanisms
from attn.variants.mechanisms import selection
from attn.variants.base import Variant

# The one default dtype of every byte count (KV cache, fixed state) in attn.count: reports and the CLI use it too.
DTYPE = "float32"


def _closed(own, mech, cfg: HeadConfig, *args) -> int | None:
  """The variant's closed form plus its active mechanisms', or None where one of them has none
  (a closed form may also return None at a config it does not cover: mla's latent norms)."""
  extra = mech(cfg, *args)
  value = None if own is None or extra is None else own(cfg, *args)
  return None if value is None else int(value + extra)


def check_length(name: str, value: Any) -> int:
  if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
    raise invalid(name, value, "a positive integer sequence length")
  return value


def _itemsize(dtype: Any) -> int:
  try:
    return jnp.dtype(dtype).itemsize
  except TypeError:
    raise invalid("dtype", dtype, "a dtype name: float32, bfloat16, float16, int8, ...") from None


@dataclasses.dataclass(frozen=True)
class Layer:
  """One attention layer, checked once: the variant's record and its config; every figure derives from it.

  Made by `check_layer(variant, cfg)`; its methods are the module's functions of
  (variant, cfg) without checking again.
  """

  variant: Variant
  cfg: HeadConfig

  @property
  def name(self) -> str:
    return self.variant.name

  @functools.cached_property
  def stored(self) -> int:
    """Elements of the tree attn.init creates, read from its shapes (cfg already checked)."""
    return sum(math.prod(shape) for shape in api._param_shapes(self.variant, self.cfg).values())

  def measured_figures(self) -> list[str]:
    """The figures measured for lack of a closed form, named as MEASURED_COLUMNS names them."""
    v, cfg, out = self.variant, self.cfg, []
    for figure, own, mech in (("analytic", v.param_count, mechanisms.param_count),
                              ("effective", v.effective_param_count, mechanisms.effective_param_count),
                              ("score_weights", v.score_weights, mechanisms.score_weights)):
      if _closed(own, mech, cfg) is None:
        out.append(figure)
    if v.flops is None or mechanisms.flops(cfg, 1, 1) is None:
      out.append("flops")
    if v.kv_cache_width is None and v.kv_cache_elements is None:
      out.append("kv_cache")
    return out

  def analytic_params(self) -> int:
    """param_counts()["analytic"] without measuring the effective count (a Jacobian's rank)."""
    analytic = _closed(self.variant.param_count, mechanisms.param_count, self.cfg)
    return int(self.stored) if analytic is None else analytic

  def param_counts(self) -> dict[str, int | None]:
    """{"analytic", "stored", "effective"}: param_counts."""
    v, cfg = self.variant, self.cfg
    analytic = _closed(v.param_count, mechanisms.param_count, cfg)
    effective = _closed(v.effective_param_count, mechanisms.effective_param_count, cfg)
    if effective is None:  # the Jacobian's rank, for layers small enough (measured.effective)
      # a layer reusing another's indexer choice is measured as one choosing its own (selection.unshared)
      effective = (None if self.stored > measured.JACOBIAN_MAX_PARAMS
                   else measured.jacobian_rank(v, selection.unshared(cfg)))
    return {"analytic": self.stored if analytic is None else analytic, "stored": int(self.stored),
            "effective": effective}

  def score_weights(self) -> int:
    closed = _closed(self.variant.score_weights, mechanisms.score_weights, self.cfg)
    return measured.score_weights(self.variant, self.cfg) if closed is None else closed

  def flops(self, T: int, S: int | None = None, backward: bool = False) -> int:
    T = check_length("T", T)
    S = T if S is None else check_length("S", S)
    forward = _closed(self.variant.flops, mechanisms.flops, self.cfg, T, S)
    if forward is None:
      return measured.flops(self.variant, self.cfg, T, S, backward)
    return 3 * forward if backward else forward

  def kv_cache_bytes_per_token(self, dtype: Any = DTYPE) -> int:
    v, cfg = self.variant, self.cfg
    if v.kv_cache_elements is not None:  # a cache of its own: its growth over a long run, rounded up
      grow = lambda n: v.kv_cache_elements(cfg, n)
      far = 1 << 40  # past any window; the growth over 2^20 tokens, which a block divides or barely misses
      return -(-(grow(far + (1 << 20)) - grow(far)) * _itemsize(dtype) // (1 << 20))
    width = measured.kv_cache_width(v, cfg) if v.kv_cache_width is None else v.kv_cache_width(cfg)
    return int(width) * _itemsize(dtype)

  def kv_cache_bytes(self, length: int, dtype: Any = DTYPE) -> int:
    v, cfg = self.variant, self.cfg
    if v.kv_cache_elements is not None:  # a cache of its own (compressed), in closed form
      return v.kv_cache_elements(cfg, check_length("length", length)) * _itemsize(dtype)
    kept = mechanisms.kv_tokens(cfg, check_length("length", length))
    return kept * self.kv_cache_bytes_per_token(dtype)

  def state_bytes(self, dtype: Any = "float32") -> int:
    v, cfg = self.variant, self.cfg
    if v.init_state is None:
      return 0
    size = measured.state_size(v, cfg) if v.state_size is None else v.state_size(cfg)
    return int(size) * _itemsize(dtype)

  def state_crossover(self, dtype: Any = DTYPE) -> int | None:
    state = self.state_bytes()
    if not state:
      return None
    return -(-state // check_layer("per_head", mechanisms.plain(self.cfg)).kv_cache_bytes_per_token(dtype))


def check_layer(variant: str | Variant, cfg: HeadConfig) -> Layer:
  """The layer of `variant` at cfg, checked once (api.check_config: a ConfigError names what it refuses)."""
  return Layer(api.check_config(variant, cfg), cfg)


def measured_figures(variant: str, cfg: HeadConfig) -> list[str]:
  """The figures of one layer that attn.count measures (attn.count.measured) for lack of a closed form.

  Names as in layer_table's rows: analytic, effective, score_weights, flops, kv_cache.
  """
  return check_layer(variant, cfg).measured_figures()


def param_counts(variant: str, cfg: HeadConfig) -> dict[str, int | None]:
  """{"analytic", "stored", "effective"} parameter counts of one layer.

  Where the variant or a mechanism has no closed form, analytic is the stored
  count and effective the Jacobian's rank (None for a layer too large to
  measure it); measured_figures names them.
  """
  return check_layer(variant, cfg).param_counts()


def score_weight_count(variant: str, cfg: HeadConfig) -> int:
  """Weights of one layer that the attention logits depend on (no biases, no values)."""
  return check_layer(variant, cfg).score_weights()


def flops(variant: str, cfg: HeadConfig, T: int, S: int | None = None,
          backward: bool = False) -> int:
  """FLOPs of one layer per batch element: forward, or forward+backward (3× in closed form;
  XLA's cost analysis of both passes where the layer has no closed form)."""
  return check_layer(variant, cfg).flops(T, S, backward)


def kv_cache_bytes_per_token(variant: str, cfg: HeadConfig, dtype: Any = DTYPE) -> int:
  """Bytes one layer caches per decoded token (MHA 2·H·K, GQA 2·G·K, MQA 2·K elements); what
  decoding caches where the variant has no closed form."""
  return check_layer(variant, cfg).kv_cache_bytes_per_token(dtype)


def kv_cache_bytes(variant: str, cfg: HeadConfig, length: int, dtype: Any = DTYPE) -> int:
  """Bytes one layer caches after `length` tokens: a window layer keeps only the last `window`
  (each mechanism's kv_tokens)."""
  return check_layer(variant, cfg).kv_cache_bytes(length, dtype)


def state_bytes(variant: str, cfg: HeadConfig, dtype: Any = "float32") -> int:
  """Bytes of one layer's fixed-size decoding state per sequence, whatever its length (a head with
  a state: Variant.state_size; 0 for a head with a KV cache). float32 by default: the state
  accumulates in float32 (attn.variants.linear.core)."""
  return check_layer(variant, cfg).state_bytes(dtype)


def state_crossover(variant: str, cfg: HeadConfig, dtype: Any = DTYPE) -> int | None:
  """The context length at which a softmax layer of the same HeadConfig (per_head) caches as many
  bytes as this layer's state (the state in float32, the KV cache in dtype); None without a state."""
  return check_layer(variant, cfg).state_crossover(dtype)


def layer_table(cfg: HeadConfig, T: int, S: int | None = None, dtype: Any = DTYPE,
                variants: list[str] | None = None) -> list[dict[str, Any]]:
  """One row per variant: the three counts, score weights, FLOPs and KV-cache bytes.

  A variant that refuses cfg (split_input when h does not divide d_model) gets
  a row {"variant", "error"} instead of numbers; a plugin's record whose own code
  raises gets {"variant", "plugin_error"} naming its entry point (built-ins raise). "measured" lists the columns
  measured for lack of a closed form (measured_figures), never shown as formulas.
  """
  check_length("T", T)
  check_length("S", T if S is None else S)
  _itemsize(dtype)
  rows = []
  for name in variants or list(api.VARIANTS):
    try:
      rows.append(_layer_row(check_layer(name, cfg), T, S, dtype))
    except ConfigError as e:
      rows.append({"variant": name, "error": str(e)})
    except Exception as e:  # noqa: BLE001  a plugin's own code failed: its row says so, the rest go on
      if api.VARIANTS.source(name) == "attn":
        raise
      rows.append({"variant": name, "plugin_error": f"{api.VARIANTS.where(name)} failed while counting: "
                                                    f"{type(e).__name__}: {e}"})
  return rows


def _layer_row(layer: Layer, T: int, S: int | None, dtype: Any) -> dict[str, Any]:
  score, H = layer.score_weights(), layer.cfg.num_heads
  row = {"variant": layer.name, **layer.param_counts(), "score_weights": score,
         "score_weights_per_head": score // H if score % H == 0 else score / H,
         "flops_fwd": layer.flops(T, S),
         "flops_fwd_bwd": layer.flops(T, S, backward=True),
         "kv_bytes_per_token": layer.kv_cache_bytes_per_token(dtype),
         "kv_bytes_at_T": layer.kv_cache_bytes(T, dtype)}
  if layer.variant.init_state is not None:  # a fixed-size state: bytes and where KV passes it
    row |= {"state_bytes": layer.state_bytes(), "state_crossover_T": layer.state_crossover(dtype)}
  figures = layer.measured_figures()
  if figures:
    row["measured"] = [c for f in figures for c in MEASURED_COLUMNS[f]]
  return row


# The columns of layer_table each measured figure fills.
MEASURED_COLUMNS = {"analytic": ("analytic",), "effective": ("effective",),
                    "score_weights": ("score_weights", "score_weights_per_head"),
                    "flops": ("flops_fwd", "flops_fwd_bwd"),
                    "kv_cache": ("kv_bytes_per_token", "kv_bytes_at_T")}


def mechanism_table(variant: str, cfg: HeadConfig, T: int, dtype: Any = DTYPE,
                    window: int | None = None) -> list[dict[str, Any]]:
  """One row per example of each registered head mechanism: what it adds to one layer of `variant`.

  Parameters and forward FLOPs (for T tokens) added over the layer without any
  mechanism, in closed form and as numbers; the KV cache after T tokens, which
  only a window (default cfg.window, else T // 4) changes.
  """
  plain = mechanisms.plain(cfg)
  base = check_layer(variant, plain)
  base_params, base_flops = base.param_counts()["analytic"], base.flops(T)
  base_cache = base.kv_cache_bytes(T, dtype)
  w = window or cfg.window or max(T // 4, 1)
  rows = []
  for m in mechanisms.MECHANISMS.values():
    for label, change, params_form, flops_form in mechanisms.examples(m):
      if "window" in change:
        change, label = {**change, "window": w}, f"{label} {w}"
      try:
        on = check_layer(variant, plain.replace(**change))
      except ConfigError as e:
        rows.append({"mechanism": label, "error": str(e)})
        continue
      rows.append({"mechanism": label, "params_formula": params_form,
                   "params": on.param_counts()["analytic"] - base_params,
                   "flops_formula": flops_form, "flops_fwd": on.flops(T) - base_flops,
                   "kv_cache_bytes": on.kv_cache_bytes(T, dtype) - base_cache})
  return rows
