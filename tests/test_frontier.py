"""The quality-vs-cache frontier of a report: cache bytes from a trial's config, the frontier, the plot."""

import dataclasses
import os

import pytest

from attn.experiments.reading import plots
from attn.experiments.reading import report
from attn.nn.config import ModelConfig


def _trial(task="text", **model):
  cfg = ModelConfig(vocab_size=256, d_model=64, num_layers=2, num_heads=8, d_k=8, d_v=8, d_ff=64, **model)
  return {"config": {"task": {"name": task}, "model": dataclasses.asdict(cfg)}}


def test_kv_cache_bytes_and_names_from_the_trials_config():
  # 2 layers · 4 bytes · (2·G·d_k numbers for keys and values, or the latent d_c for mla).
  assert report.kv_cache_bytes(_trial(variant="fused", num_kv_heads=2)) == 2 * 4 * (2 * 2 * 8)
  assert report.kv_cache_bytes(_trial(variant="mla", latent_dim=12)) == 2 * 4 * 12
  assert report.kv_cache_bytes(_trial(task="mqar", variant="fused")) == 2 * 4 * (2 * 8 * 8)
  assert report.kv_cache_bytes({"config": {}}) is None
  names = [report.setting_name(_trial(**m)["config"]["model"]) for m in
           ({"variant": "fused"}, {"variant": "per_head", "num_kv_heads": 4}, {"variant": "fused", "num_kv_heads": 1},
            {"variant": "mla", "latent_dim": 12}, {"variant": "talking_heads"})]
  assert names == ["MHA", "GQA G=4", "MQA", "mla d_c=12", "talking heads"]


def test_pareto_front_keeps_the_points_nothing_beats_on_both():
  # (cache, bits per byte): index 1 is beaten by 0 (smaller and better); 4 ties 3's cache but is worse.
  points = [(128, 2.6), (256, 2.7), (256, 2.5), (1024, 2.4), (1024, 2.45), (512, 2.5)]
  assert plots.pareto_front(points) == [0, 2, 3]
  assert plots.pareto_front([(8, 1.0)]) == [0]


def test_frontier_plot_is_drawn_when_caches_differ(tmp_path):
  pytest.importorskip("matplotlib")
  rows = [{"group": g, "setting": g, "kv_bytes": kv, "eval_bpb": (m, 0.01), "eval_accuracy": (0.5, 0.0),
           "label": {"model.variant": g}, "seed_values": {"eval_bpb": [m - 0.01, m, m + 0.01]}}
          for g, kv, m in (("MHA", 1024, 2.5), ("MQA", 128, 2.6), ("mla d_c=16", 128, 2.55))]
  plt = plots._pyplot()
  plots.kv_frontier(plt, rows, str(tmp_path / "f.png"))
  assert os.path.getsize(tmp_path / "f.png") > 1000
  md = "\n".join(report.frontier_section(rows, "eval_bpb"))
  assert "| mla d_c=16 | mla d_c=16 | 128 | 2.5500 ± 0.0100 | yes |" in md
  assert "| MQA | MQA | 128 | 2.6000 ± 0.0100 | no |" in md and "| MHA | MHA | 1,024 | 2.5000 ± 0.0100 | yes |" in md


def test_attention_parameters_from_the_trials_config_leave_out_a_sharing_layers_key_side():
  # 2 layers of per_head h = 8, d_k = d_v = 8, d_model 64, biases: 4·D·H·K + 3·H·K + D each.
  layer = 4 * 64 * 64 + 3 * 64 + 64
  assert report.attention_params(_trial(variant="per_head")) == 2 * layer
  # layer 1 reads layer 0's keys and values: no w_k, w_v, b_k, b_v of its own
  assert report.attention_params(_trial(variant="per_head", kv_source=(0, 0))) == 2 * layer - 2 * (64 * 64 + 64)
  assert report.attention_params(_trial(task="marker_position")) is None  # a classifier: no such row
  assert report.attention_params({"config": {}}) is None


def _rows():
  return [{"group": f"case={g}", "setting": g, "kv_bytes": kv, "attn_params": p, "eval_bpb": (m, 0.01),
           "eval_accuracy": (0.5, 0.0), "label": {"case": g}, "seed_values": {"eval_bpb": [m - 0.01, m, m + 0.01]}}
          for g, kv, p, m in (("MHA", 1024, 66560, 2.5), ("share 2", 512, 49920, 2.52), ("k_eq_v", 512, 49920, 2.51),
                              ("MQA", 128, 37440, 2.6))]


def test_the_frontier_table_gains_attention_parameters_and_their_own_frontier_where_they_differ():
  md = "\n".join(report.frontier_section(_rows(), "eval_bpb"))
  # MHA is on the cache frontier (nothing cached as much is better) and on the parameter one;
  # share 2 is beaten on both by k_eq_v (equal cache, equal parameters, a lower mean).
  assert "| MHA | case=MHA | 1,024 | 66,560 | 2.5000 ± 0.0100 | yes | yes |" in md
  assert "| share 2 | case=share 2 | 512 | 49,920 | 2.5200 ± 0.0100 | no | no |" in md
  assert "| k_eq_v | case=k_eq_v | 512 | 49,920 | 2.5100 ± 0.0100 | yes | yes |" in md
  equal = [dict(r, attn_params=1000) for r in _rows()]
  assert "attention params" not in "\n".join(report.frontier_section(equal, "eval_bpb"))


def test_the_parameter_frontier_plot_has_a_tick_at_each_settings_count(monkeypatch, tmp_path):
  plt = pytest.importorskip("matplotlib.pyplot")
  figures = []
  monkeypatch.setattr(plt, "close", figures.append)
  monkeypatch.setattr(plt.Figure, "savefig", lambda *a, **k: None)  # the axes are what is checked
  made = plots.make_plots(_rows(), [], [], str(tmp_path), plots.TEXT_METRICS, curves=False)
  assert made == ["frontier_kv_cache.png", "frontier_attention_params.png"]
  cache, params = (f.axes[0] for f in figures)
  assert [t.get_text() for t in params.get_xticklabels()] == ["37,440", "49,920", "66,560"]
  assert [t.get_text() for t in cache.get_xticklabels()] == ["128", "512", "1024"]
  dots = [l for l in params.get_lines() if l.get_marker() == "o"]
  assert sorted(len(l.get_ydata()) for l in dots) == [3, 3, 3, 3]  # every seed a dot
  xs = sorted(l.get_xdata()[0] for l in dots)
  assert xs[1] != xs[2] and 49920 * 0.9 < xs[1] < xs[2] < 49920 * 1.1  # equal counts side by side
  made = plots.make_plots([dict(r, attn_params=1000) for r in _rows()], [], [], str(tmp_path), plots.TEXT_METRICS,
                          curves=False)
  assert made == ["frontier_kv_cache.png"]
