"""The accelerator implementations (splash, tokamax, cudnn) against the einsum kernel, and the table per backend.

Splash runs here in Pallas interpret mode (ATTN_PALLAS_INTERPRET=1); tokamax's wrapper runs
through tokamax's own "xla" path, which checks attn's corrections (alignment, fully masked
rows, soft-cap order) but not its GPU kernels; those, cuDNN and compiled splash carry the
gpu / tpu markers and skip elsewhere.
"""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn import kernel
from attn.config import ConfigError
from attn.kernel import impls, splash, tokamax_kernel, xla
from attn.kernel.call import make_call

ON_GPU = jax.default_backend() == "gpu"
ON_TPU = jax.default_backend() == "tpu"
needs_gpu = pytest.mark.skipif(not ON_GPU, reason=f"needs a GPU backend (this is {jax.default_backend()})")
needs_tpu = pytest.mark.skipif(not ON_TPU, reason=f"needs a TPU backend (this is {jax.default_backend()})")
HAVE_TOKAMAX = importlib.util.find_spec("tokamax") is not None  # found, not imported: attn imports it
needs_tokamax = pytest.mark.skipif(not HAVE_TOKAMAX, reason="tokamax is not installed (extra [tokamax])")


def randn(seed, shape, dtype=jnp.float32):
  """N(0,1) drawn with numpy and cast on the host: jax's draws compile one program per shape."""
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(np.float32).astype(dtype))


def case(seed, B, T, S, H, G, K, V, *, kv_lengths=None, sinks=False, mask=False, bias=False,
         dtype=jnp.float32, **kw):
  """Fresh q, k, v and the options of one call: kv_lengths as a list, sinks/mask/bias drawn."""
  q, k, v = randn(seed, (B, T, H, K), dtype), randn(seed + 1, (B, S, G, K), dtype), randn(
      seed + 2, (B, S, G, V), dtype)
  if kv_lengths is not None:
    kw["kv_lengths"] = jnp.array(kv_lengths)
  if sinks:
    kw["sinks"] = randn(seed + 3, (H,))
  if mask:
    kw["mask"] = jnp.asarray(np.random.default_rng(seed + 4).random((B, 1, T, S)) < 0.6)
  if bias:
    kw["logits_bias"] = randn(seed + 5, (1, H, T, S))
  return (q, k, v), kw


def value_and_grads(f, qkv, kw):
  """f's output and the gradients of a random projection of it by q, k, v (and sinks)."""
  ct = randn(99, (*qkv[0].shape[:3], qkv[2].shape[3]))
  sinks = kw.pop("sinks", None)

  def loss(q, k, v, s):
    out = f(q, k, v, {**kw, **({} if s is None else {"sinks": s})})
    return (out.astype(jnp.float32) * ct).sum(), out
  argnums = (0, 1, 2, 3) if sinks is not None else (0, 1, 2)
  # Compiled whole: op by op (splash's interpreter above all), each small op compiles on its own.
  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums, has_aux=True))(*qkv, sinks)
  return out, grads


def by_impl(impl):
  return lambda q, k, v, kw: kernel.attention(q, k, v, impl=impl, **kw)


def assert_equal_to_einsum(f, qkv, kw, atol=2e-5, what=""):
  out, grads = value_and_grads(f, qkv, dict(kw))
  ref, ref_grads = value_and_grads(by_impl("einsum"), qkv, dict(kw))
  assert bool(jnp.isfinite(out.astype(jnp.float32)).all()), what
  np.testing.assert_allclose(np.float32(out), np.float32(ref), atol=atol, rtol=atol, err_msg=what)
  for name, a, b in zip("qkvs", grads, ref_grads):
    np.testing.assert_allclose(np.float32(a), np.float32(b), atol=atol * 10, rtol=atol * 10,
                               err_msg=f"d{name} {what}")


@pytest.fixture
def interpret(monkeypatch):
  monkeypatch.setenv(splash.INTERPRET_ENV, "1")


def test_splash_in_interpret_mode_equals_einsum_with_every_option_it_has(interpret):
  """One call with all of it: GQA, d_v != d_k, causal with T > S (fully masked rows), kv_lengths
  (one of them 0), a window, sinks and soft-cap; T and S not multiples of the 128 block."""
  qkv, kw = case(0, 2, 9, 6, 4, 2, 8, 16, kv_lengths=[5, 0], sinks=True, is_causal=True,
                 window=4, softcap=3.0)
  assert_equal_to_einsum(by_impl("splash"), qkv, kw)


SPLASH_SWEEP = [  # (B, T, S, H, G, K, V, options)
    (1, 130, 200, 2, 1, 8, 8, dict(is_causal=True)),                   # 2 key blocks, S > T
    (2, 260, 131, 2, 2, 16, 8, dict(is_causal=True, kv_lengths=[131, 40])),  # 3 query blocks
    (1, 200, 200, 4, 2, 8, 16, dict(window=37)),                       # two-sided window
    (1, 200, 200, 4, 1, 8, 8, dict(is_causal=True, window=70, sinks=True, softcap=5.0)),
    (2, 7, 300, 3, 3, 8, 12, dict(kv_lengths=[1, 299], softcap=1.0)),  # decoding-like T << S
    (1, 300, 100, 2, 1, 8, 8, dict(window=5)),                         # T > S: window empties rows
]


@pytest.mark.slow
@pytest.mark.parametrize("shape", SPLASH_SWEEP, ids=lambda s: f"T{s[1]}S{s[2]}H{s[3]}G{s[4]}")
def test_splash_sweep_in_interpret_mode(interpret, shape):
  B, T, S, H, G, K, V, options = shape
  qkv, kw = case(T + S, B, T, S, H, G, K, V, **options)
  assert_equal_to_einsum(by_impl("splash"), qkv, kw, what=str(options))


@pytest.mark.slow
def test_splash_bfloat16_and_explicit_blocks_in_interpret_mode(interpret):
  qkv, kw = case(3, 1, 200, 260, 2, 1, 16, 16, dtype=jnp.bfloat16, is_causal=True, sinks=True)
  out = kernel.attention(*qkv, impl="splash", block_q=128, block_k=256, **kw)
  ref = kernel.attention(*[x.astype(jnp.float32) for x in qkv], impl="einsum", **kw)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.float32(out), ref, atol=5e-2, rtol=5e-2)


@pytest.mark.slow  # importing tokamax and its first compile: about 4 s
@needs_tokamax
def test_tokamax_wrapper_equals_einsum_through_tokamax_xla_path():
  """T != S causal (a dense mask, bottom-right), a window, kv_lengths with a 0, d_v != d_k, GQA."""
  qkv, kw = case(10, 2, 7, 5, 4, 2, 8, 16, kv_lengths=[4, 0], is_causal=True, window=3,
                 softcap=2.0)
  via_xla = lambda q, k, v, kw: tokamax_kernel.attention(make_call(q, k, v, **kw), "xla")
  assert_equal_to_einsum(via_xla, qkv, kw)


@pytest.mark.slow
@needs_tokamax
@pytest.mark.parametrize("T, S, options", [
    (9, 9, dict(is_causal=True, window=2)),  # tokamax's own causal and window at T == S
    (6, 6, dict(window=3, kv_lengths=[6, 2])),
    (5, 8, dict(mask=True, bias=True)),
    (8, 8, dict(is_causal=True, softcap=4.0)),
    (7, 7, dict(mask=True, kv_lengths=[7, 2], window=2)),  # a row the masks empty only together
])
def test_tokamax_wrapper_sweep_through_tokamax_xla_path(T, S, options):
  qkv, kw = case(T * S, 2, T, S, 4, 1, 8, 8, **options)
  via_xla = lambda q, k, v, kw: tokamax_kernel.attention(make_call(q, k, v, **kw), "xla")
  assert_equal_to_einsum(via_xla, qkv, kw, what=str(options))


def test_xla_path_decoding_with_is_causal_drops_the_mask_and_stays_right():
  (q, k, v), kw = case(20, 2, 1, 7, 4, 2, 8, 8, kv_lengths=[7, 0], is_causal=True)
  # compiled whole (eager, each small op compiles on its own)
  attend = jax.jit(lambda q, k, v, n, impl: kernel.attention(q, k, v, impl=impl, is_causal=True, kv_lengths=n),
                   static_argnums=4)
  got = attend(q, k, v, kw["kv_lengths"], "xla")
  np.testing.assert_allclose(got, attend(q, k, v, kw["kv_lengths"], "einsum"), atol=2e-5)
  assert not np.asarray(got[1]).any()  # kv_lengths 0: zeros, not jax's uniform weights


def test_visible_rows_agree_with_the_dense_masks():
  combos = [(T, S, is_causal, window, with_lengths) for T, S in ((9, 4), (4, 9)) for is_causal in (False, True)
            for window in (None, 3) for with_lengths in (False, True)]

  @jax.jit  # every combination in one program (eager, each small op compiles on its own)
  def both(lengths_4, lengths_9):
    out = []
    for T, S, is_causal, window, with_lengths in combos:
      lengths = ({4: lengths_4, 9: lengths_9}[S]) if with_lengths else None
      out.append((kernel.structured_mask(T, S, is_causal, lengths, window),
                  kernel.masks.visible_rows(T, S, is_causal, lengths, window)))
    return out
  for (T, S, is_causal, window, with_lengths), (dense, got) in zip(
      combos, both(jnp.array([0, 2, 4]), jnp.array([0, 2, 9]))):
    dense, got = (None if a is None else np.asarray(a) for a in (dense, got))
    want = (np.ones((1, T), bool) if dense is None
            else np.broadcast_to(dense, (dense.shape[0], 1, T, S)).any(-1)[:, 0])
    got = np.ones((1, T), bool) if got is None else got
    np.testing.assert_array_equal(*np.broadcast_arrays(got, want),
                                  err_msg=f"{T, S, is_causal, window, with_lengths}")


# The table, per backend named (not detected).

def test_available_impls_per_backend(monkeypatch):
  monkeypatch.delenv(splash.INTERPRET_ENV, raising=False)
  monkeypatch.setattr(impls, "backend", lambda: "cpu")
  cpu = kernel.available_impls()
  assert {"auto", "einsum", "blocked", "xla"} <= set(cpu)
  assert not {"cudnn", "tokamax", "splash"} & set(cpu)
  monkeypatch.setattr(impls, "backend", lambda: "gpu")
  gpu = kernel.available_impls()
  assert {"cudnn", "einsum", "blocked"} <= set(gpu) and not {"splash", "onednn"} & set(gpu)
  assert ("tokamax" in gpu) == HAVE_TOKAMAX
  monkeypatch.setattr(impls, "backend", lambda: "tpu")
  tpu = kernel.available_impls()
  assert "splash" in tpu and not {"cudnn", "tokamax", "onednn"} & set(tpu)
  monkeypatch.setattr(impls, "backend", lambda: "cpu")
  monkeypatch.setenv(splash.INTERPRET_ENV, "1")
  assert "splash" in kernel.available_impls()


def test_auto_picks_per_backend(monkeypatch):
  monkeypatch.delenv(splash.INTERPRET_ENV, raising=False)
  long16 = jnp.zeros((1, 512, 4, 64), jnp.bfloat16)
  long32 = jnp.zeros((1, 512, 4, 64), jnp.float32)
  short16 = jnp.zeros((1, 8, 4, 64), jnp.bfloat16)
  wide16 = jnp.zeros((1, 512, 4, 264), jnp.bfloat16)
  picks = {}
  for backend in ("cpu", "gpu", "tpu"):
    monkeypatch.setattr(impls, "backend", lambda b=backend: b)
    picks[backend] = dict(
        long16=kernel.best_impl(long16, long16, long16),
        long32=kernel.best_impl(long32, long32, long32),
        short16=kernel.best_impl(short16, short16, short16),
        softcap=kernel.best_impl(long16, long16, long16, softcap=30.0),
        sinks=kernel.best_impl(long16, long16, long16, sinks=jnp.zeros(4)),
        weights=kernel.best_impl(long16, long16, long16, return_weights=True),
        wide=kernel.best_impl(wide16, wide16, wide16))
  assert picks["cpu"] == dict(long16="blocked", long32="blocked", short16="einsum",
                              softcap="blocked", sinks="blocked", weights="einsum", wide="blocked")
  tk = "tokamax" if HAVE_TOKAMAX else "blocked"
  assert picks["gpu"] == dict(long16="cudnn", long32=tk, short16="cudnn", softcap=tk,
                              sinks="blocked", weights="einsum", wide=tk)
  assert picks["tpu"] == dict(long16="splash", long32="splash", short16="einsum",
                              softcap="splash", sinks="splash", weights="einsum", wide="splash")


def test_auto_on_tpu_falls_back_to_blocked_for_long_calls_splash_refuses(monkeypatch):
  monkeypatch.setattr(impls, "backend", lambda: "tpu")
  x = jnp.zeros((1, 512, 2, 8))
  assert kernel.best_impl(x, x, x, probability="sigmoid") == "blocked"


@pytest.mark.parametrize("impl, kwargs, match", [
    ("splash", {}, r"impl='splash'.*TPU backend only.*ATTN_PALLAS_INTERPRET=1.*available"),
    ("cudnn", {}, r"impl='cudnn'.*GPU backend only.*available: \['auto'"),
    ("tokamax", {}, r"impl='tokamax'.*GPU backend only"),
])
def test_off_its_backend_an_impl_is_refused_by_name_before_tracing(monkeypatch, impl, kwargs,
                                                                   match):
  monkeypatch.delenv(splash.INTERPRET_ENV, raising=False)
  monkeypatch.setattr(impls, "backend", lambda: "cpu")
  x = jnp.zeros((1, 4, 2, 8))
  with pytest.raises(ConfigError, match=match):
    kernel.attention(x, x, x, impl=impl, **kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(return_weights=True), r"return_weights=True.*splash.*take this call here: \['auto', 'einsum'"),
    (dict(logits_bias=jnp.zeros((1, 2, 4, 4))), r"logits_bias=.*splash"),
    (dict(mask=jnp.ones((1, 1, 4, 4), bool)), r"mask=.*is_causal, kv_lengths and window"),
    (dict(probability="relu"), r"probability='relu'.*splash"),
    (dict(block_q=100), r"block_q=100.*multiple of 128"),
])
def test_splash_refuses_what_it_lacks_by_name(interpret, kwargs, match):
  x = jnp.zeros((1, 4, 2, 8))
  with pytest.raises(ConfigError, match=match):
    kernel.attention(x, x, x, impl="splash", **kwargs)


@pytest.mark.parametrize("shape, dtype, kwargs, match", [
    ((1, 4, 2, 12), jnp.bfloat16, {}, r"q.shape\[-1\]=12.*multiple of 8 up to"),
    ((1, 4, 2, 264), jnp.bfloat16, {}, r"q.shape\[-1\]=264.*multiple of 8 up to"),
    ((1, 4, 2, 8), jnp.float32, {}, r"impl='cudnn'.*bfloat16, float16 only, got float32"),
    ((1, 5, 2, 8), jnp.bfloat16, dict(logits_bias=jnp.zeros((1, 2, 5, 5))), r"q.shape\[1\]=5.*even"),
    ((1, 4, 2, 8), jnp.bfloat16, dict(softcap=2.0), r"softcap=2.0.*cudnn"),
])
def test_cudnn_refuses_by_name_on_a_named_gpu_backend(monkeypatch, shape, dtype, kwargs, match):
  monkeypatch.setattr(impls, "backend", lambda: "gpu")
  x = jnp.zeros(shape, dtype)
  with pytest.raises(ConfigError, match=match):
    kernel.attention(x, x, x, impl="cudnn", **kwargs)


@needs_tokamax
@pytest.mark.parametrize("kwargs, match", [
    (dict(sinks=jnp.zeros(2)), r"sinks=.*tokamax has no sinks"),
    (dict(softcap=2.0, logits_bias=jnp.zeros((1, 2, 4, 4))), r"softcap=2.0.*after the bias"),
    (dict(return_weights=True), r"return_weights=True.*tokamax"),
])
def test_tokamax_refuses_by_name_on_a_named_gpu_backend(monkeypatch, kwargs, match):
  monkeypatch.setattr(impls, "backend", lambda: "gpu")
  x = jnp.zeros((1, 4, 2, 8))
  with pytest.raises(ConfigError, match=match):
    kernel.attention(x, x, x, impl="tokamax", **kwargs)


def test_cudnn_head_limit_reads_the_device():
  assert xla.cudnn_head_max() in (128, 256)


# On the real thing (scripts/device_check.sh runs these with -m gpu).

GPU_CASES = [  # (T, S, H, G, K, V, options); bf16, forward and backward against einsum
    (256, 256, 8, 8, 64, 64, dict()),
    (256, 256, 8, 2, 128, 128, dict(is_causal=True)),
    (130, 258, 4, 1, 64, 64, dict(is_causal=True, kv_lengths=[258, 0])),
    (256, 256, 4, 4, 64, 64, dict(is_causal=True, window=32)),
]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("impl", ["cudnn", "tokamax"])
@pytest.mark.parametrize("shape", GPU_CASES, ids=lambda s: f"T{s[0]}S{s[1]}G{s[3]}K{s[4]}")
def test_gpu_impls_equal_einsum_in_bfloat16(impl, shape):
  if impl == "tokamax" and not HAVE_TOKAMAX:
    pytest.skip("tokamax is not installed (extra [tokamax])")
  T, S, H, G, K, V, options = shape
  qkv, kw = case(T, 2, T, S, H, G, K, V, dtype=jnp.bfloat16, **options)
  assert_equal_to_einsum(by_impl(impl), qkv, kw, atol=3e-2, what=f"{impl} {options}")


@pytest.mark.gpu
@needs_gpu
@needs_tokamax
def test_tokamax_on_gpu_runs_what_cudnn_refuses():
  qkv, kw = case(5, 2, 256, 256, 8, 2, 128, 256, dtype=jnp.bfloat16, is_causal=True, softcap=30.0)
  assert_equal_to_einsum(by_impl("tokamax"), qkv, kw, atol=3e-2)


@pytest.mark.gpu
@needs_gpu
def test_auto_on_this_gpu_is_cudnn_for_half_precision():
  x = jnp.zeros((1, 256, 4, 64), jnp.bfloat16)
  assert kernel.best_impl(x, x, x) == "cudnn"


@pytest.mark.tpu
@needs_tpu
@pytest.mark.parametrize("shape", SPLASH_SWEEP[:4], ids=lambda s: f"T{s[1]}S{s[2]}")
def test_splash_compiled_on_tpu_equals_einsum(shape):
  B, T, S, H, G, K, V, options = shape
  qkv, kw = case(T + S, B, T, S, H, G, K, V, **options)
  assert_equal_to_einsum(by_impl("splash"), qkv, kw, atol=2e-2, what=str(options))


@pytest.mark.parametrize("value, on", [("1", True), ("true", True), ("Yes", True), ("on", True), ("", False),
                                       ("0", False), ("false", False), ("no", False), ("NO", False), ("off", False)])
def test_pallas_interpret_reads_yes_and_no_as_meant(monkeypatch, value, on):
  monkeypatch.setenv(splash.INTERPRET_ENV, value)
  monkeypatch.setattr(impls, "backend", lambda: "cpu")
  assert splash.interpret() is on
  assert ("splash" in kernel.available_impls()) is on


@pytest.mark.parametrize("value", ["maybe", "2", "interpret"])
def test_pallas_interpret_refuses_any_other_value_by_name(monkeypatch, value):
  monkeypatch.setenv(splash.INTERPRET_ENV, value)
  with pytest.raises(ConfigError, match=rf"ATTN_PALLAS_INTERPRET='{value}' is not allowed: one of \['1', 'true'"):
    splash.interpret()
