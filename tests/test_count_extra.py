"""`attn count --extra`: an outside mechanism's options in the header, their refusal, its counts.

The mechanism (docs/extending.md's logit_scale) is registered in this process; attn.cli.main runs
in it too. tests/test_plugins.py runs `attn count` on the installed package in a subprocess.
"""

import json
import re

import pytest

import attn
import attn.cli
from attn import Mechanism
from attn.variants.mechanisms import MECHANISMS
from conftest import logit_scale_check as _check, logit_scale_logits as _scale


@pytest.fixture(params=["declared", "undeclared"])
def logit_scale(request):
  """logit_scale with effective_param_count=0 declared (a factor W_Q absorbs), and without it."""
  declared = {"effective_param_count": lambda cfg: 0} if request.param == "declared" else {}
  attn.register(Mechanism(name="logit_scale", defaults={"factor": 2.0}, check=_check, on_logits=_scale,
                          help="every logit times a factor", **declared))
  try:
    yield request.param
  finally:
    MECHANISMS.unregister("logit_scale")


def test_the_header_names_the_options_and_the_effective_count_stays_closed_form(logit_scale, capsys):
  assert attn.cli.main(["count", "--variant", "per_head", "--extra", "{logit_scale = {factor = 3.0}}"]) == 0
  out = capsys.readouterr().out
  head, _, rest = out.partition("\n\n")
  assert head.endswith("; mechanisms: logit_scale.factor=3.0.")
  row = next(line for line in rest.splitlines() if line.startswith("| per_head"))
  cells = [c.strip() for c in row.strip("|").split("|")]
  # per_head at d_model=512, h=8, d_k=d_v=64 with biases: 4·512·512 + 3·512 + 512 = 1,050,624 stored;
  # its effective count removes the key bias (H·d_k = 512, it drops out of the softmax), the value bias
  # (H·d_v = 512, rows summing to 1 carry it into b_o) and each head's GL(d_k) in W_Q·W_Kᵀ and GL(d_v)
  # in W_V·W_O (H·d_k² + H·d_v² = 2·8·64²).
  assert cells[1:3] == ["1,050,624", "1,050,624"]
  if logit_scale == "declared":
    assert cells[3] == f"{1_050_624 - 512 - 512 - 2 * 8 * 64 * 64:,}" and "declares no effective_param_count" not in out
  else:  # too large for the Jacobian: —, and a note saying what to declare
    assert cells[3] == "—"
    assert "mechanism 'logit_scale' declares no effective_param_count" in out
    assert "effective_param_count=lambda cfg: 0" in out


def test_json_carries_the_extra_options(logit_scale, capsys):
  assert attn.cli.main(["count", "--variant", "per_head", "--extra", "{logit_scale = {factor = 3.0}}",
                        "--format", "json"]) == 0
  assert json.loads(capsys.readouterr().out)["layer"]["extra"] == {"logit_scale": {"factor": 3.0}}


@pytest.mark.parametrize("extra, words", [
    ("{logit_scale = {factor = -1.0}}", "extra.logit_scale.factor=-1.0 is not allowed: a positive number"),
    ("{logit_scale = {bogus = 1}}", "extra.logit_scale.bogus=1 is not allowed: an option mechanism 'logit_scale' declares"),
    ("{nope = {}}", "extra.nope={} is not allowed"),
])
def test_a_bad_option_exits_2_with_one_line_naming_the_field(logit_scale, capsys, extra, words):
  assert attn.cli.main(["count", "--extra", extra]) == 2
  captured = capsys.readouterr()
  assert captured.out == ""  # no table of n/a rows
  lines = captured.err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("attn count: error: ") and words in lines[0]


def test_the_extra_flag_has_a_help_line(logit_scale, capsys):
  with pytest.raises(SystemExit):
    attn.cli.main(["count", "--help"])
  text = " ".join(capsys.readouterr().out.split())
  assert "--extra TABLE options of outside head mechanisms as a TOML inline table" in text
  # The built-in key selectors (moba, indexer) keep their options in extra too: listed beside it.
  assert re.search(r"\(installed: (\w+, )*logit_scale(, \w+)*\)", text), text
