"""Training: [train]'s TrainConfig, the jitted optax loop, Orbax checkpoints, devices, preemption.

Trains one trial (or seeds under vmap) and writes its rows through callbacks;
knows nothing of sweeps or stores. Imports attn's library and the data stage.
"""
