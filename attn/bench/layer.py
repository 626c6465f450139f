"""attn bench: time every variant against flax, jax and torch attention, as ratios (the command: attn/cli/bench.py).

For each shape and each variant: forward and forward+backward (gradients for
the parameters and the input) wall times, the median of --repeats runs after
warm-up, all candidates of a shape timed round-robin so that load on a shared
machine hits them alike. FLOPs are analytic: variant.flops(cfg, T, S) · B for
the forward pass (a multiply-add is 2; softmax and masking are not counted; a
causal mask still counts the full T×S, as the kernel computes it), and 3× that
for forward+backward (each matmul's backward is two matmuls of its size).
GFLOP/s are divided by the rate of a 2048³ matmul in the same dtype, measured
in the same run, to give "% mm". Peak memory is XLA's buffer assignment for the
compiled forward+backward call: arguments + outputs + temporaries - aliased
bytes (compiled.memory_analysis()), not the process's resident set.

This module times one shape (bench_shape) and runs the shapes a command asks for (run_layers). The
parts: shapes (Shape, SHAPES, the families), machine (the machine's facts), timing (round-robin),
long (the long family: cores behind the same projections, --variants does not apply), linear (the
fixed-state heads against the blocked softmax kernel; a fixed-state head in any other shape runs
causal and is skipped at a shape without a causal mask), impls (--impls), throughput (--sweep, its
config configs/bench_layer.toml), tables (the Markdown); decode, steps and account are the other
modes. Their names stay importable from here.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable

import attn
from attn.bench import impls as impls_lib, linear, long, machine, peers as peers_lib, tables, throughput, timing
from attn.bench.shapes import DTYPES, SHAPES, Shape
from attn.config import ConfigError
from attn.kernel import onednn
# The names this module held before its parts moved out, for the scripts and tests that import them here.
from attn.bench.impls import impl_cases as _impl_cases  # noqa: F401
from attn.bench.linear import linear_cases as _linear_cases, linear_crossover, variant_case as _variant_case  # noqa: F401
from attn.bench.long import (causal_ratios, core_flops_of, long_cases as _long_cases, selection_ratios,  # noqa: F401
                             window_ratios)
from attn.bench.machine import cpu_kind, machine_info  # noqa: F401
from attn.bench.shapes import (DEFAULT_SHAPES, GROUPS, LINEAR_LENGTHS, LONG_LENGTHS, LONG_WINDOW,  # noqa: F401
                               QUICK_SHAPES, SELECTION_GOAL, SELECTIONS, SELECTORS_ALONE, names as _names)
from attn.bench.tables import (NOISY_SPREAD, PEER_LABELS, PEERS, RATIO_LABELS, linear_markdown, markdown,  # noqa: F401
                               sweep_markdown)
from attn.bench.throughput import SWEEP_CONFIG, sweep_throughput  # noqa: F401
from attn.bench.timing import round_robin as _round_robin, timer as _timer  # noqa: F401


def bench_shape(name: str, shape: Shape, variants: list[str], dtype_name: str, repeats: int,
                peers: bool, matmul_n: int = 2048, log=print,
                impls: list[str] | None = None) -> dict[str, Any]:
  """Times the variants and peers at one shape; rows carry times, rates and ratios."""
  dtype = DTYPES[dtype_name]
  mask = attn.causal_mask(shape.T) if shape.causal else None
  cases, skipped, picks = {}, {}, {}
  if shape.long:
    cases, skipped = long.long_cases(shape, dtype, dtype_name, peers)
  if shape.linear:
    cases, skipped = linear.linear_cases(shape, dtype, variants)
  if impls:
    more, why, picks = impls_lib.impl_cases(shape, dtype, dtype_name, impls, peers)
    cases.update(more)
    skipped.update(why)
  for v in [] if shape.long or shape.linear else variants:
    variant = attn.get_variant(v)
    try:
      variant.check(shape.cfg)
    except ConfigError as e:
      skipped[v] = str(e)
      continue
    if variant.init_state is not None and not shape.causal:
      skipped[v] = "a fixed-state head is causal only: it runs at the causal shapes"
      continue
    cases[v] = linear.variant_case(variant, shape, dtype, mask)
  if "fused" in cases and not (shape.long or shape.linear):
    # The fused layer again with impl="onednn" (attn.kernel.onednn: the core's products on oneDNN's sgemm).
    why = onednn.why_not(dtype)
    if why is None:
      cases["fused_onednn"] = peers_lib.fused_case(shape.cfg, shape.B, shape.T, dtype,
                                                   impl="onednn", mask=mask)
    else:
      skipped["fused_onednn"] = f'impl="onednn" does not run here: {why}'
  if peers and not (shape.long or shape.linear):
    cfg = shape.cfg
    cases["jax_dpa"] = peers_lib.fused_case(cfg, shape.B, shape.T, dtype, impl="xla", mask=mask)
    cases["flax"] = peers_lib.flax_case(cfg, shape.B, shape.T, dtype, mask)
    torch_case = peers_lib.torch_mha_case(cfg, shape.B, shape.T, dtype_name, shape.causal)
    if torch_case is not None:
      cases["torch"] = torch_case
  groups = [{}, {}]  # jax, torch
  for k, f in peers_lib.matmul_cases(dtype, dtype_name, matmul_n).items():
    groups[k == "torch"][f"mm:{k}"] = f
  for k, c in cases.items():
    groups[k.startswith("torch")].update({f"{k}:fwd": c["fwd"], f"{k}:fb": c["fb"]})
  groups = [g for g in groups if g]
  log(f"[{name}] timing {sum(map(len, groups))} calls x {repeats} rounds ...")
  times = timing.round_robin(groups, repeats)

  mm_flops = 2 * matmul_n ** 3
  matmul = {k[3:]: {"gflops": mm_flops / t["median_s"] / 1e9,
                    "spread": (t["max_s"] - t["min_s"]) / t["median_s"]}
            for k, t in times.items() if k.startswith("mm:")}
  rate = matmul["jnp"]["gflops"]
  fwd_flops = attn.get_variant("fused").flops(shape.cfg, shape.T, shape.T) * shape.B
  rows = []
  core_flops = long.core_flops_of(shape)
  for k, c in cases.items():
    flops = (attn.get_variant(k).flops(shape.cfg, shape.T, shape.T) * shape.B
             if k in attn.VARIANTS else core_flops.get(k.removesuffix("_onednn"), fwd_flops))
    row = {"name": k, "kind": "peer" if k in PEERS else "variant", "fwd_flops": flops,
           "peak_bytes": c["peak_bytes"], **({"ran": picks[k]} if k in picks else {})}
    for part, mult in (("fwd", 1), ("fb", 3)):
      t = times[f"{k}:{part}"]
      gflops = mult * flops / t["median_s"] / 1e9
      row[part] = {"ms": 1e3 * t["median_s"], "min_ms": 1e3 * t["min_s"],
                   "cpu_ms": 1e3 * t["cpu_median_s"], "gflops": gflops,
                   "pct_matmul": 100 * gflops / rate}
    rows.append(row)
  by_name = {r["name"]: r for r in rows}
  for r in rows:
    r["ratios"] = {p: {part: r[part]["ms"] / by_name[p][part]["ms"] for part in ("fwd", "fb")}
                   for p in PEERS if p in by_name}
  return {"shape": dataclasses.asdict(shape), "dtype": dtype_name, "repeats": repeats,
          "matmul": matmul, "rows": rows, "skipped": skipped, "picks": picks}


def run_layers(shapes: list[str], variants: list[str], dtype: str, repeats: int, peers: bool = True,
               impls: list[str] | None = None, matmul_n: int = 2048, quick: bool = False,
               sweep: str | None = None, sweep_seeds: int = 4, sweep_steps: int | None = None, sweep_rounds: int = 1,
               info: dict[str, Any] | None = None, out: str | None = None, log: Callable[[str], None] = print,
               write: Callable[[str], None] = print) -> dict[str, Any]:
  """`attn bench`: each shape timed and its table written as it finishes, the families' summaries, sweep
  throughput where asked; the whole report (JSON-able) returned, and written to `out` where given."""
  if sweep == throughput.SWEEP_CONFIG:
    throughput.builtin_text()  # a missing or broken configs/bench_layer.toml is named before any timing
  info = info or machine.machine_info()
  write(tables.header(info))
  results = {}
  for name in shapes:
    results[name] = bench_shape(name, SHAPES[name], variants, dtype, repeats, peers, log=log, impls=impls,
                                matmul_n=matmul_n)
    write(tables.markdown(name, results[name]) + "\n")
  report = {"machine": info, "dtype": dtype, "repeats": repeats, "quick": quick,
            "shapes": results, "causal_ratio": long.causal_ratios(results),
            "window_ratio": long.window_ratios(results), "selection_ratio": long.selection_ratios(results),
            "linear_crossover": linear.linear_crossover(results)}
  if "long-16384-causal" in shapes:  # issue 51's goals: each selection in its layout (attn.bench.selection)
    from attn.bench import selection as bench_selection
    report["selection_goals"] = bench_selection.goals(16384, log=log)
    write(bench_selection.goals_markdown(report["selection_goals"]) + "\n")
  summary = tables.long_summary(report)
  if summary:
    write(summary)
  if report["linear_crossover"]:
    write(tables.linear_markdown(results) + "\n")
  if sweep:
    log("[sweep] training ...")
    report["sweep"] = throughput.sweep_throughput(sweep, sweep_seeds, sweep_steps, sweep_rounds)
    write("\n" + tables.sweep_markdown(report["sweep"]))
  if out:
    with open(out, "w") as f:
      json.dump(report, f, indent=1)
    log(f"wrote {out}")
  return report
