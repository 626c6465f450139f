"""ModelConfig.impl: every attention call of a model runs the named implementation; refusals and trial ids."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attn.config import ConfigError
from attn.experiments.running import config as config_lib
from attn.kernel import impls
from attn.nn.config import ModelConfig
from attn.nn.models import DecoderLM, EncoderDecoder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = dict(vocab_size=11, d_model=12, num_layers=2, num_heads=3, d_ff=16, max_len=9)


def counting(monkeypatch, name):
  """Replaces IMPLEMENTATIONS[name] by the same record whose run counts its calls."""
  seen = []
  record = impls.IMPLEMENTATIONS[name]

  def run(call):
    seen.append(call.T)
    return record.run(call)
  monkeypatch.setitem(impls.IMPLEMENTATIONS, name, dataclasses.replace(record, run=run))
  return seen


def test_impl_reaches_every_attention_call(monkeypatch):
  """Traced only (jax.eval_shape, the model built inside it: nothing initialised or compiled): each layer's
  self-attention, and a decoder's cross-attention."""
  seen = counting(monkeypatch, "xla")
  tokens = np.random.default_rng(0).integers(0, 11, (2, 7)).astype(np.int32)
  jax.eval_shape(lambda t: DecoderLM(ModelConfig(**TINY, impl="xla"), rngs=nnx.Rngs(0))(t), tokens)
  assert seen == [7] * TINY["num_layers"]
  del seen[:]
  jax.eval_shape(lambda t: DecoderLM(ModelConfig(**TINY), rngs=nnx.Rngs(0))(t), tokens)
  assert seen == []  # "auto" on CPU never picks xla
  seq2seq = lambda: EncoderDecoder(ModelConfig(**TINY, num_decoder_layers=1, impl="xla"), rngs=nnx.Rngs(0))
  jax.eval_shape(lambda s, t: seq2seq()(s, t), tokens, tokens[:, :5])
  assert sorted(seen) == [5, 5, 7, 7]  # two encoder layers (T=7), the decoder's self and cross (T=5)


def test_a_bad_impl_is_refused_by_name_with_the_available_ones():
  with pytest.raises(ConfigError, match=r"impl='flash' is not allowed.*one of.*available on this "
                                        r"machine: \['auto', 'einsum'"):
    ModelConfig(**TINY, impl="flash")


def test_an_impl_that_does_not_run_here_is_refused_when_the_model_is_built(monkeypatch):
  monkeypatch.setattr(impls, "backend", lambda: "cpu")
  cfg = ModelConfig(**TINY, impl="cudnn")  # a name a GPU run may use: the config itself is fine
  with pytest.raises(ConfigError, match=r"impl='cudnn'.*GPU backend only.*available: \['auto'"):
    nnx.eval_shape(lambda: DecoderLM(cfg, rngs=nnx.Rngs(0)))  # built abstractly: no initialiser compiled


def test_impl_enters_the_trial_id_only_away_from_auto():
  path = os.path.join(ROOT, "configs", "quick.toml")
  ids = {o: [t.id for t in config_lib.load(path, o).trials]
         for o in ((), ("model.impl=auto",), ("model.impl=einsum",))}
  assert ids[()] == ids[("model.impl=auto",)]
  assert not set(ids[()]) & set(ids[("model.impl=einsum",)])
  trial = config_lib.load(path, ["model.impl=blocked"]).trials[0]
  assert trial.config["model"]["impl"] == "blocked"


@pytest.mark.slow  # a real training step: about 2 s
def test_a_trial_summary_names_what_its_attention_ran():
  from attn.experiments.training import train
  for impl, want in (("auto", {"einsum"}),):  # on CPU at T = 12 "auto" resolves to the einsum kernel
    cfg = config_lib.resolve({"task": {"name": "mqar", "vocab_size": 16, "seq_len": 12, "num_pairs": 2},
                              "model": {"d_model": 16, "num_layers": 1, "num_heads": 2, "d_ff": 16,
                                        "impl": impl},
                              "train": {"steps": 1, "batch_size": 2, "eval_batches": 1}}, [], None)
    (summary,) = train.train_group([cfg], lambda i, r: None)
    assert set(summary["attention_impls"]) == want and all(summary["attention_impls"].values())


def test_the_run_record_names_the_backend_and_auto_s_order(monkeypatch):
  from attn.experiments.running import run_record
  assert run_record.start_line()["allocator"]  # the host allocator in force, named
  here = run_record.start_line()["kernel"]
  assert here["backend"] == jax.default_backend() and here["auto_order"][-1] == "einsum"
  monkeypatch.setattr(impls, "backend", lambda: "tpu")
  line = run_record.start_line()
  assert line["kernel"]["auto_order"][0] == "splash" and "splash" in line["kernel"]["impls_for_backend"]
  assert "(tpu backend)" in run_record.describe(line)


def test_a_sweep_whose_impl_does_not_run_here_is_refused_before_any_training(monkeypatch):
  monkeypatch.setattr(impls, "backend", lambda: "cpu")
  sweep = config_lib.load(os.path.join(ROOT, "configs", "quick.toml"), ["model.impl=cudnn"])
  with pytest.raises(ConfigError, match=r"model.impl='cudnn'.*GPU backend only"):
    config_lib.check_devices(sweep.trials, sweep.vmap_seeds)
