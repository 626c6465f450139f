"""Training: AdamW with warmup and cosine decay, a jitted step with donated state, held-out eval.

`train_group` trains trials that differ only in seed, or in the PACKABLE keys
(seed, lr, warmup_steps, end_lr_ratio: a pack, sweep.pack). With several
trials it stacks their parameters and runs one compiled program under jax.vmap
over the trial axis; each keeps its own data, init, optimiser state and
learning rate (a traced argument of the step, one per trial). Every step
yields, per seed, loss, accuracy, gradient/parameter/update norms and step
time. A non-finite loss or gradient stops that seed, which is recorded as
failed with the reason; the other seeds go on. With train.mesh (or
train.data_parallel) beyond one device the step and the evaluation run as one
program over a ("data", "heads") mesh of local devices, the batch or the seeds
split on "data", the attention heads on "heads"
(attn.experiments.training.parallel); the summary records the mesh.
With train.indexer "staged" each step runs its phase's program (dense,
warm-up, sparse: train.indexer_phase(step)), each compiled once.

In a trial of several processes (attn.experiments.training.distributed) every
process runs train_group on the same configs; the mesh spans them, each
loads only its rows of each batch, and only process 0 saves checkpoints (the
callbacks of the others, which write nothing, are theirs to leave empty).
Process 0 picks the checkpoint to resume from and the others restore that
same one; whether to stop for a save is agreed after every step.

Given checkpoint directories, a trial saves its state every
train.checkpoint_interval steps and at the end (attn.experiments.training.checkpoints)
and starts from its newest readable checkpoint. A resumed trial computes the
same rows and parameters, bit for bit on CPU, as one never stopped: data
batches depend only on (seed, step), the learning rate is looked up by step,
and the optimiser state (Adam moments and count) is restored with the model.
Once attn.experiments.training.preempt.save_now() asks, the loop saves after the step
it is in, waits for the save and raises preempt.Preempted (no summary).
"""

from __future__ import annotations

import math
import os
import sys
import time
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from attn import count, kernel
from attn.config import ConfigError, invalid
from attn.experiments.training import checkpoints
from attn.experiments.training import distributed
from attn.experiments.training import parallel
from attn.experiments.training import preempt
from attn.experiments.training import logit_eval, sink_eval
from attn.experiments.data import curriculum
from attn.experiments.data import tasks as tasks_lib
from attn.experiments.training.config import PACKABLE, TrainConfig, check_indexer
from attn.nn import kv_sharing, models
from attn.nn.config import ModelConfig
from attn.variants.mechanisms import selection

DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "attn", "jax")


def enable_compilation_cache(path: str | None = None) -> str:
  """Turns on JAX's persistent compilation cache (default ~/.cache/attn/jax, or $ATTN_JAX_CACHE)."""
  path = path or os.environ.get("ATTN_JAX_CACHE") or DEFAULT_CACHE
  os.makedirs(path, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return path


def model_config(model: dict[str, Any], task) -> ModelConfig:
  """The ModelConfig of a [model] table, with vocab_size, max_len and num_classes from the task."""
  derived = {"vocab_size": task.vocab_size, "max_len": task.seq_len + 1}
  if task.kind == "classifier":
    derived["num_classes"] = task.num_classes
  try:
    return ModelConfig(**{**model, **derived})
  except ConfigError as e:
    raise ConfigError(f"model.{e}") from None


def fit_d_ff(cfg: ModelConfig, kind: str, budget: int) -> ModelConfig:
  """cfg with d_ff chosen so the parameter count is nearest `budget` (P is affine in d_ff)."""
  p1, p2 = count.model_param_count(cfg.replace(d_ff=1), kind), count.model_param_count(cfg.replace(d_ff=2), kind)
  per_unit, rest = p2 - p1, p1 - (p2 - p1)
  d_ff = round((budget - rest) / per_unit)
  if d_ff < 1:
    raise invalid("sweep.param_budget", budget,
                  f"at least {rest + per_unit} for h={cfg.num_heads}, variant={cfg.variant} "
                  f"(attention and embeddings alone hold {rest})")
  return cfg.replace(d_ff=d_ff)


def attention_counts(cfg: ModelConfig, seq_len: int) -> dict[str, Any]:
  """Attention parameters (analytic, effective) and forward FLOPs per sequence, all layers that have attention.

  Each layer by its layer type (its head and variant). A layer reading another's keys and values
  (kv_source) holds no key-side weights and spends no FLOPs on them (attn count's figures); the
  effective count has no closed form then and is None. attention_measured names the figures
  measured for lack of a closed form (count.measured_figures); an effective count too large to
  measure makes it None.
  """
  at = [i for i in range(cfg.num_layers) if cfg.has_attention(i)]  # an MLP-only block (block_kinds) has none
  layers = [(cfg.layer_variant(i), cfg.layer_head(i), kv_sharing.source(cfg, i) != i) for i in at]
  pcs = [count.param_counts(variant, head) for variant, head, _ in layers]
  effective = [pc["effective"] for pc in pcs]
  shares = any(shared for _, _, shared in layers)
  out = {"attention_params_analytic": sum(int(pc["analytic"]) - (kv_sharing.dropped_count(v, h) if s else 0)
                                          for pc, (v, h, s) in zip(pcs, layers)),
         "attention_params_effective": None if None in effective or shares else sum(map(int, effective)),
         "attention_flops_fwd": sum(int(count.flops(v, h, seq_len)) - count.shared_flops_saved(cfg, i, seq_len)
                                    for i, (v, h, _) in zip(at, layers))}
  measured = sorted({f for v, h, _ in layers for f in count.measured_figures(v, h)})
  return {**out, "attention_measured": measured} if measured else out


def _weights(batch: dict[str, jax.Array], kind: str) -> jax.Array:
  """The weight of each scored position (LM tasks) or example (classifiers)."""
  return batch["weights"] if kind == "decoder_lm" else jnp.ones(batch["labels"].shape, jnp.float32)


def _scores(model, batch: dict[str, jax.Array], kind: str):
  """(cross-entropy, hit, weight) per position (LM tasks) or example, float32."""
  if kind == "decoder_lm":
    logits = model(batch["tokens"]).astype(jnp.float32)
    labels = batch["targets"]
  else:
    logits = model(batch["tokens"], batch["lengths"]).astype(jnp.float32)
    labels = batch["labels"]
  nll = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  return nll, (jnp.argmax(logits, -1) == labels).astype(jnp.float32), _weights(batch, kind)


def _loss(model, batch: dict[str, jax.Array], kind: str, denom=None):
  """Mean cross-entropy and accuracy (weighted positions for LM tasks), float32.

  denom: what the weighted sums are divided by; None: this batch's total weight
  (at least 1). A micro-batch passes its whole batch's, so that the micro-batch
  losses add up to the batch's.
  """
  nll, hit, w = _scores(model, batch, kind)
  denom = jnp.maximum(w.sum(), 1.0) if denom is None else denom
  return (nll * w).sum() / denom, (hit * w).sum() / denom


def schedule(train: TrainConfig) -> optax.Schedule:
  """Linear warmup from 0 to lr, then cosine decay to lr * end_lr_ratio at the last step."""
  steps, warmup = train.steps, max(min(train.warmup_steps, train.steps - 1), 0)
  return optax.warmup_cosine_decay_schedule(
      0.0, train.lr, warmup, max(steps, warmup + 1), end_value=train.lr * train.end_lr_ratio)


def optimizer(train: TrainConfig) -> optax.GradientTransformation:
  """AdamW (decay on matrices only) after global-norm clipping, before the learning rate.

  The step multiplies by -lr itself, with lr a traced argument taken from
  `schedule`, so the compiled program depends on shapes only and the
  persistent compilation cache serves runs that differ in steps or lr.
  """
  clip = optax.clip_by_global_norm(train.grad_clip) if train.grad_clip > 0 else optax.identity()
  decay_mask = lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)
  return optax.chain(clip, optax.scale_by_adam(train.b1, train.b2),
                     optax.add_decayed_weights(train.weight_decay, decay_mask))


def peak_bytes(compiled: Any) -> int:
  """The device memory a compiled program wants at its peak (XLA's memory analysis; 0 if it gives none)."""
  ma = compiled.memory_analysis()
  peak = int(getattr(ma, "peak_memory_in_bytes", 0) or 0)
  if peak or ma is None:
    return peak
  return sum(int(getattr(ma, f, 0) or 0) for f in ("argument_size_in_bytes", "output_size_in_bytes",
                                                   "temp_size_in_bytes")) - int(getattr(ma, "alias_size_in_bytes", 0) or 0)


def memory_estimate(config: dict[str, Any]) -> int:
  """Bytes one trial's train step wants on one device: XLA's memory analysis of the step compiled alone.

  Parameters, Adam's moments, gradients, activations at train.batch_size and workspace, from abstract
  shapes (nothing is initialised); compiled as it runs, so the persistent cache keeps it. With
  train.indexer "staged", the largest of its phases' steps.
  """
  task = tasks_lib.make_task(config["task"])
  model_cfg, train = ModelConfig(**config["model"]), TrainConfig(**config["train"])
  tx = optimizer(train)
  abstract = nnx.eval_shape(lambda: models.MODELS[task.kind](model_cfg, rngs=nnx.Rngs(0)))
  graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
  opt_state = jax.eval_shape(tx.init, params)
  batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype)
           for k, v in tasks_lib.batch_rows(task, 0, tasks_lib.TRAIN, 0, train.batch_size).items()}
  peaks = []
  for phase in train.indexer_phases():
    step, _ = _step_fns(graphdef, tx, task.kind, train.grad_accum, task, train, phase)
    with warnings.catch_warnings():
      warnings.filterwarnings("ignore", message=".*donated buffers.*")
      compiled = jax.jit(step, donate_argnums=(0, 1)).lower(
          params, opt_state, rest, batch, jax.ShapeDtypeStruct((), jnp.float32)).compile()
    peaks.append(peak_bytes(compiled))
  return max(peaks)


def _unpacked(config: dict[str, Any]) -> dict[str, Any]:
  return {**config, "train": {k: v for k, v in config["train"].items() if k not in PACKABLE}}


def _stack(trees: list[Any]) -> Any:
  return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def _batches(task, seeds: list[int], split: int, index: int, batch_size: int,
             rows: slice | None = None) -> dict[str, np.ndarray]:
  """Batch (split, index) of each seed, stacked; only `rows` of each (None: all), for one process's share."""
  per_seed = [tasks_lib.batch_rows(task, s, split, index, batch_size, rows) for s in seeds]
  return {k: np.stack([r[k] for r in per_seed]) for k in per_seed[0]}


def micro_batches(batch: dict[str, jax.Array], k: int) -> dict[str, jax.Array]:
  """The batch as k micro-batches (k, B/k, ...): micro-batch j holds rows j, j + k, j + 2k, ...

  Rows are dealt out this way, not cut in k runs, so that the B/k rows of every
  micro-batch keep the batch's split over the mesh's "data" axis: each device
  holds B/(k·N) rows of each micro-batch, and no row moves between devices.
  """
  return jax.tree.map(lambda x: jnp.swapaxes(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 0, 1), batch)


def _objective(model, batch: dict[str, jax.Array], kind: str, denom=None, indexer: str = "off",
               kl_weight: float = 1.0):
  """(what is differentiated, (loss, accuracy, indexer KL)): _loss, plus with train.indexer "warmup" or
  "sparse" kl_weight × the layers' indexer KL terms (attn.variants.selection.record_indexer_kl).

  indexer "dense" ("staged"'s first phase): _loss with every layer attending densely, the KL 0.
  """
  if indexer == "off":
    loss, acc = _loss(model, batch, kind, denom)
    return loss, (loss, acc, jnp.zeros((), jnp.float32))
  with selection.record_indexer_kl(indexer) as terms:
    loss, acc = _loss(model, batch, kind, denom)
  if indexer == "dense":
    return loss, (loss, acc, jnp.zeros((), jnp.float32))
  kl = sum(terms, jnp.zeros((), jnp.float32))
  return loss + kl_weight * kl, (loss, acc, kl)


def _value_and_grad(graphdef, kind: str, grad_accum: int, indexer: str = "off", kl_weight: float = 1.0):
  """(loss, accuracy, indexer KL), grads of the batch's mean loss (plus the indexer's term, train.indexer);
  with grad_accum > 1, micro-batch by micro-batch.

  The micro-batches run one after another under lax.scan, so only one holds
  activations at a time; their gradients, each of its weighted sum over the
  whole batch's weight, add up in float32 to the whole batch's gradient (to
  float32 summation order), then take the parameters' dtype. The indexer's KL,
  a mean over each micro-batch's queries, is averaged over the micro-batches.
  """
  def whole(params, rest, batch):
    def loss_fn(p):
      return _objective(nnx.merge(graphdef, p, rest), batch, kind, None, indexer, kl_weight)
    return _aux_and_grad(loss_fn, params)

  if grad_accum == 1:
    return whole

  def accumulated(params, rest, batch):
    denom = jnp.maximum(_weights(batch, kind).sum(), 1.0)

    def one(carry, micro):
      def loss_fn(p):
        value, aux = _objective(nnx.merge(graphdef, p, rest), micro, kind, denom, indexer, kl_weight / grad_accum)
        return value, (aux[0], aux[1], aux[2] / grad_accum)
      aux, grads = _aux_and_grad(loss_fn, params)
      total, g_sum = carry
      g_sum = jax.tree.map(lambda s, g: s + g.astype(jnp.float32), g_sum, grads)
      return (total + jnp.stack(aux), g_sum), None

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    (total, g_sum), _ = jax.lax.scan(one, (jnp.zeros(3, jnp.float32), zeros),
                                     micro_batches(batch, grad_accum))
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), g_sum, params)
    return (total[0], total[1], total[2]), grads

  return accumulated


def _aux_and_grad(loss_fn, params):
  """(loss_fn's aux, the gradient of its value)."""
  (_, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
  return aux, grads


def _indexer_only(params) -> Any:
  """A tree like params: True at the lightning indexer's parameters (selection.INDEXER_PARAMS)."""
  def name(path) -> str:
    keys = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    return next((str(k) for k in reversed(keys) if isinstance(k, str) and k != "value"), "")
  return jax.tree_util.tree_map_with_path(lambda path, _: name(path) in selection.INDEXER_PARAMS, params)


def _step_fns(graphdef, tx: optax.GradientTransformation, kind: str, grad_accum: int = 1, task=None,
              train: TrainConfig | None = None, phase: str | None = None):
  """The train step (grads, AdamW, -lr scaling, norms) and the held-out evaluation, unjitted.

  A task with a trigger_mask (bigram_backcopy) adds eval_trigger_loss and eval_trigger_accuracy, over
  the positions whose input is a trigger; train.sink_metrics adds the sink metrics (sink_eval),
  train.logit_metrics the largest attention logits (logit_eval).
  phase: the indexer phase the step runs (train.indexer_phase; None: train.indexer, which is not
  "staged"). "dense" attends densely in the step and the evaluation, and freezes the indexer.
  """
  domain_fn = getattr(task, "trigger_mask", None)
  indexer = phase or ("off" if train is None else train.indexer)
  if indexer == "staged":
    raise ValueError('_step_fns runs one phase: give phase (train.indexer_phase(step)) for train.indexer "staged"')
  value_and_grad = _value_and_grad(graphdef, kind, grad_accum, indexer,
                                   1.0 if train is None else train.indexer_kl_weight)

  def step(params, opt_state, rest, batch, lr):
    (loss, acc, kl), grads = value_and_grad(params, rest, batch)
    trained = _indexer_only(params) if indexer in ("warmup", "dense") else None
    if indexer == "dense":  # "staged"'s dense phase: everything but the (unused) indexer moves
      trained = jax.tree.map(lambda t: not t, trained)
    if trained is not None:  # the warm-up: only the indexer moves; the rest sees no gradient at all
      grads = jax.tree.map(lambda t, g: g if t else jnp.zeros_like(g), trained, grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    updates = jax.tree.map(lambda u: -lr * u, updates)
    new = optax.apply_updates(params, updates)
    if trained is not None:  # bit for bit: not even weight decay or a -0.0 update reaches a frozen parameter
      new = jax.tree.map(lambda t, a, b: a if t else b, trained, new, params)
      updates = jax.tree.map(lambda t, u: u if t else jnp.zeros_like(u), trained, updates)  # what was applied
    params = new
    metrics = {"loss": loss, "accuracy": acc, "grad_norm": optax.tree.norm(grads),
               "param_norm": optax.tree.norm(params), "update_norm": optax.tree.norm(updates)}
    if indexer not in ("off", "dense"):
      metrics["indexer_kl"] = kl
    return params, opt_state, metrics

  def evaluate(params, rest, batches):
    if indexer == "dense":  # the dense phase is evaluated as it trains, attending densely
      with selection.record_indexer_kl("dense"):
        return held_out(params, rest, batches)
    return held_out(params, rest, batches)

  def held_out(params, rest, batches):
    model = nnx.merge(graphdef, params, rest)

    def one(batch):
      nll, hit, w = _scores(model, batch, kind)
      ws = [w] if domain_fn is None else [w, w * domain_fn(batch["tokens"])]
      return [((nll * v).sum() / jnp.maximum(v.sum(), 1.0), (hit * v).sum() / jnp.maximum(v.sum(), 1.0))
              for v in ws]
    means = jax.tree.map(jnp.mean, jax.lax.map(one, batches))
    out = {"eval_loss": means[0][0], "eval_accuracy": means[0][1]}
    if domain_fn is not None:
      out.update(eval_trigger_loss=means[1][0], eval_trigger_accuracy=means[1][1])
    if train is not None and train.sink_metrics:
      tokens_BT = batches["tokens"][0]
      out.update(sink_eval.row_metrics(sink_eval.model_stats(model, tokens_BT, train.sink_threshold, domain_fn)))
    if train is not None and train.logit_metrics:
      out.update(logit_eval.row_metrics(model, batches["tokens"][0]))
    return out

  return step, evaluate


def train_group(configs: list[dict[str, Any]],
                on_row: Callable[[int, dict[str, Any]], None],
                on_step: Callable[[int, float], None] | None = None,
                vmap: bool = True,
                checkpoint_dirs: list[str] | None = None,
                on_start: Callable[[int, int], None] | None = None,
                log: Callable[[str], None] | None = None,
                on_compiled: Callable[[Any, Any], None] | None = None) -> list[dict[str, Any]]:
  """Trains trials equal but for train.seed (or the PACKABLE keys); calls on_row(i, row) per trial and step.

  checkpoint_dirs: one directory per trial to save checkpoints in and resume
  from (None: neither). on_start(i, step) is called once per trial, before its
  first row, with the step it starts at (0, or its checkpoint's). log receives
  warning lines (an unreadable checkpoint); default stderr. on_compiled(step,
  evaluate) receives each program's compiled train step and evaluation
  (jax.stages.Compiled: memory_analysis(), as_text(), input_shardings) before it runs.
  """
  cfg0 = configs[0]
  for i, c in enumerate(configs[1:], 1):
    if _unpacked(c) != _unpacked(cfg0):
      differ = sorted(f"{s}.{k}" for s in c for k in set(c[s]) | set(cfg0[s])
                      if s in cfg0 and c[s].get(k) != cfg0[s].get(k) and not (s == "train" and k in PACKABLE))
      raise invalid("configs", i, "trials that differ only in train." + ", train.".join(PACKABLE)
                    + f" (trial {i} differs from trial 0 in {', '.join(differ) or 'its sections'})")
  task = tasks_lib.make_task(cfg0["task"])
  model_cfg = ModelConfig(**cfg0["model"])
  train, kind = TrainConfig(**cfg0["train"]), task.kind
  trains = [TrainConfig(**c["train"]) for c in configs]
  seeds = [t.seed for t in trains]
  check_indexer(train, model_cfg)
  lr_steps = jnp.arange(train.steps)  # each trial's learning rate at each step, from its own schedule
  lrs = np.stack([np.asarray(jax.vmap(schedule(t))(lr_steps)) for t in trains])
  batched = vmap and len(seeds) > 1
  # Refuses a mesh that does not fit, before any model is built.
  layout = parallel.layout(train, len(seeds) if batched else 1, batched, model_cfg.num_heads,
                           jax.process_count())
  leader = jax.process_index() == 0
  tx = optimizer(train)
  graphdef, states = None, []
  for s in seeds:
    graphdef, p, r = nnx.split(models.MODELS[kind](model_cfg, rngs=nnx.Rngs(s)), nnx.Param, ...)
    # The donated step needs a buffer per leaf; an init handing one array to two leaves would fail.
    p = jax.tree.map(jnp.copy, p)
    states.append({"params": p, "opt_state": tx.init(p), "rest": r})
  s0 = states[0]
  layout = layout.with_state(nnx.merge(graphdef, s0["params"], s0["rest"]), s0["params"], s0["opt_state"],
                             s0["rest"], tx)
  # One (step, evaluation) per indexer phase (train.indexer_phase; one phase but with "staged"); the
  # phases from the warm-up on share one evaluation (on the selection), the dense phase has its own.
  programs, selected_eval = {}, None
  for phase in train.indexer_phases():
    step, evaluate = _step_fns(graphdef, tx, kind, train.grad_accum, task, train, phase)
    if batched:
      step, evaluate = jax.vmap(step), jax.vmap(evaluate)
    if phase != "dense":  # the warm-up's evaluation is the sparse phase's: one program
      selected_eval = selected_eval or evaluate
      evaluate = selected_eval
    programs[phase] = (step, evaluate)
  counts = {"model_params": count.model_param_count(model_cfg, kind), **attention_counts(model_cfg, task.seq_len)}
  summaries: list[dict[str, Any]] = [{} for _ in seeds]
  groups = [list(range(len(seeds)))] if batched else [[i] for i in range(len(seeds))]
  log = log or (lambda line: print(line, file=sys.stderr))
  for group in groups:
    dirs = [checkpoint_dirs[i] for i in group] if checkpoint_dirs else None
    start, restored = 0, None
    if dirs and leader:
      start, restored = checkpoints.resume(dirs, [states[i] for i in group], train.steps, log)
    if dirs and layout.processes > 1:  # the others restore the very checkpoint process 0 chose
      start = distributed.broadcast(start)
      if not leader and start:
        restored = [checkpoints.restore(d, start, states[i]) for d, i in zip(dirs, group)]
    group_states = restored or [states[i] for i in group]
    for i in group:
      if on_start:
        on_start(i, start)
    state = _stack(group_states) if batched else group_states[0]
    with kernel.record_picks() as picks:  # what each attention call ran ("auto" resolved), at trace time
      out = _run(task, train, [seeds[i] for i in group], (state["params"], state["opt_state"], state["rest"]),
                 lrs[group],
                 programs, lambda j, row, group=group: on_row(group[j], row), on_step, batched, start, dirs,
                 layout, on_compiled)
    for i, summary in zip(group, out):
      summaries[i] = {**summary, **counts, "attention_impls": dict(sorted(picks.items()))}
  return summaries


def _run(task, train: TrainConfig, seeds: list[int], state, lrs: np.ndarray, programs: dict[str, tuple],
         on_row, on_step, batched: bool, start: int = 0,
         checkpoint_dirs: list[str] | None = None,
         layout: parallel.Layout = parallel.Layout(),
         on_compiled: Callable[[Any, Any], None] | None = None) -> list[dict[str, Any]]:
  """Compiles and runs one (possibly vmapped) program over `seeds` from step `start`; returns their summaries.

  lrs: each trial's learning rate at each step, (len(seeds), train.steps). programs: (step, evaluation)
  per indexer phase; step t runs train.indexer_phase(t)'s, and only the phases of steps [start, steps)
  are compiled (an evaluation shared by phases, once).
  """
  n, B = len(seeds), train.batch_size
  pick = (lambda b: b) if batched else (lambda b: jax.tree.map(lambda x: x[0], b))
  at = (lambda v, j: v[j]) if batched else (lambda v, j: v)
  rows = layout.rows(B)  # this process's share of every batch (all of it in one process)
  eval_data = _stack([pick(_batches(task, seeds, tasks_lib.EVAL, j, B, rows)) for j in range(train.eval_batches)])
  if batched:  # (eval batch, seed, ...) -> (seed, eval batch, ...)
    eval_data = jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), eval_data)
  eval_data = layout.put_batch(eval_data, "eval")
  state = tuple(layout.put(x, kind) for x, kind in zip(state, parallel.STATE_KINDS))
  t0 = time.perf_counter()
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*donated buffers.*")
    lr0 = jnp.zeros((n,) if batched else (), jnp.float32)
    batch0 = layout.put_batch(pick(_batches(curriculum.train_task(task, start, train.steps), seeds, tasks_lib.TRAIN,
                                            start, B, rows)), "train")
    jit_steps, jit_evals, evals = {}, {}, {}

    def compiled_step(phase: str, batch):
      """The train step of `phase` compiled for batch's shapes (a length curriculum: once per length)."""
      key = (phase, batch["tokens"].shape)
      if key not in jit_steps:
        jit_steps[key] = layout.jit(programs[phase][0], parallel.STATE_KINDS + ("train", "replicated"),
                                    ("params", "opt_state", "replicated"), donate=(0, 1)).lower(
                                        *state, batch, lr0).compile()
      return jit_steps[key]

    for phase in train.indexer_phases(start):
      step_fn, eval_fn = programs[phase]
      compiled_step(phase, batch0)
      if id(eval_fn) not in evals:
        evals[id(eval_fn)] = layout.jit(eval_fn, ("params", "rest", "eval"), "replicated").lower(
            state[0], state[2], eval_data).compile()
      jit_evals[phase] = evals[id(eval_fn)]
  compile_s = time.perf_counter() - t0
  if on_compiled:
    for phase, shape in list(jit_steps):
      on_compiled(jit_steps[phase, shape], jit_evals[phase])
  if layout.agree(preempt.requested()):  # save_now() during the compile: nothing new to save
    raise preempt.Preempted(start)
  summaries: list[dict[str, Any] | None] = [None] * n
  times, checkpoint_s, every = [], 0.0, train.checkpoint_interval
  savers = [checkpoints.Saver(d) for d in checkpoint_dirs or []] if jax.process_index() == 0 else []
  try:
    for t in range(start, train.steps):
      batch = layout.put_batch(pick(_batches(curriculum.train_task(task, t, train.steps), seeds, tasks_lib.TRAIN,
                                             t, B, rows)), "train")
      phase = train.indexer_phase(t)
      t0 = time.perf_counter()
      step_fn = compiled_step(phase, batch)  # a new curriculum stage compiles here
      compile_s += time.perf_counter() - t0
      t0 = time.perf_counter()
      lr = layout.put(np.asarray(lrs[:, t], np.float32).reshape(lr0.shape), "replicated")
      params, opt_state, m = step_fn(*state, batch, lr)
      m = layout.fetch(m)
      times.append(time.perf_counter() - t0)
      state = (params, opt_state, state[2])
      last = t == train.steps - 1
      ev = layout.fetch(jit_evals[phase](state[0], state[2], eval_data)) \
          if last or (train.eval_every > 0 and (t + 1) % train.eval_every == 0) else None
      for j in range(n):
        if summaries[j] is not None and summaries[j]["status"] == "failed":
          continue
        row = {"step": t, **{k: float(at(v, j)) for k, v in m.items()}, "lr": float(lrs[j, t]),
               "step_time_s": times[-1], **{k: float(at(v, j)) for k, v in (ev or {}).items()}}
        if train.indexer == "staged":
          row["indexer_phase"] = phase
        bad = [k for k in ("loss", "grad_norm") if not math.isfinite(row[k])]
        if bad:  # this seed stops here; the others go on
          summaries[j] = {"status": "failed", "steps_done": t,
                          "reason": f"non-finite {bad[0]}={row[bad[0]]} at step {t}"}
          continue
        on_row(j, row)
        if last:
          summaries[j] = {"status": "ok", "steps_done": t + 1,
                          "final": {k: row[k] for k in ("loss", "accuracy", "eval_loss", "eval_accuracy")}}
      stop = not last and layout.agree(preempt.requested())  # save_now(): save after this step and stop
      if savers and (stop or last or (every > 0 and (t + 1) % every == 0)):
        t0 = time.perf_counter()
        tree = layout.fetch({"params": state[0], "opt_state": state[1], "rest": state[2]})
        for j, saver in enumerate(savers):
          if summaries[j] is None or summaries[j]["status"] == "ok":  # a failed seed keeps its last good one
            saver.save(t + 1, jax.tree.map(lambda v, j=j: at(v, j), tree))
        checkpoint_s += time.perf_counter() - t0
      if on_step:
        on_step(t, float(np.mean(m["loss"])))
      if stop:
        for saver in savers:
          saver.wait()  # the checkpoint is in place before save_now() returns
        raise preempt.Preempted(t + 1)
      if all(s is not None and s["status"] == "failed" for s in summaries):
        break
  finally:  # also on an error: no save is left running (the final one completes before the summary)
    t0 = time.perf_counter()
    for saver in savers:
      saver.close()
    checkpoint_s += time.perf_counter() - t0
  timing = {"compile_s": compile_s, "group_size": n, "train_s": float(np.sum(times)),
            "step_time_s_median": float(np.median(times[1:] or times)),
            "checkpoint_s": checkpoint_s, "resumed_from": start, **layout.summary()}
  return [{**s, **timing} for s in summaries]
