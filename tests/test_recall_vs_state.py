"""configs/recall_vs_state.toml: every arm the write-up compares is in it, at parameters within 1% of one
budget; and the report's recall-against-memory section counts what a sequence holds as `attn count` does."""

import os

import pytest

from attn import count
from attn.experiments.reading import memory
from attn.experiments.running import config as config_lib
from attn.nn.config import ModelConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "recall_vs_state.toml")
ONE_SETTING = ["sweep.seeds=[0]", "sweep.zip.task.num_pairs=[4]", "sweep.zip.task.seq_len=[32]"]


def _arms(trials):
  """case -> (ModelConfig, parameters) of each case's first trial."""
  out = {}
  for t in trials:
    if t.label["case"] not in out:
      m = ModelConfig(**t.config["model"])
      out[t.label["case"]] = (m, count.model_param_count(m, "decoder_lm"))
  return out


def _check_arms(sweep):
  arms = _arms(sweep.trials)
  params = [p for _, p in arms.values()]
  assert max(params) / min(params) - 1 < 0.01  # equal parameters, within 1%
  variants = {c: m.variant for c, (m, _) in arms.items()}
  assert {"fused", "mla", "gated_deltanet", "kda", "mamba2", "linear"} <= set(variants.values())
  softmax = {m.num_heads // m.num_kv_heads for m, _ in arms.values() if m.variant == "fused" and m.num_heads == 4}
  assert softmax == {1, 2, 4}  # MHA, GQA (G = 2), MQA
  ratios = {m.num_heads // m.num_kv_heads for m, _ in arms.values() if m.variant == "gated_deltanet"}
  assert {1, 2, 4} <= ratios  # H_v = H_k, 2·H_k, 4·H_k
  assert any(m.window for m, _ in arms.values())
  hybrids = sorted((m.layer_types.count("full_attention"), m.layer_types.count("linear_attention"))
                   for m, _ in arms.values() if m.layer_types)
  assert hybrids == [(1, 1), (1, 3)]  # one full layer to one linear, and to three
  for name in ("fused", "gated_deltanet", "linear"):  # one wide head against four narrow ones
    widths = {(m.num_heads, m.d_k) for m, _ in arms.values() if m.variant == name and m.num_heads == m.num_kv_heads}
    assert {(1, 32), (4, 8)} <= widths, name


def test_one_setting_holds_every_arm_at_equal_parameters():
  sweep = config_lib.load(CONFIG, ONE_SETTING)
  assert len(sweep.trials) == 17
  _check_arms(sweep)


@pytest.mark.slow  # seconds: the whole sweep's 102 trials, each with its parameter budget fitted
def test_the_whole_sweep_holds_every_arm_at_equal_parameters_in_every_setting():
  sweep = config_lib.load(CONFIG)
  assert len(sweep.trials) == 17 * 2 * 3
  for setting in ((4, 32), (8, 48)):
    _check_arms(type(sweep)(sweep.path, sweep.meta, sweep.axes, [
        t for t in sweep.trials if (t.label["task.num_pairs"], t.label["task.seq_len"]) == setting],
        sweep.vmap_seeds, sweep.id))


def _trial(model, seq_len):
  return {"config": {"task": {"name": "mqar", "vocab_size": 64, "seq_len": seq_len, "num_pairs": 4},
                     "model": model}}


BASE = dict(vocab_size=64, d_model=24, num_layers=4, num_heads=4, num_kv_heads=2, d_k=6, d_v=10, d_ff=8,
            max_len=40, positional="rope", rope_dim=2)


def test_sequence_bytes_are_the_cache_up_to_the_window_plus_each_linear_layers_state():
  L = 37
  mha = memory.sequence_bytes(_trial(BASE, L))
  assert mha == (4 * L * (2 * 6 + 2 * 10) * 4, 0)  # 4 layers, L positions, G = 2 key and value heads, float32
  window = memory.sequence_bytes(_trial({**BASE, "window": 9}, L))
  assert window == (4 * 9 * (2 * 6 + 2 * 10) * 4, 0)  # a ring of 9 slots
  hybrid = dict(BASE, layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"])
  kv, state = memory.sequence_bytes(_trial(hybrid, L))
  assert kv == L * (2 * 6 + 2 * 10) * 4  # one softmax layer
  # gated_deltanet (H = 4 value heads of 10, G = 2 key heads of 6): the H·K·V state plus the width-4
  # convolution's last 3 inputs of q, k and v, three layers, float32
  assert state == 3 * 4 * (4 * 6 * 10 + 3 * (2 * 2 * 6 + 4 * 10))
  assert memory.sequence_bytes({"config": {"task": {"name": "marker_position"}, "model": BASE}}) is None


def _row(case, pairs, kv, state, acc):
  return {"group": f"case={case}, num_pairs={pairs}", "label": {"case": case, "task.num_pairs": pairs},
          "memory": (kv, state), "eval_accuracy": (acc, 0.01), "seed_values": {"eval_accuracy": [acc] * 3},
          "late": [(0.0, 30)] * 3}


def test_the_frontier_is_per_task_setting_and_keeps_only_unbeaten_settings():
  rows = [_row("MHA", 4, 800, 0, 0.99), _row("GQA", 4, 400, 0, 0.99), _row("gdn", 4, 0, 100, 0.5),
          _row("hybrid", 4, 200, 50, 0.4), _row("MHA", 16, 800, 0, 0.7), _row("gdn", 16, 0, 100, 0.8)]
  assert memory.applies(rows) and not memory.applies([_row("MHA", 4, 800, 0, 0.9), _row("GQA", 4, 400, 0, 0.8)])
  assert memory.frontier(rows[:4]) == {1, 2}  # MHA: GQA recalls as much with less; hybrid: gdn beats it
  assert memory.frontier(rows[4:]) == {1}
  md = "\n".join(memory.section(rows))
  assert "### num_pairs=4" in md and "### num_pairs=16" in md
  assert "| GQA | 0 | 400 | 400 | 0.990 ± 0.010 |" in md and md.count("| yes |") == 3


def test_the_plot_draws_a_panel_per_setting_with_a_tick_at_each_settings_bytes(monkeypatch):
  plt = pytest.importorskip("matplotlib.pyplot")
  figures = []
  monkeypatch.setattr(plt, "close", figures.append)
  rows = [_row("MHA", 4, 2048, 0, 0.99), _row("gdn", 4, 0, 1024, 0.5), _row("MHA", 16, 4096, 0, 0.7)]
  for r in rows[:2]:
    r["chance"] = 0.27
  memory.plot(plt, rows, os.devnull, "MQAR")
  first, second = figures[0].axes
  assert [t.get_text() for t in first.get_xticklabels()] == ["1", "2"]  # KiB
  assert [t.get_text() for t in second.get_xticklabels()] == ["4"]
  dots = [l for l in first.get_lines() if l.get_marker() not in ("_", "None") and l.get_linestyle() == "None"]
  assert sorted(len(l.get_ydata()) for l in dots) == [3, 3]  # every seed a dot
  assert [list(l.get_ydata()) for l in first.get_lines() if l.get_linestyle() == ":"] == [[0.27, 0.27]]
  assert not [l for l in second.get_lines() if l.get_linestyle() == ":"]  # no chance given there


def test_the_curves_draw_a_panel_per_setting_and_a_line_per_trial(monkeypatch):
  plt = pytest.importorskip("matplotlib.pyplot")
  figures = []
  monkeypatch.setattr(plt, "close", figures.append)
  trials = [{"label": {"case": case, "task.num_pairs": pairs, "train.seed": seed}, "summary": {"status": "ok"},
             "rows": [{"step": s, "eval_accuracy": 0.1 * s} for s in (0, 4, 9)]}
            for case in ("MHA", "gdn", "linear") for pairs in (4, 8) for seed in (0, 1)]
  trials.append({**trials[0], "summary": {"status": "failed"}})
  memory.curves(plt, trials, os.devnull)
  panels = [ax for ax in figures[0].axes if ax.get_title()]
  assert [ax.get_title() for ax in panels] == ["MHA", "gdn", "linear"]
  assert [len(ax.get_lines()) for ax in panels] == [4, 4, 4]  # 2 task settings x 2 seeds; the failed one left out
  assert list(panels[1].get_lines()[0].get_xdata()) == [1, 5, 10]  # steps from 1
