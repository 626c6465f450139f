"""load_trial: a trained trial of a sweep directory, back as (model, model_config, task)."""

from __future__ import annotations

import os

import jax
from flax import nnx

from attn.config import invalid
from attn.experiments.data import tasks
from attn.experiments.running import store as store_lib
from attn.experiments.training import checkpoints, train
from attn.experiments.training.config import TrainConfig
from attn.nn import models
from attn.nn.config import ModelConfig


def load_trial(run_dir: str, trial_id: str, step: int | None = None):
  """(model, model_config, task) of a trial, restored from its final checkpoint or from `step`.

  step=None takes the newest checkpoint: the final one of a finished trial. The
  held-out batches that the summary's eval_loss averages are
  task.batch(seed, tasks.EVAL, j, batch_size) for j < eval_batches, with the
  train table of DIR/trials/ID/config.json.
  """
  header = store_lib.load_sweep(run_dir)
  known = [t["id"] for t in header["trials"]]
  if trial_id not in known:
    raise invalid("trial_id", trial_id, f"one of the {len(known)} trials of {run_dir}: {', '.join(known)}")
  trial_dir = os.path.join(run_dir, "trials", trial_id)
  directory = os.path.join(trial_dir, store_lib.CHECKPOINTS)
  have = checkpoints.steps(directory)
  if not have:
    if os.path.exists(os.path.join(trial_dir, store_lib.SUMMARY)):
      how = (f"it finished without one (trained before attn saved checkpoints, or failed before its "
             f"first); to train it again, remove {trial_dir} and run {store_lib.rerun_command(run_dir, header)}")
    else:
      how = f"it has not reached its first one; run {store_lib.rerun_command(run_dir, header)} to train it"
    raise invalid("trial_id", trial_id, f"a trial with a checkpoint: {directory} holds none, {how}")
  if step is None:
    step = have[-1]
  elif step not in have:
    raise invalid("step", step, f"one of the checkpointed steps of trial {trial_id}: {have}")
  cfg = store_lib.read_config(os.path.join(trial_dir, store_lib.CONFIG), store_lib.config_todo(run_dir, header))
  task = tasks.make_task(cfg["task"])
  model_cfg = ModelConfig(**cfg["model"])
  abstract = nnx.eval_shape(lambda: models.MODELS[task.kind](model_cfg, rngs=nnx.Rngs(0)))
  graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
  tx = train.optimizer(TrainConfig(**cfg["train"]))
  like = {"params": params, "opt_state": jax.eval_shape(tx.init, params), "rest": rest}
  try:
    state = checkpoints.restore(directory, step, like)
  except Exception as e:
    raise invalid("step", step, f"a readable checkpoint: {os.path.join(directory, str(step))} could not be "
                  f"read ({checkpoints.first_line(e)}); the others: {[s for s in have if s != step]}") from None
  return nnx.merge(graphdef, state["params"], state["rest"]), model_cfg, task
