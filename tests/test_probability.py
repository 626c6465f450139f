"""The probability function (softmax, sigmoid, relu): einsum and blocked kernels against a naive
numpy loop, gradients, visible-key counts, decoding, counts and refusals."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attn
from attn import ConfigError, HeadConfig, count, kernel
from attn.kernel import probability
from attn.variants import cache, mechanisms
from attn.nn.config import ModelConfig
from conftest import fresh_params, randn

SHAPES = {  # B, T, S, H, G, K, V, block_q, block_k: lengths not multiples of the blocks, G < H, V != K
    "self": (2, 13, 13, 4, 2, 6, 5, 3, 5),
    "T_lt_S": (2, 7, 12, 6, 3, 5, 8, 3, 5),
    "T_gt_S": (2, 12, 7, 4, 1, 4, 6, 5, 3),
}
# (probability, is_causal, window, softcap, kv_lengths, a dense mask with blank rows)
CASES = {
    "self": [("sigmoid", True, None, None, True, True), ("relu", False, 3, 2.0, True, False)],
    "T_lt_S": [("relu", True, 4, None, False, True), ("sigmoid", False, 100, 1.5, True, False)],
    "T_gt_S": [("sigmoid", True, 3, 2.0, True, True), ("relu", True, None, None, False, False)],
}


def qkv(seed, B, T, S, H, G, K, V, dtype=jnp.float32):
  # q scaled up: logits of both signs and past small soft-caps, so relu's kink and σ's tails show.
  return (3 * randn(seed, (B, T, H, K), dtype), randn(seed + 1, (B, S, G, K), dtype),
          randn(seed + 2, (B, S, G, V), dtype))


def options(shape, case, seed):
  B, T, S, H = shape[:4]
  prob, is_causal, window, softcap, lengths, blank = case
  rng = np.random.default_rng(seed)
  kw = {"probability": prob, "is_causal": is_causal, "window": window, "softcap": softcap,
        "kv_lengths": jnp.asarray(rng.integers(1, S + 1, B)).at[0].set(0) if lengths else None}
  mask = None
  if blank:  # a whole row blanked in every head, one head's row in another query, holes elsewhere
    mask = jnp.asarray(rng.random((B, H, T, S)) < 0.8).at[:, :, T // 2].set(False)
    mask = mask.at[:, 1, T - 1].set(False)
  return mask, kw


def naive(q, k, v, mask=None, *, probability, is_causal=False, kv_lengths=None, window=None,
          softcap=None):
  """Output (B,T,H,V) and weights (B,H,T,S) in float64, one head and one query at a time."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  kv_lengths = None if kv_lengths is None else np.asarray(kv_lengths)  # on the host: no op per index
  B, T, H, K = q.shape
  S, G = k.shape[1], k.shape[2]
  full = np.ones((B, H, T, S), bool) if mask is None else np.broadcast_to(mask, (B, H, T, S))
  out, weights = np.zeros((B, T, H, v.shape[3])), np.zeros((B, H, T, S))
  for b, h, t in itertools.product(range(B), range(H), range(T)):
    pos = t + S - T
    seen = [s for s in range(S) if full[b, h, t, s] and not (is_causal and s > pos)
            and not (window is not None and abs(pos - s) >= window)
            and not (kv_lengths is not None and s >= int(kv_lengths[b]))]
    n = len(seen)  # the row's visible keys
    for s in seen:
      logit = q[b, t, h] @ k[b, s, h // (H // G)] / np.sqrt(K)
      if softcap is not None:
        logit = softcap * np.tanh(logit / softcap)
      w = 1 / (1 + n * np.exp(-logit)) if probability == "sigmoid" else max(logit, 0.0) / n
      weights[b, h, t, s] = w
      out[b, t, h] += w * v[b, s, h // (H // G)]
  return out, weights


def run(impl, bq, bk, mask, kw, weights=False):
  """The kernel under jit, kv_lengths and the mask traced."""
  static = {n: kw[n] for n in ("probability", "is_causal", "window", "softcap")}
  f = jax.jit(lambda q, k, v, mask, kv_lengths: kernel.attention(
      q, k, v, mask, kv_lengths=kv_lengths, impl=impl, return_weights=weights,
      **({} if weights else {"block_q": bq, "block_k": bk}), **static))
  return lambda q, k, v: f(q, k, v, mask, kw["kv_lengths"])


@pytest.mark.parametrize("name", ["self", *(pytest.param(n, marks=pytest.mark.slow) for n in SHAPES
                                             if n != "self")])
def test_einsum_and_blocked_equal_the_naive_loop(name):
  B, T, S, H, G, K, V, bq, bk = SHAPES[name]
  q, k, v = qkv(0, B, T, S, H, G, K, V)
  for n, case in enumerate(CASES[name]):
    mask, kw = options(SHAPES[name], case, seed=n)
    ref, ref_w = naive(q, k, v, mask, **kw)
    out, w = run("einsum", bq, bk, mask, kw, weights=True)(q, k, v)
    np.testing.assert_allclose(w, ref_w, atol=2e-6, rtol=2e-5, err_msg=f"einsum weights {case}")
    for impl in ("einsum", "blocked"):
      got = out if impl == "einsum" else run(impl, bq, bk, mask, kw)(q, k, v)
      np.testing.assert_allclose(got, ref, atol=2e-5, rtol=2e-5, err_msg=f"{impl} {case}")
    assert not np.allclose(np.asarray(w).sum(-1)[ref_w.sum(-1) > 0], 1.0)  # no normaliser


def grads(impl, bq, bk, mask, kw, q, k, v, ct):
  static = {n: kw[n] for n in ("probability", "is_causal", "window", "softcap")}
  def loss(q, k, v):
    out = kernel.attention(q, k, v, mask, kv_lengths=kw["kv_lengths"], impl=impl, block_q=bq,
                           block_k=bk, **static)
    return jnp.sum(out.astype(jnp.float32) * ct)
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)


@pytest.mark.parametrize("name, case", [
    ("self", ("sigmoid", True, 3, 2.0, True, True)),
    pytest.param("T_lt_S", ("relu", False, 2, None, False, True), marks=pytest.mark.slow),
    ("T_gt_S", ("relu", True, 100, 1.5, True, False)),
    pytest.param("T_gt_S", ("sigmoid", False, None, None, True, True), marks=pytest.mark.slow),
])
def test_gradients_of_blocked_equal_einsum(name, case):
  """The blocked kernel's hand-written VJP against autodiff of the einsum kernel; blank rows get 0."""
  B, T, S, H, G, K, V, bq, bk = SHAPES[name]
  q, k, v = qkv(2, B, T, S, H, G, K, V)
  mask, kw = options(SHAPES[name], case, seed=2)
  ct = randn(3, (B, T, H, V))
  einsum = grads("einsum", bq, bk, mask, kw, q, k, v, ct)
  for a, b, what in zip(grads("blocked", bq, bk, mask, kw, q, k, v, ct), einsum, "qkv"):
    assert np.all(np.isfinite(np.asarray(b))), what
    np.testing.assert_allclose(a, b, atol=2e-5, rtol=2e-5, err_msg=what)
  blank = naive(q, k, v, mask, **kw)[1].sum(-1) == 0  # (B,H,T): rows that see no key
  assert blank.any() and not np.asarray(einsum[0]).transpose(0, 2, 1, 3)[blank].any()


def test_gradient_of_the_einsum_kernel_equals_finite_differences_of_the_naive_loop():
  B, T, S, H, G, K, V, _, _ = SHAPES["T_gt_S"]
  q, k, v = qkv(4, B, T, S, H, G, K, V)
  ct = np.asarray(randn(5, (B, T, H, V)), np.float64)
  rng = np.random.default_rng(4)
  for prob in probability.PROBABILITIES[1:]:
    kw = {"probability": prob, "is_causal": True, "window": None, "softcap": 2.0, "kv_lengths": None}
    dk = np.asarray(grads("einsum", None, None, None, kw, q, k, v, jnp.asarray(ct, jnp.float32))[1])
    for idx in [tuple(rng.integers(0, n) for n in k.shape) for _ in range(4)]:
      step = np.zeros(k.shape)
      step[idx] = 1e-5
      up = naive(q, np.asarray(k, np.float64) + step, v, **kw)[0]
      down = naive(q, np.asarray(k, np.float64) - step, v, **kw)[0]
      np.testing.assert_allclose(dk[idx], np.sum((up - down) * ct) / 2e-5, atol=1e-4, rtol=1e-3)


# Compiled once per case, not op by op.
visible_keys = jax.jit(probability.visible_keys, static_argnums=(0, 1), static_argnames=("is_causal", "window"))


def test_visible_keys_count_the_dense_masks():
  rng = np.random.default_rng(0)
  B, H = 3, 2
  for T, S, is_causal, window, dense in [(5, 9, True, None, "full"), (5, 9, False, 3, "row"),
                                         (9, 5, True, 1, None), (9, 5, False, None, "full"),
                                         (7, 7, True, 3, "row"), (7, 7, False, 1, "full")]:
    lengths = jnp.asarray([0, S // 2, S])
    mask = None if dense is None else jnp.asarray(  # a full (B,H,T,S) mask, or one row per example
        rng.random((B, H, T, S) if dense == "full" else (B, 1, 1, S)) < 0.7)
    d_TS = np.arange(T)[:, None] + S - T - np.arange(S)[None, :]  # query position - key position
    want = (np.ones((B, H, T, S), bool) if mask is None else np.broadcast_to(mask, (B, H, T, S))) \
        & (np.arange(S) < np.asarray(lengths)[:, None, None, None])
    want = want & (d_TS >= 0 if is_causal else True) & (np.abs(d_TS) < window if window else True)
    got = visible_keys(T, S, mask, is_causal=is_causal, kv_lengths=lengths, window=window)
    np.testing.assert_array_equal(np.broadcast_to(got, (B, H, T)), want.sum(-1),
                                  err_msg=f"{is_causal} {window} {dense}")


def test_bfloat16_inputs_give_bf16_outputs_and_gradients_near_float32():
  B, T, S, H, G, K, V, bq, bk = SHAPES["T_lt_S"]
  q, k, v = qkv(8, B, T, S, H, G, K, V)
  for n, case in enumerate(CASES["T_lt_S"][:1]):
    mask, kw = options(SHAPES["T_lt_S"], case, seed=n)
    ref = naive(q, k, v, mask, **kw)[0]
    ct = randn(9, (B, T, H, V))
    ref_grads = grads("einsum", bq, bk, mask, kw, q, k, v, ct)
    half = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    for impl in ("einsum", "blocked"):
      got = run(impl, bq, bk, mask, kw)(*half)
      assert got.dtype == jnp.bfloat16
      np.testing.assert_allclose(np.asarray(got, np.float32), ref, atol=0.05 * np.abs(ref).max())
      for g, want in zip(grads(impl, bq, bk, mask, kw, *half, ct), ref_grads):
        assert g.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(g, np.float32), want, atol=0.05 * np.abs(want).max())


def test_refused_by_name_before_tracing():
  q, k, v = qkv(0, 1, 3, 3, 2, 1, 4, 4)
  with pytest.raises(ConfigError, match=r"probability='tanh' is not allowed: one of \['softmax'"):
    HeadConfig(d_model=8, num_heads=2, probability="tanh")
  with pytest.raises(ConfigError, match="probability='sigmoid' is not allowed: 'softmax' with learned sinks"):
    HeadConfig(d_model=8, num_heads=2, sinks=True, probability="sigmoid")
  with pytest.raises(ConfigError, match="probability='relu' is not allowed: 'softmax' with learned sinks"):
    kernel.attention(q, k, v, sinks=jnp.zeros(2), probability="relu")
  with pytest.raises(ConfigError, match="probability=None is not allowed"):
    kernel.attention(q, k, v, probability=None)
  with pytest.raises(ConfigError, match='probability=.sigmoid. is not allowed: "softmax" with impl="xla"'):
    kernel.attention(q, k, v, probability="sigmoid", impl="xla")
  with pytest.raises(ConfigError, match="probability='relu' is not allowed: 'softmax' with learned"):
    ModelConfig(vocab_size=8, d_model=8, num_layers=1, num_heads=2, d_ff=8, sinks=True, probability="relu")


def test_auto_picks_the_blocked_kernel_for_long_inputs_and_it_equals_einsum():
  q, k, v = qkv(9, 1, 520, 520, 2, 1, 4, 3)
  assert kernel.best_impl(q, k, v, probability="sigmoid") == "blocked"
  f = jax.jit(lambda q, k, v, impl: kernel.attention(q, k, v, is_causal=True, probability="sigmoid",
                                                     impl=impl), static_argnums=3)
  np.testing.assert_allclose(f(q, k, v, "auto"), f(q, k, v, "einsum"), atol=2e-5, rtol=2e-5)


CFG = HeadConfig(d_model=20, num_heads=6, d_k=4, d_v=3, num_kv_heads=3, gate="headwise",
                 softcap=3.0, window=4)


@pytest.mark.parametrize("variant, prob", [("per_head", "sigmoid"),
                                           pytest.param("differential", "relu", marks=pytest.mark.slow)])
def test_a_decoded_token_equals_the_full_forward(variant, prob):
  """Token by token through a KV cache (a window ring), gate and softcap on: the causal forward."""
  cfg = CFG.replace(probability=prob)
  v = attn.get_variant(variant)
  params = fresh_params(variant, cfg)  # numpy-drawn: attn.init would compile an initialiser per shape
  x = randn(10, (2, 6, cfg.d_model))
  full = jax.jit(lambda p, x: attn.apply(v, p, x, cfg=cfg, is_causal=True))(params, x)
  step = jax.jit(lambda p, x, c, i: cache.decode_step(v, p, x, c, i, cfg=cfg))
  c, ys = cache.init(v, params, cfg, 2, 6), []
  for i in range(6):
    y, c = step(params, x[:, i:i + 1], c, jnp.asarray(i))
    ys.append(y)
  np.testing.assert_allclose(jnp.concatenate(ys, 1), full, atol=2e-5, rtol=2e-5)
  soft = jax.jit(lambda p, x: attn.apply(v, p, x, cfg=cfg.replace(probability="softmax"),
                                         is_causal=True))(params, x)
  assert not np.allclose(soft, full, atol=1e-3)  # the option reached the layer


def test_counts_add_no_parameters_and_no_flops_and_measure_the_effective_count():
  v = attn.get_variant("per_head")
  for prob in ("sigmoid", "relu"):
    cfg = CFG.replace(probability=prob)
    assert mechanisms.param_count(cfg) == mechanisms.param_count(CFG) > 0  # the gate's
    assert count.flops(v, cfg, 9, 11) == count.flops(v, CFG, 9, 11)
    assert count.measured_figures(v, cfg) == ["effective"]
  assert count.measured_figures(v, CFG) == []


def test_softmax_is_the_default_and_switches_nothing_on():
  cfg = HeadConfig(d_model=8, num_heads=2)
  assert cfg.probability == "softmax" and cfg == cfg.replace(probability="softmax")
  assert "probability" not in [m.name for m in mechanisms.active(cfg)]
  assert "probability" in [m.name for m in mechanisms.active(cfg.replace(probability="relu"))]


@pytest.mark.slow
def test_the_kit_passes_for_the_record_on_every_variant():
  from attn.testing import check_mechanism
  check_mechanism(attn.MECHANISMS["probability"], thorough=True)


@pytest.mark.slow
def test_exact_conversions_carry_it_and_one_that_drops_the_key_bias_refuses_biases():
  """per_head -> merged is exact without biases (the option acts on both alike); with biases the
  key bias's row constants, which sigmoid and relu do not drop, would be lost: refused by name."""
  cfg = HeadConfig(d_model=12, num_heads=3, d_k=5, d_v=7, use_bias=False, probability="relu")
  params = attn.init("per_head", jax.random.key(1), cfg)
  x = randn(11, (2, 5, cfg.d_model))
  merged = attn.convert(params, "per_head", "merged", cfg)
  f = jax.jit(lambda p, x: attn.apply("per_head", p, x, cfg=cfg, is_causal=True))
  g = jax.jit(lambda p, x: attn.apply("merged", p, x, cfg=cfg, is_causal=True))
  np.testing.assert_allclose(g(merged, x), f(params, x), atol=2e-5, rtol=2e-5)
  biased = cfg.replace(use_bias=True, probability="sigmoid")
  with pytest.raises(ConfigError, match="use_bias=True is not allowed: False for per_head -> merged "
                                        "with sinks, softcap or probability 'sigmoid'"):
    attn.convert(attn.init("per_head", jax.random.key(1), biased), "per_head", "merged", biased)


@pytest.mark.slow
@pytest.mark.parametrize("prob", ["sigmoid", "relu"])
def test_a_model_decoded_in_chunks_gives_the_full_forward_logits(prob):
  """DecoderLM (attn.nn.decoding) with RoPE and a window ring: a chunked prefill, then single tokens."""
  from flax import nnx
  from attn.nn import DecoderLM
  cfg = ModelConfig(vocab_size=13, d_model=12, num_layers=2, num_heads=4, d_ff=16, d_k=4, d_v=3,
                    num_kv_heads=2, max_len=12, positional="rope", rope_dim=2, rope_theta=100.0,
                    window=3, probability=prob)
  model = DecoderLM(cfg, rngs=nnx.Rngs(0))
  tokens_BT = jnp.asarray(np.random.default_rng(12).integers(0, 13, (2, 7)), jnp.int32)
  full = model(tokens_BT)
  model.init_cache(2, 8)
  outs = [model(tokens_BT[:, i:j], decode=True) for i, j in ((0, 4), (4, 5), (5, 6), (6, 7))]
  np.testing.assert_allclose(jnp.concatenate(outs, 1), full, atol=2e-5, rtol=2e-5)


def test_the_cli_lists_it_and_refuses_a_bad_value_by_name(capsys):
  from attn import cli
  with pytest.raises(SystemExit):
    cli.main(["count", "--help"])
  assert "probability: softmax|sigmoid|relu" in capsys.readouterr().out
  for argv, why in ((["--probability", "tanh"], "probability='tanh' is not allowed: one of"),
                    (["--probability", "relu", "--sinks"], "probability='relu' is not allowed: 'softmax'")):
    code = cli.main(["count", "--d-model", "8", "--num-heads", "2", *argv])
    err = capsys.readouterr().err
    assert code == 2 and why in err and "Traceback" not in err
