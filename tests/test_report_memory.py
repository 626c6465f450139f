"""A report shows what each group trained and what it holds: on every task each group's KV cache per
token, fixed state per sequence and their total at T (float32, said once); a case's settings, derived
values included, in the group table and on the plots; "held fixed" only what the config chose."""

import dataclasses
import json
import os

import pytest

from attn.experiments.reading import plots, report
from attn.experiments.running import store as store_lib
from attn.nn.config import ModelConfig

HYBRID = ["linear_attention"] * 3 + ["full_attention"]
CONFIG_TEXT = """[task]
name = "text"
seq_len = 128
[model]
d_model = 64
num_layers = 4
num_heads = 4
d_ff = 64
[sweep]
derive = ["fixed_params"]
[[sweep.cases]]
name = "GQA"
model.num_kv_heads = 2
[[sweep.cases]]
name = "hybrid"
model.layer_types = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
"""


def _store(root, task="text", bpb=(2.9, 2.6)):
  """A finished two-case sweep written by hand: GQA (d_ff 101) and a 3:1 hybrid (d_ff 71), two seeds each."""
  models = {"GQA": ModelConfig(vocab_size=256, d_model=64, num_layers=4, num_heads=4, d_k=16, d_v=16,
                               num_kv_heads=2, d_ff=101, variant="fused"),
            "hybrid": ModelConfig(vocab_size=256, d_model=64, num_layers=4, num_heads=4, d_k=16, d_v=16,
                                  d_ff=71, variant="fused", layer_types=tuple(HYBRID))}
  trials = []
  for (case, m), b in zip(models.items(), bpb):
    for seed in (0, 1):
      label = {"case": case, "train.seed": seed}
      tid = f"{case[:3].lower()}{seed}".ljust(12, "0")
      d = os.path.join(root, "trials", tid)
      os.makedirs(d)
      loss = (b + 0.01 * seed) * report.LN2
      options = {"path": "", "glob": "", "bos": False} if task == "text" else {}
      cfg = {"task": {"name": task, "seq_len": 128, **options}, "model": dataclasses.asdict(m),
             "train": {"steps": 10, "seed": seed}, "label": label}
      store_lib.write_json(os.path.join(d, "config.json"), cfg)
      store_lib.write_json(os.path.join(d, "summary.json"), {
          "status": "ok", "steps_done": 1, "model_params": 119_000,
          "final": {"loss": loss, "eval_loss": loss, "eval_accuracy": 0.4}})
      with open(os.path.join(d, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"step": 0, "loss": loss, "eval_loss": loss, "eval_accuracy": 0.4}) + "\n")
      trials.append({"id": tid, "label": label})
  store_lib.write_json(os.path.join(root, "sweep.json"), {
      "sweep_id": "s" * 12, "name": "hybrid vs GQA", "question": "", "config_path": "c.toml",
      "config_text": CONFIG_TEXT, "overrides": [], "axes": ["case", "train.seed"], "trials": trials})
  return root


def test_a_text_report_counts_the_hybrids_linear_state_not_only_its_cache(tmp_path, monkeypatch):
  monkeypatch.setattr(plots, "_pyplot", lambda: None)  # the tables here; the plots below
  md = open(report.write_report(_store(str(tmp_path))), encoding="utf-8").read()
  # Each group's memory, on the text task too: KV B/token, state B/sequence, T and the total at T.
  memory = md.split("## Memory per group", 1)[1].split("\n## ", 1)[0]
  assert "float32" in memory
  gqa = 4 * 4 * 2 * 2 * 16  # 4 layers · float32 · (keys + values) · 2 kv heads · 16
  assert f"| case=GQA | {gqa:,} | 0 | 128 | {gqa * 128:,} |" in memory
  hybrid = [l for l in memory.splitlines() if l.startswith("| case=hybrid |")][0].split(" | ")
  kv, state, total = int(hybrid[1].replace(",", "")), int(hybrid[2].replace(",", "")), int(hybrid[4][:-2].replace(",", ""))
  assert kv == 4 * 2 * 4 * 16 and state > 0 and total == kv * 128 + state  # one full layer caches; three hold state
  # The quality table ranks what a group holds at T, state included, not the cache per token alone.
  quality = md.split("## Quality against state and KV cache", 1)[1].split("\n## ", 1)[0]
  assert "state B/sequence" in quality and f"{total:,}" in quality


def test_a_case_sweeps_group_table_says_what_each_case_trained(tmp_path, monkeypatch):
  monkeypatch.setattr(plots, "_pyplot", lambda: None)
  md = open(report.write_report(_store(str(tmp_path))), encoding="utf-8").read()
  groups = md.split("## Groups", 1)[1].split("\n## ", 1)[0]
  assert "| settings |" in groups
  gqa = [l for l in groups.splitlines() if l.startswith("| case=GQA |")][0]
  hybrid = [l for l in groups.splitlines() if l.startswith("| case=hybrid |")][0]
  assert "d_ff=101" in gqa and "num_kv_heads=2" in gqa and "linear_variant" not in gqa
  assert "d_ff=71" in hybrid and "layer_types=[linear_attention×3, full_attention]" in hybrid
  assert "linear_variant=gated_deltanet" in hybrid


def test_the_plot_caption_holds_fixed_only_what_the_config_chose_and_names_each_cases_settings(tmp_path, monkeypatch):
  pytest.importorskip("matplotlib")
  from matplotlib.figure import Figure
  monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: None)  # the captions only: nothing rendered
  notes = []
  real = plots._caption
  monkeypatch.setattr(plots, "_caption", lambda fig, text: (notes.append(text), real(fig, text)))
  report.write_report(_store(str(tmp_path)))
  assert notes and all("d_ff=101" in n and "d_ff=71" in n for n in notes)
  held = notes[0].split("held fixed: ", 1)[1].split(";", 1)[0]
  assert "d_model=64" in held and "num_layers=4" in held
  assert "variant=" not in held and "d_k=" not in held  # defaults and derived-by-nobody: not "held fixed"
  assert notes[0].startswith("text (seq_len=128)")  # the task's options the config set, not bos=False


def test_an_outside_mechanisms_option_swept_by_cases_shows_its_values():
  from attn.experiments.reading import settings
  base = {"task": {"name": "mqar"}, "model": {"d_model": 64, "extra": None}, "train": {"seed": 0}}
  configs = {"case=a": {**base, "model": {"d_model": 64, "extra": {"my_gate": {"width": 3}}}},
             "case=b": {**base, "model": {"d_model": 64, "extra": {"my_gate": {"width": 5}}}}}
  assert settings.differences(configs) == {"case=a": "extra.my_gate.width=3", "case=b": "extra.my_gate.width=5"}
  labelled = {g: {**c, "label": {"case": g}} for g, c in configs.items()}  # as a store's config.json holds it
  assert settings.differences(labelled) == settings.differences(configs)


def test_a_classifiers_report_says_why_it_shows_no_memory(tmp_path, monkeypatch):
  monkeypatch.setattr(plots, "_pyplot", lambda: None)
  root = _store(str(tmp_path), task="marker_position")
  md = open(report.write_report(root), encoding="utf-8").read()
  memory = md.split("## Memory per group", 1)[1].split("\n## ", 1)[0]
  assert "classifier" in memory and "keeps no cache" in memory


def test_two_seeds_a_side_are_never_a_clear_difference_however_many_standard_errors():
  text = report.verdict([0.90, 0.91], [0.10, 0.11])  # 113 standard errors, but 1 in 6 orders by chance
  assert "clear difference" not in text and "p = 0.17" in text and "more seeds" in text
  assert "a clear difference" in report.verdict([0.90, 0.91, 0.92], [0.10, 0.11, 0.12])  # p = 1/20


def test_small_report_wordings(tmp_path, monkeypatch):
  monkeypatch.setattr(plots, "_pyplot", lambda: None)
  one = {"group": "all", "n": 1, "eval_accuracy": (0.5, 0.0), "eval_loss": (1.0, 0.0), "label": {},
         "seed_values": {"eval_accuracy": [0.5], "eval_loss": [1.0]}}
  assert "1 seed)" in report.answer([one]) and "1 seeds" not in report.answer([one])
  unmeasured = {"id": "x", "label": {}, "summary": {"status": "ok", "final": {}, "attention_params_effective": None,
                                                    "attention_measured": ["effective"]}}
  assert "– (measured)" not in "\n".join(report._trial_table([unmeasured]))
  md = open(report.write_report(_store(str(tmp_path), task="marker_position")), encoding="utf-8").read()
  assert "– for a seed that never did" in md  # the dashes of 'step reaching 0.99' are explained


def test_a_sweep_without_axes_names_its_one_trial_without_empty_brackets():
  from attn.config import ConfigError
  from attn.experiments.running import config as config_lib
  text = ('[task]\nname = "induction"\n[model]\nd_model = 16\nnum_layers = 1\nnum_heads = 2\nd_ff = 16\n'
          '[train]\nsteps = 1\n')
  with pytest.raises(ConfigError, match="num_layers") as e:
    config_lib.loads(text, "c.toml")
  assert "[]" not in str(e.value)
