"""Qwen3.5 (text) in and out: a tiny random Qwen3_5ForCausalLM built in code (no download), read by
attn.nn.hf.from_hf into a hybrid DecoderLM (gated_deltanet and gated softmax layers); logits under
right padding, cached greedy decoding, to_hf bit for bit, `attn count --hf` and the refusals,
against transformers."""

import inspect
import json

import numpy as np
import pytest

import jax.numpy as jnp

from attn import ConfigError, cli
from attn.nn import hf
from attn.nn.decoding import generate
from hf_hybrid import (  # tests/hf_hybrid.py
    assert_greedy_decoding_equal, assert_logits_equal_under_right_padding, assert_to_hf_and_back_exact, nnx_state)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.qwen3_5", reason="this transformers has no qwen3_5")

KINDS = ["linear_attention", "full_attention", "linear_attention", "full_attention"]


def tiny(**changes):
  """Awkward sizes: 3 query heads over 1 kv head of 16 (4 rotated dims), 2 key heads of 6 and 4
  value heads of 5 in the linear layers."""
  kw = dict(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=3,
            num_key_value_heads=1, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=6, linear_value_head_dim=5, linear_conv_kernel_dim=4, layer_types=KINDS,
            max_position_embeddings=64, tie_word_embeddings=False)
  return transformers.Qwen3_5TextConfig(**{**kw, **changes})


def build(config, seed=0):
  torch.manual_seed(seed)
  model = transformers.Qwen3_5ForCausalLM(config).eval()
  with torch.no_grad():  # zero-centred norms start at 0 (a scale of 1): move them so they are read
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.normal_(0.0, 0.2)
  return model


@pytest.fixture(scope="module")
def live():
  return build(tiny())


def test_cached_greedy_decoding_equals_transformers(live):
  """The fast test: states and KV caches, six tokens (attn's own full pass: the slow test below)."""
  loaded = hf.from_hf(live)
  assert loaded.family == "qwen3_5_text"
  assert [b.attn.variant for b in loaded.model.blocks] == ["gated_deltanet", "per_head"] * 2
  prompt = np.random.default_rng(1).integers(0, 50, (1, 5))
  with torch.no_grad():
    want = live.generate(torch.tensor(prompt), max_new_tokens=6, do_sample=False).numpy()
  got = np.asarray(generate(loaded.model, jnp.asarray(prompt), 6))
  np.testing.assert_array_equal(got, want)


@pytest.mark.slow
def test_logits_equal_transformers_under_right_padding(live):
  loaded = hf.from_hf(live)
  cfg = loaded.config
  assert cfg.layer_types == tuple(KINDS) and cfg.rope_dim == 4 and cfg.gate == "elementwise"  # 0.25 of 16
  assert_logits_equal_under_right_padding(live, loaded)


@pytest.mark.slow
@pytest.mark.parametrize("changes", [
    dict(),
    dict(num_attention_heads=2, num_key_value_heads=2, head_dim=8, linear_num_key_heads=1, linear_num_value_heads=3,
         linear_key_head_dim=4, linear_value_head_dim=7, linear_conv_kernel_dim=3, num_hidden_layers=3,
         layer_types=["linear_attention", "linear_attention", "full_attention"], tie_word_embeddings=True),
])
def test_cached_greedy_decoding_over_many_tokens_and_sizes(changes):
  model = build(tiny(**changes), seed=5)
  loaded = hf.from_hf(model)
  prompt = np.random.default_rng(4).integers(0, 50, (2, 4))
  assert_greedy_decoding_equal(model, loaded, prompt, 30)


@pytest.mark.slow
def test_to_hf_and_back_is_exact(live):
  out = assert_to_hf_and_back_exact(live, "Qwen3_5ForCausalLM")
  assert out.config.layer_types == KINDS


def test_count_hf_equals_transformers_parameters(live, tmp_path, capsys):
  live.save_pretrained(tmp_path / "ckpt")
  code = cli.main(["count", "--hf", str(tmp_path / "ckpt"), "--format", "json", "--dtype", "bfloat16"])
  out = capsys.readouterr()
  assert code == 0, out.err
  report = json.loads(out.out)
  assert report["total"] == sum(p.numel() for p in live.parameters())
  rows = {r["type"]: r for r in report["layer_types"]}
  # H·K·V float32 + (W − 1)·(2GK + HV) numbers per sequence, 4 bytes each, per linear layer
  assert rows["linear_attention"]["state_bytes_per_layer"] == 4 * (4 * 6 * 5 + 3 * (2 * 2 * 6 + 4 * 5))
  assert rows["full_attention"]["kv_bytes_per_token_per_layer"] == 2 * 1 * 2 * 16  # bf16 k and v, G=1, K=16


@pytest.mark.parametrize("changes, field", [
    (dict(attention_bias=True), "config.attention_bias"),
    (dict(linear_num_key_heads=3), "num_kv_heads"),
    (dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0, "partial_rotary_factor": 0.25}),
     "config.rope_parameters.rope_type"),
])
def test_what_attn_does_not_run_is_refused_before_any_weight(changes, field):
  config = tiny(**changes).to_dict()
  with pytest.raises(ConfigError, match=f"{field}=.* is not allowed"):
    hf.model_config(config)


def test_experts_are_refused_by_name():
  """Qwen3.5's dense text model has none: a config that says otherwise is refused before any weight."""
  with pytest.raises(ConfigError, match="config.num_experts=4 is not allowed"):
    hf.model_config({**tiny().to_dict(), "num_experts": 4})


def test_a_layer_type_attn_does_not_run_is_refused():
  config = {**tiny().to_dict(), "layer_types": ["linear_attention", "mamba", "linear_attention", "full_attention"]}
  with pytest.raises(ConfigError, match="config.layer_types=.* is not allowed"):
    hf.model_config(config)


def test_the_release_s_multi_token_prediction_weights_are_not_read(live):
  """As transformers: mtp.* tensors beside the model's are skipped, the rest read as they are."""
  config = live.config.to_dict()
  state = {k: v.numpy() for k, v in live.state_dict().items()} | {"mtp.fc.weight": np.ones((32, 64), np.float32)}
  loaded = hf.from_hf((config, state))
  assert loaded.family == "qwen3_5_text"


def test_names_under_the_language_model_read_the_same(live):
  """model.language_model.* (the released checkpoints; save_pretrained of transformers 5.2-5.5) reads as model.*."""
  import jax
  config = live.config.to_dict()
  state = {k: v.numpy() for k, v in live.state_dict().items()}
  wrapped = {("model.language_model." + k.removeprefix("model.") if k.startswith("model.") else k): a
             for k, a in state.items()}
  assert "model.language_model.embed_tokens.weight" in wrapped and "lm_head.weight" in wrapped
  want, got = hf.from_hf((config, state)), hf.from_hf((config, wrapped))
  for a, b in zip(jax.tree.leaves(nnx_state(got.model)), jax.tree.leaves(nnx_state(want.model)), strict=True):
    np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_the_family_kit_passes():
  from attn.testing import check_family
  measured = check_family("qwen3_5_text", tiny().to_dict())
  assert measured["logits_relative"] is not None and measured["logits_relative"] < 1e-4


def test_one_rms_norm_eps_for_every_norm_the_gated_ones_too():
  """rms_norm_eps 1e-5 (transformers' Kimi Linear default): the blocks', the q/k norms' and the linear
  layers' gated output norms' (HeadConfig.gated_norm_eps), read and written back."""
  cfg = hf.model_config(tiny(rms_norm_eps=1e-5).to_dict())
  linear = cfg.layer_types.index("linear_attention")
  assert cfg.norm_eps == 1e-5 and cfg.layer_head(linear).gated_norm_eps == 1e-5
  family = hf.FAMILIES["qwen3_5_text"]
  family.check_out(cfg)
  out = family.config_out(cfg) | {"model_type": family.model_types[0]}
  assert out["rms_norm_eps"] == 1e-5 and hf.model_config(out).layer_head(linear).gated_norm_eps == 1e-5


def tiny_moe(**changes):
  """qwen3_5_moe_text: the same layers, 4 experts of 12 (2 kept) and a gated shared expert of 20 in each."""
  moe = pytest.importorskip("transformers.models.qwen3_5_moe", reason="this transformers has no qwen3_5_moe")
  # its keyword arguments (5.2 and 5.3's configs are no dataclasses: no __dataclass_fields__; 5.4's are)
  fields = set(inspect.signature(moe.Qwen3_5MoeTextConfig.__init__).parameters)
  kw = {k: v for k, v in tiny().to_dict().items() if k in fields}
  kw |= dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12, shared_expert_intermediate_size=20)
  return moe.Qwen3_5MoeTextConfig(**{**kw, **changes}), moe


def test_the_moe_text_model_counts_and_refuses_by_name(tmp_path, capsys):
  """The fast sibling: `attn count --hf` against transformers' count; a config without experts refused."""
  config, moe = tiny_moe()
  torch.manual_seed(0)
  model = moe.Qwen3_5MoeForCausalLM(config).eval()
  model.save_pretrained(tmp_path / "moe")
  code = cli.main(["count", "--hf", str(tmp_path / "moe"), "--format", "json"])
  out = capsys.readouterr()
  assert code == 0, out.err
  assert json.loads(out.out)["total"] == sum(p.numel() for p in model.parameters())
  with pytest.raises(ConfigError, match="config.num_experts=0 is not allowed"):
    hf.model_config({**config.to_dict(), "num_experts": 0})


@pytest.mark.slow
def test_the_moe_text_model_equals_transformers():
  """Logits under right padding, 30 tokens of cached greedy decoding (and attn's full pass), to_hf bit for
  bit with the same logits, and the kit."""
  config, moe = tiny_moe()
  torch.manual_seed(3)
  model = moe.Qwen3_5MoeForCausalLM(config).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.normal_(0.0, 0.2)
  loaded = hf.from_hf(model)
  assert loaded.family == "qwen3_5_moe_text" and loaded.config.mlp == "moe" and loaded.config.moe_dense_first == 0
  assert_logits_equal_under_right_padding(model, loaded)
  prompt = np.random.default_rng(4).integers(0, 50, (2, 4))
  assert_greedy_decoding_equal(model, loaded, prompt, 30)
  assert_to_hf_and_back_exact(model, "Qwen3_5MoeForCausalLM")
  from attn.testing import check_family
  assert check_family("qwen3_5_moe_text", config.to_dict())["logits_relative"] < 1e-4
