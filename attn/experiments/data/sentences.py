"""English sentences from the Python documentation that ships with Python, and pairs of them.

pydoc_data.topics.topics maps each help() topic (79 in Python 3.11) to its
text. A topic's prose is taken as sentences:

  1. paragraphs are runs of lines between blank lines; a paragraph is prose
     when no line is indented (code, grammar, indented lists), none starts with
     "+", "|", "*", "-" or "=" (tables, bullets, underlines) and it is not a
     heading (a line underlined with "*", "=", "-" or "~");
  2. a prose paragraph's lines are joined with spaces, footnote marks "[3]"
     dropped, and it is cut after ".", "!" or "?" followed by a space and an
     upper-case letter or a quote;
  3. a sentence is kept with MIN_WORDS..MAX_WORDS words, ending in ".", with at
     least MIN_LETTERS of its characters letters or spaces; repeats are dropped
     (the first stays).

Splits are by topic, so no pair crosses from one split into another: topics
in sorted order are dealt round-robin into the named splits.

Pairs (held-out): the sentences of a topic are paired (0, 1), (2, 3), ...:
"adjacent" pairs, consecutive sentences of one paragraph or of neighbouring
paragraphs; `pairs(..., n, seed)` samples n of them (numpy's default_rng(seed))
and adds n "random" pairs, the first sentence of adjacent pair i with the
second of adjacent pair π(i) for a random permutation π (default_rng(seed +
1)), each pair of one topic then swapped with a random partner so that no
random pair shares a topic. Both kinds reuse the same 2n sentences.

Tokens: the checkpoint's tokenizer.json (tokenizers; its own padding and
truncation turned off) adds [CLS] and [SEP]; sentences longer than max_tokens
are dropped before any sampling, never truncated.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from attn.config import invalid
from attn.experiments.data import hf_text

MIN_WORDS, MAX_WORDS, MIN_LETTERS = 6, 40, 0.8
_UNDERLINE = re.compile(r"^[*=~-]{3,}$")
_CUT = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"“])")
_FOOTNOTE = re.compile(r"\s*\[\d+\]")


def _prose(paragraph: list[str]) -> bool:
  if any(line[:1].isspace() or line[:1] in "+|*-=" for line in paragraph):
    return False
  return not any(_UNDERLINE.match(line.strip()) for line in paragraph)


def split_sentences(text: str) -> list[str]:
  """The prose sentences of one help topic's text, in order (module docstring, steps 1–3)."""
  out, paragraph = [], []
  for line in text.splitlines() + [""]:
    if line.strip():
      paragraph.append(line.rstrip())
      continue
    if paragraph and _prose(paragraph):
      joined = _FOOTNOTE.sub("", " ".join(paragraph))
      out += [s.strip() for s in _CUT.split(joined)]
    paragraph = []
  keep = []
  for s in out:
    words = s.split()
    letters = sum(c.isalpha() or c == " " for c in s) / max(len(s), 1)
    if MIN_WORDS <= len(words) <= MAX_WORDS and s.endswith(".") and letters >= MIN_LETTERS:
      keep.append(s)
  return keep


def pydoc_sentences() -> list[tuple[str, str]]:
  """(topic, sentence) of every topic of pydoc_data.topics in sorted topic order, repeats dropped."""
  from pydoc_data.topics import topics
  seen, out = set(), []
  for topic in sorted(topics):
    for s in split_sentences(topics[topic]):
      if s not in seen:
        seen.add(s)
        out.append((topic, s))
  return out


def by_split(sentences: list[tuple[str, str]], names: tuple[str, ...]) -> dict[str, list[tuple[str, str]]]:
  """The sentences dealt into splits by topic: the i-th topic in sorted order goes to names[i % n]."""
  topics = sorted({t for t, _ in sentences})
  where = {t: names[i % len(names)] for i, t in enumerate(topics)}
  out = {n: [] for n in names}
  for t, s in sentences:
    out[where[t]].append((t, s))
  return out


def sample(sentences: list, n: int, seed: int) -> list:
  """n of the sentences, drawn without replacement by default_rng(seed), kept in their order."""
  if n > len(sentences):
    raise invalid("n", n, f"at most the {len(sentences)} sentences available")
  keep = np.sort(np.random.default_rng(seed).choice(len(sentences), n, replace=False))
  return [sentences[i] for i in keep]


def pairs(sentences: list[tuple[str, str]], n: int, seed: int) -> dict[str, Any]:
  """{"texts" (2n), "topics", "adjacent" (n,2), "random" (n,2)}: index pairs into texts (docstring)."""
  candidates = []
  start = 0
  while start < len(sentences):
    end = start
    while end < len(sentences) and sentences[end][0] == sentences[start][0]:
      end += 1
    candidates += [(i, i + 1) for i in range(start, end - 1, 2)]
    start = end
  chosen = sample(candidates, n, seed)
  texts = [sentences[i][1] for pair in chosen for i in pair]
  topics = [sentences[i][0] for pair in chosen for i in pair]
  adjacent = np.arange(2 * n).reshape(n, 2)
  perm = _cross_topic_permutation([topics[2 * i] for i in range(n)],
                                  [topics[2 * i + 1] for i in range(n)], seed + 1)
  random_pairs = np.stack([adjacent[:, 0], adjacent[perm, 1]], axis=1)
  return {"texts": texts, "topics": topics, "adjacent": adjacent, "random": random_pairs}


def _cross_topic_permutation(first: list[str], second: list[str], seed: int) -> np.ndarray:
  """A permutation π with first[i] != second[π(i)] for every i: a random one, clashes then swapped away."""
  n = len(first)
  rng = np.random.default_rng(seed)
  perm = rng.permutation(n)
  for i in range(n):
    if first[i] != second[perm[i]]:
      continue
    for j in rng.permutation(n):
      if first[i] != second[perm[j]] and first[j] != second[perm[i]]:
        perm[i], perm[j] = perm[j], perm[i]
        break
    else:
      raise invalid("sentences", f"{len(set(first))} topics", "enough topics for random pairs across them")
  return perm


def load_tokenizer(path: str):
  """The checkpoint's tokenizer.json with its own padding and truncation turned off."""
  tokenizer = hf_text.load_tokenizer(path)
  tokenizer.no_padding()
  tokenizer.no_truncation()
  return tokenizer


def encode(tokenizer, texts: list[str]) -> list[list[int]]:
  """Token ids of each text with the tokenizer's special tokens ([CLS] ... [SEP] for BERT)."""
  return [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=True)]


def fits(tokenizer, sentences: list[tuple[str, str]], max_tokens: int) -> list[tuple[str, str]]:
  """The sentences whose ids (special tokens included) number at most max_tokens."""
  ids = encode(tokenizer, [s for _, s in sentences])
  return [ts for ts, i in zip(sentences, ids) if len(i) <= max_tokens]


def batches(ids: list[list[int]], batch_size: int, multiple: int = 16) -> list[dict[str, np.ndarray]]:
  """Right-padded batches, shortest first: tokens (B,T) int32, lengths (B,), index (B,) into ids.

  Each batch is padded to its longest row rounded up to `multiple`, so a jitted
  function meets a few shapes; `index` puts the rows back in the input's order.
  """
  order = np.argsort([len(i) for i in ids], kind="stable")
  out = []
  for start in range(0, len(order), batch_size):
    index = order[start:start + batch_size]
    T = -(-max(len(ids[i]) for i in index) // multiple) * multiple
    tokens = np.zeros((len(index), T), np.int32)
    for row, i in enumerate(index):
      tokens[row, :len(ids[i])] = ids[i]
    out.append({"tokens": tokens, "lengths": np.array([len(ids[i]) for i in index], np.int32),
                "index": index})
  return out
