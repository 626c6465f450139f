"""A sentence encoder's view of its heads: pooled embeddings, rankings of pairs, where attention lands.

  mean_pool       sentence-transformers' pooling: the mean of the hidden states
                  over each sentence's real tokens (the first lengths_B[b]
                  positions), then L2-normalised, so a dot product is a cosine
  cosine          row-wise cosine similarity of two (N,D) arrays
  spearman        Spearman's rank correlation, ties given their average rank
  roc_auc         P(a positive pair scores above a negative one), ties counted
                  half (the Mann–Whitney U over n_pos·n_neg)
  key_mass        per head, the attention weight on a chosen set of keys per
                  example (BERT's [CLS] at s = 0, its [SEP] at s = length − 1),
                  averaged over the counted query rows as attention_stats does
  slice_share     per head, the share of ‖W_h‖²_F in the rows of head h's own
                  D/H slice of the input: 1 if the input were split across heads
                  (seed question 3's split_input), 1/H for weights spread evenly
  ranking_loss    the in-batch contrastive loss of (anchor, positive) embedding
                  pairs that sentence encoders are trained with (sentence-
                  transformers' MultipleNegativesRankingLoss): the loss of a
                  BERT without an MLM head in `attn eval` and `attn analyze --hf`
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from attn.config import invalid

Array = jax.Array
NORM_EPS = 1e-12  # torch.nn.functional.normalize's eps, as sentence-transformers' Normalize uses it
RANKING_SCALE = 20.0  # sentence-transformers' MultipleNegativesRankingLoss default: cosines times 20


def mean_pool(h_BTD, lengths_B) -> Array:
  """(B,D) unit vectors: the mean of h over positions t < lengths_B[b], L2-normalised."""
  h_BTD = jnp.asarray(h_BTD)
  if h_BTD.ndim != 3:
    raise invalid("h.shape", tuple(h_BTD.shape), "(B, T, D) hidden states")
  lengths_B = jnp.asarray(lengths_B)
  if lengths_B.shape != h_BTD.shape[:1]:
    raise invalid("lengths.shape", tuple(lengths_B.shape), f"({h_BTD.shape[0]},): one length per row")
  real_BT = (jnp.arange(h_BTD.shape[1])[None] < lengths_B[:, None]).astype(h_BTD.dtype)
  sum_BD = jnp.einsum("BTD,BT->BD", h_BTD, real_BT)
  mean_BD = sum_BD / jnp.maximum(real_BT.sum(1), 1e-9)[:, None]
  norm_B = jnp.linalg.norm(mean_BD, axis=-1, keepdims=True)
  return mean_BD / jnp.maximum(norm_B, NORM_EPS)


def cosine(a_ND, b_ND) -> np.ndarray:
  """(N,) cosine similarity of the rows of a and b (float64)."""
  a, b = np.asarray(a_ND, np.float64), np.asarray(b_ND, np.float64)
  if a.shape != b.shape or a.ndim != 2:
    raise invalid("b.shape", b.shape, f"a.shape={a.shape}, both (N, D)")
  norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
  return (a * b).sum(1) / np.maximum(norms, 1e-30)


def _ranks(x: np.ndarray) -> np.ndarray:
  """1-based ranks, tied values sharing their average rank."""
  order = np.argsort(x, kind="stable")
  sorted_x = x[order]
  starts = np.r_[0, np.flatnonzero(np.diff(sorted_x)) + 1]
  ends = np.r_[starts[1:], x.size]
  ranks = np.empty(x.size, np.float64)
  for s, e in zip(starts, ends):
    ranks[order[s:e]] = 0.5 * (s + e - 1) + 1.0
  return ranks


def spearman(a, b) -> float:
  """Spearman's rank correlation of two equal-length vectors (average ranks for ties)."""
  a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
  if a.size != b.size or a.size < 2:
    raise invalid("b.size", b.size, f"a.size={a.size}, at least 2")
  ra, rb = _ranks(a), _ranks(b)
  ra, rb = ra - ra.mean(), rb - rb.mean()
  denominator = np.sqrt((ra ** 2).sum() * (rb ** 2).sum())
  return float((ra * rb).sum() / denominator) if denominator > 0 else float("nan")


def roc_auc(positive, negative) -> float:
  """P(score of a random positive > a random negative) + ½ P(equal): 1 when every positive ranks first."""
  pos, neg = np.asarray(positive, np.float64).ravel(), np.asarray(negative, np.float64).ravel()
  if pos.size == 0 or neg.size == 0:
    raise invalid("positive, negative", (pos.size, neg.size), "at least one score each")
  ranks = _ranks(np.concatenate([pos, neg]))
  u = ranks[:pos.size].sum() - pos.size * (pos.size + 1) / 2
  return float(u / (pos.size * neg.size))


def key_mass(w_BHTS, keys_BS, rows_BT) -> Array:
  """(H,) mean over counted query rows of Σ_s w[b,h,t,s]·keys[b,s]: the attention on the chosen keys.

  keys_BS: bool, the chosen keys of each example; rows_BT: bool, the query rows
  that count (real tokens; a row of padding is left out).
  """
  w_BHTS = jnp.asarray(w_BHTS)
  if w_BHTS.ndim != 4:
    raise invalid("weights.shape", tuple(w_BHTS.shape), "(B, H, T, S) attention weights")
  B, _, T, S = w_BHTS.shape
  keys_BS, rows_BT = jnp.asarray(keys_BS), jnp.asarray(rows_BT)
  if keys_BS.shape != (B, S) or rows_BT.shape != (B, T):
    raise invalid("keys.shape, rows.shape", (tuple(keys_BS.shape), tuple(rows_BT.shape)),
                  f"(B, S)=({B}, {S}) and (B, T)=({B}, {T})")
  mass_BHT = jnp.einsum("BHTS,BS->BHT", w_BHTS, keys_BS.astype(w_BHTS.dtype))
  rows_B1T = rows_BT[:, None, :]
  return (jnp.where(rows_B1T, mass_BHT, 0.0).sum((0, 2))
          / jnp.maximum(rows_B1T.sum((0, 2)), 1))


def slice_share(w_DHK) -> np.ndarray:
  """(H,) ‖w[rows of slice h, h]‖²_F / ‖w[:, h]‖²_F for w (D,H,K): 1 for split inputs, ~1/H if spread."""
  w = np.asarray(w_DHK, np.float64)
  if w.ndim != 3 or w.shape[0] % w.shape[1]:
    raise invalid("w.shape", w.shape, "(D, H, K) with H dividing D")
  D, H, _ = w.shape
  slices = w.reshape(H, D // H, H, -1)  # [slice, row in slice, head, K]: rows in H slices of D/H
  own_H = np.stack([(slices[h, :, h] ** 2).sum() for h in range(H)])
  total_H = (w ** 2).sum(axis=(0, 2))
  return own_H / np.maximum(total_H, 1e-30)


def ranking_loss(a_BD, p_BD, valid_B, scale: float = RANKING_SCALE, own_pair_gradient: bool = False):
  """(nll (B,), hit (B,)): anchor b's cross-entropy over the batch's positives, and whether it ranks its own first.

  a and p are unit embeddings (mean_pool), so a_b·p_j is a cosine; the logits
  are scale·a_b·p_j over the valid positives j (invalid rows, batch padding,
  are neither scored nor offered as negatives) and the target is j = b, as
  MultipleNegativesRankingLoss computes it. ln(number of valid rows) is chance.
  hit: anchor b's own positive scores highest (top-1 in-batch retrieval).

  own_pair_gradient: the other rows' positives enter as constants
  (stop_gradient), so d nll_b depends on row b's own pair alone; the values are
  unchanged. With per-row head gates that makes the gradient of Σ_b nll_b
  example b's own ∂nll_b/∂ξ_b (Michel et al.'s per-example score) instead of
  row b's effect on every row's loss.
  """
  a_BD, p_BD, valid_B = jnp.asarray(a_BD), jnp.asarray(p_BD), jnp.asarray(valid_B, bool)
  if a_BD.ndim != 2 or a_BD.shape != p_BD.shape or valid_B.shape != a_BD.shape[:1]:
    raise invalid("anchors, positives, valid shapes", (a_BD.shape, p_BD.shape, valid_B.shape),
                  "(B, D), (B, D) and (B,)")
  a = a_BD.astype(jnp.float32)
  p = p_BD.astype(jnp.float32)
  others = jax.lax.stop_gradient(p) if own_pair_gradient else p
  eye_BB = jnp.eye(a.shape[0], dtype=bool)
  sim_BB = jnp.where(eye_BB, jnp.sum(a * p, -1)[:, None], a @ others.T)  # diagonal: the own pair, live
  # An invalid row keeps its own column, so its (discarded) loss stays finite and its gradient zero.
  logits_BB = jnp.where(valid_B[None, :] | eye_BB, scale * sim_BB, -jnp.inf)
  target_B = jnp.arange(a.shape[0])
  nll_B = -jax.nn.log_softmax(logits_BB, axis=-1)[target_B, target_B]
  hit_B = (jnp.argmax(logits_BB, axis=-1) == target_B).astype(jnp.float32)
  valid = valid_B.astype(jnp.float32)
  return jnp.where(valid_B, nll_B, 0.0), hit_B * valid
