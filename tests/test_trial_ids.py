"""Trial ids are stable: each shipped config still names the trials its committed report lists."""

import os
import re

import pytest

from attn.experiments.running import config as config_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = sorted(n[:-5] for n in os.listdir(os.path.join(ROOT, "configs"))
                 if os.path.exists(os.path.join(ROOT, "experiments", n[:-5], "report.md")))


# The two configs whose trials take seconds to resolve (parameter budgets fitted per trial) run in the
# slow tier; every other shipped config is checked in the fast tier.
SLOW_TO_LOAD = ("kv_cache_frontier", "todays_mechanisms")


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow if n in SLOW_TO_LOAD else ())
                                  for n in SHIPPED])
def test_committed_report_lists_the_configs_trial_ids(name):
  with open(os.path.join(ROOT, "experiments", name, "report.md"), encoding="utf-8") as f:
    listed = set(re.findall(r"^\| ([0-9a-f]{12}) \|", f.read(), flags=re.M))
  sweep = config_lib.load(os.path.join(ROOT, "configs", name + ".toml"), [])
  assert listed and listed == {t.id for t in sweep.trials}
