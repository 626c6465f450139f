"""Reading results: report.md and plots, `attn analyze` (inside the heads), `attn export` (TensorBoard), load_trial,
and a pretrained model's held-out loss by its own objective (losses: `attn eval --hf`, `attn analyze --hf`).

Reads a store, never trains a sweep. Imports attn's library and the data,
training and running stages.
"""
