"""Plots of a sweep: final metrics per swept axis, and held-out learning curves.

Every seed is a dot and the mean over seeds a bar (a short horizontal dash), so
nothing is drawn outside a metric's range (no error bars). Swept values sit at
evenly spaced ticks labelled with the values themselves (1, 2, 4, 8, not 2⁰,
2¹, ...); the bars of a numeric axis with three or more values are joined by a
line (a trend), those of two values or of names are not (categories). Each
figure carries a caption line (`caption`): the task, the steps, the seeds and
what every trial shares (d_model, layers, ...; d_k and d_v where they follow
h); a task with a chance level (MQAR: a value guessed among those listed) draws
it as a dotted line.
Learning curves show held-out accuracy and loss (for the `text` task: bits per
byte and next-byte accuracy) against step, one colour per value of the legend
axis and one panel per setting of the other axes. When the settings differ in
KV cache (rows carrying kv_bytes), frontier_kv_cache.png plots bits per byte
(else held-out loss) against cache bytes per token and draws the frontier; when they
also differ in attention parameters (rows carrying attn_params),
frontier_attention_params.png does the same against those.
"""

from __future__ import annotations

import math
import os
import textwrap
from typing import Any

import numpy as np

from attn.experiments.running.config import axis_name, show

SEED_KEYS = ("train.seed",)
METRICS = (("eval_accuracy", "held-out accuracy"), ("eval_loss", "held-out loss"))
# The byte-level `text` task: bits per byte (eval_loss / ln 2, lower is better) first.
TEXT_METRICS = (("eval_bpb", "held-out bits per byte"), ("eval_accuracy", "held-out next-byte accuracy"))


def _full_range(metric: str, metrics) -> bool:
  """Accuracy spans 0..1 where it leads (tasks that saturate); next-byte accuracy zooms to its data."""
  return metric == "eval_accuracy" and metrics[0][0] == "eval_accuracy"
MAX_PANELS = 8


short = axis_name  # model.num_heads -> num_heads, model.extra.NAME.OPTION -> NAME.OPTION


def caption(trials: list[dict[str, Any]], axes: list[str], chosen: set[str] | None = None) -> str:
  """One line saying what a sweep's plots show: task, steps, seeds, and what the trials hold fixed (of
  `chosen`'s keys where given: those the config sets or derives, not a default nobody chose)."""
  configs = [t["config"] for t in trials if t.get("config")]
  if not configs:
    return ""
  task = configs[0]["task"]
  same = lambda section, key: len({repr(c[section].get(key)) for c in configs}) == 1
  swept = {a.split(".", 1)[1] for a in axes if a.startswith("model.")}
  parts = [task["name"].upper() if task["name"] in ("mqar",) else task["name"]]
  opts = [f"{k}={v}" for k, v in task.items() if k != "name" and not isinstance(v, (dict, list))
          and v not in (None, "") and same("task", k) and f"task.{k}" not in axes
          and (chosen is None or f"task.{k}" in chosen)]
  head = parts[0] + (f" ({', '.join(opts)})" if opts else "")
  steps = {c["train"]["steps"] for c in configs}
  ran = [t["config"] for t in trials if t.get("config") and (t.get("summary") or {}).get("status") == "ok"]
  ran = ran or configs  # the seeds the plotted trials ran, not the config's (a sweep stopped early)
  seeds = len({c["train"]["seed"] for c in ran})
  text = [head, f"{min(steps)} steps" if len(steps) == 1 else f"{min(steps)}-{max(steps)} steps",
          f"{seeds} seed{'s' * (seeds != 1)}"]
  fixed = [f"{k}={configs[0]['model'][k]}" for k in ("d_model", "num_layers", "num_heads", "d_k", "d_v", "d_ff",
                                                    "num_kv_heads", "variant")
           if k not in swept and configs[0]["model"].get(k) is not None and same("model", k)
           and (chosen is None or f"model.{k}" in chosen)]
  moving = [k for k in ("d_k", "d_v") if k not in swept and not same("model", k)]
  with_h = ""
  if moving and "num_heads" in swept:
    widths = sorted({c["model"]["d_k"] for c in configs}, reverse=True)
    with_h = f"; {' = '.join(moving)} = d_model/h ({', '.join(map(str, widths))})"
  return ", ".join(text) + ("; held fixed: " + ", ".join(fixed) if fixed else "") + with_h


def chance(trials: list[dict[str, Any]]) -> tuple[float, str] | None:
  """(accuracy, what it is) of guessing, for a task that has one (MQAR); None otherwise."""
  configs = [t["config"] for t in trials if t.get("config")]
  if not configs or len({repr(c["task"]) for c in configs}) != 1:
    return None
  from attn.experiments.data import tasks  # lazy: numpy only, but not needed without configs
  task = tasks.make_task(configs[0]["task"])
  level = getattr(task, "chance", None)
  return None if level is None else (float(level), task.chance_means)


def _wrapped(fig, text: str) -> str:
  """The caption wrapped to the figure's width (about 15 characters an inch at 8 pt)."""
  return textwrap.fill(text, width=max(40, int(fig.get_figwidth() * 15)), break_on_hyphens=False)


def _caption_room(fig, text: str, least: float) -> float:
  """The share of the figure's height to keep under the axes for the caption and the x labels above it:
  `least` for the axis labels plus the caption's own lines (8 pt, 1.25 line spacing), so a long caption
  never runs into the labels."""
  if not text:
    return 0.0
  lines = _wrapped(fig, text).count("\n") + 1
  return min(0.5, least + lines * 8 * 1.25 / 72 / fig.get_figheight())


def _caption(fig, text: str) -> None:
  """The caption under the plots."""
  if text:
    fig.text(0.5, 0.005, _wrapped(fig, text), ha="center", va="bottom", fontsize=8, color="0.25")


def _pyplot():
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return None
  return plt


def _order(values: list[Any]) -> list[Any]:
  """Distinct values in sweep order, numbers sorted; any value a config holds (tables too)."""
  seen = list({repr(v): v for v in values}.values())
  if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in seen):
    return sorted(seen)
  return seen


def _rest(label: dict[str, Any], skip: set[str]) -> str:
  return ", ".join(f"{short(k)}={show(v)}" for k, v in label.items() if k not in skip and k not in SEED_KEYS)


def tied_axes(rows: list[dict[str, Any]], axes: list[str]) -> dict[str, list[str]]:
  """axis -> the later axes that move with it one-to-one (a zip), which its plots also label."""
  out: dict[str, list[str]] = {}
  for i, a in enumerate(axes):
    for b in axes[i + 1:]:
      pairs = {(repr(r["label"].get(a)), repr(r["label"].get(b))) for r in rows}
      if len(pairs) == len({p[0] for p in pairs}) == len({p[1] for p in pairs}) > 1:
        out.setdefault(a, []).append(b)
  return out


def _tick(r: dict[str, Any], axis: str, tied: list[str]) -> str:
  text = show(r["label"][axis])
  return text + "".join(f"\n{short(b)}={show(r['label'][b])}" for b in tied)


MARKERS = "os^Dv<>pXh*"


def line_styles(plt, names: list[str]) -> dict[str, tuple[Any, str]]:
  """name -> (colour, marker): 18 distinct colours, and a marker that changes with the colour's
  cycle, so no two of up to 198 names look alike."""
  palette = [plt.get_cmap("tab20")(2 * i) for i in range(10)] + [plt.get_cmap("Dark2")(i) for i in range(8)]
  if len(names) <= 10:
    return {n: (plt.get_cmap("tab10")(i), "o") for i, n in enumerate(names)}
  return {n: (palette[i % len(palette)], MARKERS[i % len(MARKERS)]) for i, n in enumerate(names)}


def slant(ax, labels: list[str], width: int = 48) -> None:
  """Tick labels at 30° when, written flat, they would run into each other; upright past 8 of them,
  where even slanted ones would."""
  if sum(len(str(s).split("\n")[0]) + 2 for s in labels) > width:
    upright = len(labels) > 8
    ax.tick_params(axis="x", labelrotation=90 if upright else 30, **({"labelsize": 8} if upright else {}))
    for label in ax.get_xticklabels():
      label.set_horizontalalignment("center" if upright else "right")


def _log_if_spanning(ax, values: list[float]) -> None:
  """A log y axis with plain tick labels when positive values span more than a factor of 20."""
  from matplotlib import ticker
  if values and min(values) > 0 and max(values) / min(values) > 20:
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))


def final_vs_axis(plt, rows: list[dict[str, Any]], axis: str, tied: list[str], path: str,
                  axes_order: list[str], metrics=METRICS, note: str = "",
                  guess: tuple[float, str] | None = None) -> None:
  """Final held-out accuracy and loss against one axis: seeds as dots, the mean a bar (joined on a trend)."""
  skip = {axis, *tied}
  values = _order([r["label"][axis] for r in rows])
  lines: dict[str, list[dict[str, Any]]] = {}
  for r in rows:
    rest = {k: v for k, v in r["label"].items() if k not in skip and k not in SEED_KEYS}
    name = show(next(iter(rest.values()))) if len(rest) == 1 else _rest(r["label"], skip) or "mean"
    lines.setdefault(name, []).append(r)
  many = len(lines) > 6  # then the legend goes beside the panels, and colours come with markers
  tall = len(values) > 8 and any(len(show(v)) > 6 for v in values)  # room for upright tick labels
  fig, panels = plt.subplots(1, 2, figsize=(12.5 if many else 10, 6.2 if tall else 4.4))
  style = line_styles(plt, list(lines))
  numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values) and len(values) > 2
  spread = 0.3 if len(lines) > 1 else 0.0  # side by side, so seeds of different lines do not overlap
  for ax, (metric, title) in zip(panels, metrics):
    for i, (name, rs) in enumerate(lines.items()):
      rs = sorted(rs, key=lambda r: values.index(r["label"][axis]))
      xs = np.array([values.index(r["label"][axis]) for r in rs], float)
      xs += (i / max(len(lines) - 1, 1) - 0.5) * spread
      means = [r[metric][0] for r in rs]
      colour, marker = style[name]
      if numeric:  # a trend over three or more ordered values: join the means
        ax.plot(xs, means, "-", lw=1.5, marker="_", ms=14, mew=2, color=colour)
      else:  # categories (names, or two values): a bar per mean, nothing joins them
        ax.plot(xs, means, "_", ms=18, mew=2, color=colour)
      for x, r in zip(xs, rs):
        seeds = r["seed_values"][metric]
        ax.plot([x] * len(seeds), seeds, marker, ms=4, alpha=0.6, color=colour, mec="none")
    ticks = {values.index(r["label"][axis]): _tick(r, axis, tied) for r in rows}
    ax.set_xticks(sorted(ticks), [ticks[i] for i in sorted(ticks)])
    ax.set_xlim(-0.6, len(values) - 0.4)
    slant(ax, list(ticks.values()))
    ax.set_xlabel(" / ".join(short(a) for a in [axis, *tied]))
    n_seeds = max(len(r["seed_values"][metric]) for r in rows)
    ax.set_title(textwrap.fill(f"{title}: each seed a dot ({n_seeds} seed{'s' * (n_seeds != 1)}), their mean a bar"  # a panel is
                               + (", bars joined" if numeric else ""), 66), fontsize=9)  # ~66 characters wide
    if metric == "eval_accuracy" and guess is not None:
      ax.axhline(guess[0], color="0.4", ls=":", lw=1.2, zorder=0)
      ax.annotate(f"chance {guess[0]:.3f}: {guess[1]}", (0.01, guess[0]), xycoords=("axes fraction", "data"),
                  xytext=(0, 3), textcoords="offset points", fontsize=7, color="0.35")
    if _full_range(metric, metrics):
      ax.set_ylim(-0.02, 1.02)
    else:
      _log_if_spanning(ax, [v for r in rows for v in r["seed_values"][metric]])
    ax.grid(alpha=0.3)
  if len(lines) > 1:
    handles = [plt.Line2D([], [], color=c, marker=m, ls="-" if numeric else "none", ms=5) for c, m in style.values()]
    title = ", ".join(short(a) for a in axes_order if a not in skip)
    if many:  # beside the panels: inside, it hides seeds' dots
      fig.legend(handles, list(lines), loc="center right", fontsize=7, title=title, title_fontsize=7, frameon=False)
    else:
      panels[0].legend(handles, list(lines), fontsize=7, title=title, title_fontsize=7)
  fig.tight_layout(rect=(0, _caption_room(fig, note, 0.02), 1 - 2.4 / fig.get_figwidth() if many else 1, 1))
  _caption(fig, note)
  fig.savefig(path, dpi=90)
  plt.close(fig)


def learning_curves(plt, trials: list[dict[str, Any]], axes: list[str], path: str, metrics=METRICS,
                    note: str = "", guess: tuple[float, str] | None = None) -> None:
  """Held-out metrics (accuracy top, loss bottom) against step; one colour per legend value, one panel per rest."""
  ok = [t for t in trials if t["summary"] and t["summary"]["status"] == "ok"]
  swept = [a for a in axes if a not in SEED_KEYS]
  # The legend carries the axis with the fewest values; panels split by every other axis.
  legend = min(swept, key=lambda a: len({repr(t["label"][a]) for t in ok})) if swept else None
  colours = _order([t["label"][legend] for t in ok]) if legend else [None]
  panels: dict[str, list[dict[str, Any]]] = {}
  for t in ok:
    panels.setdefault(_rest(t["label"], {legend} if legend else set()) or "all trials", []).append(t)
  names = list(panels)[:MAX_PANELS]
  if len(panels) > len(names):  # said on the figure: the rest are in the report's tables
    note = f"the first {len(names)} of {len(panels)} panels" + (f"; {note}" if note else "")
  # The legend's strip (inches), wide enough for its longest value at fontsize 8 beside its line.
  strip = max(1.1, 0.065 * max(len(show(c)) for c in colours) + 0.6) if legend else 0.0
  fig, grid = plt.subplots(2, len(names), figsize=(max(3.2 * len(names), 5) + 0.1 + strip, 6), squeeze=False,
                           sharey="row")
  # A numeric legend axis with many values reads best as a gradient; categories get distinct hues.
  ramp = len(colours) > 4 and all(isinstance(c, (int, float)) and not isinstance(c, bool) for c in colours)
  cmap = plt.get_cmap("viridis" if ramp else "tab10")
  colour_of = lambda i: cmap(i / max(len(colours) - 1, 1)) if ramp else cmap(i % 10)
  for j, name in enumerate(names):
    for t in panels[name]:
      c = colours.index(t["label"][legend]) if legend else 0
      colour = colour_of(c)
      ev = [r for r in t["rows"] if metrics[0][0] in r]
      steps = [r["step"] + 1 for r in ev]
      for i, (metric, title) in enumerate(metrics):
        grid[i, j].plot(steps, [r[metric] for r in ev], "-", color=colour, lw=1.2, alpha=0.8, marker=".", ms=3)
        grid[i, j].set_ylabel(title if j == 0 else "")
    grid[0, j].set_title(name, fontsize=9)
    for i, (metric, _) in enumerate(metrics):
      if _full_range(metric, metrics):
        grid[i, j].set_ylim(-0.02, 1.02)
      if metric == "eval_accuracy" and guess is not None:
        grid[i, j].axhline(guess[0], color="0.4", ls=":", lw=1.2, zorder=0)
        if j == 0:
          # at the right end, under the line: curves start near chance and rise away from it
          grid[i, j].annotate(f"chance {guess[0]:.3f}", (0.99, guess[0]), xycoords=("axes fraction", "data"),
                              xytext=(0, -9), textcoords="offset points", fontsize=7, color="0.35", ha="right")
    grid[1, j].set_xlabel("step")
    for i in range(2):
      grid[i, j].grid(alpha=0.3)
  for i, (metric, _) in enumerate(metrics):
    if metric != "eval_accuracy":
      _log_if_spanning(grid[i, 0], [r[metric] for t in ok for r in t["rows"] if metric in r])
  if legend:
    handles = [plt.Line2D([], [], color=colour_of(i))
               for i in range(len(colours))]
    fig.legend(handles, [show(c) for c in colours], title=f"{short(legend)}\n(a line per seed)",
               loc="center right", fontsize=8, title_fontsize=8)
  fig.tight_layout(rect=(0, _caption_room(fig, note, 0.01), 1 - strip / fig.get_figwidth(), 1))
  _caption(fig, note)
  fig.savefig(path, dpi=80)
  plt.close(fig)


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
  """Indices of the (x, y) points no other point beats on both (lower x and lower y win), by x."""
  front, best = [], float("inf")
  for i in sorted(range(len(points)), key=lambda i: points[i]):
    if points[i][1] < best:
      front.append(i)
      best = points[i][1]
  return front


X_AXES = {"kv_bytes": ("KV cache", "KV cache, bytes per token (all layers, float32)", "a cache as small"),
          "held_bytes": ("state and KV cache", "state + KV cache after one sequence of length T, bytes "
                         "(all layers, float32)", "as few bytes held"),
          "attn_params": ("attention parameters", "attention parameters (all layers, attn count)",
                          "as few attention parameters")}


def kv_frontier(plt, rows: list[dict[str, Any]], path: str, metric=TEXT_METRICS[0], x: str = "kv_bytes") -> None:
  """A metric (lower is better) against KV-cache bytes per token (or x, a key of X_AXES): seeds as dots,
  means as bars, the frontier of the means."""
  from matplotlib import ticker
  key, title = metric
  what, xlabel, fewer = X_AXES[x]
  rows = [{**r, "kv_bytes": r[x]} for r in rows]
  counts = x == "attn_params"  # parameter counts: a linear axis of close values, labels turned 45°
  fig, ax = plt.subplots(figsize=(10, 5.5) if counts else (8, 5))
  xs = sorted({r["kv_bytes"] for r in rows})
  log = xs[-1] / xs[0] >= 4
  at_x = {x: [r for r in rows if r["kv_bytes"] == x] for x in xs}
  cmap = plt.get_cmap("tab10")
  pos = []
  for i, r in enumerate(rows):
    same = at_x[r["kv_bytes"]]
    k, n = same.index(r), len(same)
    # Settings of equal cache size sit side by side, 12% apart on a log axis.
    pos.append(r["kv_bytes"] * (1.12 ** (k - (n - 1) / 2) if log else 1 + (0.025 if counts else 0.04) * (k - (n - 1) / 2)))
  front = pareto_front([(r["kv_bytes"], r[key][0]) for r in rows])
  ax.plot([pos[i] for i in front], [rows[i][key][0] for i in front], "-", color="0.6", lw=4, alpha=0.35,
          zorder=1, label=f"frontier of the means (no setting has {fewer} and a lower mean)")
  if not counts:
    lo, hi = (xs[0] / 1.6, xs[-1] * 1.6) if log else (0, xs[-1] * 1.15)
  else:
    span = xs[-1] - xs[0]
    lo, hi = (xs[0] / 1.3, xs[-1] * 1.5) if log else (xs[0] - 0.12 * span, xs[-1] + 0.3 * span)
  frac = (lambda v: math.log(v / lo) / math.log(hi / lo)) if log else (lambda v: (v - lo) / ((hi - lo) or 1))
  gaps = {x: (frac(x) - frac(xs[j - 1]) if j else 1.0, frac(xs[j + 1]) - frac(x) if j + 1 < len(xs) else 1.0)
          for j, x in enumerate(xs)}
  for i, r in enumerate(rows):
    same = at_x[r["kv_bytes"]]
    before, after = gaps[r["kv_bytes"]]
    # Left of its bar: the first of settings sharing an x, or a lone one whose next x is closer than
    # a label's room (an eighth of the axis) while its previous x leaves that room.
    left = same.index(r) == 0 and (len(same) > 1 or after < 0.125 <= before)
    seeds = r["seed_values"][key]
    ax.plot([pos[i]] * len(seeds), seeds, "o", ms=5, alpha=0.6, color=cmap(i % 10), mec="none", zorder=2)
    ax.plot([pos[i]], [r[key][0]], "_", ms=16, mew=2.5, color=cmap(i % 10), zorder=3)
    ax.annotate(r.get("setting") or r["group"], (pos[i], r[key][0]), xytext=(-10 if left else 10, 0),
                textcoords="offset points", ha="right" if left else "left", va="center", fontsize=8,
                color=cmap(i % 10), zorder=4)
  if log:
    ax.set_xscale("log")
    ax.xaxis.set_minor_locator(ticker.NullLocator())
  if not counts:
    ax.set_xticks(xs, [str(v) for v in xs])
  else:  # parameters: a tick at each setting's count, the axis around them (from 0 would crowd them)
    ax.set_xticks(xs, [f"{v:,}" for v in xs], rotation=45, ha="right", fontsize=8)
  ax.set_xlim(lo, hi)
  ax.set_xlabel(xlabel)
  ax.set_ylabel(title)
  n_seeds = max(len(r["seed_values"][key]) for r in rows)
  ax.set_title(f"{title} against {what}: each seed a dot ({n_seeds} seed{'s' * (n_seeds != 1)}), mean a bar", fontsize=9)
  # Below the axes: inside, the legend can hide a seed's dot.
  ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2 if counts else -0.12), frameon=False)
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  plt.close(fig)


def make_plots(rows: list[dict[str, Any]], trials: list[dict[str, Any]], axes: list[str],
               out_dir: str, metrics=METRICS, curves: bool = True, note: str | None = None) -> list[str]:
  """Writes the sweep's PNGs into out_dir; returns their file names ([] without matplotlib).

  curves=False leaves out the learning curves (a write-up's committed finals have no rows); `note`, the
  caption under each plot (default: `caption`'s).
  """
  plt = _pyplot()
  if plt is None or not rows:
    return []
  note = caption(trials, axes) if note is None else note
  guess = chance(trials) if metrics[0][0] == "eval_accuracy" else None
  made = []
  swept = [a for a in axes if a not in SEED_KEYS and all(a in r["label"] for r in rows)]
  tied = tied_axes(rows, swept)
  hidden = {b for bs in tied.values() for b in bs}
  for axis in swept:
    if axis in hidden or len({repr(r["label"][axis]) for r in rows}) < 2:
      continue
    name = f"final_vs_{short(axis)}.png"
    final_vs_axis(plt, rows, axis, tied.get(axis, []), os.path.join(out_dir, name), swept, metrics, note, guess)
    made.append(name)
  if curves:
    learning_curves(plt, trials, axes, os.path.join(out_dir, "learning_curves.png"), metrics, note, guess)
    made.append("learning_curves.png")
  # Where a group keeps a fixed-size state (a hybrid's linear layers), its cache per token undercounts what it
  # holds: the frontier is drawn against state + KV cache at T (rows carrying held_bytes) instead.
  x = "held_bytes" if any(r.get("held_bytes") for r in rows) else "kv_bytes"
  if len({r.get(x) for r in rows}) > 1 and all(r.get(x) for r in rows):
    lower_better = metrics[0] if metrics[0][0] != "eval_accuracy" else ("eval_loss", "held-out loss")
    kv_frontier(plt, rows, os.path.join(out_dir, "frontier_kv_cache.png"), lower_better, x=x)
    made.append("frontier_kv_cache.png")
    if all(r.get("attn_params") for r in rows) and len({r["attn_params"] for r in rows}) > 1:
      kv_frontier(plt, rows, os.path.join(out_dir, "frontier_attention_params.png"), lower_better, x="attn_params")
      made.append("frontier_attention_params.png")
  return made
