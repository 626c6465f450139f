"""`attn demo` and the CLI front door, run as a user would."""

import subprocess
import sys

import pytest

from attn import HeadConfig, cli, demo


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


def test_demo_command_prints_every_variant(capsys):
  assert cli.main(["demo", "--d-model", "32", "--num-heads", "4"]) == 0
  out = capsys.readouterr().out
  for name in demo.attn.VARIANTS:
    assert f"| {name} |" in out
  assert "Q5: 4 heads" in out


def test_bad_flags_exit_with_a_clear_message():
  r = subprocess.run([sys.executable, "-m", "attn", "demo", "--num-heads", "0"],
                     capture_output=True, text=True)
  assert r.returncode == 2
  assert "num_heads=0 is not allowed" in r.stderr and "Traceback" not in r.stderr
  r = subprocess.run([sys.executable, "-m", "attn", "nonsense"], capture_output=True, text=True)
  assert r.returncode == 2 and "invalid choice" in r.stderr
