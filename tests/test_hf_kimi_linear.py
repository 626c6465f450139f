"""Kimi Linear in and out: a tiny random KimiLinearForCausalLM built in code (no download), read by
attn.nn.hf.from_hf into a hybrid DecoderLM (kda layers, mla layers without positions, DeepSeek's
experts); logits under right padding, cached greedy decoding, to_hf bit for bit, `attn count --hf`
and the refusals, against transformers."""

import json

import numpy as np
import pytest

import jax.numpy as jnp

from attn import ConfigError, cli
from attn.nn import hf
from attn.nn.decoding import generate
from hf_hybrid import (  # tests/hf_hybrid.py
    assert_greedy_decoding_equal, assert_logits_equal_under_right_padding, assert_to_hf_and_back_exact)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.kimi_linear", reason="this transformers has no kimi_linear")

KINDS = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]


def tiny(**changes):
  """Awkward sizes: 3 MLA heads with d_k = 6 + 4 != d_v = 5, a latent of 10, 2 kda heads of 6, four
  experts in two groups, the first layer dense."""
  kw = dict(vocab_size=50, hidden_size=32, intermediate_size=48, moe_intermediate_size=12, num_hidden_layers=4,
            num_attention_heads=3, num_key_value_heads=3, kv_lora_rank=10, q_lora_rank=None, qk_rope_head_dim=4,
            qk_nope_head_dim=6, v_head_dim=5, num_local_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
            n_shared_experts=1, routed_scaling_factor=1.5, linear_num_heads=2, linear_head_dim=6,
            linear_conv_kernel_dim=4, layer_types=KINDS, mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
            max_position_embeddings=64, pad_token_id=None, bos_token_id=None, eos_token_id=None)
  return transformers.KimiLinearConfig(**{**kw, **changes})


def build(config, seed=0):
  torch.manual_seed(seed)
  model = transformers.KimiLinearForCausalLM(config).eval()
  with torch.no_grad():  # norms start at 1 and the correction bias at 0: move them so they are read
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.normal_(1.0, 0.2)
    for name, b in model.named_buffers():
      if name.endswith("e_score_correction_bias"):
        b.normal_(0.0, 0.1)
  return model


@pytest.fixture(scope="module")
def live():
  return build(tiny())


def test_cached_greedy_decoding_equals_transformers(live):
  """The fast test: kda states, the MLA cache and the experts, six tokens (attn's own full pass: the slow
  test below)."""
  loaded = hf.from_hf(live)
  assert loaded.family == "kimi_linear"
  assert [b.attn.variant for b in loaded.model.blocks] == ["kda"] * 3 + ["mla"]
  prompt = np.random.default_rng(1).integers(0, 50, (1, 5))
  with torch.no_grad():
    want = live.generate(torch.tensor(prompt), max_new_tokens=6, do_sample=False).numpy()
  got = np.asarray(generate(loaded.model, jnp.asarray(prompt), 6))
  np.testing.assert_array_equal(got, want)


@pytest.mark.slow
def test_logits_equal_transformers_under_right_padding(live):
  loaded = hf.from_hf(live)
  cfg = loaded.config
  assert cfg.layer_types == tuple(KINDS) and cfg.rope_layout == "none" and cfg.rope_dim == 4
  assert cfg.mlp == "moe" and cfg.moe_dense_first == 1 and cfg.linear_variant == "kda"
  assert_logits_equal_under_right_padding(live, loaded)


@pytest.mark.slow
@pytest.mark.parametrize("changes", [
    dict(),  # the fixture's sizes
    dict(q_lora_rank=7, linear_num_heads=3, linear_head_dim=4, linear_conv_kernel_dim=3, num_attention_heads=2,
         num_key_value_heads=2, layer_types=["linear_attention", "full_attention", "linear_attention",
                                             "full_attention"], mlp_layer_types=["dense", "dense", "sparse", "sparse"]),
])
def test_cached_greedy_decoding_over_many_tokens_and_sizes(changes):
  model = build(tiny(**changes), seed=5)
  loaded = hf.from_hf(model)
  prompt = np.random.default_rng(4).integers(0, 50, (2, 4))
  assert_greedy_decoding_equal(model, loaded, prompt, 30)


@pytest.mark.slow
def test_to_hf_and_back_is_exact(live):
  out = assert_to_hf_and_back_exact(live, "KimiLinearForCausalLM")
  assert out.config.layer_types == KINDS


def test_count_hf_equals_transformers_parameters(live, tmp_path, capsys):
  live.save_pretrained(tmp_path / "ckpt")
  code = cli.main(["count", "--hf", str(tmp_path / "ckpt"), "--format", "json", "--dtype", "bfloat16"])
  out = capsys.readouterr()
  assert code == 0, out.err
  report = json.loads(out.out)
  assert report["total"] == sum(p.numel() for p in live.parameters())
  rows = {r["type"]: r for r in report["layer_types"]}
  H, K, W = 2, 6, 4  # a kda layer: H·K·K float32 states + (W − 1)·3HK convolution inputs
  assert rows["linear_attention"]["state_bytes_per_layer"] == 4 * (H * K * K + (W - 1) * 3 * H * K)
  assert rows["full_attention"]["kv_bytes_per_token_per_layer"] == 2 * (10 + 4)  # latent + shared key, bf16


def _release_names(sd):
  """A state dict under transformers' in-memory names -> the names Moonshot's release holds, written here
  from the model card's layout (not attn's reader): q/k/v_conv1d apart, the forget gate's tensors
  directly under self_attn, every feed-forward under block_sparse_moe, experts as w1 (gate), w3 (up),
  w2 (down) one matrix each."""
  out = {}
  for name, a in sd.items():
    name = name.replace(".self_attn.forget_gate.", ".self_attn.").replace(".mlp.", ".block_sparse_moe.")
    if name.endswith(".self_attn.conv1d.weight"):
      for part, c in zip(np.split(a, 3), "qkv"):
        out[name.replace(".conv1d.", f".{c}_conv1d.")] = part
    elif name.endswith(".experts.gate_up_proj"):  # (E, 2F, D), gate rows first
      F = a.shape[1] // 2
      for e in range(a.shape[0]):
        out[name.replace("gate_up_proj", f"{e}.w1.weight")] = a[e, :F]
        out[name.replace("gate_up_proj", f"{e}.w3.weight")] = a[e, F:]
    elif name.endswith(".experts.down_proj"):
      out |= {name.replace("down_proj", f"{e}.w2.weight"): a[e] for e in range(a.shape[0])}
    else:
      out[name] = a
  return out


def _write(path, config, sd):
  save_file = pytest.importorskip("safetensors.numpy").save_file
  path.mkdir()
  (path / "config.json").write_text(json.dumps(config))
  save_file({k: np.ascontiguousarray(v, np.float32) for k, v in sd.items()}, str(path / "model.safetensors"))
  return str(path)


def _params(model):
  from hf_hybrid import nnx_state
  import jax
  return jax.tree.leaves(nnx_state(model))


def test_a_save_pretrained_directory_loads_and_matches_transformers(live, tmp_path):
  """What failed before: transformers' own save_pretrained writes the released names (its conversion
  mapping undone on save); read through numpy, the live model's parameters bit for bit, its logits, and
  to_hf of it saved again writes the same tensors under the same names."""
  live.save_pretrained(tmp_path / "ckpt")
  names = set(hf.read_weights(str(tmp_path / "ckpt")))
  if "model.layers.0.self_attn.conv1d.weight" not in names:  # transformers 5's conversion mapping: the release's
    assert {"model.layers.0.self_attn.q_conv1d.weight", "model.layers.0.self_attn.A_log",
            "model.layers.0.block_sparse_moe.gate_proj.weight",
            "model.layers.1.block_sparse_moe.experts.3.w2.weight"} <= names
  loaded = hf.from_hf(str(tmp_path / "ckpt"))
  for a, b in zip(_params(loaded.model), _params(hf.from_hf(live).model), strict=True):
    np.testing.assert_array_equal(a, b)
  ids = np.random.default_rng(3).integers(0, 50, (2, 7))
  with torch.no_grad():
    want = live(torch.tensor(ids)).logits.numpy()
  got = np.asarray(loaded.model(jnp.asarray(ids, jnp.int32)))
  assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()
  hf.to_hf(loaded).save_pretrained(tmp_path / "again")
  first, again = hf.read_weights(str(tmp_path / "ckpt")), hf.read_weights(str(tmp_path / "again"))
  assert set(first) == set(again)
  for name, a in first.items():
    np.testing.assert_array_equal(again[name], a, err_msg=name)


def test_the_release_layout_written_without_transformers_loads(live, tmp_path):
  """The release's names written with safetensors alone (_release_names, whatever this transformers saves):
  the same parameters as the live model's, bit for bit."""
  sd = {k: v.numpy() for k, v in live.state_dict().items()}
  path = _write(tmp_path / "release", live.config.to_dict(), _release_names(sd))
  for a, b in zip(_params(hf.from_hf(path).model), _params(hf.from_hf(live).model), strict=True):
    np.testing.assert_array_equal(a, b)


def test_an_unknown_tensor_is_refused_by_name_and_family_before_any_weight_is_read(live, tmp_path, monkeypatch):
  """A released directory with one tensor no layout of the family holds (a fourth convolution): refused
  naming it and the family from the safetensors header alone (reading the weights fails the test)."""
  sd = _release_names({k: v.numpy() for k, v in live.state_dict().items()})
  sd["model.layers.0.self_attn.o_conv1d.weight"] = sd["model.layers.0.self_attn.q_conv1d.weight"]
  path = _write(tmp_path / "odd", live.config.to_dict(), sd)
  from attn.nn.hf import load

  def no_weights(*args):
    raise AssertionError("a weight was read before the names were checked")
  monkeypatch.setattr(load, "read_weights", no_weights)
  with pytest.raises(ConfigError, match=r"checkpoint=\['model.layers.0.self_attn.o_conv1d.weight'\].*'kimi_linear'"):
    hf.from_hf(path)
  del sd["model.layers.0.self_attn.o_conv1d.weight"], sd["model.layers.2.self_attn.v_conv1d.weight"]
  with pytest.raises(ConfigError, match=r"no tensor 'layers.2.self_attn.conv1d.weight'.*'kimi_linear'"):
    hf.from_hf(_write(tmp_path / "short", live.config.to_dict(), sd))  # two of three: the stack is missing


def test_the_checkpoints_linear_attn_config_is_read():
  """A config.json as the release writes it: linear_attn_config (1-based layer lists), no layer_types."""
  config = tiny().to_dict()
  del config["layer_types"]
  config["linear_attn_config"] = {"full_attn_layers": [4], "kda_layers": [1, 2, 3], "head_dim": 6, "num_heads": 2,
                                  "short_conv_kernel_size": 4}
  cfg = hf.model_config(config)
  assert cfg.layer_types == tuple(KINDS) and cfg.layer_head(0).d_k == 6 and cfg.layer_head(0).num_heads == 2


@pytest.mark.parametrize("changes, field", [
    (dict(attention_bias=True), "config.attention_bias"),
    (dict(hidden_act="gelu"), "config.hidden_act"),
    (dict(num_key_value_heads=1), "config.num_key_value_heads"),
    (dict(mlp_layer_types=["sparse", "dense", "sparse", "sparse"]), "config.mlp_layer_types"),
    (dict(output_router_logits=True), "config.output_router_logits"),
])
def test_what_attn_does_not_run_is_refused_before_any_weight(changes, field):
  config = tiny(**changes).to_dict()
  with pytest.raises(ConfigError, match=f"{field}=.* is not allowed"):
    hf.model_config(config)


@pytest.mark.parametrize("changes, field", [
    ({"layer_types": ["linear_attention", "mamba", "linear_attention", "full_attention"]}, "config.layer_types"),
    ({"mla_use_nope": False}, "config.mla_use_nope"),
])
def test_what_a_config_json_may_say_that_attn_does_not_run_is_refused(changes, field):
  config = {**tiny().to_dict(), **changes}
  with pytest.raises(ConfigError, match=f"{field}=.* is not allowed"):
    hf.model_config(config)


@pytest.mark.slow
def test_the_family_kit_passes():
  from attn.testing import check_family
  measured = check_family("kimi_linear", tiny().to_dict())
  assert measured["logits_relative"] is not None and measured["logits_relative"] < 1e-4


def test_one_rms_norm_eps_for_every_norm_the_gated_ones_too():
  """rms_norm_eps 1e-5 (transformers' Kimi Linear default): the blocks', the q/k norms' and the linear
  layers' gated output norms' (HeadConfig.gated_norm_eps), read and written back."""
  cfg = hf.model_config(tiny(rms_norm_eps=1e-5).to_dict())
  linear = cfg.layer_types.index("linear_attention")
  assert cfg.norm_eps == 1e-5 and cfg.layer_head(linear).gated_norm_eps == 1e-5
  family = hf.FAMILIES["kimi_linear"]
  family.check_out(cfg)
  out = family.config_out(cfg) | {"model_type": family.model_types[0]}
  assert out["rms_norm_eps"] == 1e-5 and hf.model_config(out).layer_head(linear).gated_norm_eps == 1e-5
