"""The lightning indexer in DeepSeek-V3.2's form (extra.indexer.form = "deepseek", on mla).

Its choice against a second implementation in numpy written from transformers' DeepseekV32Indexer
(index queries from the RMS-normed query latent, a LayerNorm'd index key, RoPE on the first
rope_dim dims in either layout, weights · n_I^-1/2, scores · d_I^-1/2, ReLU, top-k with the lower
index winning ties); cached decoding (index keys cached beside the latent) against the full pass;
refusals; counts. Awkward shapes: d_v ≠ d_k, G = H (mla), d_model not a multiple of H, padding.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn import api
from attn.config import ConfigError, HeadConfig
from attn.variants import cache as kv_cache
from attn.variants import mla
from attn.kernel import sparse as kernel_sparse
from attn.variants.mechanisms import selection
from attn.variants.base import Options
from attn.variants.mechanisms import MECHANISMS
from conftest import fresh_params

IX = {"heads": 5, "head_dim": 6, "top_k": 4, "form": "deepseek"}
CFG = HeadConfig(d_model=22, num_heads=3, d_k=7, d_v=5, num_kv_heads=3, rope_dim=4, rope_theta=50.0, latent_dim=6,
                 q_latent_dim=9, latent_norm_eps=1e-6, rope_layout="interleaved", extra={"indexer": IX})


# attn.apply compiled whole: run op by op, the indexer's many small ops each compile on their own.
_apply = jax.jit(api.apply, static_argnums=0, static_argnames=("cfg", "return_weights", "is_causal"))


def _randn(seed, shape):
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _params(cfg, seed=0):
  p = fresh_params("mla", cfg, seed)  # numpy draws: init's jax draws compile a program of ~0.7 s CPU
  rng = np.random.default_rng(seed + 100)  # the norms away from their init, so that reading them matters
  for n in ("idk_norm", "idk_bias", "q_latent_norm"):
    p[n] = jnp.asarray(1.0 * (n != "idk_bias") + 0.5 * rng.standard_normal(p[n].shape).astype(np.float32))
  return p


def _rotate(a, pos, r, theta, layout):
  """RoPE on the first r dims of a (..., T, [N,] I), as transformers' rotate_half / interleaved pairs."""
  omega = theta ** (-np.arange(0, r, 2) / r)
  ang = pos[:, None] * omega
  if a.ndim == 4:
    ang = ang[:, None]
  cos, sin = np.cos(ang), np.sin(ang)
  a = a.astype(np.float64).copy()
  i1, i2 = (np.arange(0, r, 2), np.arange(1, r, 2)) if layout == "interleaved" else (np.arange(r // 2),
                                                                                       np.arange(r // 2, r))
  x1, x2 = a[..., i1].copy(), a[..., i2].copy()
  a[..., i1], a[..., i2] = x1 * cos - x2 * sin, x2 * cos + x1 * sin
  return a


def _numpy_choice(p, x, cfg, lengths):
  """(B,T,S) bool: each query's top_k visible keys by DeepseekV32Indexer's score, in float64."""
  o = selection.options_of(cfg)
  J, I, k, r = o["heads"], o["head_dim"], o["top_k"], cfg.rope_dim
  p = {n: np.asarray(a, np.float64) for n, a in p.items()}
  x = np.asarray(x, np.float64)
  B, T, _ = x.shape
  lat = x @ p["w_dq"]
  lat = lat / np.sqrt((lat ** 2).mean(-1, keepdims=True) + cfg.latent_norm_eps) * p["q_latent_norm"]
  q = _rotate(np.einsum("btq,qji->btji", lat, p["w_idq"]), np.arange(T), r, cfg.rope_theta, o["rope_layout"])
  kk = x @ p["w_idk"]
  kk = (kk - kk.mean(-1, keepdims=True)) / np.sqrt(kk.var(-1, keepdims=True) + 1e-6) * p["idk_norm"] + p["idk_bias"]
  kk = _rotate(kk, np.arange(T), r, cfg.rope_theta, o["rope_layout"])
  w = x @ p["w_idw"] * J ** -0.5
  score = np.einsum("btj,btjs->bts", w, np.maximum(np.einsum("btji,bsi->btjs", q, kk) * I ** -0.5, 0))
  s, t = np.arange(T)[None, None, :], np.arange(T)[None, :, None]
  seen = (s <= t) & (s < np.asarray(lengths)[:, None, None])
  score = np.where(seen, score, -np.inf)
  out = np.zeros((B, T, T), bool)
  for b in range(B):
    for i in range(T):
      order = np.argsort(-score[b, i], kind="stable")  # the lower index first among equals
      chosen = [j for j in order[:k] if seen[b, i, j]]
      out[b, i, chosen] = True
  return out


@pytest.mark.parametrize("layout", ["interleaved", pytest.param("half", marks=pytest.mark.slow)])  # one fast
def test_choice_equals_a_numpy_deepseek_indexer(layout):
  """The keys each query attends to (weights > 0, the same for every head) are the numpy indexer's, under
  right padding; the same model with every key selected is mla without the indexer, bit for bit."""
  cfg = CFG.replace(extra={"indexer": IX | {"rope_layout": layout}})
  p = _params(cfg)
  x = _randn(1, (2, 11, cfg.d_model))
  lengths = jnp.array([11, 7])
  y, w = _apply("mla", p, x, cfg=cfg, is_causal=True, kv_lengths=lengths, return_weights=True)
  got = np.asarray(w > 0)
  assert (got == got[:, :1]).all()  # one set for every head
  want = _numpy_choice(p, x, cfg, lengths)
  np.testing.assert_array_equal(got[:, 0], want)
  assert want.sum(-1).max() == 4 and want.sum(-1).min() == 1
  other = cfg.replace(extra={"indexer": IX | {"rope_layout": {"half": "interleaved"}[layout]}} if layout == "half"
                      else {"indexer": IX})
  assert not np.array_equal(_numpy_choice(p, x, other, lengths), want)  # the layout matters here
  every = cfg.replace(extra={"indexer": IX | {"top_k": 11}})
  plain = cfg.replace(extra=None)
  own = {n: a for n, a in p.items() if not n.startswith(("w_id", "idk_"))}
  np.testing.assert_array_equal(_apply("mla", p, x, cfg=every, is_causal=True, kv_lengths=lengths),
                                _apply("mla", own, x, cfg=plain, is_causal=True, kv_lengths=lengths))


@pytest.mark.slow
def test_cached_decoding_equals_the_full_pass():
  """Prefill 4 tokens, then 3 steps of 1 and one of 2 through the cache (latent, RoPE key, index key):
  outputs equal the causal full pass; the cache is kv_cache_width wide and the absorbed form agrees."""
  cfg = CFG
  p = _params(cfg, 3)
  x = jnp.asarray(_randn(4, (2, 9, cfg.d_model)))
  full, _ = mla.apply(p, x, cfg=cfg, opts=Options(is_causal=True))
  absorbed, _ = mla.decode_apply(p, x, cfg=cfg, opts=Options(is_causal=True))
  np.testing.assert_allclose(absorbed, full, atol=1e-5)
  c = kv_cache.init(mla.VARIANT, p, cfg, 2, 12)
  assert {n: a.shape[-1] for n, a in c.items()} == {"latent": 6, "k_rope": 4, "index_key": 6}
  assert kv_cache.width(c) == mla.kv_cache_width(cfg) == 6 + 4 + 6
  outs, index = [], 0
  for n in (4, 1, 1, 1, 2):
    y, c = kv_cache.decode_step(mla.VARIANT, p, x[:, index:index + n], c, index, cfg=cfg)
    outs.append(y)
    index += n
  np.testing.assert_allclose(jnp.concatenate(outs, 1), full, atol=1e-5)
  dense = cfg.replace(extra={"indexer": IX | {"top_k": 9}})  # and the selection changed the output
  assert not np.allclose(mla.apply(p, x, cfg=dense, opts=Options(is_causal=True))[0], full, atol=1e-3)


@pytest.mark.parametrize("variant,changes,match", [
    ("per_head", {}, r"extra\.indexer\.form='deepseek'.*query latent"),
    ("mla", {"q_latent_dim": None}, r"extra\.indexer\.form='deepseek'.*query latent"),
    ("mla", {"extra": {"indexer": IX | {"head_dim": 3}}}, r"extra\.indexer\.head_dim=3.*even number >= rope_dim=4"),
    ("mla", {"extra": {"indexer": IX | {"form": "v32"}}}, r"extra\.indexer\.form='v32'.*\['heads', 'deepseek'\]"),
    ("mla", {"extra": {"indexer": IX | {"rope_layout": "odd"}}}, r"extra\.indexer\.rope_layout='odd'"),
    ("per_head", {"extra": {"indexer": {"rope_layout": "interleaved"}}}, r"rope_layout='interleaved'.*form 'heads'"),
    ("mla", {"extra": {"indexer": {}}}, r"extra\.indexer=.*absent for mla: .*form 'deepseek'"),
])
def test_refused_by_name(variant, changes, match):
  cfg = CFG.replace(**changes)
  if variant == "per_head":
    cfg = cfg.replace(q_latent_dim=None, latent_dim=None, latent_norm_eps=None)
  with pytest.raises(ConfigError, match=match):
    api.check_config(variant, cfg)


def test_param_count_is_the_stored_trees():
  shapes = api.param_shapes("mla", CFG)
  stored = sum(int(np.prod(shapes[n])) for n in ("w_idq", "w_idk", "w_idw", "idk_norm", "idk_bias"))
  assert MECHANISMS["indexer"].param_count(CFG) == stored == 9 * 5 * 6 + 22 * (6 + 5) + 2 * 6


@pytest.mark.slow
def test_the_selection_has_no_gradient():
  """The indexer's parameters get no gradient from the attention (DSA trains them apart)."""
  p = _params(CFG, 5)
  x = jnp.asarray(_randn(6, (1, 8, CFG.d_model)))
  g = jax.grad(lambda p: api.apply("mla", p, x, cfg=CFG, is_causal=True).sum())(p)
  assert all(not np.any(g[n]) for n in ("w_idq", "w_idk", "w_idw", "idk_norm", "idk_bias"))
  assert np.any(g["w_dq"]) and np.any(g["q_latent_norm"])


@pytest.mark.slow
def test_kit_on_mla_with_the_deepseek_indexer():
  """attn.testing.check_variant on mla with the deepseek-form indexer (calls, masks, grads, bf16, decoding in
  chunks, counts against XLA's FLOPs), in both index RoPE layouts, with and without biases."""
  from attn.testing import check_variant
  check_variant("mla", configs=(
      CFG, CFG.replace(use_bias=True, rope_layout="half", extra={"indexer": IX | {"rope_layout": "interleaved",
                                                                               "top_k": 2, "head_dim": 4}})))


@pytest.mark.slow
def test_sparse_path_at_long_T_equals_the_dense_path(monkeypatch):
  """T = 600 (T·S past kernel.BLOCKED_MIN_SCORES: "auto" takes attn.kernel.sparse, the chosen keys only) against
  impl="einsum" (the selection as a dense mask), with padding; and mla's absorbed form (one latent kv head) too."""
  calls = []
  monkeypatch.setattr(kernel_sparse, "attention",
                      lambda *a, run=kernel_sparse.attention, **kw: calls.append(1) or run(*a, **kw))
  cfg = CFG.replace(d_model=16, extra={"indexer": IX | {"top_k": 40}})
  p = _params(cfg, 7)
  x = jnp.asarray(_randn(8, (2, 600, 16)))
  opts = Options(is_causal=True, kv_lengths=jnp.array([600, 333]))
  dense, _ = jax.jit(lambda p, x: mla.apply(p, x, cfg=cfg, opts=opts.replace(impl="einsum")))(p, x)
  for fn in (mla.apply, mla.decode_apply):
    got, _ = jax.jit(lambda p, x, fn=fn: fn(p, x, cfg=cfg, opts=opts))(p, x)
    np.testing.assert_allclose(got, dense, atol=1e-5)
  assert len(calls) == 2


def test_index_heads_rotating_their_last_dims_and_the_key_norm_eps():
  """extra.indexer.rope_dims 'last' (HY-V4's index heads) rotates each index query's and key's last rope_dim dims
  (numpy: the first-dims rotation applied to the dims moved to the front and back), norm_eps is the index key
  LayerNorm's epsilon; 'first' and 1e-6 (the defaults) give other keys here."""
  ix = IX | {"rope_dims": "last", "norm_eps": 0.3, "rope_layout": "interleaved"}  # HY-V4's layout
  cfg = CFG.replace(extra={"indexer": ix})
  p = _params(cfg)
  x = _randn(2, (2, 6, cfg.d_model))
  pos = np.arange(6)
  I, r = IX["head_dim"], cfg.rope_dim
  pn = {n: np.asarray(a, np.float64) for n, a in p.items()}
  kk = np.asarray(x, np.float64) @ pn["w_idk"]
  kk = (kk - kk.mean(-1, keepdims=True)) / np.sqrt(kk.var(-1, keepdims=True) + 0.3) * pn["idk_norm"] + pn["idk_bias"]

  def last(a):  # rotate the last r dims: move them first, rotate the first r, move them back
    moved = np.concatenate([a[..., I - r:], a[..., :I - r]], -1)
    out = _rotate(moved, pos, r, cfg.rope_theta, "interleaved")
    return np.concatenate([out[..., r:], out[..., :r]], -1)

  # compiled whole (eager, each small op compiles on its own)
  index_keys = jax.jit(selection.index_keys, static_argnums=3)
  index_queries = jax.jit(selection.index_queries, static_argnums=4)
  np.testing.assert_allclose(np.asarray(index_keys(p, x, jnp.asarray(pos), cfg)), last(kk), atol=1e-5)
  lat = np.asarray(x, np.float64) @ pn["w_dq"]
  lat = lat / np.sqrt((lat ** 2).mean(-1, keepdims=True) + cfg.latent_norm_eps) * pn["q_latent_norm"]
  qi, _ = index_queries(p, x, jnp.asarray(lat, jnp.float32), jnp.asarray(pos), cfg)
  want = last(np.einsum("btq,qji->btji", lat, pn["w_idq"])) * I ** -0.5
  np.testing.assert_allclose(np.asarray(qi), want, atol=1e-5)
  first = CFG.replace(extra={"indexer": IX | {"norm_eps": 0.3, "rope_layout": "interleaved"}})
  assert not np.allclose(np.asarray(index_keys(p, x, jnp.asarray(pos), first)), last(kk), atol=1e-3)
  for bad, match in (({"rope_dims": "middle"}, r"extra.indexer.rope_dims='middle'.*'first', 'last'"),
                     ({"norm_eps": 0}, r"extra.indexer.norm_eps=0"),
                     ({"form": "heads", "rope_dims": "last"}, r"extra.indexer.rope_dims, norm_eps=\('last', 1e-06\)")):
    with pytest.raises(ConfigError, match=match):
      api.check_config("mla", CFG.replace(extra={"indexer": IX | bad}))
