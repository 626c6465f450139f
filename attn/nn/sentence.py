"""An attn Encoder as a sentence encoder: sentence-transformers' mean pooling, head gates, swapped heads.

SentenceEncoder(model) embeds right-padded batches (tokens (B,T), lengths (B,),
index (B,) into the caller's list, as attn.experiments.data.sentences.batches
makes them) to unit vectors: the final hidden states averaged over each
sentence's real tokens, then L2-normalised (attn.analysis.sentence.mean_pool),
which is what sentence-transformers' Pooling(mean) + Normalize compute on a
BERT. Two things vary without recompiling: head gates ξ (L,H) (Michel et al.
2019: ξ_lh = 0 removes head h of layer l), and the attention parameters of any
layers (with_attention: the same per_head shapes, e.g. a layer converted to
fewer kv heads or to a latent and back, attn.convert), since the jitted
function takes the parameters as an argument.
"""

from __future__ import annotations

from typing import Any, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from attn.analysis.importance import gate_gradients
from attn.analysis.sentence import mean_pool
from attn.config import invalid
from attn.variants.base import Params

Array = jax.Array


class SentenceEncoder:
  """Embeddings, attention weights and gate gradients of an attn Encoder's mean-pooled sentences."""

  def __init__(self, model: nnx.Module):
    if not hasattr(model, "hidden") or not hasattr(model, "blocks"):
      raise invalid("model", type(model).__name__, "an attn.nn.Encoder")
    self.cfg = model.cfg
    self.graphdef, state = nnx.split(model)
    self.params = nnx.to_pure_dict(state)
    self._template = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
    self.L, self.H = len(model.blocks), model.cfg.num_heads

    def merged(params):
      state = jax.tree.map(lambda a: a, self._template)
      nnx.replace_by_pure_dict(state, params)
      return nnx.merge(self.graphdef, state)

    def embed(params, tokens_BT, lengths_B, gates_LH):
      h_BTD = merged(params).hidden(tokens_BT, lengths_B=lengths_B, head_mask=gates_LH)
      return mean_pool(h_BTD, lengths_B)

    def hidden(params, tokens_BT, lengths_B):
      return merged(params).hidden(tokens_BT, lengths_B=lengths_B)

    def weights(params, tokens_BT, lengths_B):
      return merged(params).hidden(tokens_BT, lengths_B=lengths_B, return_weights=True)[1]

    def cosine_grads(params, tokens_BT, lengths_B, base_BD):
      def example_loss(g_BLH):  # 1 − cos(e(ξ), e(1)): each example's drop in similarity
        e_BD = mean_pool(merged(params).hidden(tokens_BT, lengths_B=lengths_B, head_mask=g_BLH), lengths_B)
        return 1.0 - jnp.sum(e_BD * base_BD, axis=-1)
      return gate_gradients(example_loss, jnp.ones((tokens_BT.shape[0], self.L, self.H), jnp.float32))

    self._embed, self._hidden = jax.jit(embed), jax.jit(hidden)
    self._weights, self._cosine_grads = jax.jit(weights), jax.jit(cosine_grads)

  def attention(self, layer: int) -> Params:
    """Layer `layer`'s attention parameters (per_head canonical layout for a per_head model)."""
    return dict(self.params["blocks"][layer]["attn"]["params"])

  def with_attention(self, layers: dict[int, Params]) -> dict[str, Any]:
    """The model's parameters with the attention of the given layers replaced (same shapes)."""
    blocks = dict(self.params["blocks"])
    for l, p in layers.items():
      old = blocks[l]["attn"]["params"]
      if set(p) != set(old) or any(tuple(np.shape(p[k])) != tuple(np.shape(old[k])) for k in old):
        raise invalid(f"layers[{l}]", {k: tuple(np.shape(a)) for k, a in p.items()},
                      f"the shapes of the model's own: { {k: tuple(a.shape) for k, a in old.items()} }")
      blocks[l] = {**blocks[l], "attn": {**blocks[l]["attn"], "params": dict(p)}}
    return {**self.params, "blocks": blocks}

  def embed(self, batches: Iterable[dict[str, np.ndarray]], gates_LH=None,
            params: dict[str, Any] | None = None) -> np.ndarray:
    """(N,D) unit embeddings, row i for sentence i of the batches' index (NaN rows if none holds it)."""
    gates_LH = jnp.ones((self.L, self.H), jnp.float32) if gates_LH is None else jnp.asarray(gates_LH, jnp.float32)
    params = self.params if params is None else params
    return self._gather(batches, lambda b: self._embed(params, b["tokens"], b["lengths"], gates_LH))

  def hidden(self, batch: dict[str, np.ndarray]) -> np.ndarray:
    """(B,T,D) final hidden states of one batch, in the batch's row order."""
    return np.asarray(self._hidden(self.params, batch["tokens"], batch["lengths"]))

  def weights(self, batch: dict[str, np.ndarray]) -> list[Array]:
    """[(B,H,T,S) self-attention weights of each layer] for one batch, in its row order."""
    return self._weights(self.params, batch["tokens"], batch["lengths"])

  def cosine_gate_gradients(self, batches: Iterable[dict[str, np.ndarray]], base_ND) -> np.ndarray:
    """(N,L,H) ∂(1 − cos(e(ξ), base))/∂ξ at ξ = 1, per example: Michel et al.'s score on this loss."""
    base_ND = np.asarray(base_ND)
    return self._gather(batches, lambda b: self._cosine_grads(self.params, b["tokens"], b["lengths"],
                                                              base_ND[b["index"]]))

  @staticmethod
  def _gather(batches, fn) -> np.ndarray:
    parts, index = [], []
    for b in batches:
      parts.append(np.asarray(fn(b)))
      index.append(np.asarray(b["index"]))
    index = np.concatenate(index)
    out = np.full((index.max() + 1,) + parts[0].shape[1:], np.nan, parts[0].dtype)
    out[index] = np.concatenate(parts)  # rows no batch holds stay NaN
    return out
