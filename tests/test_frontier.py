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
