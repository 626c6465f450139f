"""Sweeping a head mechanism's option: model.extra.NAME.OPTION as a grid key, in cases and in --set.

The mechanism is registered in this process (attn.register): the sweep runs in-process, so the
store, the report and the reading code see it. tests/test_plugins.py covers the installed-package
path (entry points, worker processes).
"""

import json
import os
import re

import pytest

import attn
from attn import ConfigError, Mechanism
from attn.experiments.reading import analyze, report
from attn.experiments.running import config as config_lib
from attn.experiments.running import sweep, tb_writer
from attn.variants.mechanisms import MECHANISMS
from conftest import TINY_MQAR, logit_scale_check as _check, logit_scale_logits as _scale

BASE = TINY_MQAR + "[train]\nsteps = 2\nbatch_size = 2\neval_every = 2\neval_batches = 1\n[sweep]\nseeds = [0]\n"
GRID = BASE + '[sweep.grid]\n"model.extra.logit_scale.factor" = [1.0, 3.0]\n'
CASES = BASE + ('[[sweep.cases]]\nname = "soft"\nmodel.extra.logit_scale.factor = 0.5\n'
                '[[sweep.cases]]\nname = "sharp"\nmodel.extra.logit_scale.factor = 4.0\n')


@pytest.fixture
def logit_scale():
  """docs/extending.md's logit_scale, registered in this process for one test."""
  attn.register(Mechanism(name="logit_scale", defaults={"factor": 2.0}, check=_check, on_logits=_scale))
  try:
    yield
  finally:
    MECHANISMS.unregister("logit_scale")


def test_a_grid_key_cases_and_set_reach_one_option(logit_scale):
  grid = config_lib.loads(GRID, "g")
  assert [t.config["model"]["extra"] for t in grid.trials] == [
      {"logit_scale": {"factor": 1.0}}, {"logit_scale": {"factor": 3.0}}]
  assert grid.axes == ["model.extra.logit_scale.factor", "train.seed"]
  cases = config_lib.loads(CASES, "c")
  assert [(t.label["case"], t.config["model"]["extra"]["logit_scale"]["factor"]) for t in cases.trials] == [
      ("soft", 0.5), ("sharp", 4.0)]
  pinned = config_lib.loads(GRID, "g", ["model.extra.logit_scale.factor=5.0"])
  assert [t.config["model"]["extra"] for t in pinned.trials] == [{"logit_scale": {"factor": 5.0}}]
  whole = config_lib.loads(BASE, "b", ["model.extra.logit_scale={factor=5.0}"])
  assert pinned.trials[0].id == whole.trials[0].id  # one config, however it was written
  assert config_lib.axis_name("model.extra.logit_scale.factor") == "logit_scale.factor"
  assert config_lib.show({"logit_scale": {"factor": 1.0}}) == "{logit_scale={factor=1.0}}"


@pytest.mark.parametrize("text, overrides, words", [
    (BASE, ["model.extra.nope.factor=2.0"], r"model.extra.nope.factor=2.0 is not allowed: .*no mechanism 'nope' "
                                            r"is installed"),
    (BASE, ["model.extra.logit_scale.bogus=2.0"], r"model.extra.logit_scale.bogus=2.0 is not allowed: an option "
                                                  r"mechanism 'logit_scale' declares: .*\['factor'\]"),
    (BASE.replace("seeds = [0]", '"model.extra.nope.factor" = [1.0]').replace("[sweep]", "[sweep.grid]"), [],
     r"sweep.grid.model.extra.nope.factor=1.0 is not allowed: .*no mechanism 'nope'"),
    (BASE + '[sweep.grid]\n"model.extra.logit_scale.factor" = [1.0, {a = 1}]\n', [],
     r"sweep.grid.model.extra.logit_scale.factor=\[1.0, \{'a': 1\}\] is not allowed: values of one kind for "
     r"option 'factor' of mechanism 'logit_scale': all tables or none"),
    (BASE + '[sweep.grid]\n"model.extra" = [{nope = {}}]\n', [], r"sweep.grid.model.extra.nope=\{\} .*'nope'"),
    (CASES.replace("factor = 0.5", "bogus = 0.5"), [], r"sweep.cases\[0\].model.extra.logit_scale.bogus=0.5 is "
                                                       r"not allowed: an option mechanism 'logit_scale' declares"),
    (GRID + '"model.extra" = [{logit_scale = {factor = 1.0}}]\n', [],
     r"a key that no other axis reaches into or above \(model.extra.logit_scale.factor is one\)"),
    (GRID, ["model.extra={}"], r"a key that no sweep axis reaches into or above"),
    (BASE, ["model.extra.logit_scale.factor=-1.0"],
     r"trial \[seed=0\]: model.extra.logit_scale.factor=-1.0 is not allowed: a positive"),
])
def test_bad_options_are_refused_by_name_before_any_trial(logit_scale, text, overrides, words):
  with pytest.raises(ConfigError, match=words):
    config_lib.loads(text, "p", overrides)


def test_an_option_of_a_mechanism_not_installed_is_refused_without_it():
  assert "logit_scale" not in MECHANISMS
  with pytest.raises(ConfigError, match=r"no mechanism 'logit_scale' is installed"):
    config_lib.loads(GRID, "g")


@pytest.mark.slow  # three sweeps of two trials, their reports and one analysis: about 45 s of CPU
def test_the_sweep_report_analysis_and_run_names_of_a_swept_option(logit_scale, tmp_path):
  os.environ.setdefault("ATTN_JAX_CACHE", str(tmp_path / "jax_cache"))
  whole = BASE + '[sweep.grid]\n"model.extra" = [{logit_scale = {factor = 1.0}}, {logit_scale = {factor = 3.0}}]\n'
  for name, text in (("grid", GRID), ("cases", CASES), ("whole", whole)):
    out = str(tmp_path / name)
    sw = config_lib.loads(text, name)
    assert sweep.run_sweep(sw, out, config_text=text)["ok"] == 2
    md = open(report.write_report(out)).read()
    if name == "grid":
      assert "logit_scale.factor=1.0" in md and "logit_scale.factor=3.0" in md
      assert re.search(r"\*\*logit_scale.factor\*\*", md)  # the measured answer names the option
    if name == "whole":
      assert "extra={logit_scale={factor=3.0}}" in md
    pytest.importorskip("matplotlib")
    for png in re.findall(r"\]\(([\w.]+\.png)\)", md):
      assert os.path.getsize(os.path.join(out, png)) > 1000, png
  analyze.analyze_sweep(str(tmp_path / "grid"), plots=False)
  header = json.load(open(tmp_path / "grid" / "sweep.json"))
  assert [tb_writer.run_name(t["id"], t["label"]).split("-")[0] for t in header["trials"]] == [
      "logit_scale.factor=1.0,seed=0", "logit_scale.factor=3.0,seed=0"]
  for t in header["trials"]:
    assert os.path.exists(tmp_path / "grid" / "trials" / t["id"] / "analysis.json")
