"""Every setting the README and docs/ show takes effect (issue 55, item 1).

The examples are read out of the docs themselves: their TOML blocks ([model], [task], [train] tables,
[sweep] keys, grid and zip axes, [[sweep.cases]]), their `--set` chains and their inline
`section.key = value`. Each example is a group of settings applied together to a small base sweep;
each setting is then left out in turn, and the trial it trains must differ: in its model's layers
(each layer's variant and HeadConfig), its parameter tree or its output (shapes, dtypes; values
where those agree), or in its [task] / [train] section or the sweep's trials. A setting whose
absence is refused (another one of the group needs it) takes effect too; one whose absence
resolves to the same trial config is its default, and is skipped.
"""

import json
import pathlib
import re
import tomllib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attn
from attn import ConfigError, Mechanism
from attn.experiments.running import config as config_lib
from attn.nn.config import ModelConfig
from attn.nn.models import DecoderLM
from attn.variants.mechanisms import MECHANISMS
from conftest import logit_scale_check, logit_scale_logits

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BASE = """
[task]
name = "mqar"
vocab_size = 16
seq_len = 12
num_pairs = 2
[model]
d_model = 32
num_layers = 2
num_heads = 4
d_ff = 32
[train]
steps = 2
batch_size = 2
[sweep]
seeds = [0]
"""
SECTIONS = ("task", "model", "train", "sweep")
TABLES = {("model", "layer_heads"), ("model", "extra"), ("train", "mesh")}  # set leaf by leaf


def _leaves(section: str, table: dict) -> dict:
  """{dotted key: value} of one section; the tables of TABLES down to their leaves."""
  out = {}
  for key, value in table.items():
    if (section, key) in TABLES and isinstance(value, dict):
      stack = [(f"{section}.{key}", value)]
      while stack:
        prefix, inner = stack.pop()
        for k, v in inner.items():
          (stack.append((f"{prefix}.{k}", v)) if isinstance(v, dict) and v else out.__setitem__(f"{prefix}.{k}", v))
    else:
      out[f"{section}.{key}"] = value
  return out


def _toml_groups(raw: dict) -> list[dict]:
  groups = [_leaves(s, raw[s]) for s in ("task", "model", "train") if isinstance(raw.get(s), dict)]
  sweep = raw.get("sweep", {})
  for key, value in sweep.items():
    if key not in ("grid", "zip", "cases"):
      groups.append({f"sweep.{key}": value})
  for key, values in sweep.get("grid", {}).items():
    groups += [{key: v} for v in values]
  tied = sweep.get("zip", {})
  groups += [dict(zip(tied, values)) for values in zip(*tied.values())] if tied else []
  for case in sweep.get("cases", []):
    groups.append({k: v for s in SECTIONS if isinstance(case.get(s), dict) for k, v in _leaves(s, case[s]).items()})
  return [g for g in groups if g]


def _value(text: str):
  """A documented value as TOML, or None where it is a placeholder (N, NAME) or not TOML."""
  try:
    return tomllib.loads(f"v = {text}")["v"]
  except tomllib.TOMLDecodeError:
    return None


def _set_group(line: str) -> dict:
  """{dotted key: value} of the --set items of one command line (placeholders like N, NAME left out)."""
  group = {}
  for item in re.findall(r"--set\s+('[^']*'|\"[^\"]*\"|\S+)", line):
    key, _, value = item.strip("'\"").partition("=")
    value = _value(value)
    if value is not None and not re.search(r"[A-Z]", key):
      section, _, field = key.partition(".")
      group.update(_leaves(section, {field: value}))
  return group


def documented() -> list[tuple[str, dict]]:
  """(where, {dotted key: value}) for each group of settings the README and docs/ show."""
  out = []
  for path in DOCS:
    text, name = path.read_text(), path.relative_to(ROOT).as_posix()
    for lang, body in re.findall(r"```(\w*)\n(.*?)```", text, re.S):
      if lang == "toml":
        raw = tomllib.loads(body)
        if set(raw) <= set(SECTIONS):
          out += [(f"{name} TOML", g) for g in _toml_groups(raw)]
      out += [(f"{name} --set", g) for g in map(_set_group, body.replace("\\\n", " ").splitlines()) if g]
    spans = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    out += [(f"{name} inline --set", g) for g in map(_set_group, spans) if g]
    for key, value in re.findall(r"`((?:model|task|train|sweep)\.[a-z_.]+) = ([^`]+)`", text):
      if _value(value) is not None:
        out.append((f"{name} inline", {key: _value(value)}))
  return out


def _inline(value) -> str:
  if isinstance(value, dict):
    return "{" + ", ".join(f"{k} = {_inline(v)}" for k, v in value.items()) + "}"
  if isinstance(value, list):
    return "[" + ", ".join(_inline(v) for v in value) + "]"
  return json.dumps(value)


def _overrides(group: dict) -> list[str]:
  """--set items for a group: a key into a table sets the whole table, its leaves merged."""
  tables, out = {}, []
  for key, value in group.items():
    parts = key.split(".")
    if tuple(parts[:2]) in TABLES and len(parts) > 2:
      inner = tables.setdefault(".".join(parts[:2]), {})
      for p in parts[2:-1]:
        inner = inner.setdefault(p, {})
      inner[parts[-1]] = value
    else:
      out.append(f"{key}={_inline(value)}")
  return out + [f"{k}={_inline(v)}" for k, v in tables.items()]


def _layers(cfg: dict) -> tuple:
  """Each layer's variant and HeadConfig, and the parameter count: what most settings change."""
  m = ModelConfig(**cfg)
  layers = tuple((m.layer_variant(i), m.layer_head(i)) for i in range(m.num_layers) if m.has_attention(i))
  return layers, attn.count.model_param_count(m, "decoder_lm")


def _abstract(cfg: dict) -> tuple:
  """The parameter tree and the output, as shapes and dtypes (a dtype, a layout of the same size)."""
  def build_and_run():
    model = DecoderLM(ModelConfig(**cfg), rngs=nnx.Rngs(0))
    return nnx.state(model, nnx.Param), model(jnp.zeros((1, 8), jnp.int32))

  params, out = jax.eval_shape(build_and_run)
  leaves = jax.tree_util.tree_leaves_with_path(params)
  return tuple((jax.tree_util.keystr(p), x.shape, x.dtype) for p, x in leaves), out.shape, out.dtype


def _output(cfg: dict) -> np.ndarray:
  """The output on fixed tokens: what is left (an initialisation scale, an epsilon)."""
  model = DecoderLM(ModelConfig(**cfg), rngs=nnx.Rngs(0))
  return np.asarray(model(jnp.arange(8, dtype=jnp.int32)[None] % cfg["vocab_size"]), np.float32)


def _differ(a: dict, b: dict) -> bool:
  """Whether two trials' models differ, by the cheapest measure that tells them apart."""
  return any(not np.array_equal(f(a), f(b)) if f is _output else f(a) != f(b) for f in (_layers, _abstract, _output))


def _resolve(group: dict):
  """The sweep of BASE with the group's settings (num_layers fits a documented layer_types), or the refusal."""
  layers = len(group.get("model.layer_types", [None, None]))
  try:
    return config_lib.loads(BASE, "docs", [f"model.num_layers={layers}", *_overrides(group)])
  except ConfigError as e:
    return str(e)


@pytest.fixture(scope="module")
def logit_scale():
  """docs/extending.md's outside mechanism, registered for these tests."""
  attn.register(Mechanism(name="logit_scale", defaults={"factor": 2.0}, check=logit_scale_check,
                          on_logits=logit_scale_logits))
  try:
    yield
  finally:
    MECHANISMS.unregister("logit_scale")


EXAMPLES = documented()


def test_the_docs_show_the_settings_a_newcomer_needs():
  keys = {k for _, g in EXAMPLES for k in g}
  assert {"model.layer_types", "model.linear_variant", "model.layer_heads.linear_attention.variant",
          "model.layer_heads.full_attention.variant", "model.kv_source", "model.window"} <= keys
  assert len(EXAMPLES) >= 10


@pytest.mark.parametrize("where, group", EXAMPLES, ids=[f"{w}:{','.join(g)}"[:90] for w, g in EXAMPLES])
def test_each_documented_setting_changes_the_model_it_claims_to(logit_scale, where, group):
  full = _resolve(group)
  if isinstance(full, str):  # refused by name: it needs a setting the example leaves out
    named = {".".join(k.split(".")[:i]) for k in group for i in range(2, k.count(".") + 2)}
    assert any(k in full for k in named), f"{where}: {group} is refused without naming a key: {full}"
    return
  for key in group:
    rest = _resolve({k: v for k, v in group.items() if k != key})
    if isinstance(rest, str):
      continue  # the group's other settings need this one: it takes effect
    configs = [t.config for t in full.trials], [t.config for t in rest.trials]
    if configs[0] == configs[1] and (full.pack, full.vmap_seeds) == (rest.pack, rest.vmap_seeds):
      continue  # the documented value is the default
    if key.startswith("sweep.") or len(configs[0]) != len(configs[1]):
      assert ([t.id for t in full.trials], full.pack, full.vmap_seeds) != (
          [t.id for t in rest.trials], rest.pack, rest.vmap_seeds), f"{where}: {key} changes no trial"
      continue
    for a, b in zip(*configs):
      if a["model"] == b["model"]:
        assert a != b, f"{where}: {key}={group[key]!r} is ignored: the trial is the same without it"
      else:
        assert _differ(a["model"], b["model"]), (
            f"{where}: {key}={group[key]!r} is ignored: the model trains the same without it")


def test_the_layer_type_variant_of_a_linear_layer_is_the_one_trained():
  """The issue's case: layer_heads.linear_attention.variant = "mamba2" trained gated DeltaNet."""
  kinds = '["linear_attention", "full_attention"]'
  base = ["model.num_layers=2", f"model.layer_types={kinds}", 'model.variant="per_head"']
  mamba = config_lib.loads(BASE, "b", base + ['model.layer_heads={linear_attention={variant="mamba2"}}'])
  named = config_lib.loads(BASE, "b", base + ['model.linear_variant="mamba2"'])
  plain = config_lib.loads(BASE, "b", base)
  cfg = ModelConfig(**mamba.trials[0].config["model"])
  assert [cfg.layer_variant(i) for i in range(2)] == ["mamba2", "per_head"]
  assert attn.count.model_param_count(cfg, "decoder_lm") == attn.count.model_param_count(
      ModelConfig(**named.trials[0].config["model"]), "decoder_lm") != attn.count.model_param_count(
      ModelConfig(**plain.trials[0].config["model"]), "decoder_lm")


@pytest.mark.parametrize("sets, words", [
    (['model.linear_variant="kda"', 'model.layer_heads={linear_attention={variant="mamba2"}}'],
     r"layer_heads.linear_attention.variant='mamba2' is not allowed: unset, or 'kda' .*set one of the two"),
    (['model.layer_heads={linear_attention={variant="per_head"}}'],
     r"layer_heads.linear_attention.variant='per_head' is not allowed: a variant with a fixed-size state"),
    (['model.layer_heads={linear_attention={rope_dim=4}}'],
     r"layer_heads.linear_attention.rope_dim=4 is not allowed: left out: a linear_attention layer keeps only"),
    (['model.layer_heads={linear_attention={d_k=4}}', "model.linear_head={d_k=8}"],
     r"layer_heads.linear_attention.d_k=4 is not allowed: unset: linear_head.d_k=8 sets it"),
])
def test_a_linear_layer_type_setting_it_would_not_read_is_refused_by_name(sets, words):
  base = ["model.num_layers=2", 'model.layer_types=["linear_attention", "full_attention"]']
  with pytest.raises(ConfigError, match=words):
    config_lib.loads(BASE, "b", base + sets)
