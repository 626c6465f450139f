"""`attn analyze DIR [--trial ID ...] [--batches N]`: inside the heads of each trained trial.

For every finished trial (or the ones named) it loads the final checkpoint
(attn.experiments.load_trial) and writes, beside the trial's metrics:

  trials/ID/analysis.json   per layer: W_QK and W_OV spectra (effective and
                            numerical rank per head), attention statistics on
                            held-out data, head importance, and for a causal
                            LM attention sinks, value drains and massive
                            activations (attn.analysis.sinks, threshold
                            train.sink_threshold); the pruning curve;
                            a summary the report compares across the sweep
  trials/ID/attention.png   one held-out example's attention, layers × heads
  trials/ID/spectra.png     singular values of W_QK,h and W_OV,h per layer
  trials/ID/importance.png  normalised head importance, layers × heads
  trials/ID/pruning.png     held-out accuracy and loss as heads are gated off

Data: attention statistics and the pruning curve use the held-out batches that
training evaluated, task.batch(seed, EVAL, j, batch_size) for j < eval_batches
(--batches N: the first N), so the curve's first point is the trial's final
eval_loss. Importance uses as many training batches (TRAIN, j): the pruning
order is not chosen on the batches that then score it. L(x) in the importance
is example x's own loss: its weighted mean cross-entropy.

`attn analyze --hf PATH --text FILE_OR_DIR --out DIR` runs the same analysis
on a pretrained Hugging Face model (attn.nn.hf.from_hf: a causal LM, a BERT
with or without its MLM head, each scored by its own objective, see
analyze_hf) and writes
DIR/analysis.json and the PNGs: held-out batches from the text's held-out
split, importance batches from its train split (attn.experiments.data.hf_text);
--batches N (default 4) of --batch-size windows of --seq-len tokens each.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import time
from typing import Any, TextIO

import numpy as np

from attn.config import ConfigError, invalid
from attn.experiments.running import store as store_lib
from attn.experiments.running.config import axis_name, show

ANALYSIS = "analysis.json"


def _fmt(x: float | None) -> str:
  """x to 2 decimals, or "–" where the analysis has no value (W_QK under QK-norm)."""
  return "–" if x is None else f"{x:.2f}"


def qk_rank(out: dict[str, Any]) -> str:
  """W_QK's mean effective rank, or "–" with the reason there is none (the variant's refusal of circuits)."""
  x = out["summary"]["qk_effective_rank"]
  if x is not None:
    return f"{x:.2f}"
  why = next((lay["qk"].get("refused") for lay in out.get("layers", []) if lay["qk"].get("refused")), None)
  return f"– ({why or 'no per-head W_QK to take the spectrum of'})"


_qk_rank = qk_rank  # the name before `attn analyze` moved to attn/cli/analyze.py


def _diversity(s: dict[str, Any]) -> str:
  if s["head_diversity"] is not None:
    return f"{s['head_diversity']:.3f}"
  return "– (rows are not distributions)" if s.get("attention_entropy") is None else "– (one head: no pair)"


def _has_checkpoint(run_dir: str, trial_id: str) -> bool:
  d = os.path.join(run_dir, "trials", trial_id, store_lib.CHECKPOINTS)
  return os.path.isdir(d) and any(name.isdigit() for name in os.listdir(d))


def select_trials(run_dir: str, trial_ids: list[str] | None = None) -> tuple[list[str], list[str]]:
  """(trials to analyse, lines saying which were skipped and why); refuses bad input before any work."""
  header = store_lib.load_sweep(run_dir)
  known = [t["id"] for t in header["trials"]]
  if trial_ids:
    for tid in trial_ids:
      if tid not in known:
        raise invalid("--trial", tid, f"one of the {len(known)} trials of {run_dir}: {', '.join(known)}")
    return list(dict.fromkeys(trial_ids)), []
  chosen, skipped, no_checkpoint = [], [], []
  for t in store_lib.iter_trials(run_dir):
    status = (t["summary"] or {}).get("status", "damaged" if t["damaged"] else "unfinished")
    if status != "ok":
      skipped.append(f"skipped {t['id']}: {status}")
    elif not _has_checkpoint(run_dir, t["id"]):
      no_checkpoint.append(t["id"])
    else:
      chosen.append(t["id"])
  if no_checkpoint and not chosen:
    raise invalid("DIR", run_dir,
                  f"a sweep whose finished trials have checkpoints: none of its {len(no_checkpoint)} finished "
                  f"trials has one (trained before attn saved checkpoints). Train them again: remove "
                  f"{os.path.join(run_dir, 'trials')} and run {store_lib.rerun_command(run_dir, header)}")
  if not chosen:
    raise invalid("DIR", run_dir, f"a sweep with a finished trial: none of its {len(known)} has finished; "
                  f"run {store_lib.rerun_command(run_dir, header)}")
  skipped += [f"skipped {tid}: finished without a checkpoint" for tid in no_checkpoint]
  return chosen, skipped


def analyze_sweep(run_dir: str, trial_ids: list[str] | None = None, batches: int | None = None,
                  plots: bool = True, stream: TextIO = sys.stderr) -> list[str]:
  """Analyses the chosen trials of a sweep (default: every finished one); returns their ids."""
  if batches is not None and (isinstance(batches, bool) or not isinstance(batches, int) or batches < 1):
    raise invalid("--batches", batches, "an integer >= 1")
  chosen, skipped = select_trials(run_dir, trial_ids)
  for line in skipped:
    stream.write(line + "\n")
  from attn.experiments.training import train  # lazy: jax
  train.enable_compilation_cache()
  t0 = time.perf_counter()
  for i, tid in enumerate(chosen):
    out = analyze_trial(run_dir, tid, batches, plots=plots)
    s = out["summary"]
    js = _diversity(s)
    sinks = f", first-position mass {_fmt(s['first_mass'])}, sink heads {_fmt(s['sink_heads'])}" \
        if "sink_heads" in s else ""
    stream.write(f"trial {i + 1}/{len(chosen)} {tid} [{_label(out['label'])}]: prunable "
                 f"{s['prunable_fraction']:.2f}, W_QK eff. rank {qk_rank(out)} "
                 f"(d_k={out['d_k']}), head JS {js}{sinks}, {out['seconds']:.1f} s\n")
  stream.write(f"analysed {len(chosen)} trials in {time.perf_counter() - t0:.1f} s\n")
  return chosen


def _label(label: dict[str, Any]) -> str:
  return ", ".join(f"{axis_name(k)}={show(v)}" for k, v in label.items()) or "–"


# ---- model glue: the jitted pieces take the model as (graphdef, state), so trials of one shape share them.

def _blocks(model) -> list:
  return list(model.blocks if hasattr(model, "blocks") else model.encoder.blocks)


def _circuit_params(model_cfg, blocks: list, i: int) -> dict:
  """Layer i's arrays; a layer reading another's keys and values (kv_source) holds no key side of
  its own, so its W_QK and W_OV take its source layer's (attn.nn.kv_sharing.KEY_SIDE)."""
  from attn.nn import kv_sharing
  params = dict(blocks[i].attn.params_dict())
  j = kv_sharing.source(model_cfg, i) if getattr(model_cfg, "kv_source", None) is not None else i
  if j != i:
    src = blocks[j].attn.params_dict()
    params.update({n: src[n] for n in kv_sharing.KEY_SIDE if n in src})
  return params


# A pretrained BERT's kinds: scored by the objective it was trained with (reading.losses.OBJECTIVES).
HF_ENCODER_KINDS = ("masked_lm", "sentence_pairs")


def _forward(model, batch: dict[str, Any], kind: str, gates=None, return_weights: bool = False):
  if kind in HF_ENCODER_KINDS:
    return model.hidden(batch["tokens"], lengths_B=batch["lengths"], head_mask=gates,
                        return_weights=return_weights)
  if kind == "decoder_lm":
    return model(batch["tokens"], head_mask=gates, return_weights=return_weights)
  return model(batch["tokens"], batch["lengths"], head_mask=gates, return_weights=return_weights)


def _residual_stats(h_BTD, real_BT) -> dict[str, Any]:
  """The residual stream after a block at real positions: its largest |h| and its median |h|.

  Sun et al. 2024's "massive activations" are a few entries thousands of times
  the median; residual_max / residual_median says how far from that a model is.
  """
  import jax.numpy as jnp
  a_BTD = jnp.where(real_BT[..., None], jnp.abs(h_BTD.astype(jnp.float32)), jnp.nan)
  return {"residual_max": jnp.nanmax(a_BTD), "residual_median": jnp.nanmedian(a_BTD)}


def _per_example(logits, batch: dict[str, Any]):
  """A classifier's (nll (B,), hits (B,), weights (B,) of ones), as train._loss weighs them."""
  import jax.numpy as jnp
  import optax
  logits, labels = logits.astype(jnp.float32), batch["labels"]
  nll = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  return nll, (jnp.argmax(logits, -1) == labels).astype(jnp.float32), jnp.ones(labels.shape, jnp.float32)


@functools.lru_cache(maxsize=None)
def _compiled(graphdef, kind: str, sink_threshold: float = 0.3, domain_fn=None):
  """The jitted gradient, pruning and statistics functions of one model shape.

  A causal LM's statistics also hold attn.analysis.sinks' per layer (under "sinks"), with
  sink_threshold, and by domain_fn's domain where given (bigram_backcopy's triggers).
  """
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from attn import analysis
  from attn.analysis import sinks
  from attn.experiments.reading import losses as losses_lib
  from attn.nn import models

  def losses(state, batch, gates, own_pair_gradient=False):
    """Per example (summed nll, summed hits, summed weights); token-level kinds as `attn eval` scores them."""
    model = nnx.merge(graphdef, state)
    if kind == "decoder_lm" or kind in HF_ENCODER_KINDS:
      return losses_lib.example_losses(model, batch, "next_token" if kind == "decoder_lm" else kind, gates,
                                     own_pair_gradient)
    return _per_example(_forward(model, batch, kind, gates), batch)

  def gate_grads(state, batch, gates_BLH):
    def example_loss(g_BLH):  # sentence pairs: each pair's own gradient (ranking_loss's own_pair_gradient)
      nll, _, w = losses(state, batch, g_BLH, own_pair_gradient=True)
      return nll / jnp.maximum(w, 1.0)
    return analysis.gate_gradients(example_loss, gates_BLH)

  def pruned(state, batches, gates_KLH):
    def at(g_LH):
      def one(batch):  # the batch mean, as training's evaluation computes it
        nll, hit, w = losses(state, batch, g_LH)
        return nll.sum() / jnp.maximum(w.sum(), 1.0), hit.sum() / jnp.maximum(w.sum(), 1.0)
      loss, acc = jax.lax.map(one, batches)
      return loss.mean(), acc.mean()
    return jax.lax.map(at, gates_KLH)

  def stats(state, batch):
    model = nnx.merge(graphdef, state)
    with models.record_residuals() as residuals, sinks.record_values() as values:
      _, weights = _forward(model, batch, kind, return_weights=True)
    sink_layers = [None] * len(weights)
    if kind == "decoder_lm" and len(values) == len(weights):
      windows = [block.attn.cfg.window for block in _blocks(model)]
      domain = None if domain_fn is None else domain_fn(batch["tokens"])
      sink_layers = sinks.sink_stats(weights, values, residuals, sink_threshold, windows, domain)
    out = []
    for w_BHTS, h_BTD in zip(weights, residuals):
      T, S = w_BHTS.shape[-2:]
      if kind == "decoder_lm":
        mask = jnp.tril(jnp.ones((T, S), bool))
        real_BT = jnp.ones(h_BTD.shape[:2], bool)
      else:  # real positions ([CLS] first, when the model has one) attend real positions
        extra = T - batch["tokens"].shape[1]
        real_BT = jnp.arange(T)[None, :] < batch["lengths"][:, None] + extra
        mask = (real_BT[:, :, None] & real_BT[:, None, :])[:, None]
      out.append({**analysis.attention_stats(w_BHTS, mask), **_residual_stats(h_BTD, real_BT)})
    return out, sink_layers, [w_BHTS[0] for w_BHTS in weights]

  return jax.jit(gate_grads), jax.jit(pruned), jax.jit(stats)


@functools.lru_cache(maxsize=None)
def _spectra_fn(variant: str, head_cfg):
  import jax
  from attn import analysis

  def spectra(params):
    factors = analysis.circuit_factors(variant, params, head_cfg)
    return {name: analysis.spectrum_of_product(*factors[name]) for name in ("qk", "ov")}

  return jax.jit(spectra)


def _batches(task, seed: int, split: int, n: int, batch_size: int) -> dict[str, np.ndarray]:
  rows = [task.batch(seed, split, j, batch_size) for j in range(n)]
  return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


def _jsonable(x: Any) -> Any:
  """Lists of plain floats and ints; NaN and inf become None (JSON has neither)."""
  if isinstance(x, dict):
    return {k: _jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_jsonable(v) for v in x]
  if hasattr(x, "tolist"):
    return _jsonable(np.asarray(x).tolist())
  if isinstance(x, float):
    return x if math.isfinite(x) else None
  return x


def _mean(values: list[float]) -> float | None:
  finite = [v for v in values if v is not None and math.isfinite(v)]
  return float(np.mean(finite)) if finite else None


def _max(values: list[float | None]) -> float | None:
  finite = [v for v in values if v is not None and math.isfinite(v)]
  return float(max(finite)) if finite else None


def _ratio(a: float | None, b: float | None) -> float | None:
  return None if a is None or not b else a / b


def summarize(layers: list[dict[str, Any]], curve: dict[str, Any],
              signed: bool = False, probability: str = "softmax") -> dict[str, float | None]:
  """The scalars the report compares: means over layers and heads, head diversity, prunable fraction.

  signed: the variant's weights are a difference of softmaxes (differential), whose rows do not
  sum to 1 for want of a sink: no sink mass then. probability (HeadConfig.probability) other than
  "softmax": rows that are not distributions (sigmoid, ReLU), so no entropy, head diversity (a
  Jensen–Shannon divergence) or sink mass (one minus the row sum, which there is no sink's); the
  row sum is reported for every case.
  """
  over = lambda part, key: _mean([v for lay in layers for v in lay[part][key]])
  diversity = [lay["attention"]["diversity"] for lay in layers]
  rows_are_distributions = not signed and probability == "softmax"
  only = lambda value: value if rows_are_distributions else None
  return {"qk_effective_rank": over("qk", "effective_rank"), "qk_rank": over("qk", "rank"),
          "ov_effective_rank": over("ov", "effective_rank"), "ov_rank": over("ov", "rank"),
          "attention_entropy": only(over("attention", "entropy")), "attention_rank": over("attention", "rank"),
          "head_diversity": only(_mean([d for d in diversity if d is not None])),  # None with one head
          "first_mass": over("attention", "first_mass"), "sink_mass": only(over("attention", "sink_mass")),
          "row_sum": over("attention", "row_sum"),
          "residual_max": _max([lay["attention"]["residual_max"] for lay in layers]),
          "residual_max_over_median": _max([_ratio(lay["attention"]["residual_max"],
                                                   lay["attention"]["residual_median"]) for lay in layers]),
          "prunable_fraction": curve["prunable_fraction"], **_sink_summary(layers)}


def _sink_summary(layers: list[dict[str, Any]]) -> dict[str, float | None]:
  """attn.analysis.sinks.summary's sink_heads, value_drain, residual_first (and active_dormant) over layers."""
  if not all("sinks" in lay for lay in layers):
    return {}
  from attn.analysis import sinks
  import jax.numpy as jnp
  s = sinks.summary([{k: jnp.asarray(np.asarray(v, float)) for k, v in lay["sinks"].items()} for lay in layers])
  keys = ("sink_heads", "value_drain", "residual_first", "active_dormant")
  return {k: (None if not math.isfinite(float(s[k])) else float(s[k])) for k in keys if k in s}


def analyze_trial(run_dir: str, trial_id: str, batches: int | None = None, plots: bool = True) -> dict[str, Any]:
  """Analyses one trial from its final checkpoint; writes trials/ID/analysis.json (and PNGs); returns it."""
  from attn.experiments.training import checkpoints
  from attn.experiments.reading.trials import load_trial
  from attn.experiments.data import tasks
  t0 = time.perf_counter()
  trial_dir = os.path.join(run_dir, "trials", trial_id)
  cfg = store_lib.read_config(os.path.join(trial_dir, store_lib.CONFIG), store_lib.config_todo(run_dir))
  model, model_cfg, task = load_trial(run_dir, trial_id)
  step = checkpoints.steps(os.path.join(trial_dir, store_lib.CHECKPOINTS))[-1]  # the one load_trial read
  train = cfg["train"]
  n, B = batches or train["eval_batches"], train["batch_size"]
  held_out = _batches(task, train["seed"], tasks.EVAL, n, B)
  seen = _batches(task, train["seed"], tasks.TRAIN, n, B)
  about = {"trial": trial_id, "label": cfg.get("label", {}), "step": step, "task": cfg["task"]["name"]}
  return analyze_model(model, model_cfg, task.kind, held_out, seen, trial_dir, about, plots, t0,
                       train.get("sink_threshold", 0.3), getattr(task, "trigger_mask", None))


def analyze_model(model, model_cfg, kind: str, held_out: dict[str, np.ndarray], seen: dict[str, np.ndarray],
                  out_dir: str, about: dict[str, Any], plots: bool = True,
                  t0: float | None = None, sink_threshold: float = 0.3, domain_fn=None) -> dict[str, Any]:
  """Analyses one model on batches (n, B, ...) of its task; writes out_dir/analysis.json (and PNGs).

  held_out scores the attention statistics and the pruning curve; seen (other
  data) gives the importance that orders the pruning. about's keys lead the JSON.
  A causal LM's layers also get "sinks" (attn.analysis.sinks, threshold sink_threshold,
  domains by domain_fn), and the summary their sink_heads, value_drain, residual_first.
  """
  if getattr(model_cfg, "block_kinds", None) is not None and "mlp" in model_cfg.block_kinds:
    raise invalid("block_kinds", model_cfg.block_kinds, "no 'mlp' entry: attn analyze reads one attention layer "
                  "per block, and an MLP-only block (NemotronH's) has none")
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from attn import analysis
  from attn import api as attn_api
  from attn.analysis import sinks
  from attn.analysis.attention_stats import RANK_RTOL
  t0 = time.perf_counter() if t0 is None else t0
  n, B = held_out["tokens"].shape[:2]
  signed = attn_api.get_variant(model_cfg.variant).signed_weights
  graphdef, state = nnx.split(model)
  gate_grads, pruned, stats = _compiled(graphdef, kind, sink_threshold, domain_fn)
  blocks = _blocks(model)
  L, H = len(blocks), model_cfg.num_heads

  spectra = []
  for i, block in enumerate(blocks):  # each layer's own variant and head (layer_heads may vary them)
    try:
      spectra.append(jax.device_get(_spectra_fn(block.attn.variant, block.attn.cfg)(
          _circuit_params(model_cfg, blocks, i))))
    except ConfigError as e:  # no per-head W_QK (differential, tpa): the refusal says why
      spectra.append({name: {"effective_rank": [], "rank": [], "singular_values": [], "refused": str(e)}
                      for name in ("qk", "ov")})

  per_batch, sink_batches, example = [], [], None
  for j in range(n):
    out, sink_layers, first = stats(state, {k: v[j] for k, v in held_out.items()})
    per_batch.append(jax.device_get(out))
    sink_batches.append(jax.device_get(sink_layers))
    example = example if example is not None else jax.device_get(first)
  # Equal batches: the mean of batch means is the mean; the largest residual is the largest of all.
  attention = [{k: (np.max if k == "residual_max" else np.mean)([b[l][k] for b in per_batch], axis=0)
                for k in per_batch[0][l]} for l in range(L)]
  # The sink statistics: each batch's masses and ratios, averaged over batches; a sink head is one whose
  # averaged mass exceeds the threshold.
  sink_stats = [None if sink_batches[0][l] is None else
                {k: np.nanmean([b[l][k] for b in sink_batches], axis=0) for k in sink_batches[0][l]}
                for l in range(L)]
  sink_stats = [s if s is None else {**s, **jax.device_get(sinks.head_fractions(s, sink_threshold))}
                for s in sink_stats]

  ones = jnp.ones((B, L, H), jnp.float32)
  grads = np.concatenate([np.asarray(gate_grads(state, {k: v[j] for k, v in seen.items()}, ones))
                          for j in range(n)])
  importance = analysis.head_importance(grads)
  curve = analysis.pruning_curve(lambda g: jax.device_get(pruned(state, held_out, jnp.asarray(g))),
                                 importance)

  layers = []
  for l in range(L):
    layers.append({
        **{name: dict(spectra[l][name]) for name in ("qk", "ov")},
        "attention": attention[l],
        **({} if sink_stats[l] is None else {"sinks": sink_stats[l]}),
        "importance": {"raw": importance["raw"][l], "normalized": importance["normalized"][l]}})
  layers = _jsonable(layers)
  result = _jsonable({
      **about, "variant": model_cfg.variant,
      "num_layers": L, "num_heads": H, "d_model": model_cfg.d_model, "d_k": model_cfg.head.d_k,
      "d_v": model_cfg.head.d_v,
      "data": {"held_out_batches": n, "importance_batches": seen["tokens"].shape[0], "batch_size": B,
               "importance_split": "train", "attention_rank_rtol": RANK_RTOL},
      "eval": {"loss": curve["loss"][0], "accuracy": curve["accuracy"][0]},
      "layers": layers, "pruning": curve, "summary": summarize(layers, curve, signed, model_cfg.head.probability),
      "example": {"tokens": held_out["tokens"][0, 0]}})
  if plots:
    from attn.experiments.reading import analysis_plots
    result["plots"] = analysis_plots.make_plots(result, [np.asarray(w) for w in example], out_dir)
  result["seconds"] = time.perf_counter() - t0
  store_lib.write_json(os.path.join(out_dir, ANALYSIS), result)
  return result


HF_BATCHES = 4


def analyze_hf(path: str, text: str, out_dir: str, batches: int = HF_BATCHES, plots: bool = True,
               glob: str | None = None, seq_len: int = 128, batch_size: int = 8) -> dict[str, Any]:
  """The analysis of a pretrained Hugging Face model on local text; writes out_dir/analysis.json (and PNGs).

  Held-out batches (statistics, pruning curve) come from the corpus's held-out
  split, importance batches from its train split, both full windows of seq_len
  tokens cut by the checkpoint's own tokenizer (attn.experiments.data.hf_text).
  The loss is the model's own objective (reading.losses.objective): next-token
  for a causal LM, masked-LM for a BertForMaskedLM, and for a BertModel without
  an MLM head (a sentence encoder) the in-batch ranking loss of window halves,
  whose accuracy is top-1 retrieval; its importance is each pair's own gradient
  (attn.analysis.sentence.ranking_loss).
  """
  from attn.experiments.reading import losses as losses_lib
  from attn.nn import hf
  if isinstance(batches, bool) or not isinstance(batches, int) or batches < 1:
    raise invalid("--batches", batches, "an integer >= 1")
  if os.path.exists(out_dir) and not os.path.isdir(out_dir):
    raise invalid("--out", out_dir, "a directory (it is a file)")
  config = losses_lib.check_checkpoint(path)
  t0 = time.perf_counter()
  loaded = hf.from_hf(path)
  model, model_cfg = loaded
  seq_len = losses_lib.pair_seq_len(config, model, seq_len)
  data = {}
  for split in ("heldout", "train"):
    kind, data[split], _ = losses_lib.held_out_batches(
        path, text, model, config, seq_len, batch_size, batches * batch_size * seq_len, glob, split,
        whole=True, max_batches=batches)
  os.makedirs(out_dir, exist_ok=True)
  about = {"trial": None, "hf": os.path.abspath(path), "family": loaded.family, "text": text, "step": None,
           "label": {}, "task": "hf_text", "objective": kind}
  return analyze_model(model, model_cfg, "decoder_lm" if kind == "next_token" else kind, data["heldout"],
                       data["train"], out_dir, about, plots, t0)
