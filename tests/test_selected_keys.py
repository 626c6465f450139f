"""configs/selected_keys.toml and its text half, selected_keys_text.toml: every arm the write-up compares is
in it, at parameters within 1% of one budget, with the key budgets the write-up states; and the report's accuracy-against-FLOPs section counts
the attention FLOPs a token as attn.count.selectors does."""

import os

import pytest

from attn import count
from attn.config import HeadConfig
from attn.count import selectors
from attn.experiments.reading import selection
from attn.experiments.running import config as config_lib
from attn.nn.config import ModelConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "selected_keys.toml")
T = 1024
# The write-up's key budgets (experiments/selected_keys/README.md, "How k maps to options") and the mean
# keys a query each gets at T = 1024, as attn.count.selectors counts them.
BUDGETS = {"full": ("none", T), "window 64": ("window", 64), "window 256": ("window", 256),
           "moba 64": ("moba", 64), "moba 256": ("moba", 256), "indexer 64": ("indexer", 64),
           "indexer 256": ("indexer", 256), "indexer 64 sparse-trained": ("indexer", 64),
           "nsa 64": ("nsa", 64), "nsa 256": ("nsa", 256)}
MEAN_KEYS = {"full": 512.5, "window 64": 62.0, "window 256": 224.1, "moba 64": 55.0, "moba 256": 200.5,
             "indexer 64": 62.0, "indexer 256": 224.1, "indexer 64 sparse-trained": 62.0, "nsa 64": 67.3,
             "nsa 256": 208.5}


# The text half adds DeepSeek-V3.2's staged recipe at k = 64.
TEXT_BUDGETS = {**BUDGETS, "indexer 64 staged": ("indexer", 64)}


def _arms(config=CONFIG):
  sweep = config_lib.load(config, ["sweep.seeds=[0]"])
  return {t.label["case"]: t for t in sweep.trials}


def _budget(name: str, h: HeadConfig) -> int:
  """k as the write-up maps it to each selector's options."""
  extra = h.extra or {}
  if name == "window":
    return h.window
  if name == "moba":
    return extra["moba"]["block"] * extra["moba"]["top_k"]
  if name == "indexer":
    return extra["indexer"]["top_k"]
  if name == "nsa":  # selected blocks + window + the compressed blocks a query sees on average (T / 2 stride)
    o = extra["nsa"]
    return o["select_count"] * o["select_block"] + o["window"] + T // (2 * o["compress_stride"])
  return T


@pytest.mark.parametrize("name,budgets", [("selected_keys", BUDGETS), ("selected_keys_text", TEXT_BUDGETS)])
def test_every_arm_at_equal_parameters_with_the_stated_key_budget(name, budgets):
  arms = _arms(os.path.join(ROOT, "configs", name + ".toml"))
  assert set(arms) == set(budgets)
  params = {}
  for case, t in arms.items():
    m = ModelConfig(**t.config["model"])
    task = t.config["task"]
    assert task["seq_len"] == T and (task["name"] == "text" if name.endswith("text") else task["num_pairs"] >= 32)
    params[case] = count.model_param_count(m, "decoder_lm")
    kind, k = budgets[case]
    for i in range(m.num_layers):
      h = m.layer_head(i)
      chosen = [s for s in selection.SELECTORS if s in (h.extra or {})]
      assert chosen == ([] if kind in ("none", "window") else [kind]), case
      assert (h.window is not None) == (kind == "window"), case
      budget = _budget(kind, h)
      assert budget == k if kind != "nsa" else abs(budget - k) <= k // 8, (case, budget)
  assert max(params.values()) / min(params.values()) - 1 < 0.01, params  # equal parameters, within 1%
  assert arms["indexer 64 sparse-trained"].config["train"]["indexer"] == "sparse"
  assert arms["indexer 64"].config["train"].get("indexer", "off") == "off"
  if "indexer 64 staged" in arms:
    train = arms["indexer 64 staged"].config["train"]
    assert train["indexer"] == "staged" and 0 < train["indexer_dense_steps"] + train["indexer_warmup_steps"] < train["steps"]


def test_the_report_counts_keys_and_flops_as_count_selectors():
  arms = _arms()
  flops = {case: selection.attention_flops({"config": t.config}) for case, t in arms.items()}
  for case, f in flops.items():
    assert f["keys"] == pytest.approx(MEAN_KEYS[case], abs=0.05), case
  m = ModelConfig(**arms["full"].config["model"])
  full = sum(selectors.core_flops_at(m.layer_head(i), T, T) for i in range(m.num_layers)) / T
  assert flops["full"]["core"] == full and flops["full"]["selector"] == 0
  window = sum(selectors.core_flops_at(m.layer_head(i), T, 64) for i in range(m.num_layers)) / T
  assert flops["window 64"]["core"] == window < full
  h = ModelConfig(**arms["moba 64"].config["model"]).layer_head(0)
  row = selectors.selection_row(h, T)
  assert flops["moba 64"]["core"] == 2 * row["core_flops"] / T  # two layers alike
  assert flops["moba 64"]["selector"] == 2 * row["selector_flops"] / T > 0
  assert flops["indexer 64"]["selector_params"] == 2 * selectors.selection_row(
      ModelConfig(**arms["indexer 64"].config["model"]).layer_head(0), T)["params"] > 0


def _row(group, acc, loss, flops):
  return {"group": group, "eval_accuracy": (acc, 0.01), "eval_loss": (loss, 0.02),
          "seed_values": {"eval_accuracy": [acc - 0.01, acc, acc + 0.01], "eval_loss": [loss] * 3},
          "attention_flops": flops, "chance": 0.05}


def test_the_section_and_plot_draw_every_group_and_seed(monkeypatch):
  plt = pytest.importorskip("matplotlib.pyplot")
  none = {"keys": 512.5, "core": 65600.0, "selector": 0.0, "selector_params": 0, "selector_name": "none"}
  moba = {"keys": 55.0, "core": 7040.0, "selector": 4128.0, "selector_params": 0, "selector_name": "moba"}
  rows = [_row("case=full", 0.9, 1.0, none), _row("case=moba 64", 0.5, 2.0, moba)]
  assert selection.applies(rows) and not selection.applies(rows[:1])
  assert not selection.applies([rows[0], _row("case=full 2", 0.8, 1.1, none)])  # nothing selects keys
  md = "\n".join(selection.section(rows))
  assert "| case=moba 64 | 55.0 | 7,040 | 4,128 | 0 | 0.5000 ± 0.0100 | 2.0000 ± 0.0200 |" in md
  figures = []
  monkeypatch.setattr(plt, "close", figures.append)
  selection.plot(plt, rows, os.devnull)
  acc, loss = figures[0].axes
  assert [t.get_text() for t in acc.get_xticklabels()] == ["11.2k", "65.6k"]  # a tick at each group's FLOPs
  dots = [l for l in acc.get_lines() if l.get_marker() == "o"]
  assert sorted(len(l.get_ydata()) for l in dots) == [3, 3]  # every seed a dot
  assert len([l for l in loss.get_lines() if l.get_marker() == "o"]) == 2
  assert selection._labels([1e4, 1.1e4, 1.12e4, 5e4]) == ["10k", "\n11k", "\n\n11.2k", "50k"]  # close ones stacked
