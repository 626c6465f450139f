"""Local text as token batches for a pretrained Hugging Face model (`attn eval`, `attn analyze --hf`).

The text is an attn.experiments.data.corpus: a file, or a directory's files matching
a glob, split by file into train and held-out (a single file holds out its last
5%). A pretrained model never saw this text, so any of it is held out for it;
attn evaluates on the corpus's held-out split all the same, so that every
command (and the byte-level `text` task) scores the same bytes, and `attn
analyze --hf` ranks heads on the train split and scores the pruning on the
held-out one.

Each document (file) is tokenised on its own with the checkpoint's tokenizer
(tokenizer.json, or GPT-2's vocab.json + merges.txt) and cut into windows of
seq_len + 1 tokens that overlap by one, so every token but a document's first
is predicted exactly once. Windows are the decoder_lm task format: tokens,
targets and weights (B,T); a document's short last window is right-padded with
weight 0, which a causal model needs no mask for.

A BERT without an MLM head (a sentence encoder such as all-MiniLM-L6-v2) is
scored on span pairs instead (span_pairs): each window of seq_len tokens of a
document, tokenised without special tokens, is cut into halves, and each half
becomes its own sequence [CLS] half [SEP]; the two halves of a window are an
(anchor, positive) pair, the other windows of the batch its negatives
(attn.analysis.sentence.ranking_loss).
"""

from __future__ import annotations

import os
from typing import Any, Iterable, Iterator

import numpy as np

from attn.config import invalid
from attn.experiments.data import corpus as corpus_lib
from attn.nn.hf import require

TOKENIZER_FILES = "tokenizer.json, or vocab.json + merges.txt (GPT-2's byte-level BPE)"


def load_tokenizer(path: str):
  """The checkpoint directory's own tokenizer (a `tokenizers.Tokenizer`), refused when absent."""
  single = os.path.join(path, "tokenizer.json")
  vocab, merges = os.path.join(path, "vocab.json"), os.path.join(path, "merges.txt")
  if not os.path.isfile(single) and not (os.path.isfile(vocab) and os.path.isfile(merges)):
    raise invalid("--hf", path, f"a checkpoint directory with its tokenizer: {TOKENIZER_FILES} "
                  "(save_pretrained of the tokenizer writes them)")
  tokenizers = require("tokenizers")
  try:
    tok = tokenizers.Tokenizer.from_file(single) if os.path.isfile(single) else \
        tokenizers.ByteLevelBPETokenizer(vocab, merges)
  except Exception as e:  # a corrupt file: say which
    raise invalid("--hf", path, f"a readable tokenizer ({TOKENIZER_FILES}): {e}") from None
  # Whole documents: a tokenizer.json may carry the model's truncation (all-MiniLM-L6-v2's cuts at
  # 128 tokens) or padding; windows are cut here instead.
  tok.no_truncation()
  tok.no_padding()
  return tok


def documents(text: str, glob: str | None = None, split: str = "heldout") -> tuple[list[str], dict[str, Any]]:
  """The documents of one split of the corpus at `text` and a description of it (files, bytes)."""
  if glob is None:
    glob = corpus_lib.DEFAULT_GLOB if text == "" else "**/*"
  c = corpus_lib.load(text, glob, name="--text")
  data = c.heldout if split == "heldout" else c.train
  docs = [d.decode("utf-8", errors="replace") for d in bytes(data).split(bytes([corpus_lib.SEPARATOR]))]
  info = corpus_lib.describe(c) | {"glob": glob, "split": split}
  return [d for d in docs if d], info


def windows(token_ids: Iterable[list[int]], seq_len: int, max_tokens: int | None = None) -> dict[str, np.ndarray]:
  """tokens, targets, weights (N, seq_len) of every document's windows, at most max_tokens targets."""
  if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
    raise invalid("--seq-len", seq_len, "an integer >= 1")
  rows, budget = [], max_tokens if max_tokens is not None else float("inf")
  for ids in token_ids:
    for start in range(0, max(len(ids) - 1, 0), seq_len):
      n = int(min(len(ids) - 1 - start, seq_len, budget))
      if n <= 0:
        break
      rows.append(np.asarray(ids[start:start + n + 1], np.int32))
      budget -= n
    if budget <= 0:
      break
  if not rows:
    raise invalid("--text", "no tokens", "text with at least 2 tokens in one document of the split")
  N = len(rows)
  seq = np.zeros((N, seq_len + 1), np.int32)
  weights = np.zeros((N, seq_len), np.float32)
  for i, r in enumerate(rows):
    seq[i, :r.size] = r
    weights[i, :r.size - 1] = 1.0
  return {"tokens": seq[:, :-1], "targets": seq[:, 1:], "weights": weights}


def tokenize(tokenizer, docs: list[str], vocab_size: int, special: bool = True) -> Iterator[list[int]]:
  """Each document's ids, lazily; an id the model has no embedding for (a mismatched tokenizer) is refused.

  special=False leaves out the tokenizer's own special tokens (BERT's [CLS] … [SEP] around a document).
  """
  for d in docs:
    ids = tokenizer.encode(d, add_special_tokens=special).ids
    if ids and max(ids) >= vocab_size:
      raise invalid("tokenizer", f"id {max(ids)}", f"ids below the model's vocab_size={vocab_size}: "
                    "the tokenizer does not belong to this checkpoint")
    yield ids


def span_pairs(token_ids: Iterable[list[int]], seq_len: int, cls_id: int, sep_id: int,
               max_tokens: int | None = None, whole: bool = False) -> dict[str, np.ndarray]:
  """(anchor, positive) pairs: the halves of each window of seq_len tokens, each as [CLS] half [SEP].

  tokens, lengths (N,) and pair_tokens, pair_lengths, right-padded to
  seq_len // 2 + 2 positions (ceil for the second half: seq_len odd gives one more
  token there), weights (N,) 1. A document's last, shorter window is split in
  half too when each half has a token (whole=True: only full windows). At most
  max_tokens tokens (both halves) in all.
  """
  if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
    raise invalid("--seq-len", seq_len, "an integer >= 2: a window is cut into two halves")
  budget = max_tokens if max_tokens is not None else float("inf")
  first, second = [], []
  for ids in token_ids:
    for start in range(0, len(ids), seq_len):
      n = int(min(len(ids) - start, seq_len))
      if n < 2 or (whole and n < seq_len) or n > budget:
        break
      chunk = ids[start:start + n]
      first.append([cls_id, *chunk[:n // 2], sep_id])
      second.append([cls_id, *chunk[n // 2:], sep_id])
      budget -= n
    if budget < 2:
      break
  if not first:
    raise invalid("--text", "no window", f"text with a document of at least {seq_len if whole else 2} tokens")
  T = (seq_len + 1) // 2 + 2
  out = {}
  for name, rows in (("", first), ("pair_", second)):
    tokens = np.zeros((len(rows), T), np.int32)
    for i, r in enumerate(rows):
      tokens[i, :len(r)] = r
    out[name + "tokens"] = tokens
    out[name + "lengths"] = np.asarray([len(r) for r in rows], np.int32)
  out["weights"] = np.ones(len(first), np.float32)
  return out


def batches(w: dict[str, np.ndarray], batch_size: int, max_batches: int | None = None) -> dict[str, np.ndarray]:
  """Windows stacked as (num_batches, batch_size, T), the last batch padded with weight-0 rows."""
  if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
    raise invalid("--batch-size", batch_size, "an integer >= 1")
  N = w["tokens"].shape[0]
  nb = -(-N // batch_size)
  if max_batches is not None:
    nb = min(nb, max_batches)
  pad = nb * batch_size - min(N, nb * batch_size)
  out = {}
  for k, a in w.items():
    a = a[:nb * batch_size]
    a = np.concatenate([a, np.zeros((pad,) + a.shape[1:], a.dtype)])
    out[k] = a.reshape((nb, batch_size) + a.shape[1:])
  return out


def text_batches(path: str, text: str, seq_len: int, batch_size: int, max_tokens: int | None,
                 vocab_size: int, glob: str | None = None, split: str = "heldout"):
  """(batches, info) of one split of `text`, tokenised with the checkpoint at `path`."""
  tokenizer = load_tokenizer(path)
  docs, info = documents(text, glob, split)
  w = windows(tokenize(tokenizer, docs, vocab_size), seq_len, max_tokens)
  info |= {"documents": len(docs), "windows": int(w["tokens"].shape[0]),
           "tokens": int(w["weights"].sum()), "seq_len": seq_len}
  return batches(w, batch_size), info
