"""check_family: the checkpoint-family contract, run on one Family record and a tiny checkpoint of it.

attn's own tests call it for every built-in family, and a plugin's tests call it
on theirs. Every failure is an AssertionError naming the property, the family
and the numbers. The properties:

  refusals     each of the record's config refusals refuses a changed value by
               name, before any weight is read; an unknown model_type, a variant
               the family's layout does not convert to, a checkpoint missing a
               tensor and one with a tensor too many are refused by name (the
               unknown tensor's and the family's)
  round trip   from_hf(to_hf_state(model)) holds the model's parameters bit for
               bit, writes the same config and state dict again, and reads the
               config back to the same ModelConfig; a given checkpoint comes back
               bit for bit (every tensor it holds but those under Family.unheld, a
               vision tower attn does not read: left out of every comparison here)
  save_pretrained  when torch and transformers import: the transformers model (the live
               source, or to_hf's) saved by its own save_pretrained (the on-disk names the releases
               hold, transformers' conversions on saving included) reads back through numpy to the
               same parameters bit for bit, and to_hf of that, saved again, writes the same tensors;
               the outputs below are the directory's
  transformers when torch and transformers import: the attn model's outputs
               (logits; an Encoder's hidden states or MLM logits) equal the
               transformers model's within `tolerance` of the largest, at every
               position of right-padded rows whose window holds a real key (of a
               hybrid with linear layers, at the real tokens only: a padded token
               writes to transformers' linear states, never to attn's; likewise with
               cca heads, whose convolutions transformers feeds zeros at padded
               tokens and attn the tokens themselves); to_hf
               of what from_hf read from a live model gives its state dict back
               bit for bit, and its save_pretrained directory reads the same.
               Without them this part is left out; everything above still runs.

source is a tiny checkpoint of the family: a transformers model, a
save_pretrained directory, to_hf_state's (config, state dict) pair, or a bare
config.json dict, for which weights are drawn at random (seed).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
from typing import Any, Iterator

import jax
import numpy as np
from flax import nnx

from attn.config import ConfigError
from attn.nn import hf
from attn.nn.hf.base import BUFFERS
from attn.nn.hf.files import read_object
from attn.nn.hf.load import WEIGHTS
from attn.nn.models import MODELS, Encoder
from attn.nn.config import ModelConfig
from attn.testing.failures import Checks

_NOT_ALLOWED = "attn-check-family: a value no family allows"


def _fail(prop: str, family: str, detail: str) -> AssertionError:
  return AssertionError(f"check_family({family!r}): {prop}: {detail}")


@contextlib.contextmanager
def _registered(family: hf.Family) -> Iterator[None]:
  """The record registered for the check (unless it already is), then removed again."""
  present = hf.FAMILIES.get(family.name)
  if present is not None and present is not family:
    raise _fail("record", family.name, f"a different record of that name is registered "
                f"({hf.FAMILIES.source(family.name)}); check that one, or rename this one")
  if present is None:
    hf.FAMILIES.register(family)
  try:
    yield
  finally:
    if present is None:
      hf.FAMILIES.unregister(family.name)


def _refused(prop: str, family: str, names: str | tuple[str, ...], fn, *args, **kwargs) -> None:
  """fn(*args) raises ConfigError whose message names `names` (each of them)."""
  try:
    fn(*args, **kwargs)
  except ConfigError as e:
    for n in (names,) if isinstance(names, str) else names:
      if n not in str(e):
        raise _fail(prop, family, f"refused, but the error does not name {n!r}: {e}") from None
    return
  raise _fail(prop, family, f"accepted; should be refused naming {names!r}")


def _params(model: nnx.Module) -> dict[str, np.ndarray]:
  """The model's parameters by path."""
  leaves = jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  return {jax.tree_util.keystr(path): np.asarray(a) for path, a in leaves}


def _same(prop: str, family: str, want: dict, have: dict, what: str) -> None:
  """Bit-for-bit equality of two dicts of arrays (every key of `want` in `have`)."""
  missing = sorted(map(str, set(want) - set(have)))
  if missing:
    raise _fail(prop, family, f"{what}: {missing[:4]} missing")
  for k in want:
    a, b = np.asarray(want[k]), np.asarray(have[k])
    if a.shape != b.shape or a.dtype != b.dtype or not np.array_equal(a, b):
      diff = float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))) if a.shape == b.shape else None
      raise _fail(prop, family, f"{what}: {k} differs (shapes {a.shape} {b.shape}, max |diff| {diff})")


def _random(family: hf.Family, cfg: ModelConfig, seed: int) -> hf.Loaded:
  """A model of the family with every checkpoint tensor drawn at random: zeros (norm scales at
  their init, 1 or Gemma's 0) written out, N(0, 0.3²) added to each tensor, read back, and written
  and read once more so that tied copies agree again. numpy only: nothing to compile."""
  shapes = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: MODELS[family.model](cfg, rngs=nnx.Rngs(0))),
                                      WEIGHTS))
  one = 0.0 if cfg.norm_type == "rmsnorm_plus_one" else 1.0
  fill = lambda path, a: np.full(a.shape, one if path[-1].key == "scale" else 0.0, np.float32)
  kw, sd = hf.to_hf_state(hf.build(family.model, cfg, jax.tree_util.tree_map_with_path(fill, shapes)),
                          cfg, family.name)
  rng = np.random.default_rng(seed)
  drawn = {k: (np.asarray(a, np.float32) + 0.3 * rng.standard_normal(np.shape(a))).astype(np.float32)
           for k, a in sd.items()}
  return hf.from_hf(hf.to_hf_state(hf.from_hf((kw, drawn))))


def _transformers() -> Any:
  try:
    import torch  # noqa: F401
    import transformers
  except ImportError:
    return None
  return transformers


@nnx.jit
def _outputs(model: nnx.Module, ids: Any, lengths: Any) -> Any:
  """Logits; an Encoder's MLM logits, or its hidden states without an MLM head. One compile."""
  if isinstance(model, Encoder):
    h = model.hidden(ids, lengths_B=lengths)
    return model.mlm_logits(h) if model.cfg.mlm_head else h
  return model(ids, lengths_B=lengths)


def _hf_outputs(m: Any, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
  import torch
  with torch.no_grad():
    out = m(torch.from_numpy(ids.astype(np.int64)), attention_mask=torch.from_numpy(mask.astype(np.int64)))
  logits = getattr(out, "logits", None)
  return (logits if logits is not None else out.last_hidden_state).numpy()


def _refusals(family: hf.Family, state: tuple[dict, dict]) -> None:
  name, (config, sd) = family.name, state
  for key in family.refusals:  # an empty state dict: refused on the config, before any weight
    _refused("refusals", name, f"config.{key}", hf.from_hf, ({**config, key: _NOT_ALLOWED}, {}))
  _refused("refusals", name, "config.model_type", hf.from_hf, ({**config, "model_type": _NOT_ALLOWED}, {}))
  _refused("refusals", name, "variant", hf.from_hf, (config, {}), variant=_NOT_ALLOWED)
  # A tensor the family reads (not a buffer, an ignored head or a tied copy of another) dropped, and one added.
  read = [k for k in sorted(sd) if not k.endswith(BUFFERS) and not k.removeprefix(family.prefix).startswith(
      family.ignored) and not any(j != k and np.shape(sd[j]) == np.shape(sd[k]) and np.array_equal(sd[j], sd[k])
                                  for j in sd)]
  _refused("refusals", name, read[0].removeprefix(family.prefix), hf.from_hf,
           (config, {k: a for k, a in sd.items() if k != read[0]}))
  _refused("refusals", name, ("attn_check.extra", repr(name)), hf.from_hf, (config, {**sd, "attn_check.extra": np.zeros(1, np.float32)}))


def _checkpoint(family: hf.Family, source: Any) -> tuple[dict, dict] | None:
  """(config dict, state dict) of a given checkpoint; None for a bare config."""
  if isinstance(source, dict):
    return None
  if isinstance(source, tuple):
    return source
  if isinstance(source, (str, os.PathLike)):
    return hf.read_config(source), hf.read_weights(source)
  return read_object(source, family.architectures)


def _held(family: hf.Family, sd: dict) -> dict:
  """sd without the tensors attn holds none of (Family.unheld: a vision tower to_hf leaves at init)."""
  return {k: a for k, a in sd.items() if not k.startswith(family.unheld)} if family.unheld else sd


def _round_trip(family: hf.Family, loaded: hf.Loaded, given: tuple[dict, dict] | None) -> tuple[dict, dict]:
  """The round-trip properties; the state to_hf_state writes."""
  name, (model, cfg) = family.name, loaded
  state = hf.to_hf_state(loaded)
  again = hf.from_hf(state)
  _same("round trip", name, _params(model), _params(again.model), "from_hf(to_hf_state(model)) parameters")
  if again.config != cfg:
    diff = {f.name: (getattr(cfg, f.name), getattr(again.config, f.name)) for f in dataclasses.fields(ModelConfig)
            if getattr(cfg, f.name) != getattr(again.config, f.name)}
    raise _fail("round trip", name, f"the config read back differs: {diff}")
  _same("round trip", name, state[1], hf.to_hf_state(again)[1], "to_hf_state written twice")
  if given is not None:  # under the names attn reads (Family.released): a release may hold some otherwise
    read = family.released or (lambda sd: sd)
    _same("round trip", name, read(_held(family, {k: a for k, a in given[1].items() if not k.endswith(BUFFERS)})),
          read(state[1]), "the checkpoint's tensors against to_hf_state's (but Family.unheld's, as read)")
  return state


def _saved(family: hf.Family, model: nnx.Module, theirs: Any) -> nnx.Module:
  """The transformers model as save_pretrained writes it (the names the releases hold, with the
  conversions transformers applies on saving), read through numpy: the same parameters bit for bit;
  to_hf of that, saved again, writes the same tensors under the same names. The model read back."""
  name = family.name
  with tempfile.TemporaryDirectory() as d, tempfile.TemporaryDirectory() as again:
    theirs.save_pretrained(d)
    read = hf.from_hf(d)
    _same("save_pretrained", name, _params(model), _params(read.model), "from_hf of its save_pretrained directory")
    if family.weights_out is not None:
      hf.to_hf(read).save_pretrained(again)
      _same("save_pretrained", name, _held(family, hf.read_weights(d)), _held(family, hf.read_weights(again)),
            "to_hf(from_hf(dir)).save_pretrained's tensors against dir's")
      _same("save_pretrained", name, _params(model), _params(hf.from_hf(again).model),
            "from_hf(to_hf(from_hf(dir)).save_pretrained) parameters")
  return read.model


def _against_transformers(family: hf.Family, loaded: hf.Loaded, source: Any, live: bool, tolerance: float,
                          seed: int) -> dict[str, float]:
  """Outputs against the transformers model (the live source, or to_hf's); the live model's weights back."""
  name, (model, cfg) = family.name, loaded
  theirs = source if live else hf.to_hf(loaded)
  if live and family.weights_out is not None:
    _same("round trip", name, _held(family, {k: t.numpy() for k, t in source.state_dict().items()}),
          _held(family, {k: t.numpy() for k, t in hf.to_hf(loaded).state_dict().items()}),
          "to_hf(from_hf(model)).state_dict()")
  if not live:
    _same("round trip", name, _params(model), _params(hf.from_hf(theirs).model), "from_hf(to_hf(model)) parameters")
  model = _saved(family, model, theirs)
  T = min(9, cfg.max_len)
  ids = np.random.default_rng(seed + 1).integers(0, cfg.vocab_size, (3, T)).astype(np.int32)
  lengths = np.array([T, T // 2 + 1, 1], np.int32)
  t = np.arange(T)[None, :]
  ours, ref = np.asarray(_outputs(model, ids, lengths)), _hf_outputs(theirs, ids, t < lengths[:, None])
  # Padded positions too, where their window holds a real key: a query whose window holds none
  # is a fully masked row (attn gives 0, transformers' eager softmax spreads it), no output of the text.
  keep = t < lengths[:, None] + (cfg.window - 1 if cfg.window else T)
  if "linear_attention" in (cfg.layer_types or ()):  # a padded token writes to transformers' linear states,
    keep = t < lengths[:, None]  # never to attn's: the two agree on the real tokens only (Kimi Linear's σ gate)
  if {"heavily_compressed_attention", "compressed_sparse_attention"} & set(cfg.layer_types or ()):
    keep = t < lengths[:, None]  # transformers' V4 entries ignore the padding mask; attn's lengths hide them
  if any(cfg.layer_head(i).cca for i in range(cfg.num_layers) if cfg.has_attention(i)):
    keep = t < lengths[:, None]  # transformers zeros a padded token before ZAYA's CCA convolutions, attn does not
  if cfg.residual_conv is not None:  # transformers zeroes padded tokens before Inkling-2's convolutions, attn's
    keep = t < lengths[:, None]  # lengths mask their keys only: the two agree on the real tokens
  diff = float(np.abs(ours - ref)[keep].max())
  relative = diff / float(np.abs(ref[keep]).max())
  if not relative < tolerance:
    raise _fail("transformers", name, f"outputs differ from {type(theirs).__name__}'s by {diff:.3g} "
                f"({relative:.3g} of the largest; tolerance {tolerance:g})")
  return {"logits_max_abs": diff, "logits_relative": relative}


def _describe(cfg: ModelConfig | None, source: Any) -> str:
  """The config a property ran at: the model's dims once read, else the source's model_type."""
  if cfg is None:
    kind = source.get("model_type") if isinstance(source, dict) else type(source).__name__
    return f"source {kind!r}"
  return (f"ModelConfig(d_model={cfg.d_model}, num_layers={cfg.num_layers}, num_heads={cfg.num_heads}, "
          f"num_kv_heads={cfg.num_kv_heads}, variant={cfg.variant!r})")


def check_family(family: hf.Family | str, source: Any, *, tolerance: float = 1e-4, seed: int = 0,
                 changes: dict[str, Any] | None = None, verbose: bool = False) -> dict[str, Any]:
  """Runs the family contract (module docstring) on `family` with the tiny checkpoint `source`.

  changes: ModelConfig fields to set on the model read from a bare config dict (BERT's
  mlm_head). A read-only family (no weights_out) needs a checkpoint, and its round trip is left
  out. Returns what was measured, {"logits_max_abs", "logits_relative"} (None without
  transformers, or for a read-only family without a live model), and what was checked:
  "loaded" (from_hf's Loaded) and its "config". verbose: a pass prints what was checked.
  Anything but an AssertionError that a property raises (the record's own code failing) comes
  back as an AssertionError naming the family, the property, the hook and the config, chained.
  """
  family = hf.FAMILIES.resolve(family, "family") if isinstance(family, str) else family
  if not isinstance(family, hf.Family):
    raise _fail("record", str(family), f"a {hf.Family.__module__}.Family, not {type(family).__name__}")
  name, writes, transformers = family.name, family.weights_out is not None, _transformers()
  live = not isinstance(source, (dict, tuple, str, os.PathLike))
  checks = Checks("check_family", name, verbose)
  with _registered(family):
    with checks.property("read", _describe(None, source), [family]):
      given = _checkpoint(family, source)
      if given is None and not writes:
        raise _fail("record", name, "a read-only family (weights_out None) is checked on a checkpoint, "
                    "not a bare config")
      loaded = hf.from_hf(source) if given is not None else _random(
          family, hf.model_config(source).replace(**(changes or {})), seed)
      if loaded.family != name:
        raise _fail("record", name, f"the checkpoint was read by family {loaded.family!r}")
    at = _describe(loaded.config, source)
    state = checks.run("round trip", at, [family], _round_trip, family, loaded, given) if writes else given
    checks.run("refusals", at, [family], _refusals, family, state)
    measured: dict[str, Any] = {"loaded": loaded, "config": loaded.config, "logits_max_abs": None,
                                "logits_relative": None}
    if transformers is not None and (writes or live):
      measured |= checks.run("transformers", at, [family], _against_transformers, family, loaded, source, live,
                             tolerance, seed)
  checks.passed()
  return measured
