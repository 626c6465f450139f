"""The long family (`attn bench --shapes long`): attention cores behind the same projections, and their ratios.

B=1, T = LONG_LENGTHS, with and without a causal mask: attn's fused layer with the blocked
kernel (the "fused" row) and with the einsum kernel, jax.nn.dot_product_attention, and torch's
F.scaled_dot_product_attention; candidates whose XLA buffers would exceed half the available
memory are skipped with that reason. Causal long shapes also time the blocked core alone ("core")
against the same core with a sliding window of LONG_WINDOW keys ("core_window") and each key
selection of SELECTIONS; those up to T = 4096 without a mask time the core alone too ("core_full").
The candidates live in attn.bench.peers.
"""

from __future__ import annotations

from typing import Any

from attn.bench import peers as peers_lib
from attn.bench.shapes import LONG_LENGTHS, LONG_WINDOW, SELECTIONS, SELECTORS_ALONE, Shape
from attn.count import selectors
from attn.kernel import onednn


def long_cases(shape: Shape, dtype, dtype_name: str,
                peers: bool) -> tuple[dict[str, Any], dict[str, str]]:
  """The fused layer with the blocked kernel, and the other cores behind the same projections."""
  cfg, B, T, causal = shape.cfg, shape.B, shape.T, shape.causal
  avail = peers_lib.available_bytes()
  budget = None if avail is None else avail // 2
  cases, skipped = {}, {}
  cases["fused"] = peers_lib.fused_case(cfg, B, T, dtype, impl="blocked", is_causal=causal)
  others = {"einsum": "einsum"} | ({"jax_dpa": "xla"} if peers else {})
  for name, impl in others.items():
    c = peers_lib.fused_case(cfg, B, T, dtype, impl=impl, is_causal=causal, max_bytes=budget)
    if "skip" in c:
      skipped[name] = c["skip"]
    else:
      cases[name] = c
  why = onednn.why_not(dtype)
  impls = {"": "blocked"} | ({"_onednn": "onednn"} if why is None else {})
  if why is not None:
    skipped["fused_onednn"] = f'impl="onednn" does not run here: {why}'
  for tag, impl in impls.items():
    if tag:  # the blocked core with its block matmuls on oneDNN (attn.kernel.onednn.bmm)
      cases["fused" + tag] = peers_lib.fused_case(cfg, B, T, dtype, impl=impl, is_causal=causal)
    if causal:
      cases["core" + tag] = peers_lib.core_case(cfg, B, T, dtype, is_causal=True, impl=impl)
      cases["core_window" + tag] = peers_lib.core_case(cfg, B, T, dtype, is_causal=True,
                                                       window=LONG_WINDOW, impl=impl)
      if not tag:
        for sel, o in SELECTIONS.items():
          cases[f"core_{sel}"] = peers_lib.selection_core_case(cfg.replace(extra={sel: o}), B, T, dtype)
          if sel in SELECTORS_ALONE:
            cases[f"selector_{sel}"] = peers_lib.selector_case(cfg.replace(extra={sel: o}), B, T, dtype)
    elif T <= 4096:  # the core alone without a mask, for causal ÷ full of the core (bench_targets.py)
      cases["core_full" + tag] = peers_lib.core_case(cfg, B, T, dtype, is_causal=False, impl=impl)
  if peers:
    torch_case = peers_lib.torch_sdpa_case(cfg, B, T, dtype_name, causal)
    if torch_case is not None:
      cases["torch_sdpa"] = torch_case
  return cases, skipped


def core_flops_of(shape: Shape) -> dict[str, int]:
  """Forward FLOPs of the core rows: every T×S pair for "core", the pairs inside the window for "core_window"."""
  cfg, T = shape.cfg, shape.T
  per_pair = 2 * cfg.num_heads * (cfg.d_k + cfg.d_v) * shape.B
  pairs = sum(min(LONG_WINDOW, t + 1) for t in range(T))
  out = {"core": per_pair * T * T, "core_full": per_pair * T * T, "core_window": per_pair * pairs}
  for sel, o in SELECTIONS.items():  # the pairs it attends, plus its selector's own work
    on = cfg.replace(extra={sel: o})
    out[f"core_{sel}"] = shape.B * (2 * cfg.num_heads * (cfg.d_k + cfg.d_v) * selectors.pairs(on, T)
                                    + selectors.selector_flops(on, T))
    if sel in SELECTORS_ALONE:
      out[f"selector_{sel}"] = shape.B * selectors.selector_flops(on, T)
  return out


def causal_ratios(results: dict[str, Any]) -> dict[int, float]:
  """The fused layer's forward+backward time with a causal mask over without, per long T."""
  out = {}
  for T in LONG_LENGTHS:
    pair = [results.get(f"long-{T}{suffix}") for suffix in ("", "-causal")]
    if all(pair):
      fb = [{r["name"]: r for r in p["rows"]}["fused"]["fb"]["ms"] for p in pair]
      out[T] = fb[1] / fb[0]
  return out


def window_ratios(results: dict[str, Any]) -> dict[int, float]:
  """The blocked core's forward+backward time with a causal window of LONG_WINDOW over full causal, per T."""
  out = {}
  for T in LONG_LENGTHS:
    r = results.get(f"long-{T}-causal")
    if r:
      rows = {row["name"]: row for row in r["rows"]}
      out[T] = rows["core_window"]["fb"]["ms"] / rows["core"]["fb"]["ms"]
  return out


def selection_ratios(results: dict[str, Any]) -> dict[int, dict[str, dict[str, float]]]:
  """Each key selection's core over the full causal blocked core, per long causal T: forward and
  forward+backward time and peak memory."""
  out = {}
  for T in LONG_LENGTHS:
    r = results.get(f"long-{T}-causal")
    if r:
      rows = {row["name"]: row for row in r["rows"]}
      full = rows["core"]
      out[T] = {sel: {"fwd": rows[f"core_{sel}"]["fwd"]["ms"] / full["fwd"]["ms"],
                      "fb": rows[f"core_{sel}"]["fb"]["ms"] / full["fb"]["ms"],
                      "cpu_fb": rows[f"core_{sel}"]["fb"]["cpu_ms"] / full["fb"]["cpu_ms"],
                      "peak": (rows[f"core_{sel}"]["peak_bytes"] or 0) / (full["peak_bytes"] or 1),
                      **_less_selector(rows, sel, full)}
                for sel in SELECTIONS if f"core_{sel}" in rows}
  return out


def _less_selector(rows: dict[str, Any], sel: str, full: dict[str, Any]) -> dict[str, float]:
  """The selector's forward ÷ the full core's forward+backward, and the core's forward+backward less it
  (the attention over the chosen keys, the goal's "core"), where the bench timed the selector alone."""
  alone = rows.get(f"selector_{sel}")
  if alone is None:
    return {}
  return {"selector_fb": alone["fwd"]["ms"] / full["fb"]["ms"],
          "fb_less_selector": (rows[f"core_{sel}"]["fb"]["ms"] - alone["fwd"]["ms"]) / full["fb"]["ms"]}
