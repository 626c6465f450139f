"""DeepSeek-V3 in and out (attn.nn.hf.deepseek_v3): latent attention into mla, DeepSeek's experts.

Tiny random DeepseekV3ForCausalLM models built with transformers' own classes (nothing is
downloaded): 4 heads with d_k = 6 + 4 (nope + rope) ≠ d_v = 7, a latent of 5, 2 layers with
the first dense (first_k_dense_replace=1), 8 experts in 4 groups (2 kept, top 3), one shared
expert, YaRN with mscale ≠ mscale_all_dim (so both the rotated dims' factor and the softmax
scale differ from 1), the correction bias nonzero. Built twice: with a query latent
(q_lora_rank=6) in DeepSeek's interleaved RoPE layout, and with a plain q_proj
(q_lora_rank=None) in the half layout. transformers added deepseek_v3 in 4.51, the hf
extra's floor; the plain q_proj arrived later (4.51.1 builds q_a_proj whatever q_lora_rank
is), so that model skips before transformers 5.

The default tier reads configs (no transformers model, no compile): widths, refusals, counts.
Everything that builds a model is in the slow tier (each test several seconds on 2 cores).
"""

import json
import os

import numpy as np
import pytest

from attn.config import ConfigError
from attn.nn import hf

os.environ["HF_HUB_OFFLINE"] = "1"
TOL = 1e-4
# A DeepSeek-V3 config.json as the release writes it (rope_scaling with "type"), tiny.
CONFIG = {"model_type": "deepseek_v3", "vocab_size": 53, "hidden_size": 32, "intermediate_size": 40,
          "moe_intermediate_size": 12, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
          "n_routed_experts": 8, "num_experts_per_tok": 3, "n_group": 4, "topk_group": 2, "n_shared_experts": 1,
          "routed_scaling_factor": 2.5, "first_k_dense_replace": 1, "norm_topk_prob": True, "q_lora_rank": 6,
          "kv_lora_rank": 5, "qk_rope_head_dim": 4, "qk_nope_head_dim": 6, "v_head_dim": 7,
          "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "rope_theta": 500.0,
          "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 0.8,
                           "mscale_all_dim": 0.6, "beta_fast": 32, "beta_slow": 1},
          "scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1, "hidden_act": "silu"}
MSCALE = (0.1 * 0.6 * np.log(4.0) + 1) ** 2  # yarn_get_mscale(4, 0.6)², on the softmax scale


def test_config_reads_the_latent_widths_and_the_router():
  cfg = hf.model_config(CONFIG)
  assert (cfg.variant, cfg.head.d_k, cfg.head.d_v, cfg.num_kv_heads, cfg.rope_dim, cfg.latent_dim, cfg.q_latent_dim,
          cfg.rope_layout, cfg.latent_norm_eps) == ("mla", 10, 7, 4, 4, 5, 6, "interleaved", 1e-6)
  assert cfg.head.score_scale == pytest.approx(MSCALE / np.sqrt(10), rel=1e-12)
  ratio = (0.1 * 0.8 * np.log(4.0) + 1) / (0.1 * 0.6 * np.log(4.0) + 1)
  assert cfg.rope_attention_factor == pytest.approx(ratio, rel=1e-12) and cfg.rope_original_max_len == 16
  assert (cfg.mlp, cfg.moe_router, cfg.moe_experts, cfg.moe_top_k, cfg.moe_d_ff, cfg.moe_groups, cfg.moe_topk_groups,
          cfg.moe_routed_scaling, cfg.moe_shared_experts, cfg.moe_dense_first) == (
      "moe", "sigmoid", 8, 3, 12, 4, 2, 2.5, 1, 1)
  assert [cfg.is_moe_layer(i) for i in range(2)] == [False, True]
  plain = hf.model_config(CONFIG | {"q_lora_rank": None, "rope_interleave": False})
  assert plain.q_latent_dim is None and plain.rope_layout == "half"
  assert hf.model_config(CONFIG | {"first_k_dense_replace": 2}).mlp == "gated"  # every layer dense
  out = hf.FAMILIES["deepseek_v3"].config_out(cfg)  # back out: the same config read again
  assert hf.model_config({"model_type": "deepseek_v3", **out}) == cfg
  assert out["rope_parameters"]["mscale_all_dim"] == 0.6 and out["q_lora_rank"] == 6


@pytest.mark.parametrize("changes,match", [
    ({"scoring_func": "softmax"}, r"config.scoring_func='softmax'.*'sigmoid'"),
    ({"topk_method": "greedy"}, r"config.topk_method='greedy'.*'noaux_tc'"),
    ({"attention_bias": True}, r"config.attention_bias=True.*no bias"),
    ({"moe_layer_freq": 2}, r"config.moe_layer_freq=2"),
    ({"num_key_value_heads": 2}, r"config.num_key_value_heads=2.*num_attention_heads=4"),
    ({"kv_lora_rank": 0}, r"config.kv_lora_rank=0.*an integer >= 1"),
    ({"first_k_dense_replace": -1}, r"config.first_k_dense_replace=-1.*an integer >= 0"),
    ({"num_experts_per_tok": 9}, r"moe_top_k=9.*at most moe_experts=8"),
    ({"n_group": 3}, r"moe_groups=3.*a divisor of moe_experts=8"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0, "mscale_all_dim": 1.0}},
     r"config.rope_scaling.mscale_all_dim=1.0.*yarn only"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0, "mscale_all_dim": "x"}},
     r"config.rope_scaling.mscale_all_dim='x'.*a number"),
    ({"rope_scaling": {"type": "yarn", "factor": 0.0}}, r"rope_factor=0.0"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, r"rope_type='dynamic'"),
])
def test_refusals_by_name_before_any_weight(tmp_path, changes, match):
  (tmp_path / "config.json").write_text(json.dumps(CONFIG | changes))  # no weights on disk at all
  with pytest.raises(ConfigError, match=match):
    hf.from_hf(str(tmp_path))


def test_fp8_checkpoint_is_refused_on_its_tensor_names(tmp_path):
  """The release's fp8 blocks (weight_scale_inv beside each weight) are refused by name, not misread."""
  save_file = pytest.importorskip("safetensors.numpy").save_file
  (tmp_path / "config.json").write_text(json.dumps(CONFIG))
  save_file({"model.layers.0.self_attn.q_a_proj.weight": np.zeros((6, 32), np.float32),
             "model.layers.0.self_attn.q_a_proj.weight_scale_inv": np.ones((1, 1), np.float32)},
            str(tmp_path / "model.safetensors"))
  with pytest.raises(ConfigError, match=r"q_a_proj.weight_scale_inv.*fp8"):
    hf.from_hf(str(tmp_path))


def test_linear_mla_refuses_the_latent_norms_on_conversion():
  """mla with DeepSeek's latent norms has no per_head form (keys nonlinear in x): refused by name."""
  from attn.conversion import convert
  from attn.testing.variants import _random_params
  from attn import api
  cfg = hf.model_config(CONFIG).head
  p = _random_params(api.get_variant("mla"), cfg, 0)
  with pytest.raises(ConfigError, match=r"latent_norm_eps=1e-06.*nonlinear"):
    convert(p, "mla", "per_head", cfg)


def test_count_of_the_stored_deepseek_v3_config(capsys):
  """DeepSeek-V3 counted from its published config.json: the cache is the latent, (512 + 64) per token per
  layer, and the total is the model card's 671B without the MTP module (by hand, below)."""
  from attn import cli
  code = cli.main(["count", "--hf", "deepseek-v3", "--format", "json", "--dtype", "bfloat16"])
  out = capsys.readouterr()
  assert code == 0, out.err
  r = json.loads(out.out)
  assert [t["kv_bytes_per_token_per_layer"] for t in r["layer_types"]] == [(512 + 64) * 2]  # bf16
  assert r["kv_bytes_at"]["131072"] == (512 + 64) * 2 * 61 * 131072
  D, H, L, N = 7168, 128, 61, 129280
  attention = (D * 1536 + 1536 + 1536 * H * 192 + D * (512 + 64) + 512 + 512 * H * (128 + 128) + H * 128 * D)
  dense, expert = 3 * D * 18432, 3 * D * 2048
  moe = 256 * expert + expert + D * 256  # routed, shared, router (the correction bias is a buffer)
  total = L * (attention + 2 * D) + 3 * dense + 58 * moe + 2 * N * D + D
  assert r["total"] == total and round(total / 1e9) == 671
  active = L * (attention + 2 * D) + 3 * dense + 58 * (9 * expert + D * 256) + 2 * N * D + D
  assert r["active_per_token"] == active and round((active - N * D) / 1e9) == 37


# ---- against transformers (slow tier)

def _transformers():
  pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  if not hasattr(transformers, "DeepseekV3Config"):
    pytest.skip(f"deepseek_v3 needs transformers >= 4.51 (this is {transformers.__version__})")
  return transformers


def _v5(transformers):
  return int(transformers.__version__.split(".")[0]) >= 5


MODELS = {}


def build(q_lora=6, seed=0, **changes):
  """The tiny random model (module docstring); one per (q_lora, seed, changes), shared by the module."""
  key = (q_lora, seed, tuple(sorted(changes.items())))
  if key in MODELS:
    return MODELS[key]
  transformers = _transformers()
  if q_lora is None and not _v5(transformers):
    pytest.skip(f"a plain q_proj (q_lora_rank=None) needs transformers 5 (this is {transformers.__version__})")
  import torch
  keys = ("rope_theta", "rope_scaling", "model_type", "scoring_func", "topk_method", "moe_layer_freq")
  kw = {k: v for k, v in CONFIG.items() if k not in keys}
  kw |= {"q_lora_rank": q_lora, "rope_interleave": q_lora is not None}
  yarn = {"rope_type": "yarn", **{k: v for k, v in CONFIG["rope_scaling"].items() if k != "type"}}
  v5 = _v5(transformers)
  kw |= {"rope_parameters": yarn | {"rope_theta": 500.0}} if v5 else {"rope_theta": 500.0, "rope_scaling": yarn}
  c = transformers.DeepseekV3Config(**(kw | changes), pad_token_id=None, bos_token_id=None, eos_token_id=None)
  c._attn_implementation = "eager"
  torch.manual_seed(seed)
  m = transformers.DeepseekV3ForCausalLM(c)
  with torch.no_grad():
    for name, p in m.named_parameters():
      p.copy_(0.3 * torch.randn(p.shape) + (1.0 if name.endswith("norm.weight") else 0.0))
    for module in m.modules():
      if hasattr(module, "e_score_correction_bias"):  # a buffer: nonzero, so that it must be read
        module.e_score_correction_bias.copy_(0.1 * torch.randn(module.e_score_correction_bias.shape))
  MODELS[key] = m.eval()
  return MODELS[key]


@pytest.mark.slow
@pytest.mark.parametrize("q_lora", [6, None])
def test_logits_and_exact_round_trip(q_lora, tmp_path):
  """check_family: logits at every position of right-padded rows, to_hf bit for bit (buffers too), the
  save_pretrained directory read through numpy, the refusals; then the same weights read without the
  softmax mscale, or in the other RoPE layout, are far off, so the comparison can fail."""
  from attn.testing import check_family
  m = build(q_lora)
  measured = check_family("deepseek_v3", m)
  cfg = measured["config"]
  assert (cfg.q_latent_dim, cfg.rope_layout, cfg.rope_mscale_all_dim) == (
      q_lora, "interleaved" if q_lora else "half", 0.6)
  print(f"deepseek_v3 (q_lora_rank={q_lora}): relative {measured['logits_relative']:.2e}")
  assert measured["logits_relative"] < TOL
  m.save_pretrained(tmp_path)
  config = json.loads((tmp_path / "config.json").read_text())
  ids = np.random.default_rng(1).integers(0, 53, (2, 9))
  import torch
  with torch.no_grad():
    ref = m(torch.from_numpy(ids)).logits.numpy()
  for wrong in ({"rope_interleave": q_lora is None}, "no mscale"):
    if wrong == "no mscale":
      wrong = {k: {p: v for p, v in config[k].items() if p != "mscale_all_dim"}
               for k in ("rope_parameters", "rope_scaling") if isinstance(config.get(k), dict)}
    (tmp_path / "config.json").write_text(json.dumps(config | wrong))
    got = np.asarray(hf.from_hf(str(tmp_path)).model(ids.astype(np.int32)))
    assert np.abs(got - ref).max() / np.abs(ref).max() > 100 * TOL, wrong


@pytest.mark.slow
def test_cached_decoding_matches_transformers_cache():
  """Prefill 5 tokens, decode 10 through mla's latent cache (d_c + rope_dim per token): every step's logits
  against transformers' own cache (teacher-forced), tokens against its greedy choices and generate()."""
  from test_hf_decoding import NEW, PROMPT, _attn_steps, _hf_generate, _hf_steps, _tokens
  import jax.numpy as jnp
  m = build(6)
  model, cfg = hf.from_hf(m)
  prompt_BT = _tokens(m.config.vocab_size)
  ours, chosen_BN = _attn_steps(model, prompt_BT, NEW)
  cache = model.blocks[0].attn.cache
  assert {k: v.shape[-1] for k, v in cache.items()} == {"latent": 5, "k_rope": 4}
  theirs = _hf_steps(m, prompt_BT, chosen_BN)
  scale = max(np.abs(r).max() for r in theirs)
  worst = max(np.abs(a - r).max() for a, r in zip(ours, theirs)) / scale
  print(f"deepseek_v3: cached decoding, max relative logit difference {worst:.2e}")
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
def test_eval_analyze_and_count_a_saved_checkpoint(tmp_path, capsys):
  """As a new user would: save_pretrained with a tokenizer, then attn eval --hf, attn analyze --hf (no per-head
  W_QK under the latent norms: the report says why) and attn count --hf (total = transformers' count)."""
  from test_hf_families import _cli, _texts
  tokenizers = pytest.importorskip("tokenizers")
  texts = _texts(tmp_path)
  tok = tokenizers.ByteLevelBPETokenizer()
  tok.train_from_iterator([(texts / n).read_text() for n in ("a.txt", "b.txt")], vocab_size=280, min_frequency=2,
                          show_progress=False)
  m = build(6, vocab_size=tok.get_vocab_size())
  path = tmp_path / "ds3"
  m.save_pretrained(path)
  tok.save(str(path / "tokenizer.json"))
  code, out, err = _cli(capsys, "eval", "--hf", str(path), "--text", str(texts), "--seq-len", "16",
                        "--max-tokens", "64", "--batch-size", "4")
  assert code == 0, err
  assert out.startswith(f"{path}: deepseek_v3") and "| original | mla |" in out
  assert 0 < float(out.split("| original | mla |")[1].split("|")[2]) < float("inf")
  code, _, err = _cli(capsys, "analyze", "--hf", str(path), "--text", str(texts), "--out", str(tmp_path / "a"),
                      "--seq-len", "16", "--batch-size", "2", "--batches", "1", "--no-plots")
  assert code == 0, err
  a = json.loads((tmp_path / "a" / "analysis.json").read_text())
  assert a["num_heads"] == 4 and np.isfinite(a["eval"]["loss"])
  assert "latent_norm_eps" in json.dumps(a["layers"][0])
  code, out, err = _cli(capsys, "count", "--hf", str(path), "--format", "json")
  assert code == 0, err
  assert json.loads(out)["total"] == m.num_parameters() == sum(p.numel() for p in m.parameters())


@pytest.mark.slow
def test_mla_kit_with_deepseeks_options():
  """attn.testing.check_variant at mla's new options: latent norms, the softmax mscale, interleaved RoPE, a
  query latent or not, GQA or not (calls, masks, grads, bf16, decoding in chunks, counts, score weights)."""
  from attn import HeadConfig
  from attn.testing import check_variant
  yarn = dict(rope_scaling="yarn", rope_factor=4.0, rope_original_max_len=16, rope_mscale_all_dim=0.7)
  check_variant("mla", configs=(
      HeadConfig(d_model=20, num_heads=6, d_k=6, d_v=5, num_kv_heads=6, rope_dim=2, rope_theta=50.0, latent_dim=7,
                 q_latent_dim=9, latent_norm_eps=1e-6, rope_layout="interleaved", use_bias=False, **yarn),
      HeadConfig(d_model=18, num_heads=3, d_k=6, d_v=7, num_kv_heads=1, rope_dim=4, latent_dim=5,
                 latent_norm_eps=1e-6)))
