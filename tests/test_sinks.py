"""Attention sinks: the bigram_backcopy task, the text task's [BOS], and the sink metrics against numpy."""

import jax
import numpy as np
import pytest

from attn.config import ConfigError
from attn.experiments.data import backcopy
from attn.experiments.data import tasks
from attn.experiments.running import config as config_lib

BB = {"name": "bigram_backcopy", "vocab_size": 11, "seq_len": 23, "num_triggers": 2}


def test_bigram_backcopy_follows_its_rules():
  task = tasks.make_task(BB)
  b = task.batch(3, tasks.TRAIN, 5, 64)
  seq = np.concatenate([b["tokens"], b["targets"][:, -1:]], axis=1)
  assert (seq[:, 0] == backcopy.BOS).all() and (seq[:, 1:] != backcopy.BOS).all()
  trig = (seq >= 1) & (seq <= 2)
  assert not trig[:, 1].any() and not (trig[:, 1:] & trig[:, :-1]).any()  # no two triggers in a row
  t_rows, t_cols = np.nonzero(trig[:, 2:-1])
  assert t_rows.size > 20  # triggers occur, and each is followed by the token before it
  np.testing.assert_array_equal(seq[t_rows, t_cols + 3], seq[t_rows, t_cols + 1])
  P = task.transition
  np.testing.assert_allclose(P[1:].sum(1), 1.0, rtol=1e-12)
  prev, nxt = seq[:, 1:-1][~trig[:, 1:-1]], seq[:, 2:][~trig[:, 1:-1]]
  assert (P[prev, nxt] > 0).all()  # every bigram step is one the chain allows
  assert b["weights"].shape == (64, 23) and (b["weights"] == 1).all()
  np.testing.assert_array_equal(task.trigger_mask(b["tokens"]), trig[:, :-1])
  same = task.batch(3, tasks.TRAIN, 5, 64)
  assert all(np.array_equal(b[k], same[k]) for k in b)
  assert not np.array_equal(b["tokens"], task.batch(4, tasks.TRAIN, 5, 64)["tokens"])
  # The chain depends on transition_seed only: another seed of the data, the same P.
  np.testing.assert_array_equal(P, tasks.make_task({**BB, "seq_len": 5}).transition)
  assert not np.array_equal(P, tasks.make_task({**BB, "transition_seed": 1}).transition)


def test_bigram_backcopy_draws_from_its_transition_matrix():
  task = tasks.make_task({**BB, "vocab_size": 5, "num_triggers": 1, "seq_len": 400, "concentration": 2.0})
  seq = task.batch(0, tasks.TRAIN, 0, 64)["tokens"]
  prev, nxt = seq[:, 1:-1].ravel(), seq[:, 2:].ravel()
  P = task.transition
  for x in range(2, 5):  # ordinary tokens: empirical next-token frequencies against P's row
    after = nxt[prev == x]
    freq = np.bincount(after, minlength=5) / after.size
    assert np.abs(freq - P[x]).max() < 4 / np.sqrt(after.size)


@pytest.mark.parametrize("change,field", [
    ({"num_triggers": 0}, "task.num_triggers"), ({"num_triggers": 10}, "task.num_triggers"),
    ({"seq_len": 2}, "task.seq_len"), ({"concentration": 0.0}, "task.concentration"),
    ({"vocab_size": 2}, "task.vocab_size")])
def test_bigram_backcopy_refuses_bad_parameters_by_name(change, field):
  toml = "\n".join(["[task]", *(f"{k} = {v!r}".replace("'", '"') for k, v in {**BB, **change}.items()),
                    "[model]", "d_model = 8", "num_layers = 1", "num_heads = 2", "d_ff = 8"])
  with pytest.raises(ConfigError, match=field):
    config_lib.loads(toml, "bb.toml")


def test_text_bos_puts_one_fixed_token_first_and_keeps_old_ids(tmp_path, monkeypatch):
  monkeypatch.setenv("ATTN_TEXT_CACHE", str(tmp_path / "cache"))
  (tmp_path / "c.txt").write_text("abcdefghij klmnop, qrstuv. " * 20)
  plain = tasks.make_task({"name": "text", "path": str(tmp_path / "c.txt"), "seq_len": 9})
  bos = tasks.make_task({"name": "text", "path": str(tmp_path / "c.txt"), "seq_len": 9, "bos": True})
  assert (plain.vocab_size, bos.vocab_size) == (256, 257)
  p, b = plain.batch(1, tasks.TRAIN, 2, 5), bos.batch(1, tasks.TRAIN, 2, 5)
  assert (b["tokens"][:, 0] == 256).all() and (b["tokens"][:, 1:] < 256).all()
  np.testing.assert_array_equal(b["targets"], p["tokens"])  # the same windows, one position later
  assert (b["weights"][:, 0] == 0).all() and (b["weights"][:, 1:] == 1).all() and (p["weights"] == 1).all()
  base = f'[task]\nname = "text"\npath = "{tmp_path / "c.txt"}"\nseq_len = 9\n' \
         '[model]\nd_model = 8\nnum_layers = 1\nnum_heads = 2\nd_ff = 8\n'
  ids = [config_lib.loads(base + extra, "t.toml").trials[0].id for extra in ("", "", "")]
  with_false = config_lib.loads(base.replace("seq_len = 9", "seq_len = 9\nbos = false"), "t.toml").trials[0].id
  with_true = config_lib.loads(base.replace("seq_len = 9", "seq_len = 9\nbos = true"), "t.toml").trials[0].id
  assert ids[0] == with_false != with_true
  with pytest.raises(ConfigError, match="task.bos"):
    config_lib.loads(base.replace("seq_len = 9", 'seq_len = 9\nbos = "yes"'), "t.toml")


@pytest.mark.parametrize("value", [0, 1, 1.5, -0.2, True, "0.3", float("nan")])
def test_sink_threshold_outside_open_unit_interval_is_refused_by_name(value):
  toml = "\n".join(["[task]", 'name = "bigram_backcopy"', "[model]", "d_model = 8", "num_layers = 1",
                    "num_heads = 2", "d_ff = 8", "[train]", "sink_metrics = true",
                    f"sink_threshold = {str(value).lower() if isinstance(value, bool) else repr(value)}"
                    .replace("nan", "nan").replace("'", '"')])
  with pytest.raises(ConfigError, match="train.sink_threshold"):
    config_lib.loads(toml, "s.toml")


def test_sink_metrics_refused_on_a_classifier():
  toml = "\n".join(["[task]", 'name = "marker_position"', "[model]", "d_model = 8", "num_layers = 1",
                    "num_heads = 2", "d_ff = 8", "[train]", "sink_metrics = true"])
  with pytest.raises(ConfigError, match="train.sink_metrics"):
    config_lib.loads(toml, "s.toml")


def _numpy_stats(w_BHTT, v_BTGV, h_BTD, threshold, window, trig_BT):
  """The sink statistics of one layer, by loops and numpy."""
  B, H, T, _ = w_BHTT.shape
  rows = [t for t in range(1, T) if window is None or t < window]
  first = np.array([np.mean([w_BHTT[b, h, t, 0] for b in range(B) for t in rows]) for h in range(H)])
  def on(domain):
    picked = [(b, t) for b in range(B) for t in rows if trig_BT[b, t] == domain]
    return np.array([np.mean([w_BHTT[b, h, t, 0] for b, t in picked]) for h in range(H)])
  vn = np.sqrt((v_BTGV.astype(np.float64) ** 2).sum(-1))
  hn = np.sqrt((h_BTD.astype(np.float64) ** 2).sum(-1))
  a = np.abs(h_BTD)
  trig, other = on(True), on(False)
  return {"first_mass": first, "sink_heads": np.mean(first > threshold),
          "value_drain": vn[:, 0].mean(0) / np.median(vn.reshape(B * T, -1), axis=0),
          "residual_first": hn[:, 0].mean() / np.median(hn), "residual_massive": a.max() / np.median(a),
          "first_mass_trigger": trig, "first_mass_other": other,
          "active_dormant": np.mean((other > threshold) & (trig <= threshold))}


@pytest.mark.parametrize("window", [None, 3])
def test_layer_stats_match_numpy_on_random_arrays(window):
  from attn.analysis import sinks
  rng = np.random.default_rng(11)
  B, H, T, G, V, D = 4, 3, 7, 2, 5, 6
  logits = rng.normal(size=(B, H, T, T)) * 2
  t, s = np.arange(T)[:, None], np.arange(T)[None, :]
  logits = np.where((s <= t) & ((window is None) | (t - s < (window or T))), logits, -np.inf)
  w = np.exp(logits - logits.max(-1, keepdims=True))
  w = (w / w.sum(-1, keepdims=True)).astype(np.float32)
  v, h = rng.normal(size=(B, T, G, V)).astype(np.float32), rng.normal(size=(B, T, D)).astype(np.float32)
  h[:, 0] *= 9.0  # a first-token peak
  trig = rng.random((B, T)) < 0.4
  got = jax.jit(sinks.layer_stats, static_argnums=(3, 4))(w, v, h, 0.2, window, trig)  # one program, not op by op
  want = _numpy_stats(w, v, h, 0.2, window, trig)
  assert set(got) == set(want)
  for key in want:
    np.testing.assert_allclose(np.asarray(got[key]), want[key], rtol=2e-5, err_msg=key)


@pytest.mark.slow
def test_sink_metrics_match_numpy_on_a_fresh_random_model():
  import jax
  from flax import nnx
  from attn.experiments.training import sink_eval
  from attn.nn import models
  from attn.nn.config import ModelConfig
  # d_v != d_k, 3 heads not dividing d_model = 7, one kv head for three query heads, a window on layer 0.
  cfg = ModelConfig(vocab_size=11, d_model=7, num_layers=2, num_heads=3, num_kv_heads=1, d_k=4, d_v=5,
                           d_ff=9, variant="per_head", max_len=12, window=4, global_every=2, use_bias=True,
                           embed_init_std=1.0)
  graphdef, state = nnx.split(models.DecoderLM(cfg, rngs=nnx.Rngs(7)))
  task = tasks.make_task({**BB, "seq_len": 10})
  tokens = task.batch(0, tasks.EVAL, 0, 6)["tokens"]
  threshold = 0.15

  @jax.jit
  def run(state, tokens):  # one compiled program: the metrics, and the model's own pieces numpy reads
    model = nnx.merge(graphdef, state)
    got = sink_eval.model_stats(model, tokens, threshold, task.trigger_mask)
    with models.record_residuals() as residuals:
      _, weights = model(tokens, return_weights=True)
    inputs = [model.embed(tokens)] + residuals[:-1]
    normed = [block.attn_norm(x) for block, x in zip(model.blocks, inputs)]
    return got, weights, residuals, normed, [block.attn.params_dict() for block in model.blocks]

  got, weights, residuals, normed, params = jax.device_get(run(state, tokens))
  trig = task.trigger_mask(tokens)
  assert trig[:, 1:].any() and (~trig[:, 1:]).any()
  for l, (n, p) in enumerate(zip(normed, params)):
    v_BTGV = np.einsum("btd,dgv->btgv", n, p["w_v"]) + p["b_v"]
    want = _numpy_stats(np.asarray(weights[l]), v_BTGV, np.asarray(residuals[l]), threshold,
                        4 if l == 0 else None, trig)
    assert set(got[l]) == set(want)
    for key in want:
      np.testing.assert_allclose(got[l][key], want[key], rtol=2e-5, atol=1e-6, err_msg=f"layer {l} {key}")
  rows = jax.device_get(sink_eval.row_metrics(got))
  assert rows["first_mass_l1h2"] == got[1]["first_mass"][2] and rows["value_drain_l0g0"] == got[0]["value_drain"][0]
  np.testing.assert_allclose(rows["sink_heads"], np.mean([got[l]["first_mass"] > threshold for l in (0, 1)]))
  np.testing.assert_allclose(rows["first_mass"], np.mean([got[l]["first_mass"] for l in (0, 1)]), rtol=1e-6)
  assert rows["residual_massive"] == max(got[0]["residual_massive"], got[1]["residual_massive"])


@pytest.mark.slow
def test_training_rows_carry_the_sink_metrics_and_trigger_loss():
  from attn.experiments.training import train
  cfg = config_lib.resolve({"task": {**BB, "seq_len": 8},
                            "model": {"d_model": 8, "num_layers": 2, "num_heads": 3, "num_kv_heads": 1, "d_k": 4,
                                      "d_v": 3, "d_ff": 8},
                            "train": {"steps": 2, "batch_size": 4, "eval_batches": 2, "sink_metrics": True}},
                           [], None)
  rows = []
  (summary,) = train.train_group([cfg], lambda i, r: rows.append(r))
  assert summary["status"] == "ok"
  last = rows[-1]
  for key in ("eval_trigger_loss", "eval_trigger_accuracy", "first_mass", "sink_heads", "value_drain",
              "residual_first", "residual_massive", "active_dormant", "first_mass_l1h2", "value_drain_l1g0",
              "first_mass_trigger_l0h0", "sink_heads_l0"):
    assert np.isfinite(last[key]), key
  assert "first_mass" not in rows[0]  # only at evaluations
  assert 0 < last["first_mass"] < 1 and last["eval_trigger_loss"] != last["eval_loss"]
