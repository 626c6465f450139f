"""Records from outside attn: an installed distribution's entry points, bad plugins, the CLI on them.

The plugin package is built in a temporary directory from the code the docs show (the README's
variant, docs/extending.md's mechanism), with a `NAME-0.1.dist-info/{METADATA,entry_points.txt}`
beside it on sys.path (PYTHONPATH for subprocesses), which importlib.metadata reads as an
installed distribution: no pip needed.
"""

import contextlib
import dataclasses
import importlib
import json
import os
import re
import subprocess
import sys
import warnings

import pytest

import attn
import attn.cli
from attn import ConfigError, HeadConfig, testing
from attn.experiments.running import config as config_lib
from attn.registry import PluginWarning
from attn.variants import VARIANTS
from attn.variants.mechanisms import MECHANISMS
from conftest import TINY_MQAR, jit_apply

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python_block(path: str, marker: str) -> str:
  """The first ```python block after `marker` in a doc file."""
  text = open(os.path.join(REPO, path), encoding="utf-8").read()
  return re.search(r"```python\n(.*?)```", text[text.index(marker):], re.S).group(1)


def _distribution(root, name: str, entry_points: dict[str, dict[str, str]], files: dict[str, str]) -> str:
  """A distribution `name` under root: its files and dist-info, as pip would leave them."""
  for rel, text in files.items():
    os.makedirs(os.path.join(root, os.path.dirname(rel)), exist_ok=True)
    with open(os.path.join(root, rel), "w", encoding="utf-8") as f:
      f.write(text)
  info = os.path.join(root, f"{name}-0.1.dist-info")
  os.makedirs(info, exist_ok=True)
  with open(os.path.join(info, "METADATA"), "w") as f:
    f.write(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
  with open(os.path.join(info, "entry_points.txt"), "w") as f:
    for group, eps in entry_points.items():
      f.write(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n")
  return str(root)


@contextlib.contextmanager
def installed(*paths: str):
  """These directories on sys.path, the registries read afresh; all undone after."""
  sys.path[:0] = list(paths)
  importlib.invalidate_caches()
  VARIANTS.reload(), MECHANISMS.reload()
  try:
    yield
  finally:
    del sys.path[:len(paths)]
    for mod in [m for m in sys.modules if m.split(".")[0] in ("my_attn", "badplugin", "brokenmod", "raisingmod")]:
      del sys.modules[mod]
    importlib.invalidate_caches()
    VARIANTS.reload(), MECHANISMS.reload()


@pytest.fixture(scope="module")
def my_attn(tmp_path_factory):
  """The README's variant and docs/extending.md's mechanism, installed as distribution my_attn."""
  return _distribution(tmp_path_factory.mktemp("plugin"), "my_attn",
                       {"attn.variants": {"tempered": "my_attn:VARIANT"},
                        "attn.mechanisms": {"logit_scale": "my_attn.scale:MECHANISM"}},
                       {"my_attn/__init__.py": _python_block("README.md", "### From your own repository"),
                        "my_attn/scale.py": _python_block("docs/extending.md", "## A head mechanism")})


def test_the_readme_variant_is_at_most_40_lines():
  assert len(_python_block("README.md", "### From your own repository").splitlines()) <= 40


@pytest.mark.slow  # the kit on a plugin's mechanism over every check: seconds
def test_an_installed_plugin_is_found_counted_and_its_mechanism_passes_the_kit(my_attn, capsys):
  with installed(my_attn):
    assert attn.cli.main(["count", "--d-model", "8", "--num-heads", "2", "--variant", "tempered",
                          "--format", "csv"]) == 0
    header, row = capsys.readouterr().out.strip().splitlines()
    assert header.endswith(",measured") and row.startswith("tempered,290,290,") and row.endswith(
        ",analytic effective score_weights score_weights_per_head flops_fwd flops_fwd_bwd "
        "kv_bytes_per_token kv_bytes_at_T")
    assert VARIANTS.source("tempered") == "my_attn" and MECHANISMS.source("logit_scale") == "my_attn"
    testing.check_mechanism(MECHANISMS["logit_scale"])  # on the logits: the explicit-logits path
    counts = attn.count.param_counts("tempered", HeadConfig(d_model=8, num_heads=2, use_bias=False))
    assert counts["analytic"] == counts["stored"] == 8 * 4 * 8 + 2  # no closed form: the stored count
    assert attn.count.measured_figures("tempered", HeadConfig(d_model=8, num_heads=2)) == [
        "analytic", "effective", "score_weights", "flops", "kv_cache"]
    # the README's apply has the documented signature, no default for opts: every caller passes it
    assert attn.cli.main(["count", "--d-model", "8", "--num-heads", "2", "--format", "csv"]) == 0
    names = [line.split(",")[0] for line in capsys.readouterr().out.strip().splitlines()[1:]]
    assert names == list(VARIANTS) and "tempered" in names and "per_head" in names
    testing.check_variant("tempered")


RAISES = """
from attn import Variant
from attn.variants import per_head
def apply(params, x_BTD, context_BSD=None, *, cfg, opts):
  raise RuntimeError("plugin bug")
VARIANT = Variant(name="raises", init=per_head.init, apply=apply)
"""


@pytest.mark.slow
def test_count_keeps_every_builtin_row_when_a_plugin_fails_at_call_time(tmp_path, capsys):
  with installed(_bad(tmp_path, "raisingmod", RAISES, {"raises": "raisingmod:VARIANT"})):
    assert attn.cli.main(["count", "--d-model", "8", "--num-heads", "2", "--format", "csv"]) == 0
    out = capsys.readouterr()
    names = [line.split(",")[0] for line in out.out.strip().splitlines()[1:]]
    assert names == [n for n in VARIANTS if n != "raises"] and "per_head" in names
    [line] = out.err.strip().splitlines()
    assert line.startswith("attn count: variant 'raises' left out: entry point 'raises' (raisingmod:VARIANT) "
                           "of distribution 'raisingmod'") and line.endswith("RuntimeError: plugin bug")
    # asked for by name, its failure is the command's
    assert attn.cli.main(["count", "--d-model", "8", "--num-heads", "2", "--variant", "raises"]) == 1


@pytest.mark.slow
def test_the_readme_variant_passes_the_kit_thoroughly(my_attn):
  with installed(my_attn):
    testing.check_variant("tempered", thorough=True)


def test_a_plugin_mechanisms_options_are_validated_and_in_the_trial_id(my_attn):
  with installed(my_attn):
    cfg = HeadConfig(d_model=8, num_heads=2)
    with pytest.raises(ConfigError, match=r"extra.logit_scale.factor=-1 is not allowed: a positive number"):
      attn.api.check_config("per_head", cfg.replace(extra={"logit_scale": {"factor": -1}}))
    with pytest.raises(ConfigError, match=r"extra.logit_scale.bogus=1 is not allowed: an option "
                                          r"mechanism 'logit_scale' declares: one of \['factor'\]"):
      attn.api.check_config("per_head", cfg.replace(extra={"logit_scale": {"bogus": 1}}))
    with pytest.raises(ConfigError, match=r"extra.nope=\{\} is not allowed: one of \[.*'logit_scale'"):
      attn.api.check_config("per_head", cfg.replace(extra={"nope": {}}))
    with pytest.raises(ConfigError, match=r"extra.gate=\{\} is not allowed: no entry: 'gate' is a built-in"):
      attn.api.check_config("per_head", cfg.replace(extra={"gate": {}}))
    toml = TINY_MQAR + '[train]\nsteps = 1\n[sweep]\nseeds = [0]\n'
    plain = config_lib.loads(toml, "p").trials[0]
    scaled = config_lib.loads(toml, "p", ["model.extra.logit_scale={factor=3.0}"]).trials[0]
    also = config_lib.loads(toml.replace("[train]", "[model.extra.logit_scale]\nfactor = 3.0\n[train]"),
                            "p").trials[0]
    assert scaled.id == also.id != plain.id
    assert scaled.config["model"]["extra"] == {"logit_scale": {"factor": 3.0}}
    assert "extra" not in json.dumps(config_lib.loads(toml, "p", ["model.extra={}"]).trials[0].id)
    with pytest.raises(ConfigError, match="extra.logit_scale.factor=0"):
      config_lib.loads(toml, "p", ["model.extra.logit_scale={factor=0}"])


def _bad(tmp_path, name, source, entry_points, group="attn.variants"):
  return _distribution(tmp_path / name, name, {group: entry_points}, {f"{name}.py" if name != "badplugin"
                                                                    else "badplugin.py": source})


BAD = '''
import jax.numpy as jnp
from attn import Variant
from attn.variants import per_head
NO_INIT = Variant(name="no_init", init=None, apply=per_head.apply)
DASHED = Variant(name="my-variant", init=per_head.init, apply=per_head.apply)
NOT_A_RECORD = {"name": "x", "init": per_head.init}
DUP = Variant(name="dup", init=per_head.init, apply=per_head.apply)
PER_HEAD = Variant(name="per_head", init=per_head.init, apply=per_head.apply)
'''


@pytest.mark.parametrize("value, error", [
    ("NO_INIT", r"entry point 'v' \(badplugin:NO_INIT\) of distribution 'badplugin', group 'attn.variants': "
                r"variant 'no_init' has no 'init'"),
    ("DASHED", r"entry point 'v' \(badplugin:DASHED\) of distribution 'badplugin'.*: "
               r"variant.name='my-variant' is not allowed: a Python identifier"),
    ("NOT_A_RECORD", r"entry point 'v' \(badplugin:NOT_A_RECORD\) of distribution 'badplugin'.* names dict "
                     r".*not a attn.variants.base.Variant record"),
    ("PER_HEAD", r"two variants named 'per_head': one from 'attn', one from 'badplugin'"),
])
def test_a_malformed_record_is_refused_naming_distribution_entry_point_and_field(tmp_path, value, error):
  with installed(_bad(tmp_path, "badplugin", BAD, {"v": f"badplugin:{value}"})):
    with pytest.raises(ConfigError, match=error):
      VARIANTS.resolve("per_head")


def test_two_plugins_with_one_name_are_refused_naming_both(tmp_path):
  a = _distribution(tmp_path / "a", "plugin_a", {"attn.variants": {"dup": "badplugin:DUP"}},
                    {"badplugin.py": BAD})
  b = _distribution(tmp_path / "b", "plugin_b", {"attn.variants": {"dup": "badplugin:DUP"}}, {})
  with installed(a, b):
    with pytest.raises(ConfigError, match=r"two variants named 'dup': one from 'plugin_[ab]', "
                                          r"one from 'plugin_[ab]'"):
      list(VARIANTS)


BROKEN = "raise RuntimeError('boom')\n"


def test_a_plugin_that_fails_to_import_warns_once_and_the_rest_works(tmp_path):
  with installed(_bad(tmp_path, "brokenmod", BROKEN, {"broken": "brokenmod:VARIANT"})):
    with warnings.catch_warnings(record=True) as seen:
      warnings.simplefilter("always")
      assert "per_head" in VARIANTS and "broken" not in VARIANTS
      VARIANTS.resolve("fused")
    assert [str(w.message) for w in seen if w.category is PluginWarning] == [
        "attn: skipped entry point 'broken' (brokenmod:VARIANT) of distribution 'brokenmod', group "
        "'attn.variants': RuntimeError: boom"]
    with pytest.raises(ConfigError, match=r"variant='broken' is not available: entry point 'broken' .* "
                                          r"failed to import \(RuntimeError: boom\)"):
      attn.init("broken", None, HeadConfig(d_model=8, num_heads=2))


def test_register_is_for_this_process_and_dispatches_by_record_type():
  record = attn.VARIANTS["per_head"]
  mine = attn.register(dataclasses.replace(record, name="mine"))
  try:
    assert attn.VARIANTS["mine"] is mine and attn.VARIANTS.source("mine") == "register()"
    with pytest.raises(ConfigError, match="two variants named 'mine'"):
      attn.register(mine)
  finally:
    attn.VARIANTS.unregister("mine")
  with pytest.raises(ConfigError, match=r"record=int 3 is not allowed: one of .*Mechanism, .*Variant"):
    attn.register(3)


# ------------------------------------------------------------------ the CLI, in subprocesses


def _attn(env_path: str, *args, timeout=600):
  env = {**os.environ, "PYTHONPATH": env_path + os.pathsep + REPO}
  return subprocess.run([sys.executable, "-m", "attn", *args], cwd=REPO, env=env, capture_output=True,
                        text=True, timeout=timeout)


@pytest.mark.slow
def test_attn_count_and_sweep_with_two_workers_run_an_installed_plugin(my_attn, tmp_path):
  out = _attn(my_attn, "count", "--d-model", "8", "--num-heads", "2", "--variant", "tempered",
              "--variant", "per_head")
  assert out.returncode == 0, out.stderr
  row = next(line for line in out.stdout.splitlines() if line.startswith("| tempered"))
  assert row.count("(measured)") == 8 and "| 290 (measured) | 290 |" in row  # 4·64 + 4·8 + H
  cfg = tmp_path / "c.toml"
  cfg.write_text(TINY_MQAR.replace("d_ff = 16", 'd_ff = 16\nvariant = "tempered"')
                 + "[model.extra.logit_scale]\nfactor = 1.5\n[train]\nsteps = 3\nbatch_size = 2\n"
                 "eval_every = 3\neval_batches = 1\n[sweep]\nseeds = [0]\n"
                 '[sweep.grid]\n"model.extra.logit_scale.factor" = [1.5, 3.0]\n')  # its option, swept
  run = _attn(my_attn, "sweep", str(cfg), "--out", str(tmp_path / "out"), "--workers", "2", "--no-report")
  assert run.returncode == 0, run.stdout + run.stderr
  assert "workers done: 2 trials: 2 ok" in run.stdout + run.stderr
  header = json.load(open(tmp_path / "out" / "sweep.json"))
  factors = []
  for t in header["trials"]:
    summary = json.load(open(tmp_path / "out" / "trials" / t["id"] / "config.json"))
    assert summary["model"]["variant"] == "tempered"
    factors.append(summary["model"]["extra"]["logit_scale"]["factor"])
    assert t["label"]["model.extra.logit_scale.factor"] == factors[-1]
  assert factors == [1.5, 3.0]
  report = _attn(my_attn, "report", str(tmp_path / "out"))
  assert report.returncode == 0, report.stderr
  rows = [r for r in open(tmp_path / "out" / "report.md").read().splitlines() if "| tempered" in r
          or r.startswith("| " + header["trials"][0]["id"])]
  assert rows and all(r.count("(measured)") == 3 for r in rows)  # analytic, effective, FLOPs
  assert "logit_scale.factor=3.0" in open(tmp_path / "out" / "report.md").read()
  bad = _attn(my_attn, "count", "--extra", "{logit_scale = {factor = 0}}")
  assert bad.returncode == 2 and bad.stdout == "" and "Traceback" not in bad.stderr
  assert bad.stderr.strip().splitlines()[-1] == (
      "attn count: error: extra.logit_scale.factor=0 is not allowed: a positive number")


@pytest.mark.slow
def test_the_cli_names_a_broken_plugin_in_one_line_and_no_traceback(tmp_path):
  path = _bad(tmp_path, "brokenmod", BROKEN, {"broken": "brokenmod:VARIANT"})
  ok = _attn(path, "count", "--variant", "per_head")
  assert ok.returncode == 0 and "| per_head |" in ok.stdout
  bad = _attn(path, "count", "--variant", "broken")
  assert bad.returncode == 2 and "Traceback" not in bad.stderr
  lines = bad.stderr.strip().splitlines()
  assert lines[0].startswith("attn: warning: attn: skipped entry point 'broken'") and "boom" in lines[0]
  assert lines[-1].startswith("attn count: error: variant='broken' is not available")


def test_the_nnx_module_takes_a_record_that_is_not_registered():
  import jax
  import numpy as np
  from flax import nnx
  record = dataclasses.replace(VARIANTS["per_head"], name="unregistered")
  cfg = HeadConfig(d_model=8, num_heads=2, d_k=3, d_v=5, num_kv_heads=1)
  mha = attn.MultiHeadAttention(cfg, record, rngs=nnx.Rngs(0))
  assert "unregistered" not in VARIANTS and mha.record is record and mha.variant == "unregistered"
  x = jax.numpy.asarray(np.random.default_rng(1).standard_normal((2, 5, 8)).astype(np.float32))  # no compile
  want = jit_apply("per_head", mha.params_dict(), x, cfg=cfg, is_causal=True)
  # compiled whole (eager, each small op compiles on its own)
  np.testing.assert_array_equal(nnx.jit(lambda m, x: m(x, is_causal=True))(mha, x), want)
  mha.init_cache(2, 5)
  np.testing.assert_allclose(nnx.jit(lambda m, x: m(x, decode=True))(mha, x[:, :1]), want[:, :1], rtol=1e-5, atol=1e-6)
