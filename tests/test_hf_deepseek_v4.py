"""DeepSeek-V4 (deepseek_v4, attn.nn.hf.deepseek_v4): tiny random models built in code with transformers' own
classes (nothing downloaded), against transformers itself: logits under right padding, cached greedy
decoding, to_hf bit for bit, `attn count --hf` against transformers' parameter count; refusals by name.

The model: 4 query heads of 16 over d_model 24 (h·d_k ≠ d_model), one shared kv head whose rotated key is
the value, a query latent of 12, RoPE on the last 8 dims of each head (interleaved, at 50 in the sliding
layer and 700 in the compressed ones), a window of 5, sinks, entries of 4 tokens (heavily compressed
attention at a tiny rate, so that 19 tokens give several), the grouped output (2 groups of rank 6),
3 residual streams, 4 experts (2 kept) with the sqrtsoftplus router, its correction bias and the
clamped SwiGLU; the first layer's experts are hash-routed (a random tid2eid table, repeats included).
Tests that build a transformers model skip where the installed release lacks
deepseek_v4 (CI's floor, 4.51.1).
"""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from attn import ConfigError, cli
from attn.nn import hf
from attn.nn.hf import deepseek_v4

sys.path.insert(0, str(Path(__file__).parent))
import hf_hybrid  # noqa: E402

TOL = 1e-4  # relative to the largest logit, float32
SWA, HCA, CSA = "sliding_attention", "heavily_compressed_attention", "compressed_sparse_attention"
KW = dict(vocab_size=61, hidden_size=24, moe_intermediate_size=20, num_hidden_layers=3, num_attention_heads=4,
          num_key_value_heads=1, head_dim=16, q_lora_rank=12, partial_rotary_factor=0.5, num_experts_per_tok=2,
          n_routed_experts=4, n_shared_experts=1, layer_types=[SWA, HCA, HCA],
          compress_rates={CSA: 4, HCA: 4}, mlp_layer_types=["hash_moe", "moe", "moe"], hc_mult=3, hc_sinkhorn_iters=5,
          sliding_window=5, o_groups=2, o_lora_rank=6, index_n_heads=2, index_head_dim=8, index_topk=4,
          max_position_embeddings=64, rope_theta=50.0, compress_rope_theta=700.0, swiglu_limit=1.5,
          pad_token_id=None, bos_token_id=None, eos_token_id=None)


def _transformers():
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  pytest.importorskip("transformers.models.deepseek_v4", reason=f"deepseek_v4 is not in transformers "
                      f"{transformers.__version__}")
  return torch, transformers


def _model(kw=KW, seed=0):
  """A random DeepseekV4ForCausalLM, every weight and the correction bias moved off its initial value."""
  torch, transformers = _transformers()
  torch.manual_seed(seed)
  m = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**kw)).eval()
  with torch.no_grad():
    for p in m.parameters():
      p.add_(0.3 * torch.randn_like(p))
    for name, b in m.named_buffers():
      if name.endswith("e_score_correction_bias"):
        b.add_(0.1 * torch.randn_like(b))
      if name.endswith("tid2eid"):
        b.copy_(torch.randint(0, kw["n_routed_experts"], b.shape))
  return m


def test_logits_equal_transformers_under_right_padding():
  """At every real position (transformers' compressed entries ignore the padding mask, so a padded
  query there sees entries attn's lengths hide: the padded positions differ, and nothing reads them)."""
  torch, _ = _transformers()
  import jax.numpy as jnp
  m = _model()
  loaded = hf.from_hf(m)
  cfg = loaded.config
  assert cfg.layer_heads == {HCA: {"compress_block": 4}} and cfg.sliding_rope_theta == 50.0
  assert cfg.rope_theta == 700.0 and cfg.rope_dim == 8 and cfg.hc_mult == 3 and cfg.moe_hash_first == 1
  ids = np.random.default_rng(1).integers(0, 61, (2, 19))
  lengths = np.array([19, 13])
  mask = (np.arange(19)[None] < lengths[:, None]).astype(np.int64)
  with torch.no_grad():
    want = m(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask)).logits.numpy()
  got = np.asarray(loaded.model(jnp.asarray(ids), lengths_B=jnp.asarray(lengths)))
  for b, n in enumerate(lengths):
    assert np.abs(got[b, :n] - want[b, :n]).max() <= TOL * np.abs(want[b, :n]).max()


@pytest.mark.slow
def test_to_hf_bit_for_bit_and_family_contract():
  """to_hf writes transformers' tensors back bit for bit (the head dims' permutation undone), and the
  family contract (attn.testing.check_family) holds."""
  _transformers()
  from attn.testing import check_family
  m = _model(seed=2)
  hf_hybrid.assert_to_hf_and_back_exact(m, "DeepseekV4ForCausalLM")
  assert check_family("deepseek_v4", m)["logits_relative"] <= TOL


@pytest.mark.slow
def test_cached_greedy_decoding_equals_transformers():
  """12 tokens after a prompt of 6: the window's ring, entries ending inside steps, the streams."""
  _transformers()
  m = _model(seed=3)
  prompt = np.random.default_rng(4).integers(0, 61, (2, 6))
  hf_hybrid.assert_greedy_decoding_equal(m, hf.from_hf(m), prompt, 12)


@pytest.mark.slow
def test_count_hf_equals_transformers_parameter_count(tmp_path, capsys):
  m = _model()
  m.save_pretrained(tmp_path / "v4")
  code = cli.main(["count", "--hf", str(tmp_path / "v4"), "--format", "json"])
  out = capsys.readouterr()
  assert code == 0, out.err
  assert json.loads(out.out)["total"] == sum(p.numel() for p in m.parameters()) == 39_920


def test_count_hf_by_hand_from_config_json_alone(tmp_path, capsys):
  """`attn count --hf` on KW's config.json (no transformers) against the closed form written here (the slow
  test above checks the same total, 39,920, against transformers' own count)."""
  (tmp_path / "v4").mkdir()
  (tmp_path / "v4" / "config.json").write_text(json.dumps({"model_type": "deepseek_v4", **KW}))
  code = cli.main(["count", "--hf", str(tmp_path / "v4"), "--format", "json"])
  out = capsys.readouterr()
  assert code == 0, out.err
  D, H, K, Q, N, E, F, n, g, r, m = 24, 4, 16, 12, 61, 4, 20, 3, 2, 6, 4
  attn_ = D * Q + Q + Q * H * K + D * K + K + H * K * r + g * r * D + H  # ... + sinks
  compressor = 2 * D * K + m * K + K
  experts = D * E + E * 3 * D * F + 3 * D * F  # router, experts, the shared one (tid2eid and the bias: buffers)
  hc = 2 * ((2 + n) * n * (n * D + 1) + 3)
  report = json.loads(out.out)
  assert report["breakdown"]["attention (sliding_attention)"] == attn_
  assert report["breakdown"]["attention (heavily_compressed_attention)"] == 2 * (attn_ + compressor)
  total = 3 * (attn_ + experts + hc + 2 * D) + 2 * compressor + 2 * N * D + D + n * (n * D + 1) + 1
  assert report["total"] == total == 39_920


@pytest.mark.parametrize("change, field", [
    (dict(layer_types=[SWA, CSA, HCA]), "layer_types\\[1\\]"),
    (dict(mlp_layer_types=["moe", "hash_moe", "moe"]), "mlp_layer_types"),
    (dict(num_key_value_heads=2), "num_key_value_heads"),
    (dict(hc_mult=1), "hc_mult"),
    (dict(quantization_config={"quant_method": "fp8"}), "quantization_config"),
    (dict(scoring_func="softmax"), "scoring_func"),
    (dict(rope_parameters={"main": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50.0},
                           "compress": {"rope_type": "default", "rope_theta": 700.0}}), "rope_parameters.main"),
    (dict(attention_bias=True), "attention_bias")])
def test_what_attn_does_not_run_is_refused_by_name_before_any_weight(change, field):
  """From the config alone (no weights, no transformers): the parameter, its value and what is allowed."""
  with pytest.raises(ConfigError, match=field):
    hf.model_config({"model_type": "deepseek_v4", **KW, **change})


def test_read_and_ignored_with_a_note_where_transformers_ignores_them():
  with pytest.warns(UserWarning, match="norm_topk_prob"):
    cfg = hf.model_config({"model_type": "deepseek_v4", **KW, "norm_topk_prob": False})
  assert cfg.moe_norm_topk  # V4's router renormalises whatever the config says


def test_head_permutation_moves_the_trailing_rope_slice_first():
  j = deepseek_v4.perm(6, 2)
  assert list(j) == [4, 5, 0, 1, 2, 3]
  assert list(np.argsort(j)[j]) == list(range(6))
