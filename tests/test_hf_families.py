"""The decoder families in and out (attn.nn.hf), BERT's MLM head out, refusals.

Llama, Mistral, Qwen2, Qwen3, Gemma 2, and issue 31's Gemma 3 (text), SmolLM3, Phi-3 and gpt-oss
(their tests skip on a transformers older than the family: SINCE). Llama with RoPE scaling ("linear",
"llama3", "yarn") too, read from both transformers
releases' spellings.

Tiny random models built with transformers' own config classes (nothing is
downloaded), GQA (4 query heads, 2 kv heads) and head_dim != D/H where the
family allows it, each through attn.testing.check_family: logits compared at
every position of right-padded rows (windowed families: every position whose
window holds a real key), and to_hf's state_dict equal to the original's bit
for bit.
"""

import json
import os

import numpy as np
import pytest
from flax import nnx

from attn.config import ConfigError
from attn.nn import hf
from attn.testing import check_family

os.environ["HF_HUB_OFFLINE"] = "1"
TOL = 1e-4  # relative to the largest logit, float32
BASE = dict(vocab_size=53, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-5, tie_word_embeddings=False)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(head_dim=12, attention_bias=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=3)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=12)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(head_dim=12, num_hidden_layers=3, sliding_window=3, query_pre_attn_scalar=10,
                    attn_logit_softcapping=2.0, final_logit_softcapping=3.0, tie_word_embeddings=True)),
    # Gemma 3: 2 sliding layers : 1 full (global_every=3 as layer_types), per-head (1 + w) QK-norm,
    # the sliding layers' own base (50) beside the full layers' linearly scaled one (500).
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                    dict(head_dim=12, num_hidden_layers=3, sliding_window=3, query_pre_attn_scalar=10,
                         layer_types=["sliding_attention", "sliding_attention", "full_attention"])),
    # SmolLM3: every 4th layer NoPE (transformers' default no_rope_layer_interval), Llama's biases.
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM",
                dict(num_hidden_layers=4, attention_bias=True, mlp_bias=True, pad_token_id=None,
                     bos_token_id=None, eos_token_id=None)),
    # Phi-3: fused qkv_proj and gate_up_proj, Phi-4-mini's partial rotary 0.75 (6 of 8 dims), a window of 3.
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
             dict(partial_rotary_factor=0.75, sliding_window=3, pad_token_id=None, bos_token_id=None,
                  eos_token_id=None)),
    # gpt-oss: sinks, windows of 3 on alternate layers, 4 experts (top 2) with a SwiGLU clamp of 1 that bites
    # (from transformers 5.19: gpt_oss_reads_its_limit).
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(head_dim=12, sliding_window=3, num_local_experts=4, num_experts_per_tok=2, swiglu_limit=1.0)),
    # OLMo 2: QK-norm over the whole q and k projections (qk_norm "whole"), norms after each sublayer.
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM",
              dict(head_dim=12, attention_bias=True, pad_token_id=None, bos_token_id=None, eos_token_id=None)),
}
# The first transformers release with each family's classes (older ones skip its tests).
SINCE = {"smollm3": "4.53", "gpt_oss": "4.55"}
# The families added with issue 31: only their logits test runs in the default tier.
NEW = {"gemma3_text", "smollm3", "phi3", "gpt_oss", "olmo2"}
MEASURED = {}  # family -> (max abs, max relative) logit difference, printed with -s


def _transformers():
  pytest.importorskip("torch")
  return pytest.importorskip("transformers")


def _v5(transformers):
  return int(transformers.__version__.split(".")[0]) >= 5


def _rope(transformers, scaling=None):
  """RoPE's base (and a scaling) as the release's own checkpoints write it: transformers 4 a
  top-level rope_theta and rope_scaling, 5 rope_parameters. Never both, so each release's
  config.json is read the way it is saved."""
  if _v5(transformers):
    return dict(rope_parameters=(scaling or {"rope_type": "default"}) | {"rope_theta": 500.0})
  return dict(rope_theta=500.0) | ({"rope_scaling": scaling} if scaling else {})


def _family_rope(family, transformers, scaling=None):
  """_rope, or Gemma 3's: a linearly scaled base 500 on full layers, 50 on sliding ones (4: rope_local_base_freq;
  5: rope_parameters by layer type)."""
  if family == "gpt_oss":  # gpt-oss's own YaRN: no truncation, factor = max_position_embeddings / original
    scaling = scaling or {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
                          "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
  if family != "gemma3_text":
    return _rope(transformers, scaling)
  scaling = scaling or {"rope_type": "linear", "factor": 2.0}
  if _v5(transformers):
    return dict(rope_parameters={"full_attention": scaling | {"rope_theta": 500.0},
                                 "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}})
  return dict(rope_theta=500.0, rope_local_base_freq=50.0, rope_scaling=scaling)


def gpt_oss_reads_its_limit(transformers):
  """Whether the release's GptOssExperts clamps at config.swiglu_limit: 5.19 on. transformers 4.55 to 5.18
  fix `self.limit = 7.0` in GptOssExperts.__init__ and have no swiglu_limit in GptOssConfig, so a clamp of
  1 given there is saved in config.json and ignored: their gpt-oss is built at their 7.0 (no swiglu_limit in
  its config, as they save it; every other part compared), and 5.19 on with the clamp of 1 that bites."""
  return _release(transformers) >= (5, 19)


def _release(transformers):
  return tuple(int(p) for p in transformers.__version__.split(".")[:2])


def build(family, seed=0, rope=None, **changes):
  """A random transformers model of the family: every parameter redrawn, norm scales near 1 (1 + w: near 0);
  rope: a RoPE scaling ({"rope_type": ..., "factor": ...}) in the release's own spelling."""
  transformers = _transformers()
  import torch
  conf, model, extra = FAMILIES[family]
  if not hasattr(transformers, conf):
    pytest.skip(f"{family} needs transformers >= {SINCE[family]} (this is {transformers.__version__})")
  if family == "olmo2" and _release(transformers) == (5, 4):  # configuration_olmo2.py: `tie_word_embeddings: int`
    pytest.skip("transformers 5.4's Olmo2Config annotates tie_word_embeddings as int (bool from 5.5), and its strict "
                "validation refuses the bool False every OLMo 2 config holds: it builds and loads none")
  kw = BASE | _family_rope(family, transformers, rope) | extra | changes
  if family == "gpt_oss" and not gpt_oss_reads_its_limit(transformers):
    kw.pop("swiglu_limit", None)  # the release's own 7.0, and no swiglu_limit in its config (read as 7.0)
  if family == "smollm3" and _release(transformers) < (4, 54):  # 4.53's SmolLM3MLP: nn.Linear(..., bias=False),
    kw.pop("mlp_bias", None)  # no config.mlp_bias (a given one is saved and ignored); read from 4.54
  if family == "gemma3_text" and not _v5(transformers):  # transformers 4 ignores layer_types: its own spelling
    kw = {k: v for k, v in kw.items() if k != "layer_types"} | {"sliding_window_pattern": 3}
  cfg = getattr(transformers, conf)(**kw)
  cfg._attn_implementation = "eager"
  torch.manual_seed(seed)
  m = getattr(transformers, model)(cfg)
  with torch.no_grad():
    for name, p in m.named_parameters():
      unit = name.endswith("norm.weight") and not family.startswith("gemma")
      p.copy_(0.3 * torch.randn(p.shape) + (1.0 if unit else 0.0))  # float32: every bit must come back
  return m.eval()


def _batch(vocab, B=3, T=9, seed=1):
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, vocab, (B, T))
  lengths = np.array([T, 5, 1])
  return ids, lengths, (np.arange(T) < lengths[:, None]).astype(np.int64)


def _hf_logits(m, ids, mask):
  import torch
  with torch.no_grad():
    return m(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).logits.numpy()


@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.slow if f in NEW - {"gemma3_text", "olmo2"} else [])
                                    for f in sorted(FAMILIES)])
def test_family_logits_and_exact_round_trip(family):
  """attn.testing.check_family on transformers' own model of the family: logits at every position
  whose window holds a real key, its state dict back bit for bit through to_hf of the loaded model
  (which knows its family), its save_pretrained directory read through numpy, the refusals."""
  measured = check_family(family, build(family))
  cfg = measured["config"]
  rotary = 6 if family == "phi3" else cfg.head.d_k
  assert (cfg.num_heads, cfg.num_kv_heads, cfg.rope_dim, cfg.rope_theta) == (4, 2, rotary, 500.0)
  if family == "gpt_oss":
    assert (cfg.mlp, cfg.moe_experts, cfg.sinks, cfg.global_every, cfg.rope_scaling, cfg.rope_truncate) == (
        "moe", 4, True, 2, "yarn", False)
    assert cfg.moe_swiglu_limit == (1.0 if gpt_oss_reads_its_limit(_transformers()) else 7.0)
  if family == "smollm3":  # layer 4 of 4 drops RoPE
    assert cfg.layer_types == ("full_attention",) * 3 + ("full_attention_nope",)
  if family == "gemma3_text":
    assert (cfg.global_every, cfg.sliding_rope_theta, cfg.rope_scaling, cfg.qk_norm) == (3, 50.0, "linear", True)
  if family == "olmo2":
    assert (cfg.qk_norm, cfg.norm) == ("whole", "after")
  MEASURED[family] = (measured["logits_max_abs"], measured["logits_relative"])
  print(f"{family}: max abs {MEASURED[family][0]:.2e}, relative {MEASURED[family][1]:.2e}")
  assert MEASURED[family][1] < TOL


@pytest.mark.slow
def test_smollm3_sliding_nope_layers():
  """SmolLM3 with use_sliding_window: transformers slides its NoPE layers (layer 4 of 4), read as
  sliding_attention_nope; logits and the bit-for-bit round trip through check_family."""
  measured = check_family("smollm3", build("smollm3", use_sliding_window=True, sliding_window=3))
  cfg = measured["config"]
  assert cfg.layer_types == ("full_attention",) * 3 + ("sliding_attention_nope",) and cfg.window == 3
  assert cfg.layer_head(3).window == 3 and cfg.layer_head(3).rope_dim == 0 and cfg.layer_head(0).window is None
  assert measured["logits_relative"] < TOL


# rope_parameters of the scaled types. head_dim 12 and theta 500 give wavelengths 2π/ω of 6.3, 17.7,
# 49.9, 140, 396 and 1115 positions: llama3 with L = 64 (L/high = 16, L/low = 64) keeps one pair,
# mixes two and divides three.
SCALED = {
    "linear": {"rope_type": "linear", "factor": 2.5},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    # YaRN with L = 32 (128 / factor 4): the band between 1 and 32 turns ramps the middle pairs; the
    # softmax temperature 0.1·ln 4 + 1 by default, and gpt-oss's spelling (no truncation, a given factor).
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    "yarn-gpt-oss": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 8.0,
                     "beta_slow": 0.5, "truncate": False, "attention_factor": 1.3},
}
ORIGINAL = {"llama3": 64, "yarn": 32}  # rope_original_max_len of each scaled kind (else the default)


# A loaded model's logits, compiled: one compile per model instead of one per operation.
_forward = nnx.jit(lambda m, ids, lengths: m(ids.astype(np.int32), lengths_B=lengths.astype(np.int32)))


def _relative(model, ids, lengths, ref):
  got = np.asarray(_forward(model, ids, lengths))
  return float(np.abs(got - ref).max()), float(np.abs(got - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("key", [pytest.param(k, marks=pytest.mark.slow if k == "yarn-gpt-oss" else [])
                                 for k in sorted(SCALED)])
def test_scaled_rope_logits_and_exact_round_trip(key, tmp_path):
  """Llama 3.1-style and YaRN RoPE scaling: logits over 40 positions, the round trip, and the same weights
  read with the scaling dropped (or llama3's bands, yarn's ramp and temperature ignored) far off, so the
  comparison can fail."""
  kind = SCALED[key]["rope_type"]
  if key == "yarn-gpt-oss" and not hasattr(_transformers(), "GptOssConfig"):
    pytest.skip("YaRN without truncation (gpt-oss's) arrived with gpt-oss in transformers 4.55")
  m = build("llama", max_position_embeddings=128, rope=SCALED[key])
  ids, lengths, mask = _batch(m.config.vocab_size, T=40)
  ref = _hf_logits(m, ids, mask)
  m.save_pretrained(tmp_path)
  model, cfg = hf.from_hf(str(tmp_path))
  assert (cfg.rope_scaling, cfg.rope_factor, cfg.rope_original_max_len) == (
      kind, SCALED[key]["factor"], ORIGINAL.get(kind, 8192))
  if key == "yarn-gpt-oss":
    assert (cfg.rope_beta_fast, cfg.rope_beta_slow, cfg.rope_truncate, cfg.rope_attention_factor) == (8, 0.5, False, 1.3)
  name = f"llama ({key} RoPE)"
  MEASURED[name] = _relative(model, ids, lengths, ref)
  print(f"{name}: max abs {MEASURED[name][0]:.2e}, relative {MEASURED[name][1]:.2e}")
  assert MEASURED[name][1] < TOL
  wrong = [{"rope_type": "default"}] + ([{"rope_type": "linear", "factor": SCALED[key]["factor"]}]
                                       if kind in ("llama3", "yarn") else [])
  config = json.loads((tmp_path / "config.json").read_text())
  config.pop("rope_scaling", None)
  for params in wrong:
    (tmp_path / "config.json").write_text(json.dumps(config | {"rope_parameters": params | {"rope_theta": 500.0}}))
    off = _relative(hf.from_hf(str(tmp_path)).model, ids, lengths, ref)[1]
    print(f"  read as {params['rope_type']}: relative {off:.2e}")
    assert off > 100 * TOL
  back = hf.to_hf(model, cfg, "llama")
  want, have = m.state_dict(), back.state_dict()
  assert set(want) == set(have) and all(np.array_equal(want[k].numpy(), have[k].numpy()) for k in want)
  spelling = "rope_parameters" if _v5(_transformers()) else "rope_scaling"
  assert getattr(back.config, spelling) == getattr(m.config, spelling)
  assert hf.from_hf(back).config == cfg


def test_yarn_attention_factor_from_deepseek_mscale():
  """DeepSeek's mscale / mscale_all_dim give yarn's attention_factor as transformers derives it; absent, None
  (HeadConfig's 0.1·ln(factor) + 1); given, as given."""
  yarn = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4}
  ratio = (0.1 * 0.5 * np.log(40.0) + 1) / (0.1 * 2.0 * np.log(40.0) + 1)
  cfg = hf.model_config(LLAMA | {"rope_parameters": yarn | {"mscale": 0.5, "mscale_all_dim": 2.0}})
  assert cfg.rope_attention_factor == pytest.approx(ratio, rel=1e-12) and cfg.rope_original_max_len == 4
  assert hf.model_config(LLAMA | {"rope_parameters": yarn}).rope_attention_factor is None
  assert hf.model_config(LLAMA | {"rope_scaling": yarn | {"attention_factor": 0.9}}).rope_attention_factor == 0.9
  out = hf.rope_to_hf(cfg)["rope_parameters"]
  assert out["attention_factor"] == cfg.rope_attention_factor and "beta_fast" not in out  # defaults left out


def test_gemma3_rope_in_the_spellings_of_transformers_4_and_5():
  """Gemma 3's two bases: 4's rope_theta + rope_local_base_freq + rope_scaling, 5's rope_parameters by
  layer type; the default schedule (every 6th layer full); what rope_to_hf writes reads back both ways."""
  g3 = LLAMA | {"model_type": "gemma3_text", "num_hidden_layers": 7, "sliding_window": 4, "head_dim": 4,
                "query_pre_attn_scalar": 4}
  linear = {"rope_type": "linear", "factor": 8.0}
  v4 = hf.model_config(g3 | {"rope_theta": 1e6, "rope_local_base_freq": 1e4, "rope_scaling": linear})
  v5 = hf.model_config(g3 | {"rope_parameters": {"full_attention": linear | {"rope_theta": 1e6},
                                                 "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}})
  assert v4 == v5 and (v4.global_every, v4.window, v4.sliding_rope_theta, v4.rope_theta, v4.rope_factor) == (
      6, 4, 1e4, 1e6, 8.0)
  assert v4.layer_head(0).rope_theta == 1e4 and v4.layer_head(0).rope_scaling is None  # sliding: own base, unscaled
  assert v4.layer_head(5).rope_theta == 1e6 and v4.layer_head(5).rope_scaling == "linear"
  out = hf.FAMILIES["gemma3_text"].config_out(v4)
  assert hf.model_config(g3 | {k: out[k] for k in ("rope_theta", "rope_local_base_freq", "rope_scaling")}) == v4
  assert hf.model_config(g3 | {"rope_parameters": out["rope_parameters"]}) == v4


# Gemma 2 and 3 with float32 weights drawn at random, untied, as config.json and a state dict: no transformers.
GEMMA = {"vocab_size": 11, "hidden_size": 8, "intermediate_size": 12, "num_hidden_layers": 3, "num_attention_heads": 2,
         "num_key_value_heads": 1, "head_dim": 4, "max_position_embeddings": 16, "query_pre_attn_scalar": 4,
         "sliding_window": 4, "tie_word_embeddings": False,
         "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]}


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
def test_offset_norm_families_written_back_bit_for_bit_in_float32(family):
  """(1 + w) norms (Gemma 2's block norms, Gemma 3's q/k-norms too): every float32 tensor read by from_hf comes
  back from to_hf_state equal (==), the q/k-norm w among them at values where 1 + w - 1 != w in float32."""
  from attn.nn.models import MODELS
  cfg = hf.model_config(GEMMA | {"model_type": family})
  assert cfg.norm_type == "rmsnorm_plus_one" and cfg.qk_norm_plus_one == (family == "gemma3_text")
  _, shapes = hf.to_hf_state(MODELS["decoder_lm"](cfg, rngs=nnx.Rngs(0)), cfg, family)
  rng = np.random.default_rng(0)
  sd = {k: (0.3 * rng.standard_normal(np.shape(a))).astype(np.float32) for k, a in shapes.items()}
  qk = [k for k in sd if k.endswith(("q_norm.weight", "k_norm.weight"))]
  assert len(qk) == (6 if family == "gemma3_text" else 0)
  assert all(np.any((np.float32(1) + sd[k]) - np.float32(1) != sd[k]) for k in qk)  # the old (1 + w) - 1 lost bits
  config, back = hf.to_hf_state(hf.from_hf((GEMMA | {"model_type": family}, sd)))
  assert config["model_type"] == family and set(back) == set(sd)
  unequal = [k for k in sd if back[k].dtype != np.float32 or not np.array_equal(back[k], sd[k])]
  assert not unequal


def test_qk_norm_plus_one_is_the_same_function_as_a_scale_of_one_plus_w():
  """qk_norm_plus_one with scales w against plain QK-norm with scales 1 + w (rounded once, in float32): the same
  queries and keys; and the init (zeros) is the plain init (ones) as a function."""
  import jax
  import jax.numpy as jnp
  from attn.config import HeadConfig
  from attn.variants.mechanisms.head_mechanisms import QK_NORM
  from attn.variants.mechanisms.head_mechanisms import normalize_qk as _normalize_qk
  rng = np.random.default_rng(0)
  on = HeadConfig(d_model=8, num_heads=2, num_kv_heads=1, d_k=4, qk_norm=True, qk_norm_plus_one=True)
  off = on.replace(qk_norm_plus_one=False)
  w = {n: jnp.asarray(0.3 * rng.standard_normal(4), jnp.float32) for n in ("q_norm", "k_norm")}
  q, k = jnp.asarray(rng.standard_normal((1, 3, 2, 4)), jnp.float32), jnp.asarray(rng.standard_normal((1, 3, 1, 4)),
                                                                                  jnp.float32)
  normalize_qk = jax.jit(_normalize_qk, static_argnames="cfg")  # one compile per config, not one per operation
  got, want = normalize_qk(w, q, k, cfg=on), normalize_qk({n: 1.0 + a for n, a in w.items()}, q, k, cfg=off)
  assert all(np.allclose(a, b, rtol=1e-6, atol=1e-6) for a, b in zip(got, want))
  assert not np.allclose(got[0], normalize_qk(w, q, k, cfg=off)[0], atol=1e-3)  # without the 1: another function
  init = QK_NORM.init(None, on)
  assert all(np.array_equal(init[n], np.zeros(4)) for n in ("q_norm", "k_norm"))
  assert all(np.allclose(a, b) for a, b in zip(normalize_qk(init, q, k, cfg=on),
                                               normalize_qk(QK_NORM.init(None, off), q, k, cfg=off)))


def test_rope_scaling_in_the_spellings_of_transformers_4_and_5():
  """5's rope_parameters, 4's rope_scaling ("type" in older files) beside rope_theta; rope_scaling
  wins where both are given, as in both releases; rope_to_hf writes both and each reads back."""
  llama3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
  v5 = hf.model_config(LLAMA | {"rope_parameters": {"rope_type": "llama3", "rope_theta": 50.0, **llama3}})
  v4 = hf.model_config(LLAMA | {"rope_theta": 50.0, "rope_scaling": {"type": "llama3", **llama3, "factor": 8}})
  both = hf.model_config(LLAMA | {"rope_theta": 50.0, "rope_scaling": {"rope_type": "llama3", **llama3},
                                  "rope_parameters": {"rope_type": "default", "rope_theta": 50.0}})
  assert v5 == v4 == both
  assert (v5.rope_theta, v5.rope_scaling, v5.rope_factor, v5.rope_low_freq_factor, v5.rope_high_freq_factor,
          v5.rope_original_max_len) == (50.0, "llama3", 8.0, 1.0, 4.0, 8)
  out = hf.rope_to_hf(v5)
  assert out["rope_scaling"] == {"rope_type": "llama3", **llama3} and out["rope_theta"] == 50.0
  assert out["rope_parameters"] == out["rope_scaling"] | {"rope_theta": 50.0}
  assert hf.model_config(LLAMA | {"rope_theta": 50.0, "rope_scaling": out["rope_scaling"]}) == v5  # as 4 reads it
  assert hf.model_config(LLAMA | {"rope_parameters": out["rope_parameters"]}) == v5  # as 5 reads it
  no_length = {"rope_type": "llama3", **llama3}
  del no_length["original_max_position_embeddings"]  # transformers 5: max_position_embeddings
  assert hf.model_config(LLAMA | {"rope_scaling": no_length}).rope_original_max_len == 16
  old = hf.model_config(LLAMA | {"rope_scaling": {"type": "linear", "factor": 2}})
  assert (old.rope_scaling, old.rope_factor, old.rope_theta) == ("linear", 2.0, 10000.0)
  assert hf.rope_to_hf(old)["rope_parameters"] == {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
  assert "rope_scaling" not in hf.rope_to_hf(hf.model_config(LLAMA))


def test_family_switches():
  """What each family's table sets: biases, QK-norm, windows, Gemma 2's extras."""
  cfgs = {f: hf.model_config(build(f).config.to_dict()) for f in ("mistral", "qwen2", "qwen3", "gemma2", "llama")}
  assert not cfgs["mistral"].use_bias and cfgs["mistral"].window == 3 and cfgs["mistral"].global_every == 0
  assert cfgs["qwen2"].use_bias and cfgs["qwen2"].dense_bias is False and cfgs["qwen2"].tie_embeddings
  assert cfgs["qwen3"].qk_norm and cfgs["qwen3"].qk_norm_eps == 1e-5 and cfgs["qwen3"].head.d_k == 12
  g = cfgs["gemma2"]
  assert (g.norm, g.norm_type, g.embed_scale, g.softcap, g.logit_softcap) == (
      "sandwich", "rmsnorm_plus_one", True, 2.0, 3.0, )
  assert g.scale == pytest.approx(10 ** -0.5) and (g.window, g.global_every) == (3, 2)
  assert [g.layer_head(i).window for i in range(3)] == [3, None, 3]  # transformers' layer_types
  assert cfgs["llama"].activation == "silu" and cfgs["gemma2"].activation == "gelu"


def test_kv_heads_and_variant_on_load():
  m = build("llama", attention_bias=False)
  ids, lengths, mask = _batch(m.config.vocab_size, T=7)
  ref = _hf_logits(m, ids, mask)
  more, cfg = loaded = hf.from_hf(m, num_kv_heads=4)  # each kv head repeated: exact
  assert loaded.errors == (0.0, 0.0) and cfg.num_kv_heads == 4
  got = np.asarray(_forward(more, ids, lengths))
  assert np.abs(got - ref).max() / np.abs(ref).max() < TOL
  with pytest.warns(hf.LossyConversionWarning):
    loaded = hf.from_hf(m, num_kv_heads=1)  # mean-pooled
  assert loaded.config.num_kv_heads == 1 and 0 < loaded.error < 2
  fused, cfg = hf.from_hf(m, variant="fused")
  got = np.asarray(_forward(fused, ids, lengths))
  assert cfg.variant == "fused" and np.abs(got - ref).max() / np.abs(ref).max() < TOL


def _dir(path, config, weights=None):
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config, f)
  if weights is not None:
    save_file = pytest.importorskip("safetensors.numpy").save_file
    save_file(weights, os.path.join(path, "model.safetensors"))
  return str(path)


LLAMA = {"model_type": "llama", "vocab_size": 11, "hidden_size": 8, "intermediate_size": 12, "num_hidden_layers": 1,
         "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 16}


@pytest.mark.parametrize("changes,match", [
    ({"model_type": "gpt_oss", "swiglu_alpha": 1.5}, r"config.swiglu_alpha=1.5.*1.702"),
    ({"model_type": "gpt_oss", "output_router_logits": True}, r"config.output_router_logits=True.*router logits"),
    ({"model_type": "gpt_oss", "swiglu_limit": None}, r"config.swiglu_limit=None.*a positive number \(absent: 7.0"),
    ({"model_type": "mixtral"}, r"mixtral is refused.*block_sparse_moe"),
    ({"model_type": "qwen3_5"}, r"qwen3_5 is refused.*vision-language wrapper.*qwen3_5_text"),
    ({"model_type": "qwen3_5_moe"}, r"qwen3_5_moe is refused.*vision-language wrapper.*qwen3_5_moe_text"),
    ({"model_type": "nemotron_h", "hybrid_override_pattern": "M-E*"}, r"config.layers_block_type\[2\]='moe'.*latent"),
    ({"model_type": "falcon_h1"}, r"falcon_h1 is refused.*side by side"),
    ({"model_type": "falcon"}, r"model_type='falcon'.*'gemma2', 'gemma3_text', 'gemma4_text', 'glm5_next', 'glm5_next_text', 'glm_moe_dsa', 'gpt2'"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 0.0}}, r"rope_factor=0.0 is not allowed"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_fast": "x"}},
     r"config.rope_parameters.beta_fast='x'.*a number: yarn RoPE"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}},
     r"rope_scaling.rope_type='dynamic'.*\['default', 'linear', 'llama3', 'yarn'\]"),
    ({"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0]}}, r"rope_parameters.rope_type='longrope'"),
    ({"rope_scaling": {"rope_type": "linear"}}, r"config.rope_scaling.factor=None.*a number: linear RoPE"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}},
     r"config.rope_parameters.low_freq_factor=None.*a number: llama3 RoPE"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8.5}},
     r"original_max_position_embeddings=8.5.*an integer"),
    ({"rope_scaling": {"rope_type": "linear", "factor": -2.0}}, r"rope_factor=-2.0 is not allowed: a positive"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0}},
     r"rope_high_freq_factor=1.0 is not allowed: greater than rope_low_freq_factor=4.0"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ({"model_type": "gemma2", "query_pre_attn_scalar": 4, "sliding_window": 2, "num_hidden_layers": 3,
      "layer_types": ["full_attention", "sliding_attention", "sliding_attention"]}, r"config.layer_types=.*every k-th"),
    ({"num_key_value_heads": 3, "num_attention_heads": 4, "hidden_size": 8}, "num_key_value_heads=3"),
    # What issue 31's families may ask for and attn does not implement, refused with no weights on disk.
    ({"layer_types": ["chunked_attention"]}, r"config.layer_types=\['chunked_attention'\]"),
    ({"model_type": "llama4_text", "attention_chunk_size": 8192}, r"llama4_text is refused.*fixed chunks \(attention_chunk_size\)"),
    ({"model_type": "gemma3_text", "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
     r"rope_parameters.sliding_attention.rope_type='linear'.*'default'"),
    ({"model_type": "gemma3_text", "rope_parameters": {
        "full_attention": {"rope_type": "longrope", "rope_theta": 1e6}}}, r"rope_parameters.rope_type='longrope'"),
    ({"model_type": "phi3", "partial_rotary_factor": 0.75, "rope_scaling": {
        "rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}}, r"rope_scaling.rope_type='longrope'"),
    ({"model_type": "phi3", "partial_rotary_factor": 0.25}, r"config.partial_rotary_factor=0.25.*even rotary width.*gives 1"),
    ({"model_type": "phi3", "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 1.5}},
     r"config.rope_parameters.partial_rotary_factor=1.5.*a fraction in \(0, 1\]"),
    ({"model_type": "smollm3", "no_rope_layers": [1, 2]}, r"config.no_rope_layers=\[1, 2\].*1 \(RoPE\) or 0"),
    ({"model_type": "smollm3", "layer_types": ["full_attention", "sliding_attention_nope"], "num_hidden_layers": 2},
     r"config.layer_types=.*'full_attention' / 'sliding_attention'"),
])
def test_refusals_by_name(tmp_path, changes, match):
  with pytest.raises(ConfigError, match=match):
    hf.from_hf(_dir(tmp_path / "m", LLAMA | changes))


def test_gpt_oss_without_a_swiglu_limit_clamps_at_seven(monkeypatch):
  """transformers 4.55-5.18 save no swiglu_limit (GptOssExperts fixes 7.0): read as 7.0; a given one as given.
  Written out, another limit is refused where such a release is installed (named as installed)."""
  import importlib.metadata
  oss = LLAMA | {"model_type": "gpt_oss", "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 4,
                 "attention_bias": True}
  family, seven, other = hf.FAMILIES["gpt_oss"], hf.model_config(oss), hf.model_config(oss | {"swiglu_limit": 1.5})
  assert (seven.moe_swiglu_limit, other.moe_swiglu_limit) == (7.0, 1.5)
  assert family.config_out(seven)["swiglu_limit"] == 7.0
  for release, refused in (("4.54.1", False), ("4.55.0", True), ("5.18.0", True), ("5.19.0", False)):
    monkeypatch.setattr(importlib.metadata, "version", lambda name: release)
    family.check_out(seven)
    if refused:
      with pytest.raises(ConfigError, match=rf"moe_swiglu_limit=1.5.*7.0 with transformers {release}"):
        family.check_out(other)
    else:
      family.check_out(other)


def test_pickle_only_directory_and_bad_shapes_are_refused(tmp_path):
  pytest.importorskip("safetensors")
  d = _dir(tmp_path / "bin", LLAMA)
  open(os.path.join(d, "pytorch_model.bin"), "wb").close()
  with pytest.raises(ConfigError, match=r"pytorch_model.bin.*never pickle"):
    hf.from_hf(d)
  r = np.random.default_rng(0)
  w = {"model.embed_tokens.weight": r.standard_normal((11, 8)).astype(np.float32),
       "model.layers.0.self_attn.q_proj.weight": r.standard_normal((8, 8)).astype(np.float32),
       "model.layers.0.self_attn.k_proj.weight": r.standard_normal((8, 8)).astype(np.float32)}  # G=1: (4, 8)
  with pytest.raises(ConfigError, match=r"k_proj.weight.shape=\(8, 8\).*\(4, 8\) from config.json"):
    hf.from_hf(_dir(tmp_path / "shape", LLAMA, w))


def test_left_padding_is_refused():
  with pytest.raises(ConfigError, match="right padding"):
    hf.lengths_from_attention_mask(np.array([[0, 1, 1], [1, 1, 1]]))


def test_to_hf_refuses_what_the_family_cannot_hold():
  from flax import nnx
  from attn.nn import DecoderLM
  m = build("qwen2")
  model, cfg = hf.from_hf(m)
  with pytest.raises(ConfigError, match="norm='pre'.*'sandwich': gemma2 has it so"):
    hf.to_hf(model, cfg, "gemma2")
  with pytest.raises(ConfigError, match="use_bias=True.*mistral has no qkv biases"):
    hf.to_hf(model, cfg, "mistral")
  with pytest.raises(ConfigError, match=r"model_type='falcon' is not allowed: one of \['bailing_hybrid', 'bert', 'deepseek_v3', 'deepseek_v32', 'deepseek_v4', 'gemma2'"):
    hf.to_hf(model, cfg, "falcon")
  # A DecoderLM with RoPE that from_hf did not load: several families fit it alike (MiMo-V2-Flash with full
  # layers and dense MLPs is a Qwen2), so it must be named.
  hand = DecoderLM(cfg, rngs=nnx.Rngs(0))
  with pytest.raises(ConfigError, match="model_type=None.*'gemma2'.*llama and mimo_v2_flash and mistral and phi3 and qwen2 and smollm3 fit it alike"):
    hf.to_hf(hand, cfg)
  nnx.update(hand, nnx.state(model))
  named = hf.to_hf(hand, cfg, "qwen2").state_dict()
  assert all(np.array_equal(named[k].numpy(), t.numpy()) for k, t in m.state_dict().items())


def test_bert_masked_lm_out_and_back():
  transformers = _transformers()
  import torch
  c = transformers.BertConfig(vocab_size=31, hidden_size=12, num_hidden_layers=2, num_attention_heads=3,
                              intermediate_size=20, max_position_embeddings=16, hidden_dropout_prob=0.0,
                              attention_probs_dropout_prob=0.0)
  c._attn_implementation = "eager"
  torch.manual_seed(0)
  m = transformers.BertForMaskedLM(c)
  with torch.no_grad():
    for name, p in m.named_parameters():
      p.copy_(0.3 * torch.randn(p.shape) + (1.0 if name.endswith("LayerNorm.weight") else 0.0))
  measured = check_family("bert", m.eval())  # MLM logits at every position, the state dict back, refusals
  assert measured["config"].mlm_head and not measured["config"].pooler
  MEASURED["bert (MLM)"] = (measured["logits_max_abs"], measured["logits_relative"])
  print(f"bert (MLM): max abs {MEASURED['bert (MLM)'][0]:.2e}, relative {MEASURED['bert (MLM)'][1]:.2e}")
  assert type(hf.to_hf(hf.from_hf(m))).__name__ == "BertForMaskedLM"
  plain = hf.to_hf(hf.from_hf(transformers.BertModel(c, add_pooling_layer=True).eval()))
  assert type(plain).__name__ == "BertModel" and plain.pooler is not None


# ---- attn eval --hf and attn analyze --hf on tiny save_pretrained directories with a tokenizer.

WORDS = ["head", "query", "key", "value", "softmax", "matrix", "rank", "the", "of", "attention"]


def _texts(root, seed=0):
  texts = root / "texts"
  texts.mkdir(exist_ok=True)
  rng = np.random.default_rng(seed)
  for name in ("a.txt", "b.txt"):
    (texts / name).write_text("\n".join(" ".join(rng.choice(WORDS, 9)) for _ in range(40)))
  return texts


def _checkpoint(root, family, mlm_head=True):
  """A tiny random `family` model saved with save_pretrained, with a tokenizer trained here
  (bert: a BertForMaskedLM, or with mlm_head=False a BertModel, as a sentence encoder ships)."""
  tokenizers = pytest.importorskip("tokenizers")
  texts = _texts(root)
  corpus = [(texts / n).read_text() for n in ("a.txt", "b.txt")]
  if family == "bert":
    tok = tokenizers.BertWordPieceTokenizer()
    tok.train_from_iterator(corpus, vocab_size=60, min_frequency=1, show_progress=False)
  else:
    tok = tokenizers.ByteLevelBPETokenizer()
    tok.train_from_iterator(corpus, vocab_size=280, min_frequency=2, show_progress=False)
  path = root / family
  if family == "bert":
    transformers = _transformers()
    c = transformers.BertConfig(vocab_size=tok.get_vocab_size(), hidden_size=16, num_hidden_layers=2,
                                num_attention_heads=4, intermediate_size=24, max_position_embeddings=32)
    import torch
    torch.manual_seed(0)  # the same weights every run
    (transformers.BertForMaskedLM if mlm_head else transformers.BertModel)(c).save_pretrained(path)
  else:
    build(family, vocab_size=tok.get_vocab_size()).save_pretrained(path)
  tok.save(str(path / "tokenizer.json"))
  return str(path), str(texts)


def _cli(capsys, *argv):
  from attn import cli
  code = cli.main(list(argv))
  out = capsys.readouterr()
  return code, out.out, out.err


# `attn eval --hf` end to end: BERT and Llama in the fast tier, the other families (the same command on
# another family, whose logits identity above stays fast) in the slow tier.
@pytest.mark.parametrize("family", [pytest.param(f, marks=[] if f in ("bert", "llama") else pytest.mark.slow)
                                    for f in ["bert", *sorted(FAMILIES)]])
def test_eval_every_family(tmp_path, capsys, family):
  path, texts = _checkpoint(tmp_path, family)
  code, out, err = _cli(capsys, "eval", "--hf", path, "--text", texts, "--seq-len", "16", "--max-tokens", "64",
                        "--batch-size", "4", "--num-kv-heads", "1")
  assert code == 0, err
  assert out.startswith(f"{path}: {family}") and "| original | per_head |" in out and "| converted | per_head | 1 |" in out
  loss = float(out.split("| original | per_head |")[1].split("|")[2])
  assert 0 < loss < float("inf")
  if family == "bert":
    assert "15% masked, seed 0" in out


def test_eval_refuses_a_missing_tokenizer(tmp_path, capsys):
  path, texts = _checkpoint(tmp_path, "llama")
  os.remove(os.path.join(path, "tokenizer.json"))
  code, _, err = _cli(capsys, "eval", "--hf", path, "--text", texts)
  assert code == 2 and "tokenizer.json, or vocab.json + merges.txt" in err


# `attn analyze --hf` end to end: test_hf_encoder runs it on BERT in the fast tier, every family here runs
# in the slow tier (their logits identity, above, stays fast).
@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_analyze_every_family(tmp_path, capsys, family):
  path, texts = _checkpoint(tmp_path, family)
  out_dir = tmp_path / "analysis"
  code, _, err = _cli(capsys, "analyze", "--hf", path, "--text", texts, "--out", str(out_dir), "--seq-len", "16",
                      "--batch-size", "2", "--batches", "1", "--no-plots")
  assert code == 0, err
  a = json.loads((out_dir / "analysis.json").read_text())
  assert a["num_heads"] == 4 and np.isfinite(a["eval"]["loss"]) and a["hf"] == os.path.abspath(path)
  if family == "olmo2":  # no per-head W_QK under a norm over the whole projection: the report says why
    assert "couples the heads" in a["layers"][0]["qk"]["refused"]
