"""A pretrained Hugging Face model scored on local text by the objective it was trained with.

`attn eval --hf` and `attn analyze --hf` read this module. OBJECTIVES:

  next_token      a causal LM: mean next-token cross-entropy in nats over every
                  predicted token
  masked_lm       a BertForMaskedLM: MLM_RATE of the real tokens (seed MLM_SEED)
                  replaced by [MASK] and predicted
  sentence_pairs  a BertModel without an MLM head (a sentence encoder): each
                  window cut in halves, [CLS] half [SEP] each, mean-pooled and
                  normalised as sentence-transformers does; the in-batch ranking
                  loss of each first half against the batch's second halves
                  (attn.analysis.sentence.ranking_loss), pairs shuffled with
                  PAIR_SEED; accuracy is top-1 retrieval of the own second half

The text is tokenised with the checkpoint's own tokenizer and split by
attn.experiments.data.hf_text.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from attn.config import invalid

MLM_SEED, MLM_RATE = 0, 0.15
PAIR_SEED = 0  # the order of sentence pairs, hence which pairs are one batch's negatives
OBJECTIVES = ("next_token", "masked_lm", "sentence_pairs")


def check_checkpoint(path: str) -> dict[str, Any]:
  """config.json of a supported checkpoint with its tokenizer; anything else refused before loading weights."""
  from attn.nn import hf
  from attn.experiments.data import hf_text
  config = hf.read_config(path)
  hf.model_config(config)  # the model_type and unsupported settings, by name
  hf_text.load_tokenizer(path)
  return config


def objective(model, tokenizer) -> tuple[str, dict[str, int]]:
  """(the model's objective, the special token ids it needs), a missing one refused by name.

  A causal LM: next_token; an Encoder with an MLM head: masked_lm ([MASK]);
  one without: sentence_pairs ([CLS], [SEP]).
  """
  from attn.nn.models import Encoder
  if not isinstance(model, Encoder):
    return "next_token", {}
  name, needed = ("masked_lm", ("[MASK]",)) if model.cfg.mlm_head else ("sentence_pairs", ("[CLS]", "[SEP]"))
  ids = {t: tokenizer.token_to_id(t) for t in needed}
  missing = [t for t, i in ids.items() if i is None]
  if missing:
    raise invalid("tokenizer", f"no {', '.join(missing)}", f"a BERT tokenizer with {', '.join(needed)}: "
                  f"the {name} objective needs them")
  return name, ids


def describe(name: str, data: dict[str, np.ndarray]) -> str:
  """How the objective scores, for the report line (sentence pairs: the loss of a guess, ln of the pairs
  in each pair's batch, averaged)."""
  if name == "masked_lm":
    return f"masked LM, {MLM_RATE:.0%} masked, seed {MLM_SEED}"
  if name == "sentence_pairs":
    n_b = data["weights"].sum(-1)
    chance = float((n_b * np.log(np.maximum(n_b, 1))).sum() / n_b.sum())
    return f"sentence pairs: in-batch ranking of window halves, mean-pooled, cosine × 20, chance {chance:.3f}"
  return "next token"


def max_positions(config: dict[str, Any], seq_len: int) -> int:
  """seq_len capped at the checkpoint's positions."""
  return min(seq_len, config.get("n_positions") or config.get("max_position_embeddings") or seq_len)


def pair_seq_len(config: dict[str, Any], model, seq_len: int) -> int:
  """seq_len capped so that the model's sequences fit its positions: a window, or for sentence pairs
  each half of one with its [CLS] and [SEP] (at most 2·(positions − 2) tokens a window)."""
  from attn.nn.models import Encoder
  if isinstance(model, Encoder) and not model.cfg.mlm_head:
    return min(seq_len, 2 * (max_positions(config, seq_len + 4) - 2))
  return max_positions(config, seq_len)


def mlm_batches(data: dict[str, np.ndarray], mask_id: int, seed: int = MLM_SEED,
                rate: float = MLM_RATE) -> dict[str, np.ndarray]:
  """Masked-LM batches of next-token windows: `rate` of the real tokens (weight > 0), drawn with
  `seed`, replaced by mask_id; targets the originals, weights 1 where masked; lengths per row."""
  tokens, real = data["tokens"], data["weights"] > 0
  chosen = real & (np.random.default_rng(seed).random(tokens.shape) < rate)
  return {"tokens": np.where(chosen, mask_id, tokens).astype(np.int32), "targets": tokens.astype(np.int32),
          "weights": chosen.astype(np.float32), "lengths": real.sum(-1).astype(np.int32)}


def example_losses(model, batch: dict[str, Any], name: str, gates=None, own_pair_gradient: bool = False):
  """(summed weighted nll (B,), summed weighted hits (B,), summed weights (B,)) of a batch under objective
  `name`; gates (L,H) or (B,L,H) gate heads (Michel et al.'s ξ). Traced: call inside jit."""
  import jax.numpy as jnp
  import optax
  if name == "sentence_pairs":
    from attn.analysis.sentence import mean_pool, ranking_loss
    B = batch["tokens"].shape[0]
    tokens = jnp.concatenate([batch["tokens"], batch["pair_tokens"]])
    lengths = jnp.concatenate([batch["lengths"], batch["pair_lengths"]])
    if gates is not None and jnp.ndim(gates) == 3:  # row b's gates act on both halves of pair b
      gates = jnp.concatenate([gates, gates])
    e = mean_pool(model.hidden(tokens, lengths_B=lengths, head_mask=gates).astype(jnp.float32), lengths)
    nll, hit = ranking_loss(e[:B], e[B:], batch["weights"] > 0, own_pair_gradient=own_pair_gradient)
    return nll, hit, batch["weights"]
  if name == "masked_lm":  # padding (length-0 rows too) kept out by the lengths and the weights
    logits = model.mlm_logits(model.hidden(batch["tokens"], lengths_B=batch["lengths"], head_mask=gates))
  else:
    logits = model(batch["tokens"], head_mask=gates)
  logits = logits.astype(jnp.float32)
  w = batch["weights"]
  nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
  nll = jnp.where(w > 0, nll * w, 0.0)
  hit = (jnp.argmax(logits, -1) == batch["targets"]).astype(jnp.float32) * w
  return nll.sum(-1), hit.sum(-1), w.sum(-1)


def held_out_batches(path: str, text: str, model, config: dict[str, Any], seq_len: int, batch_size: int,
                     max_tokens: int | None, glob: str | None = None, split: str = "heldout",
                     whole: bool = False, max_batches: int | None = None):
  """(objective name, batches (nb, B, ...), info) of one split of `text` for the checkpoint at `path`.

  whole: only full windows (no padding in attention statistics), at most max_batches batches.
  """
  from attn.experiments.data import hf_text
  tokenizer = hf_text.load_tokenizer(path)
  name, ids = objective(model, tokenizer)
  docs, info = hf_text.documents(text, glob, split)
  if name == "sentence_pairs":
    w = hf_text.span_pairs(hf_text.tokenize(tokenizer, docs, config["vocab_size"], special=False), seq_len,
                           ids["[CLS]"], ids["[SEP]"], max_tokens, whole=whole)
    counted = int(w["lengths"].sum() + w["pair_lengths"].sum() - 4 * len(w["weights"]))
    # Random in-batch negatives, as a sentence encoder is trained with: consecutive windows of one
    # document would make every negative a near neighbour.
    order = np.random.default_rng(PAIR_SEED).permutation(len(w["weights"]))
    w = {k: a[order] for k, a in w.items()}
  else:
    w = hf_text.windows(hf_text.tokenize(tokenizer, docs, config["vocab_size"]), seq_len, max_tokens)
    if whole:
      w = {k: a[w["weights"].all(-1)] for k, a in w.items()}
    counted = int(w["weights"].sum())
  rows = w["tokens"].shape[0]
  if whole and rows < batch_size:
    raise invalid("--text", text, f"a {split} split with at least --batch-size={batch_size} windows of "
                  f"--seq-len={seq_len} tokens (it has {rows}); lower either")
  data = hf_text.batches(w, batch_size, max_batches)
  if name == "masked_lm":
    data = mlm_batches(data, ids["[MASK]"])
    counted = int(data["weights"].sum())
  info |= {"documents": len(docs), "windows": rows, "tokens": counted, "seq_len": seq_len}
  return name, data, info


@functools.lru_cache(maxsize=None)
def _loss_fn(graphdef, name: str):
  import jax
  from flax import nnx

  @jax.jit
  def batch_loss(state, batch):
    nll, hit, _ = example_losses(nnx.merge(graphdef, state), batch, name)
    return nll.sum(), hit.sum()

  return batch_loss


def evaluate(model, data: dict[str, np.ndarray], name: str = "next_token") -> tuple[float, float]:
  """(mean loss in nats, mean accuracy) of batches (nb, B, ...) under objective `name`, weighted per
  predicted token (next_token, masked_lm) or per pair (sentence_pairs)."""
  from flax import nnx
  graphdef, state = nnx.split(model)
  fn = _loss_fn(graphdef, name)
  sums = [fn(state, {k: v[j] for k, v in data.items()}) for j in range(data["tokens"].shape[0])]
  count = float(data["weights"].sum())
  return sum(float(s[0]) for s in sums) / count, sum(float(s[1]) for s in sums) / count
