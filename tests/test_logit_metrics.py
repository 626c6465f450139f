"""The largest attention logits (attn.analysis.logits, train.logit_metrics): against numpy on fresh
inputs under GQA, d_v != d_k and masks that blank whole rows; through a softcap and L2 clipping;
bad options refused by name; one training run's rows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attn
from attn import ConfigError
from attn.analysis import logits
from attn.experiments.training.config import TrainConfig
from conftest import fresh_params, randn

CFG = attn.HeadConfig(d_model=24, num_heads=6, d_k=5, d_v=7, num_kv_heads=2)


def _recorded(cfg, params, x, mask):
  @jax.jit
  def run(params, x):
    with logits.record_logits() as layers:
      attn.apply("fused", params, x, cfg=cfg, mask=mask)
    return layers
  return run(params, x)


def _numpy_scores(cfg, params, x):
  """(B,H,T,S) q·k/sqrt(d_k) of fused's layout (w_qkv columns: H·K queries, G·K keys, G·V values)."""
  H, G, K = cfg.num_heads, cfg.num_kv_heads, cfg.d_k
  qkv = np.asarray(x, np.float64) @ np.asarray(params["w_qkv"], np.float64) + np.asarray(params["b_qkv"])
  B, T, _ = qkv.shape
  q = qkv[..., :H * K].reshape(B, T, H, K)
  k = qkv[..., H * K:(H + G) * K].reshape(B, T, G, K)[:, :, np.arange(H) // (H // G)]
  return np.einsum("bthk,bshk->bhts", q, k) / np.sqrt(K)


def _mask(B, T):
  """Causal, with batch 1's query rows 2 and 5 blanked whole."""
  m = np.tril(np.ones((T, T), bool))[None, None].repeat(B, 0)
  m[1, :, [2, 5]] = False
  return m


def test_maxima_equal_numpy_under_gqa_and_blank_rows():
  B, T = 2, 7
  params, x = fresh_params("fused", CFG, seed=3), randn(4, (B, T, CFG.d_model))
  mask = _mask(B, T)
  (layer,) = _recorded(CFG, params, x, jnp.asarray(mask))
  want = np.where(mask, _numpy_scores(CFG, params, x), -np.inf).max(axis=(0, 2, 3))
  np.testing.assert_allclose(layer["max_score"], want, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(layer["max_logit"], layer["max_score"])  # no softcap: the same logits


def test_a_softcap_caps_the_logit_and_not_the_score():
  cfg = CFG.replace(softcap=0.5)
  B, T = 2, 7
  params, x = fresh_params("fused", cfg, seed=5), randn(6, (B, T, cfg.d_model)) * 4.0
  (layer,) = _recorded(cfg, params, x, jnp.asarray(_mask(B, T)))
  score = np.asarray(layer["max_score"], np.float64)
  assert score.max() > 0.5  # the inputs are large enough for the cap to bind
  np.testing.assert_allclose(layer["max_logit"], 0.5 * np.tanh(score / 0.5), rtol=1e-5)


def test_l2_clipping_bounds_the_score():
  c = 0.7
  cfg = CFG.replace(qk_l2_clip_threshold=c)
  B, T = 2, 7
  params, x = fresh_params("fused", cfg, seed=7), randn(8, (B, T, cfg.d_model)) * 4.0
  (layer,) = _recorded(cfg, params, x, jnp.asarray(_mask(B, T)))
  assert float(layer["max_score"].max()) <= c * c / np.sqrt(cfg.d_k) * (1 + 1e-5)


def test_a_head_with_every_pair_masked_is_minus_infinity():
  B, T = 1, 4
  params, x = fresh_params("fused", CFG, seed=9), randn(10, (B, T, CFG.d_model))
  mask = np.zeros((B, CFG.num_heads, T, T), bool)
  mask[:, 1:] = np.tril(np.ones((T, T), bool))  # head 0 sees nothing
  (layer,) = _recorded(CFG, params, x, jnp.asarray(mask))
  assert np.isneginf(layer["max_score"][0]) and np.isfinite(layer["max_score"][1:]).all()


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_a_bad_logit_metrics_is_refused_by_name(value):
  with pytest.raises(ConfigError, match=r"train\.logit_metrics"):
    TrainConfig(logit_metrics=value)


def test_training_rows_carry_the_maxima():
  """Two steps of a two-layer MQAR model with a softcap and logit_metrics: each evaluation row has the
  per-layer and model maxima, finite, the logits under the cap, the model's the largest of its layers'."""
  from attn.experiments.running import config as config_lib
  from attn.experiments.training import train
  cfg = config_lib.resolve({
      "task": {"name": "mqar", "vocab_size": 16, "seq_len": 12, "num_pairs": 2},
      "model": {"d_model": 16, "num_layers": 2, "num_heads": 2, "d_ff": 16, "softcap": 2.0},
      "train": {"steps": 2, "batch_size": 2, "eval_every": 1, "eval_batches": 1, "logit_metrics": True}}, [], None)
  rows = []
  (summary,) = train.train_group([cfg], lambda i, r: rows.append(r))
  evals = [r for r in rows if "eval_loss" in r]
  assert summary["status"] == "ok" and len(evals) == 2
  for r in evals:
    layers = [r["max_logit_l0"], r["max_logit_l1"]]
    assert np.isfinite(layers).all() and max(layers) == r["max_logit"] and r["max_logit"] <= 2.0
    assert r["max_score"] >= r["max_logit"] - 1e-6


def test_a_classifier_task_is_refused_by_name():
  from attn.experiments.running import config as config_lib
  with pytest.raises(ConfigError, match=r"train\.logit_metrics"):
    config_lib.resolve({"task": {"name": "marker_position", "vocab_size": 16, "seq_len": 12, "num_classes": 3},
                        "model": {"d_model": 16, "num_layers": 1, "num_heads": 2, "d_ff": 16, "pooling": "mean"},
                        "train": {"logit_metrics": True}}, [], None)


def test_a_model_without_softmax_logits_is_refused_by_name():
  from attn.experiments.running import config as config_lib
  with pytest.raises(ConfigError, match=r"train\.logit_metrics=True .*gated_deltanet"):
    config_lib.resolve({"task": {"name": "mqar", "vocab_size": 16, "seq_len": 12, "num_pairs": 2},
                        "model": {"d_model": 16, "num_layers": 1, "num_heads": 2, "d_ff": 16,
                                  "variant": "gated_deltanet"},
                        "train": {"logit_metrics": True}}, [], None)
