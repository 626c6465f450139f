"""Incremental decoding for DecoderLM: KV caches and generate.

Flax NNX's convention (flax.nnx.MultiHeadAttention): `init_cache` puts
nnx.Cache variables in every attention layer, then `model(tokens_BT,
decode=True)` (DecoderLM._decode) appends one or more tokens at a time and
returns their logits, equal to the full forward pass's at those positions.
What a layer caches per token is its variant's kv_cache_width
(attn.variants.cache). Every refusal here happens before any tracing.

attn.nn.models imports this module, never the reverse: the model is read
through its attributes (cfg, blocks) and called.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from attn.config import check_ids, invalid

Array = jax.Array


def _check_int(name: str, value, minimum: int) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
    raise invalid(name, value, f"an integer >= {minimum}")
  return int(value)


def init_cache(model: nnx.Module, batch_size: int, max_len: int, dtype=jnp.float32) -> None:
  """Empty KV caches of max_len tokens in every layer; max_len at most the model's max_len."""
  _check_int("batch_size", batch_size, 1)
  _check_int("max_len", max_len, 1)
  if max_len > model.cfg.max_len:
    raise invalid("max_len", max_len, f"at most the model's max_len={model.cfg.max_len}")
  for block in model.blocks:
    block.attn.init_cache(batch_size, max_len, dtype)


def cache_state(model: nnx.Module) -> tuple[Array, int, int]:
  """(cache_index, batch size, max_len) of the model's caches; refuses a model without them."""
  attn0 = model.blocks[0].attn
  if getattr(attn0, "cache", None) is None:
    raise invalid("decode", True, "decode=False, or call init_cache(batch_size, max_len) first")
  B = next(iter(attn0.cache.values()))[...].shape[0]
  return attn0.cache_index[...], B, attn0.cache_max_len


@nnx.jit
def _step(model: nnx.Module, tokens_BT: Array) -> Array:
  return model(tokens_BT, decode=True)


def generate(model: nnx.Module, prompt_BT: Array, steps: int, *, temperature: float = 0.0,
             key: Array | None = None) -> Array:
  """(B, T + steps): the prompt then steps tokens, argmax (temperature 0) or sampled."""
  check_ids("prompt", prompt_BT, model.cfg.vocab_size)
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
