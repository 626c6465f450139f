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

The collectives are counted from the compiled step's HLO (all-reduce,
all-gather, reduce-scatter, collective-permute, all-to-all: how many, and the
bytes of their results per device). `on_paper` turns FLOPs and those bytes
into an expected step time on GPUs: FLOPs / (devices · peak · utilisation)
plus bytes / link bandwidth, with the assumptions printed beside it; no GPU
was measured.
"""

from __future__ import annotations

import argparse
import math
import platform
import re
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
          "heads 4, per_head": ["train.mesh.heads=4", "model.variant=per_head"],
          # 8 devices (--xla_force_host_platform_device_count=8): the programs 8 GPUs would run
          "data 8": ["train.mesh.data=8"], "heads 8": ["train.mesh.heads=8"],
          "data 4 × heads 2": ["train.mesh.data=4", "train.mesh.heads=2"]}


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


COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1, "f64": 8, "s64": 8}
# One instruction a line: "%name = RESULT_TYPE op(...)"; a tuple type may hold /*index=N*/ comments.
_OP = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s+(" + "|".join(COLLECTIVES) + r")(-start)?\(",
                 re.M)
_SHAPE = re.compile(r"([a-z]+[0-9]*)\[([0-9,]*)\]")


def collectives(hlo: str) -> dict[str, float]:
  """Collective ops in a compiled program's HLO text: their count and result bytes per device."""
  count, nbytes = 0, 0
  for m in _OP.finditer(hlo):
    count += 1
    for dtype, dims in _SHAPE.findall(m.group(1)):
      nbytes += _BYTES.get(dtype, 4) * math.prod(int(d) for d in dims.split(",") if d)
  return {"collectives": count, "collective_mb": nbytes / 1e6}


def on_paper(flops: float, collective_mb: float, devices: int, peak_tflops: float = 312.0,
             utilisation: float = 0.4, link_gb_s: float = 300.0) -> float:
  """Expected ms per step on `devices` GPUs: compute at utilisation·peak, plus collective bytes over one link."""
  return 1e3 * (flops / (devices * peak_tflops * 1e12 * utilisation) + collective_mb * 1e6 / (link_gb_s * 1e9))


def measure(sets: list[str], steps: int) -> dict[str, float]:
  """Median step time (ms) and one device's argument / temporary bytes (MB) of the trial with `sets`."""
  from attn.experiments.running import config as config_lib
  from attn.experiments.training import train
  (trial,) = config_lib.loads(CONFIG, "bench_mesh", [f"train.steps={steps}"] + sets).trials
  memory = {}
  t0 = time.perf_counter()
  (summary,) = train.train_group([trial.config], on_row=lambda j, r: None,
                                 on_compiled=lambda step, _: memory.update(
                                     m=step.memory_analysis(), hlo=step.as_text()))
  m = memory["m"]
  from attn import count
  from attn.nn.config import ModelConfig
  from attn.variants.base import core_flops
  cfg = ModelConfig(**trial.config["model"])
  B, T = trial.config["train"]["batch_size"], trial.config["task"]["seq_len"]
  # 6 FLOPs per weight per token (forward 2, backward 4; Kaplan et al. 2020), plus the attention
  # core's T×T products, 3 × forward.
  flops = 6 * count.model_param_count(cfg, "decoder_lm") * B * T
  flops += 3 * cfg.num_layers * B * core_flops(cfg.head, T, T)
  comm = collectives(memory["hlo"])
  mesh = trial.config["train"].get("mesh") or {}
  devices = max(1, (mesh.get("data") or 1) * (mesh.get("heads") or 1))
  return {"step_ms": 1e3 * summary["step_time_s_median"], "compile_s": summary["compile_s"],
          "args_mb": m.argument_size_in_bytes / 1e6, "temp_mb": m.temp_size_in_bytes / 1e6,
          "total_mb": (m.argument_size_in_bytes + m.temp_size_in_bytes) / 1e6,
          "eval_loss": summary["final"]["eval_loss"], "wall_s": time.perf_counter() - t0,
          "gflops": flops / 1e9, **comm, "devices": devices,
          "gpu_ms": on_paper(flops, comm["collective_mb"], devices)}


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=30)
  parser.add_argument("--meshes", nargs="*", default=list(MESHES), help=f"of {list(MESHES)}")
  args = parser.parse_args(argv)
  devices = jax.local_devices()
  print(f"{len(devices)} {devices[0].platform} device(s) on {cpu_name()}; jax {jax.__version__}; "
        f"{args.steps} steps, median step time")
  print("| mesh | step (ms) | args / device (MB) | temporaries / device (MB) | total / device (MB) "
        "| final eval loss | collectives / step | collective MB / device | GFLOP / step | on paper, as many GPUs (ms) |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  for name in args.meshes:
    r = measure(MESHES[name], args.steps)
    print(f"| {name} | {r['step_ms']:.0f} | {r['args_mb']:.1f} | {r['temp_mb']:.1f} | {r['total_mb']:.1f} "
          f"| {r['eval_loss']:.4f} | {r['collectives']} | {r['collective_mb']:.1f} | {r['gflops']:.1f} "
          f"| {r['gpu_ms']:.3f} |", flush=True)
  print("\nOn paper: FLOPs / (the mesh's devices as GPUs · 312 TFLOP/s bf16 peak · 40% utilisation) "
        "+ the step's collective bytes per device over one 300 GB/s link (NVLink-class). "
        "Not measured on a GPU.")


if __name__ == "__main__":
  main()
