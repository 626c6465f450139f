"""Benchmarks: scripts that print measured ratios, never timed tests.

layer: every variant's layer against flax, jax and torch attention (`attn bench`);
peers: the peer implementations and peak-memory probe; decode: KV-cache decoding.
mesh: step time and per-device memory of one text model on meshes of local devices
(`python -m attn.bench.mesh`).
"""
