"""A BERT without an MLM head (a sentence encoder) in `attn eval --hf` and `attn analyze --hf`.

The sentence-pair objective (attn.analysis.sentence.ranking_loss over halves of
text windows, attn.experiments.data.hf_text.span_pairs) checked against numpy
and against transformers' own BertModel, mean-pooled as sentence-transformers
pools; the masked-LM BERT through analyze too.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn.analysis.sentence import RANKING_SCALE, ranking_loss
from attn.experiments.data import hf_text
from test_hf_families import _checkpoint, _cli, _texts, _transformers


def _unit(x):
  return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _numpy_ranking(a, p, valid, scale=RANKING_SCALE):
  """Per valid anchor: cross-entropy of its own positive among the valid positives; top-1 hit."""
  a, p = np.asarray(a, np.float64), np.asarray(p, np.float64)
  cols = np.flatnonzero(valid)
  nll, hit = np.zeros(len(a)), np.zeros(len(a))
  for b in cols:
    logits = scale * (p[cols] @ a[b])
    own = int(np.flatnonzero(cols == b)[0])
    m = logits.max()
    nll[b] = m + np.log(np.exp(logits - m).sum()) - logits[own]
    hit[b] = float(np.argmax(logits) == own)
  return nll, hit


def test_ranking_loss_against_numpy():
  rng = np.random.default_rng(0)
  a, p = _unit(rng.normal(size=(6, 5))), _unit(rng.normal(size=(6, 5)))
  p[2] = a[2] * 0.9 + 0.1 * p[2]  # one easy pair
  valid = np.array([True, True, True, False, True, False])
  nll, hit = jax.jit(ranking_loss)(a, p, valid)  # one compile, not one per operation
  want_nll, want_hit = _numpy_ranking(a, p, valid)
  np.testing.assert_allclose(np.asarray(nll), want_nll, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(hit), want_hit)
  assert np.all(np.asarray(nll)[~valid] == 0) and want_hit[2] == 1


def test_own_pair_gradient_is_each_pairs_own():
  """With own_pair_gradient, d(Σ_b nll_b)/dθ_b is ∂nll_b/∂θ_b with the other positives held fixed."""
  rng = np.random.default_rng(1)
  B, D = 5, 4
  X, Y = rng.normal(size=(B, D)), rng.normal(size=(B, D))
  valid = np.array([True, True, False, True, True])
  theta = jnp.asarray(rng.normal(size=(B, D)))
  unit = lambda v: v / jnp.linalg.norm(v, axis=-1, keepdims=True)
  embed = lambda t: (unit(t + X), unit(2.0 * t + Y))  # row b's anchor and positive depend on θ_b only

  def total(t, own):
    a, p = embed(t)
    return ranking_loss(a, p, valid, own_pair_gradient=own)[0].sum()

  grad_total = jax.jit(jax.grad(total), static_argnums=1)  # one compile each, not op by op
  got = np.asarray(grad_total(theta, True))
  _, p_fixed = (np.asarray(e) for e in embed(theta))
  want = np.zeros((B, D))
  cols = np.flatnonzero(valid)

  def own_loss(t_b, b):  # an independent expression of nll_b: the others' positives are constants
    a_b, p_b = unit(t_b + X[b]), unit(2.0 * t_b + Y[b])
    logits = jnp.stack([RANKING_SCALE * (a_b @ (p_b if j == b else p_fixed[j])) for j in cols])
    return jax.nn.logsumexp(logits) - logits[int(np.flatnonzero(cols == b)[0])]

  # Every row's gradient in one compiled program (b is a Python int: each row's expression is its own).
  own_grads = jax.jit(lambda t: [jax.grad(own_loss)(t[b], b) for b in cols])(theta)
  for b, g in zip(cols, own_grads):
    want[b] = np.asarray(g)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  whole = np.asarray(grad_total(theta, False))  # without it, row b also moves the others' losses
  assert np.abs(whole - want).max() > 1e-3


def test_span_pairs():
  docs = [list(range(1, 11)), [20, 21, 22], [30]]
  w = hf_text.span_pairs(iter(docs), 4, 101, 102)
  np.testing.assert_array_equal(w["tokens"], [[101, 1, 2, 102], [101, 5, 6, 102], [101, 9, 102, 0],
                                              [101, 20, 102, 0]])
  np.testing.assert_array_equal(w["pair_tokens"], [[101, 3, 4, 102], [101, 7, 8, 102], [101, 10, 102, 0],
                                                   [101, 21, 22, 102]])
  np.testing.assert_array_equal(w["lengths"], [4, 4, 3, 3])
  np.testing.assert_array_equal(w["pair_lengths"], [4, 4, 3, 4])
  assert hf_text.span_pairs(iter(docs), 4, 101, 102, whole=True)["tokens"].shape[0] == 2
  assert hf_text.span_pairs(iter(docs), 4, 101, 102, max_tokens=6)["tokens"].shape[0] == 1
  with pytest.raises(Exception, match="--seq-len=1"):
    hf_text.span_pairs(iter(docs), 1, 101, 102)


def test_a_tokenizers_own_truncation_is_lifted(tmp_path):
  tokenizers = pytest.importorskip("tokenizers")
  tok = tokenizers.BertWordPieceTokenizer()
  tok.train_from_iterator(["the head of the key and the value"] * 3, vocab_size=40, show_progress=False)
  tok.enable_truncation(5)
  tok.save(str(tmp_path / "tokenizer.json"))
  text = "the head of the key and the value " * 4
  assert len(tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json")).encode(text).ids) == 5
  assert len(hf_text.load_tokenizer(str(tmp_path)).encode(text).ids) > 20


def _pair_loss_with_transformers(path, texts, seq_len):
  """The eval's sentence-pair loss and accuracy, from transformers' BertModel and numpy alone."""
  import torch
  transformers = _transformers()
  tokenizers = pytest.importorskip("tokenizers")
  from attn.experiments.data import corpus
  tok = tokenizers.Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
  cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
  halves = []
  for doc in corpus.load(texts, "**/*").heldout.tobytes().split(b"\0"):
    ids = tok.encode(doc.decode(), add_special_tokens=False).ids
    for s in range(0, len(ids), seq_len):
      chunk = ids[s:s + seq_len]
      if len(chunk) >= 2:
        halves.append(([cls, *chunk[:len(chunk) // 2], sep], [cls, *chunk[len(chunk) // 2:], sep]))
  m = transformers.BertModel.from_pretrained(path).eval()

  def embed(rows):
    T = max(map(len, rows))
    ids = torch.tensor([r + [0] * (T - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in rows])
    with torch.no_grad():
      h = m(input_ids=ids, attention_mask=mask).last_hidden_state.double().numpy()
    mean = (h * mask.numpy()[..., None]).sum(1) / mask.numpy().sum(1, keepdims=True)
    return _unit(mean)

  a, p = embed([h[0] for h in halves]), embed([h[1] for h in halves])
  nll, hit = _numpy_ranking(a, p, np.ones(len(halves), bool))
  top2 = np.sort(RANKING_SCALE * a @ p.T, axis=1)[:, -2:]
  near_ties = int((top2[:, 1] - top2[:, 0] < 1e-3).sum())  # float32 may rank these either way
  return nll.mean(), hit.mean(), len(halves), near_ties


def _table(out):
  rows = [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines() if line.startswith("| ")]
  return {r[0]: r for r in rows}


def test_eval_sentence_encoder_matches_transformers(tmp_path, capsys):
  path, texts = _checkpoint(tmp_path, "bert", mlm_head=False)
  code, out, err = _cli(capsys, "eval", "--hf", path, "--text", texts, "--seq-len", "12", "--batch-size", "256",
                        "--max-tokens", "100000", "--num-kv-heads", "2")
  assert code == 0, err
  want_loss, want_acc, n, near_ties = _pair_loss_with_transformers(path, texts, 12)
  rows = _table(out)
  assert "sentence pairs" in out and f"scored {n} pairs" in out and f"chance {np.log(n):.3f}" in out
  assert abs(float(rows["original"][4]) - want_loss) < 1e-4 and rows["original"][5] == "–"
  assert abs(float(rows["original"][6]) - want_acc) <= near_ties / n + 1e-4
  assert rows["converted"][2] == "2" and np.isfinite(float(rows["converted"][4]))


@pytest.mark.parametrize("mlm_head", [False, True])
def test_analyze_either_bert(tmp_path, capsys, mlm_head):
  path, texts = _checkpoint(tmp_path, "bert", mlm_head=mlm_head)
  out_dir = tmp_path / "analysis"
  code, _, err = _cli(capsys, "analyze", "--hf", path, "--text", texts, "--out", str(out_dir), "--seq-len", "12",
                      "--batch-size", "4", "--batches", "2", "--no-plots")
  assert code == 0, err
  a = json.loads((out_dir / "analysis.json").read_text())
  assert a["objective"] == ("masked_lm" if mlm_head else "sentence_pairs")
  assert (a["num_layers"], a["num_heads"]) == (2, 4) and np.isfinite(a["eval"]["loss"])
  raw = np.array([lay["importance"]["raw"] for lay in a["layers"]])
  assert raw.shape == (2, 4) and raw.max() > 1e-6  # a gradient that does not vanish at ξ = 1
  assert 0.0 <= a["summary"]["first_mass"] <= 1.0


def test_refuses_a_bert_tokenizer_without_its_special_tokens(tmp_path, capsys):
  tokenizers = pytest.importorskip("tokenizers")
  path, texts = _checkpoint(tmp_path, "bert", mlm_head=False)
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"the": 0, "[UNK]": 1}, unk_token="[UNK]"))
  tok.save(os.path.join(path, "tokenizer.json"))
  code, _, err = _cli(capsys, "eval", "--hf", path, "--text", str(_texts(tmp_path)))
  assert code == 2 and "tokenizer=" in err and "[CLS], [SEP]" in err
