"""`attn report DIR`: report.md and PNG plots from a sweep's store (reads the store only).

Trials are grouped by their axis values without the seed; each group shows the
mean ± std over seeds of the final held-out accuracy and loss. Plots: final
metrics against every numeric axis (one line per value of the other axes),
and training-loss curves. A table lists every trial with its parameter counts,
FLOPs, step time and final metrics; failed trials are listed with their reason.
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Any

import numpy as np

from attn.experiments import store as store_lib

SEED_KEYS = ("train.seed",)
METRICS = (("eval_accuracy", "held-out accuracy"), ("eval_loss", "held-out loss"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("dir", metavar="DIR", help="a sweep directory written by `attn sweep`")


def run(args: argparse.Namespace) -> int:
  print(f"report: {write_report(args.dir)}")
  return 0


def _short(key: str) -> str:
  return key.split(".")[-1]


def _group_name(label: dict[str, Any]) -> str:
  return ", ".join(f"{_short(k)}={v}" for k, v in label.items() if k not in SEED_KEYS) or "all"


def _mean_std(values: list[float]) -> tuple[float, float]:
  a = np.asarray(values, float)
  return float(a.mean()), float(a.std(ddof=1)) if len(a) > 1 else 0.0


def _fmt(x: Any, digits: int = 4) -> str:
  if x is None:
    return "–"
  if isinstance(x, float):
    return f"{x:.{digits}g}" if math.isfinite(x) else str(x)
  if isinstance(x, int) and abs(x) >= 10_000:
    return f"{x:,}"
  return str(x)


def summarize(trials: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """One row per group of trials equal but for the seed: mean and std of final metrics."""
  groups: dict[str, list[dict[str, Any]]] = {}
  for t in trials:
    if t["summary"] and t["summary"]["status"] == "ok":
      groups.setdefault(_group_name(t["label"]), []).append(t)
  rows = []
  for name, ts in groups.items():
    row = {"group": name, "label": {k: v for k, v in ts[0]["label"].items() if k not in SEED_KEYS},
           "n": len(ts), "model_params": ts[0]["summary"].get("model_params"),
           "curves": [[r["loss"] for r in t["rows"]] for t in ts]}
    for key, _ in METRICS:
      row[key] = _mean_std([t["summary"]["final"][key] for t in ts])
    rows.append(row)
  return sorted(rows, key=lambda r: -r["eval_accuracy"][0])


def answer(rows: list[dict[str, Any]]) -> str:
  """The measured answer: best and worst group, and whether their gap exceeds seed noise."""
  if not rows:
    return "No trial finished, so there is no answer yet."
  best, worst = rows[0], rows[-1]
  text = (f"Best: **{best['group']}**, held-out accuracy {best['eval_accuracy'][0]:.3f} ± "
          f"{best['eval_accuracy'][1]:.3f} (loss {best['eval_loss'][0]:.3f}, {best['n']} seeds).")
  if len(rows) > 1:
    gap = best["eval_accuracy"][0] - worst["eval_accuracy"][0]
    noise = max(best["eval_accuracy"][1], worst["eval_accuracy"][1])
    verdict = ("larger than the seed-to-seed spread" if gap > 2 * noise and min(best["n"], worst["n"]) > 1
               else "within about twice the seed-to-seed spread (or one seed only): not a clear difference")
    text += (f" Worst: **{worst['group']}**, {worst['eval_accuracy'][0]:.3f} ± "
             f"{worst['eval_accuracy'][1]:.3f}. The gap, {gap:.3f}, is {verdict}.")
    by_loss = sorted(rows, key=lambda r: r["eval_loss"][0])
    lo, hi = by_loss[0], by_loss[-1]
    text += (f" By held-out loss: lowest **{lo['group']}** ({lo['eval_loss'][0]:.3f} ± "
             f"{lo['eval_loss'][1]:.3f}), highest **{hi['group']}** ({hi['eval_loss'][0]:.3f} ± "
             f"{hi['eval_loss'][1]:.3f}).")
  return text


def _plots(rows: list[dict[str, Any]], axes: list[str], out_dir: str) -> list[str]:
  """Final metrics against each numeric axis, and loss curves; returns the PNG file names."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return []
  made = []
  swept = [a for a in axes if a not in SEED_KEYS]
  for x_key in swept:
    values = {r["label"].get(x_key) for r in rows}
    if len(values) < 2 or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
      continue
    fig, panels = plt.subplots(1, 2, figsize=(10, 4))
    lines: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
      rest = ", ".join(f"{_short(k)}={v}" for k, v in r["label"].items() if k != x_key) or "all"
      lines.setdefault(rest, []).append(r)
    for ax, (metric, title) in zip(panels, METRICS):
      for name, rs in lines.items():
        rs = sorted(rs, key=lambda r: r["label"][x_key])
        ax.errorbar([r["label"][x_key] for r in rs], [r[metric][0] for r in rs],
                    yerr=[r[metric][1] for r in rs], marker="o", capsize=3, label=name)
      ax.set_xscale("log", base=2)
      ax.set_xlabel(_short(x_key))
      ax.set_title(f"{title} (mean ± std over seeds)")
    panels[0].legend(fontsize=7)
    fig.tight_layout()
    name = f"final_vs_{_short(x_key)}.png"
    fig.savefig(os.path.join(out_dir, name), dpi=100)
    plt.close(fig)
    made.append(name)
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for r in rows:
    n = min(len(c) for c in r["curves"])
    if n:
      ax.plot(np.mean([c[:n] for c in r["curves"]], axis=0), label=r["group"], lw=1)
  ax.set_xlabel("step")
  ax.set_ylabel("training loss (mean over seeds)")
  ax.set_yscale("log")
  if len(rows) <= 20:
    ax.legend(fontsize=6)
  fig.tight_layout()
  fig.savefig(os.path.join(out_dir, "loss_curves.png"), dpi=100)
  plt.close(fig)
  return made + ["loss_curves.png"]


def _trial_table(trials: list[dict[str, Any]]) -> list[str]:
  cols = ["id", "trial", "status", "model params", "attn params (analytic)", "attn params (effective)",
          "attn FLOPs fwd/seq", "step ms", "compile s", "train loss", "eval loss", "eval acc"]
  lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
  for t in trials:
    s = t["summary"] or {}
    final = s.get("final", {})
    step_ms = s["step_time_s_median"] * 1e3 if "step_time_s_median" in s else None
    if step_ms is not None and s.get("group_size", 1) > 1:
      step_ms = f"{step_ms:.3g} (×{s['group_size']} seeds)"
    cells = [t["id"], ", ".join(f"{_short(k)}={v}" for k, v in t["label"].items()) or "–",
             s.get("status", "unfinished"), s.get("model_params"), s.get("attention_params_analytic"),
             s.get("attention_params_effective"), s.get("attention_flops_fwd"), step_ms,
             s.get("compile_s"), final.get("loss"), final.get("eval_loss"), final.get("eval_accuracy")]
    lines.append("| " + " | ".join(_fmt(c, 3) if not isinstance(c, str) else c for c in cells) + " |")
  return lines


def write_report(root: str) -> str:
  """Writes DIR/report.md and DIR/*.png from the store; returns the report's path."""
  header = store_lib.load_sweep(root)
  trials = list(store_lib.iter_trials(root))
  rows = summarize(trials)
  plots = _plots(rows, header["axes"], root)
  status = [t["summary"]["status"] if t["summary"] else "unfinished" for t in trials]
  sets = " ".join(f"--set {o}" for o in header.get("overrides", []))
  md = [f"# {header['name']}", ""]
  if header.get("question"):
    md += [f"**Question.** {header['question']}", ""]
  md += [f"**Measured answer.** {answer(rows)}", "",
         f"Sweep `{header['sweep_id']}` from `{header['config_path']}`; reproduce with "
         f"`attn sweep {header['config_path']} --out {root}{' ' + sets if sets else ''}`. "
         f"{len(trials)} trials: {status.count('ok')} ok, {status.count('failed')} failed, "
         f"{status.count('unfinished')} unfinished. Metrics are the last step's; held-out "
         "metrics come from batches the trial never trained on.", "",
         "## Groups (mean ± std over seeds)", "",
         "| group | seeds | model params | eval accuracy | eval loss |", "|---|---|---|---|---|"]
  for r in rows:
    md.append(f"| {r['group']} | {r['n']} | {_fmt(r['model_params'])} | "
              f"{r['eval_accuracy'][0]:.4f} ± {r['eval_accuracy'][1]:.4f} | "
              f"{r['eval_loss'][0]:.4f} ± {r['eval_loss'][1]:.4f} |")
  md += ["", "## Plots", ""]
  md += [f"![{p}]({p})" for p in plots] or ["(matplotlib is not installed: `pip install matplotlib`)"]
  md += ["", "## Trials", "",
         "Attention counts are summed over layers; effective parameters are the degrees of freedom "
         "of the function (see `attn count`). Step time is the median wall time of one step "
         "(a step of a vmapped group trains all its seeds at once).", ""]
  md += _trial_table(trials)
  failed = [t for t in trials if t["summary"] and t["summary"]["status"] == "failed"]
  if failed:
    md += ["", "## Failed trials", ""]
    md += [f"- `{t['id']}` [{_group_name(t['label'])}, seed={t['label'].get('train.seed', '–')}]: "
           f"{t['summary']['reason']}" for t in failed]
  path = os.path.join(root, "report.md")
  store_lib.atomic_write(path, "\n".join(md) + "\n")
  return path
