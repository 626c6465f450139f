"""train.mesh = {data = N, heads = M}: the sharding table, refusals with the numbers, and trials on 4 devices.

In this process (one CPU device): every registered variant declares every
parameter in attn.nn.sharding, by the rule its docstring states; the config
takes the mesh as a TOML table or `--set train.mesh.heads=2`, leaves trial ids
alone, and refuses a mesh that does not fit, with the numbers.

On 4 devices, in a subprocess (XLA_FLAGS=--xla_force_host_platform_device_count=4
must be set before jax starts): a trial on (data 2 × heads 2), (heads 4) and
(data 4) gives the one-device trial's rows to rtol 1e-5 (update_norm 2e-3, as
in test_data_parallel: Adam's g/(|g| + 1e-8) at gradient entries near 0), and
the compiled train step takes each attention parameter, and its Adam moments,
in the shape of one device's shard (read from the HLO's entry parameters):
split by heads as the table says, not replicated. Measured over 4 steps, every
variant, H = 4 with G = 4 and G = 2: at most 2.3e-7 relative apart. All of it
runs in the slow tier: one case (per_head, G = 2, data 2 × heads 2); every
variant at both G on the meshes that split its heads (per_head on all three);
seeds split on data beside heads, micro-batches (train.grad_accum) on data 2 ×
heads 2, and a checkpoint saved on heads = 4 resumed on one device.
"""

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import attn
from attn import api
from attn.config import ConfigError, HeadConfig
from attn.experiments.running import config as config_lib
from attn.experiments.training import parallel
from attn.experiments.training.config import TrainConfig
from attn.nn import sharding
from conftest import CONFIGS, ROPE_CONFIGS, TINY_MQAR

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = TINY_MQAR.replace("num_heads = 2", "num_heads = 4") + """
[train]
steps = 4
batch_size = 8
warmup_steps = 1
eval_every = 2
eval_batches = 1
checkpoint_every = 2
"""
RTOL = {"update_norm": 2e-3}  # others: 1e-5


def _load(*sets, text=TINY):
  return config_lib.loads(text, "tiny.toml", list(sets))


def _refusal(*sets, text=TINY) -> str:
  with pytest.raises(ConfigError) as e:
    _load(*sets, text=text)
  return str(e.value)


# --- the sharding table ---------------------------------------------------------------------

def _variant_configs():
  for variant in sorted(attn.VARIANTS):
    for name, cfg in {**CONFIGS, **ROPE_CONFIGS}.items():
      try:
        api.check_config(variant, cfg)
      except ConfigError:
        continue
      yield variant, name, cfg


@pytest.mark.parametrize("variant", sorted(attn.VARIANTS))
def test_every_parameter_of_every_variant_is_declared_with_one_letter_per_axis(variant):
  seen = 0
  for v, _, cfg in _variant_configs():
    if v != variant:
      continue
    for name, shape in api.param_shapes(variant, cfg).items():
      letters = sharding.axes(variant, name)
      assert letters is None or len(letters) == len(shape), (name, letters, shape)
      seen += 1
  assert seen


def _expected(letter: str, size: int, cfg: HeadConfig, M: int):
  """The docstring's rule, written out again."""
  if letter == "H" or (letter == "G" and cfg.num_kv_heads % M == 0) or (letter == "P" and size % M == 0):
    return "heads"
  return None


def test_the_rule_query_heads_split_kv_heads_when_m_divides_g_shared_arrays_replicated():
  for variant, _, cfg in _variant_configs():
    H = cfg.num_heads
    for M in [m for m in range(1, H + 1) if H % m == 0]:
      specs = sharding.param_specs(variant, cfg, M)
      for name, shape in api.param_shapes(variant, cfg).items():
        letters = sharding.axes(variant, name)
        want = [None] * len(shape) if letters is None or M == 1 else \
            [_expected(a, n, cfg, M) for a, n in zip(letters, shape)]
        assert list(specs[name]) + [None] * (len(shape) - len(specs[name])) == want, (variant, name, M)
        for n, s in zip(shape, specs[name]):
          assert s is None or n % M == 0  # a split axis divides evenly
      # W^O always splits by its input rows (grouped_lowrank's A and B by groups: where M divides g)
      assert "heads" in specs.get("w_o", specs.get("w_oa")) or M == 1 or cfg.o_groups % M
  gqa = CONFIGS["gqa"]  # H = 6, G = 2
  assert sharding.param_specs("per_head", gqa, 2)["w_k"] == sharding.PartitionSpec(None, "heads", None)
  assert sharding.param_specs("per_head", gqa, 3)["w_k"] == sharding.PartitionSpec(None, None, None)
  assert sharding.param_specs("per_head", gqa, 3)["w_q"] == sharding.PartitionSpec(None, "heads", None)
  assert sharding.param_specs("talking_heads", gqa, 3)["mix_l"] == sharding.PartitionSpec()
  assert sharding.param_specs("mla", CONFIGS["base"], 2)["w_dkv"] == sharding.PartitionSpec(None, None)


def test_an_undeclared_parameter_is_refused_by_name():
  with pytest.raises(ConfigError, match=r"per_head.w_extra='w_extra' is not allowed: a parameter declared in "
                                        r"variant 'per_head''s record \(Variant.sharding\)"):
    sharding.axes("per_head", "w_extra")
  # A variant that declares no letters at all is replicated, and says so.
  bare = dataclasses.replace(attn.VARIANTS["per_head"], name="bare", sharding=None)
  with pytest.warns(sharding.ReplicatedWarning, match="'bare' declares no sharding letters.*'w_extra'"):
    assert sharding.axes(bare, "w_extra") is None
  with pytest.warns(sharding.ReplicatedWarning):
    specs = sharding.param_specs(dataclasses.replace(bare, param_count=None), CONFIGS["base"], 2)
  assert set(specs.values()) == {sharding.PartitionSpec()}
  with pytest.raises(ConfigError, match=r"heads=4 is not allowed: a divisor of num_heads=6"):
    sharding.param_specs("per_head", CONFIGS["gqa"], 4)


# --- the config -----------------------------------------------------------------------------

def test_the_mesh_is_a_table_or_a_dotted_set_and_leaves_trial_ids_alone():
  default = _load()
  assert default.trials[0].config["train"]["mesh"] == {"data": 1, "heads": 1}
  table = _load(text=TINY + "mesh = {data = 2, heads = 2}\n")
  dotted = _load("train.mesh.heads=2", "train.mesh.data=2")
  inline = _load("train.mesh={data = 2, heads = 2}")
  for sw in (table, dotted, inline):
    train = sw.trials[0].config["train"]
    assert train["mesh"] == {"data": 2, "heads": 2} and train["data_parallel"] == 2
    assert [t.id for t in sw.trials] == [t.id for t in default.trials]
  heads_only = _load("train.mesh.heads=4").trials[0].config["train"]
  assert heads_only["mesh"] == {"data": 1, "heads": 4} and heads_only["data_parallel"] == 1
  # data_parallel = N is the mesh {data = N, heads = 1}; saying it twice is fine, differently is not.
  assert TrainConfig(data_parallel=4).mesh == TrainConfig(mesh={"data": 4}).mesh == {"data": 4, "heads": 1}
  assert _load("train.data_parallel=2", "train.mesh.data=2").trials[0].config["train"]["mesh"]["data"] == 2
  assert "train.mesh.data=4 is not allowed: unset, or train.data_parallel=2" in \
      _refusal("train.data_parallel=2", "train.mesh.data=4")


@pytest.mark.parametrize("sets,message", [
    (["train.mesh.heads=3"], "the trial: train.mesh.heads=3 is not allowed: a divisor of model.num_heads=4: "
                             "each of the 3 devices holds num_heads / 3 whole query heads, and 4 leaves 1 over; "
                             "one of [1, 2, 4]"),
    (["train.mesh.data=3"], "train.batch_size=8 is not allowed: a multiple of train.data_parallel=3"),
    (["train.mesh.heads=0"], "train.mesh.heads=0 is not allowed: an integer >= 1 dividing model.num_heads"),
    (["train.mesh.rows=2"], "train.mesh.rows=2 is not allowed: a key of train.mesh: ['data', 'heads']"),
    (["train.mesh=2"], "train.mesh=2 is not allowed: a table {data = N, heads = M}"),
    (["train.mesh.data=two"], "train.mesh.data='two' is not allowed: \"auto\" (every local device) or an integer"),
])
def test_a_mesh_that_does_not_fit_the_model_or_batch_is_refused_with_the_numbers(sets, message):
  assert message in _refusal(*sets)


def test_a_mesh_larger_than_the_devices_present_is_refused_before_training():
  n = len(parallel.jax.local_devices())
  with pytest.raises(ConfigError) as e:
    parallel.layout(TrainConfig(mesh={"heads": 2 * n}), 1, False, num_heads=4 * n)
  assert str(e.value) == (f"train.mesh={{'data': 1, 'heads': {2 * n}}} is not allowed: at most the {n} local "
                          f"cpu device(s) present: data × heads = 1 × {2 * n} = {2 * n} devices")
  with pytest.raises(ConfigError, match=r"train.mesh.heads=3 is not allowed: a divisor of model.num_heads=4"):
    parallel.layout(TrainConfig(mesh={"heads": 3}), 1, False, num_heads=4)
  with pytest.raises(ConfigError, match=rf"at most the {n} local cpu device\(s\) present"):
    config_lib.check_devices(_load(f"train.mesh.heads={2 * n}", text=TINY.replace("num_heads = 4",
                                                                                    f"num_heads = {2 * n}")).trials, False)


def test_one_device_is_the_plain_program():
  layout = parallel.layout(TrainConfig(), 1, False, num_heads=4)
  assert (layout.data, layout.heads, layout.devices) == (1, 1, 1)
  x = {"w": np.zeros(3)}
  assert layout.put(x, "params") is x and layout.with_state(None, x, x, x, None) is layout


# --- 4 CPU devices, in a subprocess ---------------------------------------------------------

SCRIPT = r'''
import json, re, sys
from attn.experiments.running import config as config_lib
from attn.experiments.training import train

spec = json.loads(open(sys.argv[1]).read())
train.enable_compilation_cache()  # $ATTN_JAX_CACHE
out = {}

def entry_shapes(text):
  """op_name -> the shape one device's compiled step takes that argument in."""
  entry = text[text.index("\nENTRY"):]
  shapes = {}
  for dims, rest in re.findall(r"= \w+\[([\d,]*)\]\S* parameter\(\d+\)([^\n]*)", entry):
    name = re.search(r'op_name="([^"]+)"', rest)
    if name:
      shapes[name.group(1).replace("\\'", "'")] = [int(d) for d in dims.split(",") if d]
  return shapes

for case in spec["cases"]:
  trials = config_lib.loads(spec["base"], case["name"], case["sets"]).trials
  rows, got = [[] for _ in trials], {}
  dirs = [f"{spec['tmp']}/{case['ckpt']}/{j}" for j in range(len(trials))] if case.get("ckpt") else None
  summ = train.train_group([t.config for t in trials], on_row=lambda j, r: rows[j].append(r),
                           vmap=case.get("vmap", False), checkpoint_dirs=dirs,
                           on_compiled=lambda s, e: got.setdefault("step", s))
  out[case["name"]] = {"rows": rows, "mesh": summ[0]["mesh"], "starts": [s["resumed_from"] for s in summ],
                       "shapes": entry_shapes(got["step"].as_text()),
                       "argument_bytes": got["step"].memory_analysis().argument_size_in_bytes}
json.dump(out, open(sys.argv[2], "w"))
'''
MESHES = {"d2h2": ["train.mesh.data=2", "train.mesh.heads=2"], "h4": ["train.mesh.heads=4"],
          "d4": ["train.data_parallel=4"]}


def _run_on_4_devices(tmp_path, cases):
  spec = tmp_path / "spec.json"
  spec.write_text(json.dumps({"base": TINY, "cases": cases, "tmp": str(tmp_path)}))
  cache = os.environ.get("ATTN_TEST_JAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "attn", "jax-tests")
  env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), "ATTN_JAX_CACHE": cache,
         "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"}
  proc = subprocess.run([sys.executable, "-c", SCRIPT, str(spec), str(tmp_path / "out.json")], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=3000)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads((tmp_path / "out.json").read_text())


def _assert_rows_close(mine, ref, steps=None):
  assert len(mine) == len(ref)
  for seed_rows, seed_ref in zip(mine, ref):
    seed_ref = [r for r in seed_ref if steps is None or r["step"] in steps]
    assert [r["step"] for r in seed_rows] == [r["step"] for r in seed_ref]
    for r, e in zip(seed_rows, seed_ref):
      assert r.keys() == e.keys()
      for k in r:
        if k != "step_time_s":
          np.testing.assert_allclose(r[k], e[k], rtol=RTOL.get(k, 1e-5), err_msg=f"{k} at step {r['step']}")


def _assert_weights_split(run, variant, cfg: HeadConfig, M: int):
  """Each attention parameter and Adam moment enters the compiled step as one device's shard; the rest whole."""
  specs, shapes = sharding.param_specs(variant, cfg, M), api.param_shapes(variant, cfg)
  attention = {k: v for k, v in run["shapes"].items() if "['attn']['params']" in k}
  assert len(attention) == 3 * len(shapes)  # params, mu, nu
  split = 0
  for leaf, local in attention.items():
    name = leaf.split("['params']['")[1].split("']")[0]
    want = [n // M if s == "heads" else n for n, s in zip(shapes[name], list(specs[name]) + [None] * 4)]
    assert local == want, (leaf, local, want)
    split += local != list(shapes[name])
  assert split >= 3 or M == 1  # at least W^O and its two moments
  assert run["shapes"]["params['embed']['token'].value"] == [16, 16]  # replicated over heads


def _cases(variant, gqa, meshes):
  extra = [f"model.variant={variant}"] + (["model.num_kv_heads=2"] if gqa else [])
  name = f"{variant}{'_gqa' if gqa else ''}"
  return [{"name": name, "sets": extra}] + [{"name": f"{name}/{m}", "sets": extra + MESHES[m]} for m in meshes]


def _check_matrix(out, variant, gqa, meshes):
  name = f"{variant}{'_gqa' if gqa else ''}"
  cfg = HeadConfig(d_model=16, num_heads=4, num_kv_heads=2 if gqa else None)
  ref = out[name]
  assert ref["mesh"] == {"data": 1, "heads": 1}
  for m in meshes:
    run = out[f"{name}/{m}"]
    N, M = {"d2h2": (2, 2), "h4": (1, 4), "d4": (4, 1)}[m]
    assert run["mesh"] == {"data": N, "heads": M}
    _assert_rows_close(run["rows"], ref["rows"])
    _assert_weights_split(run, variant, cfg, M)
    if M > 1:
      assert run["argument_bytes"] < ref["argument_bytes"]


@pytest.mark.slow  # end to end, seconds: the slow tier runs it
def test_one_trial_on_data_2_by_heads_2_gives_the_one_device_rows_with_split_weights(tmp_path):
  out = _run_on_4_devices(tmp_path, _cases("per_head", True, ["d2h2"]))
  _check_matrix(out, "per_head", True, ["d2h2"])


# The meshes every variant runs on, per G: what a variant's sharding letters decide is how its arrays
# split by heads. With G = 4, heads = 4 splits query and kv heads alike and data 2 × heads 2 adds only
# the data split; with G = 2, heads = 2 splits kv heads and heads = 4 replicates them. per_head runs
# every mesh, data 4 (no head split) included.
HEAD_MESHES = {False: ["h4"], True: ["d2h2", "h4"]}


@pytest.mark.slow
@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
def test_every_variant_split_by_heads_gives_the_one_device_rows_with_split_weights(tmp_path, gqa):
  meshes = {v: list(MESHES) if v == "per_head" else HEAD_MESHES[gqa] for v in sorted(attn.VARIANTS)}
  out = _run_on_4_devices(tmp_path, [c for v, m in meshes.items() for c in _cases(v, gqa, m)])
  for v, m in meshes.items():
    _check_matrix(out, v, gqa, m)


@pytest.mark.slow
def test_seeds_on_data_beside_heads_micro_batches_and_a_checkpoint_resumed_on_another_mesh(tmp_path):
  vmap = ["sweep.seeds=[0, 1]", "sweep.vmap_seeds=true"]
  out = _run_on_4_devices(tmp_path, [
      {"name": "seeds", "sets": vmap, "vmap": True},
      {"name": "seeds/d2h2", "sets": vmap + ["train.data_parallel_axis=seed"] + MESHES["d2h2"], "vmap": True},
      {"name": "one", "sets": []},
      {"name": "h4", "sets": MESHES["h4"], "ckpt": "h4"},
      {"name": "h4_resumed_on_1", "sets": [], "ckpt": "h4"},  # resumes from the step-2 checkpoint
      {"name": "d2h2_accum2", "sets": MESHES["d2h2"] + ["train.grad_accum=2"]},
  ])
  _assert_rows_close(out["d2h2_accum2"]["rows"], out["one"]["rows"])
  assert out["seeds/d2h2"]["mesh"] == {"data": 2, "heads": 2}
  _assert_rows_close(out["seeds/d2h2"]["rows"], out["seeds"]["rows"])
  _assert_rows_close(out["h4"]["rows"], out["one"]["rows"])
  assert out["h4_resumed_on_1"]["starts"] == [2]
  _assert_rows_close(out["h4_resumed_on_1"]["rows"], out["one"]["rows"], steps=range(2, 4))
