"""Trial ids are stable: each shipped config still names the trials its committed report lists."""

import os
import re

import pytest

from attn.experiments.running import config as config_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = sorted(n[:-5] for n in os.listdir(os.path.join(ROOT, "configs"))
                 if os.path.exists(os.path.join(ROOT, "experiments", n[:-5], "report.md")))


@pytest.mark.parametrize("name", SHIPPED)
def test_committed_report_lists_the_configs_trial_ids(name):
  with open(os.path.join(ROOT, "experiments", name, "report.md"), encoding="utf-8") as f:
    listed = set(re.findall(r"^\| ([0-9a-f]{12}) \|", f.read(), flags=re.M))
  sweep = config_lib.load(os.path.join(ROOT, "configs", name + ".toml"), [])
  assert listed and listed == {t.id for t in sweep.trials}
