"""The table and plots of experiments/qk_control/ from a store of configs/qk_control.toml.

  python scripts/qk_control_plots.py RUN_DIR [--out experiments/qk_control]

Reads each finished trial's evaluation rows (RUN_DIR/trials/ID/metrics.jsonl, with train.logit_metrics:
max_logit, the largest logit the softmax reads, and max_score, the scaled score before a softcap) and
writes
  qk_control.png         against the learning rate (ticks at the swept values): the largest attention
                         logit over training (log scale) and the final held-out bits per byte; one
                         line a case through its seeds' means, each seed a dot;
  qk_control_curves.png  the largest logit at each evaluation over training, a panel a learning rate,
                         a colour a case, one line a seed;
  qk_control_table.md    one row a (case, learning rate): the largest logit over training and the
                         largest score (mean over seeds and the largest seed), final bits per byte
                         (mean ± SE), the change over the last 10% of steps (mean over seeds;
                         "flat" when smaller than the SE), and "stable": every seed's final bits per
                         byte at most the same case's mean at the lowest rate + 2 SE (the two SEs
                         combined): pushing the rate cost no seed what the lowest rate reached.
"""

from __future__ import annotations

import argparse
import json
import math
import os

import matplotlib
import matplotlib.ticker
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

LN2 = math.log(2.0)


def load(run_dir: str) -> tuple[list[dict], int]:
  """(the finished trials: case, lr, seed, eval rows, final), the count not finished."""
  with open(os.path.join(run_dir, "sweep.json"), encoding="utf-8") as f:
    head = json.load(f)
  out, missing = [], 0
  for t in head["trials"]:
    d = os.path.join(run_dir, "trials", t["id"])
    if not os.path.exists(os.path.join(d, "summary.json")):
      missing += 1
      continue
    with open(os.path.join(d, "metrics.jsonl"), encoding="utf-8") as f:
      rows = [r for r in map(json.loads, f) if "eval_loss" in r]
    with open(os.path.join(d, "config.json"), encoding="utf-8") as f:
      cfg = json.load(f)
    out.append({"case": t["label"]["case"], "lr": cfg["train"]["lr"], "seed": cfg["train"]["seed"],
                "steps": cfg["train"]["steps"], "rows": rows, "final": rows[-1]})
  return out, missing


def mean_se(xs) -> tuple[float, float]:
  xs = np.asarray(xs, float)
  return float(xs.mean()), float(xs.std(ddof=1) / math.sqrt(len(xs))) if len(xs) > 1 else 0.0


def bpb(row: dict) -> float:
  return row["eval_loss"] / LN2


def peak(trial: dict, key: str) -> float:
  return max(r[key] for r in trial["rows"])


def cells(trials: list[dict]) -> dict[tuple[str, float], list[dict]]:
  out: dict = {}
  for t in trials:
    out.setdefault((t["case"], t["lr"]), []).append(t)
  return out


def table(trials: list[dict], cases: list[str], lrs: list[float]) -> list[str]:
  by = cells(trials)
  lines = ["| case | lr | largest logit (mean; max seed) | largest score | final bits/byte | last 10% | stable |",
           "|---|---|---|---|---|---|---|"]
  for case in cases:
    low = by.get((case, lrs[0]), [])
    low_m, low_se = mean_se([bpb(t["final"]) for t in low]) if low else (math.nan, 0.0)
    for lr in lrs:
      ts = by.get((case, lr), [])
      if not ts:
        lines.append(f"| {case} | {lr:g} | not run | | | | |")
        continue
      logit = [peak(t, "max_logit") for t in ts]
      score = [peak(t, "max_score") for t in ts]
      m, se = mean_se([bpb(t["final"]) for t in ts])
      late = []
      for t in ts:  # the change over the last 10% of steps: the last row against the row at 90%
        cut = 0.9 * t["steps"]
        before = [r for r in t["rows"] if r["step"] + 1 <= cut][-1]
        late.append(bpb(t["final"]) - bpb(before))
      worst = max(bpb(t["final"]) for t in ts)
      stable = "yes" if worst <= low_m + 2 * math.hypot(se, low_se) else "no"
      flat = "flat" if abs(np.mean(late)) < se else "moving"
      lines.append(f"| {case} | {lr:g} | {np.mean(logit):.3g}; {max(logit):.3g} | {np.mean(score):.3g} | "
                   f"{m:.4f} ± {se:.4f} ({len(ts)} seeds) | {np.mean(late):+.4f} ({flat}) | {stable} |")
  return lines


def plots(trials: list[dict], cases: list[str], lrs: list[float], out: str) -> None:
  colours = dict(zip(cases, plt.get_cmap("tab10").colors))
  by = cells(trials)
  fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
  for ax, (key, label) in zip(axes, [("logit", "largest attention logit over training"),
                                     ("bpb", "final held-out bits per byte")]):
    for i, case in enumerate(cases):
      xs, ms = [], []
      for lr in lrs:
        ts = by.get((case, lr), [])
        if not ts:
          continue
        vals = [peak(t, "max_logit") if key == "logit" else bpb(t["final"]) for t in ts]
        jitter = lr * (1 + 0.04 * (i - len(cases) / 2))
        ax.scatter([jitter] * len(vals), vals, s=12, color=colours[case], alpha=0.6)
        xs.append(jitter)
        ms.append(float(np.mean(vals)))
      ax.plot(xs, ms, "-o", ms=4, color=colours[case], label=case)
    ax.set_xscale("log")
    if key == "logit":
      ax.set_yscale("log")
    ax.set_xticks(lrs, [f"{lr:g}" for lr in lrs])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xlabel("peak learning rate (AdamW, warm-up then cosine to 0)")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
  axes[0].legend(fontsize=8)
  fig.suptitle("Byte-level LM (Python stdlib), T = 64, 2 layers, d_model 64, 4 heads of 16, 400 steps: "
               "a dot a seed, a line the seeds' mean", fontsize=9)
  fig.tight_layout()
  fig.savefig(os.path.join(out, "qk_control.png"), dpi=120)
  plt.close(fig)

  fig, axes = plt.subplots(1, len(lrs), figsize=(4.2 * len(lrs), 3.8), sharey=True)
  for ax, lr in zip(np.atleast_1d(axes), lrs):
    for case in cases:
      for j, t in enumerate(sorted(by.get((case, lr), []), key=lambda t: t["seed"])):
        ax.plot([r["step"] + 1 for r in t["rows"]], [r["max_logit"] for r in t["rows"]], color=colours[case],
                alpha=0.7, lw=1, label=case if j == 0 else None)
    ax.set_yscale("log")
    ax.set_title(f"lr {lr:g}", fontsize=9)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
  np.atleast_1d(axes)[0].set_ylabel("largest attention logit (first held-out batch)")
  np.atleast_1d(axes)[0].legend(fontsize=7)
  fig.suptitle("The largest logit at each evaluation: a colour a case, a line a seed", fontsize=9)
  fig.tight_layout()
  fig.savefig(os.path.join(out, "qk_control_curves.png"), dpi=120)
  plt.close(fig)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("run_dir")
  parser.add_argument("--out", default="experiments/qk_control")
  args = parser.parse_args(argv)
  trials, missing = load(args.run_dir)
  cases = list(dict.fromkeys(t["case"] for t in trials))
  lrs = sorted({t["lr"] for t in trials})
  os.makedirs(args.out, exist_ok=True)
  lines = table(trials, cases, lrs)
  if missing:
    lines.append(f"\n{missing} trial(s) not finished: not in the table.")
  with open(os.path.join(args.out, "qk_control_table.md"), "w", encoding="utf-8") as f:
    f.write("\n".join(lines) + "\n")
  plots(trials, cases, lrs, args.out)
  print("\n".join(lines))


if __name__ == "__main__":
  main()
