"""Several processes, one trial: joining the group (jax.distributed) and what its processes agree on.

A trial can run as one program over P processes: `attn sweep --processes-per-trial P`
starts P processes on this machine, `--slurm-nodes N --slurm-tasks-per-node T` runs
N·T Slurm tasks (attn.experiments.running.processes). Each calls `connect` before
jax touches a device; from then on jax.devices() holds every process's devices and
the trial's mesh spans them (attn.experiments.training.parallel). CPU collectives
go through gloo.

Process 0, the leader, is the group's only writer: it leases trials and writes
the store's rows, summaries and the checkpoints. The other processes train
what it orders and write nothing. What they must agree on travels two ways:

  orders       which trials the group trains next, or stop: JSON in the
               coordination service's key-value store (attn/order/0, 1, ...),
               sent by the leader, read in turn by the others (Orders)
  collectives  the step a trial resumes from (broadcast) and, after every
               step, whether any process was asked to save and stop (agree)

A process that dies takes the group with it: a collective with a dead peer
fails at once, and jax's coordination service ends every process whose leader
is gone (or whose peer's heartbeat stops for 100 s). The leader then leaves
the trial unfinished, with its rows and checkpoint, for a re-run to resume.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import threading
from typing import Any

import jax
import numpy as np

ORDER_WAIT_MS = 60_000  # one wait of a follower for its next order; it waits again until one comes
EXIT_UNREACHABLE = 3


@dataclasses.dataclass(frozen=True)
class Group:
  """One process's place in a trial's group: the coordinator (process 0's host:port), P, its index.

  timeout: seconds to wait for the whole group to connect (--coordinator-timeout).
  """

  address: str
  processes: int
  index: int
  timeout: float
  bind: str | None = None  # where process 0 listens; None: every interface, at the address's port


def unreachable(group: Group) -> str:
  """The error of a process whose group did not connect within group.timeout."""
  P, k, a, t = group.processes, group.index, group.address, group.timeout
  if k == 0:
    what = (f"process 0 of {P} (the coordinator, listening at {a}) waited {t:g} s for the other "
            f"{P - 1} process{'es' * (P > 2)} to connect; did they start, and can they reach {a}?")
  else:
    what = (f"process {k} of {P} could not reach its coordinator at {a} within {t:g} s; is process 0 "
            "running there, and is that address reachable from this host?")
  return f"attn: error: {what} (the timeout is --coordinator-timeout)"


def connect(group: Group) -> None:
  """Joins the group (jax.distributed.initialize); exits with EXIT_UNREACHABLE after group.timeout.

  jax aborts the process itself once its own initialization_timeout passes,
  with a message that names neither the address nor the option. A watchdog
  thread ends the process first, naming both (the main thread is inside
  jax's C++ connect and cannot be interrupted).
  """
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  connected = threading.Event()

  def watchdog() -> None:
    if not connected.wait(group.timeout):
      sys.stderr.write(unreachable(group) + "\n")
      sys.stderr.flush()
      os._exit(EXIT_UNREACHABLE)

  threading.Thread(target=watchdog, name="attn coordinator timeout", daemon=True).start()
  jax.distributed.initialize(group.address, group.processes, group.index,
                             initialization_timeout=math.ceil(group.timeout) + 30,
                             coordinator_bind_address=group.bind)
  connected.set()


def processes() -> int:
  return jax.process_count()


def index() -> int:
  return jax.process_index()


def is_leader() -> bool:
  return jax.process_index() == 0


def agree(flag: bool) -> bool:
  """True when `flag` is true in any process of the group (a collective: every process calls it)."""
  from jax.experimental import multihost_utils
  return bool(np.any(multihost_utils.process_allgather(np.asarray(flag, np.int32))))


def broadcast(value: int) -> int:
  """The leader's `value`, in every process (a collective)."""
  from jax.experimental import multihost_utils
  return int(multihost_utils.broadcast_one_to_all(np.asarray(value, np.int32)))


def _client() -> Any:
  # The coordination service's client: jax keeps it here (orbax and jax's own
  # array_serialization read it the same way); it has no public accessor.
  from jax._src import distributed as jax_distributed
  client = jax_distributed.global_state.client
  if client is None:
    raise RuntimeError("jax.distributed is not initialized: call distributed.connect first")
  return client


class Orders:
  """The leader's orders to the other processes, in sequence: send on process 0, receive on the others."""

  def __init__(self):
    self._next = 0

  def send(self, order: Any) -> None:
    _client().key_value_set(f"attn/order/{self._next}", json.dumps(order))
    self._next += 1

  def receive(self) -> Any:
    """The next order; waits as long as the leader takes (it may wait for other workers' trials)."""
    key = f"attn/order/{self._next}"
    while True:
      try:
        text = _client().blocking_key_value_get(key, ORDER_WAIT_MS)
        break
      except jax.errors.JaxRuntimeError as e:
        if "DEADLINE_EXCEEDED" not in str(e):
          raise
    self._next += 1
    return json.loads(text)
