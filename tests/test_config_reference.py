"""docs/config.md: every key of a sweep config, generated from the schema (issue 55, item 3)."""

import dataclasses
import pathlib
import re

from attn.experiments.data import tasks
from attn.experiments.running import config as config_lib
from attn.experiments.running import keys
from attn.experiments.training.config import TrainConfig
from attn.nn.config import ModelConfig

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_the_committed_reference_is_the_scripts_output():
  committed = (ROOT / "docs" / "config.md").read_text()
  assert committed == keys.reference(), "docs/config.md is stale: python scripts/config_reference.py > docs/config.md"


def test_the_reference_names_every_key_the_validation_takes():
  text = keys.reference()
  named = set(re.findall(r"^\| `((?:model|train|task|sweep)\.\w+)` \|", text, re.M))
  model = {f"model.{f.name}" for f in dataclasses.fields(ModelConfig)} - {
      f"model.{k}" for k in config_lib.DERIVED_MODEL_KEYS}
  train = {f"train.{f.name}" for f in dataclasses.fields(TrainConfig)}
  task = {f"task.{k}" for name in tasks.TASKS for k in tasks.task_fields(name)}
  sweep = {f"sweep.{k}" for k in config_lib.SWEEP_KEYS}
  assert model | train | task | sweep == named
  assert {"model.linear_variant", "sweep.param_budget", "model.layer_heads"} <= named
  linear = next(line for line in text.splitlines() if line.startswith("| `model.linear_variant`"))
  assert '"mamba2"' in linear and '"per_head"' not in linear  # the fixed-state variants only


def test_the_readme_names_the_reference_and_the_keys_a_newcomer_misses():
  readme = (ROOT / "README.md").read_text()
  assert "docs/config.md" in readme and "model.linear_variant" in readme and "sweep.param_budget" in readme
