"""Recall against memory: held-out accuracy against the state plus KV cache one sequence holds.

A softmax layer caches keys and values for every position it can still attend to (a sliding
layer at most its window), a fixed-state head (gated_deltanet, kda, mamba2, linear) keeps a state
whose size does not grow with the sequence; a hybrid keeps both. What a decoder holds after one
sequence of the task's length, all layers, float32 (`attn count`: model_kv_cache_bytes at that
length plus model_state_bytes), is the x axis here; held-out accuracy the y axis. A sweep whose
settings differ in it and where some setting keeps a state gets a section of report.md and
frontier_state_cache.png: one table and one panel per task setting (the task.* axes: MQAR's
num_pairs and seq_len), each seed a dot, the mean a bar, and the frontier of the means (no other
setting holds as few bytes and recalls more).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from attn.experiments.reading import plots as plots_lib
from attn.experiments.running.config import show


def sequence_bytes(trial: dict[str, Any]) -> tuple[int, int] | None:
  """(KV-cache bytes, state bytes) a decoder trial's model holds after one sequence of its task's length
  (all layers, float32); None for a model without a decoding cache (a classifier) or without a config."""
  from attn import count  # lazy: imports jax
  from attn.config import ConfigError
  from attn.experiments.data import tasks
  from attn.nn.config import ModelConfig
  cfg = trial.get("config") or {}
  try:
    kind = tasks.TASKS[cfg["task"]["name"]].kind
    if kind != "decoder_lm":
      return None
    model = ModelConfig(**cfg["model"])
    length = cfg["task"]["seq_len"]
    return (count.model_kv_cache_bytes(model, kind, length, "float32"),
            count.model_state_bytes(model, kind, "float32"))
  except (KeyError, TypeError, ConfigError):
    return None


DTYPE = "float32"
"""The one dtype every byte count of a report is in: what the trials trained and decode in (`attn count`'s default)."""


def table(rows: list[dict[str, Any]]) -> list[str]:
  """Markdown: what each group's model holds when decoding, on every task, or why a group holds nothing.

  Per group: the KV cache per generated token, the fixed state per sequence (linear heads), and the two
  together after one sequence of the trial's length T, all layers, float32 (`attn count`). A group whose
  model keeps no decoding cache (a classifier reads its whole input at once) is listed with that reason.
  """
  md = ["## Memory per group", "",
        f"What one sequence holds when decoding, all layers, in {DTYPE} (`attn count CONFIG`): the KV cache "
        "per generated token (a sliding layer's stops growing at its window), the fixed-size state of linear "
        "heads per sequence (with their convolutions' last inputs), and both together after one sequence of "
        "the trial's length T.", "",
        "| group | KV cache B/token | state B/sequence | T | state + KV cache B at T |", "|---|---|---|---|---|"]
  for r in rows:
    if r.get("memory") is None:
      md.append(f"| {r['group']} | – | – | – | – (no decoding cache: {r.get('no_memory') or 'not a decoder'}) |")
      continue
    kv_T, state = r["memory"]
    md.append(f"| {r['group']} | {r.get('kv_bytes') or 0:,} | {state:,} | {r.get('seq_len', '–')} | {kv_T + state:,} |")
  return md + [""]


def holds_state(rows: list[dict[str, Any]]) -> bool:
  """Whether some group keeps a fixed-size state (a linear head): then a cache per token alone undercounts it."""
  return any(r.get("memory") and r["memory"][1] for r in rows)


def no_memory(trial: dict[str, Any]) -> str:
  """Why a trial's model has no decoding memory to count (sequence_bytes gave None)."""
  from attn.experiments.data import tasks
  name = ((trial.get("config") or {}).get("task") or {}).get("name")
  if name not in tasks.TASKS:
    return "the trial's config is missing"
  if tasks.TASKS[name].kind != "decoder_lm":
    return f"task {name!r} trains a {tasks.TASKS[name].kind}, which reads its whole input at once and keeps no cache"
  return "its model config could not be counted"


def applies(rows: list[dict[str, Any]]) -> bool:
  """Whether a sweep's groups (report rows carrying "memory") call for this section: every group counted,
  some group keeping a fixed-size state, and the totals not all equal."""
  return (len(rows) > 1 and all(r.get("memory") for r in rows) and any(r["memory"][1] for r in rows)
          and len({sum(r["memory"]) for r in rows}) > 1)


def _panels(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
  """Rows by task setting (their task.* axis values), settings in the order of those values."""
  out: dict[str, list[dict[str, Any]]] = {}
  values = lambda r: tuple((k, v) for k, v in r["label"].items() if k.startswith("task."))
  for r in sorted(rows, key=lambda r: repr(sorted(values(r), key=repr)) if not all(
      isinstance(v, (int, float)) for _, v in values(r)) else tuple(v for _, v in values(r))):
    task = ", ".join(f"{plots_lib.short(k)}={show(v)}" for k, v in values(r))
    out.setdefault(task or "all", []).append(r)
  return out


def _name(r: dict[str, Any]) -> str:
  """The group without its task setting (the panel says that)."""
  rest = [f"{plots_lib.short(k)}={show(v)}" for k, v in r["label"].items() if not k.startswith("task.")]
  if len(rest) == 1:
    return rest[0].split("=", 1)[1]
  return ", ".join(rest) or r["group"]


def frontier(rows: list[dict[str, Any]]) -> set[int]:
  """Indices of the rows no other row beats on both: fewer bytes held and a higher mean accuracy."""
  return set(plots_lib.pareto_front([(sum(r["memory"]), -r["eval_accuracy"][0]) for r in rows]))


def section(rows: list[dict[str, Any]]) -> list[str]:
  """Markdown: per task setting, each group's state and cache bytes, its accuracy, and whether it is on the frontier."""
  md = ["## Recall against state and cache", "",
        "Bytes one sequence of the task's length holds when decoding, all layers, float32 (`attn count`): "
        "the KV cache (a sliding layer's at most its window) plus the fixed-size state of linear heads "
        "(with their convolutions' last inputs). Held-out accuracy is mean ± std over seeds; the change is "
        "each seed's held-out accuracy over the last 10% of its steps (a flattened curve changes little). "
        "On the frontier: no other setting of the same task holds as few bytes and recalls more.", ""]
  for task, rs in _panels(rows).items():
    front = frontier(rs)
    order = sorted(range(len(rs)), key=lambda i: (sum(rs[i]["memory"]), -rs[i]["eval_accuracy"][0]))
    md += [f"### {task}", "",
           "| setting | state B | KV cache B | state + cache B | held-out accuracy | per seed | "
           "change over the last 10% (per seed) | on the frontier |", "|---|---|---|---|---|---|---|---|"]
    for i in order:
      r = rs[i]
      late = ", ".join("–" if c is None else f"{c[0]:+.3f}" for c in r.get("late", []))
      md.append(f"| {_name(r)} | {r['memory'][1]:,} | {r['memory'][0]:,} | {sum(r['memory']):,} | "
                f"{r['eval_accuracy'][0]:.3f} ± {r['eval_accuracy'][1]:.3f} | "
                f"{', '.join(f'{v:.3f}' for v in r['seed_values']['eval_accuracy'])} | {late or '–'} | "
                f"{'yes' if i in front else 'no'} |")
    md.append("")
  return md


def chance(trial: dict[str, Any]) -> float | None:
  """The task's chance accuracy (MQAR: a listed value guessed), None for a task without one."""
  from attn.experiments.data import tasks
  try:
    return getattr(tasks.make_task(trial["config"]["task"]), "chance", None)
  except (KeyError, TypeError):
    return None


def tick_labels(xs: list[float], ax) -> list[str]:
  """KiB labels of log-axis ticks at `xs` (sorted, bytes): ticks closer than a label's width (2% of the
  axis) share one label, "a, b", at the first of them, the rest left unlabelled."""
  lo, hi = np.log(xs[0] / 1.4), np.log(xs[-1] * 1.4)
  labels, first = [""] * len(xs), 0
  for i in range(1, len(xs) + 1):
    if i == len(xs) or (np.log(xs[i]) - np.log(xs[i - 1])) / (hi - lo) > 0.02:
      labels[first] = ", ".join(f"{x / 1024:g}" for x in xs[first:i])
      first = i
  return labels


def plot(plt, rows: list[dict[str, Any]], path: str, note: str = "") -> None:
  """Held-out accuracy against state + cache bytes per sequence, one panel per task setting: seeds as dots,
  means as bars, the frontier of the means, a dotted chance line where rows carry one; ticks at every
  setting's byte count; one colour and marker per setting, named in the legend."""
  from matplotlib import ticker
  panels = _panels(rows)
  names = list(dict.fromkeys(_name(r) for r in rows))
  fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels) + 2.6, 5.6), squeeze=False)
  style = plots_lib.line_styles(plt, names)
  for ax, (task, rs) in zip(axes[0], panels.items()):
    xs = sorted({sum(r["memory"]) for r in rs})
    at = {x: [r for r in rs if sum(r["memory"]) == x] for x in xs}
    pos = []
    for r in rs:  # settings holding equal bytes sit side by side, 10% apart on the log axis
      same = at[sum(r["memory"])]
      pos.append(sum(r["memory"]) * 1.1 ** (same.index(r) - (len(same) - 1) / 2))
    front = sorted(frontier(rs), key=lambda i: pos[i])
    ax.step([pos[i] for i in front], [rs[i]["eval_accuracy"][0] for i in front], where="post", color="0.6",
            lw=5, alpha=0.3, zorder=1, label="frontier of the means")
    for i, r in enumerate(rs):
      c, m = style[_name(r)]
      seeds = r["seed_values"]["eval_accuracy"]
      ax.plot([pos[i]] * len(seeds), seeds, m, ms=5, alpha=0.55, color=c, mec="none", zorder=2)
      ax.plot([pos[i]], [r["eval_accuracy"][0]], "_", ms=16, mew=2.5, color=c, zorder=3)
    level = {r.get("chance") for r in rs} - {None}
    if len(level) == 1:
      ax.axhline(level.pop(), color="0.4", ls=":", lw=1.2, zorder=0, label="chance: a listed value guessed")
    ax.set_xscale("log")
    ax.xaxis.set_minor_locator(ticker.NullLocator())
    ax.set_xticks(xs, tick_labels(xs, ax), rotation=90, fontsize=7)
    ax.set_xlim(xs[0] / 1.4, xs[-1] * 1.4)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("state + KV cache per sequence, KiB\n(all layers, float32; a tick at each setting's)", fontsize=8)
    ax.set_ylabel("held-out accuracy")
    n = max(len(r["seed_values"]["eval_accuracy"]) for r in rs)
    ax.set_title(f"{task}: each seed a dot ({n} seed{'s' * (n != 1)}), the mean a bar", fontsize=9)
    ax.grid(alpha=0.3)
  handles = [plt.Line2D([], [], color=style[n][0], marker=style[n][1], ls="none", ms=6) for n in names]
  extra, labels = axes[0][0].get_legend_handles_labels()
  fig.legend(handles + extra, names + labels, loc="center right", fontsize=7, frameon=False)
  fig.tight_layout(rect=(0, 0.05 if note else 0, 1 - 2.6 / fig.get_figwidth(), 1))
  plots_lib._caption(fig, note)
  fig.savefig(path, dpi=80)
  plt.close(fig)


def curves(plt, trials: list[dict[str, Any]], path: str, note: str = "") -> None:
  """Held-out accuracy against step, one small panel per setting (every axis but the task's and the seed),
  one colour per task setting, a line per seed: whether each curve has flattened, for every setting at once."""
  ok = [t for t in trials if t["summary"] and t["summary"]["status"] == "ok"]
  name = lambda t: _name({"label": {k: v for k, v in t["label"].items() if k not in plots_lib.SEED_KEYS},
                          "group": "all"})
  task = lambda t: ", ".join(f"{plots_lib.short(k)}={show(v)}" for k, v in t["label"].items() if k.startswith("task."))
  names, tasks = list(dict.fromkeys(map(name, ok))), list(dict.fromkeys(map(task, ok)))
  cols = min(6, len(names))
  rows = -(-len(names) // cols)
  fig, grid = plt.subplots(rows, cols, figsize=(2.6 * cols, 2.1 * rows + 0.6), squeeze=False, sharex=True, sharey=True)
  cmap = plt.get_cmap("tab10")
  for t in ok:
    ax = grid.flat[names.index(name(t))]
    ev = [r for r in t["rows"] if "eval_accuracy" in r]
    ax.plot([r["step"] + 1 for r in ev], [r["eval_accuracy"] for r in ev], "-", lw=1, alpha=0.8,
            color=cmap(tasks.index(task(t)) % 10))
  for i, ax in enumerate(grid.flat):
    if i >= len(names):
      ax.axis("off")
      continue
    ax.set_title(names[i], fontsize=8)
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.tick_params(labelsize=7)
  for ax in grid[-1]:
    ax.set_xlabel("step", fontsize=8)
  for ax in grid[:, 0]:
    ax.set_ylabel("held-out accuracy", fontsize=8)
  handles = [plt.Line2D([], [], color=cmap(i % 10)) for i in range(len(tasks))]
  fig.legend(handles, tasks, loc="upper center", ncol=len(tasks), fontsize=8, frameon=False,
             title="a line per seed", title_fontsize=8)
  fig.tight_layout(rect=(0, 0.04 if note else 0, 1, 1 - 0.5 / fig.get_figheight()))
  plots_lib._caption(fig, note)
  fig.savefig(path, dpi=80)
  plt.close(fig)
