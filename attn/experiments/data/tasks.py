"""Tasks: synthetic and text data, generated deterministically from a seed, no downloads.

Every task is a frozen dataclass whose fields are its TOML keys under [task].
`batch(seed, split, index, batch_size)` returns numpy arrays that depend only
on those four numbers, so a trial that is re-run sees exactly the same data.

Language-model tasks (kind "decoder_lm") give tokens, next-token targets and a loss weight
per position; classification tasks ("classifier") give tokens, lengths, labels.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import numpy as np

from attn.config import did_you_mean, invalid
from attn.experiments.data import arrays
from attn.experiments.data import backcopy
from attn.experiments.data import corpus as corpus_lib
from attn.experiments.data import curriculum

TRAIN, EVAL = arrays.TRAIN, arrays.EVAL
_rng, _check_int, _lm_arrays = arrays.rng, arrays.check_int, arrays.lm_arrays
BOS_BYTE = 256  # the text task's [BOS] token (bos = true)


@dataclasses.dataclass(frozen=True)
class MQAR:
  """Multi-query associative recall (Arora et al. 2023, "Zoology").

  A sequence lists num_pairs key-value pairs, then queries keys in random order,
  each followed by its value; the loss counts only the value after each query.
  Keys come from the lower half of the vocabulary, values from the upper half.
  The queries fill the rest of the sequence, so with more queries than pairs
  keys are queried again (repeated queries shorten the plateau before recall,
  Zucchet et al. 2025).

  curriculum (attn.experiments.data.curriculum): the training lengths, growing;
  a stage of length L trains on num_pairs·L // seq_len pairs (at least 1), the
  density of the held-out task, which is always seq_len long.
  """

  kind: ClassVar[str] = "decoder_lm"
  vocab_size: int = 64
  seq_len: int = 32
  num_pairs: int = 4
  curriculum: tuple = ()  # training lengths, growing, each <= seq_len (e.g. [128, 256, 512]); evaluation at seq_len
  curriculum_steps: tuple = ()  # each stage's share of the steps, summing to 1 (default: equal shares)

  def __post_init__(self):
    _check_int("vocab_size", self.vocab_size, 5)
    _check_int("num_pairs", self.num_pairs, 1)
    _check_int("seq_len", self.seq_len, 3)
    if 2 * self.num_pairs + 1 > self.seq_len:
      raise invalid("task.seq_len", self.seq_len, f"an integer >= {2 * self.num_pairs + 1}: task.num_pairs="
                    f"{self.num_pairs} pairs (two tokens each) and one query must fit")
    if (self.vocab_size - 1) // 2 < self.num_pairs:
      raise invalid("task.vocab_size", self.vocab_size,
                    f">= {2 * self.num_pairs + 1} so that num_pairs={self.num_pairs} distinct keys fit")
    lengths, fractions = curriculum.check(self.curriculum, self.curriculum_steps, self.seq_len)
    object.__setattr__(self, "curriculum", lengths)
    object.__setattr__(self, "curriculum_steps", fractions)

  def at_length(self, seq_len: int) -> MQAR:
    """This task at length seq_len with the pairs scaled to keep their density (a curriculum's stage)."""
    return MQAR(self.vocab_size, seq_len, max(1, self.num_pairs * seq_len // self.seq_len))

  chance_means: ClassVar[str] = "one of the listed values guessed"

  @property
  def num_queries(self) -> int:
    return (self.seq_len + 1 - 2 * self.num_pairs) // 2

  @property
  def chance(self) -> float:
    """Held-out accuracy of a model that knows the answer is a listed value but not which: it guesses
    one of the num_pairs listed, right when that value equals the queried one. Values are drawn with
    replacement from V = vocab_size - 1 - (vocab_size - 1) // 2 tokens, so (1 + (n - 1)/V) / n."""
    n, V = self.num_pairs, self.vocab_size - 1 - (self.vocab_size - 1) // 2
    return (1 + (n - 1) / V) / n

  def batch(self, seed: int, split: int, index: int, batch_size: int) -> dict[str, np.ndarray]:
    rng = _rng(seed, split, index)
    B, n, nq = batch_size, self.num_pairs, self.num_queries
    key_vocab = (self.vocab_size - 1) // 2
    keys_BN = rng.random((B, key_vocab)).argsort(axis=1)[:, :n] + 1
    values_BN = rng.integers(1 + key_vocab, self.vocab_size, (B, n))
    pick_BQ = rng.integers(0, n, (B, nq))
    seq = np.zeros((B, self.seq_len + 1), np.int64)
    seq[:, 0:2 * n:2], seq[:, 1:2 * n:2] = keys_BN, values_BN
    q0 = 2 * n
    seq[:, q0:q0 + 2 * nq:2] = np.take_along_axis(keys_BN, pick_BQ, axis=1)
    seq[:, q0 + 1:q0 + 2 * nq:2] = np.take_along_axis(values_BN, pick_BQ, axis=1)
    weights = np.zeros((B, self.seq_len))
    weights[:, q0:q0 + 2 * nq:2] = 1.0  # the position of a query predicts its value
    return _lm_arrays(seq, weights)


@dataclasses.dataclass(frozen=True)
class Induction:
  """A random pattern seen once at a random place in noise, then repeated at the end.

  Predicting the repeat needs an induction head (Olsson et al. 2022), which takes
  two layers: one copies each token's predecessor into it, the next finds where
  the current token was before. The gap between the copies varies from row to
  row, so no fixed positional offset solves the task.
  """

  kind: ClassVar[str] = "decoder_lm"
  min_layers: ClassVar[int] = 2
  vocab_size: int = 64
  seq_len: int = 32

  def __post_init__(self):
    _check_int("vocab_size", self.vocab_size, 3)
    _check_int("seq_len", self.seq_len, 5)

  @property
  def pattern_len(self) -> int:
    return max(2, (self.seq_len + 1) // 3)

  def batch(self, seed: int, split: int, index: int, batch_size: int) -> dict[str, np.ndarray]:
    rng = _rng(seed, split, index)
    L, m = self.seq_len + 1, self.pattern_len
    seq = rng.integers(1, self.vocab_size, (batch_size, L))
    x_BM = rng.integers(1, self.vocab_size, (batch_size, m))
    start_B = rng.integers(0, L - 2 * m + 1, batch_size)
    pos_L = np.arange(L)
    first = (pos_L >= start_B[:, None]) & (pos_L < start_B[:, None] + m)
    offset = np.clip(pos_L - start_B[:, None], 0, m - 1)
    seq = np.where(first, np.take_along_axis(x_BM, offset, axis=1), seq)
    seq[:, L - m:] = x_BM
    weights = np.zeros((batch_size, self.seq_len))
    weights[:, L - m:] = 1.0  # inside the repeat, position t predicts x[t + 1 - (L - m)]
    return _lm_arrays(seq, weights)


@dataclasses.dataclass(frozen=True)
class MarkerPosition:
  """Classify where the first marker sits: the label is the segment (of num_classes) holding it.

  Every other token is noise and later markers are distractors, so the label is
  carried by one position that only attention can single out: a [CLS] token can
  attend to it, while mean pooling averages it with every other position.
  """

  kind: ClassVar[str] = "classifier"
  vocab_size: int = 32
  seq_len: int = 32
  num_classes: int = 4
  num_markers: int = 1

  def __post_init__(self):
    _check_int("vocab_size", self.vocab_size, 3)
    _check_int("num_classes", self.num_classes, 2)
    _check_int("seq_len", self.seq_len, self.num_classes)
    _check_int("num_markers", self.num_markers, 1)
    if self.num_markers > self.seq_len:
      raise invalid("task.num_markers", self.num_markers, f"at most seq_len={self.seq_len}")

  def batch(self, seed: int, split: int, index: int, batch_size: int) -> dict[str, np.ndarray]:
    rng = _rng(seed, split, index)
    B, T = batch_size, self.seq_len
    tokens = rng.integers(2, self.vocab_size, (B, T))
    where_BM = rng.random((B, T)).argsort(axis=1)[:, :self.num_markers]
    np.put_along_axis(tokens, where_BM, 1, axis=1)  # token 1 is the marker
    return {"tokens": tokens.astype(np.int32),
            "lengths": np.full((B,), T, np.int32),
            "labels": (where_BM.min(axis=1) * self.num_classes // T).astype(np.int32)}


@dataclasses.dataclass(frozen=True)
class AfterMarker:
  """Classify the token that sits right after the one marker.

  The marker (token 1) sits once, at a random position p < T-1; the label is
  which of num_classes class tokens (2, 3, ...) sits at p+1. Every class token
  appears exactly `copies` times in every sequence, so counting tokens says
  nothing; the rest is noise. The evidence is where the marker points, and the
  two poolings differ for a structural reason in a one-layer encoder:
  - a [CLS] token's first-layer query is the same for every input, so each
    head's attention weights factor into a token term and a position term; no
    head can pick "the position after wherever the marker is". What [CLS] can
    read is the marker's position and, per class, position-weighted sums over
    that class's copies, from which its MLP can only partly decode the label
    (configs/pooling.toml measures how far);
  - with mean pooling every position has its own query: position p+1 can attend
    to its predecessor, see the marker and let its MLP write its own token into
    the pooled mean.
  With two layers [CLS] can read what the first layer wrote at p+1.
  """

  kind: ClassVar[str] = "classifier"
  vocab_size: int = 16
  seq_len: int = 32
  num_classes: int = 4
  copies: int = 2

  def __post_init__(self):
    _check_int("num_classes", self.num_classes, 2)
    _check_int("copies", self.copies, 1)
    _check_int("vocab_size", self.vocab_size, self.num_classes + 3)
    _check_int("seq_len", self.seq_len, self.num_classes * self.copies + 2)

  def batch(self, seed: int, split: int, index: int, batch_size: int) -> dict[str, np.ndarray]:
    rng = _rng(seed, split, index)
    B, T, C = batch_size, self.seq_len, self.num_classes
    tokens = rng.integers(2 + C, self.vocab_size, (B, T))  # noise
    labels = rng.integers(0, C, B)
    every_class = np.repeat(np.arange(C), self.copies)
    for i in range(B):  # the label's first copy goes right after the marker, the rest anywhere free
      rest = np.delete(every_class, labels[i] * self.copies)
      p = rng.integers(0, T - 1)
      free = np.setdiff1d(np.arange(T), [p, p + 1])
      tokens[i, p] = 1
      tokens[i, p + 1] = 2 + labels[i]
      tokens[i, rng.choice(free, rest.size, replace=False)] = 2 + rest
    return {"tokens": tokens.astype(np.int32),
            "lengths": np.full((B,), T, np.int32),
            "labels": labels.astype(np.int32)}


@dataclasses.dataclass(frozen=True)
class Text:
  """Byte-level language modelling on local text (vocabulary: the 256 byte values).

  path: a text file, a directory, or "" for the running Python's standard
  library sources; glob filters a directory ("" means `**/*`, every file, and
  `**/*.py` for the stdlib). attn.experiments.data.corpus reads, checks, caches and
  splits the text by file (about 5% of the files held out).
  Training windows of seq_len + 1 bytes start at uniform random offsets of the
  train bytes, drawn from (seed, TRAIN, index). Held-out windows depend on the
  index only, not the seed: every trial is scored on the same held-out bytes,
  so settings and seeds are compared on one sample. Every position counts, so
  eval_loss / ln 2 is held-out bits per byte.

  Packing: files are one stream, each ended by a NUL byte (corpus), and a
  window may span a file's end, as GPT-2-style packing does. bos = true puts
  token 256, [BOS] (the vocabulary becomes 257), before every window: the
  window is [BOS] and seq_len bytes from the same offsets, so the first
  position is always one fixed token, where attention sinks form (Gu et al.
  2024). [BOS] marks where the window starts, not where a file starts.
  Position 0 then predicts the window's first byte with no text before it;
  it has weight 0, so eval_loss / ln 2 is bits per byte over the seq_len - 1
  bytes that follow at least one byte of text.
  """

  kind: ClassVar[str] = "decoder_lm"
  path: str = ""
  glob: str = ""
  seq_len: int = 128
  bos: bool = False

  def __post_init__(self):
    _check_int("seq_len", self.seq_len, 2)
    if not isinstance(self.path, str):
      raise invalid("task.path", self.path, "a path to a text file or directory, or '' for the Python stdlib")
    if not isinstance(self.glob, str):
      raise invalid("task.glob", self.glob, "a glob string such as '**/*.txt' ('' for the default)")
    if not isinstance(self.bos, bool):
      raise invalid("task.bos", self.bos, "true (a [BOS] token before every window) or false")
    data = corpus_lib.load(self.path, self.glob)
    need = self.seq_len + 1
    for split, array in (("train", data.train), ("held-out", data.heldout)):
      if array.size < need:
        raise invalid("task.path", self.path or data.root,
                      f"a corpus whose {split} split holds at least seq_len+1={need} bytes (it holds "
                      f"{array.size} of {data.num_bytes}, {len(data.files)} files; about 5% of the "
                      "files are held out, a single file's last 5%)")
    object.__setattr__(self, "_corpus", data)

  @property
  def vocab_size(self) -> int:
    """The 256 byte values, and [BOS] (token 256) with bos."""
    return 257 if self.bos else 256

  @property
  def corpus(self) -> corpus_lib.Corpus:
    """The text, split into train and held-out bytes (attn.experiments.data.corpus)."""
    return self._corpus

  def batch(self, seed: int, split: int, index: int, batch_size: int) -> dict[str, np.ndarray]:
    return self.batch_rows(seed, split, index, batch_size, slice(None))

  def batch_rows(self, seed: int, split: int, index: int, batch_size: int, rows: slice) -> dict[str, np.ndarray]:
    """Rows `rows` of batch(seed, split, index, batch_size): every offset is drawn, only these windows read."""
    data = self._corpus.train if split == TRAIN else self._corpus.heldout
    rng = _rng(seed if split == TRAIN else 0, split, index)
    start_B = rng.integers(0, data.size - self.seq_len, batch_size)[rows]
    weights = np.ones((len(start_B), self.seq_len))
    if not self.bos:
      return _lm_arrays(data[start_B[:, None] + np.arange(self.seq_len + 1)], weights)
    seq = data[start_B[:, None] + np.arange(self.seq_len)].astype(np.int32)
    weights[:, 0] = 0.0  # [BOS] predicts the first byte with no text before it
    return _lm_arrays(np.concatenate([np.full((len(start_B), 1), BOS_BYTE, np.int32), seq], axis=1), weights)


TASKS: dict[str, type] = {
    "mqar": MQAR,
    "induction": Induction,
    "marker_position": MarkerPosition,
    "after_marker": AfterMarker,
    "text": Text,
    "bigram_backcopy": backcopy.BigramBackcopy,
}


def batch_rows(task, seed: int, split: int, index: int, batch_size: int,
               rows: slice | None = None) -> dict[str, np.ndarray]:
  """Rows `rows` (None: all) of task.batch(seed, split, index, batch_size): one process's share of a batch.

  A batch's rows share one generator stream, so a synthetic task draws the
  whole batch (cheap) and cuts it; a task with a `batch_rows` method (text)
  reads only the rows asked for.
  """
  if rows is None:
    return task.batch(seed, split, index, batch_size)
  if hasattr(task, "batch_rows"):
    return task.batch_rows(seed, split, index, batch_size, rows)
  return {k: v[rows] for k, v in task.batch(seed, split, index, batch_size).items()}


def task_fields(name: str) -> dict[str, Any]:
  """The TOML keys of task `name` with their defaults."""
  return {f.name: f.default for f in dataclasses.fields(TASKS[name])}


def make_task(options: dict[str, Any]):
  """The task named by options["name"], built from the remaining options."""
  options = dict(options)
  name = options.pop("name", None)
  if name not in TASKS:
    raise invalid("task.name", name, f"{did_you_mean(name, TASKS)}one of {sorted(TASKS)}")
  known = task_fields(name)
  for key in options:
    if key not in known:
      raise invalid(f"task.{key}", options[key], f"{did_you_mean(key, known)}a key of task {name!r}: {sorted(known)}")
  return TASKS[name](**options)
