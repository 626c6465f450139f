"""Experiment configs: a TOML base plus sweep axes, validated and expanded into trials.

A config has the tables [meta] (name, question), [task], [model], [train],
[sweep] and, optionally, [analysis] (enabled = true: `attn analyze` runs on the
trained trials before the report; it changes no trial). [sweep.grid] axes combine as a product, [sweep.zip] axes are tied
(zipped, equal lengths); both map dotted keys ("model.num_heads") to lists.
[[sweep.cases]] tables (name = "+qk_norm", model.qk_norm = true) are named
settings of several keys at once, one more axis ("case") crossed with the others.
sweep.seeds is shorthand for a grid axis over train.seed. sweep.derive lists
constraints applied to every trial, in order:

  "fixed_width"   d_k = d_v = d_model / num_heads (Vaswani et al. 2017, Table 3 rows A).
  "fixed_params"  d_ff = round((budget - P(0)) / (P(1) - P(0))), where P(f) is the
                  model's parameter count (counted from its parameter tree) with
                  d_ff = f; P is affine in d_ff, so every trial lands within half a
                  feed-forward unit of sweep.param_budget ("base": the base config's count).

A field that a derive computes (fixed_width: model.d_k and model.d_v;
fixed_params: model.d_ff) is refused, naming the field and the derive, when it
is given anyway, in [model], by --set or as a sweep axis: the derive would
overwrite it in every trial. One exception: under fixed_params with
param_budget = "base", [model] d_ff is the base model whose count is the budget
(with an integer budget, d_ff is left out); --set sweep.param_budget=N changes
the budget from the command line.

sweep.pack = N (default 1) trains up to N trials equal but for train.seed, train.lr,
train.warmup_steps and train.end_lr_ratio (PACKABLE) as one vmapped program (seed_groups,
docs/running.md); sweep.pack = "auto" lets each worker choose N by measured throughput
(sweep._Worker.adapt). It and sweep.vmap_seeds = true are one or the other.

[train] is a TrainConfig (frozen, validated: each error names train.<field>).
A trial's id is the hash of its resolved config (the dict stored in its
config.json) without train.checkpoint_every, train.data_parallel,
train.data_parallel_axis, train.mesh and train.grad_accum, which change how
often a trial saves, on how many devices it runs and in how many micro-batches,
but not what it computes (to float tolerance, attn.experiments.training.parallel
and .train). train.mesh is a table: `mesh = {data = 2, heads = 2}` in the file,
`--set train.mesh.heads=2` (or `--set "train.mesh={heads = 2}"`) on the command line.

A dotted key may reach into a table: train.mesh.AXIS, model.extra.NAME (an outside head
mechanism's options) and model.extra.NAME.OPTION (one of them), model.layer_heads.TYPE[.FIELD]
(a layer type's head, attn.nn.layer_heads) and model.linear_head.FIELD, as a grid or zip axis, a key of a
case or a --set, like any field; the trial label names it by its path in the table
(logit_scale.factor=3.0: axis_name, show). An option is refused by name before any trial starts
when its mechanism is not installed, when the mechanism's record does not declare it (in its
defaults), when one axis mixes tables and values, or when two axes (or an axis and a --set) reach
into one table at different depths.

Every error is an attn.ConfigError naming the file, the key, the value and what is allowed.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import itertools
import json
import tomllib
import warnings
from typing import Any

from attn.config import ConfigError, did_you_mean, invalid
from attn.experiments.data import tasks
from attn.experiments.training.config import PACKABLE, TrainConfig, check_heads, check_indexer, check_train_field

SECTIONS = ("meta", "task", "model", "train", "sweep", "analysis")
META_KEYS = {"name": str, "question": str}
ANALYSIS_KEYS = {"enabled": bool}  # [analysis]: whether `attn sweep` runs `attn analyze` before its report
PACK_ALLOWED = ("an integer >= 1: up to that many trials equal but for train." + ", train.".join(PACKABLE)
                + ' train as one vmapped program (1, the default: one program per trial), or "auto": as many as '
                "train fastest, measured, within memory")
SWEEP_KEYS = {"grid": dict, "zip": dict, "cases": list, "seeds": list, "derive": list,
              "param_budget": (int, str), "vmap_seeds": bool, "pack": (int, str)}
SWEEP_KINDS = {"grid": "a table of dotted keys to lists", "zip": "a table of dotted keys to lists",
               "cases": 'a list of tables, each a name = "..." and dotted keys to values',
               "seeds": "a list of integers", "derive": 'a list of "fixed_width", "fixed_params"',
               "param_budget": '"base" or a positive integer', "vmap_seeds": "true or false",
               "pack": PACK_ALLOWED}
DERIVED_MODEL_KEYS = ("vocab_size", "num_classes", "max_len")
DERIVES = ("fixed_width", "fixed_params")
# The fields each derive computes in every trial, and how.
DERIVED = {"fixed_width": (("model.d_k", "model.d_v"), "d_k = d_v = d_model / num_heads"),
           "fixed_params": (("model.d_ff",), "d_ff fills sweep.param_budget")}
ALIASES = {"seed": "train.seed"}
# Tables a dotted key reaches into: train.mesh.AXIS, model.extra.NAME (a mechanism's options),
# model.extra.NAME.OPTION (one option), model.layer_heads.TYPE[.FIELD] and model.linear_head.FIELD, in
# --set, sweep axes and cases alike.
TABLE_KEYS = (("train", "mesh"), ("model", "extra"), ("model", "layer_heads"), ("model", "linear_head"))
TABLE_DEPTH = {("train", "mesh"): 1, ("model", "extra"): 2, ("model", "layer_heads"): 2, ("model", "linear_head"): 1}
INTO_TABLES = ("train.mesh.AXIS, model.extra.NAME[.OPTION], model.layer_heads.TYPE[.FIELD], "
               "model.linear_head.FIELD")


@dataclasses.dataclass(frozen=True)
class Trial:
  """One resolved training run: its stable id, its axis values and its full config."""

  id: str
  label: dict[str, Any]
  config: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Sweep:
  """A validated config file expanded into trials."""

  path: str
  meta: dict[str, str]
  axes: list[str]
  trials: list[Trial]
  vmap_seeds: bool
  id: str
  analyze: bool = False
  pack: int | str = 1  # sweep.pack: trials per vmapped program, or "auto" (seed_groups)


# Resolved keys that change how a trial runs but not its rows or parameters: left out of its
# id, so that e.g. --set train.checkpoint_every=10 resumes the same trials, and a trial
# resumes on another device count.
UNHASHED = (("train", "checkpoint_every"), ("train", "data_parallel"), ("train", "data_parallel_axis"),
            ("train", "grad_accum"), ("train", "mesh"))
# The [model] and [train] keys that trial ids have hashed since the first store. A key added
# later (a HeadConfig or ModelConfig field, a train option) is hashed only away from its
# default, the value that reproduces the older behaviour: a store written before it existed
# keeps its ids and still resumes, and adding a field needs no entry here.
FIRST_KEYS = {
    "model": ("vocab_size", "d_model", "num_layers", "num_heads", "d_ff", "d_k", "d_v",
              "num_kv_heads", "collab_width", "variant", "max_len", "positional", "num_segments",
              "embed_norm", "norm", "final_norm", "use_bias", "layernorm", "activation",
              "tie_embeddings", "embed_init_std", "pooler", "num_decoder_layers",
              "share_src_tgt_embeddings", "num_classes", "pooling"),
    "train": ("steps", "batch_size", "lr", "warmup_steps", "end_lr_ratio", "weight_decay", "b1",
              "b2", "grad_clip", "eval_every", "eval_batches", "seed"),
}
# The same for [task], per task: a key a task gained later (text's bos) is hashed only away from
# its default. A task missing here (added after this rule) hashes every key.
FIRST_TASK_KEYS = {"mqar": ("vocab_size", "seq_len", "num_pairs"), "induction": ("vocab_size", "seq_len"),
                   "marker_position": ("vocab_size", "seq_len", "num_classes", "num_markers"),
                   "after_marker": ("vocab_size", "seq_len", "num_classes", "copies"),
                   "text": ("path", "glob", "seq_len")}


def _field_defaults(section: str) -> dict[str, Any]:
  fields = _model_fields().values() if section == "model" else dataclasses.fields(TrainConfig)
  return {f.name: f.default for f in fields if f.default is not dataclasses.MISSING}


def trial_id(resolved: dict[str, Any]) -> str:
  """The stable id of a resolved trial config: the hash of every key that can change its results."""
  cfg = copy.deepcopy(resolved)
  for section, key in UNHASHED:
    cfg[section].pop(key, None)
  for section, first in FIRST_KEYS.items():
    defaults = _field_defaults(section)
    for key in [k for k in cfg.get(section, {}) if k not in first and k in defaults]:
      if cfg[section][key] == defaults[key]:
        del cfg[section][key]
  task = cfg.get("task", {})
  if task.get("name") in FIRST_TASK_KEYS:
    defaults = tasks.task_fields(task["name"])
    for key in [k for k in task if k != "name" and k not in FIRST_TASK_KEYS[task["name"]]]:
      if task[key] == defaults.get(key, object()):
        del task[key]
  return stable_hash(cfg)


def stable_hash(obj: Any, n: int = 12) -> str:
  """Hex digest of canonical JSON: equal resolved configs give equal ids, any change another."""
  text = json.dumps(obj, sort_keys=True, separators=(",", ":"))
  return hashlib.sha256(text.encode()).hexdigest()[:n]


# Experiment defaults that differ from ModelConfig's, set per trial by `model_defaults` (docs/running.md,
# "Defaults that start at a sane loss"). Token embeddings start at N(0, 1): with the GPT-2 scale 0.02 a small model
# sits on MQAR's plateau for thousands of steps (measured: solved by step 200 at 1.0, still at chance after 3000 at
# 0.02). So a language model's output head is untied (LLaMA's choice, Touvron et al. 2023): tied to N(0, 1)
# embeddings, its logits start at a standard deviation of about sqrt(d_model), step 1's loss at 40 nats on MQAR
# against ln 64 = 4.2. One that ties them and sets no embed_init_std gets GPT-2's 0.02 (Radford et al. 2019), whose
# logits start near zero. A classifier has no output head to tie: its tie_embeddings stays true, the old default,
# so its trial ids do not move; every shipped language-model config sets tie_embeddings = false itself.
UNTIED_EMBED_INIT_STD = 1.0
TIED_EMBED_INIT_STD = 0.02


def model_defaults(model: dict[str, Any], kind: str) -> dict[str, Any]:
  """[model] with the experiment defaults of the keys it leaves out (tie_embeddings, embed_init_std) for a task of `kind`."""
  model = dict(model)
  model.setdefault("tie_embeddings", kind == "classifier")
  tied = model["tie_embeddings"] and kind != "classifier"
  model.setdefault("embed_init_std", TIED_EMBED_INIT_STD if tied else UNTIED_EMBED_INIT_STD)
  return model


def _model_fields() -> dict[str, Any]:
  """Settable [model] keys -> their dataclass field (HeadConfig's fields among them, declared there)."""
  from attn.nn.config import ModelConfig  # lazy: flax is only needed once models are built
  return {f.name: f for f in dataclasses.fields(ModelConfig) if f.name not in DERIVED_MODEL_KEYS}


def _schema(section: str, raw_task: dict[str, Any]) -> dict[str, Any]:
  """Settable keys of a section -> a dataclass field (model, train) or a default value (task)."""
  if section == "train":
    return {f.name: f for f in dataclasses.fields(TrainConfig)}
  if section == "model":
    return _model_fields()
  name = raw_task.get("name")
  if name not in tasks.TASKS:
    raise invalid("task.name", name, f"{did_you_mean(name, tasks.TASKS)}one of {sorted(tasks.TASKS)}")
  return {"name": name, **tasks.task_fields(name)}


# TOML values by a field's annotation ("int | None", "float", "str | None", "bool", "int | str").
_TOML_TYPES = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,), "dict": (dict,),
               "tuple[str, ...]": (list, tuple), "tuple[int, ...]": (list, tuple),
               "tuple[float, ...]": (list, tuple)}
_TYPE_WORDS = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false",
               "dict": "a table", "tuple[str, ...]": "a list of strings", "tuple[int, ...]": "a list of integers",
               "tuple[float, ...]": "a list of numbers"}


def _check_type(key: str, value: Any, spec: Any) -> Any:
  """value, converted int -> float where a float is wanted; else an error naming key.

  spec is a dataclass field, whose annotation gives the allowed types (a
  field's own checks then judge the value), or a task field's default.
  """
  if isinstance(spec, dataclasses.Field):
    names = [n.strip() for n in str(spec.type).split("|") if n.strip() != "None"]
    if isinstance(value, bool):
      ok = "bool" in names
    else:
      ok = any(isinstance(value, tuple(_TOML_TYPES[n])) for n in names if n in _TOML_TYPES)
    if not ok:
      like = "" if spec.default in (None, dataclasses.MISSING) else f" (like {spec.default!r})"
      words = " or ".join(_TYPE_WORDS.get(n, n) for n in names)
      raise invalid(key, value, f"{words}{like}")
    if "float" in names and "int" not in names and isinstance(value, int):
      return float(value)  # 1 and 1.0 are one config, with one trial id
    return value
  if isinstance(spec, bool):
    if not isinstance(value, bool):
      raise invalid(key, value, "true or false")
    return value
  if isinstance(spec, float) and isinstance(value, int) and not isinstance(value, bool):
    return float(value)
  if isinstance(spec, tuple) and isinstance(value, list):  # a list-valued task key (mqar's curriculum)
    return tuple(value)
  if type(value) is not type(spec):
    raise invalid(key, value, f"a {type(spec).__name__} (like {spec!r})")
  return value


def _check_value(where: str, section: str, name: str, value: Any, schema: dict[str, Any]) -> Any:
  """One [task]/[model]/[train] value, checked (and ints -> floats where floats are wanted)."""
  if section == "train":  # TrainConfig's own check: names train.<name>, the value and what is allowed
    return check_train_field(name, value)
  if section == "task" and name == "name":
    return value
  return _check_type(where, value, schema[name])


def flatten_keys(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
  """{"model": {"num_heads": [..]}} and {"model.num_heads": [..]} both -> dotted keys; {} stays a value."""
  out = {}
  for k, v in table.items():
    if isinstance(v, dict) and v:
      out.update(flatten_keys(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def _parse_value(text: str) -> Any:
  """A --set value as TOML (4, 1e-3, true, [1, 2], "x"); a bare word is a string."""
  try:
    return tomllib.loads(f"v = {text}")["v"]
  except tomllib.TOMLDecodeError:
    return text


def axis_name(key: str) -> str:
  """How labels, tables and plots name a dotted key: its last part; a table's entry by its path in it
  (model.extra.logit_scale.factor -> logit_scale.factor, train.mesh.heads -> mesh.heads)."""
  parts = key.split(".")
  if tuple(parts[:2]) == ("model", "extra") and len(parts) > 2:
    return ".".join(parts[2:])
  if tuple(parts[:2]) in TABLE_KEYS and len(parts) > 2:
    return ".".join(parts[1:])
  return parts[-1]


def show(value: Any) -> str:
  """A config value as a label writes it: a table as {key=value, ...}, anything else as str()."""
  if isinstance(value, dict):
    return "{" + ", ".join(f"{k}={show(v)}" for k, v in value.items()) + "}"
  return str(value)


def _entry(where: str, key: str, value: Any) -> Any:
  """A value for a dotted key into a table (TABLE_KEYS), checked by what the key names.

  train.mesh.AXIS: TrainConfig checks the mesh whole (naming train.mesh.AXIS).
  model.extra.NAME: a table of options of NAME, an installed outside head mechanism;
  model.extra.NAME.OPTION: one option NAME declares (in its defaults), a number, a string or a
  boolean. The mechanism's own check judges the values when the trial is resolved.
  """
  section, field, *path = key.split(".")
  if (section, field) != ("model", "extra") or not path:
    return value
  from attn.variants import mechanisms  # lazy: jax, slow to import for `attn status`
  name = path[0]
  m = mechanisms.outside(name, where, value)
  if len(path) == 1:
    if not isinstance(value, dict):
      raise invalid(where, value, f"a table of options of mechanism {name!r} (keys among "
                    f"{sorted(m.defaults or {})}), or set one: model.extra.{name}.OPTION")
    for option in sorted(value):
      mechanisms.declared(m, option, f"{where}.{option}", value[option])
    return value
  mechanisms.declared(m, path[1], where, value)
  if isinstance(value, (dict, list)):
    raise invalid(where, value, f"a number, a string or a boolean: the value of option {path[1]!r} of "
                  f"mechanism {name!r}")
  return value


def _put(cfg: dict[str, Any], key: str, value: Any, where: str = "") -> None:
  """cfg[section][field]... = value along a dotted key, copying the tables it passes through."""
  parts = key.split(".")
  table = cfg.setdefault(parts[0], {})
  for i, part in enumerate(parts[1:-1], 1):
    inner = table.get(part)
    if inner is None:
      inner = {}
    elif not isinstance(inner, dict):
      raise invalid(where or ".".join(parts[:i + 1]), inner, f"a table, to set its key {parts[i + 1]}")
    table[part] = inner = dict(inner)
    table = inner
  table[parts[-1]] = value


def _overlaps(a: str, b: str) -> bool:
  """One dotted key is the other or a table above it."""
  return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def _refuse_overlap(sweep: dict[str, Any], key: str, item: str) -> None:
  """A --set into a table that a sweep axis or case also sets (other than exactly: that pins the axis)."""
  for kind in ("grid", "zip"):
    for axis in flatten_keys(sweep.get(kind, {})):
      if axis != key and _overlaps(axis, key):
        raise invalid("--set", item, f"a key that no sweep axis reaches into or above ({axis} is in sweep.{kind})")


def override_keys(overrides: list[str]) -> dict[str, str]:
  """Dotted key -> the --set item that sets it (SECTION.KEY=VALUE items only; axes are set as sweep.grid.*)."""
  out = {}
  for item in overrides:
    key = item.partition("=")[0].strip()
    out[ALIASES.get(key, key)] = item
  return out


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
  """raw with each --set KEY=VALUE applied; a swept key that is set is pinned (its axis dropped)."""
  raw = copy.deepcopy(raw)
  for item in overrides:
    key, sep, text = item.partition("=")
    key = ALIASES.get(key.strip(), key.strip())
    if not sep or "." not in key:
      raise invalid("--set", item, "KEY=VALUE with a dotted key, e.g. model.num_heads=4")
    value = _parse_value(text.strip())
    parts = key.split(".")
    if parts[0] == "sweep" and len(parts) > 2 and parts[1] in ("grid", "zip"):
      raw.setdefault("sweep", {}).setdefault(parts[1], {})[".".join(parts[2:])] = value
      continue
    if len(parts) != 2 and not (tuple(parts[:2]) in TABLE_KEYS and len(parts) <= 2 + TABLE_DEPTH[tuple(parts[:2])]):
      raise invalid("--set", item, f"SECTION.KEY=VALUE (a table whole: --set 'model.layer_heads={{TYPE = {{...}}}}'), "
                    f"a key into a table ({INTO_TABLES})=VALUE, or sweep.grid.SECTION.KEY=[...]")
    if len(parts) > 2:  # into a table, e.g. train.mesh.heads or model.extra.NAME.OPTION
      value = _entry(key, key, value)
      _put(raw, key, value, where=".".join(parts[:-1]))
    else:
      if key == "task.name" and value in tasks.TASKS and value != raw.get("task", {}).get("name"):
        # Another task keeps only the file's [task] keys it shares (seq_len, vocab_size, ...).
        known = tasks.task_fields(value)
        raw["task"] = {k: v for k, v in raw.get("task", {}).items() if k in known}
      raw.setdefault(parts[0], {})[parts[1]] = value
    sweep = raw.get("sweep", {})
    _refuse_overlap(sweep, key, item)
    for kind in ("grid", "zip"):
      axes = flatten_keys(sweep.get(kind, {}))
      if key in axes:
        if kind == "zip":
          raise invalid("--set", item, f"a key that is not a tied axis ({key} is in sweep.zip)")
        sweep["grid"] = {k: v for k, v in axes.items() if k != key}
    if key == "train.seed" and "seeds" in sweep:
      del sweep["seeds"]
    cased = [c.get("name") for c in sweep.get("cases", [])
             if isinstance(c, dict) and any(_overlaps(key, k) for k in flatten_keys(c))]
    if cased:
      raise invalid("--set", item, f"a key that no sweep.cases entry sets ({key} is set by {cased})")
  return raw


def _validate_base(raw: dict[str, Any]) -> dict[str, dict[str, Any]]:
  for section in raw:
    if section not in SECTIONS:
      raise invalid(section, raw[section], f"{did_you_mean(section, SECTIONS)}one of the tables "
                    "[meta] [task] [model] [train] [sweep] [analysis]")
    if not isinstance(raw[section], dict):
      raise invalid(section, raw[section], "a table")
  for key, value in raw.get("analysis", {}).items():
    if key not in ANALYSIS_KEYS:
      raise invalid(f"analysis.{key}", value, f"one of {sorted(ANALYSIS_KEYS)}")
    if not isinstance(value, bool):
      raise invalid(f"analysis.{key}", value, "true or false")
  for key, typ in META_KEYS.items():
    if key in raw.get("meta", {}) and not isinstance(raw["meta"][key], typ):
      raise invalid(f"meta.{key}", raw["meta"][key], "a string")
  for key in raw.get("meta", {}):
    if key not in META_KEYS:
      raise invalid(f"meta.{key}", raw["meta"][key], f"{did_you_mean(key, META_KEYS)}one of {sorted(META_KEYS)}")
  for key, value in raw.get("sweep", {}).items():
    if key not in SWEEP_KEYS:
      raise invalid(f"sweep.{key}", value, f"{did_you_mean(key, SWEEP_KEYS)}one of {sorted(SWEEP_KEYS)}")
    if not isinstance(value, SWEEP_KEYS[key]) or isinstance(value, bool) != (SWEEP_KEYS[key] is bool):
      raise invalid(f"sweep.{key}", value, SWEEP_KINDS[key])
  base = {}
  for section in ("task", "model", "train"):
    schema = _schema(section, raw.get("task", {}))
    values = dict(raw.get(section, {}))
    for key, value in values.items():
      if key in DERIVED_MODEL_KEYS and section == "model":
        raise invalid(f"model.{key}", value, "not set by hand: it is derived from the task")
      if key not in schema:
        owner = f"task {raw['task']['name']!r}" if section == "task" else f"[{section}]"
        raise invalid(f"{section}.{key}", value, f"{did_you_mean(key, schema)}a key of {owner}: {sorted(schema)}")
      values[key] = _check_value(f"{section}.{key}", section, key, value, schema)
    base[section] = values
  sweep = raw.get("sweep", {})
  fitted = "fixed_params" in sweep.get("derive", []) and isinstance(sweep.get("param_budget", "base"), int)
  for key in ("d_model", "num_layers", "num_heads") + (() if fitted else ("d_ff",)):
    if key not in base["model"]:
      raise invalid(f"model.{key}", None, "required: an integer")
  return base


def _axes(raw_sweep: dict[str, Any], base: dict[str, dict[str, Any]]):
  """(grid, zip) as lists of (dotted key, values), each value type-checked."""
  grid = flatten_keys(raw_sweep.get("grid", {}))
  if "seeds" in raw_sweep:
    grid["train.seed"] = raw_sweep["seeds"]
  tied = flatten_keys(raw_sweep.get("zip", {}))
  out = []
  for kind, table in (("grid", grid), ("zip", tied)):
    axes = []
    for key, values in table.items():
      key = ALIASES.get(key, key)
      where = f"sweep.{kind}.{key}"
      if not isinstance(values, list) or not values:
        _key_value(where, key, None, base, "a dotted key task.X, model.X or train.X (or seed)", values)
        raise invalid(where, values, "a non-empty list of values")
      if len({isinstance(v, dict) for v in values}) > 1:
        raise invalid(where, values, f"values of one kind for {_what(key)}: all tables or none")
      values = [_key_value(where, key, v, base, "a dotted key task.X, model.X or train.X (or seed)")
                for v in values]
      axes.append((key, values))
    out.append(axes)
  grid, tied = out
  keyed = [("grid", k, v) for k, v in grid] + [("zip", k, v) for k, v in tied]
  for i, (_, a, _) in enumerate(keyed):
    for kind, b, values in keyed[i + 1:]:
      if _overlaps(a, b):
        raise invalid(f"sweep.{kind}.{b}", values, f"a key that no other axis reaches into or above ({a} is one)")
  lengths = {len(v) for _, v in tied}
  if len(lengths) > 1:
    raise invalid("sweep.zip", {k: len(v) for k, v in tied}, "lists of equal length (tied axes)")
  return grid, tied


def _what(key: str) -> str:
  """A key as an error names it: option O of mechanism N for model.extra.N.O, else the key."""
  parts = key.split(".")
  if tuple(parts[:2]) == ("model", "extra") and len(parts) == 4:
    return f"option {parts[3]!r} of mechanism {parts[2]!r}"
  if tuple(parts[:2]) == ("model", "extra") and len(parts) == 3:
    return f"the options of mechanism {parts[2]!r}"
  return key


def _key_value(where: str, key: str, value: Any, base: dict[str, dict[str, Any]], dotted: str,
               shown: Any = None) -> Any:
  """One value of a sweep axis or case for a dotted key, checked (a key into a table: _entry);
  value None checks the key only (errors show `shown`)."""
  if value is None:
    value = shown
  section, _, name = key.partition(".")
  if section not in ("task", "model", "train") or not name:
    raise invalid(where, value, dotted)
  schema = _schema(section, base["task"])
  field, _, rest = name.partition(".")
  table = (section, field) in TABLE_KEYS
  if field not in schema or (section == "model" and field in DERIVED_MODEL_KEYS) or (rest and not table) or (
      table and rest and len(rest.split(".")) > TABLE_DEPTH[(section, field)]):
    hint = "" if field in schema else did_you_mean(field, schema)
    raise invalid(where, value, f"{hint}a key of [{section}]: {sorted(schema)}"
                  + (f"; into a table: {INTO_TABLES}" if rest else ""))
  if value is shown:
    return value
  if rest:
    return _entry(where, key, value)
  value = _check_value(where, section, name, value, schema)
  if (section, name) == ("model", "extra") and isinstance(value, dict):
    for mech, opts in value.items():
      _entry(f"{where}.{mech}", f"model.extra.{mech}", opts)
  return value


CASE = "case"  # the label key of sweep.cases


def _cases(raw_sweep: dict[str, Any], base: dict[str, dict[str, Any]],
           swept: list[str]) -> list[tuple[str | None, dict[str, Any]]]:
  """sweep.cases as (name, {dotted key: value}), each value type-checked; [(None, {})] without any.

  A case is one named setting of several keys at once ("+qk_norm": model.qk_norm
  = true; "local/global": model.window and model.global_every): an axis whose
  values are such settings, crossed with the grid and zip axes. Keys a case
  leaves out keep the base config's value.
  """
  if "cases" not in raw_sweep:
    return [(None, {})]
  out, names = [], set()
  for i, case in enumerate(raw_sweep["cases"]):
    where = f"sweep.cases[{i}]"
    if not isinstance(case, dict) or not isinstance(case.get("name"), str) or not case["name"]:
      raise invalid(where, case, SWEEP_KINDS["cases"])
    name = case["name"]
    if name in names:
      raise invalid(f"{where}.name", name, "a name no other case has")
    names.add(name)
    values = {}
    for key, value in flatten_keys({k: v for k, v in case.items() if k != "name"}).items():
      key = ALIASES.get(key, key)
      value = _key_value(f"{where}.{key}", key, value, base, "a dotted key task.X, model.X or train.X")
      axis = next((a for a in swept if _overlaps(a, key)), None)
      if axis is not None:
        raise invalid(f"{where}.{key}", value, f"a key that no grid or zip axis sweeps ({axis} is one)")
      values[key] = value
    out.append((name, values))
  if not out:
    raise invalid("sweep.cases", [], "at least one case")
  return out


def _combos(grid, tied):
  rows = [dict(zip([k for k, _ in tied], vs)) for vs in zip(*[v for _, v in tied])] or [{}]
  for values in itertools.product(*[v for _, v in grid]):
    for row in rows:
      yield {**dict(zip([k for k, _ in grid], values)), **row}


def resolve(cfg: dict[str, dict[str, Any]], derive: list[str], budget: int | None) -> dict[str, Any]:
  """The full trial config: task defaults, derived model keys and constraints applied."""
  from attn.experiments.training import train  # lazy: imports jax and flax
  task = tasks.make_task(cfg["task"])
  model = model_defaults(cfg["model"], task.kind)
  if "fixed_width" in derive:
    D, H = model["d_model"], model["num_heads"]
    if H < 1:
      raise invalid("model.num_heads", H,
                    "an integer >= 1 (sweep.derive 'fixed_width' sets d_k = d_v = d_model/h)")
    if D % H:
      raise invalid("model.num_heads", H,
                    f"a divisor of d_model={D} (sweep.derive 'fixed_width' sets d_k = d_v = d_model/h)")
    model["d_k"] = model["d_v"] = D // H
  min_layers = getattr(task, "min_layers", 1)
  if model["num_layers"] < min_layers:
    raise invalid("model.num_layers", model["num_layers"],
                  f">= {min_layers} for task {cfg['task']['name']!r} (an induction head needs two layers)")
  if "fixed_params" in derive:
    model.setdefault("d_ff", 1)  # a start: fit_d_ff sets it (with an integer budget [model] leaves it out)
  model_cfg = train.model_config(model, task)
  if task.kind == "classifier":
    from attn.nn import layer_types  # lazy: flax
    try:
      layer_types.check_bidirectional(model_cfg, f"task {cfg['task']['name']!r} trains a classifier whose encoder")
    except ConfigError as e:
      raise ConfigError(f"model.{e}") from None
  if "fixed_params" in derive:
    model_cfg = train.fit_d_ff(model_cfg, task.kind, budget)
  note_full_selection(model_cfg, task.seq_len)
  task_cfg = {"name": cfg["task"]["name"], **{f: getattr(task, f) for f in tasks.task_fields(cfg["task"]["name"])}}
  train_cfg = TrainConfig(**cfg["train"])
  check_heads(train_cfg, model_cfg.num_heads)
  check_indexer(train_cfg, model_cfg)
  if train_cfg.sink_metrics and task.kind != "decoder_lm":
    raise invalid("train.sink_metrics", True, f"false for task {cfg['task']['name']!r}, a classifier: "
                  "the sink metrics read a causal language model's first position")
  if train_cfg.logit_metrics and task.kind != "decoder_lm":
    raise invalid("train.logit_metrics", True, f"false for task {cfg['task']['name']!r}, a classifier: "
                  "the logit metrics run a causal language model on a held-out batch")
  if train_cfg.logit_metrics:
    from attn.variants import VARIANTS  # lazy: jax
    names = {model_cfg.layer_variant(i) for i in range(model_cfg.num_layers)}
    if all(VARIANTS[n].cache_kind == "state" for n in names):
      raise invalid("train.logit_metrics", True, f"false for a model whose layers are all fixed-state heads "
                    f"({', '.join(sorted(names))}): they have no softmax logits to measure")
  return {"task": task_cfg, "model": dataclasses.asdict(model_cfg), "train": dataclasses.asdict(train_cfg)}


def note_full_selection(model_cfg: Any, T: int) -> None:
  """Warns (one line) when a key budget keeps every key at a trial's T: MoBA's top_k reaching the number
  of blocks, the lightning indexer's top_k or a window reaching T. Every query then attends to every key
  it sees, full attention exactly (tests/test_selection.py) at a selection's cost (docs/key_selection.md):
  the trial runs once, as configured, and its line says so. NSA is not warned: its compressed branch
  adds its gated share even when its selected blocks and window cover every key."""
  extra = model_cfg.extra or {}
  what = None
  if "moba" in extra or "indexer" in extra:
    from attn.variants.mechanisms import options  # lazy: jax
  if "moba" in extra:
    o = options(model_cfg.head, "moba")
    block = min(o["block"], T)
    blocks = -(-T // block)
    if o["top_k"] >= blocks:
      what = f"model.extra.moba.top_k={o['top_k']} is at least the {blocks} blocks of {block} keys in seq_len={T}"
  elif "indexer" in extra:
    k = options(model_cfg.head, "indexer")["top_k"]
    if k >= T:
      what = f"model.extra.indexer.top_k={k} is at least seq_len={T}"
  elif model_cfg.window is not None and model_cfg.window >= T:
    what = f"model.window={model_cfg.window} is at least seq_len={T}"
  if what:
    warnings.warn(f"{what}: every query attends to every key it sees (full attention, no selection)",
                  FullSelectionWarning, stacklevel=2)


class FullSelectionWarning(UserWarning):
  """A key selection that keeps every key at the trial's length (note_full_selection)."""


def load(path: str, overrides: list[str] | None = None) -> Sweep:
  """Reads, validates and expands a config file; every error names the file."""
  try:
    with open(path, "rb") as f:
      raw = tomllib.load(f)
  except FileNotFoundError:
    raise invalid("CONFIG", path, "an existing TOML file, e.g. configs/quick.toml") from None
  except tomllib.TOMLDecodeError as e:
    raise invalid("CONFIG", path, f"valid TOML ({e})") from None
  try:
    return _expand(path, apply_overrides(raw, overrides or []), override_keys(overrides or []))
  except ConfigError as e:
    raise ConfigError(f"{path}: {e}") from None


def loads(text: str, name: str, overrides: list[str] | None = None) -> Sweep:
  """Like `load`, from TOML text; `name` stands for the file in messages."""
  try:
    return _expand(name, apply_overrides(tomllib.loads(text), overrides or []), override_keys(overrides or []))
  except ConfigError as e:
    raise ConfigError(f"{name}: {e}") from None


def check_derived(raw: dict[str, Any], set_keys: dict[str, str] | None = None) -> None:
  """Refuses a value of a field that a derive computes (module docstring), naming the field and the derive."""
  sweep, set_keys = raw.get("sweep", {}), set_keys or {}
  derive = sweep.get("derive", [])
  for d in derive:
    keys, rule = DERIVED[d]
    rest = json.dumps([x for x in derive if x != d])
    for key in keys:
      section, _, name = key.partition(".")
      why = f"sweep.derive {d!r} computes {key} in every trial ({rule}) and would overwrite it"
      for kind in ("grid", "zip"):
        axes = flatten_keys(sweep.get(kind, {}))
        if key in axes:
          raise invalid(f"sweep.{kind}.{key}", axes[key],
                        f"left out: {why}; to sweep it by hand, drop the derive (sweep.derive = {rest})")
      if name not in raw.get(section, {}):
        continue
      if key in set_keys:
        also = " or change the budget: --set sweep.param_budget=N" if d == "fixed_params" else ""
        raise invalid("--set", set_keys[key],
                      f"left out: {why}; to set it by hand, also drop the derive: --set 'sweep.derive={rest}'{also}")
      if d == "fixed_params" and sweep.get("param_budget", "base") == "base":
        continue  # the base model's d_ff: its parameter count is the budget
      where = "sweep.param_budget is an integer, so " if d == "fixed_params" else ""
      raise invalid(key, raw[section][name], f"left out of [{section}]: {where}{why}; to set it by hand, "
                    f"drop the derive (sweep.derive = {rest})")


def _expand(path: str, raw: dict[str, Any], set_keys: dict[str, str] | None = None) -> Sweep:
  base = _validate_base(raw)
  sweep = raw.get("sweep", {})
  derive = sweep.get("derive", [])
  for d in derive:
    if d not in DERIVES:
      raise invalid("sweep.derive", d, f"a list of {list(DERIVES)}")
  check_derived(raw, set_keys)
  grid, tied = _axes(sweep, base)
  budget = sweep.get("param_budget", "base")
  if "fixed_params" in derive and not isinstance(budget, int):
    if budget != "base":
      raise invalid("sweep.param_budget", budget, '"base" or a positive integer')
    from attn import count
    from attn.nn.config import ModelConfig
    base_cfg = resolve(base, [d for d in derive if d != "fixed_params"], None)
    budget = count.model_param_count(ModelConfig(**base_cfg["model"]), tasks.TASKS[base["task"]["name"]].kind)
  trials, seen = [], {}
  cases = _cases(sweep, base, [k for k, _ in grid + tied])
  for combo, (case, case_values) in itertools.product(list(_combos(grid, tied)), cases):
    cfg = copy.deepcopy(base)
    for key, value in {**case_values, **combo}.items():
      _put(cfg, key, value)
    if case is not None:
      combo = {CASE: case, **combo}
    label = ", ".join(f"{axis_name(k)}={show(v)}" for k, v in combo.items())
    try:
      resolved = resolve(cfg, derive, budget)
    except ConfigError as e:
      raise ConfigError(f"trial [{label}]: {e}" if label else f"the trial: {e}") from None  # no axes: one trial
    tid = trial_id(resolved)
    if tid in seen:
      raise invalid("sweep", label, f"axes giving distinct trials (same resolved config as [{seen[tid]}])")
    seen[tid] = label
    trials.append(Trial(tid, combo, resolved))
  vmap_seeds = bool(sweep.get("vmap_seeds", False))
  pack = check_pack(sweep.get("pack", 1), vmap_seeds)
  check_seed_axis(trials, vmap_seeds)
  meta = {"name": raw.get("meta", {}).get("name", path), "question": raw.get("meta", {}).get("question", "")}
  axes = ([CASE] if cases[0][0] is not None else []) + [k for k, _ in grid] + [k for k, _ in tied]
  return Sweep(path, meta, axes, trials, vmap_seeds,
               stable_hash(sorted(t.id for t in trials)), raw.get("analysis", {}).get("enabled", False), pack)


def shape_key(trial: Trial) -> str:
  """Trials with equal shape keys differ only in seed and can train together under vmap."""
  cfg = copy.deepcopy(trial.config)
  del cfg["train"]["seed"]
  return trial_id(cfg)


def pack_key(trial: Trial) -> str:
  """Trials with equal pack keys differ only in the PACKABLE [train] keys and can be packed (sweep.pack)."""
  cfg = copy.deepcopy(trial.config)
  for key in PACKABLE:
    del cfg["train"][key]
  return trial_id(cfg)


def check_pack(pack: Any, vmap_seeds: bool) -> int | str:
  """sweep.pack (an int or "auto"); refused by name otherwise, or when packing beside vmap_seeds = true."""
  if pack != "auto" and (isinstance(pack, bool) or not isinstance(pack, int) or pack < 1):
    raise invalid("sweep.pack", pack, PACK_ALLOWED)
  if packs(pack) and vmap_seeds:
    raise invalid("sweep.pack", pack, "1 with sweep.vmap_seeds = true (a pack already trains a trial's seeds "
                  "together, and other trials beside them): set one of the two")
  return pack


def packs(pack: int | str) -> bool:
  """Whether sweep.pack puts several trials in one program (an integer > 1, or "auto")."""
  return pack == "auto" or pack > 1


def seed_groups(trials: list[Trial], vmap_seeds: bool, pack: int | str = 1,
                limits: dict[str, int] | None = None) -> list[list[Trial]]:
  """Trials that train as one program, in sweep order.

  With pack > 1: trials of one pack key, in sweep order, cut into runs of at most pack (or
  limits[pack key], where memory allows fewer: sweep.fit_packs); with "auto", of limits[pack key]
  (what the worker measures best) or, without one, all of them; else under vmap_seeds, trials
  equal but for seed; else one each. A trial is in exactly one group.
  """
  groups: dict[str, list[Trial]] = {}
  for t in trials:
    groups.setdefault(pack_key(t) if packs(pack) else shape_key(t) if vmap_seeds else t.id, []).append(t)
  if not packs(pack):
    return list(groups.values())
  out = []
  for key, group in groups.items():
    most = len(group) if pack == "auto" else pack
    n = max(1, min(most, (limits or {}).get(key, most)))
    out.extend(group[i:i + n] for i in range(0, len(group), n))
  order = {t.id: i for i, t in enumerate(trials)}
  return sorted(out, key=lambda g: order[g[0].id])


def batched(vmap_seeds: bool, pack: int | str) -> bool:
  """Whether groups of several trials train as one vmapped program."""
  return vmap_seeds or packs(pack)


def check_seed_axis(trials: list[Trial], vmap_seeds: bool) -> None:
  """Config validation: the seed axis needs seeds trained together, and an explicit count dividing each group."""
  for group in seed_groups(trials, True):
    train = group[0].config["train"]
    if train["data_parallel_axis"] != "seed":
      continue
    if not vmap_seeds:
      raise invalid("train.data_parallel_axis", "seed",
                    '"batch" unless sweep.vmap_seeds = true (only seeds trained together can be spread over devices)')
    N, n = train["data_parallel"], len(group)
    if N != "auto" and n % N:
      raise invalid("train.data_parallel", N,
                    f"a divisor of the {n} seeds trained together under sweep.vmap_seeds "
                    f'(train.data_parallel_axis = "seed" gives each device the same number of seeds), '
                    f"e.g. one of {[d for d in range(1, n + 1) if n % d == 0]}")


def check_devices(trials: list[Trial], vmap_seeds: bool, processes: int = 1, pack: int | str = 1) -> None:
  """Refuses a sweep whose train.mesh cannot run on this machine's devices, before any trial starts.

  Also refuses a model.impl that does not run here. processes: per trial; each of them has this
  machine's devices. train_group
  checks again on the machine that trains (a Slurm node may have other
  devices than the one that submits); a runner that calls this first refuses
  the sweep instead of recording every trial as failed.
  """
  from attn.experiments.training import parallel  # lazy: jax, slow to import for `attn status`
  from attn import kernel
  if processes > 1 and packs(pack):
    raise invalid("sweep.pack", pack, f"1 with {processes} processes per trial (each trial's batch is shared "
                  "over them; packs train in one process)")
  for impl in sorted({t.config.get("model", {}).get("impl", "auto") for t in trials} - {"auto"}):
    try:  # an implementation this machine cannot run (cudnn on a CPU): refused before any training
      kernel.check_impl(impl)
    except ConfigError as e:
      raise ConfigError(f"model.{e}") from None
  for group in seed_groups(trials, vmap_seeds, pack):
    n = len(group)
    parallel.device_count(TrainConfig(**group[0].config["train"]), n, batched(vmap_seeds, pack) and n > 1,
                          processes)


def check_processes(trials: list[Trial], processes: int) -> None:
  """Refuses a sweep whose batches cannot be shared over `processes` processes per trial (any devices)."""
  from attn.experiments.training import parallel  # lazy: jax
  for t in trials:
    parallel.check_processes(TrainConfig(**t.config["train"]), processes)
