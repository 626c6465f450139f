"""Incremental decoding for DecoderLM: KV caches, decode=True steps and generate.

Flax NNX's convention (flax.nnx.MultiHeadAttention): `init_cache` puts
nnx.Cache variables in every attention layer, then `model(tokens_BT,
decode=True)` appends one or more tokens at a time and returns their logits,
equal to the full forward pass's at those positions. What a layer caches per
token is its variant's kv_cache_width (attn.variants.cache). Every refusal
here happens before any tracing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from attn.config import invalid

if TYPE_CHECKING:
  from attn.nn.models import DecoderLM

Array = jax.Array


def _check_int(name: str, value, minimum: int) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
    raise invalid(name, value, f"an integer >= {minimum}")
  return int(value)


def init_cache(model: DecoderLM, batch_size: int, max_len: int, dtype=jnp.float32) -> None:
  """Empty KV caches of max_len tokens in every layer; max_len at most the model's max_len."""
  _check_int("batch_size", batch_size, 1)
  _check_int("max_len", max_len, 1)
  if max_len > model.cfg.max_len:
    raise invalid("max_len", max_len, f"at most the model's max_len={model.cfg.max_len}")
  for block in model.blocks:
    block.attn.init_cache(batch_size, max_len, dtype)


def cache_state(model: DecoderLM) -> tuple[Array, int, int]:
  """(cache_index, batch size, max_len) of the model's caches; refuses a model without them."""
  attn0 = model.blocks[0].attn
  if getattr(attn0, "cache", None) is None:
    raise invalid("decode", True, "decode=False, or call init_cache(batch_size, max_len) first")
  B, M = next(iter(attn0.cache.values()))[...].shape[:2]
  return attn0.cache_index[...], B, M


def decode(model: DecoderLM, tokens_BT: Array, head_mask, return_weights: bool,
           lengths_B) -> Array:
  """Logits (B,T,vocab) of tokens_BT placed after the cached tokens; the caches grow by T."""
  from attn.nn import models  # models imports this module
  if return_weights:
    raise invalid("return_weights", True, "False with decode=True")
  if lengths_B is not None:
    raise invalid("lengths", "given", "None with decode=True: decoding is causal against the "
                  "cache's fill")
  models.check_ids("tokens", tokens_BT, model.cfg.vocab_size)
  index, B, M = cache_state(model)
  T = tokens_BT.shape[1]
  if tokens_BT.shape[0] != B:
    raise invalid("tokens.shape[0]", tokens_BT.shape[0], f"the cache's batch size {B}")
  if not isinstance(index, jax.core.Tracer) and int(index) + T > M:
    raise invalid("tokens.shape[1]", T, f"at most max_len - cache_index = {M} - {int(index)} = "
                  f"{M - int(index)}: positions beyond the cache")
  gates = models.layer_gates(head_mask, B, len(model.blocks), model.cfg.num_heads)
  h_BTD = model.embed(tokens_BT, offset=index)
  h_BTD, _ = models.run_blocks(model.blocks, h_BTD, gates, False, decode=True)
  return model.head(models._norm(model.final_norm, h_BTD))


@nnx.jit
def _step(model: DecoderLM, tokens_BT: Array) -> Array:
  return model(tokens_BT, decode=True)


def generate(model: DecoderLM, prompt_BT: Array, steps: int, *, temperature: float = 0.0,
             key: Array | None = None) -> Array:
  """(B, T + steps): the prompt then steps tokens, argmax (temperature 0) or sampled."""
  from attn.nn import models
  models.check_ids("prompt", prompt_BT, model.cfg.vocab_size)
  _check_int("steps", steps, 0)
  B, T = prompt_BT.shape
  if T < 1:
    raise invalid("prompt.shape[1]", T, "at least 1 token")
  if T > model.cfg.max_len:
    raise invalid("prompt.shape[1]", T, f"at most max_len={model.cfg.max_len}")
  if T + steps > model.cfg.max_len:
    raise invalid("steps", steps, f"at most max_len - prompt length = {model.cfg.max_len - T}")
  if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
      or not temperature >= 0:
    raise invalid("temperature", temperature, "a number >= 0 (0: argmax)")
  if temperature > 0 and key is None:
    raise invalid("key", None, "a jax.random key when temperature > 0")
  tokens = [jnp.asarray(prompt_BT)]
  if steps == 0:
    return tokens[0]
  init_cache(model, B, T + steps)
  logits_BTN = _step(model, tokens[0])
  for i in range(steps):
    last_BN = logits_BTN[:, -1].astype(jnp.float32)
    if temperature == 0:
      next_B = jnp.argmax(last_BN, axis=-1)
    else:
      next_B = jax.random.categorical(jax.random.fold_in(key, i), last_BN / temperature)
    tokens.append(next_B[:, None].astype(tokens[0].dtype))
    if i + 1 < steps:
      logits_BTN = _step(model, tokens[-1])
  return jnp.concatenate(tokens, axis=1)
