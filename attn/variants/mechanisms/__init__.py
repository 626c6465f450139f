"""Head mechanisms: features any variant carries, each one `Mechanism` record in one Registry.

The package: record (the Mechanism record), this module (the registry and the points of the shared
path), choice (the one hook for a mechanism that chooses keys or replaces the attention), the
built-ins: head_mechanisms (gate, sinks, qk_norm, window, softcap, probability), token_logits
(Inkling-2's per-token sinks, relative bias, log scaling), cca (ZAYA1's compressed convolutional attention), selection (moba, the lightning indexer), nsa, pooled (kpool,
qsa, block_indexer: pooled index keys).

The built-ins (gate, sinks, qkv_conv, cca, qk_norm, qk_l2_clip, value_scale, window, softcap, probability, moba,
indexer, nsa, kpool, qsa, block_indexer, token_sinks, log_scaling, rel_bias), plugins
of the entry-point group `attn.mechanisms` and records given
to `attn.register` are all read from MECHANISMS: validation (api.check_config),
init (attn.init), counting (attn.count), sharding (attn.nn.sharding), the
`attn count --mechanisms` table and its help (and so the table in
experiments/parameter_counts/README.md, which scripts/count_tables.py writes).

A record acts at one or more points of the shared path every variant goes
through (attn.variants.base):

  on_qkv(params, q_BTHK, k_BSGK, v_BSGV, *, cfg,     the projections as attend_and_project gets
         state) -> (q, k, v)                         them, before on_qk (qkv_conv, cca); state: None
                                                     (a full pass), or while decoding the dict of
                                                     the record's `state` entries, which the hook
                                                     reads and replaces by those after x's tokens.
                                                     Only variants that offer "qkv_heads" reach it
  on_qk(params, q_BTHK, k_BSGK, *, cfg) -> (q, k)   queries and keys before the scores
                                                     (before RoPE; qk_norm)
  on_tokens(params, x_BTD, q_BTHK, *, cfg,          the layer's query tokens and positions (queries',
            positions) -> (q, bias or None)          keys'), right before the kernel: queries scaled,
                                                     a logits bias (B,H,T,S)-broadcastable added
                                                     (token_sinks, rel_bias, log_scaling)
  on_logits(params, logits_BHTS, *, cfg) -> logits  the scaled float32 logits before the
                                                     softmax (softcap)
  on_output(params, x_BTD, o_BTHV, *, cfg) -> o     each head's output before W^O (gate)
  kernel(params, cfg) -> dict                       keyword arguments of kernel.attention
                                                     (window, sinks, softcap, probability:
                                                     built-ins only)
  select(params, q, k, *, cfg, is_causal,           the keys each query may attend to (key
         kv_lengths, mask, dense, index)             selection: moba, indexer, pooled; one a layer):
                                                     a dense mask, or a kernel.KeyChoice that a
                                                     row of the kernel's table computes alone
  attend(params, x, q, k, v, *, cfg, opts,          replaces the attention core (nsa's three
         kernel_args, explicit)                      branches): (o, weights), or the opts to go on
                                                     with. select and attend reach the core through
                                                     one hook (choice.py documents both contracts)

A mechanism with on_logits and no kernel keywords makes the layer take the
einsum path (explicit logits, base.probabilities), since the fused kernels do
not see it.

Options. A built-in's options are HeadConfig fields, declared there (`fields`,
the first one switching it on when away from its default: gate="headwise",
sinks=True, probability="sigmoid"), so trial ids of
existing configs are unchanged. An outside mechanism's options live in ONE
HeadConfig field, `extra`: a table from the mechanism's name to its options
({"my_gate": {"width": 3}}; TOML `[model.extra.my_gate]`, `--set
model.extra.my_gate={width=3}`); its presence switches the mechanism on,
`defaults` fills what is not set, `check(cfg)` validates the values, and, as
every [model] key, it is part of the trial id (left out when empty, so configs
without plugins keep their ids). A function reads them with `options(cfg, name)`.
Why one field: a plugin cannot add fields to attn's HeadConfig, and one table
keyed by the record's name goes through ModelConfig, TOML, --set and the trial
id the way every HeadConfig field does, with no per-plugin schema. The
built-ins' fields are validated by HeadConfig where they are declared, so
their records need no check.

Parameters: `init(key, cfg, dtype)` -> dict of arrays (names no variant uses),
`sharding` one letter per axis of each (H: split with the query heads, None:
replicated; letters past an array's rank are dropped). Counts in closed form
(param_count, effective_param_count, flops, score_weights) are optional: a
layer whose mechanism lacks one has that figure measured (attn.count), and
`kv_tokens(cfg, length)` says how many tokens a layer caches after `length`
(window: the last `window`; counts only: the decoding ring is cfg.window's). `examples` are rows (label, HeadConfig changes
that switch it on, params formula, FLOPs formula) for `attn count --mechanisms`
and the configs the kit (attn.testing) composes with every variant; an outside
mechanism with none is switched on with its defaults ({"extra": {name: {}}}).
"""

from __future__ import annotations

import contextvars
import dataclasses
import zlib
from typing import Any

import jax
import jax.numpy as jnp

from attn.config import HeadConfig, did_you_mean, invalid
from attn.registry import Registry
from attn.variants.mechanisms import choice, head_mechanisms, token_logits
from attn.variants.mechanisms.record import HookError, Mechanism

__all__ = ["MECHANISMS", "HookError", "Mechanism", "active", "options", "split"]

Array = jax.Array
Params = dict[str, Array]


MECHANISMS: Registry[Mechanism] = Registry("mechanism", "attn.mechanisms", Mechanism,
                                           lambda: (*head_mechanisms.MECHANISMS, *token_logits.RECORDS))


def is_builtin(m: Mechanism) -> bool:
  return bool(m.fields)


def is_on(m: Mechanism, cfg: HeadConfig) -> bool:
  """Whether cfg switches m on: its first field away from HeadConfig's default (built-ins), or its
  name in cfg.extra."""
  if m.fields:
    return getattr(cfg, m.fields[0]) != _DEFAULTS[m.fields[0]]
  return bool(cfg.extra) and m.name in cfg.extra


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(HeadConfig)}


def default_of(field: str) -> Any:
  """HeadConfig's default of a field: a built-in mechanism is off there."""
  return _DEFAULTS[field]


def active(cfg: HeadConfig) -> list[Mechanism]:
  """The mechanisms cfg switches on, in registry order."""
  return [m for m in MECHANISMS.values() if is_on(m, cfg)]


def options(cfg: HeadConfig, name: str) -> dict[str, Any]:
  """A mechanism's options under cfg: its HeadConfig fields, or its defaults updated by cfg.extra."""
  m = MECHANISMS.resolve(name, "mechanism")
  if m.fields:
    return {f: getattr(cfg, f) for f in m.fields}
  return {**(m.defaults or {}), **dict((cfg.extra or {}).get(name) or {})}


# The declared-option check of an extra entry (HeadConfig.extra here, [model.extra] and --set
# model.extra... in attn.experiments.running.config), written once: `where` is the key as its
# caller names it, `value` what was set there.

def outside(name: str, where: str, value: Any) -> Mechanism:
  """The installed outside mechanism `name` (an extra entry's key), else ConfigError at where."""
  m = MECHANISMS.get(name) if isinstance(name, str) else None
  if m is None or m.fields:
    names = sorted(n for n, r in MECHANISMS.items() if not r.fields)
    why = (f"no entry: {name!r} is a built-in mechanism, set by the HeadConfig fields {list(m.fields)}"
           if m is not None else f"one of {names} (an installed outside head mechanism): {did_you_mean(name, MECHANISMS)}no mechanism "
           f"{name!r} is installed" + (f" ({MECHANISMS.broken()[name]})" if name in MECHANISMS.broken() else ""))
    raise invalid(where, value, why)
  return m


def declared(m: Mechanism, option: str, where: str, value: Any) -> None:
  """ConfigError at where unless `option` is one m declares (its defaults' keys)."""
  if option not in (m.defaults or {}):
    raise invalid(where, value, f"an option mechanism {m.name!r} declares: one of {sorted(m.defaults or {})}")


def check(cfg: HeadConfig) -> None:
  """Every mechanism cfg names is known and its options are valid (its record's check)."""
  for name, opts in (cfg.extra or {}).items():
    m = outside(name, f"extra.{name}", dict(opts or {}))
    for option in sorted(opts or {}):
      declared(m, option, f"extra.{name}.{option}", opts[option])
  for m in active(cfg):
    if m.check is not None:
      m.check(cfg)
  chooser = [m for m in active(cfg) if m.select is not None or m.attend is not None]
  tokens = [m for m in active(cfg) if m.on_tokens is not None]
  if chooser and tokens:  # the core's one hook attends without the tokens' bias and scaling
    first = tokens[0]
    raise invalid(first.fields[0] if first.fields else f"extra.{first.name}", options(cfg, first.name)
                  if not first.fields else getattr(cfg, first.fields[0]),
                  f"off with {chooser[0].name}: a mechanism that chooses keys or replaces the attention runs "
                  "its own core, which reads neither the tokens' bias nor their scaling")
  if len(chooser) > 1:  # the core's one hook runs one (the built-ins' checks say so first, in their words)
    second = chooser[1]
    raise invalid(second.fields[0] if second.fields else f"extra.{second.name}", options(cfg, second.name),
                  f"absent with {chooser[0].name}: one mechanism that chooses keys or replaces the attention a layer")


def _key(key: Array, m: Mechanism) -> Array:
  # The gate (the only built-in with random weights) keeps the key it always had; others their own.
  return key if m.name == "gate" else jax.random.fold_in(key, zlib.crc32(m.name.encode()) % 2**31)


def init(key: Array, cfg: HeadConfig, dtype=jnp.float32) -> Params:
  """The parameters of every active mechanism; {} when none is on."""
  out: Params = {}
  for m in active(cfg):
    if m.init is not None:
      out.update(m.init(_key(key, m), cfg, dtype))
  return out


def names() -> set[str]:
  """Every parameter name a mechanism declares (its sharding letters); no variant uses these."""
  return {n for m in MECHANISMS.values() for n in (m.sharding or {})}


def letters() -> dict[str, str | None]:
  """Parameter name -> its sharding letters, over every mechanism."""
  return {n: a for m in MECHANISMS.values() for n, a in (m.sharding or {}).items()}


def split(params: Params) -> tuple[Params, Params]:
  """(the variant's own parameters, the mechanisms')."""
  mech = names()
  return ({n: a for n, a in params.items() if n not in mech},
          {n: a for n, a in params.items() if n in mech})


# The points of the shared path (attn.variants.base calls these).

def _same_shape(m: Mechanism, hook: str, what: str, got: Any, want: Array) -> Array:
  """got, refused by name unless an array of want's shape (checked while tracing: costs nothing)."""
  if getattr(got, "shape", None) != want.shape:
    raise HookError(m.name, hook, f"returned {what} of shape {getattr(got, 'shape', type(got).__name__)} "
                    f"for {what} of shape {tuple(want.shape)}: a hook returns the shape it is given")
  return got


# Set by attn.variants.cache while decoding: the active mechanisms' decoding state (state_shapes' names
# -> (B, ...) arrays), which on_qkv hooks read and replace.
DECODE_STATE: contextvars.ContextVar = contextvars.ContextVar("attn_mechanism_state", default=None)


def state_shapes(cfg: HeadConfig) -> dict[str, tuple[int, ...]]:
  """The active mechanisms' decoding state, name -> per-sequence shape ({} for most)."""
  out: dict[str, tuple[int, ...]] = {}
  for m in active(cfg):
    if m.state is not None:
      out.update({n: tuple(s) for n, s in m.state(cfg).items()})
  return out


def on_qkv(params: Params, q_BTHK: Array, k_BSGK: Array, v_BSGV: Array,
           cfg: HeadConfig, inputs: tuple[Array, Array, Array] | None = None) -> tuple[Array, Array, Array]:
  """inputs: the query, key and value projections' inputs, which the variants that hand them pass (per_head,
  fused, two_stage, split_input) to records that read them (Mechanism.reads_inputs: qkv_conv_dynamic)."""
  for m in active(cfg):
    if m.on_qkv is not None:
      more = {"inputs": inputs} if m.reads_inputs else {}
      out = m.on_qkv(params, q_BTHK, k_BSGK, v_BSGV, cfg=cfg, state=DECODE_STATE.get(), **more)
      if not isinstance(out, tuple) or len(out) != 3:
        raise HookError(m.name, "on_qkv", f"returned {type(out).__name__}: a hook returns (q, k, v)")
      q_BTHK, k_BSGK, v_BSGV = (_same_shape(m, "on_qkv", "queries", out[0], q_BTHK),
                                _same_shape(m, "on_qkv", "keys", out[1], k_BSGK),
                                _same_shape(m, "on_qkv", "values", out[2], v_BSGV))
  return q_BTHK, k_BSGK, v_BSGV


def on_qk(params: Params, q_BTHK: Array, k_BSGK: Array, cfg: HeadConfig) -> tuple[Array, Array]:
  for m in active(cfg):
    if m.on_qk is not None:
      out = m.on_qk(params, q_BTHK, k_BSGK, cfg=cfg)
      if not isinstance(out, tuple) or len(out) != 2:
        raise HookError(m.name, "on_qk", f"returned {type(out).__name__}: a hook returns (q, k)")
      q_BTHK, k_BSGK = (_same_shape(m, "on_qk", "queries", out[0], q_BTHK),
                        _same_shape(m, "on_qk", "keys", out[1], k_BSGK))
  return q_BTHK, k_BSGK


def on_logits(params: Params, logits_BHTS: Array, cfg: HeadConfig) -> Array:
  for m in active(cfg):
    if m.on_logits is not None:
      logits_BHTS = _same_shape(m, "on_logits", "logits", m.on_logits(params, logits_BHTS, cfg=cfg), logits_BHTS)
  return logits_BHTS


def on_tokens(params: Params, x_BTD: Array, q_BTHK: Array, S: int, cfg: HeadConfig,
              opts) -> tuple[Array, Array | None]:
  """The queries and the logits bias (B,H,T,S)-broadcastable, or None, after every on_tokens hook (their
  biases summed): positions (the queries', the keys') from opts (token_logits' docstring)."""
  hooks = [m for m in active(cfg) if m.on_tokens is not None]
  if not hooks:
    return q_BTHK, None
  T = q_BTHK.shape[1]
  q_pos = jnp.arange(T) if opts.qk_positions is None else opts.qk_positions[0]
  k_pos = opts.key_positions if opts.key_positions is not None else (
      jnp.arange(S) if opts.qk_positions is None else opts.qk_positions[1])
  total = None
  for m in hooks:
    out = m.on_tokens(params, x_BTD, q_BTHK, cfg=cfg, positions=(q_pos, k_pos))
    if not isinstance(out, tuple) or len(out) != 2:
      raise HookError(m.name, "on_tokens", f"returned {type(out).__name__}: a hook returns (q, bias or None)")
    q_BTHK = _same_shape(m, "on_tokens", "queries", out[0], q_BTHK)
    if out[1] is not None:
      total = out[1] if total is None else total + out[1]
  return q_BTHK, total


def on_output(params: Params, x_BTD: Array, o_BTHV: Array, cfg: HeadConfig) -> Array:
  for m in active(cfg):
    if m.on_output is not None:
      o_BTHV = _same_shape(m, "on_output", "head outputs", m.on_output(params, x_BTD, o_BTHV, cfg=cfg), o_BTHV)
  return o_BTHV


def kernel_args(params: Params, cfg: HeadConfig) -> dict[str, Any]:
  """kernel.attention's keywords from the active mechanisms: window, sinks, softcap, probability."""
  out = {"window": None, "sinks": None, "softcap": None, "probability": "softmax"}
  for m in active(cfg):
    if m.kernel is not None:
      out.update(m.kernel(params, cfg))
  return out


def selector(cfg: HeadConfig) -> Mechanism | None:
  """The active mechanism that chooses keys or replaces the attention (select or attend), or None."""
  return next((m for m in active(cfg) if m.select is not None or m.attend is not None), None)


def attend(params: Params, x_BTD: Array | None, q_BTHK: Array, k_BSGK: Array, v_BSGV: Array, *,
           cfg: HeadConfig, opts) -> tuple[tuple[Array, Array | None] | None, Any]:
  """The one hook of the attention core (base.core): the layer's selector (select or attend; choice.py)
  does its work. Returns ((o (B,T,H,V), weights or None), opts) when it attended, else (None, the
  opts to attend with: the call's, or with its choice's mask ANDed in)."""
  m = selector(cfg)
  if m is None:
    return None, opts
  return choice.attend(m, params, x_BTD, q_BTHK, k_BSGK, v_BSGV, cfg=cfg, opts=opts,
                       kernel_args=kernel_args(params, cfg), explicit=needs_explicit_logits(cfg))


def needs_explicit_logits(cfg: HeadConfig) -> bool:
  """A mechanism acts on the logits that the fused kernels cannot take as an argument."""
  return any(m.on_logits is not None and m.kernel is None for m in active(cfg))


# Counts, added to the variant's by attn.count; None where an active mechanism has no closed form.

def _sum(cfg: HeadConfig, field: str, *args) -> int | None:
  total = 0
  for m in active(cfg):
    fn = getattr(m, field)
    if fn is None:
      if field == "param_count" and m.init is None:
        continue  # no parameters
      if field in ("flops", "score_weights") and m.init is None and m.on_qk is None and m.on_qkv is None:
        continue  # no parameters the logits read, nothing computed worth counting
      return None
    total += int(fn(cfg, *args))
  return total


def param_count(cfg: HeadConfig) -> int | None:
  """Parameters the active mechanisms add (None: one of them has no closed form)."""
  return _sum(cfg, "param_count")


def effective_param_count(cfg: HeadConfig) -> int | None:
  """Degrees of freedom the mechanisms add beyond what the variant's own count reads from cfg."""
  return _sum(cfg, "effective_param_count")


def flops(cfg: HeadConfig, T: int, S: int) -> int | None:
  return _sum(cfg, "flops", T, S)


def score_weights(cfg: HeadConfig) -> int | None:
  return _sum(cfg, "score_weights")


def kv_tokens(cfg: HeadConfig, length: int) -> int:
  """Tokens one layer caches after `length`: the fewest any active mechanism keeps."""
  kept = length
  for m in active(cfg):
    if m.kv_tokens is not None:
      kept = min(kept, int(m.kv_tokens(cfg, length)))
  return kept


def plain(cfg: HeadConfig) -> HeadConfig:
  """cfg with every mechanism off: built-in fields at HeadConfig's defaults (the switch and the options
  that only it reads, which HeadConfig refuses without it), no extra."""
  return cfg.replace(**{f: _DEFAULTS[f] for m in MECHANISMS.values() for f in m.fields},
                     extra=None)


def examples(m: Mechanism) -> tuple[tuple[str, dict[str, Any], str, str], ...]:
  """m's example rows; an outside mechanism without any is switched on with its defaults."""
  if m.examples:
    return tuple((label, dict(change), p, f) for label, change, p, f in m.examples)
  return ((m.name, {"extra": {m.name: {}}}, "not declared", "not declared"),)
