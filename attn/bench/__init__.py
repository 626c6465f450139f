"""Benchmarks: scripts that print measured ratios, never timed tests (`attn bench`: attn/cli/bench.py).

layer: one shape's variants against flax, jax and torch attention, and the shapes a run asks for;
its parts: shapes (the benchmarked layers and families), machine (the machine's facts), timing
(round-robin), long (the long family's cores), linear (the fixed-state heads), impls (--impls),
throughput (--sweep; its trial in configs/bench_layer.toml), tables (the Markdown).
peers: the peer implementations and peak-memory probe; decode: KV-cache decoding; steps: the
default sweep's step times; account: every dot per XLA flag set (flags: those sets).
mesh: step time and per-device memory of one text model on meshes of local devices
(`python -m attn.bench.mesh`).
"""
