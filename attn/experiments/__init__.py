"""Experiments: tasks (data), training (optax), checkpoints (orbax), sweeps (config -> trials -> store), reports.

`load_trial(run_dir, trial_id, step=None) -> (model, model_config, task)` gives
back a trained model from its checkpoint (attn.experiments.checkpoints).
"""

from typing import Any

__all__ = ["load_trial"]


def __getattr__(name: str) -> Any:
  if name == "load_trial":  # lazy: jax, flax and orbax load only when asked for
    from attn.experiments.checkpoints import load_trial
    return load_trial
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
