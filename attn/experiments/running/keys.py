"""Every key of a sweep config, from the schema: docs/config.md is `reference()`'s text.

The sections read what the config validation reads (attn.experiments.running.config): [model] the
ModelConfig fields (HeadConfig's among them), [train] TrainConfig's, [task] each task's dataclass,
[sweep] SWEEP_KEYS. A field's note is its trailing comment in the class that declares it, else the
docstring to read; choices come from the tables the validation checks against, variants from the
built-in registry (a plugin's records are left out, so the text is the same on every machine).
`python scripts/config_reference.py > docs/config.md` writes it; tests/test_config_reference.py
checks the committed file is the output.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from typing import Any

from attn.experiments.data import tasks
from attn.experiments.running import config as config_lib

HEADER = """# Config keys

Every key of a sweep config's tables, generated from the schema by `python scripts/config_reference.py >
docs/config.md` (attn.experiments.running.keys; a test checks this file is its output: regenerate, do
not edit). A key goes in its table (`[model]`, TOML), on the command line (`--set model.num_heads=4`), as
a sweep axis (`[sweep.grid] "model.num_heads" = [1, 4]`) or in a case (`[[sweep.cases]]`). A misspelt key
is refused with the closest keys (did you mean ...?). A dotted key reaches into a table:
{into}; or set the table whole:
`--set 'model.layer_heads={{linear_attention = {{variant = "mamba2"}}}}'`.
"""


# What each [sweep] key does (config_lib.SWEEP_KINDS says what values it takes).
SWEEP_NOTES = {
    "grid": 'axes crossed as a product: "model.num_heads" = [1, 4]',
    "zip": "tied axes, zipped (lists of equal length)",
    "cases": 'named settings of several keys at once (name = "...", model.window = 16, ...): one more axis, "case"',
    "seeds": "shorthand for a grid axis over train.seed",
    "derive": "constraints applied to every trial, in order (below)",
    "param_budget": 'with derive "fixed_params": the parameter count each trial\'s d_ff fills; "base" (the '
                    "default): the base [model]'s own count; --set sweep.param_budget=N changes it",
    "vmap_seeds": "trials equal but for train.seed train as one vmapped program",
    "pack": "trials equal but for the seed and learning-rate keys train as one vmapped program (docs/running.md)",
}


# What each [train] key does, in a line (TrainConfig's docstring has the rest).
TRAIN_NOTES = {
    "steps": "optimiser steps", "batch_size": "sequences per step",
    "lr": "peak learning rate: linear warm-up from 0, then cosine decay to lr·end_lr_ratio at the last step",
    "warmup_steps": "steps of the linear warm-up", "end_lr_ratio": "the last step's learning rate over lr",
    "weight_decay": "AdamW's decoupled decay, on matrices only", "b1": "Adam's β1", "b2": "Adam's β2",
    "grad_clip": "global-norm clipping (0: none)", "eval_every": "steps between held-out evaluations (0: at the end)",
    "eval_batches": "held-out batches per evaluation", "seed": "the trial's seed (data and initialisation)",
    "checkpoint_every": "steps between checkpoints (0: at each evaluation)",
    "data_parallel": 'local devices each step runs on, or "auto"', "data_parallel_axis": '"batch" or "seed"',
    "grad_accum": "micro-batches per step", "mesh": "{data = N, heads = M}: devices by batch and by heads",
    "sink_metrics": "attention sinks, value drains and massive activations at each evaluation",
    "logit_metrics": "the largest attention score and logit per layer at each evaluation",
    "sink_threshold": "the first-position mass above which a head counts as a sink head",
    "indexer": 'how a lightning indexer trains: "off", "warmup", "sparse" or "staged"',
    "indexer_kl_weight": "the weight of the indexer's KL term", "indexer_dense_steps": 'with "staged": dense steps',
    "indexer_warmup_steps": 'with "staged": warm-up steps',
}


def _comments(cls: type) -> dict[str, str]:
  """field -> its trailing comment in cls's source (`name: type = default  # comment`)."""
  try:
    source = inspect.getsource(cls)
  except (OSError, TypeError):
    return {}
  return {m.group(1): m.group(2).strip() for m in re.finditer(r"^\s+(\w+):[^\n#]*#\s*([^\n]*)$", source, re.M)}


def _show(value: Any) -> str:
  if value is None:
    return "unset"
  if isinstance(value, bool):
    return str(value).lower()
  if isinstance(value, str):
    return f'"{value}"'
  return repr(value)


def _cell(text: str) -> str:
  return text.replace("|", "\\|")


def _model_rows() -> list[tuple[str, str, str]]:
  from attn.config import HeadConfig
  from attn.nn import config as model_config
  from attn.nn.config import ModelConfig
  from attn.variants import VARIANTS
  builtin = sorted(n for n in VARIANTS if VARIANTS.source(n) == "attn")
  fixed_state = [n for n in builtin if VARIANTS[n].init_state is not None]
  head = {f.name for f in dataclasses.fields(HeadConfig)}
  own, heads = _comments(ModelConfig), _comments(HeadConfig)
  choices = {**model_config._CHOICES, "variant": builtin, "linear_variant": fixed_state,
             "block_kinds": model_config.BLOCK_KINDS}
  sweep_defaults = config_lib.model_defaults({}, "decoder_lm")  # what a sweep sets where [model] is silent
  classifier = config_lib.model_defaults({}, "classifier")
  rows = []
  for f in dataclasses.fields(ModelConfig):
    if f.name in config_lib.DERIVED_MODEL_KEYS:
      continue
    default = sweep_defaults.get(f.name, f.default)
    notes = [own.get(f.name) or heads.get(f.name) or ""]
    if f.name in sweep_defaults:
      notes.append(f"a sweep's default for a language model (ModelConfig's: {_show(f.default)}; a classifier's: "
                   f"{_show(classifier[f.name])}; docs/running.md)")
    if f.name in choices:
      notes.append("one of " + ", ".join(_show(c) for c in choices[f.name]))
    if f.name in ("layer_heads", "linear_head", "extra"):
      notes.append(f"a table: model.{f.name}.{'TYPE[.FIELD]' if f.name == 'layer_heads' else 'NAME[.OPTION]' if f.name == 'extra' else 'FIELD'}")
    notes.append("HeadConfig (attn/config.py)" if f.name in head else "ModelConfig (attn/nn/config.py)")
    rows.append((f.name, "required" if default is dataclasses.MISSING else _show(default),
                 "; ".join(n for n in notes if n)))
  return rows


def _train_rows() -> list[tuple[str, str, str]]:
  from attn.experiments.training.config import TrainConfig
  notes = {**TRAIN_NOTES, **_comments(TrainConfig)}
  return [(f.name, _show(f.default), "; ".join(n for n in (notes.get(f.name, ""), "TrainConfig "
                                                            "(attn/experiments/training/config.py)") if n))
          for f in dataclasses.fields(TrainConfig)]


def _table(rows: list[tuple[str, str, str]], section: str) -> list[str]:
  out = ["| key | default | what, and where it is described |", "|---|---|---|"]
  out += [f"| `{section}.{k}` | `{_cell(d)}` | {_cell(n)} |" for k, d, n in rows]
  return out


def reference() -> str:
  """The text of docs/config.md."""
  lines = [HEADER.format(into=config_lib.INTO_TABLES), "## [model]", "",
           "The model: sizes, the attention variant, its head fields (declared once in HeadConfig) and the "
           "architecture switches. `vocab_size`, `max_len` and `num_classes` come from the task.", ""]
  lines += _table(_model_rows(), "model")
  lines += ["", "## [sweep]", "", "The trials: axes, cases, derived fields.", ""]
  lines += ["| key | what | values |", "|---|---|---|"]
  lines += [f"| `sweep.{k}` | {_cell(SWEEP_NOTES.get(k, ''))} | {_cell(config_lib.SWEEP_KINDS[k])} |"
            for k in config_lib.SWEEP_KEYS]
  lines += [""] + [f"- derive `{d}`: computes {', '.join(keys)} in every trial ({rule})"
                   for d, (keys, rule) in config_lib.DERIVED.items()]
  lines += ["", "## [train]", "", "Optimiser, schedule, evaluation and checkpoints of one trial.", ""]
  lines += _table(_train_rows(), "train")
  lines += ["", "## [task]", "", "`task.name` picks the task; the other keys are that task's.", ""]
  for name, cls in tasks.TASKS.items():
    doc = (inspect.getdoc(cls) or "").split("\n\n")[0].replace("\n", " ")
    lines += [f"### `{name}` ({cls.kind})", "", doc, ""]
    notes = _comments(cls)
    lines += _table([(k, _show(v), notes.get(k, "")) for k, v in tasks.task_fields(name).items()], "task")
    lines.append("")
  lines += ["## [meta] and [analysis]", "", "| key | what |", "|---|---|",
            "| `meta.name` | the sweep's name (a string; default: the file's path) |",
            "| `meta.question` | the question it answers (a string), printed atop its report |",
            "| `analysis.enabled` | true: `attn sweep` runs `attn analyze` on the trained trials before the report |"]
  return "\n".join(lines) + "\n"
