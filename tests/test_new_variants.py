"""differential and tpa against naive implementations written here, a loop over heads in plain jnp.

Awkward shapes (d_v != d_k, h not dividing d_model, G < H, cross-attention with
T != S, RoPE, masks that blank whole rows), under jit and grad; decoding through
DecoderLM equals the full forward pass; the HeadConfig fields they read are
refused by name. The generic contract (test_contract, test_count, test_decode)
runs on both too, in the slow tier.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attn
import test_count
from attn import ConfigError, HeadConfig
from attn.nn import DecoderLM
from attn.nn.config import ModelConfig
from attn.variants import cache as kv_cache
from conftest import fresh_params, jit_apply, randn

B = 2

# (cfg, T, S or None for self-attention): grouped kv heads with d_v != d_k, cross-attention and
# RoPE; one kv head, no biases, h not dividing d_model, self-attention.
CASES = {
    "gqa_cross_rope": (HeadConfig(d_model=10, num_heads=4, d_k=4, d_v=5, num_kv_heads=2,
                                  rope_dim=2, rope_theta=7.0, q_rank=3, kv_rank=2), 4, 7),
    "mqa_self_nobias": (HeadConfig(d_model=7, num_heads=3, d_k=2, d_v=3, num_kv_heads=1,
                                   use_bias=False, q_rank=2, kv_rank=3, layer=4), 5, None),
}


def rotate(v_BNK, pos_N, cfg):
  """RoPE written out: dim i < r/2 pairs with i + r/2 and turns by pos·θ^(−2i/r)."""
  r = cfg.rope_dim
  if r == 0:
    return v_BNK
  half = r // 2
  angle = pos_N[:, None] * cfg.rope_theta ** (-2.0 * np.arange(half) / r)
  cos, sin = jnp.cos(angle), jnp.sin(angle)
  a, b = v_BNK[..., :half], v_BNK[..., half:r]
  return jnp.concatenate([a * cos - b * sin, b * cos + a * sin, v_BNK[..., r:]], -1)


def softmax(logits_BTS, keep_BTS):
  """Softmax over the kept keys; a row with none is zeros."""
  z = jnp.where(keep_BTS, logits_BTS, -1e30)
  e = jnp.exp(z - z.max(-1, keepdims=True)) * keep_BTS
  total = e.sum(-1, keepdims=True)
  return jnp.where(total > 0, e / jnp.where(total > 0, total, 1.0), 0.0)


def scores(q_BTK, k_BSK):
  return q_BTK @ k_BSK.swapaxes(-1, -2)


def naive_differential(p, x, c, keep, q_pos, k_pos, cfg):
  """Per head: two softmaxes, their difference, RMSNorm over d_v, (1 − λ_init), W^O."""
  bias = lambda name, *i: p[name][i] if cfg.use_bias else 0.0
  lam_init = 0.8 - 0.6 * math.exp(-0.3 * (cfg.layer - 1))
  lam = (jnp.exp(p["lambda_q1"] @ p["lambda_k1"]) - jnp.exp(p["lambda_q2"] @ p["lambda_k2"])
         + lam_init)
  y, maps = bias("b_o"), []
  for h in range(cfg.num_heads):
    g = h // cfg.group_size
    pair = []
    for i in (0, 1):
      q = rotate(x @ p["w_q"][:, i, h] + bias("b_q", i, h), q_pos, cfg)
      k = rotate(c @ p["w_k"][:, i, g] + bias("b_k", i, g), k_pos, cfg)
      pair.append(softmax(scores(q, k) / math.sqrt(cfg.d_k), keep))
    diff = pair[0] - lam * pair[1]
    o = diff @ (c @ p["w_v"][:, g] + bias("b_v", g))
    o = o / jnp.sqrt(jnp.mean(o ** 2, -1, keepdims=True) + 1e-5) * p["norm"] * (1 - lam_init)
    y = y + o @ p["w_o"][h]
    maps.append(diff)
  return y, jnp.stack(maps, 1)


def naive_tpa(p, x, c, keep, q_pos, k_pos, cfg):
  """Per head: q_h, k_g, v_g as (1/R)·Σ_r a_r[head]·b_r (b^q, b^k rotated), then attention."""
  def factor(name, z, r):  # the r-th factor of every token: (B, N, width)
    return z @ p[f"w_{name}"][:, r] + (p[f"b_{name}"][r] if cfg.use_bias else 0.0)

  def factors(a, b, z, rank, pos=None):  # each rank's head weights a_r and dims b_r, shared by the heads
    dims = [factor(b, z, r) if pos is None else rotate(factor(b, z, r), pos, cfg) for r in range(rank)]
    return [factor(a, z, r) for r in range(rank)], dims

  def head(ab, n):
    return sum(a_r[..., n:n + 1] * b_r for a_r, b_r in zip(*ab)) / len(ab[0])

  fq, fk, fv = (factors("aq", "bq", x, cfg.q_rank, q_pos), factors("ak", "bk", c, cfg.kv_rank, k_pos),
                factors("av", "bv", c, cfg.kv_rank))
  y, maps = (p["b_o"] if cfg.use_bias else 0.0), []
  for h in range(cfg.num_heads):
    g = h // cfg.group_size
    q, k, v = head(fq, h), head(fk, g), head(fv, g)
    w = softmax(scores(q, k) / math.sqrt(cfg.d_k), keep)
    y = y + (w @ v) @ p["w_o"][h]
    maps.append(w)
  return y, jnp.stack(maps, 1)


NAIVE = {"differential": naive_differential, "tpa": naive_tpa}


def inputs(cname, seed=0):
  cfg, T, S = CASES[cname]
  cross = S is not None
  S = S or T
  x, c = randn(seed, (B, T, cfg.d_model)), randn(seed + 1, (B, S, cfg.d_model))
  rng = np.random.default_rng(seed + 2)
  keep = rng.random((B, 1, T, S)) < 0.7
  keep[0, :, 1] = False  # a blank row
  keep[1, :, :, 0] = True
  if not cross:
    keep &= np.tril(np.ones((T, S), bool))
  q_pos = jnp.asarray(rng.integers(0, 9, (T,)))
  k_pos = jnp.arange(S) if cross else q_pos
  return cfg, x, (c if cross else None), jnp.asarray(keep), q_pos, k_pos


def params_of(variant, cfg, seed=1):
  p = fresh_params(variant, cfg, seed)
  return {k: 0.3 * a if k.startswith("lambda") else a for k, a in p.items()}  # λ of order 1


# The fast tier keeps the most awkward case (cross, GQA, RoPE); the slow tier runs every case.
@pytest.mark.parametrize("cname", [c if c == "gqa_cross_rope" else pytest.param(c, marks=pytest.mark.slow)
                                   for c in sorted(CASES)])
@pytest.mark.parametrize("variant", sorted(NAIVE))
def test_equals_the_naive_loop_under_jit_and_grad(variant, cname):
  cfg, x, ctx, keep, q_pos, k_pos = inputs(cname)
  p = params_of(variant, cfg)
  probe = randn(9, (B, x.shape[1], cfg.d_model))

  def ours(p, x):
    y, w = attn.apply(variant, p, x, ctx, cfg=cfg, mask=keep, positions=q_pos, return_weights=True)
    return (y * probe).sum(), (y, w)

  def naive(p, x):
    y, w = NAIVE[variant](p, x, x if ctx is None else ctx, keep[:, 0], q_pos, k_pos, cfg)
    return (y * probe).sum(), (y, w)

  run = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(p, x)
  (_, (y, w)), grads = run(ours)
  (_, (y_ref, w_ref)), grads_ref = run(naive)
  np.testing.assert_allclose(y, y_ref, atol=2e-5 * float(jnp.abs(y_ref).max()))
  np.testing.assert_allclose(w, w_ref, atol=2e-5)
  assert np.all(np.asarray(w)[0, :, 1] == 0.0)  # the blank row has no weights, and gives b_o
  np.testing.assert_allclose(y[0, 1], p["b_o"] if cfg.use_bias else 0.0, atol=1e-6)
  for g, g_ref in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
    np.testing.assert_allclose(g, g_ref, atol=1e-4 * max(1.0, float(jnp.abs(g_ref).max())))


def test_differential_weights_are_the_difference_map():
  cfg, x, ctx, keep, q_pos, _ = inputs("gqa_cross_rope", seed=4)
  p = params_of("differential", cfg)
  _, w = jit_apply("differential", p, x, ctx, cfg=cfg, mask=keep, positions=q_pos,
                   return_weights=True)
  lam = float(attn.variants.differential.lambda_(p, cfg))
  sums = np.asarray(w.sum(-1))
  seen = np.asarray(keep.any(-1))  # (B,1,T): rows with a key
  np.testing.assert_allclose(sums[np.broadcast_to(seen, sums.shape)], 1.0 - lam, atol=1e-5)
  assert np.all(sums[~np.broadcast_to(seen, sums.shape)] == 0.0)
  assert float(w.min()) < 0.0  # signed
  assert attn.VARIANTS["differential"].signed_weights and not attn.VARIANTS["tpa"].signed_weights


def test_lambda_init_follows_the_layer():
  assert attn.variants.differential.lambda_init(1) == pytest.approx(0.2)
  assert attn.variants.differential.lambda_init(2) == pytest.approx(0.8 - 0.6 * math.exp(-0.3))
  cfg, x, _, _, _, _ = inputs("mqa_self_nobias")
  p = params_of("differential", cfg)
  y1, y2 = (jit_apply("differential", p, x, cfg=cfg.replace(layer=l)) for l in (1, 2))
  assert float(jnp.abs(y1 - y2).max()) > 1e-3


def model(variant, **kw):
  cfg = ModelConfig(vocab_size=13, d_model=12, num_layers=2, num_heads=4, d_ff=16, d_k=4, d_v=3,
                    num_kv_heads=2, variant=variant, max_len=10, positional="rope", rope_dim=2,
                    rope_theta=50.0, **kw)
  return DecoderLM(cfg, rngs=nnx.Rngs(0))


@pytest.mark.slow  # a whole model decoded twice; the fast tier's kit decodes every variant's layer
@pytest.mark.parametrize("variant, kw", [("differential", {}), ("tpa", dict(q_rank=3, kv_rank=2))])
def test_decoding_gives_the_full_forward_logits(variant, kw):
  m = model(variant, **kw)
  assert [block.attn.cfg.layer for block in m.blocks] == [1, 2]  # the models set each layer's
  tokens_BT = jnp.asarray(np.random.default_rng(4).integers(0, 13, (2, 6)), jnp.int32)
  full = m(tokens_BT)
  for chunks in ((1,) * 6, (3, 1, 2)):
    m.init_cache(2, 8)
    outs, i = [], 0
    for T in chunks:
      outs.append(m(tokens_BT[:, i:i + T], decode=True))
      i += T
    np.testing.assert_allclose(jnp.concatenate(outs, 1), full, atol=2e-5, rtol=2e-5,
                               err_msg=str(chunks))


def test_caches_hold_their_widths():
  cfg = HeadConfig(d_model=12, num_heads=4, d_k=5, d_v=3, num_kv_heads=2, q_rank=3, kv_rank=2)
  for name, want in (("differential", {"k": (2 * 2, 5), "v": (2, 3)}),
                     ("tpa", {"k_heads": (2, 2), "k_dims": (2, 5), "v_heads": (2, 2),
                              "v_dims": (2, 3)})):
    v = attn.VARIANTS[name]
    c = jax.eval_shape(lambda: kv_cache.init(v, attn.init(name, jax.random.PRNGKey(0), cfg), cfg, 3, 7))
    assert {k: a.shape[2:] for k, a in c.items()} == want
    assert kv_cache.width(c) == v.kv_cache_width(cfg)
  # TPA's point: at H = G = 32, d_k = d_v = 128 the factors are 640 numbers, K and V 8,192.
  big = HeadConfig(d_model=4096, num_heads=32)
  assert attn.VARIANTS["tpa"].kv_cache_width(big) == 2 * (32 + 128) * 2
  assert attn.VARIANTS["per_head"].kv_cache_width(big) == 8192


@pytest.mark.parametrize("name, cfg", [
    # V >= D + 1 with biases: the bias row absorbs the RMSNorm's eps (one dof less per group).
    ("differential", HeadConfig(d_model=2, num_heads=2, d_k=1, d_v=3, num_kv_heads=1)),
    ("tpa", HeadConfig(d_model=4, num_heads=2, d_k=3, d_v=2, num_kv_heads=1, q_rank=2, kv_rank=1,
                       rope_dim=2, rope_theta=3.0)),
], ids=["differential-dv>D", "tpa-rope"])
def test_effective_count_at_more_shapes(name, cfg):
  test_count.test_effective_count_is_the_rank_of_the_jacobian(name, cfg)


def test_tpa_unsaturated_count_is_stored_less_the_gauges():
  cfg = HeadConfig(d_model=64, num_heads=4, d_k=8, d_v=6, num_kv_heads=2, q_rank=3, kv_rank=2)
  v = attn.VARIANTS["tpa"]
  gauges = 3 ** 2 + 2 * 2 ** 2 + 8 ** 2 + 6 ** 2 + 2 * (2 - 1)
  assert v.effective_param_count(cfg) == v.param_count(cfg) - gauges


@pytest.mark.parametrize("field, value", [("q_rank", 0), ("kv_rank", -1), ("q_rank", 2.0),
                                          ("kv_rank", True), ("layer", 0)])
def test_bad_ranks_and_layer_are_refused_by_name(field, value):
  with pytest.raises(ConfigError, match=f"{field}={value!r} is not allowed: a positive integer"):
    HeadConfig(d_model=8, num_heads=2, **{field: value})
  if field == "layer":  # set per layer by the models, not a model setting
    assert not hasattr(ModelConfig, "layer")
    return
  with pytest.raises(ConfigError, match=f"{field}={value!r} is not allowed"):
    ModelConfig(vocab_size=5, d_model=8, num_layers=1, num_heads=2, d_ff=8, variant="tpa",
                **{field: value})


@pytest.mark.parametrize("variant", ["differential", "tpa"])
def test_circuits_say_why_there_is_no_w_qk(variant):
  cfg = CASES["gqa_cross_rope"][0]
  with pytest.raises(ConfigError, match=f"variant='{variant}' is not allowed: .*W_QK"):
    attn.analysis.circuits(variant, params_of(variant, cfg), cfg)
