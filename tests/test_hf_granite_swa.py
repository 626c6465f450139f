"""Granite-SWA (granite_swa, attn.nn.hf.granite_swa): tiny random models built with transformers' own
classes and written by its save_pretrained (nothing downloaded), against transformers itself: logits
under right padding, cached greedy decoding against generate, to_hf bit for bit, `attn count --hf`
against transformers' parameter count; refusals by name.

The model: 6 query heads over d_model 24 with 2 kv heads, biases, full and sliding layers (window 3)
in an order global_every cannot say, per-layer RoPE bases with two NoPE layers (layer_rope_theta 0),
a sink per head in every layer, and every Granite multiplier away from 1. Tests that build a
transformers model skip where the installed release lacks granite_swa (5.25 has it; CI's floor,
4.51.1, does not).
"""

import json

import numpy as np
import pytest

from attn import ConfigError, cli
from attn.nn import hf

TOL = 1e-4  # relative to the largest logit, float32
KW = dict(vocab_size=53, hidden_size=24, intermediate_size=40, num_hidden_layers=4, num_attention_heads=6,
          num_key_value_heads=2, max_position_embeddings=32, sliding_window=3,
          layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
          layer_rope_theta=[100.0, 0, 5000.0, 0], attention_multiplier=0.3, embedding_multiplier=2.0,
          residual_multiplier=0.5, logits_scaling=3.0, attention_bias=True, tie_word_embeddings=False,
          pad_token_id=None, bos_token_id=None, eos_token_id=None)


def _transformers():
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  pytest.importorskip("transformers.models.granite_swa", reason=f"granite_swa is not in transformers "
                      f"{transformers.__version__}")
  return torch, transformers


def _saved(tmp_path, kw=KW, seed=0):
  """A random GraniteSWAForCausalLM (sinks and weights moved off their initial values), saved by
  transformers' save_pretrained; (the model, its directory)."""
  torch, transformers = _transformers()
  torch.manual_seed(seed)
  m = transformers.GraniteSWAForCausalLM(transformers.GraniteSWAConfig(**kw)).eval()
  with torch.no_grad():
    for p in m.parameters():
      p.add_(0.1 * torch.randn_like(p))
  m.save_pretrained(tmp_path / "granite_swa")
  return m, tmp_path / "granite_swa"


def test_config_read_as_written_here():
  """The fast sibling of the tests against transformers: config.json alone, each layer's head."""
  cfg = hf.model_config({"model_type": "granite_swa", **KW})
  assert cfg.layer_rope_theta == (100.0, 0.0, 5000.0, 0.0) and cfg.sinks and cfg.scale == 0.3
  assert [cfg.layer_head(i).rope_dim for i in range(4)] == [4, 0, 4, 0]
  assert [cfg.layer_head(i).rope_theta for i in (0, 2)] == [100.0, 5000.0]
  assert [cfg.layer_head(i).window for i in range(4)] == [None, 3, 3, None]
  assert (cfg.embed_multiplier, cfg.residual_multiplier, cfg.logit_divisor) == (2.0, 0.5, 3.0)
  assert hf.model_config({"model_type": "granite_swa", **KW, "layer_rope_theta": None}).layer_rope_theta == (
      (cfg.rope_theta,) * 4)  # transformers' default: the global base in every layer


@pytest.mark.slow  # torch, transformers and a compile: ~15 s; test_config_read_as_written_here is its sibling
def test_logits_equal_transformers_under_right_padding(tmp_path):
  torch, _ = _transformers()
  import jax.numpy as jnp
  from flax import nnx
  m, d = _saved(tmp_path)
  loaded = hf.from_hf(d)
  cfg = loaded.config
  assert cfg.layer_rope_theta == (100.0, 0.0, 5000.0, 0.0) and cfg.sinks and cfg.scale == 0.3
  assert [cfg.layer_head(i).rope_dim for i in range(4)] == [4, 0, 4, 0]
  assert [cfg.layer_head(i).window for i in range(4)] == [None, 3, 3, None]
  ids = torch.as_tensor(np.random.default_rng(1).integers(0, 53, (2, 9)))
  mask = torch.ones(2, 9, dtype=torch.long)
  mask[1, 6:] = 0
  with torch.no_grad():
    want = m(input_ids=ids, attention_mask=mask).logits.numpy()
  lengths = hf.lengths_from_attention_mask(mask.numpy())
  got = np.asarray(nnx.jit(lambda mm, t, n: mm(t, lengths_B=n))(loaded.model, jnp.asarray(ids.numpy()),
                                                                jnp.asarray(lengths)))
  keep = np.arange(9)[None, :] < np.array([9, 6])[:, None] + 2  # a padded query whose window holds a real key
  assert np.abs(got - want)[keep].max() <= TOL * np.abs(want).max()


@pytest.mark.slow
def test_family_contract_from_a_save_pretrained_directory(tmp_path):
  """attn.testing.check_family on the directory: round trip, refusals, save_pretrained, logits."""
  _transformers()
  from attn.testing import check_family
  _, d = _saved(tmp_path, seed=2)
  assert check_family("granite_swa", d)["logits_relative"] <= TOL


@pytest.mark.slow
def test_to_hf_is_bit_for_bit(tmp_path):
  torch, _ = _transformers()
  m, d = _saved(tmp_path, seed=3)
  want, got = m.state_dict(), hf.to_hf(hf.from_hf(d)).state_dict()
  assert set(want) == set(got)
  assert all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.slow
def test_cached_greedy_decoding_equals_generate(tmp_path):
  torch, _ = _transformers()
  import jax.numpy as jnp
  m, d = _saved(tmp_path, seed=4)
  loaded = hf.from_hf(d)
  prompt = torch.as_tensor(np.random.default_rng(4).integers(0, 53, (1, 5)))
  with torch.no_grad():
    want = m.generate(prompt, max_new_tokens=8, do_sample=False).numpy()
  got = np.asarray(loaded.model.generate(jnp.asarray(prompt.numpy()), 8))
  np.testing.assert_array_equal(got, want)


@pytest.mark.slow
def test_count_hf_equals_transformers_parameter_count(tmp_path, capsys):
  m, d = _saved(tmp_path)
  code = cli.main(["count", "--hf", str(d), "--format", "json"])
  out = capsys.readouterr()
  assert code == 0, out.err
  assert json.loads(out.out)["total"] == sum(p.numel() for p in m.parameters())


def test_count_hf_by_hand_from_config_json_alone(tmp_path, capsys):
  """`attn count --hf` on KW's config.json (no transformers) against the closed form written here."""
  (tmp_path / "g").mkdir()
  (tmp_path / "g" / "config.json").write_text(json.dumps({"model_type": "granite_swa", **KW}))
  code = cli.main(["count", "--hf", str(tmp_path / "g"), "--format", "json"])
  out = capsys.readouterr()
  assert code == 0, out.err
  D, H, G, K, F, N, L = 24, 6, 2, 4, 40, 53, 4
  attention = 2 * D * H * K + 2 * D * G * K + H * K + 2 * G * K + D + H  # q, o, k, v, biases, sinks
  total = L * (attention + 3 * D * F + 2 * D) + 2 * N * D + D
  assert json.loads(out.out)["total"] == total


@pytest.mark.parametrize("changes, match", [
    (dict(layer_rope_theta=[100.0, 0.0]), r"config.layer_rope_theta=\[100.0, 0.0\] is not allowed: a list of 4"),
    (dict(layer_rope_theta=[100.0, -1.0, 5.0, 0.0]), r"layer_rope_theta\[1\]=-1.0 is not allowed"),
    (dict(layer_types=["full_attention", "chunked_attention", "full_attention", "full_attention"]),
     r"config.layer_types=.*'full_attention' / 'sliding_attention'"),
    (dict(sliding_window=None), r"config.sliding_window=None is not allowed"),
    (dict(logits_scaling=0.0), r"logit_divisor=0.0 is not allowed"),
])
def test_what_attn_cannot_read_is_refused_by_name_before_any_weight(changes, match):
  with pytest.raises(ConfigError, match=match):
    hf.model_config({"model_type": "granite_swa", **KW} | changes)


def test_to_hf_refuses_a_model_without_sinks():
  from flax import nnx
  from attn.nn.models import DecoderLM
  cfg = hf.model_config({"model_type": "granite_swa", **KW}).replace(sinks=False)
  with pytest.raises(ConfigError, match=r"^sinks=False is not allowed: True"):
    hf.to_hf_state(nnx.eval_shape(lambda: DecoderLM(cfg, rngs=nnx.Rngs(0))), cfg, "granite_swa")

