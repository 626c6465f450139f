"""Sweeps: a validated config -> trials -> training -> the store, with resume, leases and progress.

Trials that are already finished in the store are skipped; an unfinished one
resumes from its newest readable checkpoint (a warning on the stream names any
checkpoint that could not be read). Unfinished trials that share a shape (equal
configs but for train.seed) train together under jax.vmap over seeds when
sweep.vmap_seeds is true (default false: slower on CPU, experiments/performance.md);
each seed still saves its own checkpoints. With sweep.pack = N, up to N trials equal but for
their seed, lr, warmup_steps and end_lr_ratio train as one program the same way, N reduced
before any training where memory holds fewer (fit_packs); with sweep.pack = "auto" each worker
picks N per shape by measured throughput (_Worker.adapt). A trial whose training raises is
recorded as failed with the error, and the sweep goes on; so is one whose
compiled step wants more memory than the machine has available (check_memory).
A fault of the machine (attn.process.faults: no space, an I/O
error) is not the trial's: it is left without a summary, resumable from its
last complete checkpoint, its reason in interrupted.json when the disk takes
it, and the worker stops after it (counts["fault"] says why).

Any number of workers may share one store (`attn sweep` processes, the local
workers of --workers N, Slurm array tasks): each runs `run_trials`, which
leases an unfinished trial before training it (attn.experiments.running.leases) and
leaves one that a live worker holds. A seed group is leased trial by trial and
a worker trains together the members it holds. With wait=True (what `attn
sweep` and its local workers use) a worker that runs out of trials waits for
those others hold, taking over any whose heartbeat stops. Training runs in a
thread that attn.experiments.training.preempt can stop after a step, with a checkpoint.

A worker may be a group of processes that train each trial together
(attn.experiments.training.distributed): its process 0 runs the worker's loop
above, holding the leases and writing the store, and orders the others to
train each group of trials with it just before it does; they write nothing.
In such a group an error in any process stops the group and leaves its trial
unfinished (not failed: a dead peer and a failure of one's own look alike
from inside a collective), its rows and checkpoint kept for a re-run.

With tensorboard=LOGDIR (`attn sweep --tensorboard`), each worker also writes
the rows of the trials it trains as TensorBoard runs, after the store has them
(attn.experiments.running.tb_writer: one run per trial, rewritten from the
store's rows when the trial starts or resumes; an error there never touches a trial).
"""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Any, TextIO

from attn.config import ConfigError, invalid
from attn.experiments.running import config as config_lib
from attn.experiments.running import leases
from attn.experiments.running import space
from attn.experiments.running import tb_writer
from attn.process import faults
from attn.experiments.training import preempt
from attn.experiments.running.store import CONFIG, PARTIAL, Store, config_todo, load_sweep, read_config, read_rows

DEFAULT_LEASE_TIMEOUT = leases.DEFAULT_TIMEOUT


def header(sweep: config_lib.Sweep, config_text: str, overrides: list[str]) -> dict[str, Any]:
  """What sweep.json holds: enough to know which sweep a directory belongs to."""
  return {"sweep_id": sweep.id, "name": sweep.meta["name"], "question": sweep.meta["question"],
          "config_path": sweep.path, "config_text": config_text, "overrides": list(overrides),
          "axes": sweep.axes, "vmap_seeds": sweep.vmap_seeds, "pack": sweep.pack,
          "trials": [{"id": t.id, "label": t.label} for t in sweep.trials]}


def _fmt_time(seconds: float) -> str:
  seconds = int(seconds)
  return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


class Progress:
  """One status line: trial i/N (of the trials this worker runs), step, loss, ETA; redrawn on a tty.

  The ETA is the steps left at the rate of the steps timed so far, leaving out each group's first
  step (its compilation, seconds against milliseconds); "estimating" until two steps are timed.
  """

  def __init__(self, total_steps: int, n_trials: int, stream: TextIO = sys.stderr):
    self.total, self.n, self.stream = total_steps, n_trials, stream
    self.done, self.last = 0, 0.0
    self.timed_steps, self.timed_s, self.prev, self.group = 0, 0.0, 0.0, None
    self.tty = hasattr(stream, "isatty") and stream.isatty()

  def eta(self) -> str:
    if self.timed_steps < 2:
      return "estimating"
    return _fmt_time((self.total - self.done) * self.timed_s / self.timed_steps)

  def update(self, first: int, count: int, label: str, step: int, steps: int, loss: float) -> None:
    """After step `step` of the group of `count` trials whose first is trial `first` (1-based) of n."""
    self.done += count
    now = time.perf_counter()
    if self.group == (first, label):  # a step after the group's first: timed
      self.timed_steps += count
      self.timed_s += now - self.prev
    self.group, self.prev = (first, label), now
    final = step == steps - 1
    if now - self.last < (0.2 if self.tty else 10.0) and not final and step > 0:
      return
    self.last = now
    which = f"{first}/{self.n}" if count == 1 else f"{first}-{first + count - 1}/{self.n}"
    line = f"trial {which} [{label}] step {step + 1}/{steps} loss {loss:.4f} ETA {self.eta()}"
    if self.tty:
      self.stream.write("\r\033[K" + line + ("\n" if final else ""))
    else:
      self.stream.write(line + "\n")
    self.stream.flush()


def _label(group: list[config_lib.Trial]) -> str:
  parts: dict[str, list[Any]] = {}
  for t in group:
    for k, v in t.label.items():
      seen = parts.setdefault(config_lib.axis_name(k), [])
      if v not in seen:
        seen.append(v)
  return ", ".join(f"{k}={','.join(map(config_lib.show, v))}" for k, v in parts.items())


def _done(store: Store, trial_id: str) -> bool:
  """store.is_done, False where the disk cannot be read."""
  try:
    return store.is_done(trial_id)
  except OSError:
    return False


def device_memory() -> tuple[int | None, str]:
  """(bytes a new allocation can get, where): the first device's allocator on a GPU or TPU (its limit
  is this process's share under XLA_PYTHON_CLIENT_MEM_FRACTION), else the host's MemAvailable."""
  import jax
  dev = jax.local_devices()[0]
  if dev.platform != "cpu":
    try:
      stats = dev.memory_stats() or {}
    except Exception:  # not every backend reports it
      stats = {}
    if "bytes_limit" in stats:
      share = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
      where = f"{dev.device_kind}'s memory" + (f" (this process's share, {share} of it)" if share else "")
      return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)), where
  return space.available_memory(), "this machine's memory"


def check_memory(group: list[config_lib.Trial], compiled: list[Any]) -> None:
  """Refuses (ConfigError: the trial fails by name) programs that want more memory than the device has free."""
  wanted = max(int(getattr(c.memory_analysis(), "peak_memory_in_bytes", 0) or 0) for c in compiled)
  have, where = device_memory()
  if have is not None and wanted > have:
    share = " or fewer --trials-per-device" if os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION") else ""
    raise invalid("trial", _label(group), f"a config whose train step fits {where}: XLA's memory "
                  f"analysis wants {space.fmt_bytes(wanted)}, {space.fmt_bytes(have)} is available; lower "
                  f"train.batch_size, raise train.grad_accum, shrink the model{share}")


PACK_MEMORY_FRACTION = 0.8  # of the memory device_memory() finds free, that a pack may plan to fill
AUTO_GAIN = 1.1  # sweep.pack = "auto" keeps a doubled pack when its throughput is at least this times the best


def fit_packs(pending: list[config_lib.Trial], pack: int | str, stream: TextIO) -> dict[str, int]:
  """{pack key: the most trials of it one program may hold}, for sweep.pack > 1 or "auto", before any training.

  A trial's memory is XLA's memory analysis of its train step compiled alone (train.memory_estimate:
  parameters, optimiser state, gradients, activations at the batch, workspace); a pack of n takes n
  times that. Where PACK_MEMORY_FRACTION of what device_memory() finds free holds fewer than the pack
  asks, the pack is reduced, saying so on stream with the memory named; one trial that does not fit
  alone is left to check_memory, which fails it by name.
  """
  if not config_lib.packs(pack):
    return {}
  from attn.experiments.training import train  # lazy: jax
  have, where = device_memory()
  if have is None:
    return {}
  budget, limits = int(PACK_MEMORY_FRACTION * have), {}
  sizes: dict[str, list[config_lib.Trial]] = {}
  for t in pending:
    sizes.setdefault(config_lib.pack_key(t), []).append(t)
  for key, group in sizes.items():
    asked = len(group) if pack == "auto" else min(pack, len(group))
    if asked == 1:
      continue
    per = train.memory_estimate(group[0].config)
    fits = max(1, budget // max(per, 1))
    if fits < asked:
      limits[key] = fits
      cut = "reduced to" if pack != "auto" else "at most"
      stream.write(f"sweep.pack={pack}: {cut} {fits} for [{_label(group)}]: one trial's train step needs "
                   f"{space.fmt_bytes(per)} (XLA's memory analysis), {where} has {space.fmt_bytes(have)} "
                   f"available and packs plan on {PACK_MEMORY_FRACTION:.0%} of it ({space.fmt_bytes(budget)})\n")
  return limits


def check_lease_timeout(seconds: Any) -> float:
  """seconds as a float; anything but a finite number >= 1 is refused by name."""
  ok = isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and math.isfinite(seconds)
  if not ok or seconds < 1:
    raise invalid("--lease-timeout", seconds, "a number of seconds >= 1 (default "
                  f"{DEFAULT_LEASE_TIMEOUT:g}; heartbeats come every quarter of it)")
  return float(seconds)


def prepare(sweep: config_lib.Sweep, out: str, config_text: str = "", overrides: list[str] | None = None, *,
            retry_failed: bool = False, stream: TextIO | None = None) -> bool:
  """Claims the store at `out` for `sweep` and writes every trial's config; True when it held the sweep already.

  The one resume path of every executor: a filesystem without MIN_FREE bytes
  free (or one that fails these first writes) is refused naming --out and
  its space; retry_failed (`--retry-failed`) makes the failed trials new.
  """
  stream = stream or sys.stderr
  where, free = space.free_bytes(out)
  if free < space.MIN_FREE:
    raise _full(out, where, free)
  store = Store(out)
  head = header(sweep, config_text, overrides or [])
  try:
    resumed = store.claim(head)
    for t in sweep.trials:  # an existing config.json that does not parse is refused here, before any training
      store.write_config(t.id, {"id": t.id, "label": t.label, **t.config}, head)
  except OSError as e:
    fault = faults.classify(e)
    if fault is None:
      raise
    raise _full(out, *space.free_bytes(out), fault.reason) from None
  if retry_failed:
    failed = [t for t in sweep.trials if store.failed(t.id)]
    for t in failed:
      store.reset(t.id)
    stream.write(f"retrying {len(failed)} failed trial{'s' * (len(failed) != 1)} from step 0\n" if failed else
                 f"--retry-failed: no failed trials in {out}: nothing to retry\n")
  if resumed:
    done = sum(store.is_done(t.id) for t in sweep.trials)
    stream.write(f"resuming {out}: {done} of {len(sweep.trials)} trials already finished\n")
  return resumed


def _full(out: str, where: str, free: int, why: str = "") -> ConfigError:
  return invalid("--out", out, f"a directory on a filesystem with room for the store: {where} has "
                 f"{space.fmt_bytes(free)} free ({free} bytes; at least {space.fmt_bytes(space.MIN_FREE)} needed)"
                 + (f", and {why}" if why else "") + ": free space or choose another --out")


def stored_trials(out: str) -> tuple[list[config_lib.Trial], bool, int | str]:
  """The trials of a claimed store in sweep order (from their config.json), its sweep.vmap_seeds and sweep.pack."""
  head = load_sweep(out)
  trials = []
  for entry in head["trials"]:
    path = os.path.join(out, "trials", entry["id"], CONFIG)
    if not os.path.exists(path):
      raise invalid("DIR", out, f"a store claimed by `attn sweep` with every trial's {CONFIG} ({path} is missing)")
    cfg = read_config(path, config_todo(out, head))
    trials.append(config_lib.Trial(entry["id"], cfg["label"],
                                   {k: v for k, v in cfg.items() if k not in ("id", "label")}))
  return trials, bool(head.get("vmap_seeds", False)), head.get("pack", 1)


def run_sweep(sweep: config_lib.Sweep, out: str, *, config_text: str = "",
              overrides: list[str] | None = None, stream: TextIO | None = None,
              lease_timeout: float = DEFAULT_LEASE_TIMEOUT, tensorboard: str | None = None) -> dict[str, int]:
  """Runs every unfinished trial of `sweep` into the store at `out`, waiting for those other workers hold.

  tensorboard: a TensorBoard log directory that gets each trial's rows as it trains (module docstring).

  Returns ok/failed counts of the trials it ran and skipped (finished before,
  or by other workers), plus "unfinished" when it stopped early (preempted).
  """
  lease_timeout = check_lease_timeout(lease_timeout)
  stream = stream or sys.stderr  # at call time: a captured or replaced stderr is the one written to
  prepare(sweep, out, config_text, overrides, stream=stream)
  tb = tb_writer.Writer(tensorboard, stream) if tensorboard else None
  worker = _Worker(Store(out), sweep.trials, sweep.vmap_seeds, lease_timeout, stream, None, tb, pack=sweep.pack)
  return preempt.run(worker.run, sweep.trials, True)


def run_trials(out: str, trial_ids: list[str] | None = None, *, lease_timeout: float = DEFAULT_LEASE_TIMEOUT,
               stream: TextIO | None = None, wait: bool = False, worker: str | None = None,
               tensorboard: str | None = None) -> dict[str, int]:
  """Runs each given (None: every) unfinished trial of the claimed store at `out` that it can lease, in sweep order.

  Trials finished or held by a live worker are skipped; with wait=True it then
  waits for those, taking over any whose lease goes stale. Writes no report.
  Counts as run_sweep's, "unfinished" counting trials left to other workers.
  In a group of processes (joined by distributed.connect) process 0 does all
  this and the others train the trials it orders (module docstring).
  """
  lease_timeout = check_lease_timeout(lease_timeout)
  stream = stream or sys.stderr  # at call time (run_sweep)
  trials, vmap_seeds, pack = stored_trials(out)
  mine = trials
  if trial_ids is not None:
    known = [t.id for t in trials]
    unknown = [i for i in trial_ids if i not in known]
    if unknown:
      raise invalid("trial_ids", unknown, f"ids of the {len(known)} trials of {out}: {', '.join(known)}")
    mine = [t for t in trials if t.id in set(trial_ids)]
  from attn.experiments.training import distributed  # lazy: jax
  processes = distributed.processes()  # > 1 in a trial's group of processes (after distributed.connect)
  config_lib.check_devices(mine, vmap_seeds, processes, pack)  # this machine's devices, before any trial is leased
  if not distributed.is_leader():
    return preempt.run(_follow, Store(out), {t.id: t for t in trials}, config_lib.batched(vmap_seeds, pack), stream)
  tb = tb_writer.Writer(tensorboard, stream) if tensorboard else None
  orders = distributed.Orders() if processes > 1 else None
  w = _Worker(Store(out), trials, vmap_seeds, lease_timeout, stream, worker, tb, orders, pack)
  return preempt.run(w.run, mine, wait)


def _follow(store: Store, trials: dict[str, config_lib.Trial], vmap: bool, stream: TextIO) -> dict[str, int]:
  """What the processes of a group but process 0 run: train each group of trials it orders, write nothing."""
  from attn.experiments.training import distributed, train  # lazy: jax
  orders, counts = distributed.Orders(), {"ok": 0, "failed": 0, "skipped": 0}
  me = f"process {distributed.index()} of {distributed.processes()}"
  stream.write(f"{me}: training the trials process 0 orders (JAX compilation cache: "
               f"{train.enable_compilation_cache()})\n")
  while (ids := orders.receive()) is not None:
    group = [trials[i] for i in ids]
    name = f"trial {', '.join(ids)} [{_label(group)}]"
    stream.write(f"{me}: {name}\n")
    try:
      summaries = train.train_group([t.config for t in group], on_row=lambda j, row: None, vmap=vmap,
                                    checkpoint_dirs=[store.checkpoint_dir(i) for i in ids], log=lambda line: None)
    except preempt.Preempted as p:
      preempt.record(name, p.step)
      stream.write(f"{me}: {name} stopped at step {p.step} (preempted; process 0 saved it)\n")
      continue
    for summary in summaries:
      counts[summary["status"]] += 1
  stream.write(f"{me}: done: process 0 has no more trials\n")
  return counts


def error_line(e: BaseException) -> str:
  """The exception as `module.Name: message`, without the notes added to it (JAX's "For simplicity, JAX has
  removed its internal frames..." on a ConfigError raised while tracing)."""
  kind = type(e)
  name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
  return f"{name}: {e}".strip() if str(e) else name


class _Worker:
  """One worker's pass over a store's trials: lease, train, finish, release; wait for the others' trials."""

  def __init__(self, store: Store, trials: list[config_lib.Trial], vmap_seeds: bool, lease_timeout: float,
               stream: TextIO, worker: str | None, tb: tb_writer.Writer | None = None, orders: Any = None,
               pack: int | str = 1):
    self.store, self.vmap_seeds, self.lease_timeout = store, vmap_seeds, lease_timeout
    # sweep.pack; each pack key's most trials per program (memory: fit_packs; "auto": what adapt chose
    # so far); the memory's alone ("auto"); adapt's state per pack key; the last program's timing
    self.pack, self.limits, self.caps, self.auto, self.timing = pack, {}, {}, {}, None
    self.stream, self.worker, self.tb = stream, worker, tb
    self.orders = orders  # distributed.Orders to the group's other processes; None when training alone
    self.index = {t.id: i + 1 for i, t in enumerate(trials)}
    self.n = len(trials)
    self.told: set[str] = set()  # trials reported as held by another worker
    self.progress: Progress | None = None
    self.fault: faults.Fault | None = None  # the machine's fault that stopped this worker

  def name(self, trial: config_lib.Trial) -> str:
    return f"{self.index[trial.id]}/{self.n} [{_label([trial])}]"

  def run(self, trials: list[config_lib.Trial], wait: bool) -> dict[str, int]:
    from attn.experiments.training import train  # lazy: jax
    store = self.store
    pending = [t for t in trials if not store.is_done(t.id)]
    counts = {"ok": 0, "failed": 0, "skipped": len(trials) - len(pending)}
    cache = train.enable_compilation_cache()
    self.stream.write(f"{len(pending)} trials to run into {store.root} (JAX compilation cache: {cache})\n")
    self.progress = Progress(sum(t.config["train"]["steps"] for t in pending), len(pending), self.stream)
    if self.orders is None:  # a group of processes trains no packs (config_lib.check_devices)
      self.limits = self.caps = fit_packs(pending, self.pack, self.stream)
    if self.pack == "auto":  # each pack key starts alone, then adapt doubles while throughput grows
      self.limits = {config_lib.pack_key(t): 1 for t in pending}
    self.started = 0  # trials this worker has started: the progress line's i of len(pending)
    try:
      self._loop(train, pending, counts, wait)
    except Exception as e:  # a fault of the machine outside a trial (a lease, a config read): stop here
      self.fault = faults.classify(e)
      if self.fault is None or self.orders is not None:  # a group ends at once (processes.run_member)
        raise
    finally:
      if self.orders is not None:
        self.orders.send(None)  # the group's other processes stop
    store.close()
    left = [t for t in pending if not _done(store, t.id)]
    elsewhere = len(pending) - len(left) - counts["ok"] - counts["failed"]
    line = f"done: {counts['ok']} ok, {counts['failed']} failed, {counts['skipped']} already finished"
    line += f", {elsewhere} finished by other workers" if elsewhere else ""
    line += f"; {len(left)} unfinished" if left else ""
    self.stream.write(line + "\n")
    counts["skipped"] += elsewhere
    if left:
      counts["unfinished"] = len(left)
    if self.fault is not None:
      counts["fault"] = self.fault.message
    return counts

  def _loop(self, train, pending: list[config_lib.Trial], counts: dict[str, int], wait: bool) -> None:
    store = self.store
    stopped, waiting = False, None
    while not stopped:
      ran, regroup = False, False
      todo = [t for t in pending if not store.is_done(t.id)]
      for group in config_lib.seed_groups(todo, self.vmap_seeds, self.pack, self.limits):
        if preempt.requested():
          stopped = True
          break
        held = self._lease(group)
        if held:
          ran = True
          statuses = self._train(train, held)
          if statuses is None:
            stopped = True
            break
          for status in statuses:
            counts[status] += 1
          if self.tb is not None and self.tb.fault is not None:  # events cannot be written: stop after this trial
            self.fault, stopped = self.tb.fault, True
            break
          if self.pack == "auto" and self.adapt(held):  # another size next: the groups are cut again
            regroup = True
            break
      left = [t for t in pending if not store.is_done(t.id)]
      if not left or stopped or (not wait and not regroup):
        break
      if regroup:
        continue
      if not ran:
        if waiting != len(left):
          waiting = len(left)
          self.stream.write(f"waiting for {len(left)} trial{'s' * (len(left) > 1)} other workers hold "
                            f"(one whose heartbeat stops for {self.lease_timeout:g} s is taken over)\n")
        stopped = preempt.sleep(max(0.2, min(self.lease_timeout / 8, 2.0)))

  def adapt(self, group: list[config_lib.Trial]) -> bool:
    """sweep.pack = "auto": the next program's size for this pack key from the throughput just measured.

    Throughput is trials x steps per second of the compiled step (the program's median step time,
    compilation left out). From one trial per program the size doubles while each doubling gains at
    least AUTO_GAIN over the best so far, within memory (fit_packs); at the first that does not, it
    returns to the best and stays. True when the size changed (the groups are cut again).
    """
    timing, self.timing = self.timing, None
    if not timing or not timing[1]:
      return False
    key, (n, step_s) = config_lib.pack_key(group[0]), timing
    state = self.auto.setdefault(key, {"best": None, "settled": False})
    if state["settled"]:
      return False
    rate, best, size = n / step_s, state["best"], self.limits.get(key, 1)
    what = f"sweep.pack=auto [{_label(group)}]: {n} trial{'s' * (n > 1)} per program ran {rate:.1f} trial-steps/s"
    if best is None or rate > AUTO_GAIN * best[1]:
      state["best"] = (n, rate)
      grow = min(2 * n, self.caps.get(key, 2 * n))
      if grow <= n or n < size:  # memory holds no more, or too few trials were left to fill the size
        state["settled"] = True
        self.stream.write(f"{what}: {n} per program from here\n")
        return False
      self.limits[key] = grow
      self.stream.write(f"{what}: trying {grow}\n")
      return True
    state["settled"] = True
    self.limits[key] = best[0]
    self.stream.write(f"{what}, under {AUTO_GAIN:g}x the {best[1]:.1f} of {best[0]} per program: "
                      f"{best[0]} per program from here\n")
    return True

  def _lease(self, group: list[config_lib.Trial]) -> list[config_lib.Trial]:
    """The members of a group this worker now holds the lease of (and that are still unfinished)."""
    held = []
    for t in group:
      if self.store.is_done(t.id):
        continue
      lease = self.store.lease(t.id, self.lease_timeout, self.worker)
      steps = t.config["train"]["steps"]
      if lease is None:
        if t.id not in self.told:
          self.told.add(t.id)
          other, _ = leases.read(os.path.join(self.store.trial_dir(t.id), leases.LEASE))
          self.stream.write(f"trial {self.name(t)} is held by {leases.describe(other or {})}: left to it\n")
          self.progress.total -= steps
        continue
      if self.store.is_done(t.id):  # finished by its holder in between
        self.store.release(t.id)
        continue
      if t.id in self.told:
        self.told.discard(t.id)
        self.progress.total += steps
      if lease.took_over is not None:
        self.stream.write(f"trial {self.name(t)}: taken over from {leases.describe(lease.took_over)}: "
                          f"{lease.took_over['reason']}\n")
      damage = self.store.damage(t.id)
      if damage:
        self.stream.write(f"trial {self.name(t)}: warning: {damage}: re-running it from its checkpoint\n")
      held.append(t)
    return held

  def _train(self, train, group: list[config_lib.Trial]) -> list[str] | None:
    """Trains the held trials of one group; their statuses (none if it lost them), None when preempted."""
    store, progress, stream = self.store, self.progress, self.stream
    ids = [t.id for t in group]
    label, steps = _label(group), group[0].config["train"]["steps"]
    first = self.started + 1
    self.started += len(group)
    if first == 1:  # nothing else is printed until its first step, and the first build in a process is slow
      stream.write(f"trial {first}/{progress.n} [{label}]: building its model and compiling its step (XLA compiles "
                   "each initializer once per process: seconds to a minute on a CPU, less when the compilation "
                   "cache already holds them)\n")
      stream.flush()

    def on_start(j: int, step: int) -> None:
      for problem in store.start(group[j].id, resume_from=step):
        stream.write(f"trial {self.name(group[j])}: warning: {problem}: dropped\n")
      if self.tb is not None:  # the run from the rows the store keeps, then each new one
        kept = read_rows(os.path.join(store.trial_dir(group[j].id), PARTIAL)) if step else []
        self.tb.start(group[j].id, group[j].label, kept)
      if step:
        progress.total -= step
        stream.write(f"trial {self.name(group[j])} resumes at step {step} from {store.checkpoint_dir(group[j].id)}\n")

    def on_step(step: int, loss: float) -> None:
      progress.update(first, len(group), label, step, steps, loss)

    def on_compiled(step_fn: Any, evaluate: Any) -> None:
      check_memory(group, [step_fn, evaluate])

    def on_row(j: int, row: dict[str, Any]) -> None:
      store.append(ids[j], row)  # the store first: TensorBoard shows only rows it holds
      if self.tb is not None:
        self.tb.row(ids[j], row)

    # Alone, an error of the trial's own is recorded; in a group it ends the group (module docstring).
    recorded = (ConfigError, ValueError, TypeError, RuntimeError, FloatingPointError) if self.orders is None else ()
    try:
      try:
        if self.orders is not None:
          self.orders.send(ids)  # the other processes train these with this one
        self.timing = None
        summaries = train.train_group([t.config for t in group],
                                      on_row=on_row,
                                      on_step=on_step, vmap=config_lib.batched(self.vmap_seeds, self.pack),
                                      checkpoint_dirs=[store.checkpoint_dir(i) for i in ids],
                                      on_start=on_start, log=lambda line: stream.write(line + "\n"),
                                      on_compiled=on_compiled)
        self.timing = (len(group), summaries[0].get("step_time_s_median")) if summaries else None
      except Exception as e:  # the trial's own error is recorded; the machine's stops the worker (below)
        if not isinstance(e, recorded) or faults.classify(e) is not None:
          raise
        stream.write(f"\ntrial [{label}] failed: {type(e).__name__}: {e}\n")
        summaries = [{"status": "failed", "reason": f"error: {error_line(e)}"} for _ in group]
      statuses = []
      for t, summary in zip(group, summaries):
        try:
          where = {"worker": self.worker} if self.worker else {}  # where it ran: `attn status` shows it
          store.finish(t.id, {"id": t.id, "label": t.label, **summary, **where, "finished_unix": time.time()})
        except leases.LeaseLost as e:
          stream.write(f"trial {self.name(t)} not recorded: {e}\n")
          continue
        statuses.append(summary["status"])
        if summary["status"] == "failed":
          stream.write(f"trial {self.name(t)} failed: {summary['reason']}\n")
      return statuses
    except leases.LeaseLost as e:
      stream.write(f"\ntrial [{label}] stopped: {e}; left to the worker that holds it now\n")
      if self.orders is not None:  # the other processes are mid-trial, in collectives: the group ends
        raise
      return []
    except preempt.Preempted as p:
      for t in group:
        preempt.record(self.name(t), p.step)
      stream.write(f"\ntrial [{label}] saved at step {p.step} and stopped (preempted)\n")
      return None
    except Exception as e:  # a full disk, an I/O error: the trial stays resumable, no summary; the worker stops
      self.fault = faults.classify(e)
      if self.fault is None:
        raise
      for t in group:
        if not _done(store, t.id):
          store.interrupt(t.id, self.fault.reason)
      stream.write(f"\ntrial [{label}] interrupted: {self.fault.what}\n")
      if self.orders is not None:  # the other processes are mid-trial, in collectives: the group ends
        raise
      return None
    finally:
      for t in group:
        store.release(t.id)
        if self.tb is not None:
          self.tb.close(t.id)
