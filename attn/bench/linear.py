"""The linear family (`attn bench --shapes linear`): the fixed-state heads against the blocked softmax kernel.

B=1, T = LINEAR_LENGTHS, causal, the long family's D=512, H=8, K=V=64: each fixed-state head
(gated_deltanet, kda, mamba2, linear, gla, or those --variants names), its chunked form at its
default chunk, against the fused layer with the blocked softmax kernel, causal ("fused"); the T
from which each head is faster forward+backward, and from which its XLA buffers are smaller
(linear_crossover). Its FLOPs are the heads' closed forms (attn.count).
"""

from __future__ import annotations

from typing import Any

import attn
from attn.bench import peers as peers_lib
from attn.bench.shapes import Shape
from attn.config import ConfigError


def variant_case(variant, shape: Shape, dtype, mask) -> dict[str, Any]:
  """A variant's forward and forward+backward calls; a fixed-state head causal by construction, no dense mask."""
  if variant.init_state is not None:
    return peers_lib.variant_case(variant, shape.cfg, shape.B, shape.T, dtype, None, is_causal=True)
  return peers_lib.variant_case(variant, shape.cfg, shape.B, shape.T, dtype, mask)


def linear_cases(shape: Shape, dtype, variants: list[str]) -> tuple[dict[str, Any], dict[str, str]]:
  """The fused layer with the blocked kernel, causal, and each fixed-state head among `variants`."""
  cases = {"fused": peers_lib.fused_case(shape.cfg, shape.B, shape.T, dtype, impl="blocked",
                                         is_causal=True)}
  skipped = {}
  for v in variants:
    variant = attn.get_variant(v)
    if variant.init_state is None:
      continue
    try:
      variant.check(shape.cfg)
    except ConfigError as e:
      skipped[v] = str(e)
      continue
    cases[v] = variant_case(variant, shape, dtype, None)
  return cases, skipped


def linear_crossover(results: dict[str, Any]) -> dict[str, dict[str, int | None]]:
  """Per fixed-state head of the linear family: the least T from which it beats the blocked
  softmax layer ("fused") at every longer T measured, forward+backward wall time ("time"), process
  CPU time ("cpu": what load on a shared machine changes least) and XLA's buffers ("memory"); None
  where it does not win at the longest T."""
  by_T = {}
  for r in results.values():
    if r["shape"].get("linear"):
      by_T[r["shape"]["T"]] = {row["name"]: row for row in r["rows"]}
  heads = {n for rows in by_T.values() for n in rows if n != "fused"}
  out = {}
  for head in sorted(heads):
    wins = {"time": lambda h, f: h["fb"]["ms"] < f["fb"]["ms"],
            "cpu": lambda h, f: h["fb"]["cpu_ms"] < f["fb"]["cpu_ms"],
            "memory": lambda h, f: (h["peak_bytes"] or 0) < (f["peak_bytes"] or 0)}
    out[head] = {}
    for what, win in wins.items():
      since = None
      for T in sorted(by_T, reverse=True):
        rows = by_T[T]
        if head not in rows or "fused" not in rows or not win(rows[head], rows["fused"]):
          break
        since = T
      out[head][what] = since
  return out
