"""DeepSeek-V3.2 and GLM-5 in and out (attn.nn.hf.deepseek_v32): mla with the deepseek-form indexer.

Tiny random DeepseekV32ForCausalLM / GlmMoeDsaForCausalLM models built with transformers' own
classes (nothing is downloaded): deepseek_v3's tiny model (4 heads, d_k = 6 + 4 ≠ d_v = 7, a
latent of 5, a query latent of 6, 2 layers with the first dense, 8 experts in 4 groups, YaRN with
mscale ≠ mscale_all_dim) plus an indexer of 8 heads of 8. index_topk 3 makes the selection bite
at the kit's 9 positions; 16 selects every key. transformers added deepseek_v32 and glm_moe_dsa in
5.x: every test that builds one skips where the installed transformers lacks the model.

The default tier reads configs (no transformers model, no compile): widths, refusals, counts.
Everything that builds a model is in the slow tier.
"""

import inspect
import json
import os

import numpy as np
import pytest

from attn.config import ConfigError
from attn.nn import hf

os.environ["HF_HUB_OFFLINE"] = "1"
TOL = 1e-4
CONFIG = {"vocab_size": 53, "hidden_size": 32, "intermediate_size": 40, "moe_intermediate_size": 12,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 8,
          "num_experts": 8, "num_experts_per_tok": 3, "n_group": 4, "topk_group": 2, "n_shared_experts": 1,
          "routed_scaling_factor": 2.5,
          "first_k_dense_replace": 1, "norm_topk_prob": True, "q_lora_rank": 6, "kv_lora_rank": 5,
          "qk_rope_head_dim": 4, "qk_nope_head_dim": 6, "v_head_dim": 7, "max_position_embeddings": 64,
          "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu", "index_n_heads": 8,
          "index_head_dim": 8, "index_topk": 3,
          "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                              "mscale": 0.8, "mscale_all_dim": 0.6, "beta_fast": 32, "beta_slow": 1,
                              "rope_theta": 500.0}}
# num_experts as n_routed_experts: DeepseekV32Config of transformers 5.11 and 5.12 builds its experts from
# num_experts (num_local_experts, a field of its own, 256 by default) and its router from n_routed_experts; 5.13 on
# read num_local_experts as n_routed_experts (5.25 re-routes a num_experts given to it). The releases' config.json
# has 256 of n_routed_experts and no num_experts.
FAMILIES = {"deepseek_v32": ("DeepseekV32", "half"), "glm_moe_dsa": ("GlmMoeDsa", "interleaved")}


def _config(family, **changes):
  return {"model_type": family, **CONFIG, **changes}


def _release() -> tuple[int, int]:
  import transformers
  return tuple(int(p) for p in transformers.__version__.split(".")[:2])


def skip_glm_before_5_13(family):
  """Skips a comparison of GLM-5's outputs against a transformers that computes them otherwise: its
  GlmMoeDsaIndexer rotates the index heads' RoPE dims in the half layout (rotate_half) in 5.2 to 5.12
  (modeling_glm_moe_dsa of 5.11 and 5.12: "The indexer uses NON-interleaved (half-split) RoPE"), interleaved from
  5.13 on (GLM-5's own layout, and attn's glm_moe_dsa rope_layout). A changed definition upstream, not attn's."""
  if family == "glm_moe_dsa" and _release() < (5, 13):
    import transformers
    pytest.skip(f"glm_moe_dsa against transformers {transformers.__version__}: 5.2 to 5.12 rotate GLM-5's "
                "index heads in the half layout, 5.13 on interleaved (GLM-5's, attn's)")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_config_reads_the_indexer(family):
  """mla's widths as deepseek_v3's, the indexer in its deepseek form with the family's index RoPE layout,
  the main heads interleaved whatever rope_interleave says (transformers does not read it), the dense
  layers from mlp_layer_types; written back out, the same config is read again."""
  cfg = hf.model_config(_config(family, rope_interleave=False))
  assert (cfg.variant, cfg.head.d_k, cfg.head.d_v, cfg.rope_dim, cfg.latent_dim, cfg.q_latent_dim, cfg.rope_layout) == (
      "mla", 10, 7, 4, 5, 6, "interleaved")
  assert dict(cfg.extra["indexer"]) == {"heads": 8, "head_dim": 8, "top_k": 3, "form": "deepseek",
                                        "rope_layout": FAMILIES[family][1]}
  assert [cfg.is_moe_layer(i) for i in range(2)] == [False, True]
  assert hf.model_config(_config(family, mlp_layer_types=["dense", "dense"])).mlp == "gated"
  out = hf.FAMILIES[family].config_out(cfg)
  assert out["architectures"] == [f"{FAMILIES[family][0]}ForCausalLM"] and "rope_interleave" not in out
  assert (out["index_n_heads"], out["index_head_dim"], out["index_topk"], out["mlp_layer_types"]) == (
      8, 8, 3, ["dense", "sparse"])
  assert hf.model_config({"model_type": family, **out}) == cfg
  # transformers 5.11 to 5.17 write every layer's type under its earlier name; 5.18 on read it as indexed_attention
  assert hf.model_config(_config(family, rope_interleave=False, layer_types=["deepseek_sparse_attention"] * 2)) == cfg


@pytest.mark.parametrize("changes,match", [
    ({"model_type": "glm_moe_dsa", "indexer_types": ["shared", "full"]}, r"config.indexer_types\[0\]='shared'"),
    ({"model_type": "glm_moe_dsa", "index_topk_pattern": "SF"}, r"config.indexer_types\[0\]='shared'"),
    ({"model_type": "glm_moe_dsa", "index_topk_freq": 2, "index_skip_topk_offset": 0},
     r"config.indexer_types\[0\]='shared'"),  # transformers' rule: layer 0 shares at offset 0
    ({"model_type": "glm_moe_dsa", "indexer_types": ["full", "Shared"]}, r"config.indexer_types=\['full', 'Shared'\]"),
    ({"model_type": "glm_moe_dsa", "indexer_types": ["full"]}, r"config.indexer_types=\['full'\].*2 entries"),
    ({"mlp_layer_types": ["sparse", "dense"]}, r"config.mlp_layer_types=\['sparse', 'dense'\]"),
    ({"layer_types": ["full_attention"] * 2}, r"config.layer_types=.*'indexed_attention'"),
    ({"q_lora_rank": None}, r"config.q_lora_rank=None.*query latent"),
    ({"index_head_dim": 3}, r"config.index_head_dim=3.*qk_rope_head_dim=4"),
    ({"index_topk": 0}, r"config.index_topk=0.*an integer >= 1"),
    ({"index_n_heads": True}, r"config.index_n_heads=True"),
    ({"scoring_func": "softmax"}, r"config.scoring_func='softmax'"),
])
def test_refusals_by_name_before_any_weight(tmp_path, changes, match):
  (tmp_path / "config.json").write_text(json.dumps(_config("deepseek_v32") | changes))  # no weights at all
  with pytest.raises(ConfigError, match=match):
    hf.from_hf(str(tmp_path))


def test_count_of_a_config_by_hand(tmp_path, capsys):
  """attn count --hf: deepseek_v3's parameters plus the indexer's per layer (wq_b, wk, k_norm's weight and
  bias, weights_proj), and the index key cached beside the latent: (5 + 4 + 8) numbers per token."""
  from attn import cli
  (tmp_path / "config.json").write_text(json.dumps(_config("deepseek_v32")))
  assert cli.main(["count", "--hf", str(tmp_path), "--format", "json", "--dtype", "bfloat16"]) == 0
  r = json.loads(capsys.readouterr().out)
  D, H, Q, C, N, r_, nope, V, J, I = 32, 4, 6, 5, 53, 4, 6, 7, 8, 8
  attention = D * Q + Q + Q * H * (nope + r_) + D * (C + r_) + C + C * H * (nope + V) + H * V * D
  indexer = Q * J * I + D * I + 2 * I + D * J
  dense, expert = 3 * D * 40, 3 * D * 12
  moe = 8 * expert + expert + D * 8
  assert r["total"] == 2 * (attention + indexer + 2 * D) + dense + moe + 2 * N * D + D
  assert [t["kv_bytes_per_token_per_layer"] for t in r["layer_types"]] == [(5 + 4 + 8) * 2]  # bf16


def test_glm_shared_layers_are_read_and_written_back():
  """GLM-5's 'shared' layers (indexer_types, or index_topk_pattern) become ModelConfig.indexer_types; the shared
  layer's head has no indexer weights; config_out writes them back and reads the same config again. Every layer
  'full' is indexer_types None (the model without sharing), and deepseek_v32 cannot hold shared layers."""
  cfg = hf.model_config(_config("glm_moe_dsa", num_hidden_layers=3, index_topk_pattern="FSS"))
  assert cfg.indexer_types == ("full", "shared", "shared")
  assert [dict(cfg.layer_head(i).extra["indexer"]).get("shared", False) for i in range(3)] == [False, True, True]
  out = hf.FAMILIES["glm_moe_dsa"].config_out(cfg)
  assert out["indexer_types"] == ["full", "shared", "shared"]
  assert hf.model_config({"model_type": "glm_moe_dsa", **out}) == cfg
  assert hf.model_config(_config("glm_moe_dsa", indexer_types=["full", "full"])).indexer_types is None
  from attn.nn.hf.base import check_fields
  with pytest.raises(ConfigError, match=r"indexer_types=\('full', 'shared', 'shared'\).*deepseek_v32 has no such"):
    check_fields(cfg, hf.FAMILIES["deepseek_v32"])
  check_fields(cfg, hf.FAMILIES["glm_moe_dsa"])


def test_glm_count_with_a_shared_layer_by_hand(tmp_path, capsys):
  """attn count --hf of a GLM-5 config with layer 1 shared: the indexer's parameters and its cached key in
  layer 0 only (transformers builds no indexer in a shared layer)."""
  from attn import cli
  (tmp_path / "config.json").write_text(json.dumps(_config("glm_moe_dsa", index_topk_pattern="FS")))
  assert cli.main(["count", "--hf", str(tmp_path), "--format", "json", "--dtype", "bfloat16"]) == 0
  r = json.loads(capsys.readouterr().out)
  D, H, Q, C, N, r_, nope, V, J, I = 32, 4, 6, 5, 53, 4, 6, 7, 8, 8
  attention = D * Q + Q + Q * H * (nope + r_) + D * (C + r_) + C + C * H * (nope + V) + H * V * D
  indexer = Q * J * I + D * I + 2 * I + D * J
  dense, expert = 3 * D * 40, 3 * D * 12
  moe = 8 * expert + expert + D * 8
  assert r["total"] == 2 * (attention + 2 * D) + indexer + dense + moe + 2 * N * D + D
  assert r["kv_bytes_at"]["64"] == 64 * ((5 + 4 + 8) + (5 + 4)) * 2  # bf16, at max_position_embeddings


# ---- against transformers (slow tier)

MODELS = {}


def build(family, seed=0, **changes):
  """The tiny random model (module docstring); one per (family, seed, changes), shared by the module."""
  pytest.importorskip("torch")
  pytest.importorskip("transformers")
  pytest.importorskip(f"transformers.models.{family}.modeling_{family}",
                      reason=f"{family} needs a transformers that has it")
  key = (family, seed, tuple(sorted(changes.items())))
  if key in MODELS:
    return MODELS[key]
  import torch
  import transformers
  prefix = FAMILIES[family][0]
  c = getattr(transformers, f"{prefix}Config")(**(CONFIG | changes), pad_token_id=None, bos_token_id=None,
                                               eos_token_id=None)
  c._attn_implementation = "eager"
  torch.manual_seed(seed)
  m = getattr(transformers, f"{prefix}ForCausalLM")(c)
  with torch.no_grad():
    for name, p in m.named_parameters():
      p.copy_(0.3 * torch.randn(p.shape) + (1.0 if name.endswith("norm.weight") else 0.0))
    for module in m.modules():
      if hasattr(module, "e_score_correction_bias"):
        module.e_score_correction_bias.copy_(0.1 * torch.randn(module.e_score_correction_bias.shape))
  MODELS[key] = m.eval()
  return MODELS[key]


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("topk", [3, 16])
def test_logits_and_exact_round_trip(family, topk, tmp_path):
  """check_family: logits at every position of right-padded rows (3 of 9, 5 and 1 positions: at index_topk 3
  the selection bites; at 16 every key is kept), to_hf bit for bit, the save_pretrained directory read through
  numpy, the refusals. At index_topk 3 the same weights read with the other index RoPE layout, or with every key
  selected, are far off: the comparison sees the indexer."""
  from attn.testing import check_family
  m = build(family, index_topk=topk)
  skip_glm_before_5_13(family)
  measured = check_family(family, m)
  print(f"{family} (index_topk={topk}): relative {measured['logits_relative']:.2e}")
  assert measured["logits_relative"] < TOL
  if topk == 16:
    return
  from flax import nnx
  model, cfg = hf.from_hf(m)
  pure, ix = nnx.to_pure_dict(nnx.state(model)), dict(cfg.extra["indexer"])
  ids = np.random.default_rng(1).integers(0, 53, (2, 9)).astype(np.int32)
  import torch
  with torch.no_grad():
    ref = m(torch.from_numpy(ids.astype(np.int64))).logits.numpy()
  np.testing.assert_allclose(np.asarray(model(ids)), ref, atol=TOL * np.abs(ref).max())
  other = {"half": "interleaved", "interleaved": "half"}[ix["rope_layout"]]
  for wrong in ({"rope_layout": other}, {"top_k": 9}):
    got = np.asarray(hf.build("decoder_lm", cfg.replace(extra={"indexer": ix | wrong}), pure)(ids))
    assert np.abs(got - ref).max() / np.abs(ref).max() > 100 * TOL, wrong


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_cached_decoding_matches_transformers_cache(family):
  """Prefill 5 tokens, decode 10 through mla's cache with the index keys beside it (index_topk 3 < 15
  positions): every step's logits against transformers' own cache (teacher-forced), tokens against its greedy
  choices and generate()."""
  m = build(family)
  skip_glm_before_5_13(family)
  _decoding_matches(m, family, [{"latent": 5, "k_rope": 4, "index_key": 8}] * 2)


@pytest.mark.slow
def test_glm_shared_layers_decode_as_transformers():
  """GLM-5 with layers 1 and 2 reusing layer 0's choice (index_topk_pattern 'FSS'): cached decoding against
  transformers' cache and generate(); the shared layers cache no index keys."""
  m = build("glm_moe_dsa", num_hidden_layers=3, index_topk_pattern="FSS")
  skip_glm_before_5_13("glm_moe_dsa")
  _decoding_matches(m, "glm_moe_dsa", [{"latent": 5, "k_rope": 4, "index_key": 8}] + [{"latent": 5, "k_rope": 4}] * 2)


def _decoding_matches(m, family, widths):
  from test_hf_decoding import NEW, PROMPT, _attn_steps, _hf_generate, _hf_steps, _tokens
  import jax.numpy as jnp
  model, cfg = hf.from_hf(m)
  prompt_BT = _tokens(m.config.vocab_size)
  ours, chosen_BN = _attn_steps(model, prompt_BT, NEW)
  assert [{k: v.shape[-1] for k, v in b.attn.cache.items()} for b in model.blocks] == widths
  theirs = _hf_steps(m, prompt_BT, chosen_BN)
  scale = max(np.abs(r).max() for r in theirs)
  worst = max(np.abs(a - r).max() for a, r in zip(ours, theirs)) / scale
  print(f"{family}: cached decoding, max relative logit difference {worst:.2e}")
  assert worst < TOL
  last_BNV = np.stack([r[:, -1] for r in theirs], 1)
  top2 = np.sort(last_BNV, axis=-1)[..., -2:]
  sure_BN = top2[..., 1] - top2[..., 0] >= 2 * TOL * scale
  np.testing.assert_array_equal(last_BNV.argmax(-1)[sure_BN], chosen_BN[sure_BN])
  np.testing.assert_array_equal(np.asarray(model.generate(jnp.asarray(prompt_BT, jnp.int32), NEW))[:, PROMPT:],
                                chosen_BN)
  before_tie_BN = np.cumsum(~sure_BN, axis=1) == 0
  np.testing.assert_array_equal(_hf_generate(m, prompt_BT, NEW)[before_tie_BN], chosen_BN[before_tie_BN])


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_count_of_a_saved_checkpoint_is_transformers(family, tmp_path, capsys):
  from attn import cli
  m = build(family)
  m.save_pretrained(tmp_path)
  assert cli.main(["count", "--hf", str(tmp_path), "--format", "json", "--dtype", "bfloat16"]) == 0
  assert json.loads(capsys.readouterr().out)["total"] == m.num_parameters() == sum(p.numel() for p in m.parameters())


@pytest.mark.slow
def test_glm_shared_layers_against_transformers(tmp_path, capsys):
  """GLM-5 with layers 1 and 2 reusing layer 0's choice: check_family (logits under right padding, to_hf bit
  for bit, the save_pretrained directory), attn count --hf of that directory equal to transformers' total;
  the shared layers hold no indexer in either; a checkpoint that has one there anyway loads with a one-line
  note to the same model (never used)."""
  from attn import cli
  from attn.testing import check_family
  from flax import nnx
  m = build("glm_moe_dsa", num_hidden_layers=3, index_topk_pattern="FSS")
  skip_glm_before_5_13("glm_moe_dsa")
  assert [layer.self_attn.indexer is None for layer in m.model.layers] == [False, True, True]
  measured = check_family("glm_moe_dsa", m)
  print(f"glm_moe_dsa FSS: relative {measured['logits_relative']:.2e}")
  assert measured["logits_relative"] < TOL
  m.save_pretrained(tmp_path)
  capsys.readouterr()
  assert cli.main(["count", "--hf", str(tmp_path), "--format", "json", "--dtype", "bfloat16"]) == 0
  assert json.loads(capsys.readouterr().out)["total"] == m.num_parameters()
  config, sd = hf.to_hf_state(hf.from_hf(m))
  assert not any(k.startswith(("model.layers.1.self_attn.indexer", "model.layers.2.self_attn.indexer")) for k in sd)
  extra = {k.replace("layers.0.", "layers.2."): a for k, a in sd.items() if ".self_attn.indexer." in k}
  with pytest.warns(UserWarning, match=r"^5 indexer tensors of shared layers .*read and ignored"):
    got = hf.from_hf((config, {**sd, **extra}))
  a, b = (jax_leaves(nnx.state(x.model)) for x in (got, hf.from_hf((config, sd))))
  assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.mark.slow
@pytest.mark.parametrize("kw", [{}, {"index_topk_pattern": "FSFFS"},
                                {"index_topk_freq": 2, "index_skip_topk_offset": 0}, {"index_topk_freq": 3},
                                {"indexer_types": ["full", "shared"] * 2 + ["full"]}])
def test_glm_indexer_types_are_transformers(kw):
  """attn's reading of GLM-5's full / shared layers against GlmMoeDsaConfig's own derivation."""
  pytest.importorskip("transformers")
  pytest.importorskip("transformers.models.glm_moe_dsa.configuration_glm_moe_dsa")
  import transformers
  from attn.nn.hf.deepseek_v32 import indexer_types
  if "indexer_types" not in inspect.signature(transformers.GlmMoeDsaConfig.__init__).parameters:
    pytest.skip(f"transformers {transformers.__version__}'s GLM-5 has no shared layers (indexer_types: 5.6 on)")
  if "index_skip_topk_offset" in kw and _release() < (5, 11):
    pytest.skip(f"index_skip_topk_offset against transformers {transformers.__version__}: GlmMoeDsaConfig reads it "
                "from 5.11 on (5.6 to 5.10: full where max(i - 1, 0) % index_topk_freq == 0, the offset fixed at 2)")
  assert indexer_types({"num_hidden_layers": 5, **kw}, 5) == transformers.GlmMoeDsaConfig(
      num_hidden_layers=5, **kw).indexer_types


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_model_made_in_attn_goes_out_and_back(family):
  """check_family on the bare config: an attn model drawn at random (no checkpoint) through to_hf_state, from_hf
  and to_hf, its logits against the transformers model to_hf builds."""
  pytest.importorskip("transformers")
  pytest.importorskip(f"transformers.models.{family}.modeling_{family}")
  skip_glm_before_5_13(family)
  from attn.testing import check_family
  assert check_family(family, _config(family))["logits_relative"] < TOL


@pytest.mark.slow
def test_the_mtp_layer_is_read_and_ignored_with_a_note():
  """The release's multi-token-prediction layer (layer num_hidden_layers): transformers ignores it; attn too,
  saying so in one warning line, and the model read is the one without it."""
  from flax import nnx
  m = build("deepseek_v32")
  config, sd = hf.to_hf_state(hf.from_hf(m))
  extra = {f"model.layers.2.{k.split('.', 3)[3]}": a for k, a in sd.items() if k.startswith("model.layers.1.")}
  with pytest.warns(UserWarning, match=r"^\d+ tensors of layers\.2\.\* \(the multi-token-prediction module\)"):
    got = hf.from_hf((config, {**sd, **extra}))
  want = hf.from_hf((config, sd))
  a, b = (jax_leaves(nnx.state(x.model)) for x in (got, want))
  assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def jax_leaves(state):
  import jax
  return [np.asarray(x) for x in jax.tree.leaves(state)]


@pytest.mark.parametrize("kind,match", [("mistral_large4", r"image-text wrapper"),
                                        ("mistral_large4_text", r"LeRoPE.*kv_source_layers")])
def test_mistral_large4_is_refused_with_what_attn_lacks(tmp_path, kind, match):
  """Mistral Large 4 (DSA with shared layers) is not read yet: refused by name, saying why, before any weight."""
  (tmp_path / "config.json").write_text(json.dumps({"model_type": kind, **CONFIG}))
  with pytest.raises(ConfigError, match=rf"config.model_type='{kind}'.*{match}"):
    hf.from_hf(str(tmp_path))
