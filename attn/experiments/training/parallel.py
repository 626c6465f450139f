"""Data parallel: one trial's batch, or its vmapped seeds, sharded over local devices with jax.sharding.

train.data_parallel = N runs each compiled train step and evaluation on the
first N of jax.local_devices(), as one program over a 1-D `Mesh` (axis
"devices") with `NamedSharding`s; no pmap. "auto" takes every local device.
train.data_parallel_axis says what is split:

  "batch"  each train and eval batch along B; parameters and optimiser state
           are replicated and XLA all-reduces the gradients. B must be a
           multiple of the device count.
  "seed"   the seed axis of seeds stacked under jax.vmap (sweep.vmap_seeds):
           each device holds and trains whole seeds, one or more per device;
           nothing crosses devices but the metrics. A group of n seeds runs on
           the largest divisor of n that is at most N devices (the config
           refuses an N that does not divide the sweep's groups; a smaller
           group, e.g. the unfinished seeds of a resumed sweep, takes fewer).

With one device nothing is placed or sharded: the program is the one attn
ran before data parallel existed, bit for bit. Across device counts a batch
split changes the order of the loss and gradient sums, so rows agree to float
tolerance, not bitwise. Checkpoints hold host arrays and do not depend on the
layout: a trial saved on N devices resumes on any other count.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from attn.config import invalid
from attn.experiments.training.config import TrainConfig

AXIS = "devices"  # the mesh's one axis
KINDS = ("state", "train", "eval", "replicated")


def _largest_divisor(n: int, at_most: int) -> int:
  return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


def device_count(train: TrainConfig, group_size: int, batched: bool) -> int:
  """Local devices one program of `group_size` seeds runs on; a ConfigError for what cannot run here."""
  if train.data_parallel == 1:
    return 1
  devices = jax.local_devices()
  available, kind = len(devices), devices[0].platform
  want = available if train.data_parallel == "auto" else train.data_parallel
  if want > available:
    raise invalid("train.data_parallel", train.data_parallel,
                  f'at most the {available} local {kind} device(s) present, or "auto"')
  if train.data_parallel_axis == "seed":
    return _largest_divisor(group_size, want) if batched else 1
  B = train.batch_size
  if B % want:
    raise invalid("train.data_parallel", train.data_parallel,
                  f"a device count dividing train.batch_size={B}; \"auto\" takes all {available} local "
                  f"{kind} devices, which leave {B % want} of {B} rows over: set train.data_parallel to "
                  f"one of {[d for d in range(1, available + 1) if B % d == 0]}")
  return want


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where the arrays of one compiled program live: `devices` local devices, split along `axis`."""

  devices: int = 1
  axis: str = "batch"
  batched: bool = False  # a vmapped seed axis leads every state and batch array

  @functools.cached_property
  def mesh(self) -> Mesh:
    return Mesh(np.asarray(jax.local_devices()[:self.devices]), (AXIS,))

  def sharding(self, kind: str) -> NamedSharding:
    """One sharding for every leaf of a `kind` tree: state, train / eval batches, or replicated."""
    if kind not in KINDS:
      raise invalid("kind", kind, f"one of {KINDS}")
    if kind == "replicated" or (kind == "state" and self.axis == "batch"):
      return NamedSharding(self.mesh, PartitionSpec())
    if self.axis == "seed":
      return NamedSharding(self.mesh, PartitionSpec(AXIS))
    # B follows the seed axis (if stacked) and, in eval data, the axis of eval batches.
    lead = int(self.batched) + int(kind == "eval")
    return NamedSharding(self.mesh, PartitionSpec(*[None] * lead, AXIS))

  def put(self, tree: Any, kind: str) -> Any:
    """tree placed as `kind` on the mesh; unchanged on one device."""
    return tree if self.devices == 1 else jax.device_put(tree, self.sharding(kind))

  def jit(self, fn: Callable, in_kinds: Sequence[str], out_kinds: str | Sequence[str],
          donate: tuple[int, ...] = ()) -> Any:
    """jax.jit of fn with the shardings of in_kinds / out_kinds (none on one device)."""
    if self.devices == 1:
      return jax.jit(fn, donate_argnums=donate)
    out = self.sharding(out_kinds) if isinstance(out_kinds, str) else tuple(map(self.sharding, out_kinds))
    return jax.jit(fn, in_shardings=tuple(map(self.sharding, in_kinds)), out_shardings=out,
                   donate_argnums=donate)

  def summary(self) -> dict[str, Any]:
    """What a trial's summary records of how it was run."""
    return {"data_parallel_devices": self.devices, "data_parallel_axis": self.axis}


def layout(train: TrainConfig, group_size: int, batched: bool) -> Layout:
  """The layout of a group of `group_size` seeds (stacked under vmap when batched); refuses before tracing."""
  return Layout(device_count(train, group_size, batched), train.data_parallel_axis, batched)
