"""Checkpoint families as records (attn.nn.hf.FAMILIES): the kit on bare configs, one result type for
every family, to_hf without model_type, families added from outside (docs/extending.md's example run
as an installed plugin), bad records refused by name.

Tiny random models drawn by attn.testing.check_family from a config dict (numpy only), once per
module; transformers is compared where it is installed, and GPT-2's check runs with torch and
transformers hidden, to show the round trip and the refusals need neither.
"""

import dataclasses
import importlib
import os
import re
import sys
import tomllib

import numpy as np
import pytest

from attn.config import ConfigError
from attn.nn import DecoderLM, Encoder, hf
from attn.registry import PluginWarning
from attn.testing import check_family

GPT2 = dict(model_type="gpt2", vocab_size=29, n_positions=16, n_embd=12, n_layer=2, n_head=3, n_inner=20)
BERT = dict(model_type="bert", vocab_size=31, hidden_size=12, num_hidden_layers=2, num_attention_heads=3,
            intermediate_size=20, max_position_embeddings=16, type_vocab_size=2)
# GQA, head_dim != D/H, every bias, an untied output: each name and shape of the family is used.
LLAMA = dict(model_type="llama", vocab_size=23, hidden_size=16, intermediate_size=20, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=6, max_position_embeddings=16,
             tie_word_embeddings=False, attention_bias=True, mlp_bias=True)
CONFIGS = {"gpt2": GPT2, "bert": BERT, "llama": LLAMA}


@pytest.fixture(scope="module")
def checked():
  """check_family on each bare config: GPT-2 and BERT with torch and transformers hidden (their
  comparisons with transformers' own models are test_hf.py's and test_hf_families.py's), Llama
  compared with the transformers model to_hf builds where transformers is installed."""
  out = {}
  with pytest.MonkeyPatch.context() as mp:
    mp.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    mp.setitem(sys.modules, "transformers", None)
    out["gpt2"] = check_family("gpt2", GPT2, seed=1)
    out["bert"] = check_family("bert", BERT, seed=2)
  out["llama"] = check_family("llama", LLAMA, seed=3)
  return out


def test_the_kit_on_bare_configs(checked):
  for name in ("gpt2", "bert"):  # left out without transformers; the round trip and refusals ran
    assert checked[name]["logits_relative"] is None and checked[name]["loaded"].family == name
  cfg = checked["llama"]["config"]
  assert (cfg.num_kv_heads, cfg.head.d_k, cfg.use_bias, cfg.has_dense_bias, cfg.tie_embeddings) == (2, 6, True, True,
                                                                                                    False)
  if checked["llama"]["logits_relative"] is not None:
    print(f"llama: relative {checked['llama']['logits_relative']:.2e}")
    assert checked["llama"]["logits_relative"] < 1e-4


def test_from_hf_returns_one_type_for_every_family(checked):
  for name, kind in (("gpt2", DecoderLM), ("bert", Encoder), ("llama", DecoderLM)):
    state = hf.to_hf_state(checked[name]["loaded"])
    for kwargs in ({}, {"variant": "fused"}, {"num_kv_heads": 1}):
      if name != "llama" and kwargs:  # what is asked is read the same for every family: on llama (G < H) only
        continue
      with pytest.warns(hf.LossyConversionWarning) if "num_kv_heads" in kwargs else _nothing():
        loaded = hf.from_hf(state, **kwargs)
      assert type(loaded) is hf.Loaded and isinstance(loaded.model, kind), (name, kwargs)
      assert loaded.family == name == loaded.model.hf_family and len(loaded.errors) == loaded.config.num_layers
      model, cfg = loaded  # unpacks as (model, config), whatever was asked
      assert model is loaded.model and cfg is loaded.config
      assert (loaded.error > 0) == ("num_kv_heads" in kwargs), (name, kwargs, loaded.errors)
  loaded = hf.from_hf(hf.to_hf_state(checked["gpt2"]["loaded"]), variant="mla", latent_dim=12)
  assert type(loaded) is hf.Loaded and loaded.config.variant == "mla" and loaded.error < 1e-5


class _nothing:
  def __enter__(self):
    return self

  def __exit__(self, *exc):
    return False


def _same(a, b):
  assert a.keys() == b.keys()
  for k in a:
    assert np.asarray(a[k]).dtype == np.asarray(b[k]).dtype and np.array_equal(a[k], b[k]), k


def test_to_hf_of_a_loaded_model_needs_no_model_type(checked):
  for name in CONFIGS:
    loaded = checked[name]["loaded"]
    kw, sd = hf.to_hf_state(loaded.model)  # the model alone: its cfg and its family
    for told in ((loaded.model, loaded.config, name), (loaded,), (loaded.model, loaded.config, kw["model_type"])):
      kw2, sd2 = hf.to_hf_state(*told)
      assert kw2 == kw
      _same(sd, sd2)
    converted, ccfg, _ = hf.convert_model(loaded.model, loaded.config, "fused")
    assert converted.hf_family == name and hf.to_hf_state(converted)[0] == kw
  pytest.importorskip("torch")
  pytest.importorskip("transformers")
  loaded = checked["llama"]["loaded"]
  plain, told = hf.to_hf(loaded.model), hf.to_hf(loaded.model, loaded.config, "llama")
  _same({k: t.numpy() for k, t in plain.state_dict().items()}, {k: t.numpy() for k, t in told.state_dict().items()})


def test_a_family_registered_at_run_time_loads_a_checkpoint(checked):
  kw, sd = hf.to_hf_state(checked["llama"]["loaded"])
  mine = dataclasses.replace(hf.FAMILIES["llama"], name="my_llama", model_types=("my_llama",))
  with pytest.raises(ConfigError, match=r"config.model_type='my_llama' is not allowed: did you mean 'llama'\? one of \[[^]]*'bert'"):
    hf.from_hf(({**kw, "model_type": "my_llama"}, sd))
  hf.FAMILIES.register(mine)
  try:
    assert hf.FAMILIES.source("my_llama") == "register()"
    got = hf.from_hf(({**kw, "model_type": "my_llama"}, sd))
    assert got.family == "my_llama" == got.model.hf_family
    kw2, sd2 = hf.to_hf_state(got.model)
    assert kw2 == kw | {"model_type": "my_llama"}
    _same(sd, sd2)
  finally:
    hf.FAMILIES.unregister("my_llama")
  assert "my_llama" not in hf.FAMILIES


PLUGIN = '''
from attn.nn.hf.llama import LlamaLike, family

# Llama's own table under a model type of the plugin's: what a researcher's package would register.
FAMILY = family("plugged_llama", LlamaLike("LlamaForCausalLM", mlp_bias="mlp_bias"), model_types=("plugged_llama",))
NOT_A_RECORD = {"name": "plugged_llama"}
'''


def _dist(root, name, entry_points):
  info = root / f"{name}-0.1.dist-info"
  info.mkdir()
  (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
  (info / "entry_points.txt").write_text("[attn.hf_families]\n" + "".join(f"{k} = {v}\n" for k, v in entry_points))


def test_a_family_from_an_entry_point(checked, tmp_path):
  """An installed distribution (a dist-info directory on sys.path) names a family; a broken entry
  point beside it warns once and is refused by name; one naming no record is refused by name."""
  (tmp_path / "attn_plugged_family.py").write_text(PLUGIN)
  _dist(tmp_path, "attn_plugged", [("plugged_llama", "attn_plugged_family:FAMILY"),
                                   ("broken", "attn_no_such_module:FAMILY")])
  kw, sd = hf.to_hf_state(checked["llama"]["loaded"])
  sys.path.insert(0, str(tmp_path))
  importlib.invalidate_caches()
  hf.FAMILIES.reload()
  try:
    with pytest.warns(PluginWarning, match="'broken'.*attn_plugged.*ModuleNotFoundError"):
      assert "plugged_llama" in hf.FAMILIES
    assert hf.FAMILIES.source("plugged_llama") == "attn_plugged"
    got = hf.from_hf(({**kw, "model_type": "plugged_llama"}, sd))
    assert got.family == "plugged_llama"
    _same(sd, hf.to_hf_state(got)[1])
    with pytest.raises(ConfigError, match="family='broken' is not available.*failed to import"):
      hf.FAMILIES.resolve("broken", "family")
    with pytest.raises(ConfigError, match="model_type='broken'.*not loaded: entry point 'broken'"):
      hf.from_hf(({**kw, "model_type": "broken"}, sd))  # a checkpoint of the family that did not load
    _dist(tmp_path, "attn_plugged_bad", [("bad", "attn_plugged_family:NOT_A_RECORD")])
    importlib.invalidate_caches()
    hf.FAMILIES.reload()
    with pytest.raises(ConfigError, match="entry point 'bad'.*'attn_plugged_bad'.*not a attn.nn.hf.base.Family"):
      len(hf.FAMILIES)
  finally:
    sys.path.remove(str(tmp_path))
    sys.modules.pop("attn_plugged_family", None)
    importlib.invalidate_caches()
    hf.FAMILIES.reload()
  assert "plugged_llama" not in hf.FAMILIES


def test_bad_records_are_refused_naming_the_field():
  llama = hf.FAMILIES["llama"]
  for changes, match in [(dict(model_types="llama"), r"model_types='llama' is not allowed: a tuple"),
                         (dict(model_types=()), r"model_types=\(\) is not allowed"),
                         (dict(architectures=("",)), "architectures"),
                         (dict(model="decoder"), r"model='decoder' is not allowed: one of \["),
                         (dict(weights_in="weights.py"), r"weights_in='weights.py' is not allowed: a function"),
                         (dict(config_out=None), "weights_out.*given with config_out"),
                         (dict(refusals={"x": (False, "why")}), r"refusals\['x'\]"),
                         (dict(fixed={"no_such_field": 1}), r"fixed=\['no_such_field'\].*ModelConfig field")]:
    with pytest.raises(ConfigError, match=match):
      dataclasses.replace(llama, **changes)
  with pytest.raises(ConfigError, match="family.name='my llama' is not allowed: a Python identifier"):
    hf.FAMILIES.register(dataclasses.replace(llama, name="my llama"))
  with pytest.raises(ConfigError, match="family 'my_llama' has no 'config_in'"):
    hf.FAMILIES.register(dataclasses.replace(llama, name="my_llama", config_in=None))
  with pytest.raises(ConfigError, match="named 'llama': one from 'attn', one from 'register\\(\\)'"):
    hf.FAMILIES.register(dataclasses.replace(llama, model_types=("other",)))
  with pytest.raises(ConfigError, match="not a attn.nn.hf.base.Family record"):
    hf.FAMILIES.register({"name": "my_llama"})
  hf.FAMILIES.register(dataclasses.replace(llama, name="llama_again"))
  try:  # two families reading one model type: refused when a checkpoint asks, naming both
    with pytest.raises(ConfigError, match="'llama_again' \\(register\\(\\)\\).model_types.*family 'llama''s \\(attn\\)"):
      hf.model_config(LLAMA)
  finally:
    hf.FAMILIES.unregister("llama_again")
  assert hf.model_config(LLAMA).num_kv_heads == 2


def test_the_kit_catches_a_family_that_does_not_round_trip():
  llama = hf.FAMILIES["llama"]

  def sign_flipped(pure, cfg):  # a weights_out that is not weights_in's inverse
    sd = llama.weights_out(pure, cfg)
    sd["model.layers.1.self_attn.q_proj.weight"] = -sd["model.layers.1.self_attn.q_proj.weight"]
    return sd

  bad = dataclasses.replace(llama, name="bad_llama", model_types=("bad_llama",), weights_out=sign_flipped)
  where = r"\['blocks'\]\[1\]\['attn'\]\['params'\]\['w_q'\] differs"
  with pytest.raises(AssertionError, match=r"check_family\('bad_llama'\): round trip: .*" + where):
    check_family(bad, {**LLAMA, "model_type": "bad_llama"})
  assert "bad_llama" not in hf.FAMILIES  # the kit registered it for the check only


def test_a_family_whose_code_raises_is_named_with_its_hook_and_a_pass_says_what_it_checked(capsys):
  llama = hf.FAMILIES["llama"]

  def forgetful(pure, cfg):  # a weights_out that reads a key the pure tree does not have
    return {"lm_head.weight": pure["no_such_key"]}

  bad = dataclasses.replace(llama, name="forgetful", model_types=("forgetful",), weights_out=forgetful)
  # A bare config: its random checkpoint is written through weights_out, so reading it is what fails.
  with pytest.raises(AssertionError, match=r"check_family\('forgetful'\): read: at source 'forgetful': in family "
                                           r"'forgetful'.weights_out, raised KeyError: 'no_such_key'") as e:
    check_family(bad, {**LLAMA, "model_type": "forgetful"})
  assert isinstance(e.value.__cause__, KeyError) and "forgetful" not in hf.FAMILIES
  mine = dataclasses.replace(llama, name="my_llama", model_types=("my_llama",))
  check_family(mine, {**LLAMA, "model_type": "my_llama"}, verbose=True)
  first = capsys.readouterr().out.splitlines()[0]
  checked = "read, round trip, refusals" + (", transformers" if importlib.util.find_spec("transformers") else "")
  assert first == f"check_family('my_llama'): passed {len(checked.split(', '))} properties at 2 configs: {checked}"


def test_a_read_only_family_loads_and_is_checked_on_a_checkpoint(checked):
  kw, sd = hf.to_hf_state(checked["llama"]["loaded"])
  ro = dataclasses.replace(hf.FAMILIES["llama"], name="ro_llama", model_types=("ro_llama",), weights_out=None,
                           config_out=None)
  measured = check_family(ro, ({**kw, "model_type": "ro_llama"}, sd))  # refusals only: nothing to write
  assert measured["loaded"].family == "ro_llama" and measured["logits_relative"] is None
  with pytest.raises(AssertionError, match="read-only family.*checkpoint, not a bare config"):
    check_family(ro, {**LLAMA, "model_type": "ro_llama"})
  hf.FAMILIES.register(ro)
  try:
    with pytest.raises(ConfigError, match="model_type='ro_llama'.*read-only"):
      hf.to_hf_state(hf.from_hf(({**kw, "model_type": "ro_llama"}, sd)))
  finally:
    hf.FAMILIES.unregister("ro_llama")


def test_to_hf_refuses_a_config_out_without_a_transformers_class(checked):
  pytest.importorskip("torch")
  pytest.importorskip("transformers")
  llama = hf.FAMILIES["llama"]
  odd = dataclasses.replace(llama, name="odd_llama", model_types=("odd_llama",),
                            config_out=lambda cfg: llama.config_out(cfg) | {"architectures": ["NoSuchForCausalLM"]})
  loaded = checked["llama"]["loaded"]
  hf.FAMILIES.register(odd)
  try:
    with pytest.raises(ConfigError, match=r"'odd_llama'.config_out\(\)\['architectures'\]=\['NoSuchForCausalLM'\]"):
      hf.to_hf(loaded.model, loaded.config, "odd_llama")
  finally:
    hf.FAMILIES.unregister("odd_llama")


DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "extending.md")


def _blocks(marker):
  """The python and toml code blocks of a docs/extending.md section, in order."""
  text = open(DOCS, encoding="utf-8").read()
  section = text[text.index(marker):]
  section = section[:section.index("\n## ", 1)]
  return re.findall(r"```(python|toml)\n(.*?)```", section, re.S)


def test_the_docs_checkpoint_family_is_installed_by_its_entry_point_and_passes_the_kit(tmp_path):
  """docs/extending.md's family as package my_attn (the record module, its entry point read from the
  toml block), then the doc's own test run on it: the docs cannot drift from what runs."""
  (record, _), (entry, kind), (test, _) = [(code, kind) for kind, code in _blocks("## A checkpoint family")]
  assert kind == "toml"
  (tmp_path / "my_attn").mkdir()
  (tmp_path / "my_attn" / "__init__.py").write_text("")
  (tmp_path / "my_attn" / "acme.py").write_text(record)
  (tmp_path / "my_attn" / "test_acme.py").write_text(test)  # the doc's own test, as a module of the package
  entry_points = tomllib.loads(entry)["project"]["entry-points"]
  assert list(entry_points) == ["attn.hf_families"]
  _dist(tmp_path, "my_attn", list(entry_points["attn.hf_families"].items()))
  saved = {m: sys.modules.pop(m) for m in [m for m in sys.modules if m.split(".")[0] == "my_attn"]}
  sys.path.insert(0, str(tmp_path))
  importlib.invalidate_caches()
  hf.FAMILIES.reload()
  try:
    assert hf.FAMILIES.source("acme_llama") == "my_attn"
    doc_test = importlib.import_module("my_attn.test_acme")
    doc_test.test_acme_llama_family()  # check_family on the installed record, bare config: random weights
    tiny = doc_test.TINY
    with pytest.raises(ConfigError, match=r"config.acme_experts=8 is not allowed: 0: attn reads acme's dense"):
      hf.from_hf(({**tiny, "acme_experts": 8}, {}))
    cfg = hf.model_config(tiny)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head.d_k, cfg.has_dense_bias) == (4, 2, 6, False)
  finally:
    sys.path.remove(str(tmp_path))
    for m in [m for m in sys.modules if m.split(".")[0] == "my_attn"]:
      del sys.modules[m]
    sys.modules.update(saved)
    importlib.invalidate_caches()
    hf.FAMILIES.reload()
  assert "acme_llama" not in hf.FAMILIES
