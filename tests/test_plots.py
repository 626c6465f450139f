"""The report's plots stand alone: a caption naming task, steps and what is fixed; categories drawn as
categories; MQAR's chance level; a write-up's final plots redrawn from its trials.json."""

import os

import numpy as np
import pytest

from attn.experiments.data import tasks
from attn.experiments.reading import plots, reproduce

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICK = os.path.join(ROOT, "experiments", "quick")
MQAR = {"name": "mqar", "vocab_size": 64, "seq_len": 32, "num_pairs": 8}


def _trial(h, variant, seed, acc):
  model = {"d_model": 64, "num_layers": 2, "num_heads": h, "d_k": 64 // h, "d_v": 64 // h, "d_ff": 128,
           "num_kv_heads": None, "variant": variant}
  return {"label": {"model.num_heads": h, "model.variant": variant, "train.seed": seed},
          "config": {"task": MQAR, "model": model, "train": {"steps": 250, "seed": seed}},
          "summary": {"status": "ok", "final": {"eval_accuracy": acc, "eval_loss": 1.0}}, "rows": []}


def test_the_caption_names_task_steps_seeds_and_what_is_held_fixed():
  trials = [_trial(h, v, s, 0.5) for h in (1, 4) for v in ("per_head", "merged") for s in (0, 1)]
  assert plots.caption(trials, ["model.num_heads", "model.variant", "train.seed"]) == (
      "MQAR (vocab_size=64, seq_len=32, num_pairs=8), 250 steps, 2 seeds; held fixed: d_model=64, "
      "num_layers=2, d_ff=128; d_k = d_v = d_model/h (64, 16)")


def test_mqar_chance_is_guessing_one_of_the_listed_values():
  task = tasks.make_task(MQAR)
  assert task.chance == pytest.approx((1 + 7 / 32) / 8)  # 8 pairs, values from 32 tokens, drawn with repeats
  batch = task.batch(0, tasks.EVAL, 0, 2000)  # guess among the listed values, by simulation
  listed_BN = batch["tokens"][:, 1:16:2]
  rng = np.random.default_rng(1)
  rows, cols = np.nonzero(batch["weights"])
  guess = listed_BN[rows, rng.integers(0, 8, len(rows))]
  hit = guess == batch["targets"][rows, cols]
  assert abs(hit.mean() - task.chance) < 3 * hit.std() / np.sqrt(len(hit))
  assert getattr(tasks.make_task({"name": "induction"}), "chance", None) is None  # no chance line there


def _drawn(monkeypatch, values):
  """The axes final_vs_axis draws for one group per value (three seeds each), with MQAR's chance."""
  plt = pytest.importorskip("matplotlib.pyplot")
  figures = []
  monkeypatch.setattr(plt, "close", figures.append)
  rows = [{"label": {"model.num_heads": v}, "eval_accuracy": (0.3, 0.1), "eval_loss": (1.1, 0.1),
           "seed_values": {"eval_accuracy": [0.2, 0.3, 0.4], "eval_loss": [1.0, 1.1, 1.2]}} for v in values]
  plots.final_vs_axis(plt, rows, "model.num_heads", [], os.devnull, ["model.num_heads"],
                      note="MQAR, 250 steps", guess=(0.152, "guessed"))
  return figures[0]


def test_two_values_are_categories_and_three_a_trend(monkeypatch):
  two = _drawn(monkeypatch, [1, 4]).axes[0]
  assert all(line.get_linestyle() in ("None", ":") for line in two.get_lines())  # bars and dots, no joins
  chance = [line for line in two.get_lines() if line.get_linestyle() == ":"]
  assert len(chance) == 1 and list(chance[0].get_ydata()) == [0.152, 0.152]
  three = _drawn(monkeypatch, [1, 2, 4]).axes[0]
  assert any(line.get_linestyle() == "-" for line in three.get_lines())
  assert "MQAR, 250 steps" in [t.get_text() for t in _drawn(monkeypatch, [1, 4]).texts]


def test_a_writeups_final_plots_are_redrawn_from_its_trials_json(tmp_path):
  pytest.importorskip("matplotlib")
  made = reproduce.replot(reproduce.load_writeup(QUICK), str(tmp_path))
  assert made == ["final_vs_num_heads.png", "final_vs_variant.png"]  # no rows: no learning curves
  assert all(os.path.getsize(tmp_path / name) > 10_000 for name in made)


def test_a_checkpoint_is_named_by_family_and_path_and_a_dash_says_why():
  from attn.experiments.reading import analysis_plots, analyze
  a = {"hf": "/ckpt/tiny-llama", "family": "llama", "variant": "per_head", "num_heads": 4, "d_k": 8, "d_v": 8,
       "text": "", "objective": "next_token"}
  title = analysis_plots._title(a)
  assert title.startswith("llama model from /ckpt/tiny-llama\n") and "pretrained" not in title
  assert analysis_plots._title({**a, "family": None}).startswith("Hugging Face checkpoint from /ckpt/tiny-llama")
  refused = {"summary": {"qk_effective_rank": None}, "layers": [{"qk": {"refused": "tpa has no per-head W_QK"}}]}
  assert analyze._qk_rank(refused) == "– (tpa has no per-head W_QK)"
  assert analyze._qk_rank({"summary": {"qk_effective_rank": 3.456}}) == "3.46"
  assert analyze._diversity({"head_diversity": None, "attention_entropy": 1.2}) == "– (one head: no pair)"
  assert analyze._diversity({"head_diversity": None, "attention_entropy": None}) == "– (rows are not distributions)"


def test_learning_curves_past_the_panel_limit_say_how_many_are_shown(monkeypatch):
  plt = pytest.importorskip("matplotlib.pyplot")
  figures = []
  monkeypatch.setattr(plt, "close", figures.append)
  # Not rendered: the panels and texts are set before the save (the report's test checks a saved png).
  from matplotlib.figure import Figure
  monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: None)
  rows = [{"step": 9, "eval_accuracy": 0.5, "eval_loss": 1.0}]
  trials = [{**_trial(h, f"v{i}", 0, 0.5), "rows": rows} for i in range(plots.MAX_PANELS + 3) for h in (1, 4)]
  axes = ["model.num_heads", "model.variant", "train.seed"]  # the legend: num_heads; a panel per variant
  plots.learning_curves(plt, trials, axes, os.devnull, note="MQAR, 250 steps")
  texts = [t.get_text().replace("\n", " ") for t in figures[0].texts]
  assert len([a for a in figures[0].axes if a.get_title()]) == plots.MAX_PANELS
  assert any(f"the first {plots.MAX_PANELS} of {plots.MAX_PANELS + 3} panels; MQAR, 250 steps" in t for t in texts), texts
  figures.clear()
  plots.learning_curves(plt, trials[:2 * plots.MAX_PANELS], axes, os.devnull, note="MQAR, 250 steps")
  assert not any("panels" in t.get_text() for t in figures[0].texts)
