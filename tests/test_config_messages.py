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


def test_a_bidirectional_task_names_the_variant_that_is_causal_only():
  with pytest.raises(ConfigError, match=r"model.variant='kda' is not allowed: a softmax variant: task 'marker_position'"):
    config_lib.loads(MARKER, "m", ['model.variant="kda"'])


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


QUICK = TINY.replace("[sweep]", "[sweep]\n")


@pytest.mark.parametrize("sets, words", [
    (["model.num_kv_head=1"], r"model.num_kv_head=1 is not allowed: did you mean 'num_kv_heads'"),
    (['model.variant="gated_deltnet"'], r"model.variant='gated_deltnet' is not allowed: did you mean 'gated_deltanet'\? one of \["),
    (['model.linear_variant="mamba"', 'model.layer_types=["linear_attention"]'],
     r"linear_variant='mamba' is not allowed: did you mean 'mamba2'\?"),
    (["sweep.param_budgt=1000"], r"sweep.param_budgt=1000 is not allowed: did you mean 'param_budget'\?"),
    (['task.name="marker_positon"'], r"task.name='marker_positon' is not allowed: did you mean 'marker_position'\?"),
    (["sweep.grid.model.num_kv_head=[1, 2]"], r"sweep.grid.model.num_kv_head=1 is not allowed: did you mean 'num_kv_heads'"),
    (["model.extra.mobba.top_k=2"], r"model.extra.mobba.top_k=2 is not allowed: .*did you mean 'moba'\?"),
])
def test_a_misspelt_key_or_name_gets_a_did_you_mean_before_the_list(sets, words):
  with pytest.raises(ConfigError, match=words):
    config_lib.loads(TINY, "t", sets)


def test_a_misspelt_family_gets_a_did_you_mean():
  from attn.nn.hf import FAMILIES
  from attn.nn.hf.load import family_for
  with pytest.raises(ConfigError, match=r"model_type='qwen3_nxt' is not allowed: did you mean 'qwen3_next'"):
    family_for({"model_type": "qwen3_nxt"})
  with pytest.raises(ConfigError, match=r"family='lama' is not allowed: did you mean 'llama'\?"):
    FAMILIES.resolve("lama")


def test_a_dotted_key_reaches_into_a_layer_type_table_as_its_table_form_does():
  kinds = ['model.layer_types=["linear_attention"]']
  dotted = config_lib.loads(TINY, "t", kinds + ['model.layer_heads.linear_attention.variant="mamba2"'])
  whole = config_lib.loads(TINY, "t", kinds + ['model.layer_heads={linear_attention={variant="mamba2"}}'])
  case = config_lib.loads(TINY + '[[sweep.cases]]\nname = "m"\nmodel.layer_heads.linear_attention.variant = "mamba2"\n',
                          "t", kinds)
  assert dotted.trials[0].id == whole.trials[0].id == case.trials[0].id
  assert dotted.trials[0].config["model"]["layer_heads"] == {"linear_attention": {"variant": "mamba2"}}
  with pytest.raises(ConfigError, match=r"a table whole: --set 'model.layer_heads=\{TYPE = \{...\}\}'"):
    config_lib.loads(TINY, "t", kinds + ['model.layer_heads.linear_attention.variant.x=1'])


def test_a_setting_that_must_stay_unset_says_so():
  with pytest.raises(ConfigError, match=r"window=16 is not allowed: it must be unset \(None\) for gated_deltanet"):
    config_lib.loads(TINY, "t", ['model.variant="gated_deltanet"', "model.window=16"])


@pytest.mark.parametrize("top_k, warned", [(2, False), (3, True), (8, True)])
def test_moba_top_k_at_the_number_of_blocks_warns_in_one_line(top_k, warned):
  import warnings
  sets = [f"model.extra={{moba = {{block = 4, top_k = {top_k}}}}}"]  # seq_len 12: 3 blocks of 4
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    config_lib.loads(TINY, "t", sets)
  full = [w for w in caught if issubclass(w.category, config_lib.FullSelectionWarning)]
  assert len(full) == warned, [str(w.message) for w in caught]
  if warned:
    assert str(full[0].message) == (f"model.extra.moba.top_k={top_k} is at least the 3 blocks of 4 keys in seq_len=12: "
                                    "every query attends to every key it sees (full attention, no selection)")


@pytest.mark.parametrize("sets, warned", [
    (["model.extra={indexer = {heads = 1, head_dim = 2, top_k = 11}}"], None),
    (["model.extra={indexer = {heads = 1, head_dim = 2, top_k = 12}}"], "model.extra.indexer.top_k=12 is at least seq_len=12"),
    (["model.extra={indexer = {heads = 1, head_dim = 2, top_k = 40}}"], "model.extra.indexer.top_k=40 is at least seq_len=12"),
    (["model.window=11"], None),
    (["model.window=12"], "model.window=12 is at least seq_len=12"),
])
def test_an_indexer_or_window_budget_at_T_says_it_is_full_attention_and_runs_once(sets, warned):
  import warnings
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    sweep = config_lib.loads(TINY, "t", ['model.positional="rope"', "model.rope_dim=4", *sets])
  assert len(sweep.trials) == 1  # refused by nothing: the one trial runs, as configured
  full = [str(w.message) for w in caught if issubclass(w.category, config_lib.FullSelectionWarning)]
  assert full == ([] if warned is None else
                  [f"{warned}: every query attends to every key it sees (full attention, no selection)"])
