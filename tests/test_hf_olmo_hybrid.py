"""OLMo-Hybrid in and out: a tiny random OlmoHybridForCausalLM built in code (no download) and written by
transformers' own save_pretrained, read by attn.nn.hf.from_hf into a hybrid DecoderLM (gated_deltanet
layers with negative eigenvalues, pre-norm; OLMo 2 softmax layers, norms after); logits under right
padding, cached greedy decoding, to_hf bit for bit, `attn count --hf` and the refusals, against
transformers."""

import json

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from attn import ConfigError, cli
from attn.nn import hf
from hf_hybrid import (  # tests/hf_hybrid.py
    assert_greedy_decoding_equal, assert_logits_equal_under_right_padding, assert_to_hf_and_back_exact, nnx_state)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.olmo_hybrid", reason="this transformers has no olmo_hybrid")

KINDS = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]


def tiny(**changes):
  """Awkward sizes: 4 query heads over 2 kv heads, 2 key heads of 6 for 4 value heads of 5 (d_v != d_k),
  a convolution of 3, the attention layer between linear ones."""
  kw = dict(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=6,
            linear_value_head_dim=5, linear_conv_kernel_dim=3, layer_types=KINDS, max_position_embeddings=64,
            pad_token_id=None, bos_token_id=None, eos_token_id=None)
  return transformers.OlmoHybridConfig(**{**kw, **changes})


def build(config, seed=0):
  torch.manual_seed(seed)
  model = transformers.OlmoHybridForCausalLM(config).eval()
  with torch.no_grad():  # norms start at 1: move them so they are read
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.normal_(1.0, 0.2)
  return model


@pytest.fixture(scope="module")
def live():
  return build(tiny())


@pytest.fixture(scope="module")
def saved(live, tmp_path_factory):
  path = tmp_path_factory.mktemp("olmo_hybrid") / "ckpt"
  live.save_pretrained(path)
  return str(path)


def _params(model):
  return jax.tree.leaves(nnx_state(model))


def test_a_save_pretrained_directory_loads_and_decodes_as_transformers(live, saved):
  """The directory transformers writes (its on-disk names: attention_layer_norm, feedforward_layer_norm,
  q/k/v_conv1d) holds the live model's parameters bit for bit; cached greedy decoding equals generate."""
  names = set(hf.read_weights(saved))
  assert {"model.layers.0.attention_layer_norm.weight", "model.layers.0.linear_attn.q_conv1d.weight"} <= names
  loaded = hf.from_hf(saved)
  assert loaded.family == "olmo_hybrid"
  cfg = loaded.config
  assert cfg.layer_types == tuple(KINDS) and cfg.linear_norm == "pre" and cfg.norm == "after"
  assert cfg.layer_head(0).linear_allow_neg_eigval and cfg.layer_head(0).gated_norm_eps == 1e-5
  assert [b.attn.variant for b in loaded.model.blocks] == ["gated_deltanet"] * 2 + ["per_head", "gated_deltanet"]
  for a, b in zip(_params(loaded.model), _params(hf.from_hf(live).model), strict=True):
    np.testing.assert_array_equal(a, b)
  prompt = np.random.default_rng(1).integers(0, 50, (1, 5))
  with torch.no_grad():
    want = live.generate(torch.tensor(prompt), max_new_tokens=6, do_sample=False).numpy()
  from attn.nn.decoding import generate
  np.testing.assert_array_equal(np.asarray(generate(loaded.model, jnp.asarray(prompt), 6)), want)


def test_to_hf_saved_again_writes_the_same_tensors(saved, tmp_path):
  loaded = hf.from_hf(saved)
  hf.to_hf(loaded).save_pretrained(tmp_path / "again")
  first, again = hf.read_weights(saved), hf.read_weights(str(tmp_path / "again"))
  assert set(first) == set(again)
  for name, a in first.items():
    np.testing.assert_array_equal(again[name], a, err_msg=name)


def test_the_release_convolutions_split_by_q_k_v_load(live, saved, tmp_path):
  """The release holds q_conv1d with the key rows, k_conv1d and v_conv1d with the value rows (transformers
  5.25's save splits conv1d into near-equal thirds instead): either stack reads the same parameters."""
  save_file = pytest.importorskip("safetensors.numpy").save_file
  sd = hf.read_weights(saved)
  GK, HV = 2 * 6, 4 * 5
  for l in (0, 1, 3):
    at = f"model.layers.{l}.linear_attn."
    conv = np.concatenate([sd.pop(f"{at}{c}_conv1d.weight") for c in "qkv"], 0)
    sd |= {f"{at}q_conv1d.weight": conv[:GK], f"{at}k_conv1d.weight": conv[GK:2 * GK],
           f"{at}v_conv1d.weight": conv[2 * GK:]}
    assert conv.shape[0] == 2 * GK + HV
  path = tmp_path / "release"
  path.mkdir()
  (path / "config.json").write_text(json.dumps(live.config.to_dict()))
  save_file({k: np.ascontiguousarray(v) for k, v in sd.items()}, str(path / "model.safetensors"))
  for a, b in zip(_params(hf.from_hf(str(path)).model), _params(hf.from_hf(live).model), strict=True):
    np.testing.assert_array_equal(a, b)


def test_count_hf_equals_transformers_parameters(live, saved, capsys):
  code = cli.main(["count", "--hf", saved, "--format", "json"])
  out = capsys.readouterr()
  assert code == 0, out.err
  report = json.loads(out.out)
  assert report["total"] == sum(p.numel() for p in live.parameters())
  rows = {r["type"]: r for r in report["layer_types"]}
  H, K, V, W, G = 4, 6, 5, 3, 2  # H·K·V float32 states + (W − 1)·(2GK + HV) convolution inputs
  assert rows["linear_attention"]["state_bytes_per_layer"] == 4 * (H * K * V + (W - 1) * (2 * G * K + H * V))


@pytest.mark.parametrize("changes, field", [
    (dict(attention_bias=True), "config.attention_bias"),
    (dict(hidden_act="gelu"), "config.hidden_act"),
    (dict(linear_num_key_heads=3), "num_kv_heads"),
])
def test_what_attn_does_not_run_is_refused_before_any_weight(changes, field):
  with pytest.raises(ConfigError, match=f"{field}=.* is not allowed"):
    hf.model_config(tiny(**changes).to_dict())


def test_a_layer_type_attn_does_not_run_is_refused():
  config = {**tiny().to_dict(), "layer_types": ["linear_attention", "mamba", "full_attention", "linear_attention"]}
  with pytest.raises(ConfigError, match="config.layer_types=.* is not allowed"):
    hf.model_config(config)


def test_the_release_runs_without_positions_and_neg_eigval_is_read():
  """rope_theta None (the release): positional "none", written back so; linear_allow_neg_eigval False is
  read and written."""
  cfg = hf.model_config(tiny(rope_parameters={"rope_type": "default", "rope_theta": None},
                             linear_allow_neg_eigval=False).to_dict())
  assert cfg.positional == "none" and cfg.rope_dim == 0
  assert not cfg.layer_head(0).linear_allow_neg_eigval
  family = hf.FAMILIES["olmo_hybrid"]
  family.check_out(cfg)
  out = family.config_out(cfg)
  assert out["rope_parameters"]["rope_theta"] is None and out["linear_allow_neg_eigval"] is False
  assert hf.model_config(out | {"model_type": "olmo_hybrid"}) == cfg


def test_linear_norm_is_refused_where_it_cannot_hold():
  from attn.nn.config import ModelConfig
  base = dict(vocab_size=11, d_model=8, num_layers=2, num_heads=2, d_ff=8, layer_types=("linear_attention",
              "full_attention"), use_bias=False)
  with pytest.raises(ConfigError, match="linear_norm='post' is not allowed"):
    ModelConfig(**base, norm="after", linear_norm="post")
  with pytest.raises(ConfigError, match="linear_norm='pre' is not allowed.*norm='sandwich'"):
    ModelConfig(**base, norm="sandwich", linear_norm="pre")
  with pytest.raises(ConfigError, match="linear_norm='pre' is not allowed.*without linear_attention"):
    ModelConfig(**{**base, "layer_types": None}, norm="after", linear_norm="pre")


@pytest.mark.slow
def test_logits_equal_transformers_under_right_padding(live):
  assert_logits_equal_under_right_padding(live, hf.from_hf(live))


@pytest.mark.slow
def test_to_hf_and_back_is_exact(live):
  out = assert_to_hf_and_back_exact(live, "OlmoHybridForCausalLM")
  assert out.config.layer_types == KINDS


@pytest.mark.slow
def test_without_positions_over_many_tokens():
  """The release's NoPE, one key head for three value heads, 24 tokens from two prompts."""
  model = build(tiny(rope_parameters={"rope_type": "default", "rope_theta": None}, linear_num_key_heads=1,
                     linear_num_value_heads=3, num_key_value_heads=4), seed=3)
  assert model.model.rotary_emb is None
  loaded = hf.from_hf(model)
  assert loaded.config.positional == "none"
  assert_logits_equal_under_right_padding(model, loaded)
  assert_greedy_decoding_equal(model, loaded, np.random.default_rng(4).integers(0, 50, (2, 4)), 24)


@pytest.mark.slow
def test_the_family_kit_passes():
  from attn.testing import check_family
  measured = check_family("olmo_hybrid", build(tiny()))
  assert measured["logits_relative"] is not None and measured["logits_relative"] < 1e-4
