"""The tables and plots of experiments/attention_sinks/ from a finished store of configs/attention_sinks.toml.

  python scripts/attention_sinks_plots.py RUN_DIR [--out experiments/attention_sinks]
  python scripts/attention_sinks_plots.py TEXT_RUN_DIR --text
  python scripts/attention_sinks_plots.py RUN_DIR --against experiments/attention_sinks/sinks_table.md --out DIR

Reads each trial's metrics rows (the train.sink_metrics keys of
attn.experiments.training.sink_eval, measured on the first held-out batch at
every evaluation) and writes sinks_table.md (final values, mean ± std over
seeds, each case against per_head by attn report's rule; from the final
checkpoints, row sums, the first position's share and where the residual's
outliers sit), sink_curves.png
(the baseline's metrics beside its loss), sinks_vs_case.png (the comparison)
and attention_maps.png (per_head and +gate elementwise, seed 0, from the final
checkpoints on the same held-out batch). With --text, from a store of
configs/attention_sinks_text.toml: text_sink_curves.png (every head's mass on
[BOS] over training, per case, against uniform attention's, and the loss).
"""

from __future__ import annotations

import argparse
import json
import os

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from attn.experiments.reading import report  # noqa: E402

METRICS = [("eval_loss", "held-out loss (nats)"), ("first_mass", "first-position mass"),
           ("sink_heads", "sink-head fraction (> 0.3)"), ("active_dormant", "active-dormant share"),
           ("value_drain", "value drain ‖v₀‖ / median"), ("residual_first", "first-token residual / median"),
           ("residual_massive", "largest residual entry / median")]
BASE, GATED = "per_head", "+gate elementwise"


def load(run_dir: str) -> dict[str, list[tuple[int, list[dict]]]]:
  """case -> [(seed, evaluation rows)] in sweep order, seeds ascending."""
  with open(os.path.join(run_dir, "sweep.json"), encoding="utf-8") as f:
    trials = json.load(f)["trials"]
  cases: dict[str, list] = {}
  for t in trials:
    path = os.path.join(run_dir, "trials", t["id"], "metrics.jsonl")
    if not os.path.exists(path):
      continue
    with open(path, encoding="utf-8") as f:
      rows = [r for r in map(json.loads, f) if "eval_loss" in r]
    cases.setdefault(t["label"]["case"], []).append((t["label"]["train.seed"], rows, t["id"]))
  return {c: sorted(v) for c, v in cases.items()}


def against(x: list[float], base: list[float]) -> str:
  """attn report's verdict of x against base, in whichever direction the means differ: clear/suggestive/noise."""
  hi, lo = (x, base) if np.mean(x) >= np.mean(base) else (base, x)
  arrow = "↑" if hi is x else "↓"
  v = report.verdict(hi, lo)
  t = report.compare(hi, lo)[1]
  se = "no spread" if np.isinf(t) else f"{t:.1f} SE"
  if v.startswith("a clear"):
    return f"clear {arrow} ({se})"
  if v.startswith("suggestive"):
    return f"suggestive {arrow} ({se})"
  return f"noise ({se})"


def table(cases: dict) -> str:
  """Markdown: one row per case, each metric's mean ± std and its verdict against per_head."""
  head = "| case | " + " | ".join(label for _, label in METRICS) + " |"
  lines = [head, "|" + "---|" * (len(METRICS) + 1)]
  final = {c: {k: [rows[-1].get(k, np.nan) for _, rows, _ in v] for k, _ in METRICS} for c, v in cases.items()}
  for c in cases:
    cells = []
    for k, _ in METRICS:
      x = final[c][k]
      cell = f"{np.mean(x):.3g} ± {np.std(x, ddof=1):.2g}"
      if c != BASE and BASE in final and not np.isnan(x).any():
        cell += f", {against(x, final[BASE][k])}"
      cells.append(cell)
    lines.append(f"| {c} | " + " | ".join(cells) + " |")
  lines.append("")
  lines.append("Change over the last 10% of steps (attn report's late_change), per seed: "
               "held-out loss / first-position mass")
  lines.append("")
  for c, v in cases.items():
    late = [(report.late_change(rows, "eval_loss"), report.late_change(rows, "first_mass")) for _, rows, _ in v]
    lines.append(f"- {c}: " + ", ".join(f"{a[0]:+.4f} / {b[0]:+.4f}" for a, b in late)
                 + f" (over {late[0][0][1]} steps)")
  lines += ["", "Held-out loss minus per_head's at the same seed (the same held-out batches), and held-out "
            "trigger accuracy (the copy), per seed:", ""]
  for c, v in cases.items():
    d = [rows[-1]["eval_loss"] - b[-1]["eval_loss"] for (_, rows, _), (_, b, _) in zip(v, cases[BASE])]
    acc = [rows[-1].get("eval_trigger_accuracy", np.nan) for _, rows, _ in v]
    lines.append(f"- {c}: " + ", ".join(f"{x:+.4f}" for x in d) + "; trigger accuracy "
                 + ", ".join(f"{a:.3f}" for a in acc))
  return "\n".join(lines) + "\n"


def curves(cases: dict, out: str) -> None:
  """The baseline's first-position mass per head, sink-head fraction and held-out loss over steps."""
  fig, ax = plt.subplots(1, 3, figsize=(15, 4))
  colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  for i, (seed, rows, _) in enumerate(cases[BASE]):
    steps = [r["step"] + 1 for r in rows]
    heads = sorted(k for k in rows[-1] if k.startswith("first_mass_l0h"))
    for j, k in enumerate(heads):
      ax[0].plot(steps, [r[k] for r in rows], color=colors[i], lw=1, alpha=0.4 + 0.15 * j,
                 label=f"seed {seed}" if j == 0 else None)
    ax[1].plot(steps, [r["sink_heads"] for r in rows], color=colors[i], label=f"seed {seed}", marker=".", ms=3)
    ax[2].plot(steps, [r["eval_loss"] for r in rows], color=colors[i], label=f"seed {seed}")
  ax[0].axhline(0.3, color="k", ls="--", lw=0.8)
  ax[0].set(title="per_head: first-position mass, each head", xlabel="step", ylabel="mass on [BOS]")
  ax[1].set(title="per_head: sink-head fraction (mass > 0.3)", xlabel="step", yticks=[0, 0.25, 0.5, 0.75, 1])
  ax[2].set(title="per_head: held-out loss", xlabel="step", ylabel="nats per token")
  _save_curves(fig, ax, os.path.join(out, "sink_curves.png"), legend_size=8)


def _save_curves(fig, ax, path: str, legend_size: int) -> None:
  """Legends and grids on every panel of a curves figure, then the PNG."""
  for a in ax:
    a.legend(fontsize=legend_size)
    a.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def comparison(cases: dict, out: str) -> None:
  """Each metric's final value per case, one dot per seed, the mean as a bar; the loss paired with per_head's."""
  names = list(cases)
  base = {seed: rows[-1]["eval_loss"] for seed, rows, _ in cases[BASE]}
  fig, axes = plt.subplots(2, 4, figsize=(15, 8), layout="constrained")
  for a, (k, label) in zip(axes.flat, METRICS):
    for i, c in enumerate(names):
      x = [rows[-1].get(k, np.nan) - (base[seed] if k == "eval_loss" else 0) for seed, rows, _ in cases[c]]
      a.bar(i, np.nanmean(x), color="0.85")
      for seed, xi in zip([s for s, _, _ in cases[c]], x):
        a.scatter(i, xi, s=16, zorder=3, color=f"C{seed}", label=f"seed {seed}" if i == 0 else None)
    a.set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize=8)
    a.set_title("held-out loss − per_head's, same seed" if k == "eval_loss" else label, fontsize=9)
    a.grid(axis="y", alpha=0.3)
  axes[0, 1].axhline(0.3, color="k", ls="--", lw=0.8)
  axes[0, 1].axhline(np.mean(1 / np.arange(2, 65)), color="k", ls=":", lw=0.8)  # uniform causal attention, t >= 1
  axes[0, 1].text(0, 0.3, "threshold 0.3", fontsize=7, va="bottom")
  axes[1, 3].axis("off")
  axes[1, 3].legend(*axes[0, 0].get_legend_handles_labels(), loc="center", title="dots: one per seed")
  fig.savefig(os.path.join(out, "sinks_vs_case.png"), dpi=100)
  plt.close(fig)


def forward(run_dir: str, seed: int, trial: str) -> tuple[np.ndarray, np.ndarray]:
  """The final checkpoint's layer-0 weights (B,H,T,T) and residual (B,T,D) on the first held-out batch
  (the one the sink metrics read)."""
  from attn.experiments.data import tasks
  from attn.experiments.reading.trials import load_trial
  from attn.nn import models
  model, _, task = load_trial(run_dir, trial)
  with models.record_residuals() as residuals:
    _, weights = model(task.batch(seed, tasks.EVAL, 0, 32)["tokens"], return_weights=True)
  return np.asarray(weights[0], np.float64), np.asarray(residuals[0], np.float64)


def weights_of(run_dir: str, seed: int, trial: str) -> np.ndarray:
  return forward(run_dir, seed, trial)[0]


def outliers(run_dir: str, cases: dict, factor: float = 100.0) -> str:
  """Per trial: where the largest residual entry sits, and which positions and dimensions exceed factor × median."""
  lines = ["", f"Residual entries |h| above {factor:g} × the median (final checkpoints, first held-out batch): "
           "largest / median at position t, count, positions, number of dimensions:", ""]
  for c, v in cases.items():
    for seed, _, trial in v:
      a = np.abs(forward(run_dir, seed, trial)[1])
      med = np.median(a)
      _, t, _ = np.unravel_index(a.argmax(), a.shape)
      big = np.nonzero(a > factor * med)
      where = sorted(set(big[1].tolist()))
      lines.append(f"- {c}, seed {seed}: {a.max() / med:.0f}× at t = {t}; {len(big[0])} entries"
                   + (f" at t in {where[:3]}{'…' if len(where) > 3 else ''} ({len(where)} positions), "
                      f"{len(set(big[2].tolist()))} dimensions" if len(big[0]) else ""))
  return "\n".join(lines) + "\n"


def shares(run_dir: str, cases: dict) -> str:
  """Per case and seed: the mean row sum and the first position's share w_0 / sum_s w_s (queries t >= 1)."""
  lines = ["", "Rows normalised (final checkpoints, first held-out batch, queries t >= 1, mean over heads): "
           "row sum / first position's share of the row, per seed:", ""]
  for c, v in cases.items():
    cells = []
    for seed, _, trial in v:
      w = weights_of(run_dir, seed, trial)[:, :, 1:, :]
      total = w.sum(-1)
      share = np.where(total > 0, w[..., 0] / np.where(total > 0, total, 1), 0.0)
      signed = (w < 0).any()  # differential: rows sum to about 0, a share is not defined
      cells.append(f"{total.mean():.3f} / " + ("signed" if signed else f"{share.mean():.3f}"))
    lines.append(f"- {c}: " + ", ".join(cells))
  return "\n".join(lines) + "\n"


def maps(run_dir: str, cases: dict, out: str, example: int = 0) -> None:
  """Every head's attention on one held-out example, per_head above +gate elementwise (seed 0, final checkpoints)."""
  fig, ax = plt.subplots(2, 4, figsize=(14, 7), layout="constrained")
  for r, case in enumerate((BASE, GATED)):
    seed, _, trial = cases[case][0]
    w_BHTT = weights_of(run_dir, seed, trial)
    w_HTT, mass = w_BHTT[example], w_BHTT[:, :, 1:, 0].mean((0, 2))
    for h in range(w_HTT.shape[0]):
      im = ax[r, h].imshow(w_HTT[h], cmap="viridis", vmin=0, vmax=1)
      ax[r, h].set_title(f"{case} seed {seed}, head {h}\nmass on [BOS] {mass[h]:.2f} (batch mean)", fontsize=8)
      ax[r, h].set(xticks=[0, 16, 32, 48, 63], yticks=[0, 16, 32, 48, 63], xlabel="key", ylabel="query" if h == 0 else None)
  fig.colorbar(im, ax=ax, shrink=0.6)
  fig.savefig(os.path.join(out, "attention_maps.png"), dpi=100)
  plt.close(fig)


def _mean_std(cell: str) -> tuple[float, float] | None:
  """"0.366 ± 0.05, clear ↓ (8.8 SE)" -> (0.366, 0.05)."""
  try:
    mean, std = cell.split(",")[0].split("±")
    return float(mean), float(std)
  except ValueError:
    return None


def reproduction(cases: dict, committed_md: str, seeds: int = 3) -> str:
  """Markdown: each case's final metrics in this store against a committed sinks_table.md's mean ± std.

  Δ in standard errors of the difference of two means of `seeds` seeds each,
  |Δ| / sqrt((s_new² + s_old²) / seeds); within the seeds' spread below 2 (as
  attn report's "suggestive" threshold), and always when both spreads are 0 and the means agree.
  """
  with open(committed_md, encoding="utf-8") as f:
    rows = [l for l in f.read().split("\n\n")[0].splitlines() if l.startswith("| ") and not l.startswith("| case")]
  old = {r.split("|")[1].strip(): [_mean_std(c) for c in r.split("|")[2:-1]] for r in rows}
  lines = ["| case | " + " | ".join(label for _, label in METRICS) + " |", "|" + "---|" * (len(METRICS) + 1)]
  outside = []
  for c, v in cases.items():
    cells = []
    for (k, label), committed in zip(METRICS, old.get(c, [None] * len(METRICS))):
      x = [rows_[-1].get(k, np.nan) for _, rows_, _ in v]
      m, sd = float(np.mean(x)), float(np.std(x, ddof=1))
      if committed is None:
        cells.append(f"{m:.3g} ± {sd:.2g}")
        continue
      se = np.sqrt((sd ** 2 + committed[1] ** 2) / seeds)
      z = abs(m - committed[0]) / se if se > 0 else (0.0 if np.isclose(m, committed[0]) else np.inf)
      if z >= 2:
        outside.append(f"{c}: {label}")
      cells.append(f"{m:.3g} ± {sd:.2g} (was {committed[0]:.3g} ± {committed[1]:.2g}; {z:.1f} SE)")
    lines.append(f"| {c} | " + " | ".join(cells) + " |")
  lines += ["", f"Outside the seeds' spread (2 SE or more): {', '.join(outside) or 'none'}", ""]
  return "\n".join(lines)


def uniform_first_mass(n: int) -> float:
  """Uniform causal attention's weight on position 0, averaged over queries t = 1..n-1 (t sees t + 1 keys)."""
  return float(np.mean([1.0 / (t + 1) for t in range(1, n)]))


def text_curves(cases: dict, out: str, positions: int) -> None:
  """configs/attention_sinks_text.toml: each case's heads' first-position mass over training, and the loss."""
  fig, ax = plt.subplots(1, len(cases) + 1, figsize=(5 * (len(cases) + 1), 4))
  colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  uniform = uniform_first_mass(positions)
  for a, (case, runs) in zip(ax, cases.items()):
    for seed, rows, _ in runs:
      steps = [r["step"] + 1 for r in rows]
      heads = sorted(k for k in rows[-1] if k.startswith("first_mass_l") and "_trigger" not in k and "_other" not in k)
      for k in heads:
        layer = int(k.split("_l")[1].split("h")[0])
        a.plot(steps, [r[k] for r in rows], color=colors[layer], lw=1, alpha=0.7,
               label=f"layer {layer}, seed {seed}" if k.endswith("h0") else None)
      ax[-1].plot(steps, [r["eval_loss"] for r in rows], label=f"{case}, seed {seed}", marker=".", ms=3)
    a.axhline(0.3, color="k", ls="--", lw=0.8, label="sink threshold 0.3")
    a.axhline(uniform, color="gray", ls=":", lw=1, label=f"uniform causal attention ({uniform:.3f})")
    a.set(title=f"{case}: mass on [BOS], each head", xlabel="step", ylabel="first-position mass", yscale="log",
          ylim=(1e-3, 1.0))
  ax[-1].set(title="held-out loss", xlabel="step", ylabel="nats per byte")
  _save_curves(fig, ax, os.path.join(out, "text_sink_curves.png"), legend_size=7)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("run_dir")
  p.add_argument("--out", default="experiments/attention_sinks")
  p.add_argument("--text", action="store_true",
                 help="the store is configs/attention_sinks_text.toml's: write text_sink_curves.png only")
  p.add_argument("--against", metavar="SINKS_TABLE",
                 help="a committed sinks_table.md: write reproduction.md, this store's final metrics against it")
  args = p.parse_args()
  os.makedirs(args.out, exist_ok=True)
  cases = load(args.run_dir)
  if args.against:
    with open(os.path.join(args.out, "reproduction.md"), "w", encoding="utf-8") as f:
      f.write(reproduction(cases, args.against))
    return
  if args.text:
    text_curves(cases, args.out, positions=256)  # the model sees [BOS] and 255 bytes, predicts 256
    return
  with open(os.path.join(args.out, "sinks_table.md"), "w", encoding="utf-8") as f:
    f.write(table(cases) + shares(args.run_dir, cases) + outliers(args.run_dir, cases))
  curves(cases, args.out)
  comparison(cases, args.out)
  if GATED in cases:
    maps(args.run_dir, cases, args.out)


if __name__ == "__main__":
  main()
