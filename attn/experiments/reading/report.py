"""`attn report DIR`: report.md and PNG plots from a sweep's store (reads the store only).

Trials are grouped by their axis values without the seed; each group shows the
mean ± std over seeds of the final held-out accuracy and loss (on the
byte-level `text` task, held-out bits per byte leads instead, and groups are
ranked and compared by it, lower is better); the plots are
attn/experiments/reading/plots.py's. A table lists every trial with its parameter counts,
FLOPs, step time and final metrics; failed trials are listed with their reason, and
interrupted ones (stopped by the machine: a full disk, a kill) with theirs.

A damaged store file is named by path: a damaged sweep.json or config.json is
refused (attn.experiments.running.store); a trial whose summary.json does not
parse is listed as damaged (`attn sweep` re-runs it), and metrics rows left out
(a torn last line) are named; both as warnings on stderr and in the report.
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any, TextIO

import numpy as np

from attn.experiments.reading import analysis_report
from attn.experiments.reading import memory
from attn.experiments.reading import plots as plots_lib
from attn.experiments.reading import selection
from attn.experiments.reading import settings
from attn.experiments.running import store as store_lib
from attn.experiments.reading.plots import METRICS, SEED_KEYS, TEXT_METRICS, show


_short = plots_lib.short


def _group_name(label: dict[str, Any]) -> str:
  return ", ".join(f"{_short(k)}={show(v)}" for k, v in label.items() if k not in SEED_KEYS) or "all"


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


LN2 = math.log(2)
LOWER_IS_BETTER = ("eval_bpb", "eval_loss")
TITLES = {"eval_accuracy": "held-out accuracy", "eval_bpb": "held-out bits per byte"}


def add_bits_per_byte(trials: list[dict[str, Any]]) -> bool:
  """Adds eval_bpb = eval_loss / ln 2 to the rows and final metrics of `text` trials; True if all are.

  The text task's tokens are bytes and every position is weighted, so its
  eval_loss is the mean held-out cross-entropy in nats per predicted byte.
  """
  text = [t for t in trials if (t.get("config") or {}).get("task", {}).get("name") == "text"]
  for t in text:
    for r in t["rows"]:
      if "eval_loss" in r:
        r["eval_bpb"] = r["eval_loss"] / LN2
    final = (t["summary"] or {}).get("final")
    if final and "eval_loss" in final:
      final["eval_bpb"] = final["eval_loss"] / LN2
  return bool(trials) and len(text) == len(trials)


LATE = 0.1
"""The share of a trial's steps over which `late_change` measures whether its curve has flattened."""


def late_change(rows: list[dict[str, Any]], key: str, frac: float = LATE) -> tuple[float, int] | None:
  """(change of `key`, steps it spans) from the last evaluation at or before (1 - frac) of the run to the last.

  A curve that has flattened changes by little here: on the text task, a
  drop in held-out bits per byte well under the seed spread. None with fewer
  than two evaluations.
  """
  evals = [r for r in rows if key in r]
  if len(evals) < 2:
    return None
  last = evals[-1]
  cut = last["step"] - frac * (last["step"] + 1)
  before = [r for r in evals[:-1] if r["step"] <= cut] or evals[:1]
  return last[key] - before[-1][key], last["step"] - before[-1]["step"]


def summarize(trials: list[dict[str, Any]], primary: str = "eval_accuracy") -> list[dict[str, Any]]:
  """One row per group of trials equal but for the seed: mean and std of final metrics, best first by `primary`."""
  keys = list(dict.fromkeys([primary] + [k for k, _ in METRICS]))
  groups: dict[str, list[dict[str, Any]]] = {}
  for t in trials:
    if t["summary"] and t["summary"]["status"] == "ok":
      groups.setdefault(_group_name(t["label"]), []).append(t)
  rows = []
  for name, ts in groups.items():
    row = {"group": name, "label": {k: v for k, v in ts[0]["label"].items() if k not in SEED_KEYS},
           "n": len(ts), "model_params": ts[0]["summary"].get("model_params"),
           "accuracies": [float(t["summary"]["final"]["eval_accuracy"]) for t in ts],
           "seed_values": {key: [float(t["summary"]["final"][key]) for t in ts] for key in keys},
           "solved_at": [solved_at(t["rows"]) for t in ts],
           "late": [late_change(t["rows"], primary) for t in ts]}
    for key in keys:
      row[key] = _mean_std([t["summary"]["final"][key] for t in ts])
    rows.append(row)
  return sorted(rows, key=lambda r: _score(r, primary))


def _score(r: dict[str, Any], primary: str) -> float:
  """Sort key: the best group first (lowest bits per byte or loss, highest accuracy)."""
  return r[primary][0] if primary in LOWER_IS_BETTER else -r[primary][0]


SOLVED = 0.99
"""Held-out accuracy at which a trial counts as having solved its task, for the 'solved at' column."""


def solved_at(rows: list[dict[str, Any]]) -> int | None:
  """The first evaluated step (1-based) whose held-out accuracy reaches SOLVED, or None."""
  return next((r["step"] + 1 for r in rows if r.get("eval_accuracy", 0.0) >= SOLVED), None)


def compare(a: list[float], b: list[float]) -> tuple[float, float, float]:
  """(gap of means, Welch t of the gap, share of trial pairs where a beats b; ties count half)."""
  x, y = np.asarray(a, float), np.asarray(b, float)
  gap = float(x.mean() - y.mean())
  se = math.sqrt((x.var(ddof=1) / len(x) if len(x) > 1 else 0.0) +
                 (y.var(ddof=1) / len(y) if len(y) > 1 else 0.0))
  t = gap / se if se > 0 else (math.inf if gap > 0 else 0.0)
  wins = float(np.mean((x[:, None] > y[None, :]) + 0.5 * (x[:, None] == y[None, :])))
  return gap, t, wins


def verdict(a: list[float], b: list[float]) -> str:
  """Whether group a beats group b by more than seed noise, from the trials' final values.

  Clear: every trial of a beats every trial of b, and a complete separation that
  large happens by chance with probability 1/C(n+m, n) <= 1/20 (a one-sided
  Mann-Whitney test: at least 3 seeds a side, or 2 against 5...). A standard error
  from 2 seeds is itself a guess, so 2 seeds a side are at most suggestive however
  many standard errors apart. Suggestive: at least 2 standard errors, or a complete
  separation too small a sample to be clear. Otherwise it is within seed noise; with
  one seed on either side there is no verdict.
  """
  if min(len(a), len(b)) < 2:
    return "one seed only, so no verdict"
  gap, t, wins = compare(a, b)
  p = 1 / math.comb(len(a) + len(b), len(a))
  if wins == 1.0 and p <= 0.05:
    return (f"a clear difference ({t:.1f} standard errors; every seed of one beats every seed of "
            f"the other, p = {p:.2g} by chance)")
  if wins == 1.0 and t >= 2:
    return (f"suggestive, not clear: every seed of one beats every seed of the other ({t:.1f} standard "
            f"errors), but with {len(a)} and {len(b)} seeds that happens by chance with p = {p:.2g}: "
            "more seeds would settle it")
  if t >= 2:
    return f"suggestive, not clear ({t:.1f} standard errors, {wins:.0%} of seed pairs ordered so): more seeds would settle it"
  return f"within seed noise ({t:.1f} standard errors)"


def seeds(n: int) -> str:
  """'1 seed', '3 seeds'."""
  return f"{n} seed{'s' * (n != 1)}"


def _is_number(v: Any) -> bool:
  return isinstance(v, (int, float)) and not isinstance(v, bool)


def _tied(rows: list[dict[str, Any]], a: str, b: str) -> bool:
  """Whether axes a and b move together (a zip): each value of one goes with one value of the other."""
  pairs = {(repr(r["label"][a]), repr(r["label"][b])) for r in rows}
  return len(pairs) == len({p[0] for p in pairs}) == len({p[1] for p in pairs})


LEVEL = 0.005
"""Means (accuracies, or bits per byte) closer than this count as level when a numeric axis's trend is described."""


def axis_answers(rows: list[dict[str, Any]], axes: list[str], limit: int = 8,
                 primary: str = "eval_accuracy") -> list[str]:
  """One line per swept axis and setting of the other axes: `primary` along the axis, best vs worst.

  An axis is compared only among groups that agree on every other axis, so a
  sweep over h and variant answers "does h matter for fused?" and "does the
  variant matter at h=4?" separately rather than comparing the best and worst
  of everything.
  """
  lines = []
  swept = [a for a in axes if a not in SEED_KEYS and all(a in r["label"] for r in rows)]
  for axis in swept:
    tied = [b for b in swept if b != axis and _tied(rows, axis, b)]
    if any(swept.index(b) < swept.index(axis) for b in tied):
      continue  # answered under the first of the tied axes
    slices: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
      rest = ", ".join(f"{_short(k)}={show(v)}" for k, v in r["label"].items() if k != axis and k not in tied)
      slices.setdefault(rest, []).append(r)
    name = _short(axis) + (f" (tied to {', '.join(_short(b) for b in tied)})" if tied else "")
    shown = 0
    for rest, rs in slices.items():
      if len(rs) < 2:
        continue
      if shown == limit:
        lines.append(f"- ({len(slices) - limit} more settings of the other axes for {name}: see the table)")
        break
      shown += 1
      if all(_is_number(r["label"][axis]) for r in rs):
        rs = sorted(rs, key=lambda r: r["label"][axis])
      means = [r[primary][0] for r in rs]
      along = ", ".join(f"{show(r['label'][axis])}: {r[primary][0]:.3f} ± {r[primary][1]:.3f}" for r in rs)
      trend = ""
      if _is_number(rs[0]["label"][axis]) and len(rs) > 2:
        steps = np.diff(means)
        level = np.abs(steps) < LEVEL  # e.g. two settings that both reach accuracy 1.000
        trend = (" Level throughout." if level.all() else
                 " Rises at every step." if (steps > 0).all() else
                 " Falls at every step." if (steps < 0).all() else
                 " Rises or stays level at every step." if ((steps > 0) | level).all() else
                 " Falls or stays level at every step." if ((steps < 0) | level).all() else
                 " Not monotone.")
      best = min(rs, key=lambda r: _score(r, primary))
      worst = max(rs, key=lambda r: _score(r, primary))
      where = f" ({rest})" if rest else ""
      if primary in LOWER_IS_BETTER:  # e.g. bits per byte: the lower wins
        signed = lambda r: [-v for v in r["seed_values"][primary]]
        gap = (f"Best {show(best['label'][axis])} vs worst {show(worst['label'][axis])}: gap "
               f"{worst[primary][0] - best[primary][0]:.3f}, {verdict(signed(best), signed(worst))}.")
      elif best["eval_accuracy"][0] == worst["eval_accuracy"][0]:  # saturated: tell apart by held-out loss
        lo = min(rs, key=lambda r: r["eval_loss"][0])
        hi = max(rs, key=lambda r: r["eval_loss"][0])
        losses = lambda r: [-v for v in r["seed_values"]["eval_loss"]]  # lower loss wins
        gap = (f"The same accuracy at every setting; by held-out loss, best {show(lo['label'][axis])} "
               f"({lo['eval_loss'][0]:.3g}) vs worst {show(hi['label'][axis])} ({hi['eval_loss'][0]:.3g}): "
               f"{verdict(losses(lo), losses(hi))}.")
      else:
        gap = (f"Best {show(best['label'][axis])} vs worst {show(worst['label'][axis])}: gap "
               f"{best['eval_accuracy'][0] - worst['eval_accuracy'][0]:.3f}, "
               f"{verdict(best['accuracies'], worst['accuracies'])}.")
      lower = " (lower is better)" if primary in LOWER_IS_BETTER else ""
      lines.append(f"- **{name}**{where}: {TITLES.get(primary, primary)}{lower} {along}.{trend} {gap}")
  return lines


def answer(rows: list[dict[str, Any]], axes: list[str] | None = None, primary: str = "eval_accuracy") -> str:
  """The measured answer: the best group, then each swept axis with the others held fixed."""
  if not rows:
    return "No trial finished, so there is no answer yet."
  best = rows[0]
  if primary == "eval_bpb":
    text = (f"Best: **{best['group']}**, held-out bits per byte {best['eval_bpb'][0]:.3f} ± "
            f"{best['eval_bpb'][1]:.3f} (next-byte accuracy {best['eval_accuracy'][0]:.3f}, {seeds(best['n'])}).")
  else:
    text = (f"Best: **{best['group']}**, held-out accuracy {best['eval_accuracy'][0]:.3f} ± "
            f"{best['eval_accuracy'][1]:.3f} (loss {best['eval_loss'][0]:.3f}, {seeds(best['n'])}).")
  per_axis = axis_answers(rows, list(axes or []), primary=primary)
  if per_axis:
    text += " Along each swept axis, the other axes held fixed (mean ± std over seeds):\n\n" + "\n".join(per_axis)
  elif len(rows) > 1:  # no axis varies alone (e.g. a zip whose values repeat): best against worst
    worst = rows[-1]
    signed = lambda r: [v if primary not in LOWER_IS_BETTER else -v for v in r["seed_values"][primary]]
    text += (f" Worst: **{worst['group']}**, {worst[primary][0]:.3f} ± {worst[primary][1]:.3f};"
             f" the gap is {verdict(signed(best), signed(worst))}.")
  return text


def kv_cache_bytes(trial: dict[str, Any]) -> int | None:
  """KV-cache bytes per generated token of a decoder trial's model (all layers, float32); None otherwise."""
  from attn import count  # lazy: imports jax
  from attn.config import ConfigError
  from attn.experiments.data import tasks
  from attn.nn.config import ModelConfig
  cfg = trial.get("config") or {}
  try:
    model = ModelConfig(**cfg["model"])
    return count.model_kv_cache_bytes_per_token(model, tasks.TASKS[cfg["task"]["name"]].kind, "float32")
  except (KeyError, TypeError, ConfigError):
    return None


def attention_params(trial: dict[str, Any]) -> int | None:
  """Attention parameters of a decoder trial's model, all layers (`attn count`'s "attention": a layer
  reading another's keys and values holds no key-side weights); None where there is no such model."""
  from attn import count  # lazy: imports jax
  from attn.config import ConfigError
  from attn.experiments.data import tasks
  from attn.nn.config import ModelConfig
  cfg = trial.get("config") or {}
  try:
    kind = tasks.TASKS[cfg["task"]["name"]].kind
    return count.model_param_breakdown(ModelConfig(**cfg["model"]), kind)["attention"] if kind == "decoder_lm" else None
  except (KeyError, TypeError, ConfigError):
    return None


def setting_name(model: dict[str, Any]) -> str:
  """A short name for a model's attention: MHA, GQA G=2, MQA, mla d_c=16, or the variant's name."""
  H, G = model["num_heads"], model.get("num_kv_heads") or model["num_heads"]
  if model["variant"] == "mla":
    return f"mla d_c={model.get('latent_dim') or 4 * model['d_k']}"
  if model["variant"] in ("fused", "per_head"):
    return "MHA" if G == H else "MQA" if G == 1 else f"GQA G={G}"
  return model["variant"].replace("_", " ") + (f" G={G}" if G != H else "")


def frontier_section(rows: list[dict[str, Any]], primary: str) -> list[str]:
  """Markdown: each group's memory and mean `primary`, and whether it sits on the frontier.

  Memory is the KV cache per generated token where no group keeps a fixed-size state; where one does (a
  hybrid's linear layers), a cache per token alone would undercount it, so the frontier is drawn against
  state + KV cache after one sequence of the trial's length instead, with both parts shown.
  """
  key = primary if primary in LOWER_IS_BETTER else "eval_loss"
  state = memory.holds_state(rows)
  held = (lambda r: sum(r["memory"])) if state else (lambda r: r["kv_bytes"])
  front = set(plots_lib.pareto_front([(held(r), r[key][0]) for r in rows]))
  order = sorted(range(len(rows)), key=lambda i: (held(rows[i]), rows[i][key][0]))
  params = differ(rows, "attn_params")  # a column, and a frontier of its own, where attention parameters differ
  by_params = set(plots_lib.pareto_front([(r["attn_params"], r[key][0]) for r in rows])) if params else set()
  what = ("state + KV cache after one sequence of the trial's length T over all layers (`attn count`, bytes as in "
          "Memory per group; the linear layers' fixed state counts, not the cache per token alone)" if state else
          "KV cache per generated token over all layers in float32 (`attn count`)")
  md = ["## Quality against " + ("state and KV cache" if state else "KV cache"), "",
        f"{what[0].upper()}{what[1:]}, against {TITLES.get(key, key)} "
        "(mean ± std over seeds). On the frontier: no other setting "
        + ("holds as few bytes" if state else "has a cache as small") + " and a lower mean."
        + (" Attention parameters: all layers' (`attn count`), with the frontier of the means against them."
           if params else ""), "",
        "| setting | group | KV cache B/token | " + ("state B/sequence | state + KV cache B at T | " if state else "")
        + ("attention params | " if params else "") + TITLES.get(key, key)
        + " | on the frontier |" + (" on the parameter frontier |" if params else ""),
        "|---|---|---|---|---|" + ("---|---|" if state else "") + ("---|---|" if params else "")]
  md += [f"| {rows[i].get('setting') or '–'} | {rows[i]['group']} | {rows[i]['kv_bytes']:,} | "
         + (f"{rows[i]['memory'][1]:,} | {sum(rows[i]['memory']):,} | " if state else "")
         + (f"{rows[i]['attn_params']:,} | " if params else "")
         + f"{rows[i][key][0]:.4f} ± {rows[i][key][1]:.4f} | {'yes' if i in front else 'no'} |"
         + (f" {'yes' if i in by_params else 'no'} |" if params else "") for i in order]
  return md + [""]


def frontier_applies(rows: list[dict[str, Any]]) -> bool:
  """Whether the groups differ in what they hold: in KV cache per token (every group caching some), or, where
  a group keeps a fixed-size state, in state + KV cache at T (every group counted)."""
  if memory.holds_state(rows):
    return len(rows) > 1 and all(r.get("memory") for r in rows) and len({sum(r["memory"]) for r in rows}) > 1
  return len({r["kv_bytes"] for r in rows}) > 1 and all(r["kv_bytes"] for r in rows)


def differ(rows: list[dict[str, Any]], key: str) -> bool:
  """Whether every row has a non-zero `key` and they are not all equal."""
  return all(r.get(key) for r in rows) and len({r[key] for r in rows}) > 1


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
    cells = [t["id"], ", ".join(f"{_short(k)}={show(v)}" for k, v in t["label"].items()) or "–",
             s.get("status", "damaged" if t.get("damaged") else "unfinished"), s.get("model_params"),
             s.get("attention_params_analytic"),
             s.get("attention_params_effective"), s.get("attention_flops_fwd"), step_ms,
             s.get("compile_s"), final.get("loss"), final.get("eval_loss"), final.get("eval_accuracy")]
    text = [_fmt(c, 3) if not isinstance(c, str) else c for c in cells]
    measured = s.get("attention_measured", ())  # no closed form: say so, never pass it as one
    for i, figure in ((4, "analytic"), (5, "effective"), (6, "flops")):
      if figure in measured and text[i] != "–":  # a figure left unmeasured is a dash, not "measured"
        text[i] += " (measured)"
    lines.append("| " + " | ".join(text) + " |")
  return lines


def write_report(root: str, stream: TextIO = sys.stderr) -> str:
  """Writes DIR/report.md and DIR/*.png from the store; returns the report's path. Warnings go to `stream`."""
  header = store_lib.load_sweep(root)
  trials = list(store_lib.iter_trials(root))
  warnings = [w for t in trials for w in ([t["damaged"]] if t["damaged"] else []) + t["warnings"]]
  for w in warnings:
    stream.write(f"warning: {w}\n")
  text = add_bits_per_byte(trials)
  primary = "eval_bpb" if text else "eval_accuracy"
  rows = summarize(trials, primary)
  first = {}
  for t in trials:
    if t["summary"] and t["summary"]["status"] == "ok":
      first.setdefault(_group_name(t["label"]), t)
  for r in rows:  # the KV cache and a short name of each group, from its first trial's config
    r["kv_bytes"] = kv_cache_bytes(first[r["group"]])
    r["attn_params"] = attention_params(first[r["group"]])
    # A case's own name where the config names its cases (two cases can share a setting's name).
    r["setting"] = (first[r["group"]]["label"].get("case") or setting_name(first[r["group"]]["config"]["model"])
                    if r["kv_bytes"] else None)
    r["memory"], r["chance"] = memory.sequence_bytes(first[r["group"]]), memory.chance(first[r["group"]])
    r["seq_len"] = ((first[r["group"]].get("config") or {}).get("task") or {}).get("seq_len")
    if r["memory"] is None:
      r["no_memory"] = memory.no_memory(first[r["group"]])
    r["attention_flops"] = selection.attention_flops(first[r["group"]])
  if memory.holds_state(rows):  # the frontier plot's x: what a group holds, its linear layers' state included
    for r in rows:
      r["held_bytes"] = sum(r["memory"]) if r["memory"] else None
  names = [r["setting"] for r in rows]
  if len(rows) > 1 and len(set(names)) < len(names):  # a name shared by groups: the groups say more
    for r in rows:
      r["setting"] = None
  cases = "case" in header["axes"]  # a case's name alone does not say what it trained
  trained = settings.differences({r["group"]: first[r["group"]]["config"] for r in rows
                                  if first[r["group"]].get("config")}) if cases else {}
  for r in rows:
    r["settings"] = trained.get(r["group"], "")
  note = plots_lib.caption(trials, header["axes"], settings.chosen(header)) + "".join(
      f"; {r['group']}: {r['settings']}" for r in rows if r["settings"])
  plots = plots_lib.make_plots(rows, trials, header["axes"], root, TEXT_METRICS if text else METRICS, note=note)
  if memory.applies(rows) and not text and (plt := plots_lib._pyplot()) is not None:
    memory.plot(plt, rows, os.path.join(root, "frontier_state_cache.png"), note)
    memory.curves(plt, trials, os.path.join(root, "curves_by_setting.png"), note)
    plots += ["frontier_state_cache.png", "curves_by_setting.png"]
  if selection.applies(rows) and not text and (plt := plots_lib._pyplot()) is not None:
    selection.plot(plt, rows, os.path.join(root, "accuracy_vs_attention_flops.png"), note)
    plots += ["accuracy_vs_attention_flops.png"]
  status = [t["summary"]["status"] if t["summary"] else "damaged" if t["damaged"] else
            "interrupted" if t.get("interrupted") else "unfinished" for t in trials]
  sets = " ".join(f"--set {o}" for o in header.get("overrides", []))
  md = [f"# {header['name']}", ""]
  if header.get("question"):
    md += [f"**Question.** {header['question']}", ""]
  md += [f"**Measured answer.** {answer(rows, header['axes'], primary)}", "",
         f"Sweep `{header['sweep_id']}` from `{header['config_path']}`; reproduce with "
         f"`attn sweep {header['config_path']} --out {root}{' ' + sets if sets else ''}`. "
         f"{len(trials)} trials: {status.count('ok')} ok, {status.count('failed')} failed, "
         f"{status.count('unfinished')} unfinished"
         + (f", {status.count('interrupted')} interrupted (see Interrupted trials)" if "interrupted" in status else "")
         + (f", {status.count('damaged')} damaged (see Damaged store files)" if "damaged" in status else "")
         + ". Metrics are the last step's; held-out "
         "metrics come from batches the trial never trained on."
         + (" Bits per byte are the held-out cross-entropy in nats per predicted byte / ln 2 "
            "(lower is better); accuracy is next-byte accuracy." if text else ""), "",
         "## Groups (mean ± std over seeds)", ""]
  if text:  # nothing saturates, so no 'step reaching' column; instead how flat the curves end
    spans = {c[1] for r in rows for c in r["late"] if c}
    over = f"last {spans.pop()} steps" if len(spans) == 1 else f"last {LATE:.0%} of steps"
    md += ["| group | " + ("settings | " if cases else "") + "seeds | model params | eval bits/byte | eval accuracy "
           f"| per seed (bits/byte) | change over the {over} (per seed) |", "|---|---|---|---|---|---|---|"
           + ("---|" if cases else "")]
    md += [f"| {r['group']} | " + (f"{r['settings'] or '–'} | " if cases else "") + f"{r['n']} | {_fmt(r['model_params'])} | "
           f"{r['eval_bpb'][0]:.4f} ± {r['eval_bpb'][1]:.4f} | "
           f"{r['eval_accuracy'][0]:.4f} ± {r['eval_accuracy'][1]:.4f} | "
           f"{', '.join(f'{v:.4f}' for v in r['seed_values']['eval_bpb'])} | "
           f"{', '.join('–' if c is None else f'{c[0]:+.4f}' for c in r['late'])} |" for r in rows]
  else:
    md += ["| group | " + ("settings | " if cases else "") + "seeds | model params | eval accuracy | eval loss "
           f"| step reaching {SOLVED} (per seed) |", "|---|---|---|---|---|---|" + ("---|" if cases else "")]
    md += [f"| {r['group']} | " + (f"{r['settings'] or '–'} | " if cases else "") + f"{r['n']} | {_fmt(r['model_params'])} | "
           f"{r['eval_accuracy'][0]:.4f} ± {r['eval_accuracy'][1]:.4f} | "
           f"{r['eval_loss'][0]:.3g} ± {r['eval_loss'][1]:.2g} | "
           f"{', '.join('–' if s is None else str(s) for s in r['solved_at'])} |" for r in rows]
    never = sum(s is None for r in rows for s in r["solved_at"])
    if never:  # a dash is a seed that never reached it, not a number left out
      md += ["", f"Step reaching {SOLVED}: the first evaluated step at which a seed's held-out accuracy reached "
             f"{SOLVED}; – for a seed that never did within its steps"
             + (" (no seed did)." if never == sum(len(r["solved_at"]) for r in rows) else ".")]
  if any(r.get("memory") for r in rows):  # what each group holds, on every task with a decoder
    md += [""] + memory.table(rows)[:-1]
  elif rows:
    md += ["", "## Memory per group", "", f"Left out: {rows[0].get('no_memory') or 'no group has a decoding cache'}."]
  if frontier_applies(rows):
    md += [""] + frontier_section(rows, primary)[:-1]
  if memory.applies(rows) and not text:
    md += [""] + memory.section(rows)[:-1]
  elif memory.applies(rows):  # said, not dropped: the quality table above already ranks state + cache
    md += ["", "The recall-against-state section (held-out accuracy against state + KV cache) is for recall "
           "tasks; on text the quality table above ranks bits per byte against state + KV cache at T."]
  if selection.applies(rows) and not text:
    md += [""] + selection.section(rows)[:-1]
  elif selection.applies(rows):  # said, not dropped
    md += ["", "The accuracy-against-attention-FLOPs section ranks held-out accuracy, a recall task's measure; on text "
           "the groups are ranked by bits per byte above (each trial's attention FLOPs are in the Trials table)."]
  md += ["", "## Plots", ""]
  md += [f"![{p}]({p})" for p in plots] or ["(matplotlib is not installed: `pip install matplotlib`)"]
  md += analysis_report.section(root, trials, header["axes"])  # when `attn analyze` has run
  md += ["", "## Trials", "",
         "Attention counts are summed over layers; effective parameters are the degrees of freedom "
         "of the function (see `attn count`). Step time is the median wall time of one step "
         "(a step of a vmapped group trains all its seeds at once).", ""]
  md += _trial_table(trials)
  if warnings:
    md += ["", "## Damaged store files", ""] + [f"- {w}" for w in warnings]
  failed = [t for t in trials if t["summary"] and t["summary"]["status"] == "failed"]
  if failed:
    md += ["", "## Failed trials", ""]
    md += [f"- `{t['id']}` [{_group_name(t['label'])}, seed={t['label'].get('train.seed', '–')}]: "
           f"{t['summary']['reason']}" for t in failed]
  interrupted = [t for t in trials if t.get("interrupted")]
  if interrupted:
    md += ["", "## Interrupted trials", "",
           f"Stopped by the machine, not by themselves; `attn sweep {header['config_path']} --out {root}` "
           "resumes each from its last checkpoint.", ""]
    md += [f"- `{t['id']}` [{_group_name(t['label'])}, seed={t['label'].get('train.seed', '–')}]: "
           f"{t['interrupted']}" for t in interrupted]
  path = os.path.join(root, "report.md")
  store_lib.atomic_write(path, "\n".join(md) + "\n")
  return path
