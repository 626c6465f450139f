"""A short causal convolution before the attention (ModelConfig.short_conv): BaseConv's shift, for any variant.

Each channel of the attention's input is replaced by a causal sum over its last
W positions, h'[t] = Σ_j w[j]·h[t - j] + b (depthwise, W = short_conv): the
short convolution of H3, Based and Zoology (Arora et al. 2023, 2024). With
W ≥ 2 a token's query, key and value also see the token before it, so one
attention layer can match a query against the key written just before a value,
which otherwise takes a two-layer induction circuit (Olsson et al. 2022;
Okpekpe & Orvieto 2025). Decoding keeps the last W - 1 inputs as a state in
the cache (nnx.Cache), so cached decoding equals the full pass.

ModelConfig.residual_conv W (Inkling-2's post_attention_convolution and post_mlp_convolution): each
attention's and each MLP's output y, before it joins the residual, becomes (conv(y) + y)/sqrt(W + 1), conv
depthwise causal with W taps per channel and no bias (ResidualConv; W·D parameters a sublayer); decoding
keeps its last W - 1 outputs. transformers zeroes padded positions before it; under right padding (attn's
lengths) they come after every real token, so the real tokens' outputs are the same.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from attn.config import invalid


def _check_taps(field: str, width, where: str) -> None:
  """field: None (no convolution) or an integer >= 1, the taps of the causal convolution `where`."""
  if width is not None and (isinstance(width, bool) or not isinstance(width, int) or width < 1):
    raise invalid(field, width, f"None (no convolution) or an integer >= 1: the taps of the causal convolution {where}")


def check_width(width) -> None:
  """short_conv: None (no convolution) or an integer >= 1."""
  _check_taps("short_conv", width, "before each attention layer")


def param_count(width: int | None, d_model: int) -> int:
  """Parameters of one layer's convolution: W taps and a bias per channel."""
  return 0 if width is None else (width + 1) * d_model


def causal_conv(w_WD: jax.Array, b_D: jax.Array, x_BTD: jax.Array, state_BWD: jax.Array | None = None):
  """(y, new state): y[t] = Σ_j w[j]·x[t - j] + b over x preceded by state (the last W - 1 inputs; zeros
  when None); the new state is the last W - 1 rows of [state, x]."""
  W = w_WD.shape[0]
  B, T, D = x_BTD.shape
  if state_BWD is None:
    state_BWD = jnp.zeros((B, W - 1, D), x_BTD.dtype)
  padded = jnp.concatenate([state_BWD.astype(x_BTD.dtype), x_BTD], axis=1)  # (B, W - 1 + T, D)
  y_BTD = b_D.astype(x_BTD.dtype) + sum(w_WD[j].astype(x_BTD.dtype) * padded[:, W - 1 - j:W - 1 - j + T]
                                        for j in range(W))
  return y_BTD, padded[:, T:]


class ShortConv(nnx.Module):
  """Depthwise causal convolution of width W over (B,T,D); w[0] starts at 1 (identity) plus noise."""

  def __init__(self, width: int, d_model: int, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
    check_width(width)
    self.width = width
    # The identity tap keeps the layer an attention layer at step 0; the other taps start small but
    # not at zero (PyTorch Conv1d's bound 1/sqrt(W)), so the gradient reaches them from the first step.
    noise = jax.random.uniform(rngs.params(), (width, d_model), param_dtype, -1.0, 1.0) / width ** 0.5
    self.w = nnx.Param(noise.at[0].add(1.0))
    self.b = nnx.Param(jnp.zeros((d_model,), param_dtype))
    self.state: nnx.Cache | None = nnx.data(None)  # the last W - 1 inputs, set by init_cache

  def init_cache(self, batch_size: int, dtype=jnp.float32) -> None:
    """An empty state (zeros: the positions before the first token) for decode=True."""
    self.state = nnx.Cache(jnp.zeros((batch_size, self.width - 1, self.w.shape[1]), dtype))

  def __call__(self, x_BTD: jax.Array, decode: bool = False) -> jax.Array:
    if not decode:
      return causal_conv(self.w[...], self.b[...], x_BTD)[0]
    if self.state is None:
      raise invalid("decode", True, "decode=False, or call init_cache(batch_size, max_len) first "
                    "(short_conv keeps a state)")
    y_BTD, state = causal_conv(self.w[...], self.b[...], x_BTD, self.state[...])
    self.state[...] = state.astype(self.state.dtype)
    return y_BTD


# Inkling-2's convolutions on the residual (ModelConfig.residual_conv): after every attention and every MLP.

def check_residual_width(width) -> None:
  """residual_conv: None (none) or an integer >= 1."""
  _check_taps("residual_conv", width, "on each attention's and MLP's output (Inkling-2's conv_kernel_size)")


def residual_param_count(width: int | None, d_model: int) -> int:
  """Parameters of one sublayer's output convolution: W taps per channel, no bias."""
  return 0 if width is None else width * d_model


def residual_conv(w_WD: jax.Array, y_BTD: jax.Array, state_BWD: jax.Array | None = None):
  """(out, new state): out[t] = (Σ_j w[j]·y[t − (W − 1) + j] + y[t]) / sqrt(W + 1) over y preceded by state (its
  last W − 1 rows; zeros when None), torch Conv1d's tap order (w[W − 1] the current token), in float32,
  returned in y's dtype (Inkling2ShortConvolution: its residual and scale inside)."""
  W = w_WD.shape[0]
  B, T, D = y_BTD.shape
  if state_BWD is None:
    state_BWD = jnp.zeros((B, W - 1, D), jnp.float32)
  padded = jnp.concatenate([state_BWD.astype(jnp.float32), y_BTD.astype(jnp.float32)], axis=1)
  w = w_WD.astype(jnp.float32)
  conv = sum(w[j] * padded[:, j:j + T] for j in range(W))
  out = (conv + padded[:, W - 1:]) / jnp.sqrt(jnp.float32(W + 1))
  return out.astype(y_BTD.dtype), padded[:, T:]


class ResidualConv(nnx.Module):
  """Inkling-2's short convolution on a sublayer's output, (conv(y) + y)/sqrt(W + 1): taps (W, D), torch
  Conv1d's order, no bias, stored in float32 (transformers keeps them so); the last W − 1 outputs its state."""

  def __init__(self, width: int, d_model: int, *, rngs: nnx.Rngs):
    check_residual_width(width)
    self.width = width
    bound = 1.0 / width ** 0.5  # torch Conv1d's default, depthwise: fan-in W
    self.w = nnx.Param(jax.random.uniform(rngs.params(), (width, d_model), jnp.float32, -bound, bound))
    self.state: nnx.Cache | None = nnx.data(None)  # the last W - 1 outputs, set by init_cache

  def init_cache(self, batch_size: int, dtype=jnp.float32) -> None:
    """An empty state (zeros: the positions before the first token) for decode=True."""
    del dtype  # held in float32, as the convolution computes
    self.state = nnx.Cache(jnp.zeros((batch_size, self.width - 1, self.w.shape[1]), jnp.float32))

  def __call__(self, y_BTD: jax.Array, decode: bool = False) -> jax.Array:
    if not decode:
      return residual_conv(self.w[...], y_BTD)[0]
    if self.state is None:
      raise invalid("decode", True, "decode=False, or call init_cache(batch_size, max_len) first "
                    "(residual_conv keeps a state)")
    out_BTD, state = residual_conv(self.w[...], y_BTD, self.state[...])
    self.state[...] = state
    return out_BTD
