"""RoPE frequency scaling ("linear", "llama3"): frequencies, variants, decoding, config paths.

The frequencies are checked against Meta's band-by-band loop written here and
against transformers' own functions (when installed); the variants and the
KV-cache paths through an identity that needs no second implementation:
linear scaling by 2 at positions 2p is no scaling at p. Loading real
checkpoints is in test_hf_families.py.
"""

import math

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attn
from attn import ConfigError, HeadConfig
from attn.experiments.running import config as config_lib
from attn.nn.models import DecoderLM
from attn.nn.config import ModelConfig
from attn.variants import rope
from conftest import ROPE_CONFIGS, TINY_MQAR, fresh_params, jit_apply, randn

# The fields' defaults: RoPE without scaling.
UNSCALED = dict(rope_scaling=None, rope_factor=1.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                rope_original_max_len=8192)
# rope_dim 6, theta 100: wavelengths 2π/ω = 6.3, 29.2, 135.4 against L/high = 8 and L/low = 32, one
# pair in each of llama3's bands (kept, mixed, divided).
LLAMA3 = dict(rope_scaling="llama3", rope_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
              rope_original_max_len=32)


def meta_llama3(omega, factor, low, high, original):
  """Llama 3.1's apply_scaling (meta-llama/llama-models), pair by pair with its three branches."""
  out = []
  for w in omega:
    wavelen = 2 * math.pi / w
    if wavelen < original / high:
      out.append(w)
    elif wavelen > original / low:
      out.append(w / factor)
    else:
      smooth = (original / wavelen - low) / (high - low)
      out.append((1 - smooth) * w / factor + smooth * w)
  return np.array(out)


def bands(omega, cfg):
  """How many pairs llama3 keeps, mixes and divides."""
  wavelen, L = 2 * np.pi / omega, cfg.rope_original_max_len
  short, long = L / cfg.rope_high_freq_factor, L / cfg.rope_low_freq_factor
  return tuple(int(n.sum()) for n in (wavelen < short, (wavelen >= short) & (wavelen <= long), wavelen > long))


@pytest.mark.parametrize("rope_dim, theta, scaling, want_bands", [
    (6, 100.0, dict(rope_scaling="linear", rope_factor=2.5), None),
    (6, 100.0, LLAMA3, (1, 1, 1)),
    (12, 500.0, LLAMA3 | dict(rope_original_max_len=64, rope_low_freq_factor=0.5, rope_high_freq_factor=3.0),
     (2, 1, 3)),
    (128, 500000.0, dict(LLAMA3, rope_original_max_len=8192), (29, 6, 29)),  # Llama 3.1 8B's values
])
def test_frequencies_against_meta_and_the_plain_ones(rope_dim, theta, scaling, want_bands):
  cfg = HeadConfig(d_model=rope_dim, num_heads=1, rope_dim=rope_dim, rope_theta=theta, **scaling)
  plain = theta ** (-np.arange(0, rope_dim, 2) / rope_dim)
  got = rope.frequencies(cfg)
  np.testing.assert_array_equal(rope.frequencies(cfg.replace(**UNSCALED)), plain)
  if scaling["rope_scaling"] == "linear":
    np.testing.assert_allclose(got, plain / 2.5, rtol=1e-15)
    return
  assert bands(plain, cfg) == want_bands
  np.testing.assert_allclose(got, meta_llama3(plain, cfg.rope_factor, cfg.rope_low_freq_factor,
                                              cfg.rope_high_freq_factor, cfg.rope_original_max_len), rtol=1e-14)


@pytest.mark.parametrize("params", [
    {"rope_type": "linear", "factor": 2.5},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 32},
    {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 0.5, "high_freq_factor": 3.0,
     "original_max_position_embeddings": 64}])
def test_frequencies_equal_transformers(params):
  pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
  from attn.nn import hf
  v5 = int(transformers.__version__.split(".")[0]) >= 5  # 5: rope_parameters; 4: rope_theta, rope_scaling
  spelled = dict(rope_parameters=params | {"rope_theta": 100.0}) if v5 else dict(rope_theta=100.0, rope_scaling=params)
  c = transformers.LlamaConfig(hidden_size=24, num_attention_heads=2, head_dim=12, max_position_embeddings=128,
                               **spelled)
  inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](c, "cpu")
  assert attention_factor == 1.0  # neither type scales the scores
  fields = hf.rope_from_hf(c.to_dict())
  cfg = HeadConfig(d_model=24, num_heads=2, rope_dim=12, **fields)
  np.testing.assert_allclose(rope.frequencies(cfg), inv_freq.double().numpy(), rtol=1e-6)  # theirs: float32
  assert not np.allclose(rope.frequencies(cfg.replace(**UNSCALED)), inv_freq.double().numpy(), rtol=1e-3)


def _rope_variants(cfg):
  out = []
  for name in sorted(attn.VARIANTS):
    try:
      attn.VARIANTS[name].check(cfg)
      out.append(name)
    except ConfigError:
      pass
  return out


def test_the_variants_with_rope():
  assert {"per_head", "mla", "tpa", "fused"} <= set(_rope_variants(ROPE_CONFIGS["rope_gqa"]))


# Fast: per_head (the query and key heads rotated), mla (a decoupled rotated key) and tpa (rotated
# factors); every other variant with RoPE in the slow tier.
@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in ("mla", "per_head", "tpa") else pytest.mark.slow)
                                  for n in _rope_variants(ROPE_CONFIGS["rope_gqa"])])
def test_linear_by_two_at_doubled_positions_is_plain_rope_in_every_variant(name):
  """Each variant rotates through rope.frequencies: scaled angles (2p)·ω/2 are p·ω bit for bit."""
  cfg = ROPE_CONFIGS["rope_gqa"]
  scaled = cfg.replace(rope_scaling="linear", rope_factor=2.0)
  pos = jnp.asarray([[3, 0, 7, 11], [1, 2, 3, 4]])
  x = randn(0, (2, 4, cfg.d_model))
  params = fresh_params(name, cfg)
  want = jit_apply(name, params, x, cfg=cfg, positions=pos, is_causal=True)
  got = jit_apply(name, params, x, cfg=scaled, positions=2 * pos, is_causal=True)
  np.testing.assert_allclose(got, want, atol=1e-6, err_msg=name)
  if name == "per_head":  # the scaling acts at all
    off = jit_apply(name, params, x, cfg=scaled, positions=pos, is_causal=True)
    assert float(jnp.abs(off - want).max()) > 1e-3


def test_position_free_fit_reads_the_scaled_frequencies():
  cfg = ROPE_CONFIGS["rope_gqa"]
  rng = np.random.default_rng(0)
  w_q, w_k = rng.standard_normal((cfg.d_model, 6, 6)), rng.standard_normal((cfg.d_model, 2, 6))
  plain = rope.rotation_matrices(np.arange(0, 20, 2), cfg)
  scaled = rope.rotation_matrices(np.arange(0, 10), cfg.replace(rope_scaling="linear", rope_factor=0.5))
  np.testing.assert_allclose(scaled, plain, atol=1e-12)
  _, err = rope.position_free_fit(w_q, w_k, cfg, 12)
  _, slower = rope.position_free_fit(w_q, w_k, cfg.replace(rope_scaling="linear", rope_factor=8.0), 12)
  assert 0 < slower < err  # slower rotations: closer to one position-free matrix


def _decoder(variant, **rope_fields):
  cfg = ModelConfig(vocab_size=13, d_model=12, num_layers=1, num_heads=4, d_ff=16, d_k=8, d_v=5, num_kv_heads=2,
                    variant=variant, max_len=24, positional="rope", rope_dim=6, rope_theta=100.0, **rope_fields)
  return DecoderLM(cfg, rngs=nnx.Rngs(0))


@pytest.mark.slow  # a whole model generating step by step
def test_greedy_generate_with_llama3_rope_is_argmax_of_the_full_pass():
  """Each generated token is the argmax of one causal full pass over the result at the step before."""
  model = _decoder("fused", **LLAMA3)
  prompt_BT = jnp.asarray(np.random.default_rng(5).integers(0, 13, (2, 5)), jnp.int32)
  got = model.generate(prompt_BT, 14)
  np.testing.assert_array_equal(got[:, :5], prompt_BT)
  logits = model(got)
  np.testing.assert_array_equal(got[:, 5:], jnp.argmax(logits[:, 4:-1], axis=-1))
  plain = DecoderLM(model.cfg.replace(**UNSCALED), rngs=nnx.Rngs(0))  # same weights (RoPE has none)
  assert float(jnp.abs(plain(got)[:, 1:] - logits[:, 1:]).max()) > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["per_head", "mla", "tpa"])
def test_cached_decoding_with_llama3_rope_gives_the_full_logits(variant):
  """mla and tpa rotate in their own cache paths (the absorbed latent form, cached factors)."""
  model = _decoder(variant, **LLAMA3)
  tokens_BT = jnp.asarray(np.random.default_rng(4).integers(0, 13, (2, 20)), jnp.int32)
  full = model(tokens_BT)
  model.init_cache(2, 20)
  outs, i = [], 0
  for T in (7, 1, 1, 5, 6):
    outs.append(model(tokens_BT[:, i:i + T], decode=True))
    i += T
  np.testing.assert_allclose(jnp.concatenate(outs, 1), full, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("changes, match", [
    (dict(rope_scaling="longrope"), r"rope_scaling='longrope' is not allowed: one of \[None, 'linear', 'llama3', 'yarn'\]"),
    (dict(rope_scaling="dynamic"), r"rope_scaling='dynamic' is not allowed: one of \[None, 'linear', 'llama3', 'yarn'\]"),
    (dict(rope_scaling="linear", rope_dim=0), r"rope_scaling='linear' is not allowed: None when rope_dim=0"),
    (dict(rope_scaling="linear", rope_factor=0.0), r"rope_factor=0.0 is not allowed: a positive finite number"),
    (dict(rope_scaling="linear", rope_factor=float("nan")), r"rope_factor=nan is not allowed"),
    (dict(rope_scaling="linear", rope_factor="2"), r"rope_factor='2' is not allowed"),
    (dict(rope_factor=2.0), r"rope_factor=2.0 is not allowed: 1.0 when rope_scaling=None"),
    (dict(LLAMA3, rope_low_freq_factor=0.0), r"rope_low_freq_factor=0.0 is not allowed: a positive"),
    (dict(LLAMA3, rope_high_freq_factor=1.0), r"rope_high_freq_factor=1.0 is not allowed: greater than "
                                              r"rope_low_freq_factor=1.0"),
    (dict(LLAMA3, rope_original_max_len=0), r"rope_original_max_len=0 is not allowed: a positive integer"),
    (dict(LLAMA3, rope_original_max_len=32.0), r"rope_original_max_len=32.0 is not allowed: a positive integer"),
    (dict(rope_scaling="linear", rope_factor=2.0, rope_original_max_len=16),
     r"rope_original_max_len=16 is not allowed: 8192 when rope_scaling='linear': only rope_scaling 'llama3' or 'yarn'"),
    (dict(rope_high_freq_factor=8.0), r"rope_high_freq_factor=8.0 is not allowed: 4.0 when rope_scaling=None"),
])
def test_bad_scaling_fields_are_named(changes, match):
  base = dict(d_model=16, num_heads=2, rope_dim=6)
  with pytest.raises(ConfigError, match=match):
    HeadConfig(**(base | changes))


def test_scaling_through_toml_and_the_count_flags(capsys):
  """The generic paths: TOML keys typed by the annotation (8 -> 8.0), trial ids, `attn count` flags."""
  rope_keys = 'positional = "rope"\nrope_dim = 8\n'
  base = config_lib.loads(TINY_MQAR + rope_keys, "a.toml", [])
  text = TINY_MQAR + rope_keys + 'rope_scaling = "llama3"\nrope_factor = 8\nrope_original_max_len = 32\n'
  sweep = config_lib.loads(text, "b.toml", [])
  model = sweep.trials[0].config["model"]
  assert model["rope_factor"] == 8.0 and isinstance(model["rope_factor"], float)
  assert model["rope_scaling"] == "llama3" and model["rope_original_max_len"] == 32
  assert sweep.trials[0].id != base.trials[0].id
  with pytest.raises(ConfigError, match="rope_scaling='longrope' is not allowed"):
    config_lib.loads(TINY_MQAR + rope_keys + 'rope_scaling = "longrope"\n', "c.toml", [])
  from attn import cli
  argv = ["count", "--d-model", "32", "--num-heads", "4", "--rope-dim", "8", "--variant", "per_head"]
  assert cli.main(argv) == 0
  plain = capsys.readouterr().out
  assert cli.main(argv + ["--rope-scaling", "llama3", "--rope-factor", "8", "--rope-original-max-len", "64"]) == 0
  assert capsys.readouterr().out == plain  # scaling adds no parameters, FLOPs or cache
  assert cli.main(argv + ["--rope-factor", "8"]) == 2
  assert "rope_factor=8.0 is not allowed: 1.0 when rope_scaling=None" in capsys.readouterr().err

