"""`attn analyze`: end to end on a tiny sweep, the report's section, and refusals of bad input."""

import json
import math
import os
import re

import jax
import numpy as np
import pytest

from attn import cli
from attn.config import ConfigError
from attn.experiments.reading import analyze
from attn.experiments.running import store
from attn.experiments.running import config as config_lib

TINY = """
[meta]
name = "tiny analyze"

[task]
name = "mqar"
vocab_size = 16
seq_len = 10
num_pairs = 2

[model]
d_model = 16
num_layers = 2
num_heads = 2
d_ff = 16

[train]
steps = 4
batch_size = 8
warmup_steps = 1
eval_every = 2
eval_batches = 2

[sweep]
derive = ["fixed_width"]
seeds = [0, 1]

[sweep.grid]
"model.num_heads" = [1, 2]
"""
KEYS = {"trial", "label", "step", "variant", "num_layers", "num_heads", "d_model", "d_k", "d_v", "task",
        "data", "eval", "layers", "pruning", "summary", "example", "plots", "seconds"}


@pytest.fixture(autouse=True)
def _cache(monkeypatch):
  monkeypatch.setenv("ATTN_JAX_CACHE", jax.config.jax_compilation_cache_dir)  # the suite's (conftest)


@pytest.fixture(scope="module")
def analysed(tmp_path_factory):
  """`attn sweep tiny.toml --analyze`: trains, analyses every trial, then writes the report."""
  root = tmp_path_factory.mktemp("analyze")
  (root / "tiny.toml").write_text(TINY)
  out = str(root / "out")
  assert cli.main(["sweep", str(root / "tiny.toml"), "--out", out, "--analyze"]) == 0
  return out, config_lib.load(str(root / "tiny.toml"))


@pytest.mark.slow
def test_analyze_writes_analysis_json_and_plots_for_every_trial(analysed):
  out, sw = analysed
  for t in sw.trials:
    d = os.path.join(out, "trials", t.id)
    with open(os.path.join(d, analyze.ANALYSIS)) as f:
      a = json.load(f)  # strict JSON: no NaN
    assert set(a) == KEYS
    L, H = 2, t.config["model"]["num_heads"]
    assert (a["num_layers"], a["num_heads"], a["d_k"], a["step"]) == (L, H, 16 // H, 4)
    summary = store.read_json(os.path.join(d, store.SUMMARY))
    np.testing.assert_allclose(a["eval"]["loss"], summary["final"]["eval_loss"], rtol=1e-5)
    np.testing.assert_allclose(a["eval"]["accuracy"], summary["final"]["eval_accuracy"], atol=1e-6)
    assert a["pruning"]["heads_off"] == list(range(L * H + 1))
    assert len(a["layers"]) == L
    for layer in a["layers"]:
      assert len(layer["qk"]["singular_values"]) == H and len(layer["qk"]["singular_values"][0]) == 16
      assert all(r <= 16 // H for r in layer["qk"]["rank"])  # per_head: rank(W_Q W_Kᵀ) <= d_k
      assert all(0 <= e <= math.log(10) + 1e-5 for e in layer["attention"]["entropy"])
      assert np.allclose(np.linalg.norm(layer["importance"]["normalized"]), 1.0)
      sinks = layer["sinks"]  # attn.analysis.sinks, on the same held-out batches
      assert len(sinks["first_mass"]) == H and len(sinks["value_drain"]) == H and 0 <= sinks["sink_heads"] <= 1
      np.testing.assert_allclose(sinks["sink_heads"], np.mean(np.array(sinks["first_mass"]) > 0.3))
    assert 0 <= a["summary"]["sink_heads"] <= 1 and a["summary"]["residual_first"] > 0
    diversity = a["summary"]["head_diversity"]
    assert diversity is None if H == 1 else 0 < diversity < math.log(2)
    for name in a["plots"]:
      with open(os.path.join(d, name), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert a["plots"] == ["attention.png", "spectra.png", "importance.png", "pruning.png"]


@pytest.mark.slow
def test_report_compares_the_analyses_across_axes(analysed):
  out, _ = analysed
  text = open(os.path.join(out, "report.md")).read()  # written by the sweep, after the analysis
  assert "## Inside the heads" in text
  assert "analysis_vs_num_heads.png" in text and os.path.exists(os.path.join(out, "analysis_vs_num_heads.png"))
  section = text.split("## Inside the heads")[1].split("## Trials")[0]
  assert "| num_heads=1 | 2 | 16 |" in section and "| num_heads=2 | 2 | 8 |" in section
  assert "**num_heads** = 1 (d_k=16), 2 (d_k=8)" in section


@pytest.mark.slow
def test_cli_analyzes_one_named_trial_with_fewer_batches(analysed, capsys):
  out, sw = analysed
  tid = sw.trials[-1].id
  assert cli.main(["analyze", out, "--trial", tid, "--batches", "1", "--no-plots"]) == 0
  a = store.read_json(os.path.join(out, "trials", tid, analyze.ANALYSIS))
  assert a["data"]["held_out_batches"] == 1 and "plots" not in a
  assert "analysed 1 trials" in capsys.readouterr().out


def _fake_sweep(root, trials, finished=True):
  """A sweep directory whose trials finished without checkpoints (no training needed)."""
  os.makedirs(root)
  store.write_json(os.path.join(root, store.SWEEP), {
      "sweep_id": "s", "name": "fake", "config_path": "configs/fake.toml", "overrides": ["train.steps=3"],
      "axes": [], "trials": [{"id": t, "label": {}} for t in trials]})
  for t in trials:
    os.makedirs(os.path.join(root, "trials", t))
    if finished:
      store.write_json(os.path.join(root, "trials", t, store.SUMMARY), {"status": "ok"})


def test_not_a_sweep_directory_is_refused(tmp_path, capsys):
  with pytest.raises(ConfigError, match="a sweep directory written by `attn sweep`"):
    analyze.analyze_sweep(str(tmp_path))
  assert cli.main(["analyze", str(tmp_path)]) == 2
  assert "error: DIR=" in capsys.readouterr().err


def test_an_unknown_trial_lists_the_known_ones(tmp_path):
  root = str(tmp_path / "s")
  _fake_sweep(root, ["aaa111", "bbb222"])
  with pytest.raises(ConfigError, match=r"--trial='zzz'.*aaa111, bbb222"):
    analyze.analyze_sweep(root, ["zzz"])


def test_trials_without_checkpoints_say_so_and_give_the_command(tmp_path):
  root = str(tmp_path / "s")
  _fake_sweep(root, ["aaa111", "bbb222"])
  with pytest.raises(ConfigError) as e:
    analyze.analyze_sweep(root)
  message = str(e.value)
  assert "none of its 2 finished trials has one" in message
  assert f"attn sweep configs/fake.toml --out {root} --set train.steps=3" in message
  assert f"remove {os.path.join(root, 'trials')}" in message


def test_unfinished_trials_ask_for_the_sweep(tmp_path):
  root = str(tmp_path / "s")
  _fake_sweep(root, ["aaa111"], finished=False)
  with pytest.raises(ConfigError, match="none of its 1 has finished; run attn sweep configs/fake.toml"):
    analyze.analyze_sweep(root)


def test_batches_must_be_positive(tmp_path):
  with pytest.raises(ConfigError, match="--batches=0"):
    analyze.analyze_sweep(str(tmp_path), batches=0)


def test_analysis_table_turns_analysis_on_without_changing_any_trial(tmp_path):
  (tmp_path / "a.toml").write_text(TINY)
  (tmp_path / "b.toml").write_text(TINY + "\n[analysis]\nenabled = true\n")
  plain, on = config_lib.load(str(tmp_path / "a.toml")), config_lib.load(str(tmp_path / "b.toml"))
  assert (plain.analyze, on.analyze) == (False, True)
  assert on.id == plain.id and [t.id for t in on.trials] == [t.id for t in plain.trials]
  assert config_lib.load(str(tmp_path / "a.toml"), ["analysis.enabled=true"]).analyze


@pytest.mark.parametrize("table, words", [
    ("[analysis]\nenabled = 1\n", "analysis.enabled=1 is not allowed: true or false"),
    ("[analysis]\nbatches = 2\n", "analysis.batches=2 is not allowed: one of ['enabled']"),
])
def test_analysis_table_is_validated(tmp_path, table, words):
  (tmp_path / "c.toml").write_text(TINY + "\n" + table)
  with pytest.raises(ConfigError, match=re.escape(words)):
    config_lib.load(str(tmp_path / "c.toml"))


def test_residual_stream_is_each_blocks_output_and_its_stats_skip_padding():
  import jax.numpy as jnp
  from flax import nnx
  from attn.experiments.reading.analyze import _residual_stats
  from attn.nn import models
  from attn.nn.config import ModelConfig
  # The next test's model without its key/value sharing: the initialisers of its shapes compile once for both.
  cfg = ModelConfig(vocab_size=11, d_model=12, num_layers=3, num_heads=3, num_kv_heads=1, d_k=5, d_v=4, d_ff=16,
                    variant="per_head")
  model = models.DecoderLM(cfg, rngs=nnx.Rngs(1))
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 11, (2, 9)), jnp.int32)

  @nnx.jit  # one compile, not op by op; the recording works under jit (at trace time)
  def run(model, tokens):
    with models.record_residuals() as seen:
      model(tokens)
    h, chain = model.embed(tokens), []
    for block in model.blocks:
      h = block(h, is_causal=True)
      chain.append(h)
    return list(seen), chain

  seen, chain = run(model, tokens)
  assert len(seen) == 3
  for got, h in zip(seen, chain):
    np.testing.assert_allclose(np.asarray(got), np.asarray(h), rtol=1e-6, atol=1e-6)
  real = np.arange(9)[None, :] < np.array([[9], [4]])  # example 1 is padded past 4 tokens
  h_np = np.asarray(h).copy()
  h_np[1, 4:] = 1e6  # padding must not count
  stats = jax.jit(_residual_stats)(jnp.asarray(h_np), jnp.asarray(real))
  kept = np.abs(h_np[real])
  np.testing.assert_allclose(float(stats["residual_max"]), kept.max(), rtol=1e-6)
  np.testing.assert_allclose(float(stats["residual_median"]), np.median(kept), rtol=1e-6)


def test_a_layer_sharing_keys_and_values_reads_its_sources_key_side_in_its_circuits():
  """kv_source: layer 2 holds no w_k/w_v; its W_QK is its own W_Q against layer 1's W_K (numpy SVD)."""
  from flax import nnx
  from attn.nn import DecoderLM
  from attn.nn.config import ModelConfig
  cfg = ModelConfig(vocab_size=11, d_model=12, num_layers=3, num_heads=3, num_kv_heads=1, d_k=5, d_v=4,
                    d_ff=16, variant="per_head", kv_source=[0, 1, 1])
  blocks = analyze._blocks(DecoderLM(cfg, rngs=nnx.Rngs(3)))
  assert "w_k" not in blocks[2].attn.params_dict()
  got = jax.device_get(analyze._spectra_fn(blocks[2].attn.variant, blocks[2].attn.cfg)(
      analyze._circuit_params(cfg, blocks, 2)))
  w_q = np.asarray(blocks[2].attn.params_dict()["w_q"])   # (D, H, K)
  w_k = np.asarray(blocks[1].attn.params_dict()["w_k"])   # (D, G, K)
  for h in range(3):
    s = np.linalg.svd(w_q[:, h] @ w_k[:, 0].T, compute_uv=False)[:5]
    np.testing.assert_allclose(np.asarray(got["qk"]["singular_values"][h])[:5], s, rtol=1e-4, atol=1e-6)
