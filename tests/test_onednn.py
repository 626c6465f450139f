"""impl="onednn" (attn.kernel.onednn: the core's products on oneDNN's sgemm through jax.ffi) against the einsum kernel.

Needs the onednn extra (the onednn-cpu-gomp wheel) and a C++ compiler: the tests that run it skip
before anything imports or builds it when either is missing; with both, a failed build fails them.
The error paths run everywhere.
"""

import importlib.metadata
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attn
from attn import ConfigError, HeadConfig, kernel
from attn.kernel import onednn
from conftest import randn


def _missing() -> str | None:
  try:
    importlib.metadata.distribution(onednn.DIST)
  except importlib.metadata.PackageNotFoundError:
    return f'the {onednn.DIST} wheel is not installed (pip install -e ".[onednn]")'
  if shutil.which("c++") is None:
    return "no C++ compiler (c++) to build the handlers"
  return None


_MISSING = _missing()
needs_onednn = pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))

# B, T, S, H, G, K, V: d_v != d_k, grouped, a one-key-head group, a single query, lengths that are
# not multiples of anything.
SHAPES = [
    (2, 5, 7, 6, 3, 4, 3),
    (1, 9, 4, 4, 1, 5, 2),
    (3, 1, 6, 2, 2, 3, 3),
]


def _ref_nt(a_BTHD, b_BSGD):
  H, G = a_BTHD.shape[2], b_BSGD.shape[2]
  return jnp.einsum("bthd,bshd->bhts", a_BTHD, jnp.repeat(b_BSGD, H // G, axis=2))


def _ref_nn(a_BHTS, b_BSGD):
  H, G = a_BHTS.shape[1], b_BSGD.shape[2]
  return jnp.einsum("bhts,bshd->bthd", a_BHTS, jnp.repeat(b_BSGD, H // G, axis=2))


def _ref_tn(a_BHTS, b_BTHD, G):
  B, H, T, S = a_BHTS.shape
  c_BSHD = jnp.einsum("bhts,bthd->bshd", a_BHTS, b_BTHD)
  return c_BSHD.reshape(B, S, G, H // G, -1).sum(3)


@needs_onednn
@pytest.mark.parametrize("shape", SHAPES, ids=[f"shape{i}" for i in range(len(SHAPES))])
def test_the_three_products_and_their_vjps_equal_einsum(shape):
  B, T, S, H, G, K, V = shape
  q, k = randn(1, (B, T, H, K)), randn(2, (B, S, G, K))
  p, v = randn(3, (B, H, T, S)), randn(4, (B, S, G, V))
  do = randn(5, (B, T, H, V))
  cases = [(onednn.nt, _ref_nt, (q, k)), (onednn.nn, _ref_nn, (p, v)),
           (lambda a, b: onednn.tn(a, b, G), lambda a, b: _ref_tn(a, b, G), (p, do))]
  for got_f, want_f, args in cases:
    got, got_vjp = jax.vjp(jax.jit(got_f), *args)
    want, want_vjp = jax.vjp(want_f, *args)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    ct = randn(6, want.shape)
    for g, w in zip(got_vjp(ct), want_vjp(ct)):
      np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def _grads(impl, q, k, v, **kw):
  def loss(q, k, v):
    out = kernel.attention(q, k, v, impl=impl, **kw)
    return (out * jnp.cos(jnp.arange(out.size).reshape(out.shape))).sum()
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)


@needs_onednn
@pytest.mark.parametrize("shape", SHAPES, ids=[f"shape{i}" for i in range(len(SHAPES))])
def test_attention_equals_einsum_with_masks_that_blank_rows(shape):
  B, T, S, H, G, K, V = shape
  q, k, v = randn(7, (B, T, H, K)), randn(8, (B, S, G, K)), randn(9, (B, S, G, V))
  mask = jax.random.bernoulli(jax.random.PRNGKey(10), 0.6, (B, H, T, S)).at[:, :, 0].set(False)
  for kw in ({}, {"mask": mask}, {"is_causal": True, "window": 3},
             {"mask": mask, "sinks": randn(11, (H,)), "softcap": 2.0},
             {"mask": mask, "probability": "sigmoid"},
             {"logits_bias": randn(12, (1, H, T, S))}):
    (got, g_got), (want, g_want) = _grads("onednn", q, k, v, **kw), _grads("einsum", q, k, v, **kw)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(g_got, g_want):
      assert np.isfinite(np.asarray(a)).all()
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
  # a blanked row: zero output and zero weights, not NaN
  out, w = kernel.attention(q, k, v, mask, impl="onednn", return_weights=True)
  assert not np.asarray(out[:, 0]).any() and not np.asarray(w[:, :, 0]).any()


@needs_onednn
def test_one_head_key_second_order_and_vmap():
  B, T, S, H, G, K, V = 2, 6, 5, 6, 3, 4, 7
  q, k, v = randn(13, (B, T, H, K)), randn(14, (B, S, 1, K)), randn(15, (B, S, G, V))
  f = lambda impl: lambda q: (kernel.attention(q, k, v, impl=impl) ** 2).sum()
  hvp = lambda impl: jax.jit(jax.grad(lambda q: (jax.grad(f(impl))(q) ** 2).sum()))(q)
  np.testing.assert_allclose(hvp("onednn"), hvp("einsum"), rtol=1e-4, atol=1e-5)
  per_example = lambda impl: jax.jit(jax.vmap(lambda q, k, v: kernel.attention(
      q[None], k[None], v[None], impl=impl)[0]))(q, k, v)
  np.testing.assert_allclose(per_example("onednn"), per_example("einsum"), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_the_fused_layer_through_apply():
  cfg = HeadConfig(d_model=20, num_heads=6, d_k=4, d_v=3, num_kv_heads=2)
  params = attn.init("fused", jax.random.PRNGKey(0), cfg)
  x = randn(16, (2, 7, cfg.d_model))
  run = lambda impl: jax.jit(lambda p, x: attn.apply("fused", p, x, cfg=cfg, is_causal=True,
                                                     impl=impl))(params, x)
  np.testing.assert_allclose(run("onednn"), run("einsum"), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_bfloat16_is_refused_by_name():
  q = randn(17, (1, 3, 2, 4)).astype(jnp.bfloat16)
  with pytest.raises(ConfigError, match=r"impl.*'onednn'.*float32 only, got bfloat16.*available"):
    kernel.attention(q, q[:, :, :1], q[:, :, :1], impl="onednn")


def test_unavailable_impl_names_impl_why_and_what_runs(monkeypatch):
  monkeypatch.setattr(onednn, "why_not", lambda *dtypes: "the onednn-cpu-gomp wheel is not installed")
  q = randn(18, (1, 3, 2, 4))
  with pytest.raises(ConfigError) as e:
    kernel.attention(q, q, q, impl="onednn")
  msg = str(e.value)
  assert "impl" in msg and "'onednn'" in msg and "wheel is not installed" in msg
  assert "available: ['auto', 'einsum', 'blocked', 'xla']" in msg
  cfg = HeadConfig(d_model=8, num_heads=2)
  with pytest.raises(ConfigError, match="wheel is not installed"):  # api: before tracing
    attn.apply("fused", attn.init("fused", jax.random.PRNGKey(0), cfg), randn(19, (1, 3, 8)), cfg=cfg,
               impl="onednn")
  # auto never picks it
  assert kernel.best_impl(q, q, q) == "einsum"


def test_missing_wheel_and_compiler_are_said(monkeypatch, tmp_path):
  def no_wheel(name):
    raise importlib.metadata.PackageNotFoundError(name)
  monkeypatch.setattr(importlib.metadata, "files", no_wheel)
  with pytest.raises(onednn.Unavailable, match=r'onednn-cpu-gomp wheel is not installed.*\[onednn\]'):
    onednn._libdnnl()
  monkeypatch.setenv("CXX", "no-such-compiler-xyz")
  monkeypatch.setenv("ATTN_CACHE_DIR", str(tmp_path))
  with pytest.raises(onednn.Unavailable, match="no C\\+\\+ compiler.*no-such-compiler-xyz"):
    onednn._build(tmp_path / "libdnnl.so.3")
  assert not any(tmp_path.iterdir())  # nothing half-built left behind


def test_unknown_impl_is_refused():
  q = randn(20, (1, 3, 2, 4))
  with pytest.raises(ConfigError, match=r"impl.*'mkl'.*one of"):
    kernel.attention(q, q, q, impl="mkl")


@needs_onednn
def test_the_account_finds_and_counts_the_six_ffi_products():
  from attn.bench import account
  B, T, H, G, K, V = 2, 5, 6, 2, 4, 3
  q, k, v = randn(21, (B, T, H, K)), randn(22, (B, T, G, K)), randn(23, (B, T, G, V))
  loss = lambda q, k, v: kernel.attention(q, k, v, impl="onednn").sum()
  hlo = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile().as_text()
  found = [d for d in account.account(hlo)["dots"] if d.get("ffi")]
  assert sorted(d["ffi"][len("attn_onednn_"):] for d in found) == ["nn", "nn", "nt", "nt", "tn", "tn"]
  # by hand: scores and dP contract K or V over B·H·T·S pairs; P·v, dQ, dK and dV likewise
  want = sorted([2 * B * H * T * T * K] * 3 + [2 * B * H * T * T * V] * 3)
  assert sorted(account.dot_flops(d) for d in found) == want
  assert all(d["library"].startswith("oneDNN sgemm") for d in found)
  assert account.time_dot(found[0], 2) > 0


@needs_onednn
@pytest.mark.parametrize("kw", [{}, {"is_causal": True, "window": 5}, {"sinks": True, "softcap": 3.0},
                                {"probability": "relu", "is_causal": True}],
                         ids=["full", "causal-window", "sinks-softcap", "relu"])
def test_the_blocked_core_on_onednn_products_equals_it_on_xla_dots(kw):
  from attn.kernel import blocked
  from attn.kernel.products import ONEDNN, XLA
  B, T, S, H, G, K, V = 2, 13, 11, 6, 2, 5, 3  # blocks of 4 that do not divide the lengths
  q, k, v = randn(24, (B, T, H, K)), randn(25, (B, S, G, K)), randn(26, (B, S, G, V))
  kw = dict(kw, sinks=randn(27, (H,))) if kw.get("sinks") else kw
  mask = jax.random.bernoulli(jax.random.PRNGKey(28), 0.7, (B, 1, T, S)).at[:, :, 3].set(False)

  def run(products):
    f = lambda q, k, v: blocked.attention(q, k, v, mask, kv_lengths=jnp.array([S, 7]), scale=0.4,
                                          block_q=4, block_k=4, products=products, **kw)
    loss = lambda q, k, v: (f(q, k, v) * jnp.sin(jnp.arange(B * T * H * V).reshape(B, T, H, V))).sum()
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)
  (got, g_got), (want, g_want) = run(ONEDNN), run(XLA)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  for a, b in zip(g_got, g_want):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@needs_onednn
def test_long_sequences_take_the_blocked_structure():
  B, T, H, K = 1, 520, 2, 4  # T·S >= 512²: "auto" would pick blocked; a partial last block
  q, k, v = randn(29, (B, T, H, K)), randn(30, (B, T, 1, K)), randn(31, (B, T, 1, 6))
  hlo = jax.jit(lambda q, k, v: kernel.attention(q, k, v, is_causal=True, impl="onednn")).lower(
      q, k, v).as_text()
  assert "attn_onednn_bmm" in hlo and "attn_onednn_nt" not in hlo
  got = kernel.attention(q, k, v, is_causal=True, impl="onednn")
  np.testing.assert_allclose(got, kernel.attention(q, k, v, is_causal=True, impl="einsum"),
                             rtol=1e-5, atol=1e-5)


def test_a_gpu_backend_is_refused_by_name(monkeypatch):
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  q = randn(32, (1, 3, 2, 4))
  with pytest.raises(ConfigError, match=r"impl.*'onednn'.*CPU backend only.*\"gpu\".*available: \['auto', "
                     r"'einsum', 'blocked', 'xla', 'cudnn'[,\]]"):  # then 'tokamax' where installed
    kernel.attention(q, q, q, impl="onednn")
