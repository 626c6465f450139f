"""The machine a benchmark ran on: CPU model and kind, cores, device, library versions, load, flags."""

from __future__ import annotations

import os
import platform
from typing import Any

import jax

from attn import kernel, process
from attn.bench import peers as peers_lib
from attn.kernel import onednn


def cpu_kind() -> tuple[str, str]:
  """(model name, kind): the kind adds the family and the widest vector ISA from /proc/cpuinfo.

  Cloud guests name both a Zen 3 and a Zen 5 "AMD EPYC"; their step times differ by more than the
  stored ratios' tolerance, so stored ratios are kept per kind ("AMD EPYC, family 25, AVX2").
  """
  model, fields = platform.processor() or platform.machine(), {}
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if not line.strip():
          break  # the first processor is enough
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
  except OSError:
    pass
  model = fields.get("model name", model)
  flags = set(fields.get("flags", "").split())
  isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else None
  kind = ", ".join(x for x in (model, fields.get("cpu family") and f"family {fields['cpu family']}", isa) if x)
  return model, kind


def machine_info() -> dict[str, Any]:
  """CPU model and kind, cores, device and library versions, for the JSON and the header."""
  model, kind = cpu_kind()
  dev = jax.devices()[0]
  versions = {"python": platform.python_version(), "jax": jax.__version__}
  for lib in ("jaxlib", "flax", "numpy", "torch"):
    try:
      versions[lib] = __import__(lib).__version__
    except ImportError:
      versions[lib] = None
  return {"cpu": model, "cpu_kind": kind, "cores": os.cpu_count(), "threads": _threads(),
          "platform": platform.platform(), "device": f"{dev.platform}: {dev.device_kind}",
          "load_average": _load_average(),
          "versions": versions, "xla_flags": os.environ.get("XLA_FLAGS", ""),
          "host_malloc": process.in_force(), "backend": jax.default_backend(),
          "auto_order": list(kernel.AUTO.get(jax.default_backend(), kernel.AUTO["cpu"])),
          "onednn": onednn.why_not() or "available"}  # impl="onednn", or why it does not run here


def _threads() -> int:
  """Threads XLA and torch may use here."""
  return peers_lib.threads()


def _load_average() -> list[float] | None:
  """1, 5 and 15 minute load averages: how busy the machine was."""
  try:
    return [round(x, 2) for x in os.getloadavg()]
  except OSError:
    return None
