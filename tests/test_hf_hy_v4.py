"""Hunyuan HY-V4 in and out (attn.nn.hf.hy_v4): glm_moe_dsa's mla and indexer with shared layers, sinks, an
output gate, independent hyper-connections and the routed experts' clamp.

Tiny random HYV4ForCausalLM models built with transformers' own classes (nothing is downloaded): 4 heads,
d_k = 6 + 4 ≠ d_v = 7, a latent of 5, a query latent of 6, 3 layers (the first dense, "full", "shared",
"shared"), 8 experts, 2 residual streams, an indexer of 8 heads of 8 choosing 3 keys. transformers added
hy_v4 in 5.x: every test that builds one skips where the installed transformers lacks it; the default tier
reads configs only.
"""

import json
import os

import numpy as np
import pytest

from attn.config import ConfigError
from attn.nn import hf

os.environ["HF_HUB_OFFLINE"] = "1"
TOL = 1e-4
CONFIG = {"vocab_size": 53, "hidden_size": 32, "intermediate_size": 40, "moe_intermediate_size": 12,
          "num_hidden_layers": 3, "num_attention_heads": 4, "n_routed_experts": 8, "num_experts_per_tok": 3,
          "n_shared_experts": 1, "q_lora_rank": 6, "kv_lora_rank": 5, "qk_rope_head_dim": 4, "qk_nope_head_dim": 6,
          "v_head_dim": 7, "max_position_embeddings": 64, "index_n_heads": 8, "index_head_dim": 8, "index_topk": 3,
          "hc_mult": 2, "hc_magnitude": 1.5, "swiglu_limit": 0.5, "indexer_types": ["full", "shared", "shared"],
          "mlp_layer_types": ["dense", "sparse", "sparse"], "rope_parameters": {"rope_type": "default",
                                                                                "rope_theta": 500.0}}


def test_config_reads_what_hy_v4_adds():
  """glm_moe_dsa's reading plus sinks, the elementwise gate, the index heads' last dims and LayerNorm eps,
  independent hyper-connections and the routed experts' clamp; written back out, read the same again."""
  cfg = hf.model_config({"model_type": "hy_v4", **CONFIG})
  assert (cfg.variant, cfg.gate, cfg.sinks, cfg.hc_mult, cfg.hc_form, cfg.hc_magnitude) == (
      "mla", "elementwise", True, 2, "independent", 1.5)
  assert (cfg.moe_swiglu_limit, cfg.moe_swiglu_form, cfg.indexer_types) == (0.5, "clamp_routed",
                                                                              ("full", "shared", "shared"))
  o = dict(cfg.extra["indexer"])
  assert (o["rope_dims"], o["norm_eps"], o["rope_layout"]) == ("last", cfg.norm_eps, "interleaved")
  out = hf.FAMILIES["hy_v4"].config_out(cfg)
  assert out["architectures"] == ["HYV4ForCausalLM"] and "first_k_dense_replace" not in out
  assert hf.model_config({"model_type": "hy_v4", **out}) == cfg
  assert hf.model_config({"model_type": "hy_v4", **CONFIG, "swiglu_limit": 0.0}).moe_swiglu_limit is None


def test_count_by_hand(tmp_path, capsys):
  """attn count --hf: deepseek_v3's layer plus sinks (H) and the gate (D·H·V), the indexer in layer 0 only,
  the hyper-connections 2n·(n·D + 1) + 2 per sublayer and n·(n·D + 1) + 1 for the head."""
  from attn import cli
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "hy_v4", **CONFIG}))
  assert cli.main(["count", "--hf", str(tmp_path), "--format", "json"]) == 0
  r = json.loads(capsys.readouterr().out)
  D, H, Q, C, N, r_, nope, V, J, I, n = 32, 4, 6, 5, 53, 4, 6, 7, 8, 8, 2
  attention = D * Q + Q + Q * H * (nope + r_) + D * (C + r_) + C + C * H * (nope + V) + H * V * D + H + D * H * V
  indexer = Q * J * I + D * I + 2 * I + D * J
  dense, expert = 3 * D * 40, 3 * D * 12
  moe = 8 * expert + expert + D * 8
  hyper = 3 * 2 * (2 * n * (n * D + 1) + 2) + n * (n * D + 1) + 1
  assert r["total"] == 3 * (attention + 2 * D) + indexer + dense + 2 * moe + 2 * N * D + D + hyper


@pytest.mark.parametrize("changes,match", [
    ({"indexer_types": ["shared", "full", "full"]}, r"config.indexer_types\[0\]='shared'"),
    ({"hc_mult": 0}, r"config.hc_mult=0"),
    ({"mlp_layer_types": ["sparse", "dense", "dense"]}, r"config.mlp_layer_types"),
])
def test_refusals_by_name_before_any_weight(tmp_path, changes, match):
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "hy_v4", **CONFIG, **changes}))
  with pytest.raises(ConfigError, match=match):
    hf.from_hf(str(tmp_path))


# ---- against transformers (slow tier)

MODELS = {}


def build(seed=0):
  pytest.importorskip("torch")
  pytest.importorskip("transformers")
  pytest.importorskip("transformers.models.hy_v4.modeling_hy_v4", reason="hy_v4 needs a transformers that has it")
  if seed in MODELS:
    return MODELS[seed]
  import torch
  import transformers
  c = transformers.HYV4Config(**CONFIG, pad_token_id=None, bos_token_id=None, eos_token_id=None)
  c._attn_implementation = "eager"
  torch.manual_seed(seed)
  m = transformers.HYV4ForCausalLM(c)
  with torch.no_grad():
    for name, p in m.named_parameters():
      p.copy_(0.3 * torch.randn(p.shape) + (1.0 if name.endswith("norm.weight") else 0.0))
    for module in m.modules():
      if hasattr(module, "e_score_correction_bias"):
        module.e_score_correction_bias.copy_(0.1 * torch.randn(module.e_score_correction_bias.shape))
  MODELS[seed] = m.eval()
  return MODELS[seed]


def skip_the_half_layout_of_5_17_to_5_24():
  """Skips a comparison of outputs against a transformers that rotates HY-V4 otherwise: modeling_hy_v4 of 5.17 to
  5.24 rotates the main heads' and the index heads' RoPE dims with apply_rotary_pos_emb (rotate_half, the half
  layout); 5.25 with apply_rotary_pos_emb_interleave, as GLM-5 (which it extends) and attn's hy_v4 do. A changed
  definition upstream, not attn's reading."""
  import transformers
  if (5, 17) <= tuple(int(p) for p in transformers.__version__.split(".")[:2]) < (5, 25):
    pytest.skip(f"hy_v4 against transformers {transformers.__version__}: 5.17 to 5.24 rotate its heads in the "
                "half layout, 5.25 interleaved (GLM-5's, attn's)")


@pytest.mark.slow
def test_logits_round_trip_and_count_against_transformers(tmp_path, capsys):
  """check_family: logits under right padding, to_hf bit for bit, the save_pretrained directory; attn count --hf
  of that directory equal to transformers' total; the shared layers hold no indexer."""
  from attn import cli
  from attn.testing import check_family
  m = build()
  skip_the_half_layout_of_5_17_to_5_24()
  assert [layer.self_attn.indexer is None for layer in m.model.layers] == [False, True, True]
  measured = check_family("hy_v4", m)
  assert measured["logits_relative"] < TOL
  m.save_pretrained(tmp_path)
  capsys.readouterr()
  assert cli.main(["count", "--hf", str(tmp_path), "--format", "json"]) == 0
  assert json.loads(capsys.readouterr().out)["total"] == m.num_parameters()
  with capsys.disabled():
    print(f"hy_v4: relative {measured['logits_relative']:.2e}")
  # the comparison sees what HY-V4 adds: each read otherwise (index RoPE on the first dims, DeepSeek-V4's post
  # scale 2, the shared experts clamped too, every layer its own choice from layer 0's indexer) is far off
  from flax import nnx
  import torch
  model, cfg = hf.from_hf(m)
  pure, ix = nnx.to_pure_dict(nnx.state(model)), dict(cfg.extra["indexer"])
  ids = np.random.default_rng(1).integers(0, 53, (2, 9)).astype(np.int32)
  with torch.no_grad():
    ref = m(torch.from_numpy(ids.astype(np.int64))).logits.numpy()
  np.testing.assert_allclose(np.asarray(model(ids)), ref, atol=TOL * np.abs(ref).max())
  for wrong in ({"extra": {"indexer": ix | {"rope_dims": "first"}}}, {"hc_magnitude": 2.0},
                {"moe_swiglu_form": "clamp"}):
    got = np.asarray(hf.build("decoder_lm", cfg.replace(**wrong), pure)(ids))
    assert np.abs(got - ref).max() / np.abs(ref).max() > 100 * TOL, wrong


@pytest.mark.slow
def test_cached_decoding_matches_transformers():
  """Prefill 5, decode 10 (index_topk 3): logits against transformers' cache, tokens against generate()."""
  from test_hf_deepseek_v32 import _decoding_matches
  m = build()
  skip_the_half_layout_of_5_17_to_5_24()
  _decoding_matches(m, "hy_v4", [{"latent": 5, "k_rope": 4, "index_key": 8}] + [{"latent": 5, "k_rope": 4}] * 2)


@pytest.mark.slow
def test_the_mtp_layers_are_read_and_ignored_with_a_note():
  """model.mtp_layers.* (the release's multi-token prediction): ignored by transformers, by attn with one warning
  line; the model read is the one without them."""
  from flax import nnx
  import jax
  config, sd = hf.to_hf_state(hf.from_hf(build()))
  extra = {"model.mtp_layers.0.eh_proj.weight": np.ones((32, 64), np.float32)}
  with pytest.warns(UserWarning, match=r"^1 tensors of mtp_layers\.\* .*read and ignored"):
    got = hf.from_hf((config, {**sd, **extra}))
  a, b = ([np.asarray(x) for x in jax.tree.leaves(nnx.state(x.model))] for x in (got, hf.from_hf((config, sd))))
  assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))
