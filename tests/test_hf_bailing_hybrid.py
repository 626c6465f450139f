"""Ling-3 in and out: a tiny random BailingHybridForCausalLM built in code (no download) and written by
transformers' own save_pretrained, read by attn.nn.hf.from_hf into a hybrid DecoderLM (kda layers with full-rank
gates and the bounded decay, mla layers with a head-wise output gate, DeepSeek's experts with Ling's SwiGLU
clip); logits under right padding, cached greedy decoding, to_hf bit for bit, `attn count --hf` and the
refusals, against transformers.

The fast tier reads config.json dicts written here, without torch; everything that builds a transformers model
is slow and skips by name where transformers has no bailing_hybrid (it has from 5.20; the floor 4.51.1 has not).
"""

import inspect
import json
import shutil

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from attn import ConfigError, HeadConfig, api, cli, count, testing
from attn.nn import hf

KINDS = ["linear_attention", "full_attention", "linear_attention", "full_attention"]


def release_config(**changes):
  """A config.json as inclusionAI's release writes it (no layer_types or mlp_layer_types, head_dim the kda heads'
  width, the attribute_map's names): 3 MLA heads with d_k = 6 + 4 != d_v = 5, a latent of 10, 3 kda heads of 6,
  four experts in two groups, the first layer dense."""
  return {"model_type": "bailing_hybrid", "architectures": ["BailingHybridForCausalLM"], "vocab_size": 50,
          "hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 12, "num_hidden_layers": 4,
          "num_attention_heads": 3, "num_key_value_heads": 3, "kv_lora_rank": 10, "q_lora_rank": None,
          "qk_rope_head_dim": 4, "qk_nope_head_dim": 6, "v_head_dim": 5, "head_dim": 6, "num_experts": 4,
          "num_experts_per_token": 2, "num_expert_group": 2, "topk_group": 1, "num_shared_experts": 1,
          "routed_scaling_factor": 1.5, "moe_renormalize": True, "first_k_dense_replace": 1, "layer_group_size": 2,
          "short_conv_kernel_size": 4, "kda_safe_gate": True, "kda_lower_bound": -5.0, "hidden_act": "silu",
          "rms_norm_eps": 1e-6, "rope_theta": 6000000.0, "model_max_length": 64, "num_nextn_predict_layers": 1,
          "tie_word_embeddings": False, **changes}


def test_a_release_config_json_is_read_without_torch():
  """The fast sibling: the release's config.json (no layer_types: every layer_group_size-th layer full) as attn's
  layers, and what config_out writes read back to the same config."""
  cfg = hf.model_config(release_config())
  assert cfg.layer_types == tuple(KINDS) and cfg.linear_variant == "kda" and cfg.variant == "mla"
  kda = cfg.layer_head(0)
  assert (kda.num_heads, kda.num_kv_heads, kda.d_k, kda.d_v, kda.conv_width) == (3, 3, 6, 6, 4)
  assert kda.kda_full_rank and kda.kda_lower_bound == -5.0 and kda.gated_norm_eps == 1e-6
  assert cfg.gate == "headwise" and cfg.rope_layout == "interleaved" and cfg.rope_dim == 4 and cfg.head.d_k == 10
  assert cfg.layer_head(1).gate == "headwise" and kda.gate is None
  assert cfg.mlp == "moe" and cfg.moe_dense_first == 1 and cfg.moe_experts == 4 and cfg.moe_groups == 2
  assert cfg.moe_swiglu_limit is None
  family = hf.FAMILIES["bailing_hybrid"]
  family.check_out(cfg)
  assert hf.model_config(family.config_out(cfg) | {"model_type": "bailing_hybrid"}) == cfg
  soft = hf.model_config(release_config(kda_safe_gate=False, tie_word_embeddings=True, rope_theta=1234.0))
  assert soft.layer_head(0).kda_lower_bound is None  # the softplus decay
  assert not soft.tie_embeddings and soft.rope_theta == 1234.0  # transformers ties nothing here


def test_ling_swiglu_limits_are_read_as_one_clip_after_the_activation():
  limits = dict(expert_swiglu_limit_list=[0, 7.0, 7.0, 7.0], share_expert_swiglu_limit_list=[0, 7.0, 7.0, 7.0])
  cfg = hf.model_config(release_config(**limits))
  assert (cfg.moe_swiglu_limit, cfg.moe_swiglu_form) == (7.0, "clamp_after")
  routed = hf.model_config(release_config(**limits | {"share_expert_swiglu_limit_list": [0] * 4}))
  assert (routed.moe_swiglu_limit, routed.moe_swiglu_form) == (7.0, "clamp_after_routed")
  out = hf.FAMILIES["bailing_hybrid"].config_out(routed)
  assert out["expert_swiglu_limit_list"] == [0, 7.0, 7.0, 7.0] and out["share_expert_swiglu_limit_list"] == [0] * 4


@pytest.mark.parametrize("changes, field", [
    (dict(attention_bias=True), "config.attention_bias"),
    (dict(hidden_act="gelu"), "config.hidden_act"),
    (dict(num_key_value_heads=1), "config.num_key_value_heads"),
    (dict(layer_types=["linear_attention", "mamba", "linear_attention", "full_attention"]), "config.layer_types"),
    (dict(mlp_layer_types=["sparse", "dense", "sparse", "sparse"]), "config.mlp_layer_types"),
    (dict(kda_lower_bound=0.5), "config.kda_lower_bound"),
    (dict(expert_swiglu_limit_list=[0, 7.0, 5.0, 7.0]), "config.expert_swiglu_limit_list"),
    (dict(expert_swiglu_limit_list=[0, 7.0, 7.0, 7.0], share_expert_swiglu_limit_list=[0, 3.0, 3.0, 3.0]),
     "config.share_expert_swiglu_limit_list"),
    (dict(output_router_logits=True), "config.output_router_logits"),
    (dict(quantization_config={"quant_method": "fp8"}), "config.quantization_config"),
])
def test_what_attn_does_not_run_is_refused_before_any_weight(changes, field):
  with pytest.raises(ConfigError, match=f"{field}=.* is not allowed"):
    hf.model_config(release_config(**changes))


LING = HeadConfig(d_model=24, num_heads=3, d_k=4, d_v=4, use_bias=False, conv_width=3, chunk=4, kda_full_rank=True,
                  kda_lower_bound=-5.0)


def test_kda_options_are_counted_in_closed_form_and_refused_elsewhere():
  """Full rank: W_f (D,H,K) and W_g (D,H,V) in place of the low-rank pairs; the bounded decay adds no parameter."""
  D, H, K = 24, 3, 4
  low = LING.replace(kda_full_rank=False)
  shapes = api.param_shapes("kda", LING)
  assert shapes["w_f"] == (D, H, K) and shapes["w_g"] == (D, H, K) and "w_fa" not in shapes
  assert count.param_counts("kda", LING)["analytic"] == sum(int(np.prod(s)) for s in shapes.values())
  assert count.param_counts("kda", LING)["analytic"] - count.param_counts("kda", low)["analytic"] == \
      2 * (D * H * K) - (D * K + K * H * K) - (D * K + K * H * K)
  assert api.param_shapes("kda", LING) == api.param_shapes("kda", LING.replace(kda_lower_bound=None))
  for option in (dict(kda_full_rank=True), dict(kda_lower_bound=-5.0)):
    with pytest.raises(ConfigError, match=f"{next(iter(option))}=.* is not allowed.*kda"):
      api.check_config("gated_deltanet", HeadConfig(d_model=8, num_heads=2, use_bias=False, **option))
  for bad in (0.0, 1.0, float("-inf"), True):
    with pytest.raises(ConfigError, match="kda_lower_bound=.* is not allowed: None .* or a negative finite"):
      HeadConfig(d_model=8, num_heads=2, kda_lower_bound=bad)


# ---- against transformers (slow: each builds a transformers model).

def _transformers():
  pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  pytest.importorskip("transformers.models.bailing_hybrid", reason="this transformers has no bailing_hybrid")
  return transformers


def tiny(**changes):
  """The release config's sizes as transformers' BailingHybridConfig (which writes layer_types itself)."""
  transformers = _transformers()
  names = {"num_experts": "num_local_experts", "num_experts_per_token": "num_experts_per_tok",
           "num_expert_group": "n_group", "num_shared_experts": "n_shared_experts", "moe_renormalize": "norm_topk_prob",
           "model_max_length": "max_position_embeddings", "num_nextn_predict_layers": "num_mtp_layers"}
  kw = {names.get(k, k): v for k, v in release_config().items() if k not in ("model_type", "architectures")}
  return transformers.BailingHybridConfig(**kw | dict(pad_token_id=None, bos_token_id=None, eos_token_id=None)
                                          | changes)


def build(config, seed=0):
  torch = pytest.importorskip("torch")
  torch.manual_seed(seed)
  model = _transformers().BailingHybridForCausalLM(config).eval()
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


@pytest.fixture(scope="module")
def saved(live, tmp_path_factory):
  path = tmp_path_factory.mktemp("bailing_hybrid") / "ckpt"
  live.save_pretrained(path)
  return str(path)


def _params(model):
  from hf_hybrid import nnx_state  # tests/hf_hybrid.py
  return jax.tree.leaves(nnx_state(model))


def _same_params(a, b):
  for x, y in zip(_params(a), _params(b), strict=True):
    np.testing.assert_array_equal(x, y)


@pytest.mark.slow
def test_a_save_pretrained_directory_loads_and_decodes_as_transformers(live, saved):
  """The directory transformers writes (the release's names: word_embeddings, attention, dense, q/k/v_conv1d,
  f_proj and A_log under attention, expert_bias, one matrix per expert) holds the live model's parameters bit
  for bit; cached greedy decoding equals generate and attn's own full pass."""
  from hf_hybrid import assert_greedy_decoding_equal
  names = set(hf.read_weights(saved))
  assert {"model.word_embeddings.weight", "model.layers.0.attention.q_conv1d.weight", "model.layers.0.attention.A_log",
          "model.layers.0.attention.f_proj.weight", "model.layers.1.attention.dense.weight",
          "model.layers.1.mlp.gate.expert_bias", "model.layers.1.mlp.experts.3.down_proj.weight"} <= names
  loaded = hf.from_hf(saved)
  assert loaded.family == "bailing_hybrid"
  assert [b.attn.variant for b in loaded.model.blocks] == ["kda", "mla", "kda", "mla"]
  _same_params(loaded.model, hf.from_hf(live).model)
  assert_greedy_decoding_equal(live, loaded, np.random.default_rng(4).integers(0, 50, (2, 4)), 12)


@pytest.mark.slow
def test_logits_equal_transformers_under_right_padding(live, saved):
  from hf_hybrid import assert_logits_equal_under_right_padding
  assert_logits_equal_under_right_padding(live, hf.from_hf(saved))


@pytest.mark.slow
def test_to_hf_saved_again_round_trips_bit_for_bit(live, saved, tmp_path):
  """to_hf(...).save_pretrained(dir) writes the same tensors under the same names, and from_hf(dir) holds the
  same parameters; the transformers model to_hf builds holds live's state dict bit for bit."""
  from hf_hybrid import assert_to_hf_and_back_exact
  loaded = hf.from_hf(saved)
  hf.to_hf(loaded).save_pretrained(tmp_path / "again")
  first, again = hf.read_weights(saved), hf.read_weights(str(tmp_path / "again"))
  assert set(first) == set(again)
  for name, a in first.items():
    np.testing.assert_array_equal(again[name], a, err_msg=name)
  _same_params(hf.from_hf(str(tmp_path / "again")).model, loaded.model)
  assert assert_to_hf_and_back_exact(live, "BailingHybridForCausalLM").config.layer_types == KINDS


@pytest.mark.slow
def test_count_hf_equals_transformers_parameters(live, saved, capsys):
  code = cli.main(["count", "--hf", saved, "--format", "json", "--dtype", "bfloat16"])
  out = capsys.readouterr()
  assert code == 0, out.err
  report = json.loads(out.out)
  assert report["total"] == sum(p.numel() for p in live.parameters())
  rows = {r["type"]: r for r in report["layer_types"]}
  H, K, W = 3, 6, 4  # a kda layer: H·K·K float32 states + (W − 1)·3HK convolution inputs
  assert rows["linear_attention"]["state_bytes_per_layer"] == 4 * (H * K * K + (W - 1) * 3 * H * K)
  assert rows["full_attention"]["kv_bytes_per_token_per_layer"] == 2 * (10 + 4)  # latent + shared key, bf16


def _copy_with(saved, path, change):
  """saved's directory copied to path with its tensors changed by change(dict) (safetensors alone)."""
  save_file = pytest.importorskip("safetensors.numpy").save_file
  shutil.copytree(saved, path)
  sd = hf.read_weights(saved)
  change(sd)
  (path / "model.safetensors").unlink()
  save_file({k: np.ascontiguousarray(v) for k, v in sd.items()}, str(path / "model.safetensors"))
  return str(path)


@pytest.mark.slow
def test_an_unknown_tensor_is_refused_by_name_and_family_before_any_weight_is_read(saved, tmp_path, monkeypatch):
  def odd(sd):
    sd["model.layers.0.attention.o_conv1d.weight"] = sd["model.layers.0.attention.q_conv1d.weight"]
  path = _copy_with(saved, tmp_path / "odd", odd)
  from attn.nn.hf import load

  def no_weights(*args):
    raise AssertionError("a weight was read before the names were checked")
  monkeypatch.setattr(load, "read_weights", no_weights)
  with pytest.raises(ConfigError, match=r"checkpoint=\['model.layers.0.attention.o_conv1d.weight'\].*'bailing_hybrid'"):
    hf.from_hf(path)


@pytest.mark.slow
def test_the_multi_token_prediction_layer_is_skipped_by_name(live, saved, tmp_path):
  """The release stores its MTP layer as layers.{L} (transformers does not run it): read past, the rest the same."""
  def mtp(sd):
    sd |= {k.replace("layers.3.", "layers.4."): v for k, v in list(sd.items()) if ".layers.3." in k}
  _same_params(hf.from_hf(_copy_with(saved, tmp_path / "mtp", mtp)).model, hf.from_hf(live).model)


@pytest.mark.slow
@pytest.mark.parametrize("changes", [
    # the clip on routed and shared experts, small enough to bite; a low-rank query; the softplus decay
    dict(expert_swiglu_limit_list=[3.0, 0.05, 0.05, 0.05], share_expert_swiglu_limit_list=[0, 0.05, 0.05, 0.05],
         q_lora_rank=7, kda_safe_gate=False),
    # the routed experts' clip alone; kda heads other than the MLA heads; two dense layers; layers in another order;
    # tie_word_embeddings, which BailingHybridForCausalLM does not act on
    dict(expert_swiglu_limit_list=[0, 0, 0.05, 0.05], layer_types=["full_attention", "linear_attention",
                                                                    "linear_attention", "full_attention"],
         mlp_layer_types=["dense", "dense", "sparse", "sparse"], linear_num_heads=2, linear_head_dim=4,
         tie_word_embeddings=True),
])
def test_other_sizes_and_the_swiglu_clip_match_transformers(changes):
  """What the release's BailingHybridConfig lacks it ignores, and attn would read: without
  expert_swiglu_limit_list (5.20 to 5.24: unclipped experts; 5.25 on) the sizes run without the clip and its
  checks; without q_lora_rank (5.20 to 5.23: the MLA query always q_proj; 5.24 on) the low-rank query case skips
  by name."""
  from hf_hybrid import (assert_greedy_decoding_equal, assert_logits_equal_under_right_padding,
                         assert_to_hf_and_back_exact)
  torch = pytest.importorskip("torch")
  transformers = _transformers()
  offered = inspect.signature(transformers.BailingHybridConfig.__init__).parameters
  if "q_lora_rank" in changes and "q_lora_rank" not in offered:
    pytest.skip(f"q_lora_rank: transformers {transformers.__version__}'s BailingHybrid has no query latent (5.24 on)")
  clipped = "expert_swiglu_limit_list" in offered
  if not clipped:
    changes = {k: v for k, v in changes.items() if "swiglu_limit" not in k}
  model = build(tiny(**changes), seed=5)
  with torch.no_grad():  # experts large enough that the 0.05 clip changes their outputs
    for name, p in model.named_parameters():
      if ".mlp." in name:
        p.mul_(30.0)
  loaded = hf.from_hf(model)
  if clipped:
    assert loaded.config.moe_swiglu_form == ("clamp_after" if "q_lora_rank" in changes else "clamp_after_routed")
  assert_logits_equal_under_right_padding(model, loaded)
  assert_greedy_decoding_equal(model, loaded, np.random.default_rng(4).integers(0, 50, (1, 4)), 10)
  assert_to_hf_and_back_exact(model, "BailingHybridForCausalLM")
  if not clipped:
    return
  unclipped = hf.build("decoder_lm", loaded.config.replace(moe_swiglu_limit=None, moe_swiglu_form="gpt_oss"),
                       __import__("hf_hybrid").nnx_state(loaded.model))
  ids = jnp.asarray(np.random.default_rng(0).integers(0, 50, (1, 7)))
  assert float(jnp.abs(unclipped(ids) - loaded.model(ids)).max()) > 1e-2  # the clip was exercised


@pytest.mark.slow
def test_the_family_kit_passes(live):
  measured = testing.check_family("bailing_hybrid", live)
  assert measured["logits_relative"] is not None and measured["logits_relative"] < 1e-4


@pytest.mark.slow
def test_the_variant_kit_passes_with_the_kda_options():
  testing.check_variant("kda", configs=(LING, LING.replace(kda_lower_bound=-2.0, num_kv_heads=3, d_v=5,
                                                            kda_full_rank=False)))


@pytest.mark.slow
def test_kda_flops_with_the_options_match_xla(monkeypatch):
  from test_linear_flops import TOLERANCE, unrolled_xla_flops  # tests/test_linear_flops.py
  for cfg in (LING, LING.replace(kda_lower_bound=None), LING.replace(kda_full_rank=False)):
    assert unrolled_xla_flops("kda", cfg, 9, monkeypatch) == pytest.approx(count.flops("kda", cfg, 9),
                                                                           rel=TOLERANCE["kda"])
