"""Laguna (laguna, attn.nn.hf.laguna): tiny random models built with transformers' own classes (nothing
downloaded), against transformers itself: logits under right padding, the directory its save_pretrained
writes (experts one tensor each, shared_expert, experts.e_score_correction_bias: the release's names),
cached greedy decoding against generate, to_hf bit for bit, `attn count --hf` against transformers'
parameter count; refusals by name.

The model: d_model 24, heads of 8 over 2 kv heads, 4, 2 and 6 query heads in its three layers
(num_attention_heads_per_layer), the softplus gate per element (and per head), QK-norm, a full layer
rotating half of each head at base 500000 and sliding ones (window 3) the whole head at 10000, a dense
first layer and 4 experts (top 2, routed scaling 1.5) with a shared expert after. Tests that build a
transformers model skip where the installed release lacks laguna (5.25 has it; CI's floor, 4.51.1, does not).
"""

import inspect
import json

import numpy as np
import pytest

from attn import ConfigError, cli
from attn.nn import hf

TOL = 1e-4  # relative to the largest logit, float32
KW = dict(vocab_size=53, hidden_size=24, intermediate_size=40, moe_intermediate_size=8,
          shared_expert_intermediate_size=10, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
          head_dim=8, num_experts=4, num_experts_per_tok=2, sliding_window=3, max_position_embeddings=32,
          layer_types=["full_attention", "sliding_attention", "sliding_attention"],
          num_attention_heads_per_layer=[4, 2, 6], gating="per-element", moe_routed_scaling_factor=1.5,
          pad_token_id=None, bos_token_id=None, eos_token_id=None)


def _transformers():
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  pytest.importorskip("transformers.models.laguna", reason=f"laguna is not in transformers {transformers.__version__}")
  return torch, transformers


def _model(seed=0, **changes):
  """A random LagunaForCausalLM, every weight (norms, gates, the correction bias) moved. A release whose
  LagunaConfig has no gating field (5.7 to 5.12: LagunaAttention's g_proj is per head, and the key is kept
  unread in config.json) gets the per-head gate; a test that asks for another gate skips there."""
  torch, transformers = _transformers()
  if "gating" not in inspect.signature(transformers.LagunaConfig.__init__).parameters:
    if changes.get("gating", True) is not True:
      pytest.skip(f"gating={changes['gating']!r}: transformers {transformers.__version__}'s Laguna gates per head "
                  "only (no config.gating before 5.13)")
    changes = changes | {"gating": True}
  torch.manual_seed(seed)
  m = transformers.LagunaForCausalLM(transformers.LagunaConfig(**(KW | changes))).eval()
  with torch.no_grad():
    for p in m.parameters():
      p.add_(0.1 * torch.randn_like(p))
  return m


def test_config_read_as_written_here():
  """The fast sibling of the tests against transformers: config.json alone, each layer's head."""
  cfg = hf.model_config({"model_type": "laguna", **KW})
  heads = [cfg.layer_head(i) for i in range(3)]
  assert [(h.num_heads, h.num_kv_heads, h.d_k, h.window) for h in heads] == [(4, 2, 8, None), (2, 2, 8, 3), (6, 2, 8, 3)]
  assert [(h.rope_dim, h.rope_theta) for h in heads] == [(4, 500000.0), (8, 10000.0), (8, 10000.0)]
  assert (cfg.gate, cfg.gate_activation, cfg.qk_norm) == ("elementwise", "softplus", True)
  assert cfg.moe_dense_first == 1 and cfg.moe_shared_d_ff == 10 and cfg.moe_routed_scaling == 1.5
  for gating, gate in ((True, "headwise"), ("per-head", "headwise"), (False, "elementwise")):
    assert hf.model_config({"model_type": "laguna", **KW, "gating": gating}).gate == gate  # as transformers reads it
  same = hf.model_config({"model_type": "laguna", **KW, "num_attention_heads_per_layer": [4, 4, 4]})
  assert same.layer_num_heads is None


@pytest.mark.slow  # torch, transformers and compiles: ~20 s each; test_config_read_as_written_here is the sibling
@pytest.mark.parametrize("gating", ["per-element", True])
def test_family_contract_and_the_save_pretrained_directory(tmp_path, gating):
  """check_family (round trip, refusals, save_pretrained's directory read back bit for bit, logits under
  right padding); from_hf of the directory, under the release's names, gives the same tensors back."""
  torch, _ = _transformers()
  from attn.testing import check_family
  m = _model(seed=2, gating=gating)
  assert check_family("laguna", m)["logits_relative"] <= TOL
  m.save_pretrained(tmp_path / "laguna")
  names = set(hf.read_weights(tmp_path / "laguna"))
  assert {"model.layers.1.mlp.experts.e_score_correction_bias", "model.layers.1.mlp.shared_expert.up_proj.weight",
          "model.layers.2.mlp.experts.3.down_proj.weight"} <= names
  back, want = hf.to_hf(hf.from_hf(tmp_path / "laguna")).state_dict(), m.state_dict()
  assert set(want) == set(back) and all(torch.equal(want[k], back[k]) for k in want)


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
  m.save_pretrained(tmp_path / "laguna")
  code = cli.main(["count", "--hf", str(tmp_path / "laguna"), "--format", "json"])
  out = capsys.readouterr()
  assert code == 0, out.err
  assert json.loads(out.out)["total"] == sum(p.numel() for p in m.parameters())


def test_count_hf_by_hand_from_config_json_alone(tmp_path, capsys):
  """`attn count --hf` on KW's config.json (no transformers) against the closed form written here: each
  layer's q, o and gate by its own heads."""
  (tmp_path / "l").mkdir()
  (tmp_path / "l" / "config.json").write_text(json.dumps({"model_type": "laguna", **KW}))
  code = cli.main(["count", "--hf", str(tmp_path / "l"), "--format", "json"])
  out = capsys.readouterr()
  assert code == 0, out.err
  D, G, K, N, F, E, Fe, Fs = 24, 2, 8, 53, 40, 4, 8, 10
  attention = sum(2 * D * H * K + 2 * D * G * K + 2 * K + D * H * K for H in (4, 2, 6))  # q, o, k, v, norms, gate
  experts = 2 * (E * D + E + E * 3 * D * Fe + 3 * D * Fs)  # router, correction bias, experts, shared expert
  total = attention + 3 * D * F + experts + 3 * 2 * D + D + 2 * N * D
  assert json.loads(out.out)["total"] == total


@pytest.mark.parametrize("changes, match", [
    (dict(num_attention_heads_per_layer=[4, 2]), r"config.num_attention_heads_per_layer=\[4, 2\] is not allowed"),
    (dict(num_attention_heads_per_layer=[4, 3, 6]), r"layer_num_heads\[1\]=3 is not allowed: a multiple of"),
    (dict(gating="sigmoid"), r"config.gating='sigmoid'"),
    (dict(attention_bias=True), r"config.attention_bias=True is not allowed"),
    (dict(moe_router_logit_softcapping=30.0), r"config.moe_router_logit_softcapping=30.0"),
    (dict(head_dim=6), r"config.rope_parameters.full_attention.partial_rotary_factor=0.5 is not allowed"),
    (dict(mlp_layer_types=["sparse", "dense", "dense"]), r"config.mlp_layer_types="),
])
def test_what_attn_cannot_read_is_refused_by_name_before_any_weight(changes, match):
  with pytest.raises(ConfigError, match=match):
    hf.model_config({"model_type": "laguna", **KW} | changes)
