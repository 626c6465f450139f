"""Hyper-connections (DeepSeek-V4's manifold-constrained mHC): n = ModelConfig.hc_mult residual
streams in place of one.

The residual is (B,T,n,D). Around each sublayer f (attention, MLP), one HyperConnection reads
all n streams (flattened, RMS-normalised without a scale, in float32) through one learned map
to (2 + n)·n numbers per token: pre (n), post (n) and comb (n×n), each times its own learned
scale plus a learned base:

  pre  = σ(·) + ε            the sublayer's input is Σ_i pre_i·x_i
  post = 2·σ(·)              its output y goes to stream i as post_i·y
  comb = Sinkhorn(softmax_rows(·) + ε)   x'_k = post_k·y + Σ_j comb_jk·x_j

Sinkhorn-Knopp (hc_sinkhorn_iters passes, the first a column pass, then row and column)
makes comb doubly stochastic, so the residual mix is non-expansive. The embedding enters
every stream; a HyperHead (σ weights, no comb) collapses the n streams before the final
norm. With hc_mult = 1 none of this exists: the model is the plain residual, bit for bit.
Pre-norm only (V4's layout): the sublayer's norm acts on the collapsed input.

Parameters per HyperConnection: (2 + n)·n·(n·D + 1) + 3; the head n·(n·D + 1) + 1.

ModelConfig.hc_form "independent" (HY-V4's iHC): no comb and no Sinkhorn; 2n numbers per token,
pre = σ(·) + ε, post = hc_magnitude·σ(·) + ε, and the streams are added back unmixed:
x'_k = post_k·y + x_k. Parameters per HyperConnection 2n·(n·D + 1) + 2; the same head.
(hc_magnitude is the post gates' scale in both forms: DeepSeek-V4's is 2.)

ModelConfig.hc_head "mean" (GLM-5.3-Flash's Glm5NextTextHyperHead): the final collapse is the
unweighted mean of the n streams, (1/n)·Σ_i x_i, with no parameters (MeanHead); "learned" (the
default) is the HyperHead above.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

Array = jax.Array


def _unit_rms(x, eps: float):
  x = x.astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


def sinkhorn(comb_BTnn: Array, iters: int, eps: float) -> Array:
  """V4's projection: a column pass, then iters − 1 row-and-column passes."""
  comb = comb_BTnn / (comb_BTnn.sum(-2, keepdims=True) + eps)
  for _ in range(iters - 1):
    comb = comb / (comb.sum(-1, keepdims=True) + eps)
    comb = comb / (comb.sum(-2, keepdims=True) + eps)
  return comb


class HyperConnection(nnx.Module):
  """The mixing weights around one sublayer (module docstring)."""

  def __init__(self, n: int, d_model: int, *, iters: int, eps: float, norm_eps: float,
               rngs: nnx.Rngs, std: float = 0.02, form: str = "mhc", magnitude: float = 2.0):
    self.n, self.iters, self.eps, self.norm_eps = n, iters, eps, norm_eps
    self.form, self.magnitude = form, magnitude
    width = (2 + n) * n if form == "mhc" else 2 * n
    self.fn = nnx.Param(std * jax.random.normal(rngs.params(), (width, n * d_model), jnp.float32))
    self.base = nnx.Param(jnp.zeros((width,), jnp.float32))
    self.scale = nnx.Param(jnp.ones((3 if form == "mhc" else 2,), jnp.float32))

  def weights(self, x_BTnD: Array):
    """(pre (B,T,n), post (B,T,n), comb (B,T,n,n)) in float32."""
    n = self.n
    flat = _unit_rms(x_BTnD.reshape(*x_BTnD.shape[:2], -1), self.norm_eps)
    mix = flat @ self.fn[...].T
    base, scale = self.base[...], self.scale[...]
    pre = jax.nn.sigmoid(mix[..., :n] * scale[0] + base[:n]) + self.eps
    post = self.magnitude * jax.nn.sigmoid(mix[..., n:2 * n] * scale[1] + base[n:2 * n])
    if self.form == "independent":
      return pre, post + self.eps, None
    comb = mix[..., 2 * n:] * scale[2] + base[2 * n:]
    comb = jax.nn.softmax(comb.reshape(*comb.shape[:-1], n, n), axis=-1) + self.eps
    return pre, post, sinkhorn(comb, self.iters, self.eps)

  def __call__(self, f, x_BTnD: Array) -> Array:
    """The streams after sublayer f (on the collapsed input): post·f(Σ pre·x) + combᵀ·x."""
    pre, post, comb = self.weights(x_BTnD)
    dtype = x_BTnD.dtype
    collapsed = jnp.einsum("BTn,BTnD->BTD", pre, x_BTnD.astype(jnp.float32)).astype(dtype)
    y_BTD = f(collapsed)
    mixed = x_BTnD if comb is None else jnp.einsum("BTjk,BTjD->BTkD", comb.astype(dtype), x_BTnD)
    return post.astype(dtype)[..., None] * y_BTD[:, :, None, :] + mixed


class HyperHead(nnx.Module):
  """The final collapse of the n streams to one: Σ_i (σ(·)_i + ε)·x_i."""

  def __init__(self, n: int, d_model: int, *, eps: float, norm_eps: float, rngs: nnx.Rngs,
               std: float = 0.02):
    self.eps, self.norm_eps = eps, norm_eps
    self.fn = nnx.Param(std * jax.random.normal(rngs.params(), (n, n * d_model), jnp.float32))
    self.base = nnx.Param(jnp.zeros((n,), jnp.float32))
    self.scale = nnx.Param(jnp.ones((1,), jnp.float32))

  def __call__(self, x_BTnD: Array) -> Array:
    flat = _unit_rms(x_BTnD.reshape(*x_BTnD.shape[:2], -1), self.norm_eps)
    pre = jax.nn.sigmoid(flat @ self.fn[...].T * self.scale[...] + self.base[...]) + self.eps
    return jnp.einsum("BTn,BTnD->BTD", pre, x_BTnD.astype(jnp.float32)).astype(x_BTnD.dtype)


class MeanHead(nnx.Module):
  """The final collapse of the n streams to one, unweighted: (1/n)·Σ_i x_i (GLM-5.3-Flash's)."""

  def __call__(self, x_BTnD: Array) -> Array:
    return jnp.mean(x_BTnD, axis=2)


def head(cfg, rngs: nnx.Rngs):
  """The model's final collapse (ModelConfig.hc_head), None with one stream."""
  if cfg.hc_mult == 1:
    return None
  if cfg.hc_head == "mean":
    return MeanHead()
  return HyperHead(cfg.hc_mult, cfg.d_model, eps=cfg.hc_eps, norm_eps=cfg.norm_eps, rngs=rngs)


def expand(h_BTD: Array, n: int) -> Array:
  """The embedding in every one of n streams: (B,T,n,D)."""
  return jnp.broadcast_to(h_BTD[:, :, None, :], (*h_BTD.shape[:2], n, h_BTD.shape[-1]))


FORMS = ("mhc", "independent")  # ModelConfig.hc_form
HEADS = ("learned", "mean")  # ModelConfig.hc_head


def param_count(n: int, d_model: int, layers: int, sublayers: int = 2, form: str = "mhc",
                head: str = "learned") -> int:
  """The hyper-connections' parameters in a model of `layers` blocks (0 at n = 1; the mean head has none)."""
  if n == 1:
    return 0
  per = (2 + n) * n * (n * d_model + 1) + 3 if form == "mhc" else 2 * n * (n * d_model + 1) + 2
  return layers * sublayers * per + (n * (n * d_model + 1) + 1 if head == "learned" else 0)
