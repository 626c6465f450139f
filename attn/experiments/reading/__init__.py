"""Reading results: report.md and plots, `attn analyze` (inside the heads), `attn export` (TensorBoard), load_trial.

Reads a store, never trains a sweep. Imports attn's library and the data,
training and running stages.
"""
