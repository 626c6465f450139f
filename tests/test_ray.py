"""`attn sweep --executor ray`: the option checks (no Ray needed), then a real two-node Ray cluster on this machine.

The `ray` tests start a head and a second node on 127.0.0.1 (`ray start`, their own ports and temp
dir, each in a session of its own that the fixture kills at the end, even on failure), run a
6-trial sweep across them and compare every row with the same sweep run locally, bit for bit
(step_time_s aside); then the same with the second node killed (SIGKILL to its whole process
session) while it trains a trial past a checkpoint: Ray re-runs that task on the head, which takes
the dead worker's lease over and resumes from the checkpoint; every trial finishes once, each row
once. Run: `python -m pytest -m ray -rs tests/test_ray.py` (needs pip install -e ".[ray]").
"""

import argparse
import glob
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from attn import cli
from attn.config import ConfigError
from attn.experiments import cli as sweep_cli
from attn.experiments.running import leases, ray_executor, ray_task, store
from attn.experiments.training import checkpoints
from conftest import TINY_MQAR

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, CHECKPOINT_EVERY, TRIALS = 300, 25, 6
CONFIG = TINY_MQAR + f"""
[train]
steps = {STEPS}
batch_size = 2
eval_every = 50
eval_batches = 1
checkpoint_every = {CHECKPOINT_EVERY}

[sweep]
seeds = [0, 1, 2]
[sweep.grid]
"model.num_heads" = [1, 2]
"""


def _args(*argv: str) -> argparse.Namespace:
  p = argparse.ArgumentParser()
  sweep_cli.add_arguments(p)
  return p.parse_args(["c.toml", *argv])


# ---- no cluster, no Ray needed ----

@pytest.mark.parametrize("argv, name, allowed", [
    (["--ray-cpus-per-trial", "0"], "--ray-cpus-per-trial", "a number > 0"),
    (["--ray-cpus-per-trial", "two"], "--ray-cpus-per-trial", "a number > 0"),
    (["--ray-gpus-per-trial", "-1"], "--ray-gpus-per-trial", "a number >= 0"),
    (["--ray-gpus-per-trial", "1.5"], "--ray-gpus-per-trial", "a whole number above 1"),
    (["--ray-address", "head"], "--ray-address", "HOST:PORT"),
    (["--ray-address", "ray://head:99999"], "--ray-address", "ray://HOST:PORT"),
    (["--ray-runtime-env", "[1]"], "--ray-runtime-env", "a JSON object"),
    (["--ray-runtime-env", "{pip"], "--ray-runtime-env", "a JSON object"),
    (["--trials-per-device", "2", "--ray-gpus-per-trial", "0.5"], "--trials-per-device", "1 with --ray-"),
])
def test_bad_ray_options_are_refused_by_name(argv, name, allowed, monkeypatch):
  monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "ray" else None)
  with pytest.raises(ConfigError) as e:
    ray_executor.check_args(_args("--executor", "ray", *argv))
  assert str(e.value).startswith(f"{name}=") and allowed in str(e.value), str(e.value)


def test_ray_options_parse(monkeypatch):
  monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "ray" else None)
  params = ray_executor.check_args(_args("--executor", "ray", "--ray-address", "ray://10.0.0.1:10001",
                                         "--ray-cpus-per-trial", "2", "--ray-gpus-per-trial", "0.25",
                                         "--ray-runtime-env", '{"pip": ["my-plugin"]}'))
  assert params == {"address": "ray://10.0.0.1:10001", "cpus": 2.0, "gpus": 0.25, "per_device": 1,
                    "runtime_env": {"pip": ["my-plugin"]}}
  assert ray_executor.check_args(_args("--executor", "ray", "--ray-address", "auto"))["address"] == "auto"


def test_ray_options_without_the_ray_executor_and_ray_missing_are_refused(tmp_path, capsys, monkeypatch):
  out = tmp_path / "out"
  assert cli.main(["sweep", "none.toml", "--out", str(out), "--ray-gpus-per-trial", "0.5"]) == 2
  assert "--ray-gpus-per-trial='0.5' is not allowed: only with --executor ray" in capsys.readouterr().err
  assert cli.main(["sweep", "none.toml", "--out", str(out), "--executor", "ray", "--workers", "2"]) == 2
  assert "--workers=2 is not allowed: left out with --executor ray" in capsys.readouterr().err
  monkeypatch.setitem(sys.modules, "ray", None)  # find_spec says: not installed
  assert cli.main(["sweep", "none.toml", "--out", str(out), "--executor", "ray"]) == 2
  assert 'an install with Ray: pip install -e ".[ray]"' in capsys.readouterr().err
  assert not out.exists()


def test_an_address_that_does_not_answer_is_named_within_seconds(tmp_path):
  with socket.socket() as s:  # a port nothing listens on
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  t0 = time.monotonic()
  with pytest.raises(ConfigError, match=rf"--ray-address='127.0.0.1:{port}' is not allowed: the address of a "
                                        r"running Ray cluster: 127.0.0.1:\d+ gave .* within 5 s"):
    ray_executor.connect({"address": f"127.0.0.1:{port}", "cpus": None, "gpus": None, "per_device": 1})
  assert time.monotonic() - t0 < ray_executor.CONNECT_TIMEOUT_S + 1


def test_resources_no_node_has_are_named_with_what_the_cluster_offers():
  offered = [{"ip": "10.0.0.1", "node_id": "abcdef0123", "cpus": 8.0, "gpus": 0.0},
             {"ip": "10.0.0.2", "node_id": "fedcba9876", "cpus": 4.0, "gpus": 1.0}]
  params = {"cpus": 6.0, "gpus": 0.5, "per_device": 1}
  with pytest.raises(ConfigError) as e:
    ray_executor.resources(params, offered, sys.stderr)
  msg = str(e.value)
  assert msg.startswith("--ray-cpus-per-trial=6 --ray-gpus-per-trial=0.5 is not allowed") and \
      "10.0.0.1 (abcdef01): 8 CPU, 0 GPU; 10.0.0.2 (fedcba98): 4 CPU, 1 GPU" in msg, msg
  assert ray_executor.resources({**params, "cpus": 4.0}, offered, sys.stderr) == (4.0, 0.5)
  # --trials-per-device K: 1/K of a GPU where there are GPUs, else 1/K of the smallest node's CPUs
  assert ray_executor.resources({"cpus": None, "gpus": None, "per_device": 4}, offered, sys.stderr) == (1.0, 0.25)
  cpu_only = [dict(n, gpus=0.0) for n in offered]
  assert ray_executor.resources({"cpus": None, "gpus": None, "per_device": 2}, cpu_only, sys.stderr) == (2.0, 0.0)


def test_a_trial_process_gets_threads_and_gpu_memory_from_its_resources(monkeypatch):
  monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
  env = ray_task.child_env(2.5, 0.25)
  assert env["OMP_NUM_THREADS"] == "3" and env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
  assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.225"
  assert ray_task.child_env(1, 0)["CUDA_VISIBLE_DEVICES"] == ""
  assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in ray_task.child_env(1, 1)  # a whole GPU: XLA's own default
  missing = ray_task.missing_plugins([{"group": "attn.variants", "name": "no_such_plugin_variant",
                                       "distribution": "my-attn-plugin"}])
  assert missing == ["'no_such_plugin_variant' (entry point of group 'attn.variants', distribution "
                     "'my-attn-plugin')"]


@pytest.mark.slow  # reads every registry with a plugin installed: seconds; the fast sibling is missing_plugins above
def test_the_plugins_a_sweep_names_are_what_workers_must_have(tmp_path):
  from test_plugins import _distribution, _python_block, installed
  dist = _distribution(tmp_path, "my_attn", {"attn.variants": {"tempered": "my_attn:VARIANT"}},
                       {"my_attn/__init__.py": _python_block("README.md", "### From your own repository")})
  trial = argparse.Namespace(config={"model": {"variant": "tempered", "num_heads": 2}, "task": {"name": "mqar"}})
  builtin = argparse.Namespace(config={"model": {"variant": "per_head"}})
  with installed(dist):
    needed = ray_executor.plugins([trial, builtin])
    assert needed == [{"group": "attn.variants", "name": "tempered", "distribution": "my_attn"}]
    assert ray_task.missing_plugins(needed) == []  # a worker with the distribution installed
  assert ray_task.missing_plugins(needed) == [  # one without it
      "'tempered' (entry point of group 'attn.variants', distribution 'my_attn')"]


# ---- a real two-node cluster on this machine ----

def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _ray_start(env: dict, *argv: str) -> int:
  """`ray start ...` in a session of its own, which its daemons and workers stay in (the workers each lead a
  process group of their own); that session's id."""
  ray = os.path.join(os.path.dirname(sys.executable), "ray")
  p = subprocess.Popen([ray, "start", "--num-cpus", "1", "--node-ip-address", "127.0.0.1",
                        "--dashboard-agent-listen-port", str(_free_port()),
                        "--runtime-env-agent-port", str(_free_port()), "--disable-usage-stats", *argv],
                       env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
  try:
    text, _ = p.communicate(timeout=120)
  except subprocess.TimeoutExpired:
    _kill(p.pid, signal.SIGKILL)
    raise AssertionError("ray start took over 120 s")
  assert p.returncode == 0, text
  return p.pid


def _session(sid: int) -> list[int]:
  """The processes of session `sid` (one node: its raylet, agents, workers and their trial processes)."""
  pids = []
  for d in os.listdir("/proc"):
    try:
      if d.isdigit() and os.getsid(int(d)) == sid:
        pids.append(int(d))
    except OSError:
      continue
  return pids


def _kill(sid: int, sig: int) -> None:
  for pid in _session(sid):
    try:
      os.kill(pid, sig)
    except ProcessLookupError:
      pass


def _stop(sid: int) -> None:
  _kill(sid, signal.SIGTERM)
  deadline = time.time() + 5
  while _session(sid) and time.time() < deadline:
    time.sleep(0.2)
  _kill(sid, signal.SIGKILL)


def _python(env: dict, code: str, timeout: float = 120) -> str:
  p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
  assert p.returncode == 0, p.stdout + p.stderr
  return p.stdout


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
  """(address, env, the second node's session id, config path, the local reference store)."""
  pytest.importorskip("ray")
  root = tmp_path_factory.mktemp("ray")
  temp = f"/tmp/attn-ray-test-{os.getpid()}"  # short: Ray's socket paths must stay under 107 characters
  env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
         "ATTN_JAX_CACHE": str(root / "cache"), "RAY_USAGE_STATS_ENABLED": "0",
         # a loopback-only cluster: no token (with ~/.ray/auth_token present the head wants one, the node lacks it)
         "RAY_AUTH_MODE": "disabled",
         # a dead node is declared after 5 missed health checks 1 s apart (Ray's default: 3 s apart, each waiting 10 s)
         "RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "3000",
         "RAY_health_check_failure_threshold": "5"}
  cfg = root / "c.toml"
  cfg.write_text(CONFIG)
  ref = str(root / "ref")
  p = subprocess.run([sys.executable, "-m", "attn", "sweep", str(cfg), "--out", ref, "--no-report"],
                     env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
  assert p.returncode == 0, p.stderr
  port, groups = _free_port(), []
  try:
    groups.append(_ray_start(env, "--head", "--port", str(port), "--temp-dir", temp, "--include-dashboard=false",
                             "--ray-client-server-port", str(_free_port())))
    groups.append(_ray_start(env, "--address", f"127.0.0.1:{port}"))
    _python(env, f"import ray, time; ray.init(address='127.0.0.1:{port}', logging_level='ERROR')\n"
                 "t = time.time()\n"
                 "while sum(n['Alive'] for n in ray.nodes()) < 2 and time.time() - t < 60: time.sleep(0.5)\n"
                 "assert sum(n['Alive'] for n in ray.nodes()) == 2, ray.nodes()")
    yield f"127.0.0.1:{port}", env, groups[1], str(cfg), ref
  finally:
    for g in reversed(groups):
      _stop(g)
    subprocess.run(["rm", "-rf", temp])


def _sweep(cfg: str, out: str, address: str, env: dict) -> subprocess.Popen:
  return subprocess.Popen([sys.executable, "-m", "attn", "sweep", cfg, "--out", out, "--executor", "ray",
                           "--ray-address", address, "--no-report"], env=env, cwd=REPO,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _rows(root: str, trial_id: str) -> list[dict]:
  rows = store.read_rows(os.path.join(root, "trials", trial_id, store.METRICS))
  return [{k: v for k, v in r.items() if k != "step_time_s"} for r in rows]


def _check_equal(out: str, ref: str) -> list[dict]:
  summaries = []
  for t in store.load_sweep(ref)["trials"]:
    s = store.read_json(os.path.join(out, "trials", t["id"], store.SUMMARY))
    assert s["status"] == "ok", s
    assert [r["step"] for r in _rows(out, t["id"])] == list(range(STEPS))  # every row once
    assert _rows(out, t["id"]) == _rows(ref, t["id"])
    assert s["final"] == store.read_json(os.path.join(ref, "trials", t["id"], store.SUMMARY))["final"]
    assert not os.path.exists(os.path.join(out, "trials", t["id"], leases.LEASE))
    summaries.append(s)
  return summaries


@pytest.mark.ray
def test_a_sweep_across_two_nodes_equals_the_local_one(cluster, tmp_path):
  address, env, _, cfg, ref = cluster
  out = str(tmp_path / "out")
  p = _sweep(cfg, out, address, env)
  stdout, stderr = p.communicate(timeout=300)
  assert p.returncode == 0, stderr
  summaries = _check_equal(out, ref)
  nodes = {s["worker"].split("(")[1].split(",")[0] for s in summaries}  # the node ids the trials ran on
  assert len(nodes) == 2 and all(s["worker"].startswith("ray node ") for s in summaries), summaries
  assert "the Ray cluster at 127.0.0.1" in stderr and "2 nodes, 2 CPUs" in stderr, stderr
  record = [json.loads(line) for line in open(os.path.join(out, "run.jsonl"))]
  ray_line = [r for r in record if r["event"] == "ray"][-1]
  assert len(ray_line["placements"]) == TRIALS and ray_line["trials_per_hour"] > 0
  status = subprocess.run([sys.executable, "-m", "attn", "status", out], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
  assert f"{TRIALS} ok" in status.stdout and status.stdout.count("on ray node") == TRIALS, status.stdout
  assert "trials per hour" in status.stderr and f"logs: {out}/ray/" in status.stdout


def _held_on(out: str, sid: int) -> str | None:
  """A trial whose lease is held by a process of session `sid`, some steps past a checkpoint, well before its end."""
  for d in glob.glob(os.path.join(out, "trials", "*")):
    try:
      pid = store.read_json(os.path.join(d, leases.LEASE))["pid"]
      rows = len(store.read_rows(os.path.join(d, store.PARTIAL)))
      mine = os.getsid(pid) == sid
    except (OSError, ValueError, KeyError):
      continue
    saved = checkpoints.steps(os.path.join(d, store.CHECKPOINTS))
    if mine and saved and saved[-1] + 3 < rows < STEPS // 2:
      return os.path.basename(d)
  return None


@pytest.mark.ray
def test_a_node_killed_mid_sweep_loses_nothing(cluster, tmp_path):
  address, env, node2, cfg, ref = cluster
  out = str(tmp_path / "out")
  p = _sweep(cfg, out, address, env)
  try:
    deadline, trial = time.time() + 240, None
    while trial is None and time.time() < deadline and p.poll() is None:
      trial = _held_on(out, node2)
      time.sleep(0.02)
    assert trial is not None, "no trial trained on the second node"
    _kill(node2, signal.SIGKILL)  # the node: its raylet, its workers and their trial processes
    stdout, stderr = p.communicate(timeout=300)
  finally:
    if p.poll() is None:
      p.kill()
  assert p.returncode == 0, stderr
  _check_equal(out, ref)
  log = open(os.path.join(out, "ray", f"{trial}.log")).read()
  resumed = [int(s) for s in re.findall(r"resumes at step (\d+) from", log)]
  assert len(resumed) == 1 and resumed[0] >= CHECKPOINT_EVERY and "taken over from" in log, log
  summary = store.read_json(os.path.join(out, "trials", trial, store.SUMMARY))
  assert summary["resumed_from"] == resumed[0]


@pytest.mark.ray
def test_a_worker_that_lacks_the_store_or_a_plugin_fails_naming_it(cluster, tmp_path):
  address, env, _, _, ref = cluster
  code = (f"import ray, json\nfrom attn.experiments.running import ray_task\n"
          f"ray.init(address={address!r}, logging_level='ERROR')\n"
          "f = ray.remote(ray_task.run).options(num_cpus=1, max_retries=0)\n"
          "for spec in ({'out': '/nonexistent/attn-store', 'plugins': []},\n"
          f"             {{'out': {ref!r}, 'plugins': [{{'group': 'attn.variants', 'name': 'not_here', "
          "'distribution': 'my-attn-plugin'}]}):\n"
          "  try:\n    ray.get(f.remote(spec, ['x']))\n  except Exception as e:\n"
          "    print(json.dumps(str(getattr(e, 'cause', e))))\n")
  lines = [json.loads(x) for x in _python(env, code).splitlines() if x.startswith('"')]
  assert len(lines) == 2, lines
  assert "/nonexistent/attn-store/sweep.json is missing there" in lines[0] and "--out=" in lines[0], lines[0]
  assert "lacks 'not_here' (entry point of group 'attn.variants', distribution 'my-attn-plugin')" in lines[1]
