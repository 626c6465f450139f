"""`attn count CONFIG [--case NAME]`: the models a sweep's trials train, counted; one byte dtype across the
counting API (float32, what reports count in), and a DecoderLM unless said."""

import inspect
import os
import re

import pytest

from attn import cli, count
from attn.config import ConfigError
from attn.count import cli as count_cli
from attn.experiments.reading import memory
from attn.nn.config import ModelConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = """[task]
name = "mqar"
vocab_size = 16
seq_len = 16
num_pairs = 2
[model]
d_model = 16
num_layers = 2
num_heads = 2
d_ff = 16
[sweep]
derive = ["fixed_params"]
seeds = [0, 1]
[[sweep.cases]]
name = "MHA"
[[sweep.cases]]
name = "hybrid"
model.layer_types = ["linear_attention", "full_attention"]
"""


def test_counts_the_models_the_trials_of_a_shipped_sweep_trained():
  rows = count_cli.config_rows(os.path.join(ROOT, "configs", "quick.toml"))
  assert len(rows) == 4 and sum(r["trials"] for r in rows) == 12  # seeds share a model
  # The committed report's "model params", each counted from a trained model's parameter tree.
  with open(os.path.join(ROOT, "experiments", "quick", "report.md"), encoding="utf-8") as f:
    trained = {m[0].rsplit(", seed=", 1)[0]: int(m[1].replace(",", ""))
               for m in re.findall(r"^\| [0-9a-f]{12} \| (.*?) \| ok \| ([0-9,]+) \|", f.read(), flags=re.M)}
  assert {r["model"]: r["params"] for r in rows} == trained
  assert all(r["held_at_T"] == r["kv_bytes_per_token"] * 32 for r in rows)  # softmax only: no state


def test_a_case_is_picked_by_name_and_a_cases_derived_d_ff_and_state_counted(tmp_path):
  path = tmp_path / "c.toml"
  path.write_text(CASES)
  both = count_cli.config_rows(str(path))
  assert [r["model"] for r in both] == ["case=MHA", "case=hybrid"] and [r["trials"] for r in both] == [2, 2]
  (hybrid,) = count_cli.config_rows(str(path), cases=["hybrid"])
  assert hybrid["state_bytes"] > 0 and hybrid["held_at_T"] == hybrid["kv_bytes_at_T"] + hybrid["state_bytes"]
  assert abs(hybrid["params"] - both[0]["params"]) < both[0]["params"] * 0.05  # fitted to the same budget
  with pytest.raises(ConfigError, match=r"--case='GQA'.*\['MHA', 'hybrid'\]"):
    count_cli.config_rows(str(path), cases=["GQA"])
  with pytest.raises(ConfigError, match="no sweep.cases"):
    count_cli.config_rows(os.path.join(ROOT, "configs", "quick.toml"), cases=["MHA"])


def test_the_cli_takes_a_config_and_refuses_flags_that_would_not_count_its_trials(capsys, tmp_path):
  path = tmp_path / "c.toml"
  path.write_text(CASES)
  assert cli.main(["count", str(path), "--case", "hybrid", "--set", "model.d_model=32"]) == 0
  out = capsys.readouterr().out
  assert "case=hybrid" in out and "case=MHA" not in out and "float32" in out
  assert cli.main(["count", str(path), "--preset", "gpt2"]) == 2
  assert "CONFIG" in capsys.readouterr().err
  assert cli.main(["count", "--case", "hybrid"]) == 2
  assert "without CONFIG" in capsys.readouterr().err


def test_one_dtype_default_across_the_counting_api_and_the_cli():
  m = ModelConfig(vocab_size=256, d_model=64, num_layers=4, num_heads=4, d_ff=71,
                  layer_types=("linear_attention",) * 3 + ("full_attention",))
  defaults = {f.__name__: inspect.signature(f).parameters["dtype"].default for f in (
      count.model_kv_cache_bytes, count.model_kv_cache_bytes_per_token, count.model_state_bytes,
      count.layer_type_table)}
  assert set(defaults.values()) == {count.DTYPE} == {"float32"}, defaults
  parser = __import__("argparse").ArgumentParser()
  count_cli.add_arguments(parser)
  assert parser.parse_args([]).dtype == count.DTYPE
  # Cache and state add up to what a report says one sequence holds (its bytes are float32 too).
  trial = {"config": {"task": {"name": "text", "seq_len": 128}, "model": __import__("dataclasses").asdict(m)}}
  assert count.model_kv_cache_bytes(m, "decoder_lm", 128) + count.model_state_bytes(m) == sum(
      memory.sequence_bytes(trial))
  assert count.model_param_count(m) == count.model_param_count(m, "decoder_lm")  # a DecoderLM unless said
