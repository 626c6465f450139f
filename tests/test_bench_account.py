"""The dot account's HLO reading, the XLA flag sets (attn.bench)."""


import jax
import jax.numpy as jnp
import pytest

from attn.kernel import blocked
from attn import kernel
from attn.bench import account
from attn.bench import flags
from attn.config import ConfigError

LIBRARIES = ("YNNPACK fusion", "XNNPACK fusion", "oneDNN fusion", "XLA dot (Eigen, oneDNN sgemm)")


def test_account_finds_every_dot_with_its_shape_and_flops():
  B, M, K, N, P = 3, 40, 24, 56, 8
  a, b, c = (jnp.ones(s) for s in ((B, M, K), (B, K, N), (N, P)))
  f = lambda a, b, c: jnp.einsum("bmk,bkn->bmn", a, b) @ c
  found = account.account(jax.jit(f).lower(a, b, c).compile().as_text())["dots"]
  flops = sorted(account.dot_flops(d) for d in found)
  assert flops == sorted([2 * B * M * K * N, 2 * B * M * N * P])
  assert all(d["library"] in LIBRARIES and d["count"] == 1 for d in found)
  assert {len(d["dims"][0]) for d in found} <= {0, 1}


@pytest.mark.slow
def test_account_counts_the_blocked_core_dots_once_per_visited_block_pair():
  T, H, K = 1024, 2, 16
  q, k, v = (jax.random.normal(jax.random.PRNGKey(i), (1, T, H, K)) for i in range(3))
  loss = lambda q, k, v: jnp.sum(kernel.attention(q, k, v, is_causal=True, impl="blocked"))
  pairs = sum(hi - lo for lo, hi in blocked.key_block_ranges(T, T, is_causal=True))
  hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile().as_text()
  found = account.account(hlo, pairs)["dots"]
  # forward: Q·Kᵀ and P·V; backward: Q·Kᵀ again, dO·Vᵀ, dV, dK, dQ
  assert len(found) == 7
  assert all(d["count"] == pairs and d["depth"] == 2 for d in found)
  assert pairs < (T // blocked.BLOCK_Q) * (T // blocked.BLOCK_K)


@pytest.mark.slow
def test_account_counts_the_windowed_core_dots_once_per_slab():
  T, H, K, w = 1024, 2, 16, 64
  q, k, v = (jax.random.normal(jax.random.PRNGKey(i), (1, T, H, K)) for i in range(3))
  loss = lambda q, k, v: jnp.sum(kernel.attention(q, k, v, is_causal=True, window=w, impl="blocked"))
  steps, depth = blocked.block_steps(T, T, is_causal=True, window=w)
  hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile().as_text()
  found = account.account(hlo, steps, depth)["dots"]
  assert (steps, depth) == (T // blocked.SLAB_Q, 1)
  assert len(found) == 7 and all(d["count"] == steps and d["depth"] == 1 for d in found)


def test_a_timed_dot_reproduces_the_shape_it_was_read_from():
  d = {"lhs": (2, 12, 8), "rhs": (2, 8, 20), "out": (2, 12, 20), "dims": [(0,), (2,), (0,), (1,)]}
  assert account.time_dot(d, 1) > 0
  assert "2 × (12×8 · 8×20)" == account._shape_text(d)


def test_an_unknown_flag_set_or_a_malformed_xla_flags_value_is_named():
  with pytest.raises(ConfigError, match="'nope'.*default"):
    flags.flag_set("nope")
  with pytest.raises(ConfigError, match="XLA_FLAGS='xla_cpu_use_xnnpack=true'"):
    flags.check_xla_flags("--xla_cpu_use_onednn=true xla_cpu_use_xnnpack=true")
  with pytest.raises(ConfigError, match="XLA_FLAGS='--xla-cpu'"):
    flags.with_flag_set("eigen", {"XLA_FLAGS": "--xla-cpu"})
  env = flags.with_flag_set("eigen+xnnpack", {"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false"})
  assert env["XLA_FLAGS"].split() == ["--xla_cpu_multi_thread_eigen=false",
                                      *flags.FLAG_SETS["eigen+xnnpack"].split()]


def _bench_targets():
  import importlib.util
  import pathlib
  path = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "bench_targets.py"
  spec = importlib.util.spec_from_file_location("bench_targets", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_bench_targets_judges_each_goal_from_the_measured_ratio():
  row = lambda name, fb_ms, ratios=None, peak=None, pct=0.0: {
      "name": name, "fb": {"ms": fb_ms, "pct_matmul": pct}, "ratios": ratios or {}, "peak_bytes": peak}
  report = {"dtype": "float32", "machine": {"cpu": "X", "versions": {"torch": None}},
            "shapes": {
                "reference": {"rows": [row("fused", 10.0, {"flax": {"fb": 0.69}}, pct=80.0)]},
                "long-4096": {"rows": [row("fused", 100.0), row("core_full", 50.0),
                                       row("core_full_onednn", 40.0)]},
                "long-4096-causal": {"rows": [row("fused", 60.0), row("core", 27.0),
                                              row("core_onednn", 24.0)]},
                "long-16384-causal": {"rows": [row("fused", 1.0, peak=300 * 2**20),
                                               row("core", 100.0, peak=200 * 2**20), row("core_window", 11.0)]}}}
  found = {what: (value, met) for what, value, _, met in _bench_targets().goals(report)}
  assert found["reference f+b: fused / flax MHA"] == (0.69, True)
  assert found["reference f+b: fused / torch MHA"] == (None, None)  # torch not installed: not measured
  assert found["reference f+b: fused % of matmul rate"] == (80.0, True)
  assert found["T=4096 f+b: causal / full, layer (blocked)"] == (0.6, False)
  assert found["T=4096 f+b: causal / full, core (blocked)"] == (0.54, True)
  assert found['T=4096 f+b: causal / full, core (blocked, impl="onednn")'] == (0.6, False)
  assert 'T=4096 f+b: causal / full, layer (blocked, impl="onednn")' not in found  # no such rows
  assert found["T=16384 causal: peak XLA MB, layer (blocked)"] == (300.0, False)
  assert found["T=16384 causal: peak XLA MB, core (blocked)"] == (200.0, True)
  assert found["T=16384 f+b: window 256 / full causal, core (blocked)"] == (0.11, False)
  assert "torch peers" in found


@pytest.mark.parametrize("content, says", [("", "not a readable JSON file"), ("[1, 2]", "a JSON list")])
def test_bench_targets_names_a_file_that_is_not_a_bench_report(tmp_path, capsys, content, says):
  path = tmp_path / "bench.json"
  path.write_text(content)
  assert _bench_targets().main([str(path)]) == 2
  err = capsys.readouterr().err
  assert str(path) in err and says in err
