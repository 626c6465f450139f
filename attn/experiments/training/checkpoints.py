"""Checkpoints: a trial's model state, optimiser state and step, saved with Orbax.

  DIR/trials/ID/checkpoints/N/   the training state after N steps (the trial's rows 0..N-1)

A trial saves every train.checkpoint_interval steps (default: at each
evaluation) and at its last step. A save packs the state into one host array
per dtype and Orbax writes it in a background thread of ours while training
goes on; the next save, and the end of the trial, wait for it and raise its
error, so the final checkpoint is complete before the trial's summary is
written, and a failed save (a full disk) stops the trial in the training thread. Orbax writes
N.orbax-checkpoint-tmp and renames it to N once complete
(AtomicRenameTemporaryPath, its default on a local filesystem), so a directory
named N is whole; the leftover of a killed save is deleted when the trial
resumes. Once a save has completed all but the newest two are deleted: at the
end, the final checkpoint and the one before it, the fallback when the newest
cannot be read.

A checkpoint is the Orbax tree {"arrays": {dtype: 1-D array}, "step": N} and,
in its custom metadata, "leaves": [path, shape, dtype] of every leaf of
{"params", "opt_state", "rest"} in tree order: the packing cuts a save from
~120 arrays to three (Orbax costs about a millisecond per array), and the index
lets any reader cut the arrays back into leaves (attn.experiments.load_trial does that).

In a trial of several processes only process 0 saves (arrays it reads whole
from its own shards: attn.experiments.training.parallel.Layout.fetch), and
every process restores by itself: Orbax is told that each call involves this
process alone, so none waits at a barrier for the others.

Trials trained together under vmap (sweep.vmap_seeds) save one checkpoint per
seed, sliced from the stacked state, and resume from the newest step that every
seed of the group holds readably.
"""

from __future__ import annotations

import functools
import math
import os
import shutil
import threading
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from attn.process import faults

KEEP = 2
TMP_SUFFIX = ".orbax-checkpoint-tmp"


def steps(directory: str) -> list[int]:
  """The steps of the complete checkpoints in `directory`, ascending."""
  if not os.path.isdir(directory):
    return []
  return sorted(int(name) for name in os.listdir(directory) if name.isdigit())


def _alone() -> dict[str, Any]:
  """Orbax's options for a save or restore by this process alone (none with one process: Orbax's defaults)."""
  if jax.process_count() == 1:
    return {}
  import orbax.checkpoint as ocp
  me = jax.process_index()
  return {"multiprocessing_options": ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})}


@functools.lru_cache(maxsize=1)
def _checkpointer():
  import orbax.checkpoint as ocp  # lazy: a second or two to import, needed only once a trial saves
  return ocp.Checkpointer(ocp.StandardCheckpointHandler(**_alone()), **_alone())


def _prune(directory: str) -> None:
  for old in steps(directory)[:-KEEP]:
    shutil.rmtree(os.path.join(directory, str(old)), ignore_errors=True)


def _pack(state: dict[str, Any]) -> tuple[dict[str, np.ndarray], list[list[Any]]]:
  """One 1-D host array per dtype (a copy), and each leaf's [path, shape, dtype] in tree order."""
  leaves = jax.tree_util.tree_flatten_with_path(state)[0]
  index = [[jax.tree_util.keystr(path), list(np.shape(x)), str(np.asarray(x).dtype)] for path, x in leaves]
  arrays = {}
  for dtype in sorted({d for _, _, d in index}):
    parts = [np.ravel(np.asarray(x)) for (_, x), (_, _, d) in zip(leaves, index) if d == dtype]
    arrays[dtype] = np.concatenate(parts)  # a copy: the next train step may donate the device buffers
  return arrays, index


def _unpack(arrays: dict[str, np.ndarray], like: dict[str, Any]) -> dict[str, Any]:
  """The tree `like` with its leaves cut, in order, from the arrays of `_pack`."""
  leaves, treedef = jax.tree.flatten(like)
  offsets, out = dict.fromkeys(arrays, 0), []
  for x in leaves:
    dtype, size = str(np.dtype(x.dtype)), math.prod(x.shape)
    out.append(jnp.asarray(arrays[dtype][offsets[dtype]:offsets[dtype] + size].reshape(x.shape)))
    offsets[dtype] += size
  return jax.tree.unflatten(treedef, out)


class Saver:
  """Writes one trial's checkpoints in a background thread, one at a time, keeping the newest two.

  The thread runs Orbax's synchronous save, so its error (a full disk, an I/O
  error) is caught there and raised by the next wait() in the training thread,
  where the sweep tells a fault of the machine from the trial's own; nothing
  reaches threading.excepthook. Orbax's logged copies are dropped by attn.process.hooks.quiet,
  which the `attn` command installs for its process (attn.process.setup);
  a Saver touches no process-wide hook.
  """

  def __init__(self, directory: str):
    import orbax.checkpoint as ocp
    self.directory = directory
    self._orbax = ocp.Checkpointer(ocp.StandardCheckpointHandler(**_alone()), **_alone())
    self._thread: threading.Thread | None = None
    self._error: BaseException | None = None

  def save(self, step: int, state: dict[str, Any]) -> None:
    """Starts writing state (params, opt_state, rest) as checkpoint `step`, after the previous one is done."""
    self.wait()
    os.makedirs(self.directory, exist_ok=True)
    arrays, index = _pack(state)
    path = os.path.abspath(os.path.join(self.directory, str(step)))
    self._thread = threading.Thread(target=self._write, args=(path, arrays, index, step),
                                    name=f"checkpoint {path}", daemon=True)
    self._thread.start()

  def _write(self, path: str, arrays: dict[str, np.ndarray], index: list[list[Any]], step: int) -> None:
    import orbax.checkpoint as ocp
    try:
      with faults.point("checkpoint", path + TMP_SUFFIX):
        self._orbax.save(path, args=ocp.args.StandardSave({"arrays": arrays, "step": np.asarray(step, np.int32)}),
                         custom_metadata={"leaves": index})
    except BaseException as e:  # handed to wait(), in the training thread
      self._error = e

  def wait(self) -> None:
    """Blocks until the pending save is renamed into place, then deletes all but the newest two; raises its error."""
    thread, self._thread = self._thread, None
    if thread is None:
      return
    thread.join()
    error, self._error = self._error, None
    if error is not None:
      raise error
    _prune(self.directory)

  def close(self) -> None:
    try:
      self.wait()
    finally:
      self._orbax.close()


def restore(directory: str, step: int, like: dict[str, Any]) -> dict[str, Any]:
  """Checkpoint `step` of `directory` as a tree like `like` (same paths, shapes and dtypes)."""
  import orbax.checkpoint as ocp
  path = os.path.abspath(os.path.join(directory, str(step)))
  index = (_checkpointer().metadata(path).custom_metadata or {}).get("leaves")
  expected = [[jax.tree_util.keystr(p), list(x.shape), str(np.dtype(x.dtype))]
              for p, x in jax.tree_util.tree_flatten_with_path(like)[0]]
  if index != expected:
    raise ValueError("its index of leaves is missing or differs from this model's (paths, shapes, dtypes)")
  sizes: dict[str, int] = {}
  for _, shape, dtype in expected:
    sizes[dtype] = sizes.get(dtype, 0) + math.prod(shape)
  abstract = {"arrays": {d: jax.ShapeDtypeStruct((n,), np.dtype(d)) for d, n in sizes.items()},
              "step": np.asarray(step, np.int32)}
  out = _checkpointer().restore(path, args=ocp.args.StandardRestore(abstract))
  if int(out["step"]) != step:
    raise ValueError(f"it holds step {int(out['step'])}, not {step}")
  return _unpack({d: np.asarray(a) for d, a in out["arrays"].items()}, like)


def first_line(e: Exception) -> str:
  text = (str(e).strip().splitlines() or [""])[0]
  return f"{type(e).__name__}: {text[:200]}"


def resume(directories: list[str], like: list[dict[str, Any]], below: int,
           log: Callable[[str], None]) -> tuple[int, list[dict[str, Any]] | None]:
  """(N, states): the newest step N < below that every directory holds readably; (0, None) if none.

  An unreadable checkpoint is reported through `log` by path and an earlier
  one tried. Checkpoints newer than N (and unfinished saves) are deleted: the
  steps after N are about to be recomputed and saved again.
  """
  for d in directories:
    for name in os.listdir(d) if os.path.isdir(d) else []:
      if TMP_SUFFIX in name:
        shutil.rmtree(os.path.join(d, name), ignore_errors=True)
  common = set.intersection(*[set(steps(d)) for d in directories])
  found, states = 0, None
  for step in sorted((s for s in common if s < below), reverse=True):
    try_states = []
    for d, target in zip(directories, like):
      try:
        try_states.append(restore(d, step, target))
      except Exception as e:  # any failure to read makes this checkpoint unusable
        log(f"warning: checkpoint {os.path.join(d, str(step))} could not be read ({first_line(e)}); "
            "deleting it and resuming from an earlier one")
        break
    if len(try_states) == len(directories):
      found, states = step, try_states
      break
  for d in directories:
    for newer in steps(d):
      if newer > found:
        shutil.rmtree(os.path.join(d, str(newer)), ignore_errors=True)
  return found, states
