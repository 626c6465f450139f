"""Qwen3-Next in: a tiny random Qwen3NextForCausalLM built in code (no download), read by
attn.nn.hf.from_hf into a hybrid DecoderLM (gated_deltanet and gated softmax layers); logits under
right padding and greedy decoding with caches and states against transformers; refusals by name."""

import numpy as np
import pytest

import jax.numpy as jnp

from attn import ConfigError
from attn.nn import hf
from attn.nn.decoding import generate
from hf_hybrid import (  # tests/hf_hybrid.py
    assert_greedy_decoding_equal, assert_logits_equal_under_right_padding, assert_to_hf_and_back_exact, nnx_state)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.qwen3_next", reason="this transformers has no qwen3_next")

KINDS = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]


def tiny(**changes):
  kw = dict(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=6, linear_value_head_dim=5, linear_conv_kernel_dim=4, layer_types=KINDS,
            num_experts=0, mlp_only_layers=[0, 1, 2, 3], max_position_embeddings=64, tie_word_embeddings=False)
  return transformers.Qwen3NextConfig(**{**kw, **changes})


def build(config, seed=0):
  torch.manual_seed(seed)
  model = transformers.Qwen3NextForCausalLM(config).eval()
  with torch.no_grad():  # zero-centred norms start at 0 (a scale of 1): move them so they are read
    for name, p in model.named_parameters():
      if name.endswith("norm.weight") and "linear_attn" not in name:
        p.normal_(0.0, 0.2)
  return model


@pytest.fixture(scope="module")
def live():
  return build(tiny())


# Experts after one dense layer: 4 of 12 wide, 2 kept, and a shared expert of 20 behind its σ gate.
EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12, shared_expert_intermediate_size=20,
               mlp_only_layers=[0])


@pytest.fixture(scope="module")
def live_moe():
  return build(tiny(**EXPERTS), seed=7)


@pytest.mark.slow
def test_logits_equal_transformers_under_right_padding(live):
  loaded = hf.from_hf(live)
  assert loaded.family == "qwen3_next"
  cfg = loaded.config
  assert cfg.layer_types == tuple(KINDS) and cfg.rope_dim == 2 and cfg.gate == "elementwise"  # 0.25 of 8
  assert [b.attn.variant for b in loaded.model.blocks] == ["gated_deltanet"] * 3 + ["per_head"]
  assert_logits_equal_under_right_padding(live, loaded)


def test_cached_greedy_decoding_equals_transformers(live):
  """The fast test: cached decoding (states and KV caches) against transformers' generate (attn's own
  full pass: the slow test below)."""
  loaded = hf.from_hf(live)
  prompt = np.random.default_rng(1).integers(0, 50, (1, 5))
  with torch.no_grad():
    want = live.generate(torch.tensor(prompt), max_new_tokens=6, do_sample=False).numpy()
  got = np.asarray(generate(loaded.model, jnp.asarray(prompt), 6))
  np.testing.assert_array_equal(got, want)


@pytest.mark.slow
def test_cached_greedy_decoding_over_many_tokens_and_sizes():
  """Thirty tokens from two prompts, at a second size (one key head, value heads 3 to 1, conv 3)."""
  torch.manual_seed(3)
  model = transformers.Qwen3NextForCausalLM(tiny(
      num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_num_key_heads=1,
      linear_num_value_heads=3, linear_key_head_dim=4, linear_value_head_dim=7, linear_conv_kernel_dim=3,
      layer_types=["linear_attention", "full_attention", "linear_attention"], num_hidden_layers=3,
      mlp_only_layers=[0, 1, 2])).eval()
  loaded = hf.from_hf(model)
  prompt = np.random.default_rng(4).integers(0, 50, (2, 4))
  assert_greedy_decoding_equal(model, loaded, prompt, 30)


@pytest.mark.parametrize("changes, field", [
    (dict(num_experts=4, mlp_only_layers=[1]), "config.mlp_only_layers, decoder_sparse_step"),
    (dict(num_experts=4, mlp_only_layers=[], decoder_sparse_step=2), "config.mlp_only_layers, decoder_sparse_step"),
    (dict(num_experts=4, mlp_only_layers=[0], output_router_logits=True), "config.output_router_logits"),
    (dict(attention_bias=True), "config.attention_bias"),
    (dict(linear_num_key_heads=3), "num_kv_heads"),
])
def test_what_attn_does_not_run_is_refused_before_any_weight(changes, field):
  config = tiny(**changes).to_dict()
  with pytest.raises(ConfigError, match=f"{field}=.* is not allowed"):
    hf.model_config(config)


def test_a_layer_type_attn_does_not_run_is_refused():
  config = {**tiny().to_dict(), "layer_types": ["linear_attention", "mamba", "linear_attention", "full_attention"]}
  with pytest.raises(ConfigError, match="config.layer_types=.* is not allowed"):
    hf.model_config(config)


def test_count_hf_equals_transformers_parameters_and_reports_the_state(live, tmp_path, capsys):
  import json
  from attn import cli
  from attn.count import hf as count_hf
  live.save_pretrained(tmp_path / "ckpt")
  code = cli.main(["count", "--hf", str(tmp_path / "ckpt"), "--format", "json"])
  out = capsys.readouterr()
  assert code == 0, out.err
  assert json.loads(out.out)["total"] == sum(p.numel() for p in live.parameters())
  report = count_hf.hf_report(live.config.to_dict(), "tiny")
  rows = {r["type"]: r for r in report["layer_types"]}
  # H·K·V float32 + (W − 1)·(2GK + HV) numbers per sequence, 4 bytes each, per linear layer
  assert rows["linear_attention"]["state_bytes_per_layer"] == 4 * (4 * 6 * 5 + 3 * (2 * 2 * 6 + 4 * 5))
  assert rows["linear_attention"]["kv_bytes_per_token_per_layer"] == 0
  assert rows["full_attention"]["kv_bytes_per_token_per_layer"] == 4 * 2 * 2 * 8  # float32 k and v, G=2, K=8


def test_to_hf_and_back_is_exact(live):
  out = assert_to_hf_and_back_exact(live, "Qwen3NextForCausalLM")
  assert out.config.layer_types == KINDS


def test_the_family_kit_passes():
  """attn.testing.check_family: read, refusals, the round trip and logits against transformers."""
  from attn.testing import check_family
  measured = check_family("qwen3_next", tiny().to_dict())
  assert measured["logits_relative"] is not None and measured["logits_relative"] < 1e-4


def test_count_hf_with_experts_equals_transformers_parameters(live_moe, tmp_path, capsys):
  """Router E·D, experts 3·D·F each, the shared expert 3·D·20 and its gate D, as transformers holds them."""
  import json
  from attn import cli
  live_moe.save_pretrained(tmp_path / "moe")
  code = cli.main(["count", "--hf", str(tmp_path / "moe"), "--format", "json"])
  out = capsys.readouterr()
  assert code == 0, out.err
  assert json.loads(out.out)["total"] == sum(p.numel() for p in live_moe.parameters())


@pytest.mark.slow
def test_experts_logits_decoding_and_to_hf_equal_transformers(live_moe):
  """The softmax router, the experts and the gated shared expert: logits under right padding, 30 tokens of
  cached greedy decoding (and attn's own full pass), and to_hf bit for bit, with the logits."""
  loaded = hf.from_hf(live_moe)
  cfg = loaded.config
  assert cfg.mlp == "moe" and cfg.moe_dense_first == 1 and cfg.moe_shared_d_ff == 20 and cfg.moe_shared_gate
  assert_logits_equal_under_right_padding(live_moe, loaded)
  prompt = np.random.default_rng(4).integers(0, 50, (2, 4))
  assert_greedy_decoding_equal(live_moe, loaded, prompt, 30)
  assert_to_hf_and_back_exact(live_moe, type(live_moe).__name__)


@pytest.mark.slow
def test_the_family_kit_passes_with_experts():
  from attn.testing import check_family
  measured = check_family("qwen3_next", tiny(**EXPERTS).to_dict())
  assert measured["logits_relative"] is not None and measured["logits_relative"] < 1e-4


def test_one_rms_norm_eps_for_every_norm_the_gated_ones_too():
  """rms_norm_eps 1e-5 (transformers' Kimi Linear default): the blocks', the q/k norms' and the linear
  layers' gated output norms' (HeadConfig.gated_norm_eps), read and written back."""
  cfg = hf.model_config(tiny(rms_norm_eps=1e-5).to_dict())
  linear = cfg.layer_types.index("linear_attention")
  assert cfg.norm_eps == 1e-5 and cfg.layer_head(linear).gated_norm_eps == 1e-5
  family = hf.FAMILIES["qwen3_next"]
  family.check_out(cfg)
  out = family.config_out(cfg) | {"model_type": family.model_types[0]}
  assert out["rms_norm_eps"] == 1e-5 and hf.model_config(out).layer_head(linear).gated_norm_eps == 1e-5


def test_experts_as_the_release_holds_them_read_the_same(live_moe):
  """Both layouts of the experts read as the same parameters: experts.{e}.gate_proj / up_proj / down_proj
  (transformers 4's, as 4.57 holds them) and the fused gate_up_proj / down_proj transformers 5 holds. The
  release's own state dict is one; the other is made from it."""
  import jax
  config = live_moe.config.to_dict()
  held = {k: v.detach().numpy() for k, v in live_moe.state_dict().items()}
  split, fused, E = {}, {}, config["num_experts"]
  for name, a in held.items():
    if name.endswith("experts.gate_up_proj"):  # transformers 5: (E, 2F, D), gate rows first; split here
      at, F = name.removesuffix("gate_up_proj"), a.shape[1] // 2
      for e in range(E):
        split[f"{at}{e}.gate_proj.weight"], split[f"{at}{e}.up_proj.weight"] = a[e, :F], a[e, F:]
    elif name.endswith("experts.down_proj"):
      for e in range(E):
        split[f"{name.removesuffix('down_proj')}{e}.down_proj.weight"] = a[e]
    elif ".experts.0." in name:  # transformers 4: one module per expert; fused here from all E
      at, proj = name.split(".experts.0.")
      stack = lambda p: np.stack([held[f"{at}.experts.{e}.{p}.weight"] for e in range(E)])  # noqa: E731
      if proj == "gate_proj.weight":
        fused[f"{at}.experts.gate_up_proj"] = np.concatenate([stack("gate_proj"), stack("up_proj")], 1)
      elif proj == "down_proj.weight":
        fused[f"{at}.experts.down_proj"] = stack("down_proj")
    if ".experts." not in name:  # the router, the shared expert and its gate, attention: in both
      split[name] = fused[name] = a
    else:  # the release's own layout
      (fused if name.endswith(("experts.gate_up_proj", "experts.down_proj")) else split)[name] = a
  assert len(split) - len(fused) == (config["num_hidden_layers"] - 1) * (3 * E - 2)  # every expert layer
  want, got = hf.from_hf((config, fused)), hf.from_hf((config, split))
  for a, b in zip(jax.tree.leaves(nnx_state(got.model)), jax.tree.leaves(nnx_state(want.model)), strict=True):
    np.testing.assert_array_equal(a, b)
