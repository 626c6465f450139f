"""Mixed precision (model.dtype, model.param_dtype): refusals, trial ids, dtypes kept, a bfloat16 text trial.

The tracking test trains the same tiny byte-level model on this repository's
sources twice, float32 and with dtype = "bfloat16" (compute) over float32
parameters, and compares held-out losses at every evaluation. Measured over 30
steps (loss from 6.2 to 3.6 nats): at most 0.0015 nats apart; the tolerance is
0.03 nats, about 1% of the loss, which a bfloat16 slip anywhere in the softmax or
the optimiser (8 bits of mantissa) would exceed.
"""

import os
import shutil

import numpy as np
import pytest

from attn.config import ConfigError
from attn.experiments.data import corpus
from attn.experiments.running import config as config_lib
from attn.experiments.training import checkpoints, train
from attn.nn import models
from attn.nn.config import ModelConfig
from conftest import TINY_MQAR

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = f"""
[task]
name = "text"
path = "{REPO}/attn"
glob = "**/*.py"
seq_len = 32

[model]
d_model = 32
num_layers = 2
num_heads = 4
d_ff = 64
tie_embeddings = false

[train]
steps = 30
batch_size = 16
warmup_steps = 5
eval_every = 10
eval_batches = 2
"""
MQAR = TINY_MQAR + """
[train]
steps = 4
batch_size = 4
warmup_steps = 1
eval_every = 2
eval_batches = 1
"""
TRACK_NATS = 0.03


@pytest.fixture(autouse=True)
def _caches(tmp_path_factory, monkeypatch):
  monkeypatch.setenv("ATTN_TEXT_CACHE", str(tmp_path_factory.getbasetemp() / "text_cache"))
  monkeypatch.setattr(corpus, "_MEMO", {})


def _trial(text, *sets):
  (trial,) = config_lib.loads(text, "p.toml", list(sets)).trials
  return trial


def _train(trial, dirs=None):
  rows = []
  summary, = train.train_group([trial.config], on_row=lambda j, r: rows.append(r), checkpoint_dirs=dirs)
  return rows, summary


@pytest.mark.parametrize("field", ["dtype", "param_dtype"])
@pytest.mark.parametrize("value", ["float16", "fp32", 32, None])
def test_a_dtype_is_float32_or_bfloat16_by_name(field, value):
  with pytest.raises(ConfigError) as e:
    ModelConfig(vocab_size=8, d_model=8, num_layers=1, num_heads=2, d_ff=8, **{field: value})
  assert str(e.value) == f"{field}={value!r} is not allowed: one of ['float32', 'bfloat16']"
  with pytest.raises(ConfigError, match=rf"model.{field}='float16' is not allowed: one of \['float32', 'bfloat16'\]"):
    config_lib.loads(MQAR, "p.toml", [f"model.{field}=float16"])


def test_float32_is_the_default_and_leaves_trial_ids_alone():
  plain = _trial(MQAR)
  assert (plain.config["model"]["dtype"], plain.config["model"]["param_dtype"]) == ("float32", "float32")
  assert _trial(MQAR, "model.dtype=float32", "model.param_dtype=float32").id == plain.id
  ids = {_trial(MQAR, "model.dtype=bfloat16").id, _trial(MQAR, "model.param_dtype=bfloat16").id}
  assert len(ids) == 2 and plain.id not in ids


def _stored_dtypes(directory, step):
  """{(top-level key, dtype)} of the float leaves of a checkpoint, from its index."""
  meta = checkpoints._checkpointer().metadata(os.path.join(directory, str(step)))
  return {(path.split("]")[0] + "]", dtype) for path, _, dtype in meta.custom_metadata["leaves"]
          if "float" in dtype}


@pytest.mark.slow  # end to end, trained twice: the fast tier's time limit
def test_bfloat16_parameters_optimiser_state_and_checkpoints_stay_bfloat16(tmp_path):
  param_dtype = "bfloat16"
  trial = _trial(MQAR, "model.dtype=bfloat16", f"model.param_dtype={param_dtype}")
  rows, summary = _train(trial, [str(tmp_path / "a")])
  assert summary["status"] == "ok" and all(np.isfinite(r["loss"]) for r in rows)
  # Every float leaf of the parameters and of Adam's moments is param_dtype, compute dtype or not.
  assert checkpoints.steps(str(tmp_path / "a")) == [2, 4]
  assert _stored_dtypes(str(tmp_path / "a"), 4) == {("['params']", param_dtype), ("['opt_state']", param_dtype)}
  # Resumed from step 2, it computes the rows of the uninterrupted run bit for bit.
  shutil.rmtree(tmp_path / "a" / "4")
  resumed, summary = _train(trial, [str(tmp_path / "a")])
  assert summary["resumed_from"] == 2
  strip = lambda rs: [{k: v for k, v in r.items() if k != "step_time_s"} for r in rs]
  assert strip(resumed) == strip(rows[2:])


@pytest.mark.slow  # end to end, seconds: the slow tier runs it
def test_a_bfloat16_text_trial_tracks_the_float32_held_out_loss(tmp_path):
  ref, _ = _train(_trial(TEXT))
  mixed, _ = _train(_trial(TEXT, "model.dtype=bfloat16"), [str(tmp_path)])
  # Computing in bfloat16 keeps float32 master weights and optimiser state.
  assert _stored_dtypes(str(tmp_path), 30) == {("['params']", "float32"), ("['opt_state']", "float32")}
  ref_eval = [(r["step"], r["eval_loss"]) for r in ref if "eval_loss" in r]
  mixed_eval = [(r["step"], r["eval_loss"]) for r in mixed if "eval_loss" in r]
  assert [s for s, _ in ref_eval] == [s for s, _ in mixed_eval] == [9, 19, 29]
  assert ref_eval[-1][1] < ref_eval[0][1] - 0.5  # it learns: the comparison is not between two flat curves
  gaps = [abs(a - b) for (_, a), (_, b) in zip(ref_eval, mixed_eval)]
  assert max(gaps) < TRACK_NATS, gaps
  assert gaps != [0.0] * len(gaps)  # bfloat16 really computed something else
