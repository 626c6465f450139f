"""The blocked kernel and the structured masks against dense masks built here in numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax import nnx

import attn
from attn import ConfigError, kernel
from attn.kernel import blocked
from attn.bench.peers import peak_bytes
from attn.config import HeadConfig
from attn.nn import DecoderLM, Encoder, EncoderDecoder
from attn.nn.config import ModelConfig
from attn.variants import fused
from conftest import CONFIGS, for_variant, fresh_params, randn, tier

SHAPES = {  # B, T, S, H, G, K, V, block_q, block_k
    "self": (2, 13, 13, 4, 4, 8, 8, 4, 8),            # lengths not multiples of the blocks
    "gqa_cross": (2, 7, 11, 6, 2, 5, 9, 3, 4),        # grouped heads, d_v != d_k, T < S
    "mqa_T_gt_S": (3, 9, 5, 3, 1, 4, 6, 4, 2),        # multi-query, T > S: early rows see nothing
    "one_block": (2, 1, 6, 2, 2, 3, 3, None, None),   # a single query, blocks from the shapes
}
# Per shape, the (is_causal, kv_lengths, dense mask) combinations to check; "lengths" has a 0
# and "blank" a fully masked row in every head.
CASES = {
    "self": [(False, None, None), (True, "lengths", "blank")],
    "gqa_cross": [(True, None, None), (False, "lengths", None)],
    "mqa_T_gt_S": [(True, "lengths", None)],
    "one_block": [(False, None, "blank")],
}


def qkv(seed, B, T, S, H, G, K, V, dtype=jnp.float32):
  return (randn(seed, (B, T, H, K), dtype), randn(seed + 1, (B, S, G, K), dtype),
          randn(seed + 2, (B, S, G, V), dtype))


def dense_mask(B, H, T, S, *, is_causal=False, kv_lengths=None, mask=None) -> np.ndarray:
  """The (B,H,T,S) mask the structured arguments stand for, written out in numpy."""
  t, s = np.arange(T)[:, None], np.arange(S)[None, :]
  keep = np.ones((B, H, T, S), bool)
  if is_causal:
    keep &= s <= t + (S - T)  # bottom-right aligned
  if kv_lengths is not None:
    keep &= (s < np.asarray(kv_lengths)[:, None, None, None])
  if mask is not None:
    keep &= np.broadcast_to(np.asarray(mask), keep.shape)
  return keep


def structured(B, T, S, case, seed=0):
  """is_causal, kv_lengths (B,) with a 0, and a (B,1,T,S) mask with a blank row, as named."""
  rng = np.random.default_rng(seed)
  is_causal, lengths, blank = case
  kv_lengths = None if lengths is None else jnp.asarray(rng.integers(1, S + 1, B)).at[0].set(0)
  mask = None if blank is None else jnp.asarray(
      rng.random((B, 1, T, S)) < 0.7).at[:, :, T // 2].set(False)
  return is_causal, kv_lengths, mask


def grads(fn, q, k, v, ct):
  return jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) * ct), argnums=(0, 1, 2))(q, k, v)


def value_and_grads(fn):
  """jit of (fn(q, k, v), its vjp with ct): one compile per function."""
  def run(q, k, v, ct):
    out, vjp = jax.vjp(fn, q, k, v)
    return out, vjp(ct)
  return jax.jit(run)


# Compiled whole: op by op, every small op of the kernel compiles on its own.
attention = jax.jit(kernel.attention, static_argnames=("is_causal", "impl", "block_q", "block_k"))
jit_grads = jax.jit(grads, static_argnums=0)
reference = jax.jit(kernel.reference_attention)


# gqa_cross (grouped heads, d_v != d_k, T < S, blocks not dividing T or S, causal and with lengths) and
# mqa_T_gt_S (one kv head, T > S: rows that see nothing, a length of 0) in the fast tier; self and one_block
# slow (a blanking dense mask on the blocked kernel keeps a fast sibling in
# test_kernel_mechanisms.py::test_blank_rows_give_zeros_and_finite_gradients).
@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in ("gqa_cross", "mqa_T_gt_S") else pytest.mark.slow)
                                  for n in SHAPES])
def test_blocked_equals_einsum_values_and_gradients(name):
  B, T, S, H, G, K, V, bq, bk = SHAPES[name]
  q, k, v = qkv(0, B, T, S, H, G, K, V)
  ct = randn(9, (B, T, H, V))
  for case in CASES[name]:
    is_causal, kv_lengths, mask = structured(B, T, S, case)
    keep = jnp.asarray(dense_mask(B, H, T, S, is_causal=is_causal, kv_lengths=kv_lengths,
                                  mask=mask))
    out, grads = value_and_grads(lambda q, k, v: kernel.attention(
        q, k, v, mask, is_causal=is_causal, kv_lengths=kv_lengths, impl="blocked",
        block_q=bq, block_k=bk))(q, k, v, ct)
    ref_out, ref_grads = value_and_grads(
        lambda q, k, v: kernel.attention(q, k, v, keep, impl="einsum"))(q, k, v, ct)
    np.testing.assert_allclose(out, ref_out, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(out, reference(q, k, v, keep), atol=1e-5, rtol=1e-5)
    for a, b in zip(grads, ref_grads):
      np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


# Slow: einsum's structured masks against the dense ones keep a fast sibling in
# test_every_variant_structured_equals_dense_mask (fused, at these small shapes on einsum), xla's in
# test_kernel_mechanisms.py::test_window_on_the_xla_path_is_aligned_as_ours (causal, T != S, kv_lengths).
@pytest.mark.slow
@pytest.mark.parametrize("impl", ["einsum", "xla"])
def test_structured_masks_equal_dense_masks_on_every_path(impl):
  B, H, G, K = 2, 4, 2, 8  # xla needs d_v = d_k
  for T, S in ((5, 8), (8, 5)):  # causal with T < S and T > S
    q, k, v = qkv(T, B, T, S, H, G, K, K)
    for case in ((True, "lengths", "blank"), (True, None, None)):
      is_causal, kv_lengths, mask = structured(B, T, S, case, seed=T)
      keep = dense_mask(B, H, T, S, is_causal=is_causal, kv_lengths=kv_lengths, mask=mask)
      got = attention(q, k, v, mask, is_causal=is_causal, kv_lengths=kv_lengths, impl=impl)
      np.testing.assert_allclose(got, reference(q, k, v, jnp.asarray(keep)),
                                 atol=2e-6, rtol=1e-5)


def test_fully_masked_rows_are_zero_in_value_and_gradient():
  B, T, S, H, G, K, V, bq, bk = SHAPES["mqa_T_gt_S"]
  q, k, v = qkv(2, B, T, S, H, G, K, V)
  kv_lengths = jnp.array([0, 3, 0])
  f = lambda q, k, v: attention(q, k, v, is_causal=True, kv_lengths=kv_lengths,
                                impl="blocked", block_q=bq, block_k=bk)
  out = np.asarray(f(q, k, v))
  dq, dk, dv = (np.asarray(g) for g in jit_grads(f, q, k, v, randn(3, out.shape)))
  assert np.all(np.isfinite(dq)) and np.all(np.isfinite(dk)) and np.all(np.isfinite(dv))
  for b in (0, 2):  # no key at all
    assert not out[b].any() and not dq[b].any() and not dk[b].any() and not dv[b].any()
  blank_rows = T - S  # bottom-right causal: queries t < T - S see no key
  assert not out[1, :blank_rows].any() and not dq[1, :blank_rows].any()
  assert not dk[1, 3:].any() and not dv[1, 3:].any()  # keys past the length get no gradient
  assert out[1, blank_rows:].any()


def test_bfloat16_within_its_tolerance():
  B, T, S, H, G, K, V, bq, bk = SHAPES["gqa_cross"]
  q, k, v = qkv(4, B, T, S, H, G, K, V, jnp.bfloat16)
  kv_lengths = jnp.array([4, 11])
  f = lambda q, k, v: attention(q, k, v, is_causal=True, kv_lengths=kv_lengths,
                                impl="blocked", block_q=bq, block_k=bk)
  out = f(q, k, v)
  assert out.dtype == jnp.bfloat16
  f32 = [a.astype(jnp.float32) for a in (q, k, v)]
  keep = jnp.asarray(dense_mask(B, H, T, S, is_causal=True, kv_lengths=kv_lengths))
  np.testing.assert_allclose(out.astype(jnp.float32), reference(*f32, keep),
                             atol=3e-2, rtol=3e-2)
  ct = randn(5, out.shape)
  ref = lambda q, k, v: kernel.attention(q, k, v, keep)
  for a, b in zip(jit_grads(lambda *x: f(*x).astype(jnp.float32), q, k, v, ct),
                  jit_grads(ref, *f32, ct)):
    assert a.dtype == jnp.bfloat16
    np.testing.assert_allclose(a.astype(jnp.float32), b, atol=6e-2, rtol=6e-2)
  big = f(q * 60, k * 60, v)  # logits far past bf16's exp range stay finite
  assert np.all(np.isfinite(np.asarray(big.astype(jnp.float32))))


def test_jit_with_traced_lengths_and_vmap():
  B, T, S, H, G, K, V, bq, bk = SHAPES["self"]
  q, k, v = qkv(6, B, T, S, H, G, K, V)
  kv_lengths = jnp.array([5, 13])
  f = jax.jit(lambda q, k, v, n: kernel.attention(q, k, v, kv_lengths=n, is_causal=True,
                                                  impl="blocked", block_q=bq, block_k=bk))
  # against the dense reference, compiled whole (the blocked kernel eager compiles each small op on its own)
  want = reference(q, k, v, jnp.asarray(dense_mask(B, H, T, S, is_causal=True, kv_lengths=kv_lengths)))
  np.testing.assert_allclose(f(q, k, v, kv_lengths), want, atol=1e-6)
  one = lambda q, k, v, n: f(q[None], k[None], v[None], n[None])[0]
  np.testing.assert_allclose(jax.vmap(one)(q, k, v, kv_lengths), want, atol=1e-6)
  f(q, k, v, jnp.array([99, -1]))  # under jit the values are not checked


def test_block_sizes_and_causal_work():
  assert blocked.block_sizes(1000, 1000) == (500, 250)  # equal splits no larger than the targets
  assert blocked.block_sizes(7, 3, block_q=4, block_k=8) == (4, 3)
  assert blocked.block_sizes(5, 5) == (5, 5)
  assert blocked.work_fraction(4096, 4096, is_causal=False) == 1.0
  # Causal skips the blocks above the diagonal: about half the work.
  assert 0.5 < blocked.work_fraction(4096, 4096, is_causal=True) <= 0.6
  assert blocked.work_fraction(8, 2, is_causal=True, block_q=2, block_k=2) == 0.25


def test_auto_picks_blocked_for_long_sequences():
  short = jnp.zeros((1, 64, 1, 8))
  long_q, long_k = jnp.zeros((1, 512, 1, 8)), jnp.zeros((1, 512, 1, 8))
  assert kernel.best_impl(short, short, short) == "einsum"
  assert 512 * 512 >= kernel.BLOCKED_MIN_SCORES > 64 * 64
  if jax.default_backend() == "cpu":
    assert kernel.best_impl(long_q, long_k, long_k) == "blocked"
  assert kernel.best_impl(long_q, long_k, long_k, return_weights=True) == "einsum"
  assert kernel.best_impl(long_q, long_k, long_k, logits_bias=jnp.zeros(())) == "einsum"


@pytest.mark.parametrize("kwargs, match", [
    ({"kv_lengths": jnp.array([1, 2, 3])}, "kv_lengths.shape"),
    ({"kv_lengths": jnp.array([1.0, 2.0])}, "kv_lengths.shape"),
    ({"kv_lengths": jnp.array([1, 14])}, "kv_lengths='lengths in \\[1, 14\\]'"),
    ({"kv_lengths": jnp.array([-1, 2])}, "kv_lengths="),
    ({"is_causal": 1}, "is_causal=1"),
    ({"block_q": 0, "impl": "blocked"}, "block_q=0"),
    ({"block_k": -2, "impl": "blocked"}, "block_k=-2"),
    ({"block_q": True}, "block_q=True"),
    ({"impl": "blocked", "return_weights": True}, "return_weights"),
    ({"impl": "blocked", "logits_bias": jnp.zeros(())}, "logits_bias"),
])
def test_bad_inputs_are_clear_errors(kwargs, match):
  B, T, S, H, G, K, V, _, _ = SHAPES["self"]
  q, k, v = qkv(7, B, T, S, H, G, K, V)
  with pytest.raises(ConfigError, match=match):
    kernel.attention(q, k, v, **kwargs)


# The variants outside conftest.FAST_VARIANTS in the slow tier (the structured masks are the kernel's:
# the fast variants and the kernel tests above carry the identity), and merged forced onto the blocked
# kernel too (per_head takes that path in the fast tier). The heads with a fixed-size state take no
# dense mask (attn.variants.linear; the kit checks their kv_lengths).
# Of the fast variants, fused on einsum and per_head on blocked stay fast; per_head and merged on einsum are
# slow (the same structured masks through the same kernel: the fused case is their sibling).
@pytest.mark.parametrize("variant, force_blocked", [
    *(pytest.param(v, False, marks=pytest.mark.slow if v in ("per_head", "merged") else tier(v))
      for v in sorted(attn.VARIANTS) if attn.VARIANTS[v].init_state is None), ("per_head", True),
    pytest.param("merged", True, marks=pytest.mark.slow)])
def test_every_variant_structured_equals_dense_mask(variant, force_blocked, monkeypatch):
  if force_blocked:  # impl="auto" then takes the blocked kernel at these small shapes
    monkeypatch.setattr(kernel, "BLOCKED_MIN_SCORES", 0)
  cfg = for_variant(variant, CONFIGS["gqa"])
  params = fresh_params(variant, cfg, seed=1)
  x, ctx = randn(2, (2, 5, cfg.d_model)), randn(3, (2, 7, cfg.d_model))
  kv_lengths = jnp.array([0, 4])
  for context, S in ((None, 5), (ctx, 7)):
    keep = jnp.asarray(dense_mask(2, 1, 5, S, is_causal=True, kv_lengths=kv_lengths))

    def loss(x, structured, context=context, keep=keep):
      kw = {"is_causal": True, "kv_lengths": kv_lengths} if structured else {"mask": keep}
      y = attn.apply(variant, params, x, context, cfg=cfg, **kw)
      return jnp.sum(y ** 2), y
    run = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
    (_, y), gx = run(x, True)
    (_, y_ref), gx_ref = run(x, False)
    np.testing.assert_allclose(y, y_ref, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(gx, gx_ref, atol=1e-4, rtol=1e-4)
  mha = attn.MultiHeadAttention(cfg, variant, params=params)
  keep = jnp.asarray(dense_mask(2, 1, 5, 5, is_causal=True, kv_lengths=kv_lengths))
  call = nnx.jit(lambda m, x, structured: m(x, is_causal=True, kv_lengths=kv_lengths)
                 if structured else m(x, mask=keep), static_argnums=2)
  np.testing.assert_allclose(call(mha, x, True), call(mha, x, False), atol=1e-5, rtol=1e-5)


def test_apply_refuses_bad_structured_masks():
  cfg = CONFIGS["base"]
  params = fresh_params("fused", cfg)
  x = randn(0, (2, 3, cfg.d_model))
  with pytest.raises(ConfigError, match="kv_lengths="):
    attn.apply("fused", params, x, cfg=cfg, kv_lengths=jnp.array([1, 4]))
  with pytest.raises(ConfigError, match="is_causal"):
    attn.apply("fused", params, x, cfg=cfg, is_causal="yes")


@pytest.mark.slow
def test_models_outputs_equal_the_dense_mask_path():
  """Models pass is_causal / kv_lengths; the same blocks fed dense masks give the same outputs."""
  cfg = ModelConfig(vocab_size=31, d_model=24, num_layers=2, num_heads=4, d_ff=32, max_len=16,
                    num_kv_heads=2)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 31, (2, 9)))
  norm = lambda n, h: h if n is None else n(h)

  lengths = jnp.array([9, 4])

  @nnx.jit
  def lm_dense(lm, tokens):
    h = lm.embed(tokens)
    for block in lm.blocks:
      h = block(h, attn.causal_mask(9))
    return lm.head(norm(lm.final_norm, h))
  lm = DecoderLM(cfg, rngs=nnx.Rngs(0))
  np.testing.assert_allclose(nnx.jit(lambda m, t: m(t))(lm, tokens), lm_dense(lm, tokens),
                             atol=1e-5, rtol=1e-5)

  @nnx.jit
  def enc_dense(enc, tokens, lengths):
    h = enc.embed(tokens)
    for block in enc.blocks:
      h = block(h, attn.padding_mask(lengths, 9))
    return norm(enc.final_norm, h)
  enc = Encoder(cfg, rngs=nnx.Rngs(1))
  np.testing.assert_allclose(enc.hidden(tokens, lengths_B=lengths),
                             enc_dense(enc, tokens, lengths), atol=1e-5, rtol=1e-5)

  @nnx.jit
  def ed_dense(ed, tokens, tgt, lengths):
    mem = ed.encoder.hidden(tokens, lengths_B=lengths)
    h = ed.tgt_embed(tgt)
    for block in ed.decoder:
      h = block(h, attn.causal_mask(6), mem, attn.padding_mask(lengths, 9))
    return ed.head(norm(ed.decoder_norm, h))
  ed = EncoderDecoder(cfg.replace(num_decoder_layers=1), rngs=nnx.Rngs(2))
  tgt = tokens[:, :6]
  np.testing.assert_allclose(nnx.jit(lambda m, s, t, n: m(s, t, src_lengths=n))(ed, tokens, tgt,
                                                                                lengths),
                             ed_dense(ed, tokens, tgt, lengths), atol=1e-5, rtol=1e-5)


@pytest.mark.slow  # fast sibling: test_every_variant_structured_equals_dense_mask[per_head-True] (the layer)
def test_decoder_lm_on_the_blocked_kernel_equals_einsum(monkeypatch):
  cfg = ModelConfig(vocab_size=31, d_model=24, num_layers=1, num_heads=4, d_ff=32, max_len=16,
                    variant="per_head")
  lm = DecoderLM(cfg, rngs=nnx.Rngs(3))
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 31, (2, 11)))
  einsum = nnx.jit(lambda m, t: m(t))(lm, tokens)
  monkeypatch.setattr(kernel, "BLOCKED_MIN_SCORES", 0)
  np.testing.assert_allclose(nnx.jit(lambda m, t: m(t))(lm, tokens), einsum, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_long_sequence_memory_does_not_grow_with_scores():
  """T = S = 16384, B=1, H=8, K=V=64: forward+backward compiles to buffers of O(T), not O(T·S)."""
  T = 16384
  x = jax.ShapeDtypeStruct((1, T, 8, 64), jnp.float32)
  attend = lambda q, k, v: kernel.attention(q, k, v, impl="blocked")
  grad_of_sum = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v)), argnums=(0, 1, 2)))
  m = grad_of_sum.lower(x, x, x).compile().memory_analysis()
  peak = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
  assert peak <= 256 * 2**20, peak / 2**20
  # With a cotangent argument (as attn bench measures), the temporaries are the saved
  # output (needed for rowsum(dO·O)) plus a few blocks: one (B,T,H,V) float32 array is
  # 32 MB, while a single (B,H,T,S) float32 score array would be 8 GB.
  with_ct = jax.jit(jax.grad(lambda q, k, v, ct: jnp.sum(attend(q, k, v) * ct),
                             argnums=(0, 1, 2)))
  m = with_ct.lower(x, x, x, x).compile().memory_analysis()
  assert m.temp_size_in_bytes <= (32 + 16) * 2**20, m.temp_size_in_bytes / 2**20


# multi-query with biases in the fast tier; grouped heads and no biases slow.
@pytest.mark.parametrize("G,V,use_bias", [(1, 7, True), *(pytest.param(*c, marks=pytest.mark.slow) for c in (
    (1, 7, False), (3, 5, False), (3, 5, True)))])  # grouped heads and multi-query, d_v != d_k
def test_fused_split_projections_equal_the_packed_matmul(G, V, use_bias):
  """fused's long-sequence path (one matmul per column block) = the packed matmul, value and grads."""
  cfg = HeadConfig(d_model=10, num_heads=6, num_kv_heads=G, d_k=3, d_v=V, use_bias=use_bias)
  params = fresh_params("fused", cfg, seed=4)
  x = randn(5, (2, 9, 10))
  cts = randn(6, (2, 9, 6, 3)), randn(7, (2, 9, G, 3)), randn(8, (2, 9, G, V))

  def proj(split):
    loss = lambda p, x: sum(jnp.sum(a * c) for a, c in
                            zip(fused.project_qkv(p, x, None, cfg, split=split), cts))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  (packed, g_packed), (split, g_split) = proj(False)(params, x), proj(True)(params, x)
  np.testing.assert_allclose(split, packed, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(g_split), jax.tree.leaves(g_packed)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_fused_layer_memory_at_16384_holds_no_packed_copies():
  """The fused layer's forward+backward at T = 16384 (attn bench --shapes long): O(T) buffers.

  Arguments and outputs (x, cotangent, dx, weights and their gradients) are 104 MB; the kernel's
  backward loop holds q, k, v, dq and dO (5 × 32 MB). With the packed product's q, k, v slices
  as copies it was 361 MB; one (B,H,T,S) float32 score array alone would be 8 GB.
  """
  cfg = HeadConfig(d_model=512, num_heads=8, d_k=64, d_v=64)
  params = jax.eval_shape(lambda: fused.init(jax.random.PRNGKey(0), cfg))
  x = jax.ShapeDtypeStruct((1, 16384, 512), jnp.float32)
  apply = lambda p, x: fused.apply(p, x, cfg=cfg)[0]  # impl "auto": blocked at this length
  fb = jax.jit(jax.grad(lambda p, x, ct: jnp.sum(apply(p, x) * ct), argnums=(0, 1)))
  peak = peak_bytes(fb.lower(params, x, x).compile())
  assert peak <= 310 * 2**20, peak / 2**20
