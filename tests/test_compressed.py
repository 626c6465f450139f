"""Compressed keys and values (DeepSeek-V4's CSA/HCA layout): the kernel against a naive reference
written here, the variant's decoding against its full pass, the refusals."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn.config import ConfigError
from attn.kernel import compressed as ck_kernel


def _rand(seed, shape, dtype=jnp.float32):
  """N(0,1) drawn with numpy, cast on the host: jax's draws compile one program per shape."""
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(np.float32).astype(dtype))


# The naive reference: loops over entries and (query, key) pairs, written apart from the kernel.

def naive_pool(c, z, bias, m):
  """c, z (B,S,P,G,X), bias (P,m,G,X): entry n = Σ softmax(z + b) c over its slots, by loops."""
  c, z, bias = (np.asarray(a, np.float64) for a in (c, z, bias))
  B, S, P, G, X = c.shape
  out = np.zeros((B, S // m, G, X))
  for n in range(S // m):
    slots_c, slots_z = [], []
    if P == 2 and n > 0:
      for j in range(m):
        slots_c.append(c[:, (n - 1) * m + j, 0])
        slots_z.append(z[:, (n - 1) * m + j, 0] + bias[0, j])
    for j in range(m):
      slots_c.append(c[:, n * m + j, P - 1])
      slots_z.append(z[:, n * m + j, P - 1] + bias[P - 1, j])
    zz = np.stack(slots_z)
    w = np.exp(zz - zz.max(0))
    w /= w.sum(0)
    out[:, n] = (w * np.stack(slots_c)).sum(0)
  return out


def naive_visible(B, H, T, S, N, m, span, *, causal, lengths, window, mask):
  """(B,H,T,S+N) booleans by loops: a token by causality, length, window, mask; an entry when every
  token it pools is visible ignoring the window."""
  out = np.zeros((B, H, T, S + N), bool)
  for b, h, t in itertools.product(range(B), range(H), range(T)):
    p = t + S - T

    def tok(s, win=True):
      ok = s < (S if lengths is None else lengths[b])
      ok &= (not causal) or s <= p
      ok &= (not win) or window is None or abs(p - s) < window
      ok &= mask is None or bool(mask[b, h, t, s])
      return ok

    for s in range(S):
      out[b, h, t, s] = tok(s)
    for n in range(N):
      first = max(0, (n + 1) * m - span)
      out[b, h, t, S + n] = all(tok(s, win=False) for s in range(first, (n + 1) * m))
  return out


def naive_attention(q, k, v, ck, cv, vis, scale, sinks):
  """jnp, dense: softmax over the visible [tokens | entries] (and sinks), fully hidden rows 0."""
  H, G = q.shape[2], k.shape[2]
  kk = jnp.repeat(jnp.concatenate([k, ck], 1), H // G, axis=2)
  vv = jnp.repeat(jnp.concatenate([v, cv], 1), H // G, axis=2)
  logits = jnp.einsum("bthk,bshk->bhts", q, kk) * scale
  logits = jnp.where(vis, logits, -1e30)
  mx = logits.max(-1, keepdims=True)
  if sinks is not None:
    mx = jnp.maximum(mx, sinks[None, :, None, None])
  e = jnp.where(vis, jnp.exp(logits - mx), 0.0)
  den = e.sum(-1, keepdims=True)
  if sinks is not None:
    den = den + jnp.exp(sinks[None, :, None, None] - mx)
  p = e / jnp.where(den > 0, den, 1.0)
  return jnp.einsum("bhts,bshv->bthv", p, vv)


CASES = [  # B, T, S, H, G, K, V, m, span, causal, window, lengths, sinks, mask
    (2, 11, 11, 4, 1, 8, 8, 4, 4, True, 3, (11, 6), True, False),   # one shared wide kv head
    (2, 13, 13, 6, 2, 5, 7, 3, 6, True, 4, None, False, False),    # overlap, d_v != d_k
    (1, 7, 10, 3, 3, 4, 4, 4, 4, True, None, None, True, True),    # cache-like S > T, dense mask
    (2, 9, 9, 2, 1, 6, 3, 2, 2, False, 2, (9, 5), True, False),    # bidirectional, lengths
]


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow if i else ())
                                  for i, c in enumerate(CASES)])
def test_kernel_matches_naive_in_values_and_gradients(case):
  B, T, S, H, G, K, V, m, span, causal, window, lengths, use_sinks, use_mask = case
  N = S // m
  q, k, v = _rand(1, (B, T, H, K)), _rand(2, (B, S, G, K)), _rand(3, (B, S, G, V))
  ck, cv = _rand(4, (B, N, G, K)), _rand(5, (B, N, G, V))
  sinks = _rand(6, (H,)) if use_sinks else None
  mask = np.array(jax.random.bernoulli(jax.random.PRNGKey(7), 0.8, (B, H, T, S))) if use_mask else None
  if mask is not None:
    mask[0, 0, 2] = False  # a row that sees no token (nor any entry)
  lens = None if lengths is None else np.asarray(lengths)
  vis = naive_visible(B, H, T, S, N, m, span, causal=causal, lengths=lens, window=window, mask=mask)
  scale = K ** -0.5
  kw = dict(m=m, span=span, mask=None if mask is None else jnp.asarray(mask), is_causal=causal,
            kv_lengths=None if lens is None else jnp.asarray(lens), scale=scale, window=window,
            sinks=sinks)

  def ref(q, k, v, ck, cv):
    return naive_attention(q, k, v, ck, cv, vis, scale, sinks)

  def run(impl):
    return lambda q, k, v, ck, cv: ck_kernel.attention(q, k, v, ck, cv, impl=impl, block_q=4,
                                                       block_k=3, **kw)

  # Everything compiled whole: op by op, the blocked kernel's loops and their gradients compile each
  # small op on its own (several times the CPU).
  # Values and gradients from one program a function.
  args = (q, k, v, ck, cv)
  dout = _rand(8, (B, T, H, V))

  def value_and_grads(f):
    def loss(*a):
      y = f(*a)
      return jnp.sum(y * dout), y
    (_, y), g = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(5)), has_aux=True))(*args)
    return y, g
  want, g_want = value_and_grads(ref)
  for impl in ("einsum", "blocked"):
    got, g_got = value_and_grads(run(impl))
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5, err_msg=impl)
    for name, a, b in zip("q k v ck cv".split(), g_got, g_want):
      np.testing.assert_allclose(a, b, atol=5e-5, rtol=5e-5, err_msg=f"{impl} d{name}")


def test_comp_block_ranges():
  """The blocks the loops visit: a query block sees the compressed blocks that have ended for its
  last query, and a compressed block is read back by the query blocks from its first ended one."""
  from attn.kernel.plan import comp_blocks_for, comp_query_blocks_for, plan_for
  import dataclasses
  plan = dataclasses.replace(plan_for(40, 40, 8, 8, is_causal=True, window=4), cm=4, N=10, bc=3)
  assert plan.nc == 4
  # query block i ends at position 8i + 7: entries n < (8i + 8) // 4 = 2i + 2, in blocks of 3
  assert [int(comp_blocks_for(plan, i, 40)[1]) for i in range(5)] == [1, 2, 2, 3, 4]
  assert [int(comp_blocks_for(plan, i, 13)[1]) for i in range(5)] == [1, 1, 1, 1, 1]  # kv length 13
  # entry 3j ends at position 12j + 3: the query blocks from (12j + 3) // 8
  assert [int(comp_query_blocks_for(plan, j)[0]) for j in range(4)] == [0, 1, 3, 4]


@pytest.mark.slow
def test_blocked_visits_only_ended_blocks():
  """At a long T the blocked path runs without any T×S array: its compiled temporaries stay far
  below the (T, S + N) float32 scores, and it equals the einsum path."""
  B, T, H, G, K, m, w = 1, 1024, 2, 1, 16, 16, 64
  N = T // m
  q, k, v = _rand(1, (B, T, H, K)), _rand(2, (B, T, G, K)), _rand(3, (B, T, G, K))
  ck, cv = _rand(4, (B, N, G, K)), _rand(5, (B, N, G, K))
  kw = dict(m=m, is_causal=True, scale=0.25, window=w)
  f = jax.jit(lambda *a: ck_kernel.attention(*a, impl="blocked", **kw))
  mem = f.lower(q, k, v, ck, cv).compile().memory_analysis()
  if mem is not None:
    assert mem.temp_size_in_bytes < B * H * T * (T + N) * 4 / 4
  np.testing.assert_allclose(f(q, k, v, ck, cv),
                             ck_kernel.attention(q, k, v, ck, cv, impl="einsum", **kw), atol=2e-5)


def test_pool_matches_naive():
  for P, S, m in ((1, 11, 4), (2, 13, 3), (1, 3, 4)):
    c, z = _rand(1, (2, S, P, 2, 3)), _rand(2, (2, S, P, 2, 3))
    bias = _rand(3, (P, m, 2, 3))
    pool = jax.jit(ck_kernel.pool, static_argnums=3)  # compiled whole (eager, each small op compiles alone)
    np.testing.assert_allclose(pool(c, z, bias, m), naive_pool(c, z, bias, m), atol=1e-5)


@pytest.mark.parametrize("m", [0, -2, 1.5, True])
def test_bad_block_refused(m):
  q = jnp.zeros((1, 4, 1, 2))
  with pytest.raises(ConfigError, match="compress_block"):
    ck_kernel.attention(q, q, q, q[:, :1], q[:, :1], m=m, scale=1.0)


# The variant

from attn import api  # noqa: E402
from attn.config import HeadConfig  # noqa: E402
from attn.testing import check_variant  # noqa: E402
from attn.variants import VARIANTS, cache  # noqa: E402
from attn.variants.base import Options  # noqa: E402


def _cfg(**kw):
  base = dict(d_model=24, num_heads=4, d_k=8, d_v=6, num_kv_heads=1, compress_block=3, sinks=True,
              window=4, rope_dim=4)
  return HeadConfig(**{**base, **kw})


@pytest.mark.slow
@pytest.mark.parametrize("kw", [dict(), dict(compress_overlap=True, window=None, d_v=8),
                                dict(compress_block=4, compress_overlap=True, rope_dim=0, sinks=False)])
def test_decoding_equals_full_pass(kw):
  """Token by token and in uneven chunks (prompt longer than a block, steps across block ends)
  through the compressed cache equals the causal full pass (the fast tier: the contract kit's
  decoding at the default block of 4, tests/test_contract.py)."""
  cfg = _cfg(**kw)
  v = VARIANTS["compressed"]
  p = jax.tree.map(lambda a: a + 0.3 * _rand(9, a.shape), api.init(v, jax.random.PRNGKey(0), cfg))
  x = _rand(1, (2, 13, cfg.d_model))
  full, _ = v.apply(p, x, cfg=cfg, opts=Options(is_causal=True))
  step = jax.jit(lambda p, x, c, i: cache.decode_step(v, p, x, c, i, cfg=cfg))
  for chunks in ([5] + [1] * 8, [4, 3, 6], [13]):
    c, i, ys = cache.init(v, p, cfg, 2, 14), 0, []
    for n in chunks:
      y, c = step(p, x[:, i:i + n], c, jnp.asarray(i))
      ys.append(y)
      i += n
    np.testing.assert_allclose(jnp.concatenate(ys, 1), full, atol=3e-5, rtol=3e-5, err_msg=str(chunks))
    assert int((np.abs(c["ck"]).sum((0, 2, 3)) > 0).sum()) == 13 // cfg.compress_block


@pytest.mark.slow
def test_variant_kit_with_overlap_and_small_blocks():
  """The kit (the contract test runs it at the default block of 4) at blocks of 2 and 3, the
  overlap, a window, and gate, QK-norm and softcap on."""
  check_variant("compressed", configs=(
      HeadConfig(d_model=24, num_heads=6, d_k=5, d_v=7, num_kv_heads=2, compress_block=2,
                 compress_overlap=True, window=3, rope_dim=4),
      HeadConfig(d_model=16, num_heads=4, d_k=6, d_v=5, num_kv_heads=1, use_bias=False,
                 compress_block=3, gate="headwise", qk_norm=True, softcap=5.0)))


@pytest.mark.parametrize("kw, field", [
    (dict(compress_block=0), "compress_block"), (dict(compress_block=-4), "compress_block"),
    (dict(compress_overlap="yes"), "compress_overlap"),
    (dict(probability="sigmoid"), "probability"),
    (dict(extra={"indexer": {"heads": 2, "head_dim": 3, "top_k": 3}}, window=None), "extra")])
def test_bad_config_refused(kw, field):
  with pytest.raises(ConfigError, match=field):
    api.check_config("compressed", _cfg(**kw))


def test_other_variants_refuse_compress_block():
  with pytest.raises(ConfigError, match="compress_block"):
    api.check_config("per_head", HeadConfig(d_model=8, num_heads=2, compress_block=4))


# Counts (attn count)

from attn import count  # noqa: E402
from attn.count import measured  # noqa: E402


@pytest.mark.parametrize("kw", [dict(), dict(window=None, compress_overlap=True), dict(compress_block=5)])
def test_cache_elements_are_what_the_cache_holds(kw):
  cfg = _cfg(**kw)
  v = VARIANTS["compressed"]
  for L in (1, 3, 7, 12, 31):
    held = jax.eval_shape(lambda: cache.init(v, {}, cfg, 1, L))
    assert v.kv_cache_elements(cfg, L) == sum(int(np.prod(s.shape)) for s in held.values()), L
  G, KV, m = cfg.num_kv_heads, cfg.d_k + cfg.d_v, cfg.compress_block
  grow = 4 * G * KV * ((1 if cfg.window is None else 0) + 1 / m)  # float32 bytes a token, long run
  assert 0 <= count.kv_cache_bytes_per_token("compressed", cfg, "float32") - grow < 1
  assert count.kv_cache_bytes("compressed", cfg, 31, "float32") == 4 * v.kv_cache_elements(cfg, 31)
  assert "kv_cache" not in count.measured_figures("compressed", cfg)


@pytest.mark.slow
def test_flops_and_params_against_xla_and_the_stored_tree():
  wide = dict(d_model=48, num_heads=4, d_k=12, d_v=20, num_kv_heads=2, rope_dim=0, sinks=False)
  for cfg, T, S in ((_cfg(compress_overlap=True, **wide), 6, 14), (_cfg(compress_block=5, **wide), 9, 9)):
    assert count.param_counts("compressed", cfg)["analytic"] == measured.stored("compressed", cfg)
    want, got = count.flops("compressed", cfg, T, S), measured.flops("compressed", cfg, T, S)
    assert abs(got - want) <= 0.1 * want, (cfg, want, got)


def test_params_closed_form_is_the_stored_tree():
  cfg = _cfg(compress_overlap=True, use_bias=False)
  assert count.param_counts("compressed", cfg)["analytic"] == measured.stored("compressed", cfg)


@pytest.mark.slow
def test_variant_at_long_T_takes_the_blocked_path_and_agrees():
  """At T·(S+N) past the blocked threshold the layer runs the blocked kernel (no weights), equal to
  the einsum path its weights-out call takes, with right padding (kv_lengths)."""
  cfg = _cfg(d_model=16, num_heads=2, d_k=8, d_v=8, compress_block=8, window=32)
  p = jax.tree.map(lambda a: a + 0.3 * _rand(9, a.shape), api.init("compressed", jax.random.PRNGKey(0), cfg))
  x = _rand(1, (2, 600, 16))
  opts = Options(is_causal=True, kv_lengths=jnp.array([600, 451]))
  y_blocked, _ = jax.jit(lambda p, x: VARIANTS["compressed"].apply(p, x, cfg=cfg, opts=opts))(p, x)
  y_einsum, w = jax.jit(lambda p, x: VARIANTS["compressed"].apply(
      p, x, cfg=cfg, opts=opts.replace(return_weights=True)))(p, x)
  np.testing.assert_allclose(y_blocked, y_einsum, atol=3e-5)
  assert w.shape == (2, 2, 600, 600) and float(jnp.abs(w[1, :, :, 451:]).max()) == 0.0


@pytest.mark.parametrize("kind", ["heavily_compressed_attention",
                                  pytest.param("compressed_sparse_attention", marks=pytest.mark.slow)])
def test_pooling_and_causality_match_transformers_deepseek_v4(kind):
  """V4's compressors (HCA: blocks of m; CSA: 2m slots at stride m) give our entries, with the same
  weights: transformers' output un-rotated (its own RoPE with -sin) equals pool + norm, and its
  block bias is our causal entry mask. Skipped where transformers lacks deepseek_v4."""
  mod = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
  torch = pytest.importorskip("torch")
  from transformers import DeepseekV4Config
  from attn.variants import compressed as variant
  hf_cfg = DeepseekV4Config(hidden_size=16, head_dim=8, num_attention_heads=2, q_lora_rank=8,
                            index_n_heads=2, index_head_dim=4, index_topk=64, num_hidden_layers=2,
                            vocab_size=10, partial_rotary_factor=0.5,
                            compress_rates={"compressed_sparse_attention": 3,
                                            "heavily_compressed_attention": 4})
  comp = (mod.DeepseekV4HCACompressor if kind.startswith("heavily") else mod.DeepseekV4CSACompressor)(hf_cfg)
  g = torch.Generator().manual_seed(0)
  with torch.no_grad():
    for p in comp.parameters():
      p.copy_(torch.randn(p.shape, generator=g) * 0.5)
  m, hd = comp.compress_rate, 8
  P = 1 if kind.startswith("heavily") else 2
  B, T = 2, 11
  x = torch.randn(B, T, 16, generator=g)
  pos = torch.arange(T).unsqueeze(0).expand(B, -1)
  with torch.no_grad():
    out, block_bias = comp(x, torch.randn(B, T, 8, generator=g), pos, None, 0)
    N = out.shape[2]
    cos, sin = comp.rotary_emb(out, position_ids=(torch.arange(N) * m).unsqueeze(0).expand(B, -1),
                               layer_type="compress")
    want = mod.apply_rotary_pos_emb(out, cos, -sin)[:, 0].numpy()
  t = lambda a: jnp.asarray(a.detach().numpy())
  w = lambda lin: t(lin.weight).T.reshape(16, P, 1, hd)
  params = {"w_ck": w(comp.kv_proj), "w_zk": w(comp.gate_proj), "n_ck": t(comp.kv_norm.weight)[None],
            "b_ck": t(comp.position_bias).reshape(m, P, 1, hd).transpose(1, 0, 2, 3)}
  c_k, z_k = (variant._project(jnp.asarray(x.numpy()), params[n]) for n in ("w_ck", "w_zk"))
  got = variant._norm(ck_kernel.pool(c_k, z_k, params["b_ck"], m), params["n_ck"])[:, :, 0]
  assert N == T // m
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
  # CSA's bias also carries the indexer's top-k, which keeps every ended entry at index_topk >= N
  if block_bias is not None:
    ours = np.broadcast_to(ck_kernel.structured_entries(T, T, N, m, True, None), (B, 1, T, N))
    np.testing.assert_array_equal(np.isfinite(block_bias.numpy()), ours)
