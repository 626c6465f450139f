"""Config refusals a newcomer reads (issue 55): a trial's reason is the ConfigError's message, and a
bidirectional task refuses a head that is causal by construction at validation."""

import os

import jax
import pytest

from attn import ConfigError
from attn.experiments.running import config as config_lib
from attn.experiments.running import store, sweep
from conftest import TINY_MQAR

TINY = TINY_MQAR + "[train]\nsteps = 1\nbatch_size = 2\neval_every = 1\neval_batches = 1\n[sweep]\nseeds = [0]\n"
MARKER = """
[task]
name = "marker_position"
vocab_size = 16
seq_len = 8
[model]
d_model = 16
num_layers = 2
num_heads = 2
d_ff = 16
"""


@pytest.mark.parametrize("sets", [
    ['model.layer_types=["linear_attention", "full_attention"]'],
    ['model.layer_types=["full_attention", "linear_attention"]', 'model.linear_variant="mamba2"'],
])
def test_a_bidirectional_task_refuses_a_linear_layer_at_validation(sets):
  with pytest.raises(ConfigError, match=r"model.layer_types\[\d\]='linear_attention' is not allowed: a softmax layer "
                                        r"type: task 'marker_position' trains a classifier whose encoder attends both "
                                        r"ways, and layer \d's (gated_deltanet|mamba2) head is causal by construction"):
    config_lib.loads(MARKER, "m", sets)


def test_an_encoder_refuses_a_linear_layer_before_tracing():
  from flax import nnx
  from attn.nn.models import ModelConfig, SequenceClassifier
  cfg = ModelConfig(vocab_size=16, d_model=16, num_layers=2, num_heads=2, d_ff=16, num_classes=3,
                    layer_types=["full_attention", "linear_attention"])
  with pytest.raises(ConfigError, match=r"layer_types\[1\]='linear_attention' is not allowed: a softmax layer type: "
                                        r"an Encoder attends both ways"):
    SequenceClassifier(cfg, rngs=nnx.Rngs(0))


def test_a_trial_failed_by_a_config_error_while_tracing_records_its_message(tmp_path, monkeypatch):
  def train_group(*args, **kwargs):
    def step(x):
      raise ConfigError("model.window=3 is not allowed: a refusal met while tracing")
    return jax.jit(step)(1.0)
  monkeypatch.setattr("attn.experiments.training.train.train_group", train_group)
  sw = config_lib.loads(TINY, "tiny")
  counts = sweep.run_sweep(sw, str(tmp_path / "out"), config_text=TINY)
  assert counts["failed"] == 1
  summary = store.read_json(os.path.join(tmp_path, "out", "trials", sw.trials[0].id, "summary.json"))
  assert summary["reason"] == ("error: attn.config.ConfigError: model.window=3 is not allowed: a refusal met "
                               "while tracing"), summary["reason"]
