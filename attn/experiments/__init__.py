"""Experiments: tasks (data), training (optax), sweeps (config -> trials -> store), reports."""
