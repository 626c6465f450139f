"""Experiments: sweep configs become trials, trials train into a store, the store is read back.

Four stages, each a subpackage that imports only the stages above it in this
list (and attn's library below all of them); the commands (attn/cli/) sit on top, and
`cli` and `reproduce_cli` here are their old import paths:

  data/      tasks and corpora, deterministic from a seed
  training/  [train] config, the optax train loop, Orbax checkpoints, devices, preemption
  running/   sweep configs -> trials, the store, leases, workers, Slurm, status, TensorBoard events
  reading/   reports, plots, `attn analyze`, `attn export`, load_trial

`load_trial(run_dir, trial_id, step=None) -> (model, model_config, task)` gives
back a trained model from its checkpoint (attn.experiments.reading.trials).
"""

from typing import Any

__all__ = ["load_trial"]


def __getattr__(name: str) -> Any:
  if name == "load_trial":  # lazy: jax, flax and orbax load only when asked for
    from attn.experiments.reading.trials import load_trial
    return load_trial
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
