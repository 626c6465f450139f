"""MultiHeadAttention: an NNX module that owns a variant's parameters and calls attn.apply.

The module is a shell over the functional core: its nnx.Params are exactly the
arrays of `attn.init(variant, ...)`, held in an nnx.Dict under the variant's
own names, and `__call__` is `attn.apply(variant, params, ...)`, so checks and
math are shared with the functional API.

dtype and param_dtype are Flax's: parameters are created and stored in
param_dtype; with dtype set, the inputs and parameters are cast to it for the
computation (the kernel's softmax stays float32), and None computes in the
inputs' dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from attn import api, kernel
from attn.config import HeadConfig, check_head_mask, invalid
from attn.nn import kv_sharing
from attn.variants import cache as kv_cache
from attn.variants.base import Params, Variant


class MultiHeadAttention(nnx.Module):
  """One attention layer of any variant (a registered name or a Variant record), its parameters nnx.Params."""

  def __init__(self, cfg: HeadConfig, variant: str | Variant = "fused", *, rngs: nnx.Rngs | None = None,
               dtype=None, param_dtype=jnp.float32, params: Params | None = None,
               impl: str | None = None):
    """impl: the attention core's implementation of every call (None: attn.apply's default, "auto"),
    refused here, before tracing, unless it runs on this machine."""
    # A record need not be registered (attn.apply takes one too): the module keeps the record itself.
    self.record = api.check_config(variant, cfg)
    if impl is not None:
      kernel.check_impl(impl)
    self.impl = impl
    self.variant = self.record.name
    self.cfg = cfg
    self.dtype = None if dtype is None else jnp.dtype(dtype)
    if params is None:
      if not isinstance(rngs, nnx.Rngs):
        raise invalid("rngs", rngs, "an nnx.Rngs (or pass params=... to load existing weights)")
      params = api.init(self.record, rngs.params(), cfg, param_dtype)
    else:
      api.check_params(self.record, params, cfg)
    self.params = nnx.Dict({name: nnx.Param(jnp.asarray(a)) for name, a in params.items()})
    self.cache: nnx.Dict | None = nnx.data(None)  # KV cache entries, set by init_cache
    self.cache_index: nnx.Cache | None = nnx.data(None)
    self.cache_max_len: int | None = None  # positions it serves (a window's ring has fewer slots)

  def init_cache(self, batch_size: int, max_len: int, dtype=jnp.float32) -> None:
    """An empty KV cache (nnx.Cache variables) for decode=True; what it holds is the variant's.

    Per token it holds Variant.kv_cache_width numbers (attn.variants.cache), for
    max_len tokens, or with cfg.window a ring of min(window, max_len);
    cache_index is the number of tokens already decoded. A layer reading another's keys and
    values (kv_source, attn.nn.kv_sharing) holds none: only its index.
    """
    if getattr(self, "kv_source", None) is not None:
      self.cache_index = nnx.Cache(jnp.array(0, jnp.int32))
      self.cache_max_len = max_len
      return
    entries = kv_cache.init(self.record, self.params_dict(), self.cfg,
                            batch_size, max_len, dtype)
    self.cache = nnx.Dict({name: nnx.Cache(a) for name, a in entries.items()})
    self.cache_index = nnx.Cache(jnp.array(0, jnp.int32))
    self.cache_max_len = max_len

  @classmethod
  def from_params(cls, cfg: HeadConfig, variant: str | Variant, params: Params) -> MultiHeadAttention:
    """A module holding the given plain-dict parameters (checked against cfg)."""
    return cls(cfg, variant, params=params)

  def params_dict(self) -> Params:
    """The parameters as a plain dict of arrays, ready for attn.apply or attn.convert."""
    return {name: p[...] for name, p in self.params.items()}

  def _compute(self, x_BTD: jax.Array, context_BSD: jax.Array | None = None):
    """(params, x, context) in the compute dtype: cast when self.dtype is set."""
    params, dtype = self.params_dict(), self.dtype
    if getattr(self, "kv_source", None) is not None:  # a sharing layer holds no key-side weights
      params = kv_sharing.with_dropped(params, self.variant, self.cfg)
    if dtype is None:
      return params, x_BTD, context_BSD
    cast = lambda a: a if a is None else a.astype(dtype)
    return {name: cast(a) for name, a in params.items()}, cast(x_BTD), cast(context_BSD)

  def load_params(self, params: Params) -> None:
    """Replaces the parameter values with a plain dict of the variant's names and shapes."""
    api.check_params(self.record, params, self.cfg)
    for name, a in params.items():
      self.params[name][...] = jnp.asarray(a)

  def __call__(self, x_BTD: jax.Array, context_BSD: jax.Array | None = None, *,
               mask: jax.Array | None = None, return_weights: bool = False,
               head_mask: jax.Array | None = None, is_causal: bool = False,
               kv_lengths: jax.Array | None = None, positions: jax.Array | None = None,
               decode: bool = False, impl: str | None = None, kv_inputs=None):
    """y (B,T,D); with return_weights, (y, weights (B,H,T,S)). mask: True = may attend.

    decode=True: x's tokens follow the cache_index tokens already cached (init_cache first);
    they are attended causally against the cache, written into it, and cache_index advances.

    head_mask (H,) or (B,H) gates each query head's output before W^O;
    is_causal and kv_lengths (B,) are structured masks; positions (T,) or (B,T) place
    x's tokens for RoPE; impl the attention core's implementation (attn.apply), by default
    the module's; kv_inputs (key input, value input): per_head's keys and values from inputs of their own
    (attn.apply), decoding too.
    """
    impl = self.impl if impl is None else impl
    if kv_inputs is not None:
      kv_inputs = tuple(self._compute(a)[1] for a in kv_inputs)
    if decode:
      return self._decode(x_BTD, head_mask, kv_inputs)
    params, x_BTD, context_BSD = self._compute(x_BTD, context_BSD)
    return api.apply(self.record, params, x_BTD, context_BSD, cfg=self.cfg,
                     mask=mask, return_weights=return_weights, head_mask=head_mask,
                     is_causal=is_causal, kv_lengths=kv_lengths, positions=positions, impl=impl,
                     kv_inputs=kv_inputs)

  def _decode(self, x_BTD: jax.Array, head_mask, kv_inputs=None) -> jax.Array:
    if getattr(self, "kv_source", None) is not None and self.cache_index is not None:
      return kv_sharing.decode(self, x_BTD, head_mask)  # reads its source layer's keys and values
    if self.cache is None:
      raise invalid("decode", True, "decode=False, or call init_cache(batch_size, max_len) first")
    cache = {name: c[...] for name, c in self.cache.items()}
    B, M = next(iter(cache.values())).shape[0], self.cache_max_len
    if x_BTD.shape[0] != B:
      raise invalid("x.shape[0]", x_BTD.shape[0], f"the cache's batch size {B} (init_cache)")
    check_head_mask(head_mask, B, self.cfg.num_heads)
    index = self.cache_index[...]
    if not isinstance(index, jax.core.Tracer) and int(index) + x_BTD.shape[1] > M:
      raise invalid("x.shape[1]", x_BTD.shape[1],
                    f"at most max_len - cache_index = {M} - {int(index)} = {M - int(index)} "
                    "tokens: positions beyond the cache")
    params, x_BTD, _ = self._compute(x_BTD)
    if kv_inputs is not None:
      api.check_kv_inputs(kv_inputs, x_BTD, None)
    y_BTD, cache = kv_cache.decode_step(self.record, params, x_BTD,
                                        cache, index, cfg=self.cfg, head_mask=head_mask, kv_inputs=kv_inputs)
    for name, a in cache.items():
      self.cache[name][...] = a
    self.cache_index[...] = index + x_BTD.shape[1]
    return y_BTD
