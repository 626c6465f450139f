"""One mesh per trial's program: local devices as a ("data", "heads") grid, arrays placed with NamedSharding.

train.mesh = {data = N, heads = M} runs each compiled train step and
evaluation on the first N·M of jax.local_devices(), as one program over a
`Mesh` of shape (N, M) with axes ("data", "heads"); no pmap.
train.data_parallel = N is the mesh {data = N, heads = 1}, and "auto" (for
either) takes every local device, divided by M. Along "data",
train.data_parallel_axis says what is split:

  "batch"  each train and eval batch along B (B must be a multiple of N, and
           with train.grad_accum = k each micro-batch too: B/k of N); the
           gradients are all-reduced.
  "seed"   the seed axis of seeds stacked under jax.vmap (sweep.vmap_seeds):
           each device row holds and trains whole seeds, one or more per row.
           A group of n seeds runs on the largest divisor of n that is at most
           N rows (the config refuses an N that does not divide the sweep's
           groups; a smaller group, e.g. the unfinished seeds of a resumed
           sweep, takes fewer).

Along "heads" the attention layers are split by heads (tensor parallelism as
in Megatron-LM): each variant's parameters, and with them their Adam moments,
shard as attn.nn.sharding declares (query heads split; kv heads split when M
divides G, else replicated; W^O by its input rows; shared arrays replicated),
everything else is replicated, and the batch is replicated over "heads". XLA
inserts the collectives the shardings imply, among them the all-reduce after
each output projection. M must divide the model's num_heads. A device's
coordinates are (i, j) = divmod(index, M): the M devices of one row, which
exchange activations in every layer, are adjacent in jax.local_devices().

With one device nothing is placed or sharded: the program is the one attn
ran before meshes existed, bit for bit. Otherwise rows agree with it to float
tolerance (sums run in another order). Checkpoints hold host arrays and do not
depend on the layout: a trial saved on one mesh resumes on any other.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from attn.config import invalid
from attn.experiments.training.config import TrainConfig, check_heads
from attn.nn import sharding as sharding_lib

AXES = ("data", "heads")  # the mesh's axes
STATE_KINDS = ("params", "opt_state", "rest")
KINDS = STATE_KINDS + ("state", "train", "eval", "replicated")


def _largest_divisor(n: int, at_most: int) -> int:
  return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


def _is_spec(x: Any) -> bool:
  return isinstance(x, PartitionSpec)


def mesh_shape(train: TrainConfig, group_size: int, batched: bool) -> tuple[int, int]:
  """(N, M): devices along "data" and "heads" for `group_size` seeds; a ConfigError for what cannot run here."""
  N, M = train.data_parallel, train.mesh["heads"]
  if N == 1 and M == 1:
    return 1, 1
  devices = jax.local_devices()
  available, kind = len(devices), devices[0].platform
  want = available // M if N == "auto" else N
  if want * M > available or want < 1:
    if M == 1:
      raise invalid("train.data_parallel", N, f'at most the {available} local {kind} device(s) present, or "auto"')
    raise invalid("train.mesh", dict(train.mesh),
                  f"at most the {available} local {kind} device(s) present: data × heads = "
                  f"{'auto' if N == 'auto' else N} × {M} = {want * M if want else M} devices")
  if train.data_parallel_axis == "seed":
    return (_largest_divisor(group_size, want) if batched else 1), M
  B, k = train.batch_size, train.grad_accum
  if B % want or (B // k) % want:
    rows = "rows" if k == 1 else f"rows in each of {k} micro-batches (train.grad_accum)"
    raise invalid("train.data_parallel", N,
                  f"a device count dividing train.batch_size={B}; \"auto\" takes {want} of the {available} "
                  f"local {kind} devices, which leave {(B // k) % want} of {B // k} {rows} over: set "
                  f"train.data_parallel to one of {[d for d in range(1, available // M + 1) if (B // k) % d == 0]}")
  return want, M


def device_count(train: TrainConfig, group_size: int, batched: bool) -> int:
  """Local devices one program of `group_size` seeds runs on (data × heads); refuses what cannot run here."""
  N, M = mesh_shape(train, group_size, batched)
  return N * M


@dataclasses.dataclass(frozen=True, eq=False)
class Layout:
  """Where the arrays of one compiled program live: a `data` × `heads` mesh, the batch or seeds split on data.

  specs: PartitionSpec trees of "params", "opt_state" and "rest" without the
  seed axis (with_state); None places every state leaf whole on each device.
  """

  data: int = 1
  heads: int = 1
  axis: str = "batch"
  batched: bool = False  # a vmapped seed axis leads every state and batch array
  specs: dict[str, Any] | None = None

  @property
  def devices(self) -> int:
    return self.data * self.heads

  @functools.cached_property
  def mesh(self) -> Mesh:
    grid = np.asarray(jax.local_devices()[:self.devices]).reshape(self.data, self.heads)
    return Mesh(grid, AXES)

  def with_state(self, model, params: Any, opt_state: Any, rest: Any,
                 tx: optax.GradientTransformation) -> Layout:
    """This layout with the shardings of a model's state: attention by attn.nn.sharding, the rest replicated.

    Adam's moments take their parameter's sharding; the step count and the
    non-parameter state are replicated.
    """
    if self.devices == 1:
      return self
    p = sharding_lib.model_specs(model, params, self.heads)
    o = optax.tree_map_params(tx, lambda _, spec: spec, opt_state, p,
                              transform_non_params=lambda _: PartitionSpec(), is_leaf=_is_spec)
    r = jax.tree.map(lambda _: PartitionSpec(), rest)
    return dataclasses.replace(self, specs={"params": p, "opt_state": o, "rest": r})

  def _named(self, *spec) -> NamedSharding:
    return NamedSharding(self.mesh, PartitionSpec(*spec))

  def sharding(self, kind: str) -> Any:
    """The sharding of a `kind` tree: one NamedSharding for every leaf, or a tree of them for a state kind."""
    if kind not in KINDS:
      raise invalid("kind", kind, f"one of {KINDS}")
    seed = ["data"] if self.axis == "seed" else [None] * int(self.batched)  # the stacked seed axis, if any
    if kind in STATE_KINDS and self.specs is not None:
      return jax.tree.map(lambda s: self._named(*seed, *s), self.specs[kind], is_leaf=_is_spec)
    if kind in STATE_KINDS + ("state",):
      return self._named(*seed)
    if kind == "replicated":
      return self._named()
    if self.axis == "seed":
      return self._named("data")
    # B follows the seed axis (if stacked) and, in eval data, the axis of eval batches.
    return self._named(*seed, *[None] * int(kind == "eval"), "data")

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
    return {"data_parallel_devices": self.data, "data_parallel_axis": self.axis,
            "mesh": {"data": self.data, "heads": self.heads}}


def layout(train: TrainConfig, group_size: int, batched: bool, num_heads: int | None = None) -> Layout:
  """The layout of a group of `group_size` seeds (stacked under vmap when batched); refuses before tracing.

  num_heads: the model's, which train.mesh.heads must divide.
  """
  if num_heads is not None:
    check_heads(train, num_heads)
  N, M = mesh_shape(train, group_size, batched)
  return Layout(N, M, train.data_parallel_axis, batched)
