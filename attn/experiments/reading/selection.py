"""How few keys: held-out accuracy and loss against the attention FLOPs per token of a key selection.

A softmax layer's attention core costs 2·H·(K + V) FLOPs per (query, key) pair it attends to; full
causal attention attends to t + 1 keys at query t, a window to min(t + 1, window), a key selection
(moba, the lightning indexer, nsa: attn.variants.selection, nsa) to the keys it chooses, and the
selection adds its own FLOPs (MoBA's block scores, the indexer's scores over every visible key,
NSA's gates, pooling and block scores). attn.count.selectors gives both in closed form; here they
are summed over the layers and divided by the task's length: forward FLOPs per token of the
attention cores plus selectors (projections and feed-forward left out: equal parameters make
those nearly equal). A sweep whose groups differ in these FLOPs and where some group selects keys
gets a section of report.md (one row a group: keys a query, FLOPs, accuracy and loss) and
accuracy_vs_attention_flops.png (accuracy and loss against the FLOPs, each seed a dot, the mean a
bar, a tick at each group's FLOPs).
"""

from __future__ import annotations

import textwrap

from typing import Any

import numpy as np

SELECTORS = ("moba", "indexer", "nsa")


def attention_flops(trial: dict[str, Any]) -> dict[str, Any] | None:
  """{"keys": mean keys a query (over the layers), "core": the cores' forward FLOPs a token, "selector":
  the selectors' forward FLOPs a token, "selector_params", "selector_name"} of a decoder trial at its
  task's length, all layers; None without a config or for a model with no softmax key per query
  (a linear head's state, a classifier)."""
  from attn.config import ConfigError
  from attn.count import selectors
  from attn.experiments.data import tasks
  from attn.nn.config import ModelConfig
  cfg = trial.get("config") or {}
  try:
    if tasks.TASKS[cfg["task"]["name"]].kind != "decoder_lm":
      return None
    model = ModelConfig(**cfg["model"])
    T = int(cfg["task"]["seq_len"])
  except (KeyError, TypeError, ConfigError):
    return None
  keys = core = sel = params = 0
  names = set()
  for i in range(model.num_layers):
    if not model.has_attention(i) or model.layer_variant(i) not in ("per_head", "fused", "mla"):
      return None
    h = model.layer_head(i)
    if any(s in (h.extra or {}) for s in SELECTORS):
      row = selectors.selection_row(h, T)
      names.add(row["selector"])
      core, sel, params = core + row["core_flops"], sel + row["selector_flops"], params + row["params"]
      keys += selectors.pairs(h, T)
    else:
      k = T if h.window is None else min(h.window, T)
      core += selectors.core_flops_at(h, T, k)
      keys += k * (k + 1) // 2 + (T - k) * k
  L = model.num_layers
  return {"keys": keys / (L * T), "core": core / T, "selector": sel / T, "selector_params": params,
          "selector_name": "/".join(sorted(names)) or "none"}


def applies(rows: list[dict[str, Any]]) -> bool:
  """Whether a sweep's groups (report rows carrying "attention_flops") call for this section: every group
  counted, some group selecting keys, and the FLOPs not all equal."""
  return (len(rows) > 1 and all(r.get("attention_flops") for r in rows)
          and any(r["attention_flops"]["selector_name"] != "none" for r in rows)
          and len({_total(r) for r in rows}) > 1)


def _total(r: dict[str, Any]) -> float:
  return r["attention_flops"]["core"] + r["attention_flops"]["selector"]


def section(rows: list[dict[str, Any]]) -> list[str]:
  """report.md's section: one row a group, in the report's order (best held-out accuracy first)."""
  lines = ["## Accuracy against attention FLOPs", "",
           "Forward FLOPs per token of the attention cores and the key selectors, summed over the layers "
           "(attn.count.selectors in closed form at the task's length: 2·H·(K + V) a (query, key) pair, "
           "plus the selector's own scores); keys a query are the mean over queries and layers. "
           "Projections and the feed-forward are left out.", "",
           "| group | keys a query | core FLOPs/token | selector FLOPs/token | selector params "
           "| eval accuracy | eval loss |", "|---|---:|---:|---:|---:|---|---|"]
  for r in rows:
    f = r["attention_flops"]
    lines.append(f"| {r['group']} | {f['keys']:.1f} | {f['core']:,.0f} | {f['selector']:,.0f} | "
                 f"{f['selector_params']:,} | {r['eval_accuracy'][0]:.4f} ± {r['eval_accuracy'][1]:.4f} | "
                 f"{r['eval_loss'][0]:.4f} ± {r['eval_loss'][1]:.4f} |")
  return lines + [""]


def _short(flops: float) -> str:
  return f"{flops / 1e6:.3g}M" if flops >= 1e6 else f"{flops / 1e3:.3g}k"


def _labels(totals: list[float]) -> list[str]:
  """Tick labels, each on the first of three lines where it sits 15% clear of that line's last label."""
  out, last = [], [0.0, 0.0, 0.0]
  for t in totals:
    line = next((n for n in range(3) if t >= 1.15 * last[n]), 2)
    last[line] = t
    out.append("\n" * line + _short(t))
  return out


def plot(plt, rows: list[dict[str, Any]], path: str, caption: str = "") -> None:
  """accuracy (left) and loss (right) against the attention FLOPs per token (log axis): each seed a dot,
  the mean a bar, one colour a group, a tick at each distinct FLOPs value; the legend below the panels."""
  fig, axes = plt.subplots(1, 2, figsize=(12, 5.2))
  totals = sorted({_total(r) for r in rows})
  colours = plt.get_cmap("tab10" if len(rows) <= 10 else "tab20").colors
  for ax, metric, name in ((axes[0], "eval_accuracy", "held-out accuracy"), (axes[1], "eval_loss", "held-out loss")):
    for i, r in enumerate(rows):
      x, values = _total(r), r["seed_values"][metric]
      shift = 1.0 + 0.03 * (i - (len(rows) - 1) / 2) / max(len(rows), 1)  # groups at one FLOPs side by side
      ax.plot([x * shift] * len(values), values, "o", color=colours[i % len(colours)], alpha=0.75, markersize=5,
              label=r["group"].removeprefix("case=") if ax is axes[0] else None)
      ax.plot([x * shift], [float(np.mean(values))], "_", color=colours[i % len(colours)], markersize=16, mew=2.5)
    if metric == "eval_accuracy" and rows[0].get("chance") is not None:
      ax.axhline(rows[0]["chance"], color="grey", linestyle=":", linewidth=1, label="chance")
    ax.set_xscale("log")
    ax.set_xticks(totals)
    ax.set_xticklabels(_labels(totals), fontsize=8)
    ax.minorticks_off()
    ax.set_xlabel("attention FLOPs per token (forward, cores + selectors, all layers)")
    ax.set_ylabel(name)
    ax.grid(alpha=0.3)
  fig.legend(loc="lower center", ncol=min(len(rows) + 1, 6), fontsize=8, frameon=False)
  if caption:  # wrapped to the figure's width (about 13 characters an inch at 9 pt); tight_layout keeps its room
    fig.suptitle(textwrap.fill(caption, width=int(fig.get_figwidth() * 13), break_on_hyphens=False), fontsize=9)
  fig.tight_layout(rect=(0, 0.06 + 0.035 * (len(rows) // 6), 1, 0.98))
  fig.savefig(path, dpi=110)
  plt.close(fig)
