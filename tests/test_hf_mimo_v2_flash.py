"""MiMo-V2-Flash (mimo_v2_flash, attn.nn.hf.mimo_v2_flash): tiny random models built with transformers' own
classes (nothing downloaded), against transformers itself: logits under right padding, the directory its
save_pretrained writes (sinks as attention_sink_bias, one tensor per expert: the release's names),
cached greedy decoding against generate, to_hf bit for bit, `attn count --hf` against transformers'
parameter count; refusals by name.

The model: 4 query heads over d_model 24, query/key heads of 12 and value heads of 6 (d_v < d_k) times
attention_value_scale 0.6, one kv head in the full layer and two (with sinks) in the sliding ones
(window 3), partial RoPE per layer type (4 of 12 dims at base 500, 6 at 50), q/k/v biases, a dense
first layer and DeepSeek-routed experts (4, top 2, 2 groups) after. Tests that build a transformers
model skip where the installed release lacks mimo_v2_flash (5.25 has it; CI's floor, 4.51.1, does not).
"""

import json

import numpy as np
import pytest

from attn import ConfigError, cli
from attn.nn import hf

TOL = 1e-4  # relative to the largest logit, float32
KW = dict(vocab_size=53, hidden_size=24, intermediate_size=40, moe_intermediate_size=8, num_hidden_layers=3,
          num_attention_heads=4, num_key_value_heads=1, head_dim=12, v_head_dim=6, n_routed_experts=4,
          num_experts_per_tok=2, n_group=2, topk_group=1, sliding_window=3, max_position_embeddings=32,
          layer_types=["full_attention", "sliding_attention", "sliding_attention"], attention_bias=True,
          attention_value_scale=0.6,
          rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.334},
                           "sliding_attention": {"rope_type": "default", "rope_theta": 50.0,
                                                 "partial_rotary_factor": 0.5}},
          pad_token_id=None, bos_token_id=None, eos_token_id=None)


def _transformers():
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  pytest.importorskip("transformers.models.mimo_v2_flash", reason=f"mimo_v2_flash is not in transformers "
                      f"{transformers.__version__}")
  return torch, transformers


def _model(seed=0, kw=KW):
  """A random MiMoV2FlashForCausalLM, every weight (sinks and the correction bias too) moved."""
  torch, transformers = _transformers()
  torch.manual_seed(seed)
  m = transformers.MiMoV2FlashForCausalLM(transformers.MiMoV2FlashConfig(**kw)).eval()
  with torch.no_grad():
    for p in m.parameters():
      p.add_(0.1 * torch.randn_like(p))
    for layer in m.model.layers[1:]:
      layer.mlp.gate.e_score_correction_bias.add_(0.1 * torch.randn(4))
  return m


def test_config_read_as_written_here():
  """The fast sibling of the tests against transformers: config.json alone, each layer's head."""
  cfg = hf.model_config({"model_type": "mimo_v2_flash", **KW})
  heads = [cfg.layer_head(i) for i in range(3)]
  assert [(h.d_k, h.d_v, h.num_kv_heads, h.sinks, h.window) for h in heads] == [
      (12, 6, 1, False, None), (12, 6, 2, True, 3), (12, 6, 2, True, 3)]
  assert [(h.rope_dim, h.rope_theta) for h in heads] == [(4, 500.0), (6, 50.0), (6, 50.0)]
  assert cfg.value_scale == 0.6 and cfg.mlp == "moe" and cfg.moe_dense_first == 1 and cfg.moe_shared_experts == 0
  assert hf.model_config({"model_type": "mimo_v2_flash", **KW, "attention_value_scale": None}).value_scale is None
  old = {k: v for k, v in KW.items() if k != "sliding_window"} | {"sliding_window_size": 2}
  assert hf.model_config({"model_type": "mimo_v2_flash", **old}).window == 3  # size + 1, transformers' rule


@pytest.mark.slow  # torch, transformers and compiles: ~20 s; test_config_read_as_written_here is its sibling
def test_family_contract_and_the_save_pretrained_directory(tmp_path):
  """check_family (round trip, refusals, save_pretrained's directory read back bit for bit, logits under
  right padding); from_hf of the directory, which holds the release's names, gives the same model."""
  torch, _ = _transformers()
  from attn.testing import check_family
  m = _model(seed=2)
  assert check_family("mimo_v2_flash", m)["logits_relative"] <= TOL
  m.save_pretrained(tmp_path / "mimo")
  names = set(hf.read_weights(tmp_path / "mimo"))
  assert "model.layers.1.self_attn.attention_sink_bias" in names and "model.layers.1.mlp.experts.3.up_proj.weight" in names
  back = hf.to_hf(hf.from_hf(tmp_path / "mimo")).state_dict()
  want = m.state_dict()
  assert set(want) == set(back) and all(torch.equal(want[k], back[k]) for k in want)


@pytest.mark.slow
def test_multi_token_prediction_layers_are_skipped_by_name(tmp_path):
  """The release's model.mtp.* tensors are not run (transformers ignores them on load too)."""
  m = _model(seed=5)
  from attn.nn.hf.files import read_object
  config, state = read_object(m, ("MiMoV2FlashForCausalLM",))
  extra = dict(state) | {"model.mtp.layers.0.enorm.weight": np.ones(24, np.float32)}
  plain, with_mtp = hf.from_hf((config, state)), hf.from_hf((config, extra))
  assert plain.config == with_mtp.config
  with pytest.raises(ConfigError, match=r"model.layers.9.foo"):
    hf.from_hf((config, dict(state) | {"model.layers.9.foo": np.ones(2, np.float32)}))


@pytest.mark.slow
def test_cached_greedy_decoding_equals_generate():
  torch, _ = _transformers()
  import jax.numpy as jnp
  m = _model(seed=4)
  loaded = hf.from_hf(m)
  prompt = torch.as_tensor(np.random.default_rng(4).integers(0, 53, (1, 5)))
  with torch.no_grad():
    want = m.generate(prompt, max_new_tokens=8, do_sample=False).numpy()
  got = np.asarray(loaded.model.generate(jnp.asarray(prompt.numpy()), 8))
  np.testing.assert_array_equal(got, want)


@pytest.mark.slow
def test_count_hf_equals_transformers_parameter_count(tmp_path, capsys):
  m = _model()
  m.save_pretrained(tmp_path / "mimo")
  code = cli.main(["count", "--hf", str(tmp_path / "mimo"), "--format", "json"])
  out = capsys.readouterr()
  assert code == 0, out.err
  assert json.loads(out.out)["total"] == sum(p.numel() for p in m.parameters())


@pytest.mark.parametrize("changes, match", [
    (dict(layer_types=["full_attention", "chunked_attention", "full_attention"]), r"config.layer_types="),
    (dict(mlp_layer_types=["sparse", "dense", "sparse"]), r"config.mlp_layer_types=.*'dense' layers first"),
    (dict(rope_parameters={"full_attention": {"rope_type": "yarn", "rope_theta": 5.0, "factor": 2.0}}),
     r"config.rope_parameters.full_attention.rope_type='yarn'"),
    (dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 5.0, "partial_rotary_factor": 0.1}}),
     r"config.rope_parameters.full_attention.partial_rotary_factor=0.1"),
    (dict(attention_value_scale=0.0), r"value_scale=0.0 is not allowed"),
    (dict(output_router_logits=True), r"config.output_router_logits=True"),
])
def test_what_attn_cannot_read_is_refused_by_name_before_any_weight(changes, match):
  with pytest.raises(ConfigError, match=match):
    hf.model_config({"model_type": "mimo_v2_flash", **KW} | changes)


def test_to_hf_refuses_a_schedule_mimo_cannot_hold():
  from flax import nnx
  from attn.nn.models import DecoderLM
  cfg = hf.model_config({"model_type": "mimo_v2_flash", **KW})
  bad = cfg.replace(layer_heads={"sliding_attention": {"num_kv_heads": 2}})  # sliding layers without sinks
  with pytest.raises(ConfigError, match=r"layer 1 num_kv_heads, sinks, d_k, d_v=\(2, False, 12, 6\)"):
    hf.to_hf_state(nnx.eval_shape(lambda: DecoderLM(bad, rngs=nnx.Rngs(0))), bad, "mimo_v2_flash")


def test_quantized_and_unknown_checkpoints_are_refused_by_name():
  """A quantized release (quantization_config) is refused from config.json, before any weight."""
  with pytest.raises(ConfigError, match=r"config.quantization_config=.*dequantize"):
    hf.model_config({"model_type": "mimo_v2_flash", **KW, "quantization_config": {"quant_method": "fp8"}})
  with pytest.raises(ConfigError, match=r"config.quantization_config=.*dequantize"):
    hf.model_config({"model_type": "laguna", "quantization_config": {"quant_method": "fp8"}})
