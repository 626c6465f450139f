"""ZAYA1 (zaya): no family reads it yet, and from_hf and `attn count --hf` say so by name before any weight is read
(its router's state carried across layers, skip expert and rescaled residuals are not attn's blocks). Its attention
is attn's: per_head with the cca mechanism, read by attn.nn.hf.zaya, equal to transformers' own ZayaAttention (a
layer built with transformers' classes, random weights, nothing downloaded) in a full pass under right padding and
decoding through transformers' cache, its tensors written back bit for bit. The tests that build a transformers layer
skip where the installed release lacks zaya (5.25 has it; CI's floor, 4.51.1, does not).
"""

import json

import numpy as np
import pytest

import jax.numpy as jnp

from attn import ConfigError, api, cli
from attn.nn import hf
from attn.nn.hf import zaya
from attn.nn.hf.base import Weights
from attn.variants import cache

KW = dict(vocab_size=53, hidden_size=24, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
          head_dim=8, cca_time0=2, cca_time1=3, layer_types=["hybrid", "hybrid_sliding"], sliding_window=3,
          max_position_embeddings=64, num_experts=2, moe_intermediate_size=8, router_hidden_size=8,
          pad_token_id=None, bos_token_id=None, eos_token_id=None)


def test_refused_by_name_before_any_weight_and_its_heads_read(tmp_path):
  """The fast sibling of the tests against transformers: config.json alone."""
  with pytest.raises(ConfigError, match=r"model_type='zaya'.*ZAYA1.*router.*skip expert.*cca"):
    hf.model_config({"model_type": "zaya", **KW})
  with pytest.raises(ConfigError, match=r"model_type='zaya'"):
    hf.from_hf(({"model_type": "zaya", **KW}, {}))  # no tensors: the refusal comes first
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "zaya", **KW}))
  assert cli.main(["count", "--hf", str(tmp_path)]) == 2
  full, sliding = zaya.head_config(KW), zaya.head_config(KW, "hybrid_sliding")
  assert (full.num_heads, full.num_kv_heads, full.d_k, full.d_v, full.use_bias) == (4, 2, 8, 8, False)
  assert (full.cca, full.cca_depthwise_width, full.cca_grouped_width) == (True, 2, 3)
  assert (full.rope_dim, full.rope_theta, full.window) == (4, 5e6, None)  # partial_rotary_factor 0.5 by default
  assert (sliding.rope_theta, sliding.window) == (1e4, 3)


@pytest.mark.parametrize("changes, name", [({"cca_time0": 0}, "config.cca_time0"),
                                           ({"cca_time1": -2}, "config.cca_time1"),
                                           ({"num_key_value_heads": 3}, "config.num_key_value_heads"),
                                           ({"sliding_window": None}, "config.sliding_window")])
def test_bad_heads_refused_by_name(changes, name):
  with pytest.raises(ConfigError, match=rf"{name}=.* is not allowed"):
    zaya.head_config(KW | changes, "hybrid_sliding")


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
  causal = make(config=config, inputs_embeds=x, attention_mask=mask2d, cache=None, position_ids=pos)
  with torch.no_grad():
    want, _ = att(x, attention_mask={"causal": causal, "conv": mask2d}, cache=None,
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
      want, _ = att(x[:, index:index + n], attention_mask={"causal": mask, "conv": None}, cache=tcache,
                    position_embeddings=rotary(x, pos, "hybrid"))
    got, acache = cache.decode_step(v, p, jnp.asarray(x[:, index:index + n].numpy()), acache, index, cfg=head)
    np.testing.assert_allclose(np.asarray(got), want.numpy(), atol=1e-5 * np.abs(want.numpy()).max(),
                               err_msg=f"tokens {index}..{index + n - 1}")
    index += n
