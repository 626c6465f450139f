"""[train]: TrainConfig, the optimiser, schedule, evaluation, checkpoint and device settings of one trial.

Frozen and validated: every error names train.<field>, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from attn.config import invalid

# (lowest allowed, whether the lowest itself is allowed, what to say) per [train] field.
_TRAIN_RANGES = {
    "steps": (1, True, "an integer >= 1"), "batch_size": (1, True, "an integer >= 1"),
    "lr": (0.0, False, "a finite number > 0"), "warmup_steps": (0, True, "an integer >= 0"),
    "end_lr_ratio": (0.0, True, "a finite number >= 0"),
    "weight_decay": (0.0, True, "a finite number >= 0"),
    "b1": (0.0, True, "a number in [0, 1)"), "b2": (0.0, True, "a number in [0, 1)"),
    "grad_clip": (0.0, True, "a finite number >= 0 (0 turns clipping off)"),
    "eval_every": (0, True, "an integer >= 0 (0: only at the end)"),
    "eval_batches": (1, True, "an integer >= 1"), "seed": (0, True, "an integer >= 0"),
    "checkpoint_every": (0, True, "an integer >= 0 (0: at each evaluation, every eval_every steps)"),
    "grad_accum": (1, True, "an integer >= 1 (micro-batches per batch)"),
    "indexer_kl_weight": (0.0, False, "a finite number > 0 (the indexer's KL term's weight in the loss)"),
    "indexer_dense_steps": (0, True, 'an integer >= 0 (train.indexer = "staged": steps of dense training first)'),
    "indexer_warmup_steps": (1, True, 'an integer >= 1 (train.indexer = "staged": steps of the indexer\'s '
                             "warm-up after the dense ones)"),
}
# [train] keys whose values may differ between trials packed into one vmapped program (sweep.pack):
# the seed (data and init), and what only the learning-rate schedule reads, since the step takes its
# learning rate as a traced argument. Everything else (the model, the task, the batch, the optimiser's
# constants, the step count and cadences) shapes the compiled program or its loop and must be equal.
PACKABLE = ("seed", "lr", "warmup_steps", "end_lr_ratio")
# train.indexer: how the lightning indexer trains (DeepSeek-V3.2 §2.1; attn.variants.selection).
INDEXER_PHASES = ("off", "warmup", "sparse", "staged")
# The options only train.indexer = "staged" reads (None: unset).
STAGED_KEYS = ("indexer_dense_steps", "indexer_warmup_steps")
DATA_PARALLEL_AXES = ("batch", "seed")
MESH_KEYS = ("data", "heads")
MESH_ALLOWED = 'a table {data = N, heads = M}: data "auto" or an integer >= 1, heads an integer >= 1'


def _check_mesh(value: Any) -> dict[str, Any]:
  """train.mesh as given (None: unset), each key checked; else a ConfigError naming train.mesh[.key]."""
  if value is None:
    return {}
  if not isinstance(value, dict):
    raise invalid("train.mesh", value, MESH_ALLOWED)
  for key, n in value.items():
    if key not in MESH_KEYS:
      raise invalid(f"train.mesh.{key}", n, f"a key of train.mesh: {list(MESH_KEYS)}")
    auto_ok = key == "data" and n == "auto"
    if not auto_ok and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
      raise invalid(f"train.mesh.{key}", n, '"auto" (every local device) or an integer >= 1' if key == "data"
                    else "an integer >= 1 dividing model.num_heads")
  return dict(value)


def check_train_field(name: str, value: Any) -> Any:
  """value of [train] field `name`, checked alone (ints -> floats where a float is wanted); else a ConfigError."""
  if name == "sink_metrics":
    if not isinstance(value, bool):
      raise invalid("train.sink_metrics", value, "true (sink metrics at every evaluation) or false")
    return value
  if name == "logit_metrics":
    if not isinstance(value, bool):
      raise invalid("train.logit_metrics", value, "true (the largest attention logits at every evaluation) or false")
    return value
  if name == "sink_threshold":
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (number and math.isfinite(value) and 0 < value < 1):
      raise invalid("train.sink_threshold", value, "a number in (0, 1): a head is a sink head when its mean "
                    "attention on the first position exceeds it (Gu et al. 2024 use 0.3)")
    return float(value)
  if name == "data_parallel":
    if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
      raise invalid("train.data_parallel", value, '"auto" (every local device) or an integer >= 1')
    return value
  if name == "mesh":
    return _check_mesh(value)
  if name == "indexer":
    if value not in INDEXER_PHASES:
      raise invalid("train.indexer", value, '"off" (the indexer gets no gradient), "warmup" (only the indexer '
                    'trains, by its KL to the dense attention), "sparse" (the model on its selection, the '
                    'indexer by its KL on the selected keys) or "staged" (dense, then "warmup", then "sparse": '
                    "train.indexer_dense_steps, train.indexer_warmup_steps)")
    return value
  if name == "data_parallel_axis":
    if value not in DATA_PARALLEL_AXES:
      raise invalid("train.data_parallel_axis", value,
                    '"batch" (split each batch) or "seed" (one seed per device, with sweep.vmap_seeds)')
    return value
  if name in STAGED_KEYS and value is None:
    return value
  low, inclusive, allowed = _TRAIN_RANGES[name]
  number = isinstance(value, (int, float)) and not isinstance(value, bool)
  if _TRAIN_TYPES[name] in ("int", "int | None") and not (number and isinstance(value, int)):
    raise invalid(f"train.{name}", value, allowed)
  if _TRAIN_TYPES[name] == "float":
    if not number:
      raise invalid(f"train.{name}", value, allowed)
    value = float(value)  # 1 and 1.0 are one config, with one trial id
  ok = value >= low if inclusive else value > low
  if name in ("b1", "b2"):
    ok = ok and value < 1
  if not (ok and math.isfinite(value)):
    raise invalid(f"train.{name}", value, allowed)
  return value


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """[train]: optimiser, schedule, evaluation and checkpoint cadence of one trial.

  checkpoint_every: save model, optimiser state and step every this many steps
  and at the last step; 0 (the default) saves at each evaluation, every
  eval_every steps (with eval_every = 0 too, only at the end).

  data_parallel: local devices each train step and evaluation run on, or
  "auto" (all of them). The default 1 runs exactly the single-device program,
  so results made before this option existed, or on any machine, do not
  change; more devices give rows equal to float tolerance (summed in another
  order), and the summary records the count used. data_parallel_axis: "batch"
  splits each batch (batch_size must be a multiple of the count), "seed"
  spreads seeds trained together (sweep.vmap_seeds) one or more per device.
  See attn.experiments.training.parallel.

  mesh: {data = N, heads = M}, one mesh of N·M local devices: "data" is
  data_parallel (give one or the other), "heads" splits every attention layer
  by heads over M devices (M must divide num_heads). Resolved, both are set:
  data_parallel = mesh["data"] (default 1) and mesh["heads"] (default 1).

  grad_accum: k splits each train batch into k micro-batches of
  batch_size / k rows, run one after another inside the compiled step, their
  gradients summed: the update of the whole batch (to float32 summation
  order) with the activations of one micro-batch. k must divide batch_size,
  and each micro-batch must split over the data-parallel devices. Evaluation
  batches are not split.

  sink_metrics: at every evaluation, also measure attention sinks, value
  drains and massive activations per layer and head on the first held-out
  batch (attn.experiments.training.sink_eval; language-model tasks only);
  sink_threshold: the first-position mass above which a head counts as a
  sink head, in (0, 1) (Gu et al. 2024: 0.3).

  logit_metrics: at every evaluation, also the largest attention score and
  logit per softmax layer and over the model on the first held-out batch
  (attn.experiments.training.logit_eval; language-model tasks only).

  indexer: how a model with the lightning indexer (model.extra.indexer) trains, DeepSeek-V3.2's two
  phases (DeepSeek-AI 2025, §2.1; docs/key_selection.md). "off" (the default): the model trains on
  its selection and the indexer gets no gradient. "warmup": every layer attends densely, the loss
  adds indexer_kl_weight × Σ_layers KL(p_t || Softmax(I_t)) (p_t the layer's attention summed over
  heads, L1-normalised), and only the indexer's parameters change (the others stay bit for bit: their
  gradients are zeroed before clipping and Adam, and their values kept after the update). "sparse": every layer attends to its selection; the loss adds the KL
  over the selected keys, which reaches only the indexer (its inputs detached), while the language
  model's loss reaches only the rest (the choice has no gradient). The rows add indexer_kl.
  Evaluation runs the model as configured (its selection) in every phase.

  indexer = "staged": DeepSeek-V3.2's whole recipe in one trial, each step's phase a function of the
  step alone (indexer_phase; a resumed trial continues in its phase). With N1 = indexer_dense_steps
  (>= 0) and N2 = indexer_warmup_steps (>= 1), both required and N1 + N2 < steps: steps [0, N1)
  "dense": every indexer layer attends densely (no selection), the loss is the language model's
  alone, and the indexer, unused, stays bit for bit (its gradients zero, its values kept after the
  update: not even weight decay reaches it); steps [N1, N1 + N2) are "warmup"'s step and steps
  [N1 + N2, steps) "sparse"'s, the same compiled functions. One optimiser state and one learning-rate
  schedule (warmup_steps, cosine over all `steps`) run through the phases: Adam's count is global,
  and the moments of what a phase freezes decay with zero gradients. Rows add indexer_phase ("dense",
  "warmup", "sparse") and, from the warm-up on, indexer_kl. Evaluation in the dense phase attends
  densely (as that phase trains; an untrained indexer's selection says nothing of it); from the
  warm-up on it runs on the selection, as "warmup" and "sparse" do (the warm-up leaves the rest bit
  for bit, so a dense evaluation would repeat the dense phase's last value, while the selection's
  shows what the warm-up buys); the final summary, after a sparse step, is the sparse model's.
  indexer_dense_steps and indexer_warmup_steps are refused with any other mode; they shape the
  trial's loop, so trials packed together (sweep.pack) share them.
  """

  steps: int = 200
  batch_size: int = 32
  lr: float = 3e-3
  warmup_steps: int = 20
  end_lr_ratio: float = 0.1
  weight_decay: float = 0.01
  b1: float = 0.9
  b2: float = 0.98
  grad_clip: float = 1.0
  eval_every: int = 50
  eval_batches: int = 4
  seed: int = 0
  checkpoint_every: int = 0
  data_parallel: int | str = 1
  data_parallel_axis: str = "batch"
  grad_accum: int = 1
  mesh: dict[str, Any] | None = None
  sink_metrics: bool = False
  sink_threshold: float = 0.3
  logit_metrics: bool = False
  indexer: str = "off"
  indexer_kl_weight: float = 1.0
  indexer_dense_steps: int | None = None
  indexer_warmup_steps: int | None = None

  def __post_init__(self):
    for f in dataclasses.fields(self):
      object.__setattr__(self, f.name, check_train_field(f.name, getattr(self, f.name)))
    self._check_staged()
    mesh = self.mesh
    if "data" in mesh and self.data_parallel not in (1, mesh["data"]):
      raise invalid("train.mesh.data", mesh["data"],
                    f"unset, or train.data_parallel={self.data_parallel}: both name the mesh's data axis")
    object.__setattr__(self, "data_parallel", mesh.get("data", self.data_parallel))
    object.__setattr__(self, "mesh", {"data": self.data_parallel, "heads": mesh.get("heads", 1)})
    B, N = self.batch_size, self.data_parallel
    if self.data_parallel_axis == "batch" and N != "auto" and B % N:
      raise invalid("train.batch_size", B,
                    f"a multiple of train.data_parallel={N}: each train and eval batch is split evenly "
                    f"over the devices, and {B} rows over {N} devices leave {B % N} over")
    k = self.grad_accum
    if B % k:
      raise invalid("train.grad_accum", k,
                    f"a divisor of train.batch_size={B} (micro-batches of equal size): one of "
                    f"{[d for d in range(1, B + 1) if B % d == 0]}")
    if self.data_parallel_axis == "batch" and N != "auto" and (B // k) % N:
      raise invalid("train.grad_accum", k,
                    f"a divisor of train.batch_size={B} leaving micro-batches that split over "
                    f"train.data_parallel={N} devices: {B} // {k} = {B // k} rows do not; one of "
                    f"{[d for d in range(1, B + 1) if B % (d * N) == 0]}")

  def _check_staged(self) -> None:
    """train.indexer "staged" needs both phase lengths and a sparse step after them; other modes neither."""
    if self.indexer != "staged":
      for key in STAGED_KEYS:
        if getattr(self, key) is not None:
          raise invalid(f"train.{key}", getattr(self, key),
                        f'unset with train.indexer={self.indexer!r}: it is read only by train.indexer = "staged"')
      return
    n1, n2 = self.indexer_dense_steps, self.indexer_warmup_steps
    for key, value, allowed in (("indexer_dense_steps", n1, "an integer >= 0"),
                                ("indexer_warmup_steps", n2, "an integer >= 1")):
      if value is None:
        raise invalid(f"train.{key}", value, f'{allowed}, given with train.indexer = "staged"')
    if n1 + n2 >= self.steps:  # blames the warm-up unless the dense steps alone leave no room for one
      key, value = ("indexer_warmup_steps", n2) if n1 + 1 < self.steps else ("indexer_dense_steps", n1)
      raise invalid(f"train.{key}", value,
                    f"a value with train.indexer_dense_steps + train.indexer_warmup_steps < train.steps="
                    f"{self.steps}, leaving at least one sparse step ({n1} + {n2} leaves none)")

  def indexer_phase(self, step: int) -> str:
    """What step `step` runs: train.indexer itself, or for "staged" "dense", "warmup" or "sparse" by the step."""
    if self.indexer != "staged":
      return self.indexer
    if step < self.indexer_dense_steps:
      return "dense"
    return "warmup" if step < self.indexer_dense_steps + self.indexer_warmup_steps else "sparse"

  def indexer_phases(self, start: int = 0) -> list[str]:
    """The phases steps [start, steps) run, in order (indexer_phase): one, or for "staged" up to three."""
    cuts = [start] + ([b for b in (self.indexer_dense_steps, self.indexer_dense_steps + self.indexer_warmup_steps)
                       if start < b < self.steps] if self.indexer == "staged" else [])
    return list(dict.fromkeys(self.indexer_phase(t) for t in cuts))

  @property
  def checkpoint_interval(self) -> int:
    """Steps between checkpoints; 0: only the last step's."""
    return self.checkpoint_every or self.eval_every

  def replace(self, **changes) -> TrainConfig:
    return dataclasses.replace(self, **changes)


_TRAIN_TYPES = {f.name: f.type for f in dataclasses.fields(TrainConfig)}


def check_heads(train: TrainConfig, num_heads: int) -> None:
  """Refuses a mesh whose heads axis does not divide the model's query heads."""
  M = train.mesh["heads"]
  if num_heads % M:
    raise invalid("train.mesh.heads", M,
                  f"a divisor of model.num_heads={num_heads}: each of the {M} devices holds "
                  f"num_heads / {M} whole query heads, and {num_heads} leaves {num_heads % M} over; one of "
                  f"{[d for d in range(1, num_heads + 1) if num_heads % d == 0]}")


def check_indexer(train: TrainConfig, model_cfg: Any) -> None:
  """Refuses train.indexer "warmup" / "sparse" / "staged" for a model with no lightning indexer in any layer."""
  if train.indexer == "off":
    return
  heads = [model_cfg.layer_head(i) for i in range(model_cfg.num_layers)]
  if not any("indexer" in (h.extra or {}) for h in heads):
    raise invalid("train.indexer", train.indexer, '"off" for a model without the lightning indexer: give '
                  "model.extra.indexer (e.g. {heads = 4, head_dim = 32, top_k = 64}) to train one")
