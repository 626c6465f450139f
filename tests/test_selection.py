"""Key selection as head mechanisms (attn.variants.selection): the kit, refusals, exactness, counts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn import api, kernel
from attn.config import ConfigError, HeadConfig
from attn.kernel import select
from attn.testing import check_mechanism
from attn.kernel import gathered as kernel_gathered
from attn.kernel import sparse as kernel_sparse
from attn.variants.mechanisms import selection
from attn.variants.mechanisms import MECHANISMS


def _randn(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


CFG = HeadConfig(d_model=24, num_heads=6, d_k=6, d_v=7, num_kv_heads=2, rope_dim=4, rope_theta=100.0)


@pytest.mark.slow
@pytest.mark.parametrize("name,variant", [("moba", "per_head"), ("moba", "fused"), ("moba", "mla"),
                                          ("indexer", "per_head"), ("indexer", "fused")])
def test_kit_passes(name, variant):
  check_mechanism(MECHANISMS[name], variants=[variant])


@pytest.mark.parametrize("extra,field", [
    ({"moba": {"top_k": 0}}, "extra.moba.top_k"), ({"moba": {"block": 0}}, "extra.moba.block"),
    ({"moba": {"top_k": -2}}, "extra.moba.top_k"), ({"indexer": {"heads": 0}}, "extra.indexer.heads"),
    ({"indexer": {"top_k": 0}}, "extra.indexer.top_k"), ({"indexer": {"head_dim": 1.5}}, "extra.indexer.head_dim"),
    ({"moba": {}, "indexer": {}}, "extra."),
])
def test_bad_options_refused_by_name(extra, field):
  with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
    api.check_config("per_head", CFG.replace(extra=extra))


def test_selection_refused_on_non_softmax_heads_and_indexer_without_unrotated_dims():
  with pytest.raises(ConfigError, match="probability"):
    api.check_config("per_head", CFG.replace(probability="sigmoid", extra={"moba": {}}))
  with pytest.raises(ConfigError, match="rope_dim"):
    api.check_config("per_head", CFG.replace(rope_dim=6, extra={"indexer": {}}))
  with pytest.raises(ConfigError, match="window"):
    api.check_config("per_head", CFG.replace(window=8, extra={"moba": {}}))


def test_return_weights_refused_at_long_T():
  cfg = HeadConfig(d_model=8, num_heads=2, d_k=4, d_v=4, extra={"moba": {"block": 64, "top_k": 2}})
  p = api.init("per_head", jax.random.key(0), cfg)
  x = _randn(0, (1, 512, 8))
  with pytest.raises(ConfigError, match="return_weights"):
    api.apply("per_head", p, x, cfg=cfg, is_causal=True, return_weights=True)


@pytest.mark.parametrize("variant", ["per_head", "fused", "mla"])
@pytest.mark.slow
def test_selecting_every_key_is_full_causal_attention_exactly(variant):
  T = 13
  plain = CFG.replace(rope_dim=0) if variant == "mla" else CFG
  x = _randn(1, (2, T, plain.d_model))
  for extra in ({"moba": {"block": 4, "top_k": 4}}, {"indexer": {"heads": 2, "head_dim": 3, "top_k": T}}):
    if variant == "mla" and "indexer" in extra:
      continue  # refused by mla
    cfg = plain.replace(extra=extra)
    p = api.init(variant, jax.random.key(1), cfg)
    own = {n: a for n, a in p.items() if not n.startswith("w_i")}
    y = api.apply(variant, p, x, cfg=cfg, is_causal=True)
    want = api.apply(variant, own, x, cfg=plain, is_causal=True)
    np.testing.assert_array_equal(y, want)
    if extra.get("moba"):  # fewer blocks: the output moves
      few = plain.replace(extra={"moba": {"block": 4, "top_k": 2}})
      assert not np.allclose(api.apply(variant, p, x, cfg=few, is_causal=True), want, atol=1e-3)


@pytest.mark.slow
def test_the_indexer_shared_by_8_query_heads_runs_the_token_kernel_at_long_T(monkeypatch):
  """H = 8 query heads over one kv head, T = 600: the indexer's choice (its indices beside the bits,
  attn.kernel.sparse's idx_BTk) runs on attn.kernel.tokens, equal to impl="einsum" in values and gradients."""
  from attn.kernel import tokens as kernel_tokens
  calls = []
  monkeypatch.setattr(kernel_tokens, "attention", lambda *a, run=kernel_tokens.attention, **kw: calls.append(1) or run(*a, **kw))
  cfg = HeadConfig(d_model=16, num_heads=8, d_k=6, d_v=5, num_kv_heads=1, rope_dim=2,
                   extra={"indexer": {"heads": 2, "head_dim": 4, "top_k": 100}})
  p = api.init("per_head", jax.random.key(5), cfg)
  x, kv = _randn(6, (2, 600, 16)), jnp.array([600, 301])
  cot = _randn(7, (2, 600, 16))
  f = lambda impl: jax.jit(jax.value_and_grad(lambda x: (api.apply(  # noqa: E731
      "per_head", p, x, cfg=cfg, is_causal=True, kv_lengths=kv, impl=impl) * cot).sum()))(x)
  (l1, g1), (l2, g2) = f("auto"), f("einsum")
  assert calls, "the token kernel was not called"
  np.testing.assert_allclose(l1, l2, rtol=1e-5)
  np.testing.assert_allclose(g1, g2, atol=1e-4 * max(1.0, float(jnp.abs(g2).max())))


@pytest.mark.parametrize("extra", [{"moba": {"block": 64, "top_k": 3}},
                                   {"indexer": {"heads": 2, "head_dim": 4, "top_k": 100}}])
@pytest.mark.slow
def test_sparse_path_equals_dense_path_at_long_T(extra, monkeypatch):
  """T = 600 (auto takes the kernel computing only the chosen keys) against impl="einsum" (the
  selection's dense mask),
  values and gradients, with GQA, d_v ≠ d_k, RoPE and padding."""
  calls = []
  for module in (kernel_sparse, kernel_gathered):  # the indexer's row, MoBA's (attn.kernel.selected calls them)
    monkeypatch.setattr(module, "attention", lambda *a, run=module.attention, **kw: calls.append(1) or run(*a, **kw))
  cfg = HeadConfig(d_model=16, num_heads=4, d_k=6, d_v=5, num_kv_heads=2, rope_dim=2, extra=extra)
  p = api.init("per_head", jax.random.key(2), cfg)
  x = _randn(3, (2, 600, 16))
  kv = jnp.array([600, 333])

  def loss(p, x, impl):
    y = api.apply("per_head", p, x, cfg=cfg, is_causal=True, kv_lengths=kv, impl=impl)
    return (y * _randn(4, y.shape)).sum(), y

  (l1, y1), g1 = jax.jit(jax.value_and_grad(lambda p, x: loss(p, x, "auto"), (0, 1), has_aux=True))(p, x)
  (l2, y2), g2 = jax.jit(jax.value_and_grad(lambda p, x: loss(p, x, "einsum"), (0, 1), has_aux=True))(p, x)
  assert calls, "the sparse kernel was not called"
  np.testing.assert_allclose(y1, y2, atol=1e-5)
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
    np.testing.assert_allclose(a, b, atol=1e-4 * max(1.0, float(jnp.abs(b).max())))
  for n in ("w_iq", "w_ik", "w_iw"):  # the selection has no gradient
    if n in g1[0]:
      assert not np.any(g1[0][n])


@pytest.mark.slow
def test_selection_ignores_positions_shift():
  """The indexer reads unrotated dims and MoBA relative scores: shifting every position keeps y."""
  for extra in ({"moba": {"block": 3, "top_k": 2}}, {"indexer": {"heads": 2, "head_dim": 3, "top_k": 4}}):
    cfg = CFG.replace(extra=extra)
    p = api.init("per_head", jax.random.key(3), cfg)
    x = _randn(5, (2, 17, cfg.d_model))
    pos = jnp.arange(17)
    y = api.apply("per_head", p, x, cfg=cfg, is_causal=True, positions=pos)
    y2 = api.apply("per_head", p, x, cfg=cfg, is_causal=True, positions=pos + 37)
    np.testing.assert_allclose(y2, y, atol=2e-5)


@pytest.mark.slow
def test_counts_in_closed_form():
  """Keys attended (the core's FLOPs) against the selection's own mask; indexer parameters stored."""
  T = 50
  for extra in ({"moba": {"block": 8, "top_k": 3}}, {"moba": {"block": 7, "top_k": 1}},
                {"indexer": {"heads": 2, "head_dim": 3, "top_k": 9}}):
    cfg = CFG.replace(extra=extra)
    q, k = _randn(6, (1, T, cfg.num_heads, cfg.d_k)), _randn(7, (1, T, cfg.num_kv_heads, cfg.d_k))
    if "moba" in extra:
      o = extra["moba"]
      pairs = select.moba_mask(q, k, block=o["block"], top_k=o["top_k"], is_causal=True).sum() / cfg.num_heads
    else:
      pairs = select.indexer_tokens(_randn(8, (1, T, 2, 3)), _randn(9, (1, T, 3)), _randn(10, (1, T, 2)),
                                    top_k=9, is_causal=True).sum()
    want = 2 * int(pairs) * cfg.num_heads * (cfg.d_k + cfg.d_v)
    assert selection.selected_core_flops(cfg, T) == want
  cfg = CFG.replace(extra={"indexer": {"heads": 3, "head_dim": 5, "top_k": 9}})
  shapes = api.param_shapes("per_head", cfg)
  stored = sum(int(np.prod(shapes[n])) for n in ("w_iq", "w_ik", "w_iw"))
  assert MECHANISMS["indexer"].param_count(cfg) == stored == 2 * (6 * 3 * 5 + 2 * 5 + 6 * 3)
  assert selection.selected_core_flops(CFG, T) == 2 * (T * (T + 1) // 2) * 6 * 13


@pytest.mark.parametrize("variant,name", [("talking_heads", "moba"), ("talking_heads", "indexer"),
                                          ("merged", "indexer"), ("collaborative", "indexer"),
                                          ("mla", "indexer")])
def test_variants_that_cannot_carry_a_selection_refuse_it_by_name(variant, name):
  cfg = HeadConfig(d_model=24, num_heads=6, d_k=6, d_v=7, num_kv_heads=2, extra={name: {}})
  with pytest.raises(ConfigError, match=f"extra\\.{name}=.*absent for {variant}"):
    api.check_config(variant, cfg)
