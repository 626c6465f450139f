"""The experiment defaults start every task at a sane loss: step 1's cross-entropy near ln vocab (ln classes),
not tens of nats; the shipped configs keep their trials (tests/test_trial_ids.py checks their ids)."""

import math

import pytest
from flax import nnx

from attn.experiments.data import tasks
from attn.experiments.running import config as config_lib
from attn.experiments.training import train
from attn.nn import models

TASKS = {"mqar": 'name = "mqar"\nvocab_size = 64\nseq_len = 16\nnum_pairs = 4',
         "induction": 'name = "induction"\nvocab_size = 64\nseq_len = 16',
         "text": 'name = "text"\nseq_len = 16\npath = "CORPUS"',
         "marker_position": 'name = "marker_position"\nseq_len = 16',
         "after_marker": 'name = "after_marker"\nseq_len = 16'}


def _config(name, corpus, extra=""):
  return (f"[task]\n{TASKS[name].replace('CORPUS', str(corpus))}\n[model]\nd_model = 32\nnum_layers = 2\n"
          f"num_heads = 2\nd_ff = 32\n{extra}[train]\nsteps = 1\n")


# One language-model task in the fast tier (a model build compiles its initializers: about a second): text, whose
# 256-byte vocabulary is the largest ln n; the rest (mqar, induction: decoders with the same output head) slow.
@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n == "text" else pytest.mark.slow)
                                  for n in sorted(TASKS)])
def test_step_one_loss_is_near_ln_vocab_on_every_task(name, tmp_path):
  corpus = tmp_path / "c.txt"
  corpus.write_text("the quick brown fox jumps over the lazy dog; " * 200)
  (trial,) = config_lib.loads(_config(name, corpus), "c.toml").trials
  task = tasks.make_task(trial.config["task"])
  cfg = models.ModelConfig(**trial.config["model"])
  model = models.MODELS[task.kind](cfg, rngs=nnx.Rngs(0))
  # Compiled whole: op by op, each small op of the model compiles on its own.
  loss, _ = nnx.jit(lambda m, b: train._loss(m, b, task.kind))(model, task.batch(0, 0, 0, 32))
  n = cfg.vocab_size if task.kind == "decoder_lm" else cfg.num_classes
  # Unit-scale logits cost about half a nat over ln n; tied to N(0, 1) embeddings it was 40 nats.
  assert abs(float(loss) - math.log(n)) < 0.75, (name, float(loss), math.log(n))


def test_the_defaults_untie_a_language_models_head_and_a_tied_one_starts_small():
  resolved = lambda name, extra="": config_lib.loads(_config(name, "x.txt", extra), "c.toml").trials[0].config["model"]
  assert (resolved("mqar")["tie_embeddings"], resolved("mqar")["embed_init_std"]) == (False, 1.0)
  tied = resolved("mqar", "tie_embeddings = true\n")
  assert (tied["tie_embeddings"], tied["embed_init_std"]) == (True, 0.02)
  assert resolved("mqar", "tie_embeddings = true\nembed_init_std = 0.5\n")["embed_init_std"] == 0.5  # chosen: kept
  # A classifier has no output head to tie: its key keeps the old default, so its trial ids stay.
  assert (resolved("after_marker")["tie_embeddings"], resolved("after_marker")["embed_init_std"]) == (True, 1.0)


def test_the_sweep_says_it_is_building_the_first_model_before_the_silent_build(tmp_path, monkeypatch):
  import io

  from attn.experiments.running import sweep
  from conftest import TINY_MQAR
  seen = []

  def stub(configs, **kwargs):  # what was printed when the model would be built
    seen.append(log.getvalue())
    return [{"status": "failed", "reason": "stub"} for _ in configs]
  monkeypatch.setattr(train, "train_group", stub)
  log = io.StringIO()
  sweep.run_sweep(config_lib.loads(TINY_MQAR + "[train]\nsteps = 1\n[sweep]\nseeds = [0, 1]\n", "c.toml"),
                  str(tmp_path / "out"), stream=log)
  assert len(seen) == 2 and "building its model and compiling its step" in seen[0]
  assert log.getvalue().count("building its model") == 1  # once, before the first build only
