"""Running: sweep configs into trials, the crash-safe store, leases, workers, Slurm, status, TensorBoard events.

Decides which trial runs where and records it. Imports attn's library and the
data and training stages; never the reading stage.
"""
