"""Shared fixtures: awkward configs and fresh random inputs."""

import importlib.metadata
import os

# Tests compile thousands of tiny programs and run each once: XLA's CPU backend without its
# expensive LLVM passes compiles them about twice as fast (measured on two contract cases:
# 7.8 s -> 4.6 s), and without its MLIR fusion emitters (the older LLVM IR emitters instead)
# a third faster again (test_kernel.py, cold cache, one process: 14.9 -> 9.9 s of CPU); the same
# identities hold to the same tolerances.
# One LLVM module per program, not split for parallel code generation: these programs are tiny and
# the machine has two cores, so the split only adds work (test_kernel_blocked.py and
# test_mechanisms_scales.py, cold cache, one process: 19.3 and 18.3 s -> 16.9 and 16.5 s of CPU, AMD EPYC Zen 4).
# XLA aborts on a flag it does not know: these two only where they were tested (jaxlib 0.10.2).
_JAXLIB = tuple(int(p) for p in importlib.metadata.version("jaxlib").split(".")[:2])
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0",
     "--xla_llvm_disable_expensive_passes=true",
     *(("--xla_cpu_use_fusion_emitters=false", "--xla_cpu_parallel_codegen_split_count=1")
       if _JAXLIB >= (0, 10) else ())]).strip()

import jax  # noqa: E402  (after XLA_FLAGS)
import jax.numpy as jnp
import numpy as np
import pytest

import attn
from attn import HeadConfig

jax.config.update("jax_default_matmul_precision", "highest")

# One persistent compilation cache for the whole session and every xdist worker: a program
# compiled by one test (or worker, or an earlier run) is read from disk by the next.
_CACHE = os.environ.get("ATTN_TEST_JAX_CACHE") or os.path.join(
    os.path.expanduser("~"), ".cache", "attn", "jax-tests")
os.makedirs(_CACHE, exist_ok=True)
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

# attn.apply compiled whole (variant, cfg and flags static): run eagerly, every small op of a layer
# compiles on its own, which costs a test several times more than one compile of the layer.
jit_apply = jax.jit(attn.apply, static_argnums=0,
                    static_argnames=("cfg", "return_weights", "is_causal"))

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


# RoPE inside awkward shapes (rope_theta small, so that a few positions tell the frequencies
# apart). Kept out of CONFIGS so that the contract matrix does not double; suites that test RoPE
# (the contract's offsets test, the exact converters) read them.
ROPE_CONFIGS = {
    "rope_gqa": HeadConfig(d_model=24, num_heads=6, d_k=6, d_v=7, num_kv_heads=2, rope_dim=4,
                           rope_theta=100.0),
    "rope_mqa_nobias": HeadConfig(d_model=16, num_heads=4, d_k=6, d_v=5, num_kv_heads=1,
                                  rope_dim=2, rope_theta=100.0, use_bias=False),
}


# Configs with nothing awkward about them: parametrized suites run them in the slow tier only.
PLAIN_CONFIGS = ("base", "single_head")

# Variants whose generic cases (contract matrix, counts against XLA and the Jacobian) run in the
# fast tier: fused (the default), per_head (the seeds' layout) and merged (W_Q·W_Kᵀ). Every other
# variant runs its generic cases in the slow tier (CI runs both) and keeps quick checks of its own:
# collaborative, split_input and two_stage their exact identities and conversions (test_identities,
# test_convert), the others their test files. MATRIX_VARIANTS also run the plain configs there.
FAST_VARIANTS = ("fused", "merged", "per_head")
MATRIX_VARIANTS = ("collaborative", "fused", "merged", "per_head", "split_input", "two_stage")


# The configs a fast variant other than per_head runs in the fast tier: the two most awkward (fewer kv
# heads than query heads, d_v != d_k). per_head runs every awkward config there; the slow tier runs all.
FAST_CONFIGS = ("dv_ne_dk", "gqa")


def tier(variant: str, cname: str | None = None):
  """Marks of one generic case: slow for a plain config, a variant outside FAST_VARIANTS, or a config
  outside FAST_CONFIGS for a variant other than per_head."""
  slow = (cname in PLAIN_CONFIGS or variant not in FAST_VARIANTS
          or (cname is not None and variant != "per_head" and cname not in FAST_CONFIGS))
  return pytest.mark.slow if slow else ()


def in_matrix(variant: str, cname: str) -> bool:
  """Whether a config-by-variant matrix runs this case: a variant outside MATRIX_VARIANTS skips
  the plain configs (they add little to the awkward ones) to keep the slow tier's time down."""
  return variant in MATRIX_VARIANTS or cname not in PLAIN_CONFIGS


def for_variant(name: str, cfg: HeadConfig) -> HeadConfig:
  """cfg, with d_v = d_k for a variant whose values are its keys (k_eq_v and compressed_shared refuse d_v ≠ d_k)."""
  return cfg.replace(d_v=cfg.d_k) if name in ("k_eq_v", "compressed_shared") else cfg


def variant_params(names=None, fast=FAST_VARIANTS):
  """pytest params over attn.VARIANTS (or names), each in its tier; fast: the variants (of
  FAST_VARIANTS) that run in the fast tier, for a property no variant's own code can break alone."""
  return [pytest.param(n, marks=tier(n) or (() if n in fast else pytest.mark.slow), id=n)
          for n in sorted(names or attn.VARIANTS)]


@pytest.fixture(params=sorted(CONFIGS), ids=sorted(CONFIGS))
def cfg(request):
  return CONFIGS[request.param]


def device_array(a, dtype):
  """a (numpy, any float dtype) as a jax array of dtype, cast on the host: jnp.asarray(a, dtype)
  of a float64 array casts on the device, one compiled convert per new shape."""
  dtype = np.dtype(dtype)
  return jnp.asarray(np.asarray(a).astype(dtype), dtype)


def randn(seed: int, shape, dtype=jnp.float32):
  """Fresh N(0,1) inputs drawn with numpy: jax.random would compile once per new shape."""
  return device_array(np.random.default_rng(seed).standard_normal(shape), dtype)


def fresh_params(variant: str, cfg: HeadConfig, seed: int = 0, dtype=jnp.float32):
  """Random params of `variant`: weights N(0, 1/fan_in) (fan_in = size / last axis), biases N(0, 1/4)."""
  rng = np.random.default_rng(seed)
  out = {}
  for name, shape in sorted(attn.param_shapes(variant, cfg).items()):
    std = 0.5 if name.startswith("b_") else 1.0 / np.sqrt(np.prod(shape) / shape[-1])
    out[name] = device_array(std * rng.standard_normal(shape), dtype)
  return out


def random_params(params, seed: int):
  """The same tree with every leaf redrawn at its scale; biases nonzero (init makes them zero)."""
  rng = np.random.default_rng(seed)
  out = {}
  for name, a in sorted(params.items()):
    std = 0.5 if name.startswith("b") else 1.0 / np.sqrt(a.size / a.shape[-1])
    out[name] = device_array(std * rng.standard_normal(a.shape), a.dtype)
  return out


# The [task] and [model] of the tiny MQAR sweeps that runner tests build on (they add [train], [sweep]).
TINY_MQAR = """
[task]
name = "mqar"
vocab_size = 16
seq_len = 12
num_pairs = 2

[model]
d_model = 16
num_layers = 1
num_heads = 2
d_ff = 16
"""
# Two trials of four steps on it: the store tests' sweep.
TINY_SWEEP = TINY_MQAR + """
[train]
steps = 4
batch_size = 2
eval_every = 2
eval_batches = 1

[sweep]
seeds = [0, 1]
"""


# docs/extending.md's logit_scale mechanism, its two functions (tests register it as they need it).
def logit_scale_logits(params, logits_BHTS, *, cfg):
  from attn.variants.mechanisms import options
  return logits_BHTS * options(cfg, "logit_scale")["factor"]


def logit_scale_check(cfg):
  from attn import ConfigError
  from attn.variants.mechanisms import options
  factor = options(cfg, "logit_scale")["factor"]
  if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
    raise ConfigError(f"extra.logit_scale.factor={factor!r} is not allowed: a positive number")


from skips import pytest_terminal_summary  # noqa: E402,F401  (the skips, grouped by reason, after the totals)
from hf_marks import pytest_collection_modifyitems  # noqa: E402,F401  (the hf mark, from each test's code)
