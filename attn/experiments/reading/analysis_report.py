"""The report's "Inside the heads" section: trials' analysis.json compared across the sweep's axes.

Reads DIR/trials/ID/analysis.json (written by `attn analyze`) of every finished
trial that has one. Groups are the report's (trials equal but for the seed);
each metric is shown as mean ± std over seeds, in a table, one line per swept
axis and setting of the other axes, and one plot per axis with each seed a dot
and the mean a line (the convention of attn/experiments/reading/plots.py).
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from attn.experiments.running import store as store_lib
from attn.experiments.reading.plots import SEED_KEYS, _order, _pyplot, caption, short, show, slant, tied_axes

ANALYSIS = "analysis.json"
# summary key of analysis.json -> what the report calls it
METRICS = (
    ("qk_effective_rank", "W_QK effective rank"),
    ("qk_rank", "W_QK numerical rank"),
    ("ov_effective_rank", "W_OV effective rank"),
    ("attention_entropy", "attention entropy (nats)"),
    ("head_diversity", "head diversity (mean JS, nats)"),
    ("first_mass", "attention on the first position"),
    ("sink_mass", "attention on a learned sink"),
    ("row_sum", "attention row sum (1 under softmax)"),
    ("residual_max", "largest residual |h|"),
    ("residual_max_over_median", "largest / median residual |h|"),
    ("sink_heads", "fraction of sink heads"),
    ("value_drain", "first value norm / median"),
    ("residual_first", "first residual norm / median"),
    ("prunable_fraction", "prunable fraction (≤ 0.01 acc. lost)"),
)


def load(root: str, trials: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """The finished trials that have an analysis.json, each with it under "analysis"."""
  out = []
  for t in trials:
    path = os.path.join(root, "trials", t["id"], ANALYSIS)
    if t["summary"] and t["summary"].get("status") == "ok" and os.path.exists(path):
      try:
        analysis = store_lib.read_json(path)
      except store_lib.StoreDamaged as e:
        raise store_lib.StoreDamaged(path, e.problem, f"remove it and run `attn analyze {root} --trial {t['id']}` "
                                     "to write it again") from None
      out.append({**t, "analysis": analysis})
  return out


def _stat(values: list[float | None]) -> tuple[float, float, list[float]] | None:
  """(mean, std over seeds, the values) of the finite values; None when there are none."""
  vs = [float(v) for v in values if v is not None and math.isfinite(v)]
  if not vs:
    return None
  return float(np.mean(vs)), float(np.std(vs, ddof=1)) if len(vs) > 1 else 0.0, vs


def groups(analysed: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """One row per group of trials equal but for the seed: label, d_k, seeds and each metric's _stat."""
  by: dict[str, list[dict[str, Any]]] = {}
  for t in analysed:
    key = ", ".join(f"{short(k)}={show(v)}" for k, v in t["label"].items() if k not in SEED_KEYS) or "all"
    by.setdefault(key, []).append(t)
  rows = []
  for name, ts in by.items():
    a0 = ts[0]["analysis"]
    row = {"group": name, "label": {k: v for k, v in ts[0]["label"].items() if k not in SEED_KEYS},
           "n": len(ts), "d_k": a0["d_k"], "num_heads": a0["num_heads"]}
    for key, _ in METRICS:
      row[key] = _stat([t["analysis"]["summary"].get(key) for t in ts])
    rows.append(row)
  return rows


def _cell(s: tuple[float, float, list[float]] | None, digits: int = 3) -> str:
  return "–" if s is None else f"{s[0]:.{digits}g} ± {s[1]:.2g}"


def _along(rows: list[dict[str, Any]], axes: list[str]) -> list[str]:
  """One line per swept axis and setting of the other axes: every metric along the axis."""
  lines = []
  swept = [a for a in axes if a not in SEED_KEYS and all(a in r["label"] for r in rows)]
  tied = tied_axes(rows, swept)
  hidden = {b for bs in tied.values() for b in bs}
  for axis in swept:
    if axis in hidden:
      continue
    skip = {axis, *tied.get(axis, [])}
    slices: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
      rest = ", ".join(f"{short(k)}={show(v)}" for k, v in r["label"].items() if k not in skip)
      slices.setdefault(rest, []).append(r)
    for rest, rs in slices.items():
      if len(rs) < 2:
        continue
      values = _order([r["label"][axis] for r in rs])
      rs = sorted(rs, key=lambda r: values.index(r["label"][axis]))
      dk = len({r["d_k"] for r in rs}) > 1  # d_k moves with the axis (e.g. fixed width)
      at = ", ".join(f"{show(r['label'][axis])}" + (f" (d_k={r['d_k']})" if dk else "") for r in rs)
      parts = [f"{name} " + " → ".join(_cell(r[key]) for r in rs) for key, name in METRICS
               if any(r[key] is not None for r in rs)]
      where = f" ({rest})" if rest else ""
      lines.append(f"- **{short(axis)}** = {at}{where}: " + "; ".join(parts) + ".")
  return lines


def plot_axis(plt, rows: list[dict[str, Any]], axis: str, tied: list[str], path: str, note: str = "") -> None:
  """Each metric against one axis: seeds as dots, the mean a bar per setting of the other axes, bars
  joined on a numeric axis of three or more values (plots.final_vs_axis's rule)."""
  skip = {axis, *tied}
  values = _order([r["label"][axis] for r in rows])
  numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values) and len(values) > 2
  lines: dict[str, list[dict[str, Any]]] = {}
  for r in rows:
    rest = ", ".join(f"{short(k)}={show(v)}" for k, v in r["label"].items() if k not in skip)
    lines.setdefault(rest or "mean", []).append(r)
  metrics = [(key, name) for key, name in METRICS if any(r[key] is not None for r in rows)]
  fig, grid = plt.subplots(-(-len(metrics) // 3), 3, figsize=(13, 3.5 * -(-len(metrics) // 3)), squeeze=False)
  for ax in grid.ravel()[len(metrics):]:
    ax.axis("off")
  spread = 0.12 if len(lines) > 1 else 0.0
  for ax, (key, name) in zip(grid.ravel(), metrics):
    for i, (line_name, rs) in enumerate(lines.items()):
      rs = sorted((r for r in rs if r[key] is not None), key=lambda r: values.index(r["label"][axis]))
      if not rs:
        continue
      at = np.array([values.index(r["label"][axis]) for r in rs], float)
      xs = at + (i / max(len(lines) - 1, 1) - 0.5) * spread
      line, = ax.plot(xs, [r[key][0] for r in rs], "-_" if numeric else "_", ms=14, mew=2, lw=1.5,
                      color=f"C{i % 10}", label=line_name)
      for x, r in zip(xs, rs):
        ax.plot([x] * len(r[key][2]), r[key][2], "o", ms=4, alpha=0.6, color=line.get_color(), mec="none")
      if key in ("qk_effective_rank", "qk_rank"):  # the rank a factored head cannot exceed
        ax.plot(at, [r["d_k"] for r in rs], ":x" if numeric else "x", color="0.5", lw=1, ms=5)
    dk_of = {repr(r["label"][axis]): set() for r in rows}
    for r in rows:
      dk_of[repr(r["label"][axis])].add(r["d_k"])
    dk = "model.d_k" not in skip and all(len(v) == 1 for v in dk_of.values()) and \
        len(set.union(*dk_of.values())) > 1  # d_k is set by this axis (e.g. fixed width)
    ticks = {values.index(r["label"][axis]): show(r["label"][axis]) + "".join(
        f"\n{short(b)}={show(r['label'][b])}" for b in tied) + (f"\nd_k={r['d_k']}" if dk else "")
        for r in rows}
    ax.set_xticks(sorted(ticks), [ticks[i] for i in sorted(ticks)], fontsize=7)
    slant(ax, list(ticks.values()), width=60)
    ax.set_xlim(-0.5, len(values) - 0.5)
    ax.set_title(name + (" (grey: d_k)" if key in ("qk_effective_rank", "qk_rank") else ""), fontsize=9)
    ax.tick_params(axis="y", labelsize=7)
    if key in ("prunable_fraction", "first_mass", "sink_mass", "sink_heads"):  # fractions
      ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
  if len(lines) > 1:
    grid[0, 0].legend(fontsize=7)
  fig.suptitle(f"inside the heads against {' / '.join(short(a) for a in [axis, *tied])}: each seed a dot, "
               f"their mean a bar{', bars joined' if numeric else ''}; a missing bar: no value (–, see report.md)"
               + (f"\n{note}" if note else ""), fontsize=9)
  fig.tight_layout(rect=(0, 0, 1, 1 - (0.6 if note else 0.4) / fig.get_figheight()))
  fig.savefig(path, dpi=80)
  plt.close(fig)


def section(root: str, trials: list[dict[str, Any]], axes: list[str]) -> list[str]:
  """Markdown lines of the section (with its PNGs written into root); [] when no trial has an analysis."""
  analysed = load(root, trials)
  if not analysed:
    return []
  rows = groups(analysed)
  finished = sum(1 for t in trials if t["summary"] and t["summary"].get("status") == "ok")
  md = ["", "## Inside the heads", "",
        f"From `attn analyze` (trials/ID/{ANALYSIS}; {len(analysed)} of {finished} finished trials). "
        "Per trial, ranks are means over layers and heads: effective rank exp(H(σ/‖σ‖₁)) and numerical "
        "rank (σ > max(M,N)·eps·σ_max) of W_QK,h = W_Q,h·W_K,hᵀ and W_OV,h; attention entropy is the mean "
        "over heads and held-out queries; head diversity the mean Jensen–Shannon divergence between "
        "the heads of a layer (0: copies, log 2 = 0.693: disjoint keys); prunable fraction the share of "
        "heads gated off, least important first, before held-out accuracy drops more than 0.01. "
        "Mean ± std over seeds. –: no value, for a reason of the layer's: head diversity with one head (no "
        "pair to compare); W_QK ranks for a variant without per-head W_QK factors (its analysis.json says "
        "why, under qk.refused); entropy, diversity and sink mass where rows are not distributions "
        "(sigmoid, ReLU, differential).", "",
        "| group | seeds | d_k | " + " | ".join(name for _, name in METRICS) + " |",
        "|---|---|---|" + "---|" * len(METRICS)]
  for r in rows:
    md.append(f"| {r['group']} | {r['n']} | {r['d_k']} | " + " | ".join(_cell(r[k]) for k, _ in METRICS) + " |")
  along = _along(rows, axes)
  if along:
    md += ["", "Along each swept axis, the others held fixed (mean ± std over seeds, in axis order):", ""]
    md += along
  plt = _pyplot()
  swept = [a for a in axes if a not in SEED_KEYS and all(a in r["label"] for r in rows)]
  tied = tied_axes(rows, swept)
  hidden = {b for bs in tied.values() for b in bs}
  plots = []
  for axis in swept:
    if plt is None or axis in hidden or len({repr(r["label"][axis]) for r in rows}) < 2:
      continue
    name = f"analysis_vs_{short(axis)}.png"
    plot_axis(plt, rows, axis, tied.get(axis, []), os.path.join(root, name), caption(trials, axes))
    plots.append(name)
  if plots:
    md += [""] + [f"![{p}]({p})" for p in plots]
  md += ["", "Per trial: trials/ID/attention.png, spectra.png, importance.png, pruning.png."]
  return md
