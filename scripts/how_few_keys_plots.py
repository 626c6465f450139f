"""The table and plots of experiments/how_few_keys/ from a store of configs/how_few_keys.toml (finished or not).

  python scripts/how_few_keys_plots.py RUN_DIR [--out experiments/how_few_keys]

Reads each finished trial's evaluation rows (RUN_DIR/trials/ID/metrics.jsonl; trials still running or
not started are counted, not drawn) and writes
  how_few_keys.png     held-out accuracy at T against the key budget k (ticks at the swept k), against
                       the attention FLOPs per token and against the key bytes a query reads: one line a
                       selection through its seeds' means, each seed a dot, full attention a band
                       (mean ± 2 SE with 2+ seeds, its one value otherwise) and a point;
  how_few_keys_curves.png   held-out accuracy over training, a panel a selection, a colour a budget,
                       full attention in each panel, one line a seed;
  how_few_keys_table.md     one row a case: keys a query, FLOPs, key bytes, the selector's parameters
                       and FLOPs, accuracy (mean ± SE), seeds, the change over the last 10% of steps;
                       then a line a selection: the smallest budget within 2 SE of full attention.

FLOPs per token: attn.experiments.reading.selection.attention_flops (the cores and the selectors, all
layers, forward, in closed form at the task's T). Key bytes a query (float32, all layers, the mean over
the T causal queries): the keys and values its core reads (keys a query × G × (d_k + d_v) × 4) plus
what its selector reads of the keys: MoBA one mean key (G × d_k) a visible block, the lightning indexer
one index key (G × head_dim) a visible key, NSA nothing beyond its compressed keys (counted among the
keys: its choice reads the compressed scores). Projections and the feed-forward are left out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from attn.experiments.reading import selection  # noqa: E402

FAMILIES = ("window", "moba", "indexer", "nsa", "pooled")  # "pooled": the pooled indexer's slot (README)
COLOURS = {"window": "tab:orange", "moba": "tab:green", "indexer": "tab:red", "nsa": "tab:purple",
           "pooled": "tab:brown", "full": "black"}


MAPPING = ("k as options: window = k; MoBA 4 blocks of k/4 (its own and 3 chosen); indexer top_k = k (2 index heads "
           "of 8, KL-trained, one choice for both heads); NSA k/2 selected + a window of k/2 + compressed blocks of 16.")


def load(run_dir: str) -> tuple[dict, list[dict], int]:
  """(sweep.json, the trials with a finished metrics.jsonl: id, case, seed, config, eval rows, final), unfinished count."""
  with open(os.path.join(run_dir, "sweep.json"), encoding="utf-8") as f:
    head = json.load(f)
  out, missing = [], 0
  for t in head["trials"]:
    d = os.path.join(run_dir, "trials", t["id"])
    path = os.path.join(d, "metrics.jsonl")
    if not os.path.exists(path):
      missing += 1
      continue
    with open(path, encoding="utf-8") as f:
      rows = [r for r in map(json.loads, f) if "eval_accuracy" in r]
    with open(os.path.join(d, "config.json"), encoding="utf-8") as f:
      cfg = json.load(f)
    summary = {}
    if os.path.exists(os.path.join(d, "summary.json")):
      with open(os.path.join(d, "summary.json"), encoding="utf-8") as f:
        summary = json.load(f)
    out.append({"id": t["id"], "case": t["label"]["case"], "seed": t["label"]["train.seed"], "config": cfg,
                "rows": rows, "final": rows[-1], "summary": summary})
  return head, out, missing


def family(case: str) -> tuple[str, int | None]:
  """("window", 8) from "window 8"; ("full", None)."""
  m = re.fullmatch(r"(\w+) (\d+)", case)
  return (m.group(1), int(m.group(2))) if m else (case, None)


def key_bytes(cfg: dict, keys_a_query: float) -> float:
  """Bytes of keys a query reads, mean over the T causal queries, all layers (module docstring)."""
  m, T = cfg["model"], cfg["task"]["seq_len"]
  L, G = m["num_layers"], m.get("num_kv_heads") or m["num_heads"]
  dk = m.get("d_k") or m["d_model"] // m["num_heads"]
  dv = m.get("d_v") or dk
  extra = m.get("extra") or {}
  core = keys_a_query * L * G * (dk + dv) * 4
  mean_visible = (T + 1) / 2
  if "moba" in extra:
    blocks = sum(math.ceil((t + 1) / extra["moba"]["block"]) for t in range(T)) / T
    return core + blocks * L * G * dk * 4
  if "indexer" in extra or "pooled_indexer" in extra:
    o = extra.get("indexer") or extra["pooled_indexer"]
    return core + mean_visible * L * G * o.get("head_dim", 32) * 4
  return core


def summarize(trials: list[dict]) -> dict[str, dict]:
  """case -> its family, k, seeds' accuracies, keys a query, FLOPs, key bytes, selector params, late change."""
  cases: dict[str, dict] = {}
  for t in trials:
    c = cases.setdefault(t["case"], {"case": t["case"], "acc": [], "late": [], "trials": [], "secs": []})
    sm = t["summary"]
    if sm.get("train_s") is not None:  # a resumed trial's train_s counts only its last process's steps
      c["secs"].append(f"{sm['train_s'] + sm.get('compile_s', 0):.0f}" + ("*" if sm.get("resumed_from") else ""))
    c["family"], c["k"] = family(t["case"])
    c["acc"].append(t["final"]["eval_accuracy"])
    c["trials"].append(t)
    rows = t["rows"]
    steps = rows[-1]["step"] + 1
    before = [r for r in rows if r["step"] + 1 <= 0.9 * steps]
    if before:
      c["late"].append(rows[-1]["eval_accuracy"] - before[-1]["eval_accuracy"])
    f = selection.attention_flops({"config": t["config"]})
    c["keys"], c["core"], c["sel"], c["sel_params"] = f["keys"], f["core"], f["selector"], f["selector_params"]
    c["flops"] = f["core"] + f["selector"]
    c["bytes"] = key_bytes(t["config"], f["keys"])
  for c in cases.values():
    a = np.array(c["acc"])
    c["mean"] = float(a.mean())
    c["se"] = float(a.std(ddof=1) / np.sqrt(len(a))) if len(a) > 1 else None
  return cases


def answer(cases: dict[str, dict], ks: list[int]) -> list[str]:
  """A line a selection: the smallest budget within 2 SE of full attention's accuracy."""
  full = cases.get("full")
  if full is None:
    return ["full attention has not finished: no answer."]
  lines = []
  for fam in FAMILIES:
    mine = sorted((c for c in cases.values() if c["family"] == fam), key=lambda c: c["k"])
    if not mine:
      lines.append(f"- {fam}: " + ("its slot is empty (the pooled indexer is being built elsewhere; README)."
                                   if fam == "pooled" else "not run."))
      continue
    hit = None
    for c in mine:
      se = math.hypot(full["se"] or 0.0, c["se"] or 0.0) if (full["se"] is not None and c["se"] is not None) else None
      if se is not None and abs(c["mean"] - full["mean"]) <= 2 * se:
        hit = (c, f"within 2 SE ({c['mean']:.3f} ± {c['se']:.3f} against {full['mean']:.3f} ± {full['se']:.3f})")
        break
      if se is None and c["mean"] >= full["mean"] - 0.01:
        hit = (c, f"{c['mean']:.3f} against full attention's {full['mean']:.3f} (1 seed: no SE; within 0.01 taken)")
        break
    ran = ", ".join(f"k={c['k']}: {c['mean']:.3f} ({len(c['acc'])} seed{'s' * (len(c['acc']) > 1)})" for c in mine)
    missing = [k for k in ks if k not in {c["k"] for c in mine}]
    if hit:
      c = hit[0]
      lines.append(f"- **{fam}: k = {c['k']}**, {hit[1]}; its selector {c['sel_params']:,} parameters and "
                   f"{c['sel']:,.0f} FLOPs a token. Ran: {ran}.")
    else:
      lines.append(f"- {fam}: no budget run reaches full attention ({ran})"
                   + (f"; not run: k = {', '.join(map(str, missing))}." if missing else "."))
  return lines


def table(cases: dict[str, dict], ks: list[int], missing: int) -> str:
  lines = ["| case | keys a query | attention FLOPs/token (cores + selector) | of it the selector's | selector params "
           "| key bytes a query | held-out accuracy | seeds | last 10% of steps | wall s a trial |",
           "|---|---:|---:|---:|---:|---:|---|---:|---|---|"]
  order = sorted(cases.values(), key=lambda c: (c["family"] != "full", FAMILIES.index(c["family"])
                                                if c["family"] in FAMILIES else -1, c["k"] or 0))
  for c in order:
    acc = f"{c['mean']:.4f} ± {c['se']:.4f}" if c["se"] is not None else f"{c['mean']:.4f} (1 seed)"
    late = ", ".join(f"{x:+.4f}" for x in c["late"])
    lines.append(f"| {c['case']} | {c['keys']:.1f} | {c['flops']:,.0f} | {c['sel']:,.0f} | {c['sel_params']:,} | "
                 f"{c['bytes']:,.0f} | {acc} | {len(c['acc'])} | {late} | {', '.join(c['secs'])} |")
  lines += ["", "Wall s a trial: train + compile seconds from its summary.json (* resumed from a checkpoint: "
            "the steps before it are not counted). Last 10% of steps: held-out accuracy at the end minus at 90% of "
            "the steps.", "", f"Trials not finished (not run, or stopped mid-way): {missing}.", "",
            "Smallest budget within 2 SE of full attention (SE of a difference: the two groups' SEs in quadrature):", ""]
  return "\n".join(lines + answer(cases, ks)) + "\n"


def describe(head: dict, trials: list[dict], seeds_as: str = "each seed a dot; the line through the means") -> str:
  cfg = trials[0]["config"]
  task, m, tr = cfg["task"], cfg["model"], cfg["train"]
  seeds = sorted({t["seed"] for t in trials})
  return (f"MQAR, T = {task['seq_len']}, {task['num_pairs']} pairs, vocabulary {task['vocab_size']}; curriculum "
          f"{'/'.join(map(str, task.get('curriculum') or []))} over {tr['steps']} steps (batch {tr['batch_size']}); "
          f"held out at T = {task['seq_len']}.\nFixed: {m['num_layers']} layers, d_model {m['d_model']}, "
          f"{m['num_heads']} heads, RoPE on {m.get('rope_dim')} dims, short_conv {m.get('short_conv')}, lr {tr['lr']}. "
          f"Seeds drawn: {', '.join(map(str, seeds))} ({seeds_as}).")


def plot(cases: dict[str, dict], trials: list[dict], head: dict, ks: list[int], path: str) -> None:
  fig, axes = plt.subplots(1, 3, figsize=(16, 5.6))
  full = cases.get("full")
  T = trials[0]["config"]["task"]["seq_len"]
  for ax, x, label in ((axes[0], "k", "key budget k (keys a query; full attention at T)"),
                       (axes[1], "flops", "attention FLOPs per token (forward, cores + selectors, 2 layers)"),
                       (axes[2], "bytes", "key bytes a query reads (float32, 2 layers, mean over queries)")):
    for fam in FAMILIES:
      mine = sorted((c for c in cases.values() if c["family"] == fam), key=lambda c: c["k"])
      if not mine:
        continue
      xs = [c["k"] if x == "k" else c[x] for c in mine]
      ax.plot(xs, [c["mean"] for c in mine], "-", color=COLOURS[fam], label=fam if ax is axes[0] else None)
      for xv, c in zip(xs, mine):
        ax.plot([xv] * len(c["acc"]), c["acc"], "o", color=COLOURS[fam], alpha=0.6, markersize=4)
        if x != "k":
          ax.annotate(str(c["k"]), (xv, c["mean"]), fontsize=6, color=COLOURS[fam], xytext=(2, 2),
                      textcoords="offset points")
    if full is not None:
      fx = T if x == "k" else full[x]
      ax.plot([fx] * len(full["acc"]), full["acc"], "s", color="black", markersize=5,
              label="full attention" if ax is axes[0] else None)
      lo, hi = ((full["mean"] - 2 * full["se"], full["mean"] + 2 * full["se"]) if full["se"] is not None
                else (full["mean"], full["mean"]))
      ax.axhspan(lo, hi, color="grey", alpha=0.25) if hi > lo else ax.axhline(full["mean"], color="grey", lw=1)
    ax.axhline(_chance(trials), color="grey", linestyle=":", linewidth=1, label="chance" if ax is axes[0] else None)
    ax.set_xscale("log")
    if x == "k":
      ticks = ks + [T]
      ax.set_xticks(ticks)
      ax.set_xticklabels([str(k) for k in ks] + [f"{T}\n(full)"])
      ax.minorticks_off()
    ax.set_xlabel(label, fontsize=9)
    ax.set_ylabel(f"held-out accuracy at T = {T}")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
  fig.legend(loc="lower center", ncol=7, fontsize=9, frameon=False)
  fig.suptitle("How few keys keep recall: " + describe(head, trials) + "\nGrey band: full attention's mean ± 2 SE "
               "(a line with one seed); numbers beside points: k.\n" + MAPPING, fontsize=9)
  fig.subplots_adjust(left=0.05, right=0.99, bottom=0.2, top=0.82, wspace=0.22)
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _chance(trials: list[dict]) -> float:
  """A value guessed among the task's values (attn.experiments.data.tasks.MQAR's chance)."""
  from attn.experiments.reading import plots
  c = plots.chance([{"config": t["config"]} for t in trials[:1]])
  return c[0] if c else 0.0


def _stage_starts(cfg: dict) -> list[float]:
  """The steps where the curriculum's later stages begin (its shares of train.steps)."""
  shares = cfg["task"].get("curriculum_steps") or []
  steps, out, acc = cfg["train"]["steps"], [], 0.0
  for share in shares[:-1]:
    acc += share
    out.append(round(acc * steps))
  return out


def curves(cases: dict[str, dict], trials: list[dict], head: dict, ks: list[int], path: str) -> None:
  fams = [f for f in FAMILIES if any(c["family"] == f for c in cases.values())]
  fig, axes = plt.subplots(1, max(len(fams), 1), figsize=(4 * max(len(fams), 1), 4.4), sharey=True, squeeze=False)
  cmap = plt.get_cmap("viridis")
  full = cases.get("full")
  for ax, fam in zip(axes[0], fams):
    if full is not None:
      for i, t in enumerate(full["trials"]):
        ax.plot([r["step"] + 1 for r in t["rows"]], [r["eval_accuracy"] for r in t["rows"]], color="black",
                lw=1.2, label="full" if i == 0 else None)
    for c in sorted((c for c in cases.values() if c["family"] == fam), key=lambda c: c["k"]):
      colour = cmap(ks.index(c["k"]) / max(len(ks) - 1, 1)) if c["k"] in ks else "grey"
      for i, t in enumerate(c["trials"]):
        ax.plot([r["step"] + 1 for r in t["rows"]], [r["eval_accuracy"] for r in t["rows"]], color=colour,
                lw=1, alpha=0.85, label=f"k = {c['k']}" if i == 0 else None)
    for b in _stage_starts(trials[0]["config"]):
      ax.axvline(b, color="grey", linestyle=":", linewidth=1)
    ax.set_title(fam, fontsize=10)
    ax.set_xlabel("training step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
  axes[0][0].set_ylabel("held-out accuracy")
  fig.suptitle("Learning curves: " + describe(head, trials, "one line a seed") + "\nDotted: where the "
               "training length grows (the curriculum's stages); held-out batches are always at the full T.", fontsize=8)
  fig.subplots_adjust(left=0.07, right=0.99, bottom=0.12, top=0.8, wspace=0.1)
  fig.savefig(path, dpi=110)
  plt.close(fig)


def costs(run_dir: str) -> str:
  """The cost table of every case from its config.json alone (trained or not): keys a query, FLOPs, key bytes."""
  with open(os.path.join(run_dir, "sweep.json"), encoding="utf-8") as f:
    head = json.load(f)
  lines = ["| case | keys a query | core FLOPs/token | selector FLOPs/token | selector params | key bytes a query |",
           "|---|---:|---:|---:|---:|---:|"]
  seen = set()
  for t in head["trials"]:
    case = t["label"]["case"]
    if case in seen:
      continue
    seen.add(case)
    with open(os.path.join(run_dir, "trials", t["id"], "config.json"), encoding="utf-8") as f:
      cfg = json.load(f)
    c = selection.attention_flops({"config": cfg})
    lines.append(f"| {case} | {c['keys']:.1f} | {c['core']:,.0f} | {c['selector']:,.0f} | {c['selector_params']:,} | "
                 f"{key_bytes(cfg, c['keys']):,.0f} |")
  return "\n".join(lines) + "\n"


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("run_dir")
  p.add_argument("--out", default="experiments/how_few_keys")
  p.add_argument("--ks", default="8,16,32,64,128,256")
  p.add_argument("--costs", action="store_true", help="print every case's cost table (from the configs) and stop")
  a = p.parse_args()
  if a.costs:
    print(costs(a.run_dir), end="")
    return 0
  ks = [int(k) for k in a.ks.split(",")]
  head, trials, missing = load(a.run_dir)
  if not trials:
    print("no finished trials")
    return 1
  os.makedirs(a.out, exist_ok=True)
  cases = summarize(trials)
  with open(os.path.join(a.out, "how_few_keys_table.md"), "w", encoding="utf-8") as f:
    f.write(table(cases, ks, missing))
  plot(cases, trials, head, ks, os.path.join(a.out, "how_few_keys.png"))
  curves(cases, trials, head, ks, os.path.join(a.out, "how_few_keys_curves.png"))
  print(f"{len(trials)} finished trials, {missing} not: {a.out}/how_few_keys.png, how_few_keys_curves.png, "
        "how_few_keys_table.md")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
