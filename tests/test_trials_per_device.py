"""`attn sweep --trials-per-device K`: placement and memory shares per device, reduced or refused naming memory."""

import io
import types

import pytest

from attn.config import ConfigError
from attn.experiments import cli
from attn.experiments.running import sweep, workers


def gpu(i, gb, fraction=0.75):
  """A stand-in for jax's device: what per_device_plan reads (the limit of a process with that fraction)."""
  return types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H200", local_hardware_id=i,
                               memory_stats=lambda: {"bytes_limit": int(gb * 1e9 * fraction)})


def test_k_workers_per_gpu_each_on_one_gpu_with_its_share():
  stream = io.StringIO()
  k, placement, fraction = workers.per_device_plan(3, [gpu(0, 141), gpu(1, 141)], stream)
  assert k == 3 and sorted(placement) == ["0", "0", "0", "1", "1", "1"]
  assert fraction == "0.300" and stream.getvalue() == ""


def test_too_many_per_device_is_reduced_naming_the_memory():
  stream = io.StringIO()
  k, placement, fraction = workers.per_device_plan(8, [gpu(0, 6)], stream)
  assert k == 2 and placement == ["0", "0"] and fraction == "0.450"  # 0.9 · 6 GB / 2 GiB -> 2
  assert "reduced to 2" in stream.getvalue() and "6.0 GB" in stream.getvalue()


def test_on_cpu_it_is_k_workers():
  cpu = types.SimpleNamespace(platform="cpu")
  assert workers.per_device_plan(3, [cpu]) == (3, [None, None, None], None)


def test_a_trial_beyond_its_share_is_refused_naming_the_memory(monkeypatch):
  monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.300")
  monkeypatch.setattr(sweep, "device_memory",
                      lambda: (10**9, "NVIDIA H200's memory (this process's share, 0.300 of it)"))
  compiled = types.SimpleNamespace(memory_analysis=lambda: types.SimpleNamespace(peak_memory_in_bytes=3 * 10**9))
  trial = types.SimpleNamespace(label={"model.d_model": 4096})
  with pytest.raises(ConfigError, match=r"share, 0.300.*wants 3.0 GB, 1.0 GB is available.*fewer "
                                        r"--trials-per-device"):
    sweep.check_memory([trial], [compiled])


def parse(*argv):
  p = __import__("argparse").ArgumentParser()
  cli.add_arguments(p)
  return p.parse_args(["configs/quick.toml", *argv])


@pytest.mark.parametrize("argv, match", [
    (("--trials-per-device", "0"), r"--trials-per-device=0.*integer >= 1"),
    (("--trials-per-device", "2", "--workers", "3"), r"--trials-per-device=2.*1 with --workers"),
    (("--trials-per-device", "2", "--processes-per-trial", "2"), r"--trials-per-device=2"),
    (("--trials-per-device", "1000000"), r"--trials-per-device=1000000 is not allowed: an integer from 1 to \d+: "
                                         r"this process may use \d+ CPU cores"),
])
def test_trials_per_device_refuses_what_it_cannot_combine_with(argv, match):
  with pytest.raises(ConfigError, match=match):
    cli._check(parse(*argv))


def test_trials_per_device_beyond_the_cores_is_refused_before_the_store_is_touched(tmp_path, monkeypatch):
  cores = len(__import__("os").sched_getaffinity(0))
  monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
  assert cli._check(parse("--trials-per-device", str(cores))) in ("workers", "here")
  args = parse("--trials-per-device", str(cores + 1), "--out", str(tmp_path / "store"), "--no-report")
  def load(*a, **k):
    raise AssertionError("the config was read: the store and the workers come next")
  monkeypatch.setattr(cli.config_lib, "load", load)
  with pytest.raises(ConfigError, match=rf"--trials-per-device={cores + 1} is not allowed: an integer from 1 to {cores}"):
    cli.run(args)
  assert not (tmp_path / "store").exists()


def test_trials_per_device_runs_the_workers_executor(monkeypatch):
  monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
  monkeypatch.setattr(workers.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})  # 2 of 4 cores
  assert cli._check(parse("--trials-per-device", "2")) == "workers"
  assert __import__("os").environ["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"


@pytest.mark.slow  # two worker processes, each compiling: about 20 s
def test_trials_per_device_runs_every_trial_once_on_cpu(tmp_path):
  import json
  import os
  import subprocess
  import sys
  from conftest import TINY_SWEEP
  cfg = tmp_path / "c.toml"
  cfg.write_text(TINY_SWEEP + '\n[meta]\nname = "t"\nquestion = "q"\n')
  out = tmp_path / "run"
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
  p = subprocess.run([sys.executable, "-m", "attn", "sweep", str(cfg), "--out", str(out), "--no-report",
                      "--trials-per-device", "2"], capture_output=True, text=True, env=env, timeout=600)
  assert p.returncode == 0, p.stderr
  assert "2 local workers" in p.stderr
  done = [json.loads((d / "summary.json").read_text())["status"] for d in (out / "trials").iterdir()]
  assert done and set(done) == {"ok"}


@pytest.mark.gpu
@pytest.mark.skipif(__import__("jax").default_backend() != "gpu", reason="needs a GPU backend")
def test_per_device_plan_on_this_gpu():
  import jax
  k, placement, fraction = workers.per_device_plan(2, jax.local_devices(), io.StringIO())
  assert k == 2 and len(placement) == 2 * jax.local_device_count() and fraction == "0.450"
