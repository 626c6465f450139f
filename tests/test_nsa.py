"""Native Sparse Attention (attn.variants.nsa) against a naive reference written here: per-query loops
for the choice, dense masks for the three softmaxes; values and gradients, the sparse path, refusals."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn import api, kernel
from attn.config import ConfigError, HeadConfig
from attn.testing import check_mechanism, check_variant
from attn.variants.mechanisms import nsa
from attn.variants.base import Options, core
from conftest import fresh_params

OPTS = {"compress_block": 4, "compress_stride": 3, "select_block": 3, "select_count": 3, "window": 4}


def _randn(seed, shape, scale=1.0):
  return jnp.asarray(scale * np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


def _cfg(**o):
  return HeadConfig(d_model=10, num_heads=6, d_k=5, d_v=7, num_kv_heads=2, extra={"nsa": {**OPTS, **o}})


# The reference: the paper's rules, one query at a time.

def _visible(b, h, t, *, T, S, causal, lengths, mask):
  keep = []
  for s in range(S):
    ok = s < lengths[b] and (not causal or s <= t + S - T)
    if mask is not None:
      ok = ok and bool(mask[b % mask.shape[0], h % mask.shape[1], t % mask.shape[2], s])
    keep.append(ok)
  return np.array(keep)


def _choice(B, H, T, S, G, o, causal, lengths, mask, probs):
  """Per (b, h, t): keys of the selected blocks, keys of the window, usable compressed blocks; and
  the compressed probabilities' block scores from `probs` (b, h, t) -> (N_c,) numpy."""
  l, d, sb, n, w = (o[k] for k in ("compress_block", "compress_stride", "select_block", "select_count",
                                    "window"))
  Nc = 0 if S < l else (S - l) // d + 1
  Ns = -(-S // sb)
  R = H // G
  over = np.array([[len(set(range(i * d, i * d + l)) & set(range(j * sb, min((j + 1) * sb, S))))
                    for j in range(Ns)] for i in range(Nc)], float).reshape(Nc, Ns)
  sel = np.zeros((B, H, T, S), bool)
  win = np.zeros((B, H, T, S), bool)
  for b, g, t in itertools.product(range(B), range(G), range(T)):
    vis = [_visible(b, h, t, T=T, S=S, causal=causal, lengths=lengths, mask=mask) for h in range(g * R, (g + 1) * R)]
    seen = np.any(vis, axis=0)
    cand = [j for j in range(Ns) if seen[j * sb:(j + 1) * sb].any()]
    if cand:
      own = cand[-1]
      score = sum(probs(b, h, t) for h in range(g * R, (g + 1) * R)) @ over if Nc else np.zeros(Ns)
      rank = sorted(cand, key=lambda j: (0, 0, j) if j == own else (1, 0, j) if j in (0, own - 1)
                    else (2, -score[j], j))
      keys = np.zeros(S, bool)
      for j in rank[:n]:
        keys[j * sb:(j + 1) * sb] = True
    for r, h in enumerate(range(g * R, (g + 1) * R)):
      if cand:
        sel[b, h, t] = keys & vis[r]
      p = t + S - T if causal else (np.flatnonzero(vis[r])[-1] if vis[r].any() else -1)
      win[b, h, t] = vis[r] & (np.arange(S) > p - w)
  return sel, win


def _softmax_attend(q, k, v, keep, scale):
  """Per (b, h, t): softmax over the kept keys, 0 for a row keeping none."""
  B, T, H, _ = q.shape
  R = H // k.shape[2]
  logits = jnp.einsum("BTHK,BSHK->BHTS", q, jnp.repeat(k, R, axis=2)) * scale
  logits = jnp.where(keep, logits, -jnp.inf)
  m = jnp.max(jnp.where(keep, logits, -1e30), -1, keepdims=True)
  e = jnp.where(keep, jnp.exp(logits - m), 0.0)
  z = e.sum(-1, keepdims=True)
  p = e / jnp.where(z > 0, z, 1.0)
  return jnp.einsum("BHTS,BSHV->BTHV", p, jnp.repeat(v, R, axis=2)), p


def _compressed(params, k, v, l, d):
  Nc = 0 if k.shape[1] < l else (k.shape[1] - l) // d + 1
  kc = jnp.stack([sum(params["w_compress_k"][j] * k[:, i * d + j] for j in range(l)) for i in range(Nc)], 1)
  vc = jnp.stack([sum(params["w_compress_v"][j] * v[:, i * d + j] for j in range(l)) for i in range(Nc)], 1)
  return kc, vc


def reference_masks(params, q, k, v, cfg, *, causal, lengths=None, mask=None):
  """The keys each branch of each (b, h, t) attends to (numpy; no gradient, as the choice has none)."""
  o = nsa.options(cfg)
  B, T, H, _ = q.shape
  S, G = k.shape[1], cfg.num_kv_heads
  l, d = o["compress_block"], o["compress_stride"]
  lengths = [S] * B if lengths is None else [int(x) for x in lengths]
  mask = None if mask is None else np.asarray(mask)
  Nc = 0 if S < l else (S - l) // d + 1
  usable = np.zeros((B, H, T, Nc), bool)
  for b, h, t in itertools.product(range(B), range(H), range(T)):
    vis = _visible(b, h, t, T=T, S=S, causal=causal, lengths=lengths, mask=mask)
    usable[b, h, t] = [vis[i * d:i * d + l].all() for i in range(Nc)]
  p_np = np.asarray(_compressed_weights(params, q, k, v, usable, l, d, cfg.score_scale), np.float64)
  sel, win = _choice(B, H, T, S, G, o, causal, lengths, mask, lambda b, h, t: p_np[b, h, t])
  return usable, sel, win


# The compressed branch's weights, compiled whole (eager, each small op compiles on its own).
_compressed_weights = jax.jit(lambda params, q, k, v, usable, l, d, scale: _softmax_attend(
    q, *_compressed(params, k, v, l, d), usable, scale)[1], static_argnums=(5, 6, 7))


def reference(params, x, q, k, v, cfg, keep):
  """The gated sum of three softmaxes under the reference's masks; and the selected branch's weights."""
  o = nsa.options(cfg)
  usable, sel, win = keep
  kc, vc = _compressed(params, k, v, o["compress_block"], o["compress_stride"])
  o_c, _ = _softmax_attend(q, kc, vc, usable, cfg.score_scale)
  o_s, w_s = _softmax_attend(q, k, v, sel, cfg.score_scale)
  o_w, _ = _softmax_attend(q, k, v, win, cfg.score_scale)
  g = jax.nn.sigmoid(jnp.einsum("BTD,DHC->BTHC", x, params["w_gate"]) + params["b_gate"])
  return g[..., 0:1] * o_c + g[..., 1:2] * o_s + g[..., 2:3] * o_w, w_s


def _inputs(cfg, B, T, S, seed):
  """NSA's own parameters (the gate's weights at init's scale) and q, k, v, drawn with numpy: jax's draws
  (api.init eager) compile one program per shape."""
  shapes = api.param_shapes("per_head", cfg)
  own = {"w_gate": _randn(seed + 7, shapes["w_gate"], cfg.d_model ** -0.5)}
  own["w_compress_k"] = _randn(seed, (nsa.options(cfg)["compress_block"],), 0.5)
  own["w_compress_v"] = _randn(seed + 1, (nsa.options(cfg)["compress_block"],), 0.5)
  own["b_gate"] = _randn(seed + 2, shapes["b_gate"])
  H, G = cfg.num_heads, cfg.num_kv_heads
  return (own, _randn(seed + 3, (B, T, cfg.d_model)), _randn(seed + 4, (B, T, H, cfg.d_k)),
          _randn(seed + 5, (B, S, G, cfg.d_k)), _randn(seed + 6, (B, S, G, cfg.d_v)))


CASES = [  # (name, T, S, causal, lengths, mask, options); the first in the fast tier
    ("causal_padded", 11, 11, True, [11, 7], None, {}),
    ("cache_mask", 3, 13, False, [13, 10], "causal_at_end", {"select_count": 2}),
    ("cross_blank_row", 5, 9, False, None, "blank_row", {"compress_stride": 2, "select_block": 2}),
    ("few_blocks", 7, 7, True, None, None, {"select_count": 9, "compress_block": 5, "compress_stride": 5}),
]
SLOW = pytest.mark.slow


def _mask(kind, B, T, S):
  if kind is None:
    return None
  if kind == "causal_at_end":  # a decoding step: query t at position S - T + t
    return jnp.asarray(np.arange(S)[None, :] <= (np.arange(T) + S - T)[:, None])[None, None]
  m = np.ones((B, 1, T, S), bool)
  m[1, :, 2] = False
  m[0, :, :, 6:] = False
  return jnp.asarray(m)


@pytest.mark.parametrize("case", [pytest.param(c, id=c[0], marks=() if i == 0 else SLOW)
                                  for i, c in enumerate(CASES)])
def test_against_the_naive_reference_values_and_gradients(case):
  _, T, S, causal, lengths, kind, extra = case
  cfg = _cfg(**extra)
  B = 2
  params, x, q, k, v = _inputs(cfg, B, T, S, seed=T + S)
  mask = _mask(kind, B, T, S)
  lens = None if lengths is None else jnp.asarray(lengths)
  opts = Options(is_causal=causal, kv_lengths=lens, mask=mask)
  ct = _randn(99, (B, T, cfg.num_heads, cfg.d_v))

  def ours(params, x, q, k, v):
    return (core(params, q, k, v, cfg=cfg, opts=opts, x_BTD=x)[0] * ct).sum()

  keep = reference_masks(params, q, k, v, cfg, causal=causal, lengths=lengths, mask=mask)

  def theirs(params, x, q, k, v):
    y, w = reference(params, x, q, k, v, cfg, keep)
    return (y * ct).sum(), (y, w)

  # One program each for the values and gradients (the reference's outputs and weights as its aux).
  a, ga = jax.jit(jax.value_and_grad(ours, argnums=range(5)))(params, x, q, k, v)
  (b, (y_ref, w_ref)), gb = jax.jit(jax.value_and_grad(theirs, argnums=range(5), has_aux=True))(params, x, q, k, v)
  np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  y, w = jax.jit(lambda *a: core(*a[:4], cfg=cfg, opts=opts.replace(return_weights=True), x_BTD=a[4]))(params, q, k, v, x)
  np.testing.assert_allclose(y, y_ref, atol=2e-6)
  np.testing.assert_allclose(w, w_ref, atol=2e-6)
  for got, want in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
    np.testing.assert_allclose(got, want, atol=1e-5 * max(1.0, float(jnp.abs(want).max())))
  if case[0] != "few_blocks":  # there one compressed block: its softmax is 1 whatever the pooling
    assert all(np.any(g != 0) for g in jax.tree.leaves(ga[0])), "gates and compression train"


@pytest.mark.parametrize("T,lengths", [(29, [29, 18]), pytest.param(40, None, marks=SLOW)])
def test_sparse_path_equals_dense_path(T, lengths, monkeypatch):
  """branches(long=True): the chunked compressed branch (chunks of 8, T not a multiple), the
  gathered kernel and the blocked window, against the dense masks; values and gradients."""
  monkeypatch.setattr(nsa, "CHUNK", 8)
  cfg = _cfg(select_block=5, select_count=2, window=6)
  params, x, q, k, v = _inputs(cfg, 2, T, T, seed=3)
  lens = None if lengths is None else jnp.asarray(lengths)
  ct = [_randn(40 + i, (2, T, cfg.num_heads, cfg.d_v)) for i in range(3)]

  def loss(params, q, k, v, long):
    out = nsa.branches(params, q, k, v, cfg=cfg, is_causal=True, kv_lengths=lens,
                       impl="blocked" if long else "einsum", long=long)[:3]
    return sum((o * c).sum() for o, c in zip(out, ct)), out

  (l1, o1), g1 = jax.jit(jax.value_and_grad(lambda *a: loss(*a, True), argnums=range(4), has_aux=True))(params, q, k, v)
  (l2, o2), g2 = jax.jit(jax.value_and_grad(lambda *a: loss(*a, False), argnums=range(4), has_aux=True))(params, q, k, v)
  for a, b in zip(o1, o2):
    np.testing.assert_allclose(a, b, atol=2e-6)
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
    np.testing.assert_allclose(a, b, atol=2e-5 * max(1.0, float(jnp.abs(b).max())))


@pytest.mark.parametrize("long", [False, pytest.param(True, marks=SLOW)])
def test_covering_every_block_is_full_causal_attention(long):
  T = 23
  cfg = _cfg(select_count=100, window=T)
  params, x, q, k, v = _inputs(cfg, 2, T, T, seed=5)
  lens = jnp.asarray([23, 9])
  run = lambda cfg: jax.jit(lambda *a: nsa.branches(*a, cfg=cfg, is_causal=True, kv_lengths=lens,
                                                     impl="einsum", long=long))(params, q, k, v)
  _, o_s, o_w, _ = run(cfg)
  full = jax.jit(lambda q, k, v: kernel.attention(q, k, v, is_causal=True, kv_lengths=lens,
                                                  scale=cfg.score_scale))(q, k, v)
  if long:  # the gathered kernel sums blocks in another order
    np.testing.assert_allclose(o_s, full, atol=2e-6)
  else:
    np.testing.assert_array_equal(o_s, full)
    np.testing.assert_array_equal(o_w, full)
  few = run(_cfg(select_count=2, window=T))[1]
  assert not np.allclose(few, full, atol=1e-3)


def test_causal_through_the_layer_with_gqa():
  """Changing tokens after t0 leaves outputs up to t0 (the compressed branch waits for a block's end)."""
  cfg = _cfg().replace(d_model=12, rope_dim=2)
  p = fresh_params("per_head", cfg, seed=1)
  x = _randn(1, (1, 14, 12))
  f = jax.jit(lambda x: api.apply("per_head", p, x, cfg=cfg, is_causal=True))
  y, y2 = f(x), f(x.at[:, 9:].add(3.0))
  np.testing.assert_array_equal(y2[:, :9], y[:, :9])
  assert not np.allclose(y2[:, 9:], y[:, 9:])


def test_ties_are_broken_by_the_lower_index():
  """Equal keys everywhere: every block scores alike, the lowest indices are taken, twice alike."""
  cfg = _cfg(select_count=3, select_block=2, window=1)
  params, x, q, _, _ = _inputs(cfg, 1, 12, 12, seed=2)
  k = jnp.ones((1, 12, 2, 5))
  v = jnp.broadcast_to(jnp.arange(12.0)[None, :, None, None], (1, 12, 2, 7))
  f = jax.jit(lambda q, k, v: nsa.branches(params, q, k, v, cfg=cfg, is_causal=True, return_weights=True))
  _, o_s, _, w = f(q, k, v)
  # query 11: own block 5, the one before (4), the initial one (0): keys 0, 1, 8..11 equally weighted
  np.testing.assert_allclose(w[0, 0, 11], np.isin(np.arange(12), [0, 1, 8, 9, 10, 11]) / 6, atol=1e-7)
  np.testing.assert_array_equal(o_s, f(q + 0.0, k, v)[1])


@pytest.mark.parametrize("change,field", [
    ({"compress_block": 0}, "extra.nsa.compress_block"), ({"compress_stride": -1}, "extra.nsa.compress_stride"),
    ({"select_block": 0}, "extra.nsa.select_block"), ({"select_count": 0}, "extra.nsa.select_count"),
    ({"window": 0}, "extra.nsa.window"), ({"compress_stride": 5, "compress_block": 4}, "extra.nsa.compress_stride"),
    ({"select_count": 2.5}, "extra.nsa.select_count"), ({"blocks": 3}, "extra.nsa.blocks"),
])
def test_bad_options_refused_by_name(change, field):
  with pytest.raises(ConfigError, match=field.replace(".", r"\.") + "="):
    api.check_config("per_head", _cfg(**change))


@pytest.mark.parametrize("variant,cfg_change,field", [
    ("linear", {}, "extra"), ("gated_deltanet", {}, "extra"), ("talking_heads", {}, "extra.nsa"),
    ("merged", {}, "extra.nsa"), ("collaborative", {}, "extra.nsa"), ("differential", {}, "extra.nsa"),
    ("per_head", {"extra": {"nsa": {}, "moba": {}}}, "extra.(nsa|moba)"),
    ("per_head", {"probability": "sigmoid"}, "probability"), ("per_head", {"window": 8}, "window"),
    ("per_head", {"sinks": True}, "sinks"),
])
def test_refused_where_it_cannot_act(variant, cfg_change, field):
  cfg = HeadConfig(d_model=24, num_heads=6, d_k=6, d_v=6, num_kv_heads=2, extra={"nsa": {}}).replace(**cfg_change)
  with pytest.raises(ConfigError, match=field.replace(".", r"\.") + "="):
    api.check_config(variant, cfg)


def test_return_weights_refused_at_long_T():
  cfg = HeadConfig(d_model=8, num_heads=2, d_k=4, d_v=4, extra={"nsa": {}})
  p = fresh_params("per_head", cfg)
  with pytest.raises(ConfigError, match="return_weights"):
    api.apply("per_head", p, _randn(0, (1, 512, 8)), cfg=cfg, is_causal=True, return_weights=True)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["per_head", "fused", "mla", "grouped_lowrank", "k_eq_v", "split_input",
                                     "tpa", "two_stage"])
def test_kit_passes(variant):
  check_mechanism(nsa.NSA, variants=[variant])
  if variant not in ("per_head", "fused", "mla"):
    return
  cfg = HeadConfig(d_model=24, num_heads=6, d_k=6, d_v=7, num_kv_heads=2, rope_dim=4, rope_theta=100.0,
                   extra={"nsa": dict(nsa.NSA.examples[0][1]["extra"]["nsa"])})
  check_variant(variant, configs=(cfg,))


@pytest.mark.slow
def test_layer_sparse_path_equals_dense_at_long_T():
  """T = 600 through api.apply: "auto" (chunks, gathered, blocked window) against "einsum"."""
  cfg = HeadConfig(d_model=16, num_heads=4, d_k=6, d_v=5, num_kv_heads=2, rope_dim=2,
                   extra={"nsa": {"compress_block": 16, "compress_stride": 8, "select_block": 32,
                                  "select_count": 4, "window": 40}})
  p = api.init("per_head", jax.random.key(2), cfg)
  x = _randn(3, (2, 600, 16))
  kv = jnp.array([600, 333])

  def loss(p, x, impl):
    y = api.apply("per_head", p, x, cfg=cfg, is_causal=True, kv_lengths=kv, impl=impl)
    return (y * _randn(4, y.shape)).sum(), y

  (_, y1), g1 = jax.jit(jax.value_and_grad(lambda p, x: loss(p, x, "auto"), (0, 1), has_aux=True))(p, x)
  (_, y2), g2 = jax.jit(jax.value_and_grad(lambda p, x: loss(p, x, "einsum"), (0, 1), has_aux=True))(p, x)
  np.testing.assert_allclose(y1, y2, atol=1e-5)
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
    np.testing.assert_allclose(a, b, atol=1e-4 * max(1.0, float(jnp.abs(b).max())))
