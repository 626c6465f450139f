"""Counting: three parameter counts, FLOPs vs XLA, KV cache, whole models, published tables, CLI.

Published numbers are written here from their sources (Hugging Face checkpoints,
Vaswani et al. 2017 Table 3), not taken from attn.count.presets.
"""

import contextlib
import functools
import io
import json
import math
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attn
from attn import ConfigError, HeadConfig, cli, count, kernel
from attn.count import presets
from attn.nn import models
from attn.variants import VARIANTS
from attn.nn.config import ModelConfig
from conftest import CONFIGS, for_variant, randn, random_params, tier, variant_params


def random_configs(n: int, seed: int = 0) -> list[HeadConfig]:
  """Random small HeadConfigs: d_v != d_k, G < H, no bias, h not dividing D all occur."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    H = int(rng.integers(1, 7))
    G = int(rng.choice([g for g in range(1, H + 1) if H % g == 0]))
    D = H * int(rng.integers(1, 6)) if rng.random() < 0.6 else int(rng.integers(3, 30))
    out.append(HeadConfig(d_model=D, num_heads=H, d_k=int(rng.integers(1, 9)),
                          d_v=int(rng.integers(1, 9)), num_kv_heads=G,
                          use_bias=bool(rng.random() < 0.5),
                          collab_width=int(rng.integers(1, 20))))
  return out


ALL_CONFIGS = list(CONFIGS.values()) + random_configs(10)


def accepted(name: str, configs: list[HeadConfig]) -> list[HeadConfig]:
  out = []
  for cfg in configs:
    try:
      attn.api.check_config(name, cfg)
      out.append(cfg)
    except ConfigError:
      pass
  assert len(out) >= 4, f"{name} accepts too few test configs to mean anything"
  return out


# ---------------------------------------------------------------- per layer


# Heads with a fixed-size state (attn.variants.linear) form no attention weights and cache no keys:
# the tests of those below read the others; the state heads' own are in tests/test_linear_variants.py.
WEIGHTED = [n for n in sorted(attn.VARIANTS) if attn.VARIANTS[n].init_state is None]


@pytest.mark.parametrize("name", variant_params())
def test_analytic_equals_stored_and_effective_at_most_stored(name):
  configs = accepted(name, ALL_CONFIGS)
  for cfg in configs:
    c = count.param_counts(name, cfg)
    assert c["analytic"] == c["stored"], cfg
    if c["effective"] is None:  # no closed form (the state heads) and too large for the Jacobian
      assert "effective" in count.measured_figures(name, cfg) and c["stored"] > JACOBIAN_MAX_PARAMS
      continue
    assert 0 < c["effective"] <= c["stored"], cfg
  # "stored" is read from shapes; the arrays attn.init really makes agree.
  params = jax.jit(attn.init, static_argnums=(0, 2))(name, jax.random.PRNGKey(0), configs[-1])  # one compile
  assert count.param_counts(name, configs[-1])["stored"] == sum(a.size for a in params.values())


def test_same_function_class_same_effective_count():
  # per_head, fused and two_stage compute the same function class (seed questions 1, 2).
  for cfg in ALL_CONFIGS:
    eff = {n: count.param_counts(n, cfg)["effective"] for n in ("per_head", "fused", "two_stage")}
    assert len(set(eff.values())) == 1, (cfg, eff)


def _accepts(name: str, cfg: HeadConfig) -> bool:
  try:
    attn.api.check_config(name, cfg)
  except ConfigError:
    return False
  return True


# The effective count is the Jacobian's rank (attn.testing.check_effective_count): the kit checks
# every variant at its small configs (tests/test_contract.py); these are the shapes where a
# formula has a case of its own.
JACOBIAN_CASES = [
    pytest.param("per_head", HeadConfig(d_model=4, num_heads=2, d_k=5, d_v=5, use_bias=False),
                 id="per_head-dk>D"),
    pytest.param("collaborative", HeadConfig(d_model=6, num_heads=3, d_k=2, d_v=2, collab_width=7,
                                             use_bias=False), id="collaborative-width7"),
    pytest.param("split_input", HeadConfig(d_model=6, num_heads=3, d_k=4, d_v=2), id="split_input-dk>D/H"),
] + [pytest.param(name, HeadConfig(**dims), id=f"{name}-{label}", marks=pytest.mark.slow)
     for name, label, dims in [
         # RoPE (rope_theta small, so that T = 5 positions tell the frequencies apart): the rotated
         # dims have their own count and the key bias stays (base.rope_score_dof).
         ("per_head", "rope-mqa", dict(d_model=4, num_heads=2, d_k=4, d_v=2, num_kv_heads=1,
                                        rope_dim=2, rope_theta=3.0)),
         ("split_input", "rope", dict(d_model=6, num_heads=3, d_k=4, d_v=2, rope_dim=2,
                                      rope_theta=3.0)),
         ("talking_heads", "rope", dict(d_model=4, num_heads=2, d_k=3, d_v=2, num_kv_heads=1,
                                        rope_dim=2, rope_theta=3.0)),
         # mla with latents narrower than G·(K + V) and H·K, with and without a RoPE key.
         ("mla", "qlatent-nobias", dict(d_model=6, num_heads=3, d_k=2, d_v=2, latent_dim=4,
                                        q_latent_dim=3, use_bias=False)),
         ("mla", "qlatent-rope", dict(d_model=6, num_heads=2, d_k=4, d_v=2, latent_dim=3,
                                      q_latent_dim=4, rope_dim=2, rope_theta=3.0)),
     ]]


@pytest.mark.parametrize("name, cfg", JACOBIAN_CASES)
def test_effective_count_is_the_rank_of_the_jacobian(name, cfg):
  attn.testing.check_effective_count(name, cfg)


@pytest.mark.parametrize("name", variant_params(WEIGHTED))
def test_score_weights_are_the_weights_the_logits_depend_on(name):
  cfg = for_variant(name, HeadConfig(d_model=12, num_heads=4, d_k=3, d_v=5, num_kv_heads=2, collab_width=7))
  params = random_params({n: np.zeros(s, np.float32) for n, s in attn.param_shapes(name, cfg).items()}, 3)
  x_BTD, r_BHTS = randn(4, (2, 5, cfg.d_model)), randn(5, (2, 4, 5, 5))  # numpy draws: no compile
  opts = attn.api.Options(return_weights=True)
  loss = lambda p: (attn.VARIANTS[name].apply(p, x_BTD, None, cfg=cfg, opts=opts)[1]
                    * r_BHTS).sum()
  grads = jax.jit(jax.grad(loss))(params)
  touched = sum(int((jnp.abs(g) > 0).sum()) for k, g in grads.items() if not k.startswith("b"))
  assert touched == count.score_weight_count(name, cfg)


def test_seed_question_score_weights_per_head():
  cfg = HeadConfig(d_model=512, num_heads=8, d_k=64)
  assert count.score_weight_count("per_head", cfg) == 8 * 2 * 512 * 64
  assert count.score_weight_count("merged", cfg) == 8 * 512 * 512
  assert count.param_counts("per_head", cfg)["analytic"] == 4 * 512 * 512 + 4 * 512


from attn.count.measured import JACOBIAN_MAX_PARAMS, xla_flops  # noqa: E402  (tests/test_mla.py and test_mechanisms.py read it here)


# FLOPs against XLA's cost analysis: the kit (attn.testing), for every variant.


def test_flops_default_S_is_T_and_bad_lengths_are_refused():
  cfg = CONFIGS["gqa"]
  assert count.flops("fused", cfg, 9) == count.flops("fused", cfg, 9, 9)
  for bad in (0, -3, 2.5, True):
    with pytest.raises(ConfigError, match="T"):
      count.flops("fused", cfg, bad)


def test_kv_cache_mha_gqa_mqa():
  # Per token per layer: a key (d_k) and a value (d_v) for each of the G kv heads.
  mha, gqa, mqa = (HeadConfig(d_model=512, num_heads=8, num_kv_heads=g) for g in (8, 2, 1))
  for name in ("per_head", "fused", "two_stage", "split_input"):
    assert count.kv_cache_bytes_per_token(name, mha, "bfloat16") == 2 * 8 * 64 * 2
    assert count.kv_cache_bytes_per_token(name, gqa, "bfloat16") == 2 * 2 * 64 * 2
    assert count.kv_cache_bytes_per_token(name, mqa, "float32") == 2 * 1 * 64 * 4
  # merged: the raw context (512) that x·W_h is scored against, plus values.
  assert count.kv_cache_bytes_per_token("merged", mqa, "float16") == (512 + 64) * 2
  with pytest.raises(ConfigError, match="dtype"):
    count.kv_cache_bytes_per_token("fused", mha, "not-a-dtype")


# A variant with a cache of its own (kv_cache_elements: compressed's window, pooled entries and pending
# block) grows by other than its kernel's columns per token; tests/test_compressed.py checks that cache
# against the arrays it holds after each length.
@pytest.mark.parametrize("name", variant_params([n for n in WEIGHTED if attn.VARIANTS[n].kv_cache_elements is None]))
def test_kv_cache_width_is_what_the_kernel_reads_from_the_context(name, monkeypatch):
  # The distinct key and value columns the kernel receives in the variant's decode form
  # (decode_apply, else apply) = what a decoder must cache. A column repeated (a kv head shared
  # by query heads, mla's latent read as key and as value) is cached once; a constant one
  # (mla's column of ones carrying b_v) not at all. Keys and values are read where the kernel
  # takes them: attention(q, k, v), or its pieces scores(q, k) and weighted_sum(w, v) for a
  # variant that mixes explicit logits (talking_heads). A variant whose kernel reads keys and values
  # rebuilt from what it caches (cache_entries without decode_apply: tpa's factors) is read there.
  cfg = for_variant(name, HeadConfig(d_model=12, num_heads=6, d_k=3, d_v=5, num_kv_heads=3, collab_width=7))
  traced = []  # the kernel's key and value arguments, as traced inside one jitted call

  def spy(fn, *read):
    def wrapped(*args, **kwargs):
      traced.extend(args[i] for i in read)
      return fn(*args, **kwargs)
    return wrapped

  for fn_name, read in (("attention", (1, 2)), ("scores", (1,)), ("weighted_sum", (1,))):
    monkeypatch.setattr(kernel, fn_name, spy(getattr(kernel, fn_name), *read))
  params = random_params({n: np.zeros(s, np.float32) for n, s in attn.param_shapes(name, cfg).items()}, 1)
  v = attn.VARIANTS[name]
  x_BTD = randn(1, (1, 4, 12))

  @jax.jit  # one compile; the arguments the spies saw come back as its outputs
  def kernel_inputs(params, x_BTD):
    traced.clear()
    if v.cache_entries is not None and v.decode_apply is None:
      opts = attn.api.Options(qk_positions=(jnp.arange(4), jnp.arange(4)))
      return list(v.cache_entries(params, x_BTD, cfg=cfg, opts=opts).values())
    (v.decode_apply or v.apply)(params, x_BTD, cfg=cfg)
    return list(traced)

  seen = [np.asarray(a) for a in kernel_inputs(params, x_BTD)]
  assert seen, "the variant did not call attn.kernel"
  columns = []
  for a_BSGW in seen:
    for g in range(a_BSGW.shape[2]):
      for w in range(a_BSGW.shape[3]):
        col = a_BSGW[:, :, g, w]
        if np.ptp(col) > 0 and not any(np.array_equal(col, c) for c in columns):
          columns.append(col)
  assert count.kv_cache_bytes_per_token(name, cfg, jnp.int8) == len(columns)


def test_every_variant_has_cache_and_score_formulas():
  # The formulas live on the Variant, in the variant's own file; count.py reads them.
  for name, v in attn.VARIANTS.items():
    for cfg in CONFIGS.values():
      try:
        v.check(cfg)
      except ConfigError:
        continue
      score = v.score_weights(cfg)
      if v.kv_cache_elements is not None:  # a cache of its own (compressed): its size in closed form
        assert count.kv_cache_bytes(name, cfg, 64, "float32") == 4 * v.kv_cache_elements(cfg, 64) > 0
        assert isinstance(score, int) and 0 < score <= v.param_count(cfg), name
        continue
      width = v.kv_cache_width(cfg)
      if v.init_state is not None:  # a fixed-size state instead of a cache per token
        assert width == 0 and count.state_bytes(name, cfg, "float32") == 4 * v.state_size(cfg) > 0
      else:
        assert isinstance(width, int) and width > 0, name
      assert isinstance(score, int) and 0 < score <= v.param_count(cfg), name
      assert count.kv_cache_bytes_per_token(name, cfg, "float32") == 4 * width
      assert count.score_weight_count(name, cfg) == score


# ---------------------------------------------------------------- whole models


def tree_count(model) -> int:
  return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def built_count(cfg: ModelConfig, kind: str) -> int:
  return tree_count(nnx.eval_shape(lambda: models.MODELS[kind](cfg, rngs=nnx.Rngs(0))))


SMALL = dict(vocab_size=37, d_model=12, num_layers=2, num_heads=3, d_ff=20, max_len=9)
MODEL_CASES = [
    ("encoder", dict(num_segments=2, embed_norm=True, norm="post", final_norm=False, pooler=True)),
    ("encoder", dict(use_bias=False, layernorm=False, positional="none", d_k=5, d_v=2)),
    ("decoder_lm", dict(num_kv_heads=1)),
    ("decoder_lm", dict(tie_embeddings=False, use_bias=False, positional="sinusoidal")),
    ("decoder_lm", dict(tie_embeddings=False, layernorm=False, final_norm=False)),
    ("classifier", dict(num_classes=4, pooler=True, num_segments=3)),
    ("classifier", dict(num_classes=2, pooling="mean", use_bias=False)),
    ("encoder_decoder", dict(num_decoder_layers=3, positional="sinusoidal", norm="post",
                             final_norm=False)),
    ("encoder_decoder", dict(num_decoder_layers=1, share_src_tgt_embeddings=False)),
    ("encoder_decoder", dict(num_decoder_layers=2, share_src_tgt_embeddings=False,
                             tie_embeddings=False, layernorm=False, use_bias=False)),
    ("encoder_decoder", dict(num_decoder_layers=2, tie_embeddings=False, embed_norm=True)),
    # The model switches of Llama, Qwen2, Gemma 2 and BERT's masked-LM head (attn.nn.hf).
    ("decoder_lm", dict(norm_type="rmsnorm", mlp="gated", activation="silu", use_bias=False,
                        tie_embeddings=False, positional="rope", rope_dim=4, num_kv_heads=1)),
    ("decoder_lm", dict(norm_type="rmsnorm", mlp="gated", dense_bias=False, tie_embeddings=False,
                        positional="none", qk_norm=True)),
    ("decoder_lm", dict(norm_type="rmsnorm_plus_one", norm="sandwich", mlp="gated", use_bias=False,
                        embed_scale=True, logit_softcap=30.0, softcap=50.0, window=3,
                        global_every=2, scale=0.3, d_k=6)),
    ("decoder_lm", dict(mlp="gated", dense_bias=True, use_bias=False, tie_embeddings=False)),
    ("encoder", dict(num_segments=2, embed_norm=True, norm="post", final_norm=False, mlm_head=True)),
    ("encoder", dict(norm_type="rmsnorm", norm="sandwich", mlm_head=True, pooler=True)),
    ("encoder_decoder", dict(num_decoder_layers=2, norm="sandwich", norm_type="rmsnorm",
                             mlp="gated")),
]


@pytest.mark.parametrize("kind,changes", MODEL_CASES)
def test_model_formula_equals_the_flax_parameter_tree(kind, changes):
  cfg = ModelConfig(**{**SMALL, **changes})
  parts = count.model_param_breakdown(cfg, kind)
  assert all(v >= 0 for v in parts.values())
  assert count.model_param_count(cfg, kind) == built_count(cfg, kind)


@pytest.mark.parametrize("name", variant_params())
def test_model_formula_for_every_variant(name):
  cfg = ModelConfig(**{**SMALL, "variant": name, "num_decoder_layers": 1, "num_kv_heads": 1})
  if VARIANTS[name].init_state is not None:  # causal by construction: no encoder takes it, the count neither
    with pytest.raises(ConfigError, match="causal by construction"):
      count.model_param_count(cfg, "encoder_decoder")
    with pytest.raises(ConfigError, match="causal by construction"):
      built_count(cfg, "encoder_decoder")
    lm = ModelConfig(**{**SMALL, "variant": name, "num_kv_heads": 1})
    assert count.model_param_count(lm, "decoder_lm") == built_count(lm, "decoder_lm")
    return
  assert count.model_param_count(cfg, "encoder_decoder") == built_count(cfg, "encoder_decoder")


# Published totals, from the Hugging Face checkpoints (each array counted once).
PUBLISHED = {"bert-base": 109_482_240, "bert-large": 335_141_888, "gpt2": 124_439_808,
             "gpt2-medium": 354_823_168, "gpt2-large": 774_030_080, "gpt2-xl": 1_557_611_200}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_bert_gpt2_counts(name):
  preset = presets.get_preset(name)
  assert count.model_param_count(preset.config, preset.kind) == PUBLISHED[name]


@pytest.mark.slow
@pytest.mark.parametrize("name", [*sorted(PUBLISHED), "vaswani-base"])
def test_whole_model_presets_build_the_counted_tree(name):
  preset = presets.get_preset(name)
  assert built_count(preset.config, preset.kind) == count.model_param_count(preset.config, preset.kind)


# Vaswani et al. 2017, Table 3, params column (×10⁶): row changes and the paper's number.
TABLE3 = {
    "vaswani-base": ({}, 65),
    "vaswani-A-h1": (dict(num_heads=1, d_k=512, d_v=512), 65),
    "vaswani-A-h4": (dict(num_heads=4, d_k=128, d_v=128), 65),
    "vaswani-A-h16": (dict(num_heads=16, d_k=32, d_v=32), 65),
    "vaswani-A-h32": (dict(num_heads=32, d_k=16, d_v=16), 65),
    "vaswani-B-dk16": (dict(d_k=16), 58),
    "vaswani-B-dk32": (dict(d_k=32), 60),
    "vaswani-C-N2": (dict(num_layers=2, num_decoder_layers=2), 36),
    "vaswani-C-N4": (dict(num_layers=4, num_decoder_layers=4), 50),
    "vaswani-C-N8": (dict(num_layers=8, num_decoder_layers=8), 80),
    "vaswani-C-d256": (dict(d_model=256, d_k=32, d_v=32), 28),
    "vaswani-C-d1024": (dict(d_model=1024, d_k=128, d_v=128), 168),
    "vaswani-C-ff1024": (dict(d_ff=1024), 53),
    "vaswani-C-ff4096": (dict(d_ff=4096), 90),
}
BASE = dict(N=6, d_model=512, d_ff=2048, h=8, d_k=64, d_v=64)


@pytest.mark.parametrize("name", sorted(TABLE3))
def test_table3_params_column(name):
  changes, paper = TABLE3[name]
  preset = presets.get_preset(name)
  m = preset.config
  want = {**BASE, **{ {"num_layers": "N", "num_heads": "h"}.get(k, k): v
                      for k, v in changes.items() if k != "num_decoder_layers"}}
  assert (m.num_layers, m.num_decoder_layers, m.d_model, m.d_ff, m.num_heads, m.d_k, m.d_v) == (
      want["N"], want["N"], want["d_model"], want["d_ff"], want["h"], want["d_k"], want["d_v"])
  assert round(count.model_param_count(m, "encoder_decoder") / 1e6) == paper
  assert preset.matches()


def test_table3_rows_A_do_not_change_with_h():
  base = count.model_param_count(presets.get_preset("vaswani-base").config, "encoder_decoder")
  for name in ("vaswani-A-h1", "vaswani-A-h4", "vaswani-A-h16", "vaswani-A-h32"):
    m = presets.get_preset(name).config
    assert m.num_heads * m.d_k == m.d_model
    assert count.model_param_count(m, "encoder_decoder") == base


def test_table3_vaswani_base_by_hand():
  m = presets.get_preset("vaswani-base").config
  # By hand: 6 encoder + 6 decoder layers (post-norm, biases), one shared 512-wide table.
  attn_layer, ffn, ln = 4 * (512 * 512 + 512), 2 * 512 * 2048 + 2048 + 512, 2 * 512
  layers = 6 * (attn_layer + ffn + 2 * ln) + 6 * (2 * attn_layer + ffn + 3 * ln)
  assert count.model_param_count(m, "encoder_decoder") == layers + presets.VASWANI_VOCAB * 512


def millions(m, vocab: int) -> int:
  return round(count.model_param_count(m.replace(vocab_size=vocab), "encoder_decoder") / 1e6)


def test_table3_vocabulary_interval_and_the_row_that_cannot_match():
  ranges = {}
  for name, (_, paper) in TABLE3.items():
    preset = presets.get_preset(name)
    lo, hi = presets.vocab_range(preset)
    # The interval's ends are exact: inside rounds to the paper, one step outside does not.
    assert millions(preset.config, lo) == paper == millions(preset.config, hi)
    assert millions(preset.config, lo - 1) != paper != millions(preset.config, hi + 1)
    ranges[name] = (lo, hi)
  lo, hi = max(a for a, _ in ranges.values()), min(b for _, b in ranges.values())
  assert lo <= presets.VASWANI_VOCAB <= hi
  # The paper's "about 37000" does not give 65M for base.
  assert millions(presets.get_preset("vaswani-base").config, 37_000) == 63
  big = presets.get_preset("vaswani-big")
  assert (big.config.d_model, big.config.d_ff, big.config.num_heads) == (1024, 4096, 16)
  assert not big.matches()
  big_lo, big_hi = presets.vocab_range(big)
  assert big_hi < lo  # no vocabulary matches big together with the other rows


def test_model_kv_cache_and_kind_errors():
  gpt2 = presets.get_preset("gpt2").config
  assert count.model_kv_cache_bytes_per_token(gpt2, "decoder_lm", "float16") == 12 * 2 * 768 * 2
  with pytest.raises(ConfigError, match="kind"):
    count.model_param_count(gpt2, "transformer")
  with pytest.raises(ConfigError, match="kind"):
    count.model_kv_cache_bytes_per_token(gpt2, "encoder")


# ---------------------------------------------------------------- CLI


def run_cli(capsys, *argv):
  code = cli.main(["count", *argv])
  out = capsys.readouterr()
  return code, out.out, out.err


@functools.lru_cache(maxsize=None)
def printed(*argv) -> tuple[int, str]:
  """(exit code, stdout) of `attn count ARGV`, run once for the tests that read the same table (the
  command is deterministic: the seed question's and Table 3's tables are checked here and in the docs)."""
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    code = cli.main(["count", *argv])
  return code, out.getvalue()


def md_rows(text: str) -> dict[str, list[str]]:
  rows = {}
  for line in text.splitlines():
    if line.startswith("| ") and not line.startswith("|---"):
      cells = [c.strip() for c in line.strip("|").split("|")]
      rows.setdefault(cells[0], cells)
  return rows


def test_cli_markdown_seed_question():
  code, out = printed("--d-model", "512", "--num-heads", "8", "--d-k", "64")
  assert code == 0
  rows = md_rows(out)
  assert set(attn.VARIANTS) <= set(rows)
  cfg = HeadConfig(d_model=512, num_heads=8, d_k=64)
  for name in attn.VARIANTS:
    c = count.param_counts(name, cfg)
    effective = "—" if c["effective"] is None else f"{c['effective']:,}"  # state heads: not defined
    assert rows[name][1:4] == [f"{c['analytic']:,}", f"{c['stored']:,}", effective]
    measured = " (measured)" if "flops" in count.measured_figures(name, cfg) else ""
    assert rows[name][6] == f"{count.flops(name, cfg, 128):,}" + measured
  assert rows["per_head"][5] == f"{2 * 512 * 64:,}" and rows["merged"][5] == f"{512 ** 2:,}"


def test_cli_csv_and_json(capsys):
  code, out, _ = run_cli(capsys, "--num-kv-heads", "2", "--format", "csv", "--variant", "fused",
                         "--variant", "merged")
  assert code == 0
  lines = out.strip().splitlines()
  assert lines[0].startswith("variant,analytic,stored,effective") and len(lines) == 3
  code, out, _ = run_cli(capsys, "--preset", "gpt2", "--format", "json", "--seq-len", "64")
  assert code == 0
  report = json.loads(out)
  assert report["model"]["count"] == PUBLISHED["gpt2"]
  fused = next(r for r in report["rows"] if r["variant"] == "fused")
  assert fused["model_params"] == PUBLISHED["gpt2"]
  assert fused["flops_fwd"] == count.flops("fused", presets.get_preset("gpt2").config.head, 64)


def test_cli_published_group(capsys):
  code, out, _ = run_cli(capsys, "--preset", "bert-gpt2", "--format", "json")
  assert code == 0
  assert {r["row"]: r["ours"] for r in json.loads(out)} == PUBLISHED


def test_cli_table3(capsys):
  code, out = printed("--preset", "vaswani-table3")
  assert code == 0
  rows = md_rows(out)
  assert rows["big"][-1] == "**no**"
  assert sum(r[-1] == "yes" for r in rows.values()) == len(TABLE3)
  report = json.loads(run_cli(capsys, "--preset", "vaswani-table3", "--format", "json")[1])
  assert report["vocab_size"] == presets.VASWANI_VOCAB and list(report["unmatched"]) == ["big"]


@pytest.mark.parametrize("argv,field", [
    (["--preset", "gpt5"], "preset"),
    (["--d-model", "512", "--num-heads", "3"], "d_k"),
    (["--num-kv-heads", "3"], "num_kv_heads"),
    (["--d-model", "0"], "d_model"),
    (["--seq-len", "0"], "T"),
    (["--dtype", "float7"], "dtype"),
    (["--variant", "nope"], "variant"),
    (["--preset", "bert-base", "--num-heads", "5"], "d_k"),
    (["--preset", "vaswani-table3", "--d-k", "16"], "preset"),
])
def test_cli_errors_are_clear(capsys, argv, field):
  code, out, err = run_cli(capsys, *argv)
  assert code == 2 and out == ""
  assert field in err and "Traceback" not in err


def test_cli_variant_that_refuses_the_config_says_why(capsys):
  code, out, _ = run_cli(capsys, "--d-model", "20", "--num-heads", "6", "--d-k", "4",
                             "--d-v", "3")
  assert code == 0
  assert "n/a: num_heads=6" in md_rows(out)["split_input"][1]


@pytest.mark.parametrize("doc", ["experiments/parameter_counts/README.md"])
def test_doc_tables_are_what_the_command_prints(doc):
  # scripts/count_tables.py writes these blocks; here each is checked against the CLI itself.
  text = (pathlib.Path(__file__).parents[1] / doc).read_text()
  blocks = re.findall(r"<!-- attn count (.*?) -->\n(.*?)<!-- /attn count -->", text, flags=re.S)
  assert blocks, doc
  for args, body in blocks:
    code, out = printed(*args.split())
    assert code == 0
    chunks = [c for c in out.strip().split("\n\n") if not c.startswith("One attention layer")]
    assert chunks and body.strip() == "\n\n".join(chunks).strip(), args


@pytest.mark.parametrize("use_bias", [True, False])
def test_mechanism_table_matches_closed_forms_and_stored_arrays(use_bias):
  cfg = attn.HeadConfig(d_model=24, num_heads=6, d_k=5, d_v=3, num_kv_heads=2, use_bias=use_bias)
  D, H, K, V, b = 24, 6, 5, 3, int(use_bias)
  rows = {r["mechanism"].split(" ")[0] + (" " + r["mechanism"].split(" ")[1]
                                          if r["mechanism"].startswith("gate") else ""): r
          for r in count.mechanism_table("per_head", cfg, T=40, dtype="float32", window=7)}
  assert rows["gate headwise"]["params"] == H * (D + b)
  assert rows["gate elementwise"]["params"] == H * V * (D + b)
  assert rows["sinks"]["params"] == H and rows["qk_norm"]["params"] == 2 * K
  assert rows["gate headwise"]["flops_fwd"] == 2 * 40 * D * H
  width = 2 * (K + V) * 4  # G·(K + V) float32 numbers per token
  assert rows["window"]["kv_cache_bytes"] == (7 - 40) * width
  plain = sum(np.prod(s) for s in attn.param_shapes("per_head", cfg).values())
  for name, change in (("gate elementwise", {"gate": "elementwise"}), ("sinks", {"sinks": True}),
                       ("qk_norm", {"qk_norm": True})):
    stored = sum(np.prod(s) for s in attn.param_shapes("per_head", cfg.replace(**change)).values())
    assert rows[name]["params"] == stored - plain, name
  assert count.kv_cache_bytes("per_head", cfg.replace(window=7), 5, "float32") == 5 * width
  assert count.kv_cache_bytes("per_head", cfg.replace(window=7), 500, "float32") == 7 * width


def test_cli_qk_norm_flag_takes_the_whole_mode(capsys):
  """--qk-norm is per head (2·K scales), --qk-norm whole one scale per query and key dim ((H + G)·K)."""
  stored = {}
  for flag in ((), ("--qk-norm",), ("--qk-norm", "whole")):
    code, out, err = run_cli(capsys, "--d-model", "20", "--num-heads", "6", "--d-k", "4", "--d-v", "3",
                             "--num-kv-heads", "2", *flag, "--format", "json", "--variant", "per_head")
    assert code == 0, err
    stored[flag[1:] or flag] = json.loads(out)["rows"][0]["stored"]
  assert stored[("--qk-norm",)] - stored[()] == 2 * 4
  assert stored[("whole",)] - stored[()] == (6 + 2) * 4
  code, _, err = run_cli(capsys, "--d-model", "24", "--num-heads", "6", "--qk-norm", "heads")
  assert code == 2 and "qk_norm='heads' is not allowed" in err
