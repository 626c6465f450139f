"""HeadConfig validation: every refusal names the field, the value and what is allowed."""

import jax
import pytest

import attn
from attn import ConfigError, HeadConfig


@pytest.mark.parametrize("kwargs, match", [
    (dict(d_model=0, num_heads=2), r"d_model=0 .*positive integer"),
    (dict(d_model=16.0, num_heads=2), r"d_model=16.0 .*positive integer"),
    (dict(d_model=16, num_heads=-1), r"num_heads=-1 .*positive integer"),
    (dict(d_model=16, num_heads=True), r"num_heads=True .*positive integer"),
    (dict(d_model=16, num_heads=2, d_k=0), r"d_k=0 .*positive integer"),
    (dict(d_model=16, num_heads=2, d_v="8"), r"d_v='8' .*positive integer"),
    (dict(d_model=16, num_heads=3), r"d_k=None .*num_heads=3 does not divide d_model=16"),
    (dict(d_model=16, num_heads=3, d_k=4), r"d_v=None .*num_heads=3"),
    (dict(d_model=16, num_heads=4, num_kv_heads=3), r"num_kv_heads=3 .*divisor of num_heads=4"),
    (dict(d_model=16, num_heads=4, num_kv_heads=0), r"num_kv_heads=0 .*positive integer"),
    (dict(d_model=16, num_heads=4, use_bias=1), r"use_bias=1 .*True or False"),
    (dict(d_model=16, num_heads=4, scale=-1.0), r"scale=-1.0 .*positive finite"),
    (dict(d_model=16, num_heads=4, collab_width=0), r"collab_width=0 .*positive integer"),
])
def test_invalid_configs(kwargs, match):
  with pytest.raises(ConfigError, match=match):
    HeadConfig(**kwargs)


def test_defaults_and_free_dims():
  cfg = HeadConfig(d_model=24, num_heads=4)
  assert (cfg.d_k, cfg.d_v, cfg.num_kv_heads, cfg.collab_width) == (6, 6, 4, 24)
  odd = HeadConfig(d_model=20, num_heads=6, d_k=3, d_v=7, num_kv_heads=2)
  assert (odd.d_k, odd.d_v, odd.group_size) == (3, 7, 3)
  assert odd.score_scale == pytest.approx(3 ** -0.5)
  assert odd.replace(scale=0.1).score_scale == 0.1
  one = attn.single_head(64)
  assert (one.num_heads, one.d_k, one.d_v) == (1, 64, 64)
  with pytest.raises(Exception):
    cfg.d_model = 3  # frozen


def test_unknown_variant_lists_the_known_ones():
  with pytest.raises(ConfigError, match=r"variant='nope' .*'fused'.*'per_head'"):
    attn.init("nope", jax.random.PRNGKey(0), HeadConfig(d_model=8, num_heads=2))


def test_split_input_needs_heads_dividing_d_model():
  cfg = HeadConfig(d_model=20, num_heads=6, d_k=4, d_v=4)
  with pytest.raises(ConfigError, match=r"num_heads=6"):
    attn.init("split_input", jax.random.PRNGKey(0), cfg)


def test_cfg_must_be_a_head_config():
  with pytest.raises(ConfigError, match=r"cfg='dict' .*HeadConfig"):
    attn.init("fused", jax.random.PRNGKey(0), {"d_model": 8})


def test_head_presets_build_the_configs_they_name():
  p = {name: make() for name, make in attn.HEAD_PRESETS.items()}
  assert (p["vaswani-base"].d_model, p["vaswani-base"].num_heads, p["vaswani-base"].d_k) == (512, 8, 64)
  assert (p["single-head"].num_heads, p["single-head"].d_k, p["single-head"].d_v) == (1, 512, 512)
  assert (p["mqa"].num_kv_heads, p["gqa"].num_kv_heads) == (1, 2)
