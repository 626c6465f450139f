"""Shared fixtures: awkward configs and fresh random inputs."""

import jax
import jax.numpy as jnp
import pytest

from attn import HeadConfig

jax.config.update("jax_default_matmul_precision", "highest")

# The awkward shapes every identity must survive: d_v != d_k, h not dividing
# d_model, fewer key/value heads than query heads, no biases, a single head.
CONFIGS = {
    "base": HeadConfig(d_model=32, num_heads=4),
    "dv_ne_dk": HeadConfig(d_model=24, num_heads=3, d_k=5, d_v=11),
    "h_not_dividing_D": HeadConfig(d_model=20, num_heads=6, d_k=4, d_v=3),
    "gqa": HeadConfig(d_model=24, num_heads=6, d_k=5, d_v=7, num_kv_heads=2),
    "mqa_nobias": HeadConfig(d_model=16, num_heads=4, d_k=6, d_v=6, num_kv_heads=1, use_bias=False),
    "single_head": HeadConfig(d_model=12, num_heads=1, d_k=12, d_v=12),
}


@pytest.fixture(params=sorted(CONFIGS), ids=sorted(CONFIGS))
def cfg(request):
  return CONFIGS[request.param]


def randn(seed: int, shape, dtype=jnp.float32):
  return jax.random.normal(jax.random.PRNGKey(seed), shape, dtype)


def random_params(params, seed: int):
  """The same tree with every leaf redrawn, biases included (init makes biases zero)."""
  keys = jax.random.split(jax.random.PRNGKey(seed), len(params))
  return {name: 0.5 * jax.random.normal(k, a.shape, a.dtype)
          for k, (name, a) in zip(keys, sorted(params.items()))}
