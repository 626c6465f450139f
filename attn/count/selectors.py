"""What a key selection costs, in closed form: the selector's parameters and FLOPs, and the attention
core's FLOPs at T causal queries with k keys a query (moba, indexer, nsa; attn.variants.selection, nsa).

The core at k keys a query: 2·H·(K + V) per (query, key) pair, Σ_t min(t + 1, k) pairs under
is_causal (the first queries see fewer than k), T·k without. Each selector's own pairs follow its
rule: MoBA top_k blocks of `block` (its own block causally), the indexer min(t + 1, top_k), NSA its
compressed blocks ended, its selected blocks' keys and its window. Softmax, masking and top-k are
not counted (a few elementwise operations per score: XLA's count is within 10% of these at the
sizes tests/test_count_selectors.py checks). S = T, no padding.
"""

from __future__ import annotations

from typing import Any

from attn.config import HeadConfig
from attn.variants import mechanisms, nsa, selection
from attn.variants.mechanisms import pooled


def core_flops_at(cfg: HeadConfig, T: int, k: int, *, causal: bool = True) -> int:
  """The attention core's FLOPs with k keys a query: 2·H·(K + V)·pairs."""
  pairs = T * k if not causal else (T * (T + 1) // 2 if k >= T else k * (k + 1) // 2 + (T - k) * k)
  return 2 * pairs * cfg.num_heads * (cfg.d_k + cfg.d_v)


def selector_flops(cfg: HeadConfig, T: int) -> int:
  """The selector's own forward FLOPs at T = S (0 without a selection)."""
  m = mechanisms.selector(cfg)
  if m is None:
    return 0
  if m.name == "nsa":
    return nsa.selector_flops(cfg, T, T)
  return m.flops(cfg, T, T)


def pairs(cfg: HeadConfig, T: int) -> int:
  """(query, key) pairs the layer's attention computes over T causal queries."""
  m = mechanisms.selector(cfg)
  if m is not None and m.name == "nsa":
    return sum(nsa.keys(cfg, T).values())
  if m is not None and m.name in pooled.NAMES:
    return pooled.keys(m.name, cfg, T)
  return selection.selected_core_flops(cfg, T) // (2 * cfg.num_heads * (cfg.d_k + cfg.d_v))


def selection_row(cfg: HeadConfig, T: int) -> dict[str, Any]:
  """One row: the selector, its parameters and FLOPs, keys a query (mean), the core's FLOPs with it
  and without (full causal), and their ratio."""
  m = mechanisms.selector(cfg)
  n = pairs(cfg, T)
  full = core_flops_at(cfg, T, T)
  core = 2 * n * cfg.num_heads * (cfg.d_k + cfg.d_v)
  return {"selector": m.name if m else "none", "params": m.param_count(cfg) if m else 0,
          "selector_flops": selector_flops(cfg, T), "keys_per_query": round(n / T, 1),
          "core_flops": core, "full_core_flops": full, "core_vs_full": f"{core / full:.3f}"}
