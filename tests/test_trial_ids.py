"""Shipped configs: trial ids are stable (each still names the trials its committed report lists), and every
config opens with a short header (question, command, runtime; the rest belongs in its write-up)."""

import os
import re

import pytest

from attn.experiments.running import config as config_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = sorted(n[:-5] for n in os.listdir(os.path.join(ROOT, "configs"))
                 if os.path.exists(os.path.join(ROOT, "experiments", n[:-5], "report.md")))


# The configs whose trials take a quarter of a second or more to resolve (parameter budgets fitted per
# trial, text tasks) run in the slow tier; every other shipped config is checked in the fast tier.
SLOW_TO_LOAD = ("attention_sinks_text", "kv_cache_frontier", "recall_vs_state", "selected_keys_text", "shared_kv",
                "text_dk_fixed_heads", "text_heads_fixed_width", "todays_mechanisms", "qk_control")


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow if n in SLOW_TO_LOAD else ())
                                  for n in SHIPPED])
def test_committed_report_lists_the_configs_trial_ids(name):
  with open(os.path.join(ROOT, "experiments", name, "report.md"), encoding="utf-8") as f:
    listed = set(re.findall(r"^\| ([0-9a-f]{12}) \|", f.read(), flags=re.M))
  sweep = config_lib.load(os.path.join(ROOT, "configs", name + ".toml"), [])
  assert listed and listed == {t.id for t in sweep.trials}


HEADER_LINES = 8  # the convention: question, command and runtime in at most 8 comment lines


def _header(text):
  """The leading comment block: the lines from the top that start with '#'."""
  lines = []
  for line in text.splitlines():
    if not line.startswith("#"):
      break
    lines.append(line)
  return lines


def test_the_header_counts_only_the_leading_comment_block():
  assert _header("# a\n# b\n\n# not the header\n[meta]\n") == ["# a", "# b"]
  assert _header("[meta]\n# a comment later\n") == []


@pytest.mark.parametrize("name", sorted(n for n in os.listdir(os.path.join(ROOT, "configs")) if n.endswith(".toml")))
def test_every_config_header_says_question_command_runtime_in_at_most_8_lines(name):
  with open(os.path.join(ROOT, "configs", name), encoding="utf-8") as f:
    header = _header(f.read())
  assert 0 < len(header) <= HEADER_LINES, f"{name}: {len(header)} header lines (at most {HEADER_LINES})"
  for label in ("# Question:", "# Command:", "# Runtime:"):
    assert any(line.startswith(label) for line in header), f"{name}: no {label!r} line"
