"""Pooled key selection (attn.kernel.pooled, attn.variants.mechanisms.pooled): the choices against
transformers' own indexers, the kernel rows against the dense masked reference in values and
gradients, exactness at a full budget, counts, refusals."""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn import api
from attn.config import ConfigError, HeadConfig
from attn.count import measured, selectors
from attn.kernel import impls, pooled, select
from attn.kernel import gathered as kernel_gathered
from attn.kernel import selected as kernel_selected
from attn.kernel import sparse as kernel_sparse
from attn.kernel import tokens as kernel_tokens
from attn.variants.mechanisms import pooled as mech
from conftest import fresh_params


def _randn(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


def _sets(idx):
  return [[set(int(i) for i in row if i >= 0) for row in b] for b in np.asarray(idx)]


def _untied(scores_BTN, L_BT, pool, n):
  """(B,T) bool: rows whose n-th and (n+1)-th best candidate pools score apart (ReLU scores tie at 0,
  and torch's top-k breaks ties in no documented order)."""
  s = np.asarray(scores_BTN)
  cand = (np.arange(s.shape[-1]) + 1) * pool - 1 <= np.asarray(L_BT)[..., None]
  s = np.sort(np.where(cand, s, -np.inf), -1)[..., ::-1]
  if s.shape[-1] <= n:
    return np.ones(s.shape[:2], bool)
  return (s[..., n - 1] != s[..., n]) | np.isinf(s[..., n])


# The choices against transformers (torch), on the same index inputs; right padding, T not a
# multiple of the pool.

@pytest.mark.slow
def test_kpool_choice_equals_glm5_next():
  torch = pytest.importorskip("torch")
  glm = pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")
  B, T, D, Q, J, I, P, top = 2, 23, 12, 10, 8, 8, 4, 8
  conf = types.SimpleNamespace(hidden_size=D, index_n_heads=J, index_head_dim=I, qk_rope_head_dim=2,
                               index_topk=top, q_lora_rank=Q, index_kpool=P, index_kpool_always_select_tail=True)
  torch.manual_seed(0)
  ix = glm.Glm5NextTextIndexer(conf, 0)
  with torch.no_grad():
    for prm in ix.parameters():
      prm.normal_()
  x, qr = torch.randn(B, T, D), torch.randn(B, T, Q)
  lengths = [T, 14]
  am = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
  with torch.no_grad():
    want = ix(x, qr, am, None).numpy()
    qi = ix.wq_b(qr).view(B, T, J, I)
    ki = ix.k_norm(ix.wk(x))
    gate = torch.nn.functional.linear(x, ix.index_kpool_compress_gate)
    w = ix.weights_proj(x) * J ** -0.5
  j = lambda t: jnp.asarray(t.numpy())  # noqa: E731
  L = pooled.last_key(T, T, is_causal=True, kv_lengths=jnp.array(lengths), B=B)
  pk = pooled.kpool_keys(j(ki), j(gate), j(ix.index_kpool_compress_ape.detach()), P)
  pools = pooled.pool_top(lambda q, w: pooled.kpool_scores(q, pk, w), (j(qi), j(w)), L, N=T // P, pool=P,
                          n=top // P, rows=8)
  got = pooled.pool_tokens(pools, L, pool=P, tail=True)
  ok = _untied(pooled.kpool_scores(j(qi), pk, j(w)), L, P, top // P)
  assert ok.sum() >= 0.8 * B * T
  for b in range(B):  # transformers leaves padded queries empty
    for t in range(lengths[b]):
      if ok[b, t]:
        assert _sets(got)[b][t] == _sets(want)[b][t], (b, t)


@pytest.mark.slow
def test_qsa_choice_equals_qwen4_exp():
  torch = pytest.importorskip("torch")
  qwen = pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp")
  B, T, D, J, I, r, budget = 2, 22, 12, 4, 8, 3, 9
  conf = types.SimpleNamespace(indexer_n_heads=J, indexer_kv_heads=1, indexer_head_dim=I, indexer_budget=budget,
                               indexer_compress_ratio=r, hidden_size=D, rms_norm_eps=1e-6)
  torch.manual_seed(1)
  ix = qwen.Qwen4ExpTextQSAIndexer(conf, 0)
  with torch.no_grad():
    for prm in ix.parameters():
      prm.normal_()
  lengths = [T, 13]
  x = torch.randn(B, T, D)
  cos, sin = torch.ones(B, T, I), torch.zeros(B, T, I)  # RoPE off: the heads form is position-free
  vis = (torch.arange(T)[None, :] <= torch.arange(T)[:, None])[None] & (
      torch.arange(T)[None, None, :] < torch.tensor(lengths)[:, None, None])
  with torch.no_grad():  # the public forward, its cache (past_key_values before 5.25, cache on) by position
    want = ix(x, (cos, sin), vis[:, None], None)[:, 0].numpy()
    q, keys = ix.index_qk_proj(x).split([J * I, I], dim=-1)  # the indexer's queries and keys, as forward forms them
    q, keys = ix.q_layernorm(q.reshape(B, T, J, I)), keys.reshape(B, T, I)
  L = pooled.last_key(T, T, is_causal=True, kv_lengths=jnp.array(lengths), B=B)
  norm = jnp.asarray(1.0 + ix.k_layernorm.weight.detach().numpy())
  pk = pooled.qsa_keys(jnp.asarray(keys.numpy())[:, :, None], norm, r)
  pools = pooled.pool_top(lambda q: pooled.qsa_scores(q, pk), (jnp.asarray(q.numpy()),), L, N=T // r, pool=r,
                          n=budget // r, rows=8)
  got = pooled.token_mask(pooled.pool_tokens(pools, L, pool=r, tail=True)[:, None], T)[:, 0]
  ok = _untied(pooled.qsa_scores(jnp.asarray(q.numpy()), pk), L, r, budget // r)
  assert ok.sum() >= 0.8 * B * T
  for b in range(B):
    for t in range(lengths[b]):
      if ok[b, t]:
        np.testing.assert_array_equal(np.asarray(got)[b, t], want[b, t], err_msg=f"{b, t}")


@pytest.mark.slow
def test_block_indexer_choice_equals_minimax_m3():
  torch = pytest.importorskip("torch")
  mm = pytest.importorskip("transformers.models.minimax_m3_vl.modeling_minimax_m3_vl")
  B, T, D, G, I, b, top = 2, 27, 12, 2, 8, 4, 3
  conf = types.SimpleNamespace(index_head_dim=I, index_n_heads=G, index_block_size=b, index_topk_blocks=top,
                               index_local_blocks=2, hidden_size=D, rms_norm_eps=1e-6)
  torch.manual_seed(2)
  ix = mm.MiniMaxM3VLIndexer(conf, 0)
  with torch.no_grad():
    for prm in ix.parameters():
      prm.normal_()
  x = torch.randn(B, T, D)
  pos = torch.arange(T)[None].expand(B, T)
  cos, sin = torch.ones(B, T, I), torch.zeros(B, T, I)
  with torch.no_grad():
    want = ix(x, (cos, sin), None, pos).numpy()  # (B,G,T,top)
    qi = ix.q_norm(ix.q_proj(x).view(B, T, G, I))
    ki = ix.k_norm(ix.k_proj(x))
  if want.ndim == 3:  # (B,T,top): one choice for all index heads, by the largest head's block score
    import transformers
    pytest.skip(f"MiniMaxM3VLIndexer of transformers {transformers.__version__} chooses one set of blocks for all "
                "index heads (5.12: the block scores' amax over the heads); 5.13 on, as attn, each head its own")
  L = pooled.last_key(T, T, is_causal=True, B=B)
  got = pooled.block_top(jnp.asarray(qi.numpy()), jnp.asarray(ki.numpy()), L, block=b, top_k=top, local=2, rows=8)
  assert _sets(got.reshape(B * G, T, -1)) == _sets(want.reshape(B * G, T, -1))


# The kernel rows against the dense masked reference: values and gradients, GQA, d_v != d_k, padding,
# T not a multiple of the pool or block; the tokens kernel (8 query heads a kv head) and the
# block-skipping one (2).

CASES = [({"kpool": {"heads": 2, "head_dim": 4, "top_k": 6, "kpool": 3}}, {"top_k": 42}),
         ({"kpool": {"heads": 2, "head_dim": 4, "top_k": 6, "kpool": 3, "always_select_tail": False}}, None),
         ({"qsa": {"heads": 4, "head_dim": 4, "kv_heads": 2, "budget": 8, "compress_ratio": 4}}, {"budget": 40}),
         ({"block_indexer": {"head_dim": 4, "block": 8, "top_k": 2, "local": 1}}, {"top_k": 6})]


@pytest.mark.slow
@pytest.mark.parametrize("heads,kv_heads", [(8, 1), (4, 2)])
@pytest.mark.parametrize("extra,full", CASES)
def test_rows_equal_the_dense_masked_reference(extra, full, heads, kv_heads, monkeypatch):
  _rows_against_dense(extra, full, heads, kv_heads, monkeypatch)


def test_rows_equal_the_dense_masked_reference_small(monkeypatch):
  """The fast sibling: the block indexer's whole blocks on the gathered kernel, one choice per kv group
  of 4 query heads (the slow test: every case, both layouts)."""
  _rows_against_dense(CASES[3][0], None, 8, 2, monkeypatch, T=21)


@pytest.mark.slow
@pytest.mark.parametrize("extra", [CASES[0][0], CASES[2][0]])
def test_pools_gathered_whole_equal_the_reference(extra, monkeypatch):
  """Each pool gathered whole on the token kernel (POOLS_WHOLE, not the default: measured not faster)."""
  monkeypatch.setattr(kernel_selected, "POOLS_WHOLE", True)
  _rows_against_dense(extra, None, 8, 1, monkeypatch)


# Which kernel each choice runs on (attn.kernel.selected.key_choice): the block indexer's whole blocks on
# the gathered kernel in every layout; pools on the token kernel with 8 query heads a kv head, on the
# block-skipping kernel with fewer.
RUNS_ON = {("block_indexer", True): "gathered", ("block_indexer", False): "gathered", ("kpool", True): "tokens",
           ("kpool", False): "sparse", ("qsa", True): "tokens", ("qsa", False): "sparse"}


def _rows_against_dense(extra, full, heads, kv_heads, monkeypatch, T=41):
  monkeypatch.setattr(impls, "BLOCKED_MIN_SCORES", 16)  # these small calls take the selection rows
  calls = []
  for name, module in (("tokens", kernel_tokens), ("sparse", kernel_sparse), ("gathered", kernel_gathered)):
    monkeypatch.setattr(module, "attention",
                        lambda *a, run=module.attention, name=name, **kw: calls.append(name) or run(*a, **kw))
  cfg = HeadConfig(d_model=16, num_heads=heads, d_k=6, d_v=5, num_kv_heads=kv_heads, rope_dim=2, extra=extra)
  p = fresh_params("per_head", cfg, seed=3)  # numpy draws: init's jax draws compile a program of ~0.7 s CPU
  x, kv = _randn(4, (2, T, 16)), jnp.array([T, T * 5 // 8])
  cot = _randn(5, (2, T, 16))

  def run(cfg, impl):
    f = lambda p, x: (api.apply("per_head", p, x, cfg=cfg, is_causal=True, kv_lengths=kv, impl=impl) * cot).sum()  # noqa: E731
    return jax.jit(jax.value_and_grad(f, (0, 1)))(p, x)  # compiled whole: eager, each op compiles alone

  (l1, g1), (l2, g2) = run(cfg, "auto"), run(cfg, "einsum")
  assert calls, "no selection row ran"
  kernel_ran = "tokens" if "tokens" in calls else calls[0]
  assert kernel_ran == RUNS_ON[next(iter(extra)), heads // kv_heads >= 8], calls
  np.testing.assert_allclose(l1, l2, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
    np.testing.assert_allclose(a, b, atol=1e-4 * max(1.0, float(jnp.abs(b).max())))
  name = next(iter(extra))
  for n in p:  # the selection has no gradient
    if n.startswith("w_i") or n in ("ape", "iq_norm", "ik_norm"):
      assert not np.any(g1[0][n]), n
  if full is not None:  # a budget covering every key: full causal attention, on the rows too
    plain = cfg.replace(extra={})
    own = {n: a for n, a in p.items() if not (n.startswith("w_i") or n in ("ape", "iq_norm", "ik_norm"))}
    def full_pass(cfg, **kw):  # compiled whole (eager, each small op compiles on its own)
      return jax.jit(lambda p, x: api.apply("per_head", p, x, cfg=cfg, is_causal=True, kv_lengths=kv, **kw))
    want = full_pass(plain)(own, x)
    big = cfg.replace(extra={name: {**extra[name], **full}})
    np.testing.assert_allclose(full_pass(big)(p, x), want, atol=1e-5)
    np.testing.assert_allclose(full_pass(big, impl="einsum")(p, x), want, atol=1e-5)


@pytest.mark.slow
def test_a_smaller_budget_moves_the_output():
  cfg = HeadConfig(d_model=16, num_heads=4, d_k=6, d_v=5, num_kv_heads=2, rope_dim=2,
                   extra={"qsa": {"heads": 2, "head_dim": 4, "budget": 4, "compress_ratio": 2}})
  p = api.init("per_head", jax.random.key(0), cfg)
  own = {n: a for n, a in p.items() if not (n.startswith("w_i") or n.endswith("_norm"))}
  x = _randn(0, (1, 19, 16))
  assert not np.allclose(api.apply("per_head", p, x, cfg=cfg, is_causal=True),
                         api.apply("per_head", own, x, cfg=cfg.replace(extra={}), is_causal=True), atol=1e-3)


# Counts: parameters against the built tree, pairs against the dense masks, FLOPs against XLA.

COUNT_CFG = HeadConfig(d_model=32, num_heads=4, d_k=16, d_v=12, num_kv_heads=2, rope_dim=4)


@pytest.mark.parametrize("extra", [pytest.param(c[0], marks=() if i == 3 else pytest.mark.slow)
                                   for i, c in enumerate(CASES)])
def test_counts_in_closed_form(extra):
  name = next(iter(extra))
  cfg = COUNT_CFG.replace(extra=extra)
  built = jax.eval_shape(lambda key: api.init("per_head", key, cfg), jax.random.key(0))  # init's tree, no draws
  base = api.param_shapes("per_head", COUNT_CFG)
  assert mech.param_count(name, cfg) == sum(int(np.prod(a.shape)) for n, a in built.items() if n not in base)
  p = fresh_params("per_head", cfg)
  T = 29
  q, k = _randn(1, (1, T, 4, 16)), _randn(2, (1, T, 2, 16))
  select_ = functools.partial(mech._select, name, cfg=cfg, is_causal=True, kv_lengths=None, mask=None, dense=True)
  m = jax.jit(select_)(p, q, k)  # compiled whole (eager, each small op compiles on its own)
  keep = np.broadcast_to(np.asarray(m), (1, 4, T, T)) & np.asarray(select.visible(T, T, True, None, 1))[:, None]
  assert selectors.pairs(cfg, T) * 4 == int(keep.sum())
  inputs = {n: a for n, a in p.items() if n not in base}
  xla = measured.xla_flops(lambda p, q, k: mech.index_inputs(name, p, q, k, cfg), inputs, q, k)
  o = mech.options(cfg, name)
  C, I, H, G = 12, o["head_dim"], 4, 2
  proj = {"kpool": 2 * T * H * C * o.get("heads", 1) * (I + 1) + 4 * T * G * C * I,
          "qsa": 2 * T * H * C * o.get("heads", 1) * I + 2 * T * G * C * o.get("kv_heads", 1) * I,
          "block_indexer": 2 * T * H * C * I + 2 * T * G * C * I}[name]
  assert proj <= xla <= 1.1 * proj + 8 * T * 16, (proj, xla)  # the projections; + RMSNorm / scaling
  assert selectors.selector_flops(cfg, T) > proj


@pytest.mark.parametrize("extra,field", [
    ({"kpool": {"top_k": 10, "kpool": 4}}, "extra.kpool.top_k"),
    ({"kpool": {"kpool": 0}}, "extra.kpool.kpool"),
    ({"kpool": {"always_select_tail": 1}}, "extra.kpool.always_select_tail"),
    ({"qsa": {"budget": 10, "compress_ratio": 4}}, "extra.qsa.budget"),
    ({"qsa": {"heads": 4, "kv_heads": 3}}, "extra.qsa.kv_heads"),
    ({"block_indexer": {"top_k": 2, "local": 3}}, "extra.block_indexer.local"),
    ({"block_indexer": {"block": 1.5}}, "extra.block_indexer.block"),
    ({"block_indexer": {"blocks": 4}}, "extra.block_indexer.blocks"),
    ({"kpool": {}, "moba": {}}, "extra."),
])
def test_bad_options_refused_by_name(extra, field):
  cfg = HeadConfig(d_model=16, num_heads=4, d_k=6, d_v=5, num_kv_heads=2, rope_dim=2, extra=extra)
  with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
    api.check_config("per_head", cfg)
  with pytest.raises(ConfigError, match="rope_dim"):
    api.check_config("per_head", cfg.replace(rope_dim=6, extra={next(iter(extra)): {}}))


# K-pool's deepseek form (GLM-5.3-Flash's: index inputs from x and the query latent, on mla; its parity with
# transformers' whole model is tests/test_hf_glm5_next.py's): the sparse rows against the dense path, cached
# decoding (index keys and gates cached beside the latent) against the full pass, no gradient to the indexer.

KP = {"heads": 3, "head_dim": 4, "top_k": 8, "kpool": 4, "form": "deepseek"}
MLA_KP = HeadConfig(d_model=16, num_heads=3, d_k=6, d_v=5, num_kv_heads=3, latent_dim=6, q_latent_dim=7,
                    latent_norm_eps=1e-5, use_bias=False, extra={"kpool": KP})


def _kp_params(cfg, seed=0):
  p = api.init("mla", jax.random.key(seed), cfg)
  rng = np.random.default_rng(seed + 100)  # the offsets, norm and bias off their init, so that reading them matters
  for n, at in (("ape", 0.0), ("idk_norm", 1.0), ("idk_bias", 0.0)):
    p[n] = jnp.asarray(at + 0.5 * rng.standard_normal(p[n].shape).astype(np.float32))
  return p


@pytest.mark.slow
def test_kpool_deepseek_form_decodes_as_the_full_pass_and_has_no_gradient():
  from attn.variants import cache as kv_cache
  from attn.variants import mla
  from attn.variants.base import Options
  cfg = MLA_KP
  p = _kp_params(cfg, 3)
  x = _randn(4, (2, 19, cfg.d_model))
  full, _ = mla.apply(p, x, cfg=cfg, opts=Options(is_causal=True))
  absorbed, _ = mla.decode_apply(p, x, cfg=cfg, opts=Options(is_causal=True))
  np.testing.assert_allclose(absorbed, full, atol=1e-5)
  c = kv_cache.init(mla.VARIANT, p, cfg, 2, 24)
  assert {n: a.shape[-1] for n, a in c.items()} == {"latent": 6, "index_key": 8}  # the index key and its gate
  assert kv_cache.width(c) == mla.kv_cache_width(cfg) == 6 + 2 * 4
  outs, index = [], 0
  for n in (9, 1, 1, 3, 5):
    y, c = kv_cache.decode_step(mla.VARIANT, p, x[:, index:index + n], c, index, cfg=cfg)
    outs.append(y)
    index += n
  np.testing.assert_allclose(jnp.concatenate(outs, 1), full, atol=1e-5)
  dense = cfg.replace(extra={"kpool": KP | {"top_k": 20}})  # every pool: the selection changed the output
  assert not np.allclose(mla.apply(p, x, cfg=dense, opts=Options(is_causal=True))[0], full, atol=1e-3)
  g = jax.grad(lambda p: api.apply("mla", p, x, cfg=cfg, is_causal=True).sum())(p)
  assert all(not np.any(g[n]) for n in ("w_idq", "w_idk", "w_idw", "w_idg", "idk_norm", "idk_bias", "ape"))
  assert np.any(g["w_dq"]) and np.any(g["q_latent_norm"])


@pytest.mark.slow
def test_kpool_deepseek_form_sparse_rows_at_long_T_equal_the_dense_path(monkeypatch):
  """T = 600 (T·S past kernel.BLOCKED_MIN_SCORES: "auto" takes the key-selection rows) against impl="einsum" (the
  choice as a dense mask), with padding; mla's absorbed form (one latent kv head) too."""
  from attn.variants import mla
  from attn.variants.base import Options
  calls = []
  monkeypatch.setattr(kernel_sparse, "attention",
                      lambda *a, run=kernel_sparse.attention, **kw: calls.append(1) or run(*a, **kw))
  cfg = MLA_KP.replace(extra={"kpool": KP | {"top_k": 32}})
  p = _kp_params(cfg, 7)
  x = _randn(8, (2, 600, 16))
  opts = Options(is_causal=True, kv_lengths=jnp.array([600, 333]))
  dense, _ = jax.jit(lambda p, x: mla.apply(p, x, cfg=cfg, opts=opts.replace(impl="einsum")))(p, x)
  for fn in (mla.apply, mla.decode_apply):
    got, _ = jax.jit(lambda p, x, fn=fn: fn(p, x, cfg=cfg, opts=opts))(p, x)
    np.testing.assert_allclose(got, dense, atol=1e-5)
  assert len(calls) == 2


@pytest.mark.slow
def test_kit_on_mla_with_the_kpool_deepseek_form():
  """attn.testing.check_variant on mla with K-pool's deepseek form (calls, masks, grads, bf16, decoding in chunks,
  counts against XLA's FLOPs)."""
  from attn.testing import check_variant
  check_variant("mla", configs=(MLA_KP,))
