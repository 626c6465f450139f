"""configs/how_few_keys.toml (experiments/how_few_keys): every selection at every budget the write-up names,
each k mapped to its options as the write-up's table says, on the recall recipe that full attention learns
(T = 512, 64 pairs, short_conv, a curriculum ending at T); seed 0 of every case runs before any seed 1."""

import os

from attn.count import selectors
from attn.experiments.running import config as config_lib
from attn.nn.config import ModelConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "how_few_keys.toml")
KS = (8, 16, 32, 64, 128, 256)
T = 512


def _fine_keys(kind: str, extra: dict, window) -> int:
  """k as the write-up maps it (README, "How k maps to options"): NSA's selected and window keys, its
  compressed ones apart."""
  if kind == "window":
    return window
  if kind == "moba":
    return extra["moba"]["block"] * extra["moba"]["top_k"]
  if kind == "indexer":
    return extra["indexer"]["top_k"]
  o = extra["nsa"]
  return o["select_count"] * o["select_block"] + o["window"]


def test_every_selection_at_every_budget_on_the_recipe_seed_0_first():
  sweep = config_lib.load(CONFIG)
  seeds = [t.label["train.seed"] for t in sweep.trials]
  assert seeds == sorted(seeds) and set(seeds) == {0, 1, 2}  # seed 0 of the whole grid first
  cases = {t.label["case"]: t.config for t in sweep.trials}
  assert set(cases) == {"full"} | {f"{s} {k}" for s in ("window", "moba", "indexer", "nsa") for k in KS}
  for case, cfg in cases.items():
    task, m = cfg["task"], ModelConfig(**cfg["model"])
    assert (task["seq_len"], task["num_pairs"], task["curriculum"][-1]) == (T, 64, T)
    assert m.short_conv == 3 and m.variant == "fused"
    if case == "full":
      assert m.window is None and not m.extra
      continue
    kind, k = case.split()[0], int(case.split()[1])
    assert _fine_keys(kind, m.extra or {}, m.window) == k, case
    h = m.layer_head(0)
    keys = selectors.pairs(h, T) / T if kind != "window" else None
    if kind in ("moba", "indexer"):  # never more keys a query than k
      assert keys <= k, (case, keys)
    if kind == "nsa":  # at most k plus the compressed blocks it has seen (t/16 at query t, 16 a query on average)
      assert k / 2 < keys <= k + T / 32 + 1, (case, keys)
    if kind == "indexer":
      assert cfg["train"]["indexer"] == "sparse"
