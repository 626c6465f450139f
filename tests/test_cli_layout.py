"""The commands live in attn/cli/, one module each; their old import paths name the same functions; `attn bench
--sweep` reads its trial from configs/bench_layer.toml and names that file when it is missing or broken."""

import os

import pytest

from attn import ConfigError, cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_old_command_paths_are_the_new_commands():
  from attn import eval_cli
  from attn.cli import count, eval as eval_cmd, reproduce, sweep
  from attn.count import cli as count_cli
  from attn.experiments import cli as sweep_cli, reproduce_cli
  from attn.experiments.running import launch, model_counts
  assert (sweep_cli.run, sweep_cli.add_arguments, sweep_cli._check) == (sweep.run, sweep.add_arguments, launch.check)
  assert (count_cli.run, count_cli.add_arguments, count_cli.config_rows) == (count.run, count.add_arguments,
                                                                               model_counts.config_rows)
  assert (reproduce_cli.run, eval_cli.run) == (reproduce.run, eval_cmd.run)


def test_the_built_in_sweep_is_the_quick_sweeps_h1_per_head_trial():
  from attn.bench import throughput
  from attn.experiments.running import config as config_lib
  (trial,) = config_lib.loads(throughput.builtin_text(), "builtin").trials
  quick = [t for t in config_lib.load(os.path.join(ROOT, "configs", "quick.toml")).trials
           if t.config["model"]["num_heads"] == 1 and t.config["model"]["variant"] == "per_head"]
  assert trial.config["model"] == quick[0].config["model"] and trial.config["task"] == quick[0].config["task"]
  assert throughput.SWEEP_FILE == os.path.join(ROOT, "configs", "bench_layer.toml")


@pytest.mark.parametrize("text, match", [(None, "cannot be read"), ("[task\nname = 1", "not valid TOML")])
def test_a_missing_or_broken_bench_config_is_named_before_any_timing(tmp_path, monkeypatch, capsys, text, match):
  from attn.bench import throughput
  path = tmp_path / "bench_layer.toml"
  if text is not None:
    path.write_text(text)
  monkeypatch.setattr(throughput, "SWEEP_FILE", str(path))
  with pytest.raises(ConfigError, match=match):
    throughput.builtin_text()
  assert cli.main(["bench", "--shapes", "small", "--variants", "fused", "--no-peers", "--repeats", "1",
                   "--sweep"]) == 2
  captured = capsys.readouterr()
  assert str(path) in captured.err and match in captured.err and "timing" not in captured.err
  assert captured.out == ""
