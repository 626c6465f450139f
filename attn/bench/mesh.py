"""Step time and per-device memory of one small text model trained on several meshes of local devices.

  XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m attn.bench.mesh [--steps 30]

The model: byte-level LM on the Python standard library's sources (task
"text", seq_len 128), d_model 256, 2 layers, 8 heads of d_k = d_v = 32,
d_ff 1024, fused, batch 32, float32. Each mesh trains it for --steps steps
through attn.experiments.training.train (the path `attn sweep` takes) and
reports the median step time and, from the compiled train step's
memory_analysis, what one device holds: arguments (parameters, Adam moments,
batch), temporaries (activations kept for the backward pass and workspace),
and their sum. On forced host devices every "device" is a thread pool on the
same CPU cores, so the times measure the cost of the partitioned program and
its collectives on this machine, not a speed-up; the memory is what each
device of a real mesh would hold.
"""

from __future__ import annotations

import argparse
import platform
import time

import jax

CONFIG = """
[task]
name = "text"
seq_len = 128

[model]
d_model = 256
num_layers = 2
num_heads = 8
d_ff = 1024
tie_embeddings = false
variant = "fused"

[train]
batch_size = 32
warmup_steps = 5
eval_every = 0
eval_batches = 1
"""
MESHES = {"1 device": [], "data 4": ["train.mesh.data=4"], "heads 4": ["train.mesh.heads=4"],
          "data 2 × heads 2": ["train.mesh.data=2", "train.mesh.heads=2"],
          "heads 4, per_head": ["train.mesh.heads=4", "model.variant=per_head"]}


def cpu_name() -> str:
  """The CPU's model name (lscpu's), or the platform's processor string."""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or "unknown CPU"


def measure(sets: list[str], steps: int) -> dict[str, float]:
  """Median step time (ms) and one device's argument / temporary bytes (MB) of the trial with `sets`."""
  from attn.experiments.running import config as config_lib
  from attn.experiments.training import train
  (trial,) = config_lib.loads(CONFIG, "bench_mesh", [f"train.steps={steps}"] + sets).trials
  memory = {}
  t0 = time.perf_counter()
  (summary,) = train.train_group([trial.config], on_row=lambda j, r: None,
                                 on_compiled=lambda step, _: memory.update(m=step.memory_analysis()))
  m = memory["m"]
  return {"step_ms": 1e3 * summary["step_time_s_median"], "compile_s": summary["compile_s"],
          "args_mb": m.argument_size_in_bytes / 1e6, "temp_mb": m.temp_size_in_bytes / 1e6,
          "total_mb": (m.argument_size_in_bytes + m.temp_size_in_bytes) / 1e6,
          "eval_loss": summary["final"]["eval_loss"], "wall_s": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=30)
  parser.add_argument("--meshes", nargs="*", default=list(MESHES), help=f"of {list(MESHES)}")
  args = parser.parse_args(argv)
  devices = jax.local_devices()
  print(f"{len(devices)} {devices[0].platform} device(s) on {cpu_name()}; jax {jax.__version__}; "
        f"{args.steps} steps, median step time")
  print("| mesh | step (ms) | args / device (MB) | temporaries / device (MB) | total / device (MB) | final eval loss |")
  print("|---|---|---|---|---|---|")
  for name in args.meshes:
    r = measure(MESHES[name], args.steps)
    print(f"| {name} | {r['step_ms']:.0f} | {r['args_mb']:.1f} | {r['temp_mb']:.1f} | {r['total_mb']:.1f} "
          f"| {r['eval_loss']:.4f} |", flush=True)


if __name__ == "__main__":
  main()
