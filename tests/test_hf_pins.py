"""CI's Hugging Face pins (constraints-hf.txt, the known-good release; constraints-hf-floor.txt, the floor)
against pyproject.toml's hf extra: the floor file pins every lower bound the extra declares, the newest file
pins a release inside it, and .ci/run installs with both. Reads files only: no transformers needed."""

import os
import re
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pins(name: str) -> dict[str, str]:
  with open(os.path.join(ROOT, name)) as f:
    lines = [line.split("#")[0].strip() for line in f]
  return dict(line.split("==") for line in lines if line)


def version(v: str) -> tuple[int, ...]:
  """0.21 and 0.21.0 alike."""
  parts = [int(p) for p in v.split(".")]
  while parts and parts[-1] == 0:
    parts.pop()
  return tuple(parts)


def floors() -> dict[str, str]:
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    hf = tomllib.load(f)["project"]["optional-dependencies"]["hf"]
  return dict(d.split(">=") for d in hf)


def test_the_floor_file_pins_the_hf_extras_lower_bounds():
  floor = pins("constraints-hf-floor.txt")
  for name, low in floors().items():
    assert version(floor[name]) == version(low), (name, floor[name], low)


def test_the_newest_pin_is_inside_the_hf_extra_and_above_the_floor():
  newest, floor = pins("constraints-hf.txt"), pins("constraints-hf-floor.txt")
  for name, low in floors().items():
    assert version(newest[name]) >= version(low), (name, newest[name], low)
  assert version(newest["transformers"]) > version(floor["transformers"])
  assert set(floor) <= set(newest)  # what the floor pins, the newest end pins too


def test_ci_installs_the_hf_tiers_with_both_files():
  with open(os.path.join(ROOT, ".ci", "run")) as f:
    run = f.read()
  assert re.search(r'pip install .*"\.\[[^\]]*\bhf\b[^\]]*\]" -c constraints-hf\.txt', run)
  assert re.search(r'pip install .*"\.\[hf,pretrained\]" -c constraints-hf-floor\.txt', run)
