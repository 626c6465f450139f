"""Counting from one checked record: a layer checked once for all its figures; a report builds each table once."""

import importlib.util
import os

import pytest

from attn import HeadConfig, api, count
from attn.count import hf as count_hf
from attn.count import model as count_model

# A tiny Gemma 3 config.json: 6 layers, 5 sliding and 1 full, one kv head (G < H), d_v = d_k = 4.
GEMMA3 = {"model_type": "gemma3_text", "head_dim": 4, "hidden_activation": "gelu_pytorch_tanh",
          "hidden_size": 16, "intermediate_size": 32, "max_position_embeddings": 128, "num_attention_heads": 4,
          "num_hidden_layers": 6, "num_key_value_heads": 1, "query_pre_attn_scalar": 4, "rms_norm_eps": 1e-6,
          "rope_local_base_freq": 10000, "rope_theta": 1000000, "sliding_window": 8,
          "sliding_window_pattern": 6, "vocab_size": 64}


def counting(monkeypatch, module, name):
  """Replaces module.name by a wrapper that counts its calls; returns the list of calls."""
  calls, inner = [], getattr(module, name)

  def wrapper(*args, **kwargs):
    calls.append(args[:1])
    return inner(*args, **kwargs)

  monkeypatch.setattr(module, name, wrapper)
  return calls


def test_a_layer_row_checks_its_config_once(monkeypatch):
  cfg = HeadConfig(d_model=12, num_heads=3, d_k=5, d_v=7, num_kv_heads=1)
  want = count.layer_table(cfg, 9, 11, variants=["per_head", "fused"])
  checks = counting(monkeypatch, api, "check_config")
  rows = count.layer_table(cfg, 9, 11, variants=["per_head", "fused"])
  assert [c[0] for c in checks] == ["per_head", "fused"]  # one check per row, for all nine figures
  assert rows == want
  H, G, K, V, D = 3, 1, 5, 7, 12
  assert rows[0]["analytic"] == D * H * K + D * G * K + D * G * V + H * V * D + H * K + G * K + G * V + D
  assert rows[0]["kv_bytes_per_token"] == 4 * G * (K + V)  # float32, count.DTYPE


def test_the_record_gives_the_functions_figures_and_refuses_by_name():
  cfg = HeadConfig(d_model=12, num_heads=3, d_k=5, d_v=7, num_kv_heads=1, window=4)
  layer = count.check_layer("per_head", cfg)
  assert layer.param_counts() == count.param_counts("per_head", cfg)
  assert layer.flops(9, 11, backward=True) == count.flops("per_head", cfg, 9, 11, backward=True)
  assert layer.kv_cache_bytes(10, "float32") == count.kv_cache_bytes("per_head", cfg, 10, "float32") == (
      4 * 1 * (5 + 7) * 4)  # the window keeps 4 tokens
  with pytest.raises(api.ConfigError, match="num_heads"):
    count.check_layer("split_input", cfg.replace(d_model=13))


def test_hf_report_builds_each_table_once(monkeypatch):
  want = count_hf.hf_report(GEMMA3, "tiny", (16, 64))
  tables = counting(monkeypatch, count_model, "type_table")
  breakdowns = counting(monkeypatch, count_model, "model_param_breakdown")
  report = count_hf.hf_report(GEMMA3, "tiny", (16, 64))
  assert (len(tables), len(breakdowns)) == (1, 1)
  assert report == want
  sliding, full = report["layer_types"]
  assert (sliding["layers"], full["layers"]) == (5, 1)
  # per_head at D=16, H=4, G=1, K=V=4, no biases; a sliding layer keeps its window of 8 tokens
  assert sliding["params_per_layer"] == 16 * 4 * 4 + 2 * 16 * 1 * 4 + 4 * 4 * 16 + 2 * 4  # + QK-norm scales
  assert sliding["kv_bytes_at"] == {"16": 5 * 8 * 2 * 4 * 4, "64": 5 * 8 * 2 * 4 * 4}  # float32
  assert full["kv_bytes_at"] == {"16": 16 * 2 * 4 * 4, "64": 64 * 2 * 4 * 4}


def test_the_walk_of_the_config_climbs_back_up_at_most_twice():
  """scripts/count_walk.py: 27 stops and 4 climbs at 6ecffc4; counting from records halves the climbs."""
  path = os.path.join(os.path.dirname(__file__), os.pardir, "scripts", "count_walk.py")
  spec = importlib.util.spec_from_file_location("count_walk", path)
  walk = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(walk)
  stops, climbs = walk.measure()
  assert climbs <= 2 and stops <= 27
