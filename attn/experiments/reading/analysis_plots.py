"""Plots of one trial's analysis (attn analyze): attention patterns, circuit spectra, importance, pruning.

Each function reads the analysis dict that analysis.json holds (plus, for the
attention grid, one example's weights) and writes one PNG.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from attn.experiments.reading.plots import _pyplot, show
from attn.experiments.running.config import axis_name

PLOTS = ("attention.png", "spectra.png", "importance.png", "pruning.png")


def _title(a: dict[str, Any]) -> str:
  dims = f"{a['variant']}, h={a['num_heads']}, d_k={a['d_k']}, d_v={a['d_v']}"
  if a.get("hf"):  # a pretrained model (attn analyze --hf)
    scored = {"sentence_pairs": "; loss: in-batch ranking of window halves, accuracy: top-1 retrieval",
              "masked_lm": "; masked-LM loss and accuracy"}.get(a.get("objective"), "")
    family = f"{a['family']} model" if a.get("family") else "Hugging Face checkpoint"
    return f"{family} from {a['hf']}\n{dims}, text {a['text'] or 'Python stdlib'}{scored}"
  label = ", ".join(f"{axis_name(k)}={show(v)}" for k, v in a["label"].items())
  return f"trial {a['trial']} [{label}]\ntask {a.get('task', '?')}, {dims}, checkpoint of step {a['step']}"


def attention_grid(plt, a: dict[str, Any], weights: list[np.ndarray], path: str) -> None:
  """One held-out example's attention weights, a panel per layer (rows) and head (columns)."""
  from matplotlib.colors import PowerNorm
  L, H = len(weights), weights[0].shape[0]
  size = max(1.3, min(3.0, 16 / max(H, 1), 11 / max(L, 1)))
  fig, grid = plt.subplots(L, H, figsize=(max(size * H + 1.4, 6.0), (size + 0.45) * L + 1.1), squeeze=False)
  image = None
  signed = any(float(np.min(w)) < 0 for w in weights)
  for l, w_HTS in enumerate(weights):
    stats = a["layers"][l]["attention"]
    importance = a["layers"][l]["importance"]["normalized"]
    for h in range(H):
      ax = grid[l, h]
      if signed:  # differential's weights A1 − λ·A2
        image = ax.imshow(w_HTS[h], cmap="RdBu_r", vmin=-1.0, vmax=1.0, interpolation="nearest")
      else:
        image = ax.imshow(w_HTS[h], cmap="Blues", norm=PowerNorm(0.5, vmin=0.0, vmax=1.0),
                          interpolation="nearest")
      # under sigmoid or ReLU (or differential) the rows are no distributions: no entropy (analyze.summarize)
      entropy = stats["entropy"][h] if (a.get("summary") or {}).get("attention_entropy", 0) is not None else None
      ax.set_title(f"layer {l} head {h}\nentropy {'–' if entropy is None else f'{entropy:.2f}'}, "
                   f"imp. {importance[h]:.2f}", fontsize=7)
      ax.set_xticks([])
      ax.set_yticks([])
      if l == L - 1:
        ax.set_xlabel("key s", fontsize=7)
      if h == 0:
        ax.set_ylabel("query t", fontsize=7)
  fig.suptitle("attention weights of one held-out example\n(entropy: mean over held-out data, "
               "nats; imp.: normalised importance)\n" + _title(a), fontsize=8)
  fig.tight_layout(rect=(0, 0, 1 - 1.0 / fig.get_figwidth(), 1))
  bar = fig.add_axes((1 - 0.8 / fig.get_figwidth(), 0.15, 0.2 / fig.get_figwidth(), 0.6))
  fig.colorbar(image, cax=bar).ax.tick_params(labelsize=7)
  fig.savefig(path, dpi=90)
  plt.close(fig)


def spectra(plt, a: dict[str, Any], path: str) -> None:
  """Singular values of W_QK,h (top) and W_OV,h (bottom) per layer, one line per head, d_k/d_v marked."""
  from matplotlib import ticker
  L, H = a["num_layers"], a["num_heads"]
  fig, grid = plt.subplots(2, L, figsize=(max(4.2 * L, 7.0), 6.5), squeeze=False)
  cmap = plt.get_cmap("tab10" if H <= 10 else "viridis")
  for l, layer in enumerate(a["layers"]):
    for row, (name, width, what) in enumerate((("qk", a["d_k"], "W_QK"), ("ov", a["d_v"], "W_OV"))):
      ax = grid[row, l]
      for h in range(H):
        s = np.asarray(layer[name]["singular_values"][h], float)
        s = s[s > s[0] * 1e-7] if s[0] > 0 else s[:0]  # zeros (past the factor width) cannot sit on a log axis
        colour = cmap(h % 10) if H <= 10 else cmap(h / max(H - 1, 1))
        ax.plot(np.arange(1, len(s) + 1), s, "-", marker=".", ms=3, lw=1, color=colour,
                label=f"head {h}")
      ax.axvline(width, color="0.4", ls="--", lw=1)
      ax.text(width, 1.0, f" {'d_k' if name == 'qk' else 'd_v'}={width}", transform=ax.get_xaxis_transform(),
              fontsize=7, va="top", color="0.3")
      ax.set_yscale("log")
      ax.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
      ax.yaxis.set_minor_formatter(ticker.NullFormatter())
      ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
      eff = ", ".join(f"{v:.1f}" for v in layer[name]["effective_rank"])
      ax.set_title(f"layer {l}: {what},h singular values\neffective rank per head: {eff}", fontsize=8)
      ax.set_xlabel("index i", fontsize=8)
      ax.set_ylabel("σ_i", fontsize=8)
      ax.tick_params(labelsize=7)
      ax.grid(alpha=0.3, which="both")
  if 1 < H <= 10:
    grid[0, 0].legend(fontsize=6, loc="lower left", ncol=2)
  fig.suptitle(_title(a), fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  plt.close(fig)


def importance(plt, a: dict[str, Any], path: str) -> None:
  """Normalised importance per layer and head, annotated with the order in which pruning removes it."""
  L, H = a["num_layers"], a["num_heads"]
  norm_LH = np.array([layer["importance"]["normalized"] for layer in a["layers"]], float)
  raw_LH = np.array([layer["importance"]["raw"] for layer in a["layers"]], float)
  rank = {tuple(lh): i + 1 for i, lh in enumerate(a["pruning"]["order"])}
  fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * H + 2.5), max(3.0, 0.7 * L + 2.0)))
  image = ax.imshow(norm_LH, cmap="Oranges", vmin=0.0, vmax=1.0, aspect="auto")
  for l in range(L):
    for h in range(H):
      colour = "white" if norm_LH[l, h] > 0.6 else "black"
      ax.text(h, l, f"{norm_LH[l, h]:.2f}\n({raw_LH[l, h]:.2g})\n#{rank[(l, h)]}", ha="center",
              va="center", fontsize=7 if H <= 8 else 5, color=colour)
  ax.set_xticks(range(H), [str(h) for h in range(H)], fontsize=8)
  ax.set_yticks(range(L), [str(l) for l in range(L)], fontsize=8)
  ax.set_xlabel("head")
  ax.set_ylabel("layer")
  ax.set_title("head importance E|∂L/∂ξ|, normalised per layer (raw in brackets);\n#k: the k-th head "
               "pruned\n" + _title(a), fontsize=8)
  fig.colorbar(image, ax=ax, fraction=0.05).ax.tick_params(labelsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  plt.close(fig)


def pruning(plt, a: dict[str, Any], path: str) -> None:
  """Held-out accuracy and loss against the number of heads gated off, least important first."""
  p = a["pruning"]
  n = a["num_layers"] * a["num_heads"]
  off, acc, loss = p["heads_off"], p["accuracy"], p["loss"]
  fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
  left.plot(off, acc, "-o", ms=4, color="C0")
  left.axhline(acc[0] - p["tolerance"], color="C3", ls="--", lw=1,
               label=f"unpruned − {p['tolerance']:g}")
  kept = round(p["prunable_fraction"] * n)
  left.axvline(kept, color="0.4", ls=":", lw=1,
               label=f"prunable: {kept}/{n} heads ({p['prunable_fraction']:.0%})")
  left.set_ylim(-0.02, 1.02)
  left.set_ylabel("held-out accuracy")
  left.legend(fontsize=7, loc="lower left")
  right.plot(off, loss, "-o", ms=4, color="C1")
  right.set_ylabel("held-out loss")
  if min(loss) > 0 and max(loss) / min(loss) > 20:
    from matplotlib import ticker
    right.set_yscale("log")
    right.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
  order = p["order"]
  for ax in (left, right):
    if len(off) <= 17:  # label each point with the head removed to reach it
      ax.set_xticks(off, ["0"] + [f"{k}\nL{order[k - 1][0]}H{order[k - 1][1]}" for k in off[1:]], fontsize=6)
    ax.set_xlabel("heads gated off (least important first)", fontsize=8)
    ax.grid(alpha=0.3)
  fig.suptitle("pruning curve on held-out data\n" + _title(a), fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  plt.close(fig)


def make_plots(a: dict[str, Any], weights: list[np.ndarray], out_dir: str) -> list[str]:
  """Writes the PNGs of one trial into out_dir; returns their names ([] without matplotlib).

  A variant without per-head circuits (its refusal is in the layers' "refused") has no spectra plot.
  """
  plt = _pyplot()
  if plt is None:
    return []
  attention_grid(plt, a, weights, os.path.join(out_dir, PLOTS[0]))
  has_spectra = "refused" not in a["layers"][0]["qk"]
  if has_spectra:
    spectra(plt, a, os.path.join(out_dir, PLOTS[1]))
  importance(plt, a, os.path.join(out_dir, PLOTS[2]))
  pruning(plt, a, os.path.join(out_dir, PLOTS[3]))
  return [name for name in PLOTS if has_spectra or name != PLOTS[1]]
