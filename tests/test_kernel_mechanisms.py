"""window, sinks and softcap: einsum and blocked against a naive numpy loop, gradients, refusals."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn import ConfigError, kernel, masks
from attn.kernel import blocked, plan as blocked_plan
from conftest import randn

SHAPES = {  # B, T, S, H, G, K, V, block_q, block_k: lengths not multiples of the blocks
    "self": (2, 13, 13, 4, 2, 6, 5, 3, 5),
    "T_lt_S": (2, 7, 12, 6, 3, 5, 8, 3, 5),
    "T_gt_S": (2, 12, 7, 4, 1, 4, 6, 5, 3),
}
# (is_causal, window, sinks, softcap, kv_lengths, a dense mask with blank rows): windows of 1, of
# a few and longer than S, causal and not, with every other mask.
CASES = {
    "self": [(True, 1, True, None, False, False), (False, 3, True, 2.0, True, True),
             (True, None, True, 1.5, True, False)],
    "T_lt_S": [(True, 4, True, 3.0, False, True), (False, 1, False, 2.0, True, False),
               (False, 100, True, None, False, False)],
    "T_gt_S": [(True, 3, True, None, True, True), (False, 2, True, 1.0, False, False),
               (True, 100, False, 4.0, False, True), (True, 1, True, 2.0, True, True)],
}


def qkv(seed, B, T, S, H, G, K, V, dtype=jnp.float32):
  # q scaled up so that logits reach past small soft-caps.
  return (3 * randn(seed, (B, T, H, K), dtype), randn(seed + 1, (B, S, G, K), dtype),
          randn(seed + 2, (B, S, G, V), dtype))


def options(shape, case, seed=0):
  """The keyword arguments a case names, on fresh random inputs."""
  B, T, S, H = shape[:4]
  is_causal, window, sinks, softcap, lengths, blank = case
  rng = np.random.default_rng(seed)
  kw = {"is_causal": is_causal, "window": window, "softcap": softcap}
  kw["sinks"] = jnp.asarray(rng.standard_normal(H), jnp.float32) if sinks else None
  kw["kv_lengths"] = jnp.asarray(rng.integers(1, S + 1, B)).at[0].set(0) if lengths else None
  mask = None
  if blank:  # a whole row blanked in every head, and one head's row in another query
    mask = jnp.asarray(rng.random((B, H, T, S)) < 0.8).at[:, :, T // 2].set(False)
    mask = mask.at[:, 1, T - 1].set(False)
  return mask, kw


def sees(t, s, T, S, is_causal, window) -> bool:
  """Query t, at position t + S - T (aligned at the end of the keys), may see key s."""
  pos = t + S - T
  return not (is_causal and s > pos) and not (window is not None and abs(pos - s) >= window)


def naive(q, k, v, mask=None, *, is_causal=False, kv_lengths=None, window=None, sinks=None,
          softcap=None):
  """Output (B,T,H,V) and weights (B,H,T,S) in float64, one head and one query at a time."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  # Read on the host once: indexing a jax array in the loops below dispatches an op each time.
  kv_lengths, sinks = (None if a is None else np.asarray(a) for a in (kv_lengths, sinks))
  mask = None if mask is None else np.asarray(mask)
  B, T, H, K = q.shape
  S, G = k.shape[1], k.shape[2]
  full = np.ones((B, H, T, S), bool) if mask is None else np.broadcast_to(mask, (B, H, T, S))
  out = np.zeros((B, T, H, v.shape[3]))
  weights = np.zeros((B, H, T, S))
  for b, h, t in itertools.product(range(B), range(H), range(T)):
    g = h // (H // G)
    seen = [s for s in range(S)
            if full[b, h, t, s] and sees(t, s, T, S, is_causal, window)
            and not (kv_lengths is not None and s >= int(kv_lengths[b]))]
    logits = np.array([q[b, t, h] @ k[b, s, g] / np.sqrt(K) for s in seen])
    if softcap is not None:
      logits = softcap * np.tanh(logits / softcap)
    terms = list(logits) + ([] if sinks is None else [float(sinks[h])])
    if not terms:
      continue
    top = max(terms)
    denom = sum(np.exp(x - top) for x in terms)
    for s, l in zip(seen, logits):
      weights[b, h, t, s] = np.exp(l - top) / denom
      out[b, t, h] += weights[b, h, t, s] * v[b, s, g]
  return out, weights


def run(impl, bq, bk, mask, kw):
  """The kernel under jit, with the arrays (sinks, kv_lengths, mask) as traced arguments."""
  static = {n: kw[n] for n in ("is_causal", "window", "softcap")}
  @jax.jit
  def f(q, k, v, mask, sinks, kv_lengths):
    return kernel.attention(q, k, v, mask, sinks=sinks, kv_lengths=kv_lengths, impl=impl,
                            block_q=bq, block_k=bk, **static)
  return lambda q, k, v: f(q, k, v, mask, kw["sinks"], kw["kv_lengths"])


# T > S (one kv head, early rows see nothing) stays fast with two of its cases: a two-sided window of 2 with a
# soft-cap and sinks, and a causal window of 1 with sinks, a soft-cap, lengths with a 0 and blank rows. Every
# case of every shape in the slow tier: self (T = S, grouped heads: fast sibling
# test_gradients_of_blocked_equal_einsum[self-case0]), T < S, and windows longer than S (fast sibling
# test_window_wider_than_the_sequence_is_global).
@pytest.mark.parametrize("name, every_case", [("T_gt_S", False)] + [
    pytest.param(n, True, marks=pytest.mark.slow) for n in SHAPES])
def test_einsum_and_blocked_equal_the_naive_loop(name, every_case):
  """The fast case: T > S's two-sided window of 2 with a soft-cap and its window of 1 with everything else."""
  B, T, S, H, G, K, V, bq, bk = SHAPES[name]
  q, k, v = qkv(0, B, T, S, H, G, K, V)
  for n, case in enumerate(CASES[name]):
    if not every_case and n not in (1, 3):
      continue
    mask, kw = options(SHAPES[name], case, seed=n)
    ref, _ = naive(q, k, v, mask, **kw)
    for impl in ("einsum", "blocked"):
      got = run(impl, bq, bk, mask, kw)(q, k, v)
      np.testing.assert_allclose(got, ref, atol=2e-5, rtol=2e-5, err_msg=f"{impl} {case}")


def weights(mask, kw):
  """The einsum kernel's output and weights, under jit."""
  static = {n: kw[n] for n in ("is_causal", "window", "softcap")}
  f = jax.jit(lambda q, k, v, mask, sinks, kv_lengths: kernel.attention(
      q, k, v, mask, sinks=sinks, kv_lengths=kv_lengths, return_weights=True, **static))
  return lambda q, k, v: f(q, k, v, mask, kw["sinks"], kw["kv_lengths"])


def test_weights_exclude_the_sink():
  B, T, S, H, G, K, V, _, _ = SHAPES["T_lt_S"]
  q, k, v = qkv(1, B, T, S, H, G, K, V)
  mask, kw = options(SHAPES["T_lt_S"], (True, 4, True, 2.0, True, True), seed=1)
  out, w = weights(mask, kw)(q, k, v)
  ref_out, ref_w = naive(q, k, v, mask, **kw)
  np.testing.assert_allclose(out, ref_out, atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(w, ref_w, atol=2e-6, rtol=2e-5)
  sums = np.asarray(w.sum(-1))
  assert np.all(sums < 1) and np.all(sums[np.asarray(w.max(-1)) > 0] > 0)  # 1 - the sink's share
  assert not np.asarray(w)[:, :, T // 2].any()  # the blank row


def grads(impl, bq, bk, mask, kw, q, k, v, ct):
  """jax.grad of <out, ct> w.r.t. q, k, v and sinks, under jit."""
  static = {n: kw[n] for n in ("is_causal", "window", "softcap")}
  def loss(q, k, v, sinks):
    out = kernel.attention(q, k, v, mask, sinks=sinks, kv_lengths=kw["kv_lengths"], impl=impl,
                           block_q=bq, block_k=bk, **static)
    return jnp.sum(out.astype(jnp.float32) * ct)
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, kw["sinks"])


# self in the fast tier (grouped heads, a window, sinks, a soft-cap, lengths with a 0 and blank rows at once);
# T < S and T > S slow (T > S's blank rows keep test_blank_rows_give_zeros_and_finite_gradients fast).
@pytest.mark.parametrize("name, case", [
    ("self", (True, 3, True, 2.0, True, True)),
    pytest.param("T_lt_S", (False, 2, True, 1.5, False, True), marks=pytest.mark.slow),
    pytest.param("T_gt_S", (True, 100, True, None, True, False), marks=pytest.mark.slow),
])
def test_gradients_of_blocked_equal_einsum(name, case):
  B, T, S, H, G, K, V, bq, bk = SHAPES[name]
  q, k, v = qkv(2, B, T, S, H, G, K, V)
  mask, kw = options(SHAPES[name], case, seed=2)
  ct = randn(3, (B, T, H, V))
  einsum = grads("einsum", bq, bk, mask, kw, q, k, v, ct)
  for x in einsum:
    assert np.all(np.isfinite(np.asarray(x)))
  for a, b, what in zip(grads("blocked", bq, bk, mask, kw, q, k, v, ct), einsum, "qkvs"):
    np.testing.assert_allclose(a, b, atol=2e-5, rtol=2e-5, err_msg=what)


def test_sink_gradient_equals_finite_differences_of_the_naive_loop():
  B, T, S, H, G, K, V, bq, bk = SHAPES["self"]
  q, k, v = qkv(4, B, T, S, H, G, K, V)
  mask, kw = options(SHAPES["self"], (True, 4, True, 2.0, False, True), seed=4)
  ct = np.asarray(randn(5, (B, T, H, V)), np.float64)
  sinks = np.asarray(kw["sinks"], np.float64)
  eps, numeric = 1e-5, np.zeros(H)
  for h in range(H):
    step = np.eye(H)[h] * eps
    up = naive(q, k, v, mask, **{**kw, "sinks": sinks + step})[0]
    down = naive(q, k, v, mask, **{**kw, "sinks": sinks - step})[0]
    numeric[h] = np.sum((up - down) * ct) / (2 * eps)
  for impl in ("einsum", "blocked"):
    dsinks = grads(impl, bq, bk, mask, kw, q, k, v, jnp.asarray(ct, jnp.float32))[3]
    np.testing.assert_allclose(dsinks, numeric, atol=1e-4, rtol=1e-4, err_msg=impl)


def test_blank_rows_give_zeros_and_finite_gradients():
  B, T, S, H, G, K, V, bq, bk = SHAPES["T_gt_S"]
  q, k, v = qkv(6, B, T, S, H, G, K, V)
  mask = jnp.ones((B, 1, T, S), bool).at[:, :, 5].set(False)
  kw = {"is_causal": True, "window": 2, "softcap": 1.0, "kv_lengths": jnp.array([0, S]),
        "sinks": jnp.asarray(np.random.default_rng(6).standard_normal(H), jnp.float32)}
  ct = randn(7, (B, T, H, V))
  blank_BT = np.zeros((B, T), bool)
  blank_BT[0] = True  # no keys at all
  blank_BT[:, : T - S] = True  # bottom-right causal: the first T - S queries see nothing
  blank_BT[:, 5] = True
  for impl in ("einsum", "blocked"):
    out = np.asarray(run(impl, bq, bk, mask, kw)(q, k, v))
    assert not out[blank_BT].any() and out[~blank_BT].any(), impl
    dq, dk, dv, dsinks = (np.asarray(x) for x in grads(impl, bq, bk, mask, kw, q, k, v, ct))
    for x in (dq, dk, dv, dsinks):
      assert np.all(np.isfinite(x)), impl
    assert not dq[blank_BT].any() and not dk[0].any() and not dv[0].any(), impl
  _, w = weights(mask, kw)(q, k, v)
  assert not np.asarray(w).transpose(0, 2, 1, 3)[blank_BT].any()


# Slow; fast siblings: test_kernel_blocked.py::test_bfloat16_within_its_tolerance (blocked, values and gradients)
# and test_kernel.py::test_bf16_inputs_softmax_in_float32 (einsum).
@pytest.mark.slow
def test_bfloat16_runs_and_stays_close_to_float32():
  B, T, S, H, G, K, V, bq, bk = SHAPES["T_lt_S"]
  q, k, v = qkv(8, B, T, S, H, G, K, V)
  mask, kw = options(SHAPES["T_lt_S"], (True, 3, True, 2.0, True, False), seed=8)
  ref = naive(q, k, v, mask, **kw)[0]
  ct = randn(9, (B, T, H, V))
  ref_grads = grads("einsum", bq, bk, mask, kw, q, k, v, ct)
  half = [x.astype(jnp.bfloat16) for x in (q, k, v)]
  kw16 = {**kw, "sinks": kw["sinks"].astype(jnp.bfloat16)}
  for impl in ("einsum", "blocked"):
    out = run(impl, bq, bk, mask, kw16)(*half)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(out.astype(jnp.float32), ref, atol=5e-2, rtol=5e-2, err_msg=impl)
    for a, b in zip(grads(impl, bq, bk, mask, kw16, *half, ct), ref_grads):
      assert a.dtype == jnp.bfloat16
      np.testing.assert_allclose(a.astype(jnp.float32), b, atol=0.15, rtol=0.1, err_msg=impl)


def test_window_on_the_xla_path_is_aligned_as_ours():
  """T == S causal travels as jax's local_window_size, the rest as a dense mask: same answer."""
  B, H, G, K = 2, 4, 2, 8  # xla needs d_v = d_k
  combos = (((9, 9), True, 3), ((9, 9), True, 20), ((9, 9), False, 3),
            ((5, 9), True, 2), ((9, 5), False, 1), ((9, 5), True, 4))
  inputs = [(qkv(T + S, B, T, S, H, G, K, K), jnp.array([S, 3])) for (T, S), _, _ in combos]
  outs = jax.jit(lambda inputs: [  # every combination in one program (one compile, not six)
      kernel.attention(*qkv_, impl="xla", is_causal=is_causal, window=window, kv_lengths=n)
      for (qkv_, n), (_, is_causal, window) in zip(inputs, combos)])(inputs)
  for ((T, S), is_causal, window), ((q, k, v), kv_lengths), got in zip(combos, inputs, outs):
    ref = naive(q, k, v, is_causal=is_causal, window=window, kv_lengths=kv_lengths)[0]
    np.testing.assert_allclose(got, ref, atol=2e-5, rtol=2e-5,
                               err_msg=f"{T, S, is_causal, window}")


def visible_blocks(T, S, is_causal, window, bq, bk) -> np.ndarray:
  """(nq, nk): whether some query of block i may see some key of block j, from a dense mask."""
  keep = np.array([[sees(t, s, T, S, is_causal, window) for s in range(S)] for t in range(T)])
  nq, nk = -(-T // bq), -(-S // bk)
  return np.array([[keep[i * bq:(i + 1) * bq, j * bk:(j + 1) * bk].any() for j in range(nk)]
                   for i in range(nq)])


def test_block_plan_visits_exactly_the_blocks_the_window_reaches():
  for (T, S), is_causal, window in itertools.product(((23, 23), (10, 29), (29, 10)),
                                                     (True, False), (None, 1, 4, 9, 100)):
    for bq, bk in ((3, 5), (5, 3), (4, 4)):
      need = visible_blocks(T, S, is_causal, window, bq, bk)
      fwd = np.zeros_like(need)
      for i, (lo, hi) in enumerate(blocked.key_block_ranges(
          T, S, is_causal=is_causal, window=window, block_q=bq, block_k=bk)):
        fwd[i, lo:hi] = True
      bwd = np.zeros_like(need)
      for j, (lo, hi) in enumerate(blocked.query_block_ranges(
          T, S, is_causal=is_causal, window=window, block_q=bq, block_k=bk)):
        bwd[lo:hi, j] = True
      case = f"T={T} S={S} causal={is_causal} window={window} blocks={bq}x{bk}"
      np.testing.assert_array_equal(fwd, need, err_msg=case)
      np.testing.assert_array_equal(bwd, need, err_msg=case)


def test_blocks_visited_at_a_fixed_window_grow_linearly_in_T():
  w, bq, bk = 256, 512, 256
  for is_causal in (True, False):
    per_block = -(-(bq + 2 * w) // bk) + 1  # a query block's keys span bq + 2w - 2 positions
    totals = []
    for T in (4096, 8192, 16384):
      fwd = blocked.key_block_ranges(T, T, is_causal=is_causal, window=w, block_q=bq, block_k=bk)
      bwd = blocked.query_block_ranges(T, T, is_causal=is_causal, window=w, block_q=bq,
                                       block_k=bk)
      assert max(hi - lo for lo, hi in fwd) <= per_block
      assert max(hi - lo for lo, hi in bwd) <= -(-(bk + 2 * w) // bq) + 1
      totals.append(sum(hi - lo for lo, hi in fwd))
    assert totals[2] - totals[1] == 2 * (totals[1] - totals[0])  # affine in T: O(T·w)
  assert blocked.work_fraction(16384, 16384, is_causal=True, window=w, block_q=bq,
                               block_k=bk) < 0.05


def test_both_window_paths_are_covered_here():
  """A window whose slab fits takes the slab path, a wider one the block loop; CASES has both."""
  paths = set()
  for name, cases in CASES.items():
    B, T, S, H, G, K, V, bq, bk = SHAPES[name]
    for is_causal, window, *_ in cases:
      if window is not None:
        plan = blocked_plan.plan_for(T, S, bq, bk, is_causal=is_causal, window=window)
        paths.add((name, plan.slab > 0))
        if plan.slab:  # the slab holds every key a query block may see
          assert plan.slab >= bq + (window - 1 if is_causal else 2 * window - 2)
  assert {(n, True) for n in SHAPES} <= paths and any(not slab for _, slab in paths)
  long = functools.partial(blocked_plan.plan_for, 16384, 16384, None, None, is_causal=True)
  assert long(window=256).slab == blocked.SLAB_Q + 256 and long(window=4096).slab == 0


def test_window_wider_than_the_sequence_is_global():
  B, T, S, H, G, K, V, bq, bk = SHAPES["T_lt_S"]
  q, k, v = qkv(10, B, T, S, H, G, K, V)
  f = jax.jit(lambda q, k, v, window: kernel.attention(
      q, k, v, is_causal=True, window=window, impl="blocked", block_q=bq, block_k=bk),
      static_argnums=3)
  np.testing.assert_array_equal(f(q, k, v, 10**12), f(q, k, v, None))
  np.testing.assert_array_equal(masks.window_mask(T, S, 10**12), np.ones((1, 1, T, S), bool))


def test_best_impl_keeps_cudnn_off_with_sinks_or_softcap(monkeypatch):
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  x = jnp.zeros((1, 8, 2, 64), jnp.bfloat16)
  assert kernel.best_impl(x, x, x) == "cudnn"
  assert kernel.best_impl(x, x, x, sinks=jnp.zeros(2)) != "cudnn"
  assert kernel.best_impl(x, x, x, softcap=30.0) != "cudnn"


@pytest.mark.parametrize("kwargs, match", [
    ({"window": 0}, "window=0"),
    ({"window": -3}, "window=-3"),
    ({"window": True}, "window=True"),
    ({"window": 2.0}, "window=2.0"),
    ({"softcap": 0.0}, "softcap=0.0"),
    ({"softcap": -1}, "softcap=-1"),
    ({"softcap": float("inf")}, "softcap=inf"),
    ({"softcap": float("nan")}, "softcap=nan"),
    ({"softcap": True}, "softcap=True"),
    ({"softcap": jnp.float32(5.0)}, "softcap="),
    ({"sinks": jnp.zeros(3)}, r"sinks.shape=\(3,\)"),
    ({"sinks": jnp.zeros((1, 4))}, r"sinks.shape=\(1, 4\)"),
    ({"sinks": [0.0] * 4}, "sinks.shape=None"),
    ({"sinks": jnp.zeros(4, jnp.int32)}, "sinks.dtype='int32'"),
    ({"sinks": jnp.zeros(4), "impl": "xla"}, "sinks="),
    ({"softcap": 5.0, "impl": "cudnn"}, "impl='cudnn' is not allowed.*GPU backend only"),
    ({"sinks": jnp.zeros(4), "impl": "blocked", "window": 0}, "window=0"),
])
def test_bad_values_are_clear_errors(kwargs, match):
  q, k, v = qkv(11, 2, 5, 5, 4, 2, 8, 8)
  with pytest.raises(ConfigError, match=match):
    kernel.attention(q, k, v, **kwargs)
  with pytest.raises(ConfigError, match=match):  # before tracing: the same under jit
    jax.jit(lambda q, k, v: kernel.attention(q, k, v, **kwargs))(q, k, v)


@pytest.mark.slow
def test_long_windowed_sequence_memory_does_not_grow_with_scores():
  """T = S = 16384 with a window, sinks and a softcap: forward+backward buffers are O(T)."""
  x = jax.ShapeDtypeStruct((1, 16384, 8, 64), jnp.float32)
  sinks = jax.ShapeDtypeStruct((8,), jnp.float32)
  loss = lambda q, k, v, sinks: jnp.sum(kernel.attention(
      q, k, v, is_causal=True, window=512, sinks=sinks, softcap=30.0, impl="blocked"))
  m = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(x, x, x, sinks).compile()
  m = m.memory_analysis()
  peak = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
  assert peak <= 256 * 2**20, peak / 2**20  # one (B,H,T,S) float32 array would be 8 GB
