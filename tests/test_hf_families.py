"""Llama, Mistral, Qwen2, Qwen3 and Gemma 2 in and out (attn.nn.hf), BERT's MLM head out, refusals.

Tiny random models built with transformers' own config classes (nothing is
downloaded), GQA (4 query heads, 2 kv heads) and head_dim != D/H where the
family allows it; logits compared at every position of right-padded rows
(windowed families: every position whose window holds a real key, see
_defined), and to_hf's state_dict equal to the original's bit for bit.
"""

import json
import os

import numpy as np
import pytest

from attn.config import ConfigError
from attn.nn import hf

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
}
MEASURED = {}  # family -> (max abs, max relative) logit difference, printed with -s


def _transformers():
  pytest.importorskip("torch")
  return pytest.importorskip("transformers")


def _rope(transformers):
  """RoPE's base as the release's own checkpoints write it: transformers 4 a top-level rope_theta,
  5 rope_parameters. Never both, so each release's config.json is read the way it is saved."""
  if int(transformers.__version__.split(".")[0]) >= 5:
    return dict(rope_parameters={"rope_type": "default", "rope_theta": 500.0})
  return dict(rope_theta=500.0)


def build(family, seed=0, **changes):
  """A random transformers model of the family: every parameter redrawn, norm scales near 1 (1 + w: near 0)."""
  transformers = _transformers()
  import torch
  conf, model, extra = FAMILIES[family]
  cfg = getattr(transformers, conf)(**(BASE | _rope(transformers) | extra | changes))
  cfg._attn_implementation = "eager"
  torch.manual_seed(seed)
  m = getattr(transformers, model)(cfg)
  with torch.no_grad():
    for name, p in m.named_parameters():
      unit = name.endswith("norm.weight") and family != "gemma2"
      p.copy_(0.3 * torch.randn(p.shape) + (1.0 if unit else 0.0))
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


def _defined(cfg, lengths, T):
  """Positions whose every window holds a real key. A padded query whose window (t − w, t] has
  no key before the length is a fully masked row: transformers' eager softmax spreads it over
  masked keys, attn's gives 0; neither is a logit of the text."""
  t = np.arange(T)[None, :]
  return np.ones((len(lengths), T), bool) if cfg.window is None else t < lengths[:, None] + cfg.window - 1


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_logits_and_exact_round_trip(family, tmp_path):
  m = build(family)
  ids, lengths, mask = _batch(m.config.vocab_size)
  ref = _hf_logits(m, ids, mask)
  m.save_pretrained(tmp_path)
  model, cfg = hf.from_hf(str(tmp_path))  # safetensors through numpy
  assert (cfg.num_heads, cfg.num_kv_heads, cfg.rope_dim, cfg.rope_theta) == (4, 2, cfg.head.d_k, 500.0)
  got = np.asarray(model(ids.astype(np.int32), lengths_B=lengths.astype(np.int32)))
  keep = _defined(cfg, lengths, ids.shape[1])
  diff = np.abs(got - ref)[keep]
  MEASURED[family] = (float(diff.max()), float(diff.max() / np.abs(ref[keep]).max()))
  print(f"{family}: max abs {MEASURED[family][0]:.2e}, relative {MEASURED[family][1]:.2e}")
  assert MEASURED[family][1] < TOL
  back = hf.to_hf(model, cfg, family)
  want, have = m.state_dict(), back.state_dict()
  assert set(want) == set(have)
  for k in want:
    assert np.array_equal(want[k].numpy(), have[k].numpy()), k
  assert hf.from_hf(back)[1] == cfg


def test_family_switches():
  """What each family's table sets: biases, QK-norm, windows, Gemma 2's extras."""
  cfgs = {f: hf.model_config(build(f).config.to_dict()) for f in FAMILIES}
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
  more, cfg, err = hf.from_hf(m, num_kv_heads=4)  # each kv head repeated: exact
  assert err == 0.0 and cfg.num_kv_heads == 4
  got = np.asarray(more(ids.astype(np.int32), lengths_B=lengths.astype(np.int32)))
  assert np.abs(got - ref).max() / np.abs(ref).max() < TOL
  with pytest.warns(hf.LossyConversionWarning):
    _, cfg, err = hf.from_hf(m, num_kv_heads=1)  # mean-pooled
  assert cfg.num_kv_heads == 1 and 0 < err < 2
  fused, cfg = hf.from_hf(m, variant="fused")
  got = np.asarray(fused(ids.astype(np.int32), lengths_B=lengths.astype(np.int32)))
  assert cfg.variant == "fused" and np.abs(got - ref).max() / np.abs(ref).max() < TOL


def _dir(path, config, weights=None):
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config, f)
  if weights is not None:
    from safetensors.numpy import save_file
    save_file(weights, os.path.join(path, "model.safetensors"))
  return str(path)


LLAMA = {"model_type": "llama", "vocab_size": 11, "hidden_size": 8, "intermediate_size": 12, "num_hidden_layers": 1,
         "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 16}


@pytest.mark.parametrize("changes,match", [
    ({"model_type": "gpt_oss"}, r"gpt_oss.*mixture of experts"),
    ({"model_type": "phi3"}, r"model_type='phi3'.*\['bert', 'gemma2', 'gpt2', 'llama', 'mistral', 'qwen2', 'qwen3'\]"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, r"rope_parameters.rope_type='yarn'"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, r"rope_scaling.rope_type='linear'"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ({"model_type": "gemma2", "query_pre_attn_scalar": 4, "sliding_window": 2, "num_hidden_layers": 3,
      "layer_types": ["full_attention", "sliding_attention", "sliding_attention"]}, r"config.layer_types=.*every k-th"),
    ({"num_key_value_heads": 3, "num_attention_heads": 4, "hidden_size": 8}, "num_key_value_heads=3"),
])
def test_refusals_by_name(tmp_path, changes, match):
  with pytest.raises(ConfigError, match=match):
    hf.from_hf(_dir(tmp_path / "m", LLAMA | changes))


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
  transformers = _transformers()
  model, cfg = hf.from_hf(build("qwen2"))
  with pytest.raises(ConfigError, match="model_type=None.*gemma2"):
    hf.to_hf(model, cfg)
  with pytest.raises(ConfigError, match="norm='pre'.*'sandwich': gemma2 has it so"):
    hf.to_hf(model, cfg, "gemma2")
  with pytest.raises(ConfigError, match="use_bias=True.*mistral has no qkv biases"):
    hf.to_hf(model, cfg, "mistral")
  del transformers


def test_bert_masked_lm_out_and_back(tmp_path):
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
  m.eval()
  ids, lengths, mask = _batch(31)
  with torch.no_grad():
    ref = m(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).logits.numpy()
  m.save_pretrained(tmp_path)
  enc, cfg = hf.from_hf(str(tmp_path))
  assert cfg.mlm_head and not cfg.pooler
  got = np.asarray(enc.mlm_logits(enc(ids.astype(np.int32), lengths_B=lengths.astype(np.int32))))
  real = mask.astype(bool)  # BERT's padded queries are not compared (their keys are masked alike)
  rel = np.abs(got - ref)[real].max() / np.abs(ref).max()
  MEASURED["bert (MLM)"] = (float(np.abs(got - ref)[real].max()), float(rel))
  print(f"bert (MLM): max abs {MEASURED['bert (MLM)'][0]:.2e}, relative {rel:.2e}")
  assert rel < TOL
  back = hf.to_hf(enc, cfg)
  assert type(back).__name__ == "BertForMaskedLM"
  want, have = m.state_dict(), back.state_dict()
  assert set(want) == set(have) and all(np.array_equal(want[k].numpy(), have[k].numpy()) for k in want)
  plain = hf.to_hf(*hf.from_hf(transformers.BertModel(c, add_pooling_layer=True).eval()))
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


def _checkpoint(root, family):
  """A tiny random `family` model saved with save_pretrained, with a tokenizer trained here."""
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
    transformers.BertForMaskedLM(c).save_pretrained(path)
  else:
    build(family, vocab_size=tok.get_vocab_size()).save_pretrained(path)
  tok.save(str(path / "tokenizer.json"))
  return str(path), str(texts)


def _cli(capsys, *argv):
  from attn import cli
  code = cli.main(list(argv))
  out = capsys.readouterr()
  return code, out.out, out.err


@pytest.mark.parametrize("family", ["bert", *sorted(FAMILIES)])
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


def test_eval_refuses_a_missing_tokenizer_and_a_bert_without_mlm_head(tmp_path, capsys):
  transformers = _transformers()
  path, texts = _checkpoint(tmp_path, "llama")
  os.remove(os.path.join(path, "tokenizer.json"))
  code, _, err = _cli(capsys, "eval", "--hf", path, "--text", texts)
  assert code == 2 and "tokenizer.json, or vocab.json + merges.txt" in err
  bert = tmp_path / "plain_bert"
  transformers.BertModel(transformers.BertConfig(vocab_size=60, hidden_size=16, num_hidden_layers=1,
                                                 num_attention_heads=4, intermediate_size=24)).save_pretrained(bert)
  (tmp_path / "bert").mkdir()
  _, _ = _checkpoint(tmp_path / "bert", "bert")
  os.replace(tmp_path / "bert" / "bert" / "tokenizer.json", bert / "tokenizer.json")
  code, _, err = _cli(capsys, "eval", "--hf", str(bert), "--text", texts)
  assert code == 2 and "BertForMaskedLM" in err
  code, _, err = _cli(capsys, "analyze", "--hf", str(bert), "--text", texts, "--out", str(tmp_path / "a"))
  assert code == 2 and "a causal LM" in err


@pytest.mark.parametrize("family", [pytest.param(f, marks=[] if f == "gemma2" else pytest.mark.slow)
                                    for f in sorted(FAMILIES)])
def test_analyze_every_family(tmp_path, capsys, family):
  path, texts = _checkpoint(tmp_path, family)
  out_dir = tmp_path / "analysis"
  code, _, err = _cli(capsys, "analyze", "--hf", path, "--text", texts, "--out", str(out_dir), "--seq-len", "16",
                      "--batch-size", "2", "--batches", "1", "--no-plots")
  assert code == 0, err
  a = json.loads((out_dir / "analysis.json").read_text())
  assert a["num_heads"] == 4 and np.isfinite(a["eval"]["loss"]) and a["hf"] == os.path.abspath(path)
