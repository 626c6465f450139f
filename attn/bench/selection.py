"""Issue 51's goals for the indexer, timed side by side: `python -m attn.bench.selection [--T 16384]`.

B 1, T causal, 16 query heads of 64, float32, forward+backward. Rows, alternated round by round
(each warmed once; medians):

  full_G1 / full_GH   full causal attention (the blocked kernel), one kv head / 16 kv heads
  attn_G1 / attn_GH   attention over the indexer's top_k tokens (attn.kernel.tokens, one choice
                      for every head), one shared kv head (the layout DSA ships) / 16 kv heads
  selector            the selector alone (attn.kernel.select.indexer_top: blockwise index scores,
                      exact top-k by bisection); it has no gradient, so its forward is its share
  scores              the selector's index scores alone (the same buckets, no top-k)
  gather              jnp.take of the chosen key rows alone (the attention's gather, one pass)
  old_attn_G1 / _GH   (--old) the blocked kernel over the key blocks holding a chosen token
                      (attn.kernel.sparse with the bits): the previous path, and the H = G one
  matmul              a 2048³ float32 matmul: the machine's rate in the same rounds

Printed: each row's median seconds, × full causal of its layout, the goal beside, FLOPs and the
rate they ran at; the chosen pairs, the gathered bytes and the gather's rate. A table, not a test.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import time

import jax
import jax.numpy as jnp
from jax import lax

from attn import kernel
from attn.bench import peers as peers_lib
from attn.kernel import select, sparse, tokens

GOALS = {"attn": 0.40, "selector": 0.25, "together": 0.60}


def _fb(apply, q, k, v):
  """Forward+backward of sum(apply(q, k, v) · ct): gradients for q, k and v, compiled."""
  ct = jax.random.normal(jax.random.PRNGKey(7), q.shape[:3] + (v.shape[3],), jnp.float32)
  f = jax.jit(jax.grad(lambda q, k, v, ct: jnp.sum(apply(q, k, v) * ct), argnums=(0, 1, 2)))
  f = f.lower(q, k, v, ct).compile()
  return peers_lib.block(f, q, k, v, ct)


def _scores_only(qi, ki, w, *, rows: int, buckets: int):
  """The selector's index scores in its buckets and row tiles, reduced to a row max (kept alive)."""
  T, S = qi.shape[1], ki.shape[1]
  rows = min(rows, T)
  n = -(-T // rows)
  per = -(-n // buckets)
  out = []
  for a in range(0, n, per):
    t0, t1 = a * rows, min(T, (a + per) * rows)
    e = max(1, min(S, t1 + S - T))
    fn = lambda q, ww, c0, e=e: select.index_scores(q, ki[:, :e], ww).max(-1)  # noqa: E731
    out.append(select._by_chunks(fn, qi[:, t0:t1], w[:, t0:t1], t1 - t0, rows))
  return jnp.concatenate(out, axis=1)


def _gather(k_SGK, v_SGV, idx_Tk, tile: int):
  """The attention's gather alone: each tile's chosen key and value rows, summed (kept alive)."""
  T, k = idx_Tk.shape
  n = T // tile
  f = lambda i: (jnp.take(k_SGK, i, axis=0).sum(1) + jnp.take(v_SGV, i, axis=0).sum(1))  # noqa: E731
  return lax.map(f, jnp.maximum(idx_Tk[: n * tile], 0).reshape(n, tile, k))


def _rounds(calls: dict, repeats: int) -> dict[str, float]:
  """Each call warmed once, then timed once a round, round after round: the median seconds."""
  for f in calls.values():
    f()
  got = {n: [] for n in calls}
  for _ in range(repeats):
    for n, f in calls.items():
      t = time.perf_counter()
      f()
      got[n].append(time.perf_counter() - t)
  return {n: statistics.median(v) for n, v in got.items()}


def cases(T: int, H: int, D: int, top_k: int, J: int, I: int, old: bool, layouts: tuple[str, ...]):
  keys = jax.random.split(jax.random.PRNGKey(0), 9)
  rnd = lambda i, s: jax.random.normal(keys[i], s, jnp.float32)  # noqa: E731
  q = rnd(0, (1, T, H, D))
  kv = {1: (rnd(1, (1, T, 1, D)), rnd(2, (1, T, 1, D)))}
  if "GH" in layouts:
    kv[H] = (rnd(3, (1, T, H, D)), rnd(4, (1, T, H, D)))
  qi, ki, w = rnd(5, (1, T, J, I)), rnd(6, (1, T, I)), rnd(7, (1, T, J))
  scale = D ** -0.5
  sel = jax.jit(lambda qi, ki, w: select.indexer_top(qi, ki, w, top_k=top_k, is_causal=True))
  idx = sel(qi, ki, w)
  out = {}
  bits = select.indices_to_bits(idx, T)
  blocks = select.token_blocks(bits, 128, T)
  for G, tag in ((1, "G1"), (H, "GH")):
    if tag not in layouts:
      continue
    k, v = kv[G]
    out[f"full_{tag}"] = _fb(lambda q, k, v: kernel.attention(q, k, v, is_causal=True, impl="blocked"),
                             q, k, v)
    out[f"attn_{tag}"] = _fb(lambda q, k, v: tokens.attention(q, k, v, idx[:, None], scale=scale,
                                                              is_causal=True, unique=True), q, k, v)
    if old:
      out[f"old_attn_{tag}"] = _fb(lambda q, k, v: sparse.attention(
          q, k, v, blocks, block_k=128, scale=scale, is_causal=True, bits_BTW=bits), q, k, v)
  out["selector"] = peers_lib.block(sel.lower(qi, ki, w).compile(), qi, ki, w)
  sc = jax.jit(lambda qi, ki, w: _scores_only(qi, ki, w, rows=select.INDEX_ROWS, buckets=select.BUCKETS))
  out["scores"] = peers_lib.block(sc.lower(qi, ki, w).compile(), qi, ki, w)
  tile = tokens.tile_rows(top_k, 1, D, D)
  g = jax.jit(lambda k, v, i: _gather(k, v, i, tile))
  out["gather"] = peers_lib.block(g.lower(kv[1][0][0], kv[1][1][0], idx[0]).compile(),
                                  kv[1][0][0], kv[1][1][0], idx[0])
  a = jax.random.normal(jax.random.PRNGKey(2), (2048, 2048), jnp.float32)
  out["matmul"] = peers_lib.block(jax.jit(jnp.matmul), a, a)
  pairs = int((idx >= 0).sum())
  return out, pairs, tile


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--T", type=int, default=16384)
  p.add_argument("--heads", type=int, default=16)
  p.add_argument("--head-dim", type=int, default=64)
  p.add_argument("--top-k", type=int, default=2048)
  p.add_argument("--index-heads", type=int, default=4)
  p.add_argument("--index-dim", type=int, default=32)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--old", action="store_true", help="also time the blocked path over the same choice")
  p.add_argument("--before", action="store_true", help="with --goals: the block indexer also on the token "
                 "kernel (before blocks51), kpool and qsa with whole pools (attn.kernel.selected), alternated")
  p.add_argument("--only", default=None, help="with --goals: these rows only, comma-separated labels (e.g. "
                 "kpool,qsa,block_indexer,moba)")
  p.add_argument("--layouts", default="G1,GH", help="G1 (one kv head), GH (a kv head a query head)")
  p.add_argument("--goals", action="store_true", help="the goals' table of attn bench --shapes long-16384-causal "
                 "alone (every selection in its layout, core with selector)")
  a = p.parse_args(argv)
  if a.goals:
    r = goals(a.T, a.heads, a.head_dim, a.repeats, log=lambda t: print(t, flush=True), budget=a.top_k,
              before=a.before, only=None if a.only is None else tuple(a.only.split(",")))
    print(r["extras"])
    print(goals_markdown(r))
    print(f"commit {subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], capture_output=True, text=True).stdout.strip()}")
    return 0
  T, H, D, k, J, I = a.T, a.heads, a.head_dim, a.top_k, a.index_heads, a.index_dim
  layouts = tuple(a.layouts.split(","))
  calls, pairs, tile = cases(T, H, D, k, J, I, a.old, layouts)
  med = _rounds(calls, a.repeats)
  mm_rate = 2 * 2048 ** 3 / med["matmul"] / 1e9
  causal = T * (T + 1) // 2
  per_pair = 2 * H * 2 * D  # forward FLOPs a (query, key) pair: q·k and p·v over H heads
  score_flops, compares = select.indexer_top_flops(T, T, J, I, is_causal=True)
  rows = [("full_G1", "full_G1", None, 3.5 * per_pair * causal), ("full_GH", "full_GH", None, 3.5 * per_pair * causal),
          ("attn_G1", "full_G1", GOALS["attn"], 3.5 * per_pair * pairs),
          ("attn_GH", "full_GH", GOALS["attn"], 3.5 * per_pair * pairs),
          ("selector", "full_G1", GOALS["selector"], score_flops), ("scores", "full_G1", None, score_flops),
          ("old_attn_G1", "full_G1", None, 3.5 * per_pair * pairs),
          ("old_attn_GH", "full_GH", None, 3.5 * per_pair * pairs)]
  print(f"T {T}, B 1, causal, {H} heads of {D}, float32, forward+backward; indexer top {k} "
        f"({J} index heads of {I}); medians of {a.repeats}, alternated")
  print(f"{'row':<13}{'s':>9}{'× full':>9}{'goal':>7}{'GFLOP':>9}{'GFLOP/s':>9}{'× matmul':>9}")
  for name, base, goal, flops in rows:
    if name not in med or base not in med:
      continue
    s = med[name]
    gf = flops / 1e9
    print(f"{name:<13}{s:>9.3f}{s / med[base]:>9.3f}{'' if goal is None else f'{goal:.2f}':>7}"
          f"{gf:>9.1f}{gf / s:>9.1f}{gf / s / mm_rate:>9.3f}")
  for tag in layouts:
    tot = (med[f"attn_{tag}"] + med["selector"]) / med[f"full_{tag}"]
    print(f"together_{tag}: {tot:.3f}× full causal (goal {GOALS['together']:.2f})")
  gathered = pairs * 2 * D * 4
  print(f"matmul 2048³: {mm_rate:.1f} GFLOP/s; chosen pairs {pairs} of {causal} causal "
        f"({pairs / causal:.4f}); selector compare-and-count {compares / 1e9:.1f} G ops "
        f"({compares / 1e9 / med['selector']:.1f} G/s of the selector's time, "
        f"{compares / 1e9 / max(1e-9, med['selector'] - med['scores']):.1f} G/s beside the scores)")
  print(f"gather: {gathered / 2**30:.2f} GiB of key and value rows (one kv head) in {med['gather']:.3f} s, "
        f"{gathered / 2**30 / med['gather']:.2f} GiB/s; tile {tile} queries")
  print(f"load {os.getloadavg()}; threads {peers_lib.threads()}")
  try:
    model = [ln for ln in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
             if "Model name" in ln]
    print(model[0].strip() if model else "")
  except OSError:
    pass
  return 0



# Issue 51's goals inside `attn bench --shapes long-16384-causal` (attn.bench.layer calls `goals`): each
# selection's core with its selector, through the shared path (base.core, impl "blocked": the
# selection rows), in the layout its checkpoints ship, over the full causal core of the same layout.
# (label, kv heads, extra, goal for core + selector; None: measured, no goal)
GOAL_ROWS = (
    ("indexer", 1, {"indexer": {"heads": 4, "head_dim": 32, "top_k": 2048}}, GOALS["together"]),
    ("indexer H=G", 16, {"indexer": {"heads": 4, "head_dim": 32, "top_k": 2048}}, None),
    ("kpool", 1, {"kpool": {"heads": 4, "head_dim": 32, "top_k": 2048, "kpool": 16}}, 0.35),
    ("qsa", 2, {"qsa": {"heads": 4, "head_dim": 32, "kv_heads": 1, "budget": 2048, "compress_ratio": 16}}, 0.35),
    ("block_indexer", 2, {"block_indexer": {"head_dim": 32, "block": 128, "top_k": 16, "local": 1}}, 0.35),
    ("moba", 2, {"moba": {"block": 512, "top_k": 4}}, 0.35),
    ("nsa", 2, {"nsa": {"compress_block": 32, "compress_stride": 16, "select_block": 64, "select_count": 16,
                        "window": 512}}, 0.60),
)
TOKEN_KERNEL = ("indexer", "kpool", "qsa")  # their choices run on attn.kernel.tokens here (the block indexer: gathered)
# Rows --before times again on the other form of the row rule (attn.kernel.selected): the block indexer
# "(before)", its blocks' tokens on the token kernel (BLOCKS_ROW "sparse", as before blocks51); K-pool and
# QSA "(whole pools)", each pool gathered whole (POOLS_WHOLE True: measured, not faster, so not the default).
BEFORE = {"kpool": "whole pools", "qsa": "whole pools", "block_indexer": "before"}


@contextlib.contextmanager
def _rule_other():
  from attn.kernel import selected
  was = selected.BLOCKS_ROW, selected.POOLS_WHOLE
  selected.BLOCKS_ROW, selected.POOLS_WHOLE = "sparse", True
  try:
    yield
  finally:
    selected.BLOCKS_ROW, selected.POOLS_WHOLE = was
ALONE = ("moba", "indexer", "kpool", "qsa", "block_indexer")  # selectors timed alone too (nsa's is inside)


def scaled(extra: dict, budget: int) -> dict:
  """A GOAL_ROWS selection with its key budget 2048 scaled to `budget` (the same k/T at a shorter T)."""
  (name, o), = extra.items()
  f = budget / 2048
  o = dict(o)
  for key in ("top_k", "budget"):
    if key in o and name != "block_indexer" and name != "moba":
      o[key] = budget
  if name == "block_indexer":
    o["top_k"] = max(1, round(o["top_k"] * f))
  if name == "moba":
    o["block"] = max(1, round(o["block"] * f))
  if name == "nsa":
    o["select_count"], o["window"] = max(1, round(o["select_count"] * f)), max(1, round(o["window"] * f))
  return {name: o}


def goals(T: int = 16384, H: int = 16, D: int = 64, repeats: int = 2, log=print, only=None,
          budget: int = 2048, before: bool = False) -> dict:
  """Median forward+backward seconds of each GOAL_ROWS core with its selector, its selector alone and
  the full causal core of each layout, alternated round by round; pairs and gathered bytes beside.
  budget: the rows' keys a query (2048 at the goals' T 16384; T 4096 with 512 keeps k/T). before: the
  BEFORE rows again on the other form of the row rule ("label (before)", "label (whole pools)", compiled
  under it, timed in the same rounds)."""
  from attn.bench.peers import core_case, selection_core_case, selector_case
  from attn.config import HeadConfig
  from attn.count import selectors
  rows = [(label, G, extra if budget == 2048 else scaled(extra, budget), goal) for label, G, extra, goal in GOAL_ROWS
          if only is None or label in only]
  calls, info = {}, {}
  for G in sorted({r[1] for r in rows}):
    log(f"[selection goals] full causal core, {H} heads over {G} kv heads ...")
    cfg = HeadConfig(d_model=H * D, num_heads=H, d_k=D, d_v=D, num_kv_heads=G)
    calls[f"full G{G}"] = core_case(cfg, 1, T, jnp.float32, is_causal=True)["fb"]
  for label, G, extra, _ in rows:
    log(f"[selection goals] {label} ...")
    cfg = HeadConfig(d_model=H * D, num_heads=H, d_k=D, d_v=D, num_kv_heads=G, extra=extra)
    calls[label] = selection_core_case(cfg, 1, T, jnp.float32)["fb"]
    name = next(iter(extra))
    if before and name in BEFORE:
      with _rule_other():  # compiled here, under the other rule
        calls[f"{label} ({BEFORE[name]})"] = selection_core_case(cfg, 1, T, jnp.float32)["fb"]
    if name in ALONE:
      calls[f"{label}: selector"] = selector_case(cfg, 1, T, jnp.float32)["fb"]
    pairs = selectors.pairs(cfg, T)
    info[label] = {"pairs": pairs, "pair_share": pairs / (T * (T + 1) // 2),
                   # the token kernel gathers K + V float32 numbers a chosen pair per kv head
                   "gathered_bytes": pairs * G * 2 * D * 4 if name in TOKEN_KERNEL else None}
    if before and name in BEFORE:
      info[f"{label} ({BEFORE[name]})"] = {**info[label], "gathered_bytes": pairs * G * 2 * D * 4}
  a = jax.random.normal(jax.random.PRNGKey(2), (2048, 2048), jnp.float32)
  calls["matmul 2048³"] = peers_lib.block(jax.jit(jnp.matmul), a, a)
  log(f"[selection goals] timing {len(calls)} calls, {repeats} rounds ...")
  med = _rounds(calls, repeats)
  return {"T": T, "H": H, "D": D, "repeats": repeats, "seconds": med, "info": info, "budget": budget,
          "extras": {label: extra for label, _, extra, _ in rows},
          "rows": [(lab, G, next(iter(extra)), goal) for label, G, extra, goal in rows
                   for lab in (label, f"{label} ({BEFORE.get(next(iter(extra)))})") if lab == label or lab in info],
          "load": list(os.getloadavg())}


def goals_markdown(r: dict) -> str:
  """The goals' table: × full causal of the same layout, the goal beside, pairs and bytes."""
  med = r["seconds"]
  mm = 2 * 2048 ** 3 / med["matmul 2048³"] / 1e9
  out = [f"Issue 51's goals, T={r['T']} (key budget {r.get('budget', 2048)}), B 1, causal, {r['H']} query heads of {r['D']}, float32, forward+backward, "
         f"each core with its selector (medians of {r['repeats']}, alternated; matmul {mm:.0f} GFLOP/s; load "
         f"{r['load']}):", "",
         "| selection | kv heads | core+selector s | × full | goal | selector alone × full | rest × full | "
         "pairs ÷ causal | gathered GiB |", "|---|---|---|---|---|---|---|---|---|"]
  for label, G, name, goal in r["rows"]:
    full = med[f"full G{G}"]
    s = med[label]
    sel = med.get(f"{label.split(' (')[0]}: selector")
    i = r["info"][label]
    gib = "" if i["gathered_bytes"] is None else f"{i['gathered_bytes'] / 2**30:.2f}"
    verdict = "" if goal is None else f"{goal:.2f} " + ("met" if s / full <= goal else f"missed by {s / full - goal:.2f}")
    out.append(f"| {label} | {G} | {s:.2f} | {s / full:.3f} | {verdict} | "
               f"{'' if sel is None else f'{sel / full:.3f}'} | {'' if sel is None else f'{(s - sel) / full:.3f}'} | "
               f"{i['pair_share']:.4f} | {gib} |")
  out.append("")
  out.append("full causal: " + ", ".join(f"{n} {s:.2f} s" for n, s in med.items() if n.startswith("full")))
  return "\n".join(out)


if __name__ == "__main__":
  raise SystemExit(main())
