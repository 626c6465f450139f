"""`attn demo` and the CLI front door, run as a user would."""

import subprocess
import sys

import pytest

from attn import HeadConfig, cli, demo
from attn.conversion import CONVERTERS, REGROUPERS, Converter


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [
    HeadConfig(d_model=24, num_heads=4),
    HeadConfig(d_model=20, num_heads=6, d_k=4, d_v=3, num_kv_heads=2),
])
def test_identities_hold_and_one_head_differs(cfg):
  rows = demo.identities(cfg)
  assert len(rows) >= 5
  for claim, err, reported in rows:
    if "lossy" in claim:
      assert err > 1e-2 and reported > 1e-2, claim
    else:
      assert err < 1e-5 and reported < 1e-5, claim
  assert demo.one_head_vs_many(cfg) > 1e-2


def test_identities_come_from_the_converter_registry(monkeypatch):
  """Every registered conversion that applies is a row, a new one included; no list in demo.py."""
  paths = []
  monkeypatch.setattr(demo, "max_error", lambda path, cfg, inputs, dst_cfg=None: (
      paths.append((tuple(path), cfg.num_kv_heads, (dst_cfg or cfg).num_kv_heads)) or (0.0, 0.0)))
  monkeypatch.setitem(CONVERTERS, ("fused", "merged"),
                      Converter(lambda p, cfg: (p, 0.0), exact=True, name="fused -> merged"))
  cfg = HeadConfig(d_model=24, num_heads=4, num_kv_heads=2)
  claims = [claim for claim, _, _ in demo.identities(cfg)]
  for c in list(CONVERTERS.values()) + list(REGROUPERS.values()):
    assert any(claim.startswith(c.name + " (") for claim in claims), c.name
  assert (("fused", "merged"), 2, 2) in paths
  assert (("per_head", "merged", "per_head"), 2, 2) in paths  # the lossy SVD's round trip
  assert (("per_head", "per_head"), 1, 2) in paths and (("per_head", "per_head"), 2, 1) in paths
  # A converter whose check refuses cfg is left out (collaborative needs D̃ = H·d_k).
  claims = [claim for claim, _, _ in demo.identities(cfg.replace(collab_width=5))]
  assert not any(claim.startswith("per_head -> collaborative") for claim in claims)


@pytest.mark.slow  # > 10 s: the fast tier stays under 4 minutes
def test_demo_command_prints_every_variant(capsys):
  assert cli.main(["demo", "--d-model", "32", "--num-heads", "4"]) == 0
  out = capsys.readouterr().out
  for name in demo.attn.VARIANTS:
    assert f"| {name} |" in out
  assert "Q5: 4 heads" in out


def test_bad_flags_are_refused_with_a_clear_message(capsys):
  assert cli.main(["demo", "--num-heads", "0"]) == 2  # in process: the command's own path to the message
  err = capsys.readouterr().err
  assert "num_heads=0 is not allowed" in err and "Traceback" not in err


@pytest.mark.slow  # a second interpreter (and its restart with mimalloc): fast sibling just above
def test_bad_flags_exit_with_a_clear_message():
  r = subprocess.run([sys.executable, "-m", "attn", "demo", "--num-heads", "0"],
                     capture_output=True, text=True)
  assert r.returncode == 2
  assert "num_heads=0 is not allowed" in r.stderr and "Traceback" not in r.stderr


def test_an_unknown_command_exits_with_argparse_s_message(capsys):
  with pytest.raises(SystemExit) as e:  # in process: a second interpreter would import JAX again
    cli.main(["nonsense"])
  assert e.value.code == 2 and "invalid choice" in capsys.readouterr().err
