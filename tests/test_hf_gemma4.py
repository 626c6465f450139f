"""Gemma 4's text model (gemma4_text, attn.nn.hf.gemma4): tiny random models built in code with
transformers' own classes (nothing downloaded), against transformers itself: logits under right
padding, cached greedy decoding with the last layers reading earlier layers' caches, to_hf bit for
bit, `attn count --hf` against transformers' parameter count; refusals by name.

The models: 4 query heads over d_model 32 (h·d_k ≠ d_model), sliding layers of 2 kv heads of 8 with
a window of 3, global layers of 12 wide heads (1 kv head with keys equal to values, or the sliding
layers' 2 without), proportional RoPE on half of the global head (6 of 12 dims, a permutation
away from attn's partial RoPE), the last two layers sharing, per-layer inputs of 5, double-wide
MLPs. Tests that build a transformers model skip where the installed release lacks gemma4
(CI's floor, 4.51.1).
"""

import json

import numpy as np
import pytest

from attn import ConfigError, cli
from attn.nn import hf
from attn.nn.hf import gemma4

TOL = 1e-4  # relative to the largest logit, float32
TYPES = ["sliding_attention", "full_attention"] * 3
KEQV = dict(vocab_size=53, hidden_size=32, intermediate_size=40, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, global_head_dim=12, num_global_key_value_heads=1,
            attention_k_eq_v=True, max_position_embeddings=32, rms_norm_eps=1e-6, sliding_window=3,
            layer_types=TYPES, num_kv_shared_layers=2, use_double_wide_mlp=True, hidden_size_per_layer_input=5,
            vocab_size_per_layer_input=53, final_logit_softcapping=3.0, tie_word_embeddings=True,
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
                             "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                                                "rope_theta": 500.0}},
            pad_token_id=None, bos_token_id=None, eos_token_id=None)
# Global layers per_head with the sliding layers' kv heads, plain RoPE, no per-layer inputs or sharing.
PLAIN = KEQV | dict(attention_k_eq_v=False, num_kv_shared_layers=0, use_double_wide_mlp=False,
                    hidden_size_per_layer_input=0, final_logit_softcapping=None, tie_word_embeddings=False,
                    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
                                     "full_attention": {"rope_type": "default", "rope_theta": 500.0}})


def _transformers():
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  pytest.importorskip("transformers.models.gemma4", reason=f"gemma4 is not in transformers "
                      f"{transformers.__version__}")
  return torch, transformers


def _model(kw, seed=0):
  """A random Gemma4ForCausalLM, weights and layer scalars moved off their initial values."""
  torch, transformers = _transformers()
  torch.manual_seed(seed)
  m = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**kw)).eval()
  with torch.no_grad():
    for p in m.parameters():
      p.add_(0.1 * torch.randn_like(p))
    for layer in m.model.layers:
      layer.layer_scalar.fill_(0.7 + 0.1 * layer.layer_idx)
  return m


def test_logits_equal_transformers_under_right_padding():
  torch, _ = _transformers()
  import jax.numpy as jnp
  m = _model(KEQV)
  loaded = hf.from_hf(m)
  cfg = loaded.config
  assert cfg.layer_heads["full_attention"] == {"d_k": 12, "d_v": 12, "num_kv_heads": 1, "rope_dim": 6,
                                               "variant": "k_eq_v"}
  assert cfg.kv_source == (0, 1, 2, 3, 2, 3) and cfg.per_layer_dim == 5 and cfg.double_wide_mlp
  assert sorted(loaded.model.blocks[5].attn.params) == ["q_norm", "w_o", "w_q"]  # no k_proj, v_proj, k_norm
  ids = torch.as_tensor(np.random.default_rng(1).integers(0, 53, (2, 9)))
  mask = torch.ones(2, 9, dtype=torch.long)
  mask[1, 6:] = 0
  with torch.no_grad():
    want = m(input_ids=ids, attention_mask=mask).logits.numpy()
  lengths = hf.lengths_from_attention_mask(mask.numpy())
  from flax import nnx
  got = np.asarray(nnx.jit(lambda mm, t, n: mm(t, lengths_B=n))(loaded.model, jnp.asarray(ids.numpy()),
                                                                jnp.asarray(lengths)))
  assert np.abs(got - want).max() <= TOL * np.abs(want).max()


@pytest.mark.slow
@pytest.mark.parametrize("kw", [KEQV, PLAIN], ids=["k_eq_v", "per_head"])
def test_family_contract_round_trip_bit_for_bit(kw):
  """attn.testing.check_family: logits, refusals, and to_hf's state dict equal to the original's bit for bit.

  transformers 5.5 to 5.14 cannot run PLAIN: Gemma4TextRotaryEmbedding.__init__ gives the global head
  (global_head_dim) its RoPE frequencies only for rope_type "proportional" (head_dim_key="global_head_dim");
  "default" gets compute_default_rope_parameters' config.head_dim (the sliding layers' 8), and the forward
  fails in apply_rotary_pos_emb (12 against 8). 5.15 builds each layer type's RoPE from
  config.per_layer_config[layer_type]. There the round trip is checked and the rest skipped."""
  torch, transformers = _transformers()
  from attn.testing import check_family
  m = _model(kw, seed=2)
  if kw is PLAIN and tuple(int(p) for p in transformers.__version__.split(".")[:2]) < (5, 15):
    _assert_round_trip(torch, m)
    pytest.skip(f"transformers 5.5-5.14's Gemma4TextRotaryEmbedding (this is {transformers.__version__}; "
                "per layer type from 5.15) gives a full layer's default RoPE head_dim, not global_head_dim: "
                "its forward fails at global_head_dim 12; the round trip passed, logits not compared")
  measured = check_family("gemma4_text", m)
  assert measured["logits_relative"] <= TOL
  _assert_round_trip(torch, m)


def _assert_round_trip(torch, m):
  back = hf.to_hf(hf.from_hf(m))
  want, got = m.state_dict(), back.state_dict()
  assert set(want) == set(got)
  assert all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.slow
def test_cached_greedy_decoding_equals_transformers():
  torch, _ = _transformers()
  import jax.numpy as jnp
  m = _model(KEQV, seed=3)
  loaded = hf.from_hf(m)
  prompt = torch.as_tensor(np.random.default_rng(4).integers(0, 53, (1, 5)))
  with torch.no_grad():
    want = m.generate(prompt, max_new_tokens=8, do_sample=False).numpy()
  got = np.asarray(loaded.model.generate(jnp.asarray(prompt.numpy()), 8))
  np.testing.assert_array_equal(got, want)
  assert [b.attn.cache is None for b in loaded.model.blocks] == [False] * 4 + [True] * 2  # shared caches


@pytest.mark.slow
@pytest.mark.parametrize("kw", [KEQV, PLAIN], ids=["k_eq_v", "per_head"])
def test_count_hf_equals_transformers_parameter_count(tmp_path, capsys, kw):
  m = _model(kw)
  m.save_pretrained(tmp_path / "g4")
  code = cli.main(["count", "--hf", str(tmp_path / "g4"), "--format", "json", "--dtype", "bfloat16"])
  out = capsys.readouterr()
  assert code == 0, out.err
  report = json.loads(out.out)
  assert report["total"] == sum(p.numel() for p in m.parameters())
  shared = {r["type"]: r["kv_shared_layers"] for r in report["layer_types"]}
  assert shared == ({"sliding_attention": 1, "full_attention": 1} if kw is KEQV else
                    {"sliding_attention": 0, "full_attention": 0})


def test_permutation_turns_proportional_rope_into_partial_rope():
  """HF's pair (i, K/2 + i) at θ^(-2i/K) is attn's pair (i, r/2 + i) at θ'^(-2i/r), θ' = θ^(r/K)."""
  K, r, theta, pos = 12, 6, 500.0, 7.0
  x = np.random.default_rng(5).standard_normal(K)
  inv = np.concatenate([theta ** (-np.arange(0, r, 2) / K), np.zeros(K // 2 - r // 2)])
  ang = pos * np.concatenate([inv, inv])
  hf_rot = x * np.cos(ang) + np.concatenate([-x[K // 2:], x[:K // 2]]) * np.sin(ang)
  j = gemma4.perm(K, r)
  y, h = x[j], r // 2
  a = pos * (theta ** (r / K)) ** (-np.arange(0, r, 2) / r)
  attn_rot = np.concatenate([y[:h] * np.cos(a) - y[h:r] * np.sin(a), y[h:r] * np.cos(a) + y[:h] * np.sin(a), y[r:]])
  np.testing.assert_allclose(attn_rot, hf_rot[j], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("changes, match", [
    (dict(enable_moe_block=True), r"config.enable_moe_block=True is not allowed: False: attn does not run"),
    (dict(attention_bias=True), r"config.attention_bias=True"),
    (dict(use_bidirectional_attention="all"), r"config.use_bidirectional_attention='all'"),
    (dict(model_type="gemma4"), r"model_type='gemma4'.*vision and audio towers"),
    (dict(rope_parameters={"sliding_attention": {"rope_type": "yarn", "rope_theta": 5.0}}),
     r"config.rope_parameters.sliding_attention.rope_type='yarn'"),
    (dict(num_kv_shared_layers=5), r"config.num_kv_shared_layers=5 is not allowed: at most 4: layer 1 "
                                   r"\(full_attention\) would share with no earlier full_attention layer"),
    (dict(per_layer_config={"1": {"head_dim": 12, "sliding_window": 5}}), r"config.per_layer_config\[1\]"),
    (dict(num_global_key_value_heads=3), r"config.num_global_key_value_heads=3 is not allowed: a divisor of"),
])
def test_what_attn_does_not_run_is_refused_by_name_before_any_weight(changes, match):
  with pytest.raises(ConfigError, match=match):
    hf.model_config({"model_type": "gemma4_text", **KEQV} | changes)


def test_converting_on_load_is_refused_by_name_before_any_weight():
  """Every layer converts with one head, which a model of two layouts and shared caches does not have."""
  source = ({"model_type": "gemma4_text", **KEQV}, {})  # no tensors: the refusal comes first
  with pytest.raises(ConfigError, match=r"variant, num_kv_heads=\('per_head', 1\) is not allowed: the "
                     r"model's own \('per_head', None\): it has layer_heads"):
    hf.from_hf(source, num_kv_heads=1)
  with pytest.raises(ConfigError, match=r"value_norm_eps=1e-06 is not allowed: it must be unset \(None\) for variant 'fused': only "
                     r"per_head and k_eq_v read it"):
    hf.from_hf(source, variant="fused")


def test_bidirectional_vision_is_read_and_ignored_with_a_note_as_transformers_text_model_does():
  with pytest.warns(UserWarning, match="use_bidirectional_attention='vision' read and ignored"):
    cfg = hf.model_config({"model_type": "gemma4_text", **KEQV, "use_bidirectional_attention": "vision"})
  assert cfg == hf.model_config({"model_type": "gemma4_text", **KEQV})


def test_to_hf_refuses_a_schedule_gemma4_cannot_hold():
  cfg = hf.model_config({"model_type": "gemma4_text", **KEQV})
  from flax import nnx
  from attn.nn.models import DecoderLM
  bad = cfg.replace(kv_source=(0, 1, 2, 3, 0, 1))  # allowed in attn, not Gemma 4's rule
  with pytest.raises(ConfigError, match=r"kv_source=\(0, 1, 2, 3, 0, 1\) is not allowed: \(0, 1, 2, 3, 2, 3\)"):
    hf.to_hf_state(nnx.eval_shape(lambda: DecoderLM(bad, rngs=nnx.Rngs(0))), bad, "gemma4_text")


def test_count_hf_by_hand_from_config_json_alone(tmp_path, capsys):
  """`attn count --hf` on KEQV's config.json (no transformers), against the closed form written here: the
  sharing layers (4, 5) hold no k_proj, v_proj or k_norm and have MLPs 2·F wide. (The slow test above checks
  the same total against transformers' own count: 56,159 for this config.)"""
  (tmp_path / "g4").mkdir()
  (tmp_path / "g4" / "config.json").write_text(json.dumps({"model_type": "gemma4_text", **KEQV}))
  code = cli.main(["count", "--hf", str(tmp_path / "g4"), "--format", "json", "--dtype", "bfloat16"])
  out = capsys.readouterr()
  assert code == 0, out.err
  D, H, L, F, N, K, G, Kg, Gg, P = 32, 4, 6, 40, 53, 8, 2, 12, 1, 5
  sliding = [2 * D * H * K + 2 * D * G * K + 2 * K] * 2 + [2 * D * H * K + K]  # layer 4 shares
  full = [2 * D * H * Kg + D * Gg * Kg + 2 * Kg] * 2 + [2 * D * H * Kg + Kg]  # k_eq_v: one kv projection
  mlp = 4 * 3 * D * F + 2 * 3 * D * 2 * F
  per_layer = N * L * P + D * L * P + P + L * (2 * D * P + D)
  norms = L * 4 * D + D
  report = json.loads(out.out)
  assert report["breakdown"]["attention (sliding_attention)"] == sum(sliding)
  assert report["breakdown"]["attention (full_attention)"] == sum(full)
  assert report["total"] == N * D + sum(sliding) + sum(full) + mlp + per_layer + norms == 56_159
  rows = {r["type"]: r for r in report["layer_types"]}
  # KV cache at 32 tokens (bfloat16): two sliding rings of 3 slots of G·2K, two full caches of Gg·Kg.
  assert report["kv_bytes_at"]["32"] == 2 * (2 * 3 * G * 2 * K + 2 * 32 * Gg * Kg)
  assert rows["full_attention"]["kv_bytes_per_token_per_layer"] == 2 * Gg * Kg
