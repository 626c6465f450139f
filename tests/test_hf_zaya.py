"""ZAYA1 (zaya, attn.nn.hf.zaya) read in full: CCA attention (per_head with the cca mechanism), the router network
with its state carried across layers and the skip expert, the rescaled residuals (attn.nn.moe, attn.nn.models).

Fast, config.json and numpy alone: the config read as written here, `attn count --hf` against a closed form
written here, the kit (attn.testing.check_family) on a bare config with torch and transformers hidden (round trip
bit for bit, refusals), an unknown or missing tensor refused naming it and the family, the attention tensors moved
both ways. Slow, against transformers' own ZayaForCausalLM (a tiny random model built with its classes, every
weight and buffer moved off its init, nothing downloaded): the kit on the live model (logits under right padding
at the real tokens, its save_pretrained directory read back bit for bit), to_hf(from_hf(dir)).save_pretrained
bit for bit, cached greedy decoding against generate, `attn count --hf` against transformers' parameter total,
and one attention layer against transformers' ZayaAttention (a full pass under right padding, decoding through
its cache). The tests that build a transformers model skip where the installed release lacks zaya (5.25 has it;
CI's floor, 4.51.1, does not).
"""

import inspect
import json
import sys

import numpy as np
import pytest

import jax.numpy as jnp

from attn import ConfigError, api, cli
from attn.nn import hf
from attn.nn.hf import zaya
from attn.nn.hf.base import Weights
from attn.testing import check_family

import hf_hybrid  # tests/hf_hybrid.py
from attn.variants import cache

TOL = 1e-4  # relative to the largest logit, float32
KW = dict(vocab_size=53, hidden_size=24, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
          head_dim=8, cca_time0=2, cca_time1=3, layer_types=["hybrid", "hybrid_sliding"], sliding_window=3,
          max_position_embeddings=64, num_experts=2, moe_intermediate_size=8, router_hidden_size=8,
          pad_token_id=None, bos_token_id=None, eos_token_id=None)
# Every path of the reader at once: three layers, attention biases, an untied head, the sliding layers rotating
# whole heads (layer_heads' rope_dim) at their own base, three experts.
WIDE = KW | dict(num_hidden_layers=3, layer_types=["hybrid", "hybrid_sliding", "hybrid"], attention_bias=True,
                 tie_word_embeddings=False, num_experts=3,
                 rope_parameters={"hybrid": {"rope_type": "default", "rope_theta": 1000.0,
                                             "partial_rotary_factor": 0.5},
                                  "hybrid_sliding": {"rope_type": "default", "rope_theta": 50.0,
                                                     "partial_rotary_factor": 1.0}})


def _config(**changes):
  return {"model_type": "zaya", **(KW | changes)}


def test_config_read_as_written_here():
  """The fast sibling of the tests against transformers: config.json alone."""
  cfg = hf.model_config(_config())
  assert (cfg.variant, cfg.num_heads, cfg.num_kv_heads, cfg.head.d_k, cfg.use_bias, cfg.tie_embeddings) == (
      "per_head", 4, 2, 8, False, True)
  assert (cfg.cca, cfg.cca_depthwise_width, cfg.cca_grouped_width) == (True, 2, 3)
  assert cfg.layer_types == ("full_attention", "sliding_attention") and cfg.layer_heads is None
  assert [(h.rope_dim, h.rope_theta, h.window) for h in map(cfg.layer_head, range(2))] == [(4, 5e6, None),
                                                                                           (4, 1e4, 3)]
  assert (cfg.moe_experts, cfg.moe_top_k, cfg.moe_d_ff, cfg.moe_router_mlp, cfg.moe_norm_topk) == (2, 1, 8, 8, False)
  assert cfg.moe_router_carry and cfg.moe_skip_expert and cfg.residual_scale
  assert [cfg.router_carried(i) for i in range(2)] == [False, True]
  wide = hf.model_config({"model_type": "zaya", **WIDE})
  assert [(h.rope_dim, h.rope_theta) for h in map(wide.layer_head, range(3))] == [(4, 1e3), (8, 50.0), (4, 1e3)]
  assert wide.layer_heads == {"sliding_attention": {"rope_dim": 8}} and not wide.tie_embeddings and wide.use_bias
  full, sliding = zaya.head_config(KW), zaya.head_config(KW, "hybrid_sliding")
  assert (full.rope_dim, full.rope_theta, full.window) == (4, 5e6, None)  # partial_rotary_factor 0.5 by default
  assert (sliding.rope_theta, sliding.window) == (1e4, 3)


@pytest.mark.parametrize("changes, name", [({"cca_time0": 0}, "config.cca_time0"),
                                           ({"cca_time1": -2}, "config.cca_time1"),
                                           ({"num_key_value_heads": 3}, "config.num_key_value_heads"),
                                           ({"sliding_window": None}, "config.sliding_window")])
def test_bad_heads_refused_by_name(changes, name):
  with pytest.raises(ConfigError, match=rf"{name}=.* is not allowed"):
    zaya.head_config(KW | changes, "hybrid_sliding")


@pytest.mark.parametrize("changes, match", [
    (dict(lm_head_bias=True), r"config.lm_head_bias=True is not allowed"),
    (dict(output_router_logits=True), r"config.output_router_logits=True is not allowed"),
    (dict(layer_types=["hybrid", "full_attention"]), r"config.layer_types=.* is not allowed"),
    (dict(layer_types=["hybrid"]), r"config.layer_types=.* is not allowed: 2 of"),
    (dict(router_hidden_size=0), r"moe_router_mlp=0 is not allowed"),
    (dict(rope_parameters={"hybrid": {"rope_type": "yarn"}}), r"config.rope_parameters.hybrid.rope_type='yarn'"),
])
def test_what_attn_cannot_read_is_refused_by_name_before_any_weight(changes, match):
  with pytest.raises(ConfigError, match=match):
    hf.from_hf((_config(**changes), {}))  # no tensors: the refusal comes first


def test_count_hf_by_hand_from_config_json_alone(tmp_path, capsys):
  """`attn count --hf` on config.json (no transformers) against the closed form written here."""
  (tmp_path / "config.json").write_text(json.dumps(_config()))
  code = cli.main(["count", "--hf", str(tmp_path), "--format", "json"])
  out = capsys.readouterr()
  assert code == 0, out.err
  D, H, G, K, N, E, F, R, W0, W1 = 24, 4, 2, 8, 53, 2, 8, 8, 2, 3
  C = (H + G) * K  # CCA's channels: the query heads, then the key heads
  attention = D * H * K + 2 * D * G * K + H * K * D + C * W0 + C + C * K * W1 + C + G  # q, k, v, o; convs; temp
  router = D * R + R + R + 2 * (R * R + R) + R * (E + 1)  # down, its norm, two layers, out to E + 1 classes
  block = attention + E * 3 * D * F + router + 2 * D + 2 * 4 * D  # experts, two norms, two residual scalings
  total = 2 * block + R + N * D + 2 * D + D  # one carried router scale, the (tied) table, its scaling, final norm
  report = json.loads(out.out)
  assert report["total"] == total
  assert report["active_per_token"] == total - 2 * (E - 1) * 3 * D * F  # one expert a token


@pytest.fixture(scope="module")
def kit():
  """check_family on the wide bare config, torch and transformers hidden: numpy and attn only."""
  with pytest.MonkeyPatch.context() as mp:
    mp.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    mp.setitem(sys.modules, "transformers", None)
    return check_family("zaya", {"model_type": "zaya", **WIDE}, seed=1)


def test_the_kit_on_a_bare_config_and_names_refused(kit):
  """Round trip bit for bit and the refusals (the kit); a tensor attn does not know, and one missing, refused
  naming it and the family, before any weight is read."""
  assert kit["logits_relative"] is None and kit["config"].layer_heads == {"sliding_attention": {"rope_dim": 8}}
  config, sd = hf.to_hf_state(kit["loaded"])
  assert {"model.layers.2.mlp.gate.router_states_scale", "model.input_hidden_states_scale",
          "model.layers.0.mlp.gate.balancing_biases", "lm_head.weight"} <= set(sd)
  assert "model.layers.0.mlp.gate.router_states_scale" not in sd  # the first layer carries nothing in
  for extra in ("model.layers.0.mlp.gate.router_mlp.fc3.weight", "model.layers.1.self_attn.qkv_proj.v_proj.weight"):
    with pytest.raises(ConfigError, match=rf"{extra.removeprefix('model.')}.*'zaya'"):
      hf.from_hf((config, {**sd, extra: np.zeros(8, np.float32)}))
  missing = "model.layers.1.mlp.gate.router_states_scale"
  with pytest.raises(ConfigError, match=rf"no tensor '{missing.removeprefix('model.')}'.*family 'zaya'"):
    hf.from_hf((config, {k: a for k, a in sd.items() if k != missing}))


@pytest.mark.parametrize("bias", [False, True])
def test_attention_tensors_round_trip_bit_for_bit_and_an_unknown_one_is_refused_by_name(bias):
  """numpy only: random tensors under ZAYA's names read as per_head with cca and written back unchanged."""
  head = zaya.head_config(KW | {"attention_bias": bias})
  rng = np.random.default_rng(0)
  params = {n: rng.normal(size=s).astype(np.float32) for n, s in api.param_shapes("per_head", head).items()}
  state = zaya.attention_out(params, "self_attn", head)
  assert len(state) == (15 if bias else 10)  # with biases: q, k, both value halves and o
  back = zaya.attention_in(Weights(state), "self_attn", head)
  assert set(back) == set(params) and all(np.array_equal(back[n], params[n]) for n in params)
  with pytest.raises(ConfigError, match=r"checkpoint='self_attn.qkv_proj.v_proj.weight' is not allowed.*'zaya'"):
    zaya.attention_in(Weights(state | {"self_attn.qkv_proj.v_proj.weight": state["self_attn.o_proj.weight"]}),
                      "self_attn", head)


def _transformers():
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  pytest.importorskip("transformers.models.zaya", reason=f"zaya is not in transformers {transformers.__version__}")
  from transformers.models.zaya import modeling_zaya
  return torch, transformers, modeling_zaya


def _layer(layer, seed=0, **changes):
  """transformers' ZayaAttention of layer `layer`, every weight moved (temperatures off transformers' 0), its
  config, rotary embedding and the same tensors as attn's parameters."""
  torch, transformers, modeling_zaya = _transformers()
  config = transformers.ZayaConfig(**(KW | changes))
  config._attn_implementation = "eager"
  torch.manual_seed(seed)
  att = modeling_zaya.ZayaAttention(config, layer).eval()
  with torch.no_grad():
    for name, p in att.named_parameters():
      p.copy_(0.3 * torch.randn_like(p) + (1.0 if name.endswith("temp") else 0.0))
  head = zaya.head_config(KW | changes, config.layer_types[layer])
  state = {f"self_attn.{k}": v.numpy() for k, v in att.state_dict().items()}
  params = zaya.attention_in(Weights(state), "self_attn", head)
  return att, config, modeling_zaya.ZayaRotaryEmbedding(config), head, state, params


def _cache(function, cache) -> dict:
  """The cache under the keyword `function` takes: transformers 5.24 and 5.25 name it cache, 5.18 and 5.22
  past_key_values (ZayaAttention.forward and masking_utils' mask makers, as read). Chosen by the signature, not
  the version: a wrong name would go unread into the layer's **kwargs."""
  return {"cache" if "cache" in inspect.signature(function).parameters else "past_key_values": cache}


@pytest.mark.slow  # torch and transformers: ~5 s each; test_refused_by_name_before_any_weight_and_its_heads_read
@pytest.mark.parametrize("layer, changes", [(0, {}), (1, {"attention_bias": True}),
                                            (0, {"num_key_value_heads": 1, "cca_time0": 3, "cca_time1": 1}),
                                            (1, {"cca_time0": 1, "cca_time1": 1, "num_key_value_heads": 4})],
                         ids=["full", "sliding_bias", "mqa_3x1", "mha_1x1"])
def test_attention_equals_transformers_under_right_padding_and_writes_back_bit_for_bit(layer, changes):
  torch, _, _ = _transformers()
  from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
  att, config, rotary, head, state, params = _layer(layer, **changes)
  B, T = 2, 7
  x = torch.randn(B, T, KW["hidden_size"], generator=torch.Generator().manual_seed(1))
  lengths = torch.tensor([7, 4])
  mask2d = (torch.arange(T)[None] < lengths[:, None]).long()
  pos = torch.arange(T)[None]
  make = create_sliding_window_causal_mask if head.window else create_causal_mask
  causal = make(config=config, inputs_embeds=x, attention_mask=mask2d, position_ids=pos, **_cache(make, None))
  with torch.no_grad():
    want, _ = att(x, attention_mask={"causal": causal, "conv": mask2d}, **_cache(att.forward, None),
                  position_embeddings=rotary(x, pos, config.layer_types[layer]))
  got = api.apply("per_head", {k: jnp.asarray(v) for k, v in params.items()}, jnp.asarray(x.numpy()), cfg=head,
                  is_causal=True, kv_lengths=jnp.asarray(lengths.numpy()))
  want = want.numpy()
  for b, n in enumerate(lengths.tolist()):
    np.testing.assert_allclose(np.asarray(got)[b, :n], want[b, :n], atol=1e-5 * np.abs(want).max())
  back = zaya.attention_out(params, "self_attn", head)
  assert set(back) == set(state)
  for name, a in state.items():
    assert np.asarray(back[name]).dtype == np.float32 and np.array_equal(np.asarray(back[name]), a), name


@pytest.mark.slow
def test_decoding_equals_transformers_through_its_cache():
  """A prompt of 4, then 3 tokens one at a time: transformers' layer through its DynamicCache (conv and recurrent
  state) against attn's cache.decode_step (the KV cache and cca's state)."""
  torch, transformers, _ = _transformers()
  att, config, rotary, head, _, params = _layer(0, seed=3)
  x = torch.randn(2, 7, KW["hidden_size"], generator=torch.Generator().manual_seed(4))
  tcache = transformers.DynamicCache(config=config)
  v = api.get_variant("per_head")
  p = {k: jnp.asarray(a) for k, a in params.items()}
  acache = cache.init(v, p, head, 2, 7)
  index = 0
  for n in (4, 1, 1, 1):
    pos = torch.arange(index, index + n)[None]
    with torch.no_grad():
      mask = None if n == 1 else torch.triu(torch.full((n, n), float("-inf")), 1)[None, None]
      want, _ = att(x[:, index:index + n], attention_mask={"causal": mask, "conv": None}, **_cache(att.forward, tcache),
                    position_embeddings=rotary(x, pos, "hybrid"))
    got, acache = cache.decode_step(v, p, jnp.asarray(x[:, index:index + n].numpy()), acache, index, cfg=head)
    np.testing.assert_allclose(np.asarray(got), want.numpy(), atol=1e-5 * np.abs(want.numpy()).max(),
                               err_msg=f"tokens {index}..{index + n - 1}")
    index += n


def _model(seed=0, **changes):
  """A random ZayaForCausalLM, every weight and buffer (the balancing biases, the residual scales, the router
  state scales) moved off its init."""
  torch, transformers, _ = _transformers()
  torch.manual_seed(seed)
  m = transformers.ZayaForCausalLM(transformers.ZayaConfig(**(KW | changes))).eval()
  with torch.no_grad():
    for name, p in [*m.named_parameters(), *m.named_buffers()]:
      if p.is_floating_point() and "inv_freq" not in name:
        p.add_(0.3 * torch.randn_like(p))
  return m


@pytest.mark.slow  # torch, transformers and compiles; test_the_kit_on_a_bare_config_and_names_refused is the sibling
def test_family_contract_and_the_save_pretrained_directory(tmp_path):
  """check_family on the live model (its state dict back bit for bit, refusals, its save_pretrained directory
  read back, logits under right padding at the real tokens); from_hf of the directory, to_hf of that saved
  again, read once more: the same tensors bit for bit, buffers included."""
  _transformers()
  m = _model(seed=2, **{k: v for k, v in WIDE.items() if k not in KW or WIDE[k] != KW[k]})
  assert check_family("zaya", m)["logits_relative"] <= TOL
  m.save_pretrained(tmp_path / "z")
  loaded = hf.from_hf(tmp_path / "z")
  hf.to_hf(loaded).save_pretrained(tmp_path / "again")
  first, again = hf.read_weights(tmp_path / "z"), hf.read_weights(tmp_path / "again")
  assert set(first) == set(again) and {"model.layers.1.mlp.gate.balancing_biases", "lm_head.weight",
                                       "model.layers.2.post_mlp_residual_scale.residual_bias"} <= set(first)
  assert all(np.array_equal(first[k], again[k]) for k in first)


@pytest.mark.slow
def test_cached_greedy_decoding_equals_generate(tmp_path):
  """From the save_pretrained directory (tied head, defaults): attn's cached greedy decoding against generate,
  and against attn's own full pass."""
  _transformers()
  m = _model(seed=4)
  m.save_pretrained(tmp_path / "z")
  prompt = np.random.default_rng(4).integers(0, 53, (1, 5))
  hf_hybrid.assert_greedy_decoding_equal(m, hf.from_hf(tmp_path / "z"), prompt, 8)


@pytest.mark.slow
def test_count_hf_equals_transformers(tmp_path, capsys):
  m = _model(**{k: v for k, v in WIDE.items() if k not in KW or WIDE[k] != KW[k]})
  m.save_pretrained(tmp_path / "z")
  code = cli.main(["count", "--hf", str(tmp_path / "z"), "--format", "json"])
  out = capsys.readouterr()
  assert code == 0, out.err
  assert json.loads(out.out)["total"] == sum(p.numel() for p in m.parameters())  # buffers are not parameters
