"""attn.count.selectors: the selectors' FLOPs and the core's at k keys a query, in closed form, against
XLA's cost analysis and against the pairs each selection's own masks keep."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn import api
from attn.config import HeadConfig
from attn.count import measured, selectors
from attn.kernel import nsa as cmp
from attn.kernel import select
from attn.variants.mechanisms import nsa, selection

# XLA also counts the elementwise work the closed forms leave out (masks, exp, max, ReLU, top-k's
# comparisons: a few operations per score or per key element); with these widths (K = 64, V = 48,
# d_I = 16) XLA counted 0.4-7% more than the closed forms (jax 0.10.2), never less.
TOL = 0.10
CFG = HeadConfig(d_model=64, num_heads=4, d_k=64, d_v=48, num_kv_heads=2)
T = 48


def _randn(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


def _params(cfg, keep=lambda name: True, seed=0):
  """Random per_head params of cfg (those keep names), drawn with numpy from the shapes: attn.init run
  eagerly would compile each of its operations (the counts and masks here do not depend on the values)."""
  rng = np.random.default_rng(seed)
  return {n: jnp.asarray(0.3 * rng.standard_normal(s).astype(np.float32))
          for n, s in sorted(api.param_shapes("per_head", cfg).items()) if keep(n)}


def _close(closed, xla):
  assert closed <= xla <= (1 + TOL) * closed, (closed, xla)


def test_moba_gate_flops_against_xla():
  cfg = CFG.replace(extra={"moba": {"block": 8, "top_k": 2}})
  q, k = _randn(0, (1, T, 4, 64)), _randn(1, (1, T, 2, 64))
  xla = measured.xla_flops(lambda q, k: select.moba_scores(q, k, block=8, is_causal=True), q, k)
  _close(selectors.selector_flops(cfg, T), xla)


def test_indexer_flops_against_xla():
  cfg = CFG.replace(extra={"indexer": {"heads": 4, "head_dim": 16, "top_k": 8}})
  p = _params(cfg, lambda n: n.startswith("w_i"))
  q, k = _randn(0, (1, T, 4, 64)), _randn(1, (1, T, 2, 64))
  xla = measured.xla_flops(lambda p, q, k: select.index_scores(*selection.index_inputs(p, q, k, cfg)), p, q, k)
  _close(selectors.selector_flops(cfg, T), xla)


def test_nsa_selector_and_compressed_branch_flops_against_xla():
  """Gates, pooling, the compressed branch and the banded block scores (the long path's chunk)."""
  cfg = CFG.replace(extra={"nsa": {"compress_block": 8, "compress_stride": 4, "select_block": 8,
                                   "select_count": 2, "window": 8}})
  o = nsa.options(cfg)
  p = _params(cfg, lambda n: n in ("w_gate", "b_gate", "w_compress_k", "w_compress_v"))
  x, q = _randn(0, (1, T, 64)), _randn(1, (1, T, 4, 64))
  k, v = _randn(2, (1, T, 2, 64)), _randn(3, (1, T, 2, 48))
  band = tuple(map(jnp.asarray, cmp.overlaps(T, 8, 4, 8)))
  t, lim = jnp.arange(T), jnp.array([T])
  geo = dict(T=T, S=T, is_causal=True, limit_B=lim, vis_BHcS=None)

  def selector(p, x, q, k, v):
    kc, vc = nsa._compressed_kv(p, k, v, o)
    out = cmp.branch(q, kc, vc, cmp.compressed_visible(t, **geo, block=8, stride=4),
                     cmp.selection_visible(t, **geo, select_block=8), groups=2, band=band, count=2,
                     scale=cfg.score_scale, softcap=None)
    return nsa.gates(p, x), out
  N = cmp.num_compressed(T, 8, 4)
  closed = selectors.selector_flops(cfg, T) + 2 * T * N * 4 * (64 + 48)  # + the compressed core
  _close(closed, measured.xla_flops(selector, p, x, q, k, v))


def test_core_at_k_keys_against_xla():
  """k keys a query, gathered (no causal shortfall): 2·T·k·H·(K + V) and the softmax's elementwise."""
  kk = 6
  q, ks, vs = _randn(0, (1, T, 4, 64)), _randn(1, (1, T, kk, 4, 64)), _randn(2, (1, T, kk, 4, 48))

  def core(q, ks, vs):
    w = jax.nn.softmax(jnp.einsum("BTHK,BTkHK->BTHk", q, ks), axis=-1)
    return jnp.einsum("BTHk,BTkHV->BTHV", w, vs)
  _close(selectors.core_flops_at(CFG, T, kk, causal=False), measured.xla_flops(core, q, ks, vs))
  assert selectors.core_flops_at(CFG, T, T) == 2 * (T * (T + 1) // 2) * 4 * 112
  assert selectors.core_flops_at(CFG, T, 5) == 2 * (15 + 43 * 5) * 4 * 112


@pytest.mark.parametrize("opts", [
    {"compress_block": 8, "compress_stride": 4, "select_block": 8, "select_count": 3, "window": 5},
    pytest.param({"compress_block": 5, "compress_stride": 3, "select_block": 7, "select_count": 2,
                  "window": 64}, marks=pytest.mark.slow)])
def test_nsa_keys_are_the_pairs_its_masks_keep(opts):
  """nsa.keys (closed form) against the dense path's own masks at T = 47 (not a multiple of a block)."""
  Tn = 47
  cfg = CFG.replace(extra={"nsa": opts})
  p = _params(cfg, seed=1)
  q, k, v = _randn(0, (1, Tn, 4, 64)), _randn(1, (1, Tn, 2, 64)), _randn(2, (1, Tn, 2, 48))
  w = jax.jit(lambda q, k, v: nsa.branches(p, q, k, v, cfg=cfg, is_causal=True, return_weights=True)[3])(q, k, v)
  got = nsa.keys(cfg, Tn)
  assert got["selected"] == int((w[0, 0] > 0).sum())  # a softmax's weights: > 0 on every kept key
  t = np.arange(Tn)
  assert got["window"] == int(np.minimum(opts["window"], t + 1).sum())
  lim = jnp.array([Tn])
  usable = cmp.compressed_visible(jnp.arange(Tn), T=Tn, S=Tn, block=opts["compress_block"],
                                  stride=opts["compress_stride"], is_causal=True, limit_B=lim, vis_BHcS=None)
  assert got["compressed"] == int(usable.sum())
  row = selectors.selection_row(cfg, Tn)
  assert row["core_flops"] == 2 * sum(got.values()) * 4 * 112


def test_attn_count_prints_the_selection_row(capsys):
  import attn.cli
  code = attn.cli.main(["count", "--d-model", "64", "--num-heads", "4", "--d-k", "16", "--d-v", "8",
                        "--seq-len", "300", "--variant", "per_head", "--extra",
                        "{nsa = {compress_block = 8, compress_stride = 4, select_block = 16, select_count = 3, window = 20}}"])
  out = capsys.readouterr().out
  assert code == 0 and "Key selection at T=300" in out
  cfg = HeadConfig(d_model=64, num_heads=4, d_k=16, d_v=8, extra={"nsa": {
      "compress_block": 8, "compress_stride": 4, "select_block": 16, "select_count": 3, "window": 20}})
  row = selectors.selection_row(cfg, 300)
  assert f"| nsa | {row['params']:,} | {row['selector_flops']:,} |" in out
  assert f"{row['core_flops']:,} | {row['full_core_flops']:,} | {row['core_vs_full']} |" in out
