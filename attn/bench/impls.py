"""The fused layer with each named attention core (`attn bench --impls`), and torch SDPA pinned to a backend."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from attn import kernel
from attn.bench import peers as peers_lib
from attn.bench.shapes import Shape
from attn.config import ConfigError


def impl_cases(shape: Shape, dtype, dtype_name: str, impls: list[str],
                peers: bool) -> tuple[dict[str, Any], dict[str, str], dict[str, str]]:
  """The fused layer with each named core (is_causal, not a dense mask), "auto"'s pick, and torch
  SDPA pinned to its flash and cuDNN backends: (cases, skipped with the reason, picks)."""
  cases, skipped, picks = {}, {}, {}
  for impl in impls:
    name = f"fused[{impl}]"
    try:
      kernel.check_impl(impl, jnp.dtype(dtype))
      with kernel.record_picks() as seen:
        cases[name] = peers_lib.fused_case(shape.cfg, shape.B, shape.T, dtype, impl=impl,
                                           is_causal=shape.causal)
      picks[name] = ",".join(seen)
    except ConfigError as e:
      skipped[name] = f"refused: {e}"
    except Exception as e:  # a kernel failing to compile here: said, and the other rows still run
      skipped[name] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
  if peers:
    for backend in ("flash", "cudnn"):
      c = peers_lib.torch_sdpa_case(shape.cfg, shape.B, shape.T, dtype_name, shape.causal, backend)
      if c is None:
        skipped[f"torch_sdpa_{backend}"] = "torch is not installed, or K != V or G != H"
      elif "skip" in c:
        skipped[f"torch_sdpa_{backend}"] = c["skip"]
      else:
        cases[f"torch_sdpa_{backend}"] = c
  return cases, skipped, picks
