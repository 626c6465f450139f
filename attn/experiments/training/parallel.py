"""One mesh per trial's program: devices as a ("data", "heads") grid, arrays placed with NamedSharding.

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

A trial may span P processes (attn.experiments.training.distributed): then
train.mesh counts each process's devices, and the mesh is the P processes'
meshes stacked along "data", P·N × M over jax.devices(), process by process,
so that each row of M "heads" devices sits inside one process. Each batch is
split over all P·N rows: B must be a multiple of P·N, and each process loads
only its own B/P rows (`rows`) and makes the global batch with
jax.make_array_from_process_local_data. State is placed from each process's
copy (every process builds or restores the same one). Parameters are thus
replicated across processes, and each process holds every shard of them:
`fetch` reads whole host arrays in any process without a collective, which is
how the leader saves checkpoints. The "seed" axis is refused with P > 1
(processes that train different seeds share nothing: make them separate
trials).

With one device nothing is placed or sharded: the program is the one attn
ran before meshes existed, bit for bit. Otherwise rows agree with it to float
tolerance (sums run in another order). Checkpoints hold host arrays and do not
depend on the layout: a trial saved on one mesh resumes on any other.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Sequence

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from attn.config import invalid
from attn.experiments.training import distributed
from attn.experiments.training.config import TrainConfig, check_heads
from attn.nn import sharding as sharding_lib

AXES = ("data", "heads")  # the mesh's axes
STATE_KINDS = ("params", "opt_state", "rest")
KINDS = STATE_KINDS + ("state", "train", "eval", "replicated")


def _largest_divisor(n: int, at_most: int) -> int:
  return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


def _is_spec(x: Any) -> bool:
  return isinstance(x, PartitionSpec)


def _multiples(n: int, at_most: int) -> list[int]:
  return [d for d in range(n, at_most + 1, n)]


def check_processes(train: TrainConfig, processes: int, N: int | None = None) -> None:
  """Refuses a [train] that cannot be shared over `processes` processes of N devices each (None: train's own N)."""
  P = processes
  if P == 1:
    return
  if train.data_parallel_axis == "seed":
    raise invalid("train.data_parallel_axis", "seed",
                  f'"batch" with {P} processes per trial: processes that train different seeds share no '
                  "computation; train the seeds as separate trials side by side instead (--workers N, or "
                  "one Slurm array task each)")
  N = train.data_parallel if N is None else N
  if N == "auto":
    N = 1  # the devices each process has: checked where it runs; a multiple of P at least
  B, k = train.batch_size, train.grad_accum
  if B % (P * N) or (B // k) % (P * N):
    rows = f"{B} rows leave {B % (P * N)}" if k == 1 else \
        f"{B // k} rows in each of {k} micro-batches (train.grad_accum) leave {(B // k) % (P * N)}"
    raise invalid("train.batch_size", B,
                  f"a multiple of {P * k * N} with {P} processes per trial of {N} device(s) each "
                  f"(train.mesh.data){f' and {k} micro-batches' if k > 1 else ''}: each batch is shared over "
                  f"the {P * N} devices of the trial's processes, and {rows} over; e.g. one of "
                  f"{_multiples(P * k * N, max(B, 1) * 2)[:6]}")


def mesh_shape(train: TrainConfig, group_size: int, batched: bool, processes: int = 1) -> tuple[int, int]:
  """(N, M): each process's devices along "data" and "heads" for `group_size` seeds; refuses what cannot run here.

  processes: the trial's P; the mesh is then P·N × M (module docstring).
  """
  N, M = train.data_parallel, train.mesh["heads"]
  if N == 1 and M == 1:
    check_processes(train, processes, 1)
    return 1, 1
  devices = jax.local_devices()
  available, kind = len(devices), devices[0].platform
  want = available // M if N == "auto" else N
  if want * M > available or want < 1:
    if processes > 1:
      raise invalid("train.mesh", dict(train.mesh),
                    f"at most the {available} local {kind} device(s) of each of the {processes} processes of "
                    f"the trial: data × heads = {'auto' if N == 'auto' else N} × {M} = "
                    f"{want * M if want else M} devices in each process")
    if M == 1:
      raise invalid("train.data_parallel", N, f'at most the {available} local {kind} device(s) present, or "auto"')
    raise invalid("train.mesh", dict(train.mesh),
                  f"at most the {available} local {kind} device(s) present: data × heads = "
                  f"{'auto' if N == 'auto' else N} × {M} = {want * M if want else M} devices")
  if processes > 1:
    check_processes(train, processes, want)
    return want, M
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


def device_count(train: TrainConfig, group_size: int, batched: bool, processes: int = 1) -> int:
  """Local devices one program of `group_size` seeds runs on (data × heads) in each of its processes; refuses
  what cannot run here."""
  N, M = mesh_shape(train, group_size, batched, processes)
  return N * M


def _process_devices(p: int) -> list[Any]:
  return sorted((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)


def host(x: Any) -> np.ndarray:
  """x as one host array, from this process's shards alone (no collective); refuses if they do not cover it."""
  if not isinstance(x, jax.Array) or x.is_fully_addressable:
    return np.asarray(x)
  if x.is_fully_replicated:
    return np.asarray(x.addressable_data(0))
  out, seen = np.empty(x.shape, x.dtype), set()
  for shard in x.addressable_shards:
    where = tuple(s.indices(n)[:2] for s, n in zip(shard.index, x.shape))
    if where not in seen:
      seen.add(where)
      out[shard.index] = np.asarray(shard.data)
  if sum(math.prod(b - a for a, b in w) for w in seen) != x.size:
    raise ValueError(f"an array of shape {x.shape} ({x.sharding}) is not held whole by process "
                     f"{jax.process_index()}: its shards here cover only part of it")
  return out


@dataclasses.dataclass(frozen=True, eq=False)
class Layout:
  """Where the arrays of one compiled program live: a `data` × `heads` mesh, the batch or seeds split on data.

  specs: PartitionSpec trees of "params", "opt_state" and "rest" without the
  seed axis (with_state); None places every state leaf whole on each device.
  """

  data: int = 1  # every process's rows: P·N
  heads: int = 1
  axis: str = "batch"
  batched: bool = False  # a vmapped seed axis leads every state and batch array
  specs: dict[str, Any] | None = None
  processes: int = 1

  @property
  def devices(self) -> int:
    return self.data * self.heads

  @functools.cached_property
  def mesh(self) -> Mesh:
    if self.processes == 1:
      grid = jax.local_devices()[:self.devices]
    else:  # each process's first N·M devices, process by process: its N rows of M
      per = self.devices // self.processes
      grid = [d for p in range(self.processes) for d in _process_devices(p)[:per]]
    return Mesh(np.asarray(grid).reshape(self.data, self.heads), AXES)

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
    """tree (whole, the same in every process) placed as `kind` on the mesh; unchanged on one device."""
    if self.devices == 1:
      return tree
    if self.processes == 1:
      return jax.device_put(tree, self.sharding(kind))
    shardings = self.sharding(kind)

    def one(x, sharding):
      x = np.asarray(x)
      return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    if isinstance(shardings, NamedSharding):
      return jax.tree.map(lambda x: one(x, shardings), tree)
    return jax.tree.map(one, tree, shardings)

  def rows(self, batch_size: int) -> slice | None:
    """The rows of each batch this process loads: its 1/P share along B; None (all of them) in one process."""
    if self.processes == 1:
      return None
    share, p = batch_size // self.processes, jax.process_index()
    return slice(p * share, (p + 1) * share)

  def put_batch(self, batch: Any, kind: str) -> Any:
    """A "train" or "eval" batch placed on the mesh, from this process's `rows` of it (all of them in one process)."""
    if self.processes == 1:
      return self.put(batch, kind)
    sharding = self.sharding(kind)
    d = list(sharding.spec).index("data")  # the B axis

    def one(x):
      whole = x.shape[:d] + (x.shape[d] * self.processes,) + x.shape[d + 1:]
      return jax.make_array_from_process_local_data(sharding, x, whole)

    return jax.tree.map(one, batch)

  def fetch(self, tree: Any) -> Any:
    """tree's arrays as host arrays (jax.device_get), read in each process from its own shards."""
    return jax.device_get(tree) if self.processes == 1 else jax.tree.map(host, tree)

  def agree(self, flag: bool) -> bool:
    """flag, or in a trial of several processes whether it holds in any of them (a collective)."""
    return flag if self.processes == 1 else distributed.agree(flag)

  def jit(self, fn: Callable, in_kinds: Sequence[str], out_kinds: str | Sequence[str],
          donate: tuple[int, ...] = ()) -> Any:
    """jax.jit of fn with the shardings of in_kinds / out_kinds (none on one device)."""
    if self.devices == 1:
      return jax.jit(fn, donate_argnums=donate)
    out = self.sharding(out_kinds) if isinstance(out_kinds, str) else tuple(map(self.sharding, out_kinds))
    return jax.jit(fn, in_shardings=tuple(map(self.sharding, in_kinds)), out_shardings=out,
                   donate_argnums=donate)

  def summary(self) -> dict[str, Any]:
    """What a trial's summary records of how it was run (the mesh over all its processes)."""
    return {"data_parallel_devices": self.data, "data_parallel_axis": self.axis,
            "mesh": {"data": self.data, "heads": self.heads},
            **({"processes": self.processes} if self.processes > 1 else {})}


def layout(train: TrainConfig, group_size: int, batched: bool, num_heads: int | None = None,
           processes: int = 1) -> Layout:
  """The layout of a group of `group_size` seeds (stacked under vmap when batched); refuses before tracing.

  num_heads: the model's, which train.mesh.heads must divide. processes: the
  trial's (jax.process_count() once they are connected).
  """
  if num_heads is not None:
    check_heads(train, num_heads)
  N, M = mesh_shape(train, group_size, batched, processes)
  return Layout(N * processes, M, train.data_parallel_axis, batched, processes=processes)
