"""`attn bench`'s shapes: one benchmarked layer each (Shape), the families they form, and names read from flags.

reference, causal and small time every variant against the peers; long-* time attention cores
behind the same projections (attn.bench.long), linear-* the fixed-state heads against the blocked
softmax kernel (attn.bench.linear); wide-4096-causal is issue 44's accelerator goal.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from attn.config import HeadConfig, invalid

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class Shape:
  """One benchmarked layer: batch, length, width, heads, head widths and a causal mask or none."""

  B: int
  T: int
  D: int
  H: int
  K: int
  causal: bool = False
  long: bool = False  # attention cores behind the fused projections (module docstring)
  linear: bool = False  # the fixed-state heads against the blocked softmax kernel (module docstring)

  @property
  def cfg(self) -> HeadConfig:
    return HeadConfig(d_model=self.D, num_heads=self.H, d_k=self.K, d_v=self.K)


SHAPES = {
    "reference": Shape(B=8, T=256, D=512, H=8, K=64),
    "causal": Shape(B=8, T=256, D=512, H=8, K=64, causal=True),
    "small": Shape(B=32, T=64, D=64, H=4, K=16),  # the experiment runner's default model
}
LONG_LENGTHS = (1024, 4096, 16384)
LONG_WINDOW = 256  # the sliding window of the long family's core_window row
# The key selections the long causal shapes time as cores (attn.variants.selection, nsa): ~2048 keys a
# query, the earlier measurement's MoBA and indexer, and NSA at the paper's sizes. Goal (issue 42):
# a selection's core at most SELECTION_GOAL × full causal at T = 16384.
SELECTIONS = {"moba": {"block": 512, "top_k": 4}, "indexer": {"heads": 4, "head_dim": 32, "top_k": 2048},
              "nsa": {"compress_block": 32, "compress_stride": 16, "select_block": 64, "select_count": 16,
                      "window": 512}}
SELECTION_GOAL = 0.2
# Selections whose choice of keys runs apart from their attention (NSA's choice is inside its branches):
# the bench also times the choice alone, which the goal reports beside the core, not in it.
SELECTORS_ALONE = ("moba", "indexer")
for _T in LONG_LENGTHS:
  for _causal in (False, True):
    SHAPES[f"long-{_T}{'-causal' if _causal else ''}"] = Shape(
        B=1, T=_T, D=512, H=8, K=64, causal=_causal, long=True)
LINEAR_LENGTHS = (1024, 2048, 4096, 8192, 16384)
for _T in LINEAR_LENGTHS:
  SHAPES[f"linear-{_T}"] = Shape(B=1, T=_T, D=512, H=8, K=64, causal=True, linear=True)
GROUPS = {"long": tuple(n for n in SHAPES if n.startswith("long-")),
          "linear": tuple(n for n in SHAPES if n.startswith("linear-"))}
# issue 44's accelerator goal: T = 4096, causal, 16 heads of 128 (run in bfloat16 on a GPU).
SHAPES["wide-4096-causal"] = Shape(B=1, T=4096, D=2048, H=16, K=128, causal=True, long=True)
DEFAULT_SHAPES = ("reference", "causal", "small")
QUICK_SHAPES = ("reference", "small")


def names(text: str | None, known, field: str, default, groups=None) -> list[str]:
  """The comma-separated names of a flag (a group stands for its members), each known, in order, once."""
  groups = groups or {}
  if text is None:
    return list(default)
  names = []
  for n in (n.strip() for n in text.split(",") if n.strip()):
    if n not in known and n not in groups:
      raise invalid(field, n, f"comma-separated names from {sorted([*known, *groups])}")
    names.extend(groups.get(n, (n,)))
  if not names:
    raise invalid(field, text, "at least one name")
  return list(dict.fromkeys(names))
