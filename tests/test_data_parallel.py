"""Data parallel (train.data_parallel): refusals by name before tracing, and loss curves on 4 devices.

The fast tests check the config and device-count refusals in this process.
The slow ones train in one subprocess with 4 CPU devices
(XLA_FLAGS=--xla_force_host_platform_device_count=4 must be set before jax
starts, and this process's jax has started): every row on 4 devices, the
batch split or the seeds spread, equals the single-device row to rtol 1e-5,
update_norm to rtol 2e-3. Not bitwise: a batch split sums the loss and
gradients per device and then across devices, another float32 summation order,
and a program compiled for fewer seeds per device may order its sums otherwise
too; a loss differs in its last bits from step 0. Measured over 12 steps
(2-core CPU, shared with other jobs): at most 1e-6 relative in loss, eval loss
and norms; update_norm up to 1.7e-4, because Adam's update g/(|g| + 1e-8) turns
a last-bit change of a gradient entry near 1e-8 into a visible one.
"""

import hashlib
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from attn.config import ConfigError
from attn.experiments.running import config as config_lib
from attn.experiments.training import parallel
from attn.nn.config import ModelConfig
from attn.experiments.training.config import TrainConfig
from conftest import TINY_MQAR

TINY = TINY_MQAR + """

[train]
steps = 3
batch_size = 12

[sweep]
seeds = [0, 1, 2]
"""
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RTOL = {"update_norm": 2e-3}  # others: 1e-5 (see the module docstring)


def _load(*overrides):
  return config_lib.loads(TINY, "tiny.toml", list(overrides))


def _check(sweep) -> None:
  config_lib.check_devices(sweep.trials, sweep.vmap_seeds)


def _refusal(*overrides) -> str:
  with pytest.raises(ConfigError) as e:
    _load(*overrides)
  return str(e.value)


# --- config validation (pure, fast) -------------------------------------------------------

def test_default_is_one_device_and_the_device_count_leaves_trial_ids_alone():
  default = _load()
  for t in default.trials:  # the id hashes the resolved config without how-to-run keys
    cfg = json.loads(json.dumps(t.config))
    for key in ("checkpoint_every", "data_parallel", "data_parallel_axis", "grad_accum", "mesh"):
      del cfg["train"][key]
    for key, value in (("norm_eps", 1e-5), ("latent_dim", None), ("q_latent_dim", None),
                         ("rope_dim", 0), ("rope_theta", 10000.0), ("dtype", "float32"),
                         ("param_dtype", "float32")):  # hashed only when set (newer keys)
      assert cfg["model"].pop(key) == value
    for key in [k for k in cfg["model"] if k not in config_lib.FIRST_KEYS["model"]]:
      assert cfg["model"].pop(key) == json.loads(json.dumps(getattr(ModelConfig, key)))  # a newer key at its default
    for key in [k for k in cfg["train"] if k not in config_lib.FIRST_KEYS["train"]]:
      assert cfg["train"].pop(key) == getattr(TrainConfig, key)  # a newer key (sink_metrics) at its default
    task_defaults = config_lib.tasks.task_fields(cfg["task"]["name"])
    for key in [k for k in cfg["task"] if k != "name" and k not in config_lib.FIRST_TASK_KEYS[cfg["task"]["name"]]]:
      assert cfg["task"].pop(key) == json.loads(json.dumps(task_defaults[key]))  # a newer key (curriculum) at its default
    text = json.dumps(cfg, sort_keys=True, separators=(",", ":"))
    assert t.id == hashlib.sha256(text.encode()).hexdigest()[:12]
    assert (t.config["train"]["data_parallel"], t.config["train"]["data_parallel_axis"]) == (1, "batch")
  for sets in (["train.data_parallel=4"], ["train.data_parallel=auto"],
               ["train.data_parallel=3", "train.data_parallel_axis=seed", "sweep.vmap_seeds=true"]):
    other = _load(*sets)  # a trial resumed on another device count is the same trial
    assert [t.id for t in other.trials] == [t.id for t in default.trials]


def test_a_batch_that_does_not_divide_over_the_devices_is_refused_with_the_numbers():
  msg = _refusal("train.data_parallel=5")
  assert "train.batch_size=12 is not allowed: a multiple of train.data_parallel=5" in msg
  assert "12 rows over 5 devices leave 2 over" in msg
  msg = _refusal("train.data_parallel=4", "sweep.grid.train.batch_size=[8, 10]")
  assert "trial [batch_size=10, seed=0]: train.batch_size=10" in msg and "leave 2 over" in msg
  _load("train.data_parallel=4", "sweep.grid.train.batch_size=[8, 12]")  # both divide
  _load("train.data_parallel=5", "train.data_parallel_axis=seed", "train.batch_size=7",
        "sweep.vmap_seeds=true", "sweep.seeds=[0, 1, 2, 3, 4]")  # the seed axis never splits a batch


@pytest.mark.parametrize("value", ["0", "-2", "true", "2.0", "all", "[2]"])
def test_data_parallel_is_auto_or_a_positive_integer(value):
  msg = _refusal(f"train.data_parallel={value}")
  assert "train.data_parallel=" in msg and '"auto" (every local device) or an integer >= 1' in msg


def test_the_seed_axis_needs_vmapped_seeds_and_a_count_dividing_them():
  msg = _refusal("train.data_parallel_axis=seed", "train.data_parallel=3")
  assert "train.data_parallel_axis='seed' is not allowed" in msg and "sweep.vmap_seeds = true" in msg
  msg = _refusal("train.data_parallel_axis=seed", "train.data_parallel=2", "sweep.vmap_seeds=true")
  assert "train.data_parallel=2 is not allowed: a divisor of the 3 seeds" in msg and "[1, 3]" in msg
  assert "train.data_parallel_axis='rows'" in _refusal("train.data_parallel_axis=rows")
  for n in (1, 3, '"auto"'):
    _load("train.data_parallel_axis=seed", f"train.data_parallel={n}", "sweep.vmap_seeds=true")


def test_more_devices_than_present_are_refused_with_the_count_available():
  n = len(jax.local_devices())
  train = TrainConfig(batch_size=12 * (n + 1), data_parallel=n + 1)
  with pytest.raises(ConfigError, match=rf"train.data_parallel={n + 1} is not allowed: at most the {n} local"):
    parallel.layout(train, 1, False)
  auto = TrainConfig(batch_size=12 * n, data_parallel="auto")
  assert parallel.layout(auto, 1, False).devices == n
  _check(_load("train.data_parallel=auto"))
  with pytest.raises(ConfigError, match=rf"train.data_parallel={n + 1} is not allowed: at most the {n} local"):
    _check(_load(f"train.batch_size={12 * (n + 1)}", f"train.data_parallel={n + 1}"))


def test_one_device_places_nothing():
  x = {"tokens": np.zeros((4, 3), np.int32)}
  layout = parallel.layout(TrainConfig(), 3, True)
  assert layout.devices == 1 and layout.put(x, "train") is x
  assert layout.summary() == {"data_parallel_devices": 1, "data_parallel_axis": "batch",
                              "mesh": {"data": 1, "heads": 1}}


# --- 4 CPU devices, in a subprocess (slow) -------------------------------------------------

SCRIPT = r'''
import json, sys
import jax, numpy as np
from attn.config import ConfigError
from attn.experiments.running import config as config_lib
from attn.experiments.training import parallel
from attn.experiments.training.config import TrainConfig
from attn.experiments.training import train

out, tmp = {"devices": len(jax.local_devices())}, sys.argv[2]
train.enable_compilation_cache()  # $ATTN_JAX_CACHE: a resumed run reuses its reference's programs
TASKS = {"mqar": 'name = "mqar"\nvocab_size = 16\nseq_len = 12\nnum_pairs = 2',
         "marker": 'name = "marker_position"\nvocab_size = 16\nseq_len = 10\nnum_classes = 3'}
BASE = """[task]\n{task}\n[model]\nd_model = 16\nnum_layers = 1\nnum_heads = 2\nd_ff = 16
[train]\nsteps = 12\nbatch_size = 8\nwarmup_steps = 2\neval_every = 4\neval_batches = 2\ncheckpoint_every = 4
[sweep]\nseeds = [0, 1, 2, 3]\n"""

def run(name, sets, task="mqar", seeds=1, vmap=False, ckpt=None):
  sets = sets + [f"sweep.seeds={list(range(seeds))}", f"sweep.vmap_seeds={str(vmap).lower()}"]
  trials = config_lib.loads(BASE.format(task=TASKS[task]), name, sets).trials
  rows, starts = [[] for _ in trials], [None] * len(trials)
  dirs = [f"{tmp}/{ckpt}/{j}" for j in range(len(trials))] if ckpt else None
  summ = train.train_group([t.config for t in trials], on_row=lambda j, r: rows[j].append(r), vmap=vmap,
                           checkpoint_dirs=dirs, on_start=lambda j, s: starts.__setitem__(j, s))
  out[name] = {"rows": rows, "devices": [s["data_parallel_devices"] for s in summ],
               "axis": summ[0]["data_parallel_axis"], "starts": starts}

DP4, SEED = ["train.data_parallel=4"], ["train.data_parallel_axis=seed"]
run("one", [], ckpt="one")
run("batch4", DP4)
run("marker_one", [], task="marker")
run("marker_batch4", DP4, task="marker")
run("vmap_one", [], seeds=4, vmap=True)
run("vmap_batch4", ["train.data_parallel=auto"], seeds=4, vmap=True)
run("vmap_seed4", DP4 + SEED, seeds=4, vmap=True, ckpt="seed4")
run("vmap_seed2", ["train.data_parallel=2"] + SEED, seeds=4, vmap=True)
run("vmap_seed_resumed_on_1", SEED, seeds=4, vmap=True, ckpt="seed4")  # resumes at step 8
run("batch4_resumed", DP4, ckpt="one")

# The first seed of a group of three pending seeds on 4 devices: the largest divisor, 3.
out["partial_group"] = parallel.layout(TrainConfig(data_parallel=4, data_parallel_axis="seed"), 3, True).devices
x = np.arange(4 * 8 * 5).reshape(4, 8, 5)
for axis, kind in (("batch", "train"), ("seed", "state")):
  placed = parallel.Layout(4, 1, axis, True).put(x, kind)
  out[f"shards_{axis}"] = sorted({tuple(s.data.shape) for s in placed.addressable_shards}) + [len(placed.addressable_shards)]
for name, cfg in (("refuse_8", TrainConfig(data_parallel=8, batch_size=16)),
                  ("refuse_auto", TrainConfig(data_parallel="auto", batch_size=6))):
  try:
    parallel.layout(cfg, 1, False)
    out[name] = None
  except ConfigError as e:
    out[name] = str(e)
json.dump(out, open(sys.argv[1], "w"))
'''


@pytest.fixture(scope="module")
def four_devices(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("dp")
  cache = os.environ.get("ATTN_TEST_JAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "attn", "jax-tests")
  env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), "ATTN_JAX_CACHE": cache,
         "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"}
  proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp / "out.json"), str(tmp)], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads((tmp / "out.json").read_text())


def _assert_rows_close(mine, ref, steps=None):
  assert len(mine) == len(ref)
  for seed_rows, seed_ref in zip(mine, ref):
    if steps is not None:
      seed_ref = [r for r in seed_ref if r["step"] in steps]
    assert [r["step"] for r in seed_rows] == [r["step"] for r in seed_ref]
    for r, e in zip(seed_rows, seed_ref):
      assert r.keys() == e.keys()
      for k in r:
        if k != "step_time_s":
          np.testing.assert_allclose(r[k], e[k], rtol=RTOL.get(k, 1e-5), err_msg=f"{k} at step {r['step']}")


@pytest.mark.slow
def test_batch_split_over_4_devices_gives_the_single_device_loss_curve(four_devices):
  assert four_devices["devices"] == 4
  for ref, dp in (("one", "batch4"), ("marker_one", "marker_batch4"), ("vmap_one", "vmap_batch4")):
    assert four_devices[ref]["devices"] == [1] * len(four_devices[ref]["rows"])
    assert four_devices[dp]["devices"] == [4] * len(four_devices[dp]["rows"]), dp  # "auto": all 4
    assert four_devices[dp]["axis"] == "batch"
    _assert_rows_close(four_devices[dp]["rows"], four_devices[ref]["rows"])
  assert four_devices["shards_batch"] == [[4, 2, 5], 4]  # B = 8 split in 4


@pytest.mark.slow
def test_seeds_spread_over_devices_give_the_single_device_loss_curves(four_devices):
  ref = four_devices["vmap_one"]["rows"]
  for name, devices in (("vmap_seed4", 4), ("vmap_seed2", 2)):
    assert four_devices[name]["devices"] == [devices] * 4 and four_devices[name]["axis"] == "seed"
    _assert_rows_close(four_devices[name]["rows"], ref)
  assert four_devices["shards_seed"] == [[1, 8, 5], 4]  # one seed per device
  assert four_devices["partial_group"] == 3


@pytest.mark.slow
def test_a_checkpoint_resumes_on_another_device_count(four_devices):
  for name, ref in (("vmap_seed_resumed_on_1", "vmap_one"), ("batch4_resumed", "one")):
    run = four_devices[name]
    assert run["starts"] == [8] * len(run["rows"])  # saved at 4, 8, 12 on the other count; 8 < 12 resumes
    _assert_rows_close(run["rows"], four_devices[ref]["rows"], steps=range(8, 12))


@pytest.mark.slow
def test_device_counts_that_cannot_run_here_are_refused_with_the_count(four_devices):
  assert "train.data_parallel=8 is not allowed: at most the 4 local cpu device(s) present" in \
      four_devices["refuse_8"]
  assert "train.data_parallel='auto' is not allowed: a device count dividing train.batch_size=6" in \
      four_devices["refuse_auto"] and "one of [1, 2, 3]" in four_devices["refuse_auto"]
