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

import functools

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
    if block.attn is not None:  # an MLP-only block (ModelConfig.block_kinds) keeps nothing
      block.attn.init_cache(batch_size, max_len, dtype)
    if getattr(block, "conv", None) is not None:  # short_conv's state: the last inputs (attn.nn.short_conv)
      block.conv.init_cache(batch_size, dtype)
    for conv in (getattr(block, "attn_out_conv", None), getattr(block, "mlp_out_conv", None)):
      if conv is not None:  # residual_conv's state: each sublayer's last outputs (attn.nn.short_conv)
        conv.init_cache(batch_size, dtype)


def cache_state(model: nnx.Module) -> tuple[Array, int, int]:
  """(cache_index, batch size, max_len) of the model's caches; refuses a model without them."""
  attn0 = next(b.attn for b in model.blocks if b.attn is not None)
  if getattr(attn0, "cache", None) is None:
    raise invalid("decode", True, "decode=False, or call init_cache(batch_size, max_len) first")
  B = next(iter(attn0.cache.values()))[...].shape[0]
  return attn0.cache_index[...], B, attn0.cache_max_len


@nnx.jit
def _step(model: nnx.Module, tokens_BT: Array) -> Array:
  return model(tokens_BT, decode=True)


def generate(model: nnx.Module, prompt_BT: Array, steps: int, *, temperature: float = 0.0,
             key: Array | None = None) -> Array:
  """(B, T + steps): the prompt then steps tokens, argmax (temperature 0) or sampled.

  One compiled program: the prompt's prefill, then the token loop under lax.fori_loop with the
  caches carried on the device; nothing returns to the host until the tokens do (no per-token
  dispatch or transfer). Compiled once per (model, prompt shape, steps, greedy or sampled).
  """
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
  prompt_BT = jax.device_put(prompt_BT)  # explicit: the one transfer in
  if steps == 0:
    return prompt_BT
  init_cache(model, B, T + steps)
  sample = temperature > 0
  temperature_ = jax.device_put(np.float32(temperature if sample else 1.0))
  key_ = key if sample else jax.device_put(np.zeros(2, np.uint32))  # unused when greedy
  return _generate(model, prompt_BT, temperature_, key_, steps=steps, sample=sample)


@functools.partial(nnx.jit, static_argnames=("steps", "sample"))
def _generate(model: nnx.Module, prompt_BT: Array, temperature: Array, key: Array, *, steps: int,
              sample: bool) -> Array:
  """The prompt's prefill and the token loop, one program; the model's caches are updated in place."""
  def pick(last_BN: Array, i: Array) -> Array:
    last_BN = last_BN.astype(jnp.float32)
    if not sample:
      return jnp.argmax(last_BN, axis=-1).astype(prompt_BT.dtype)
    return jax.random.categorical(jax.random.fold_in(key, i), last_BN / temperature).astype(prompt_BT.dtype)

  last_BN = model(prompt_BT, decode=True)[:, -1]
  graphdef, state = nnx.split(model)

  def token(i, carry):  # token i from the last logits, then the logits after it (the caches grow by one)
    state, last_BN, new_BS = carry
    next_B = pick(last_BN, i)
    m = nnx.merge(graphdef, state)
    last_BN = m(next_B[:, None], decode=True)[:, -1]
    return nnx.state(m), last_BN, new_BS.at[:, i].set(next_B)

  new_BS = jnp.zeros((prompt_BT.shape[0], steps), prompt_BT.dtype)
  state, last_BN, new_BS = jax.lax.fori_loop(0, steps - 1, token, (state, last_BN, new_BS))
  nnx.update(model, state)
  new_BS = new_BS.at[:, steps - 1].set(pick(last_BN, steps - 1))
  return jnp.concatenate([prompt_BT, new_BS], axis=1)
