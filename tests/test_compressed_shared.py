"""compressed_shared (attn.variants.compressed_shared): DeepSeek-V4's attention layer. Decoding through its
own cache equals the causal full pass, with and without entries, with the overlap and the indexer; the
contract kit at its own options; refusals by name. (Against transformers: tests/test_hf_deepseek_v4.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn import ConfigError, api
from attn.config import HeadConfig
from attn.testing import check_variant
from attn.variants import VARIANTS, cache, compressed_shared
from attn.variants.base import Options


def _cfg(**kw):
  base = dict(d_model=20, num_heads=4, d_k=8, d_v=8, num_kv_heads=1, use_bias=False, q_latent_dim=6, rope_dim=4,
              rope_layout="interleaved", window=4, sinks=True, o_groups=2, o_rank=3, compress_block=3,
              compress_overlap=True, compress_index_heads=2, compress_index_dim=6, compress_index_topk=2)
  return HeadConfig(**{**base, **kw})


def _run(cfg, chunks, T=11):
  v = VARIANTS["compressed_shared"]
  # numpy draws at init's shapes (jax's would compile one draw per shape: most of the test's time)
  rng = np.random.default_rng(0)
  shapes = jax.eval_shape(lambda key: api.init(v, key, cfg), jax.random.PRNGKey(0))
  p = {k: jnp.asarray((k.startswith("n_") or k.endswith("norm")) + 0.3 * rng.standard_normal(a.shape), jnp.float32)
       for k, a in shapes.items()}
  x = jnp.asarray(rng.standard_normal((2, T, cfg.d_model)), jnp.float32)
  full = jax.jit(lambda p, x: v.apply(p, x, cfg=cfg, opts=Options(is_causal=True))[0])(p, x)
  step = jax.jit(lambda p, x, c, i: cache.decode_step(v, p, x, c, i, cfg=cfg))
  c, i, ys = cache.init(v, p, cfg, 2, T + 1), 0, []
  for n in chunks:
    y, c = step(p, x[:, i:i + n], c, jnp.asarray(i))
    ys.append(y)
    i += n
  return np.asarray(jnp.concatenate(ys, 1)), np.asarray(full), p, x


def test_decoding_with_the_indexer_equals_full_pass():
  """Token by token across block ends (one compiled step; the slow tier adds a prompt): the entries, the
  indexer's keys and both compressors' buffers through the cache; the indexer keeps 2 of up to 3 entries."""
  cfg = _cfg()
  got, want, p, x = _run(cfg, [1] * 11)
  np.testing.assert_allclose(got, want, atol=3e-5, rtol=3e-5)
  # the choice matters: keeping every entry gives another layer
  every = jax.jit(lambda p, x: VARIANTS["compressed_shared"].apply(
      p, x, cfg=cfg.replace(compress_index_topk=8), opts=Options(is_causal=True))[0])(p, x)
  assert np.abs(np.asarray(every) - want)[:, 9:].max() > 1e-3 and np.abs(np.asarray(every) - want)[:, :8].max() == 0


@pytest.mark.slow
@pytest.mark.parametrize("kw", [dict(compress_block=None, compress_overlap=False, compress_index_heads=0,
                                     compress_index_dim=0, compress_index_topk=0),
                                dict(compress_overlap=False, compress_index_heads=0, compress_index_dim=0,
                                     compress_index_topk=0, window=None, q_latent_dim=None, use_bias=True),
                                dict(num_kv_heads=2, compress_block=2), dict()])
def test_decoding_equals_full_pass(kw):
  """Token by token, in one chunk and in uneven ones: no entries (V4's sliding layers), one series without
  a window or the latent but with biases, the indexer over two kv heads' layer, and the fast test's layer."""
  cfg = _cfg(**kw)
  for chunks in ([1] * 11, [11], [5, 1, 3, 2]):
    got, want, _, _ = _run(cfg, chunks)
    np.testing.assert_allclose(got, want, atol=3e-5, rtol=3e-5, err_msg=str(chunks))


@pytest.mark.slow
def test_variant_kit_at_its_own_options():
  """The kit (the contract test runs it at the kit's plain configs) with entries, the overlap, the indexer,
  the latent and the grouped output."""
  check_variant("compressed_shared", configs=(
      _cfg(compress_block=2, sinks=False),
      HeadConfig(d_model=16, num_heads=4, d_k=6, d_v=6, num_kv_heads=2, compress_block=2, softcap=5.0, q_latent_dim=7,
                 o_groups=2)))


@pytest.mark.parametrize("kw, field", [
    (dict(d_v=6), "d_v"), (dict(compress_block=None, compress_overlap=False), "compress_index_heads"),
    (dict(q_latent_dim=None), "compress_index_heads"), (dict(compress_index_dim=2), "compress_index_heads"),
    (dict(compress_index_topk=0), "compress_index"), (dict(qk_norm=True), "qk_norm"),
    (dict(compress_block=None, compress_index_heads=0, compress_index_dim=0, compress_index_topk=0),
     "compress_overlap"),
    (dict(probability="sigmoid"), "probability")])
def test_bad_config_refused(kw, field):
  with pytest.raises(ConfigError, match=field):
    api.check_config("compressed_shared", _cfg(**kw))


def test_other_variants_refuse_the_indexer():
  with pytest.raises(ConfigError, match="compress_index_heads"):
    api.check_config("compressed", HeadConfig(d_model=8, num_heads=2, compress_index_heads=1, compress_index_dim=2,
                                              compress_index_topk=1))


def test_cache_elements_are_what_the_cache_holds():
  cfg = _cfg()
  c = VARIANTS["compressed_shared"].init_cache(None, cfg, 1, 24)
  assert sum(a.size for a in c.values()) == compressed_shared.kv_cache_elements(cfg, 24)


@pytest.mark.slow
def test_blocked_kernel_honours_the_indexers_choice():
  """Long sequences take the blocked kernel ("auto"): a per-query choice of entries (B,1,T,N), as the
  indexer gives it, with the window, sinks and the overlap's span, equals the einsum definition."""
  from attn.kernel import compressed as ckernel
  rng = np.random.default_rng(0)
  B, T, H, K, m = 2, 70, 4, 8, 4
  q = jnp.asarray(rng.standard_normal((B, T, H, K)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((B, T, 1, K)), jnp.float32)
  c = jnp.asarray(rng.standard_normal((B, T // m, 1, K)), jnp.float32)
  kw = dict(m=m, span=2 * m, entry_mask_=jnp.asarray(rng.random((B, 1, T, T // m)) < 0.4), is_causal=True,
            scale=0.3, window=5, sinks=jnp.asarray(rng.standard_normal(H), jnp.float32))
  want = ckernel.attention(q, k, k, c, c, impl="einsum", **kw)
  got = ckernel.attention(q, k, k, c, c, impl="blocked", block_q=16, block_k=16, **kw)
  np.testing.assert_allclose(got, want, atol=2e-6)
