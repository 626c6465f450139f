"""`attn bench`'s Markdown: the header naming the machine, one table per shape, the long and linear
families' summaries, sweep throughput. The rows are attn.bench.layer's (and long's, linear's, throughput's)."""

from __future__ import annotations

from typing import Any

from attn.bench import linear
from attn.bench.shapes import LONG_WINDOW, SELECTION_GOAL

PEERS = ("flax", "jax_dpa", "torch", "torch_sdpa", "torch_sdpa_flash",
         "torch_sdpa_cudnn")  # rows that other rows are divided by
PEER_LABELS = {"flax": "flax.nnx.MultiHeadAttention",
               "jax_dpa": "jax.nn.dot_product_attention",
               "torch": "torch.nn.MultiheadAttention",
               "torch_sdpa": "torch F.scaled_dot_product_attention",
               "torch_sdpa_flash": "torch SDPA, flash backend",
               "torch_sdpa_cudnn": "torch SDPA, cuDNN backend",
               "einsum": "fused, einsum kernel",
               "core": "blocked core alone, causal",
               "core_full": "blocked core alone, no mask",
               "core_window": "blocked core alone, causal window 256",
               "core_moba": "core with MoBA 512×4 (2048 keys), causal",
               "core_indexer": "core with the indexer, top 2048, causal",
               "core_nsa": "core with NSA (32/16, 16×64, window 512), causal",
               "selector_moba": "MoBA's choice of blocks alone (no gradient: f+b = fwd)",
               "selector_indexer": "the indexer's scores and top-k alone (no gradient: f+b = fwd)",
               "fused_onednn": 'fused, impl="onednn"',
               "core_onednn": 'blocked core alone, causal, impl="onednn"',
               "core_full_onednn": 'blocked core alone, no mask, impl="onednn"',
               "core_window_onednn": 'blocked core alone, causal window 256, impl="onednn"'}
RATIO_LABELS = {"flax": "× flax", "jax_dpa": "× jax dpa", "torch": "× torch",
                "torch_sdpa": "× torch SDPA", "torch_sdpa_flash": "× SDPA flash",
                "torch_sdpa_cudnn": "× SDPA cuDNN"}
NOISY_SPREAD = 0.25  # (max - min) / median of the matmul's times above which a table is flagged


def header(info: dict[str, Any]) -> str:
  """The machine (attn.bench.machine.machine_info) and how to read the tables."""
  return (f"# attn bench\n\n{info.get('cpu_kind', info['cpu'])}, {info['cores']} cores ({info['threads']} usable: XLA "
          f"and torch threads), {info['device']}; "
          + ", ".join(f"{k} {v}" for k, v in info["versions"].items() if v)
          + f"; load average at start {info['load_average']}; impl=\"onednn\": {info['onednn']}; "
          f"jax backend {info['backend']}, \"auto\" tries {', '.join(info['auto_order'])}\n\n"
          "Times are medians (ms). % mm: analytic GFLOP/s over this run's matmul rate. "
          "× peer: this layer's time over the peer's (below 1 is faster). "
          "fwd+bwd FLOPs = 3 × forward.\n")


def _mb(n):
  """Bytes as whole MiB, or – where XLA gave none."""
  return "–" if n is None else f"{n / 2**20:.0f}"


def _ratio(r, peer):
  """fwd / f+b time over the peer's, or – without that peer."""
  x = r["ratios"].get(peer)
  return "–" if x is None else f"{x['fwd']:.2f} / {x['fb']:.2f}"


def markdown(name: str, result: dict[str, Any]) -> str:
  """One shape's table: times, GFLOP/s, % of the matmul rate, ratios to the peers, memory."""
  s = result["shape"]
  mm = result["matmul"]
  mm_text = ", ".join(f"{k} {v['gflops']:.0f} GFLOP/s (spread {100 * v['spread']:.0f}%)"
                      for k, v in mm.items())
  names = {r["name"] for r in result["rows"]}
  peers = [p for p in PEERS if p in names]
  ratio_heads = "".join(f" {RATIO_LABELS[p]}{' (fwd / f+b)' if i == 0 else ''} |"
                        for i, p in enumerate(peers))
  lines = [
      f"### {name}: B={s['B']} T=S={s['T']} D={s['D']} H={s['H']} K=V={s['K']}"
      f"{' causal' if s['causal'] else ''}, {result['dtype']}, median of {result['repeats']}",
      "", f"Matmul rate in this run: {mm_text}.", "",
      "| layer | fwd ms | fwd % mm | fwd+bwd ms | fwd+bwd GFLOP/s | fwd+bwd % mm |"
      f"{ratio_heads} peak MB |",
      "|---|---:|---:|---:|---:|---:|" + "---:|" * (len(peers) + 1)]
  for r in result["rows"]:
    label = PEER_LABELS.get(r["name"], r["name"]) + (f" ({r['ran']})" if r.get("ran") else "")
    ratios = "".join(f" {_ratio(r, p)} |" for p in peers)
    lines.append(
        f"| {label} | {r['fwd']['ms']:.1f} | {r['fwd']['pct_matmul']:.0f}% | {r['fb']['ms']:.1f} "
        f"| {r['fb']['gflops']:.0f} | {r['fb']['pct_matmul']:.0f}% |{ratios} "
        f"{_mb(r['peak_bytes'])} |")
  for v, why in result["skipped"].items():
    lines.append(f"\n{v}: skipped, {why}")
  spread = max(v["spread"] for v in mm.values())
  if spread > NOISY_SPREAD:
    lines.append(f"\nWARNING: the machine was busy: the matmul's time varied by {100 * spread:.0f}% "
                 "of its median over the rounds, so ratios are rough; re-run on a quiet machine "
                 "(the JSON also holds min and process-CPU times).")
  return "\n".join(lines)


def long_summary(report: dict[str, Any]) -> str:
  """The long family's ratios: causal ÷ non-causal, window ÷ full causal, each selection ÷ full causal (the goal)."""
  parts = []
  if report["causal_ratio"]:
    parts.append("Long sequences, fused layer, forward+backward time causal ÷ non-causal: "
                 + ", ".join(f"T={T} {x:.2f}" for T, x in report["causal_ratio"].items()) + "\n")
  if report["window_ratio"]:
    parts.append(f"Long sequences, blocked core alone, forward+backward time with a causal window of "
                 f"{LONG_WINDOW} ÷ full causal: "
                 + ", ".join(f"T={T} {x:.3f}" for T, x in report["window_ratio"].items()) + "\n")
  for T, sel in report["selection_ratio"].items():
    parts.append(f"Long sequences, T={T}: each key selection's core ÷ the full causal blocked core "
                 f"(forward / forward+backward time, forward+backward process CPU time, peak memory; goal at "
                 f"T=16384: forward+backward ≤ {SELECTION_GOAL}×): "
                 + "; ".join(f"{n} {x['fwd']:.2f} / {x['fb']:.2f}, CPU {x['cpu_fb']:.2f}, peak {x['peak']:.2f}"
                             + ("" if "selector_fb" not in x else
                                f", of which the selector {x['selector_fb']:.2f}, the attention {x['fb_less_selector']:.2f}")
                             + ("" if T != 16384 else (" (goal met)" if x.get("fb_less_selector", x["fb"]) <= SELECTION_GOAL
                                                       else " (goal not met)"))
                             for n, x in sel.items()) + "\n")
  return "\n".join(parts)


def linear_markdown(results: dict[str, Any]) -> str:
  """The linear family in one table: forward+backward ms and peak MB per T, and where each head wins."""
  by_T = {r["shape"]["T"]: {row["name"]: row for row in r["rows"]}
          for r in results.values() if r["shape"].get("linear")}
  if not by_T:
    return ""
  Ts = sorted(by_T)
  names = list(dict.fromkeys(n for T in Ts for n in by_T[T]))
  cross = linear.linear_crossover(results)
  cell = lambda row: "–" if row is None else f"{row['fb']['ms']:.0f} / {row['fb']['cpu_ms']:.0f} / {_mb(row['peak_bytes'])}"
  since = lambda T: "never" if T is None else f"T ≥ {T}"
  lines = ["Linear heads against the blocked softmax kernel (causal), forward+backward: wall ms / "
           "process CPU ms / peak MB (XLA's buffers), and the T from which each head is faster "
           "(wall; CPU) and smaller at every longer T measured.", "",
           "| layer | " + " | ".join(f"T={T}" for T in Ts) + " | faster from (wall; CPU) | smaller from |",
           "|---|" + "---:|" * (len(Ts) + 2)]
  for n in names:
    label = "blocked softmax (fused, causal)" if n == "fused" else n
    wins = cross.get(n)
    tail = (" | – | – |" if wins is None
            else f" | {since(wins['time'])}; {since(wins['cpu'])} | {since(wins['memory'])} |")
    lines.append(f"| {label} | " + " | ".join(cell(by_T[T].get(n)) for T in Ts) + tail)
  return "\n".join(lines)


def sweep_markdown(r: dict[str, Any]) -> str:
  """Sweep throughput (attn.bench.throughput): sequential against vmap, medians of the alternated rounds."""
  rows = "\n".join(f"| {m} | {r[m]['wall_s']:.1f} | {r[m].get('cpu_s', float('nan')):.1f} | {r[m]['compile_s']:.1f} "
                   f"| {r[m]['trials_per_minute']:.1f} | {r[m]['steady_trials_per_minute']:.1f} |"
                   for m in ("sequential", "vmap"))
  walls = "; ".join(f"{m}: " + ", ".join(f"{w:.1f}" for w in r[m].get("walls_s", [])) for m in ("sequential", "vmap"))
  return (f"### sweep throughput: {r['config']} [{', '.join(f'{k}={v}' for k, v in r['trial'].items())}], "
          f"{r['seeds']} seeds x {r['steps']} steps, median of {len(r.get('rounds', [])) or 1} "
          f"alternated rounds (wall s per round, in order: {walls})\n\n"
          f"| mode | wall s | CPU s (user+sys) | compile s | trials / minute | without compile |\n"
          f"|---|---:|---:|---:|---:|---:|\n{rows}\n\n"
          f"Seeds under vmap: {r['vmap_speedup']:.2f}x the sequential throughput (wall).")
