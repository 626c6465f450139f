"""Shared indexer layers (ModelConfig.indexer_types, attn.nn.index_sharing): a "shared" layer reuses the
previous full layer's top-k choice, in the full pass and in cached decoding.

The reference is independent of the sharing hook: each layer's choice is computed in numpy from its full
layer's attention input and weights (test_indexer_deepseek's DeepseekV32Indexer in numpy) and applied as a
dense mask to the same model without any indexer (plain mla), layer by layer. Awkward shapes: d_v ≠ d_k,
d_model not a multiple of H, right padding, top_k below the length.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attn.config import ConfigError
from attn.count import model as count_model
from attn.nn import index_sharing
from attn.nn.config import ModelConfig
from attn.nn.models import DecoderLM
from attn.variants.mechanisms import selection
from conftest import fresh_params, jit_apply
from test_indexer_deepseek import _numpy_choice

IX = {"heads": 3, "head_dim": 6, "top_k": 3, "form": "deepseek"}
INDEX_PARAMS = ("w_idq", "w_idk", "w_idw", "idk_norm", "idk_bias")


def _cfg(types=("full", "shared", "shared"), **changes):
  base = dict(vocab_size=31, d_model=22, num_layers=3 if types is None else len(types), num_heads=3, d_ff=24,
              variant="mla", d_k=7, d_v=5,
              num_kv_heads=3, rope_dim=4, rope_theta=50.0, latent_dim=6, q_latent_dim=9, latent_norm_eps=1e-6,
              positional="rope", norm_type="rmsnorm", rope_layout="interleaved", extra={"indexer": IX},
              indexer_types=list(types) if types is not None else None)
  return ModelConfig(**(base | changes))


def _built(cfg, seed):
  """DecoderLM(cfg) with numpy draws at its parameters' shapes (scales near 1, biases near 0, weights
  N(0, 1/fan_in)): its own init runs eagerly and compiles one draw per shape, most of a fast test's CPU."""
  model = nnx.eval_shape(lambda: DecoderLM(cfg, rngs=nnx.Rngs(seed)))
  rng = np.random.default_rng(seed)

  def draw(path, a):
    name = str(path[-1].key)
    if "norm" in name or name == "scale":
      x = 1.0 + 0.1 * rng.standard_normal(a.shape)
    elif name.startswith("b_") or name == "bias":
      x = 0.1 * rng.standard_normal(a.shape)
    else:
      x = rng.standard_normal(a.shape) / np.sqrt(np.prod(a.shape[:-1]))
    return jnp.asarray(x, a.dtype)
  state = nnx.state(model)
  nnx.replace_by_pure_dict(state, jax.tree_util.tree_map_with_path(draw, nnx.to_pure_dict(state)))
  nnx.update(model, state)
  return model


def _model(cfg, seed=0):
  model = _built(cfg, seed)
  rng = np.random.default_rng(seed + 7)  # the index norms away from their init, so reading them matters
  for block in model.blocks:
    p = block.attn.params
    for n in ("idk_norm", "idk_bias"):
      if n in p:
        p[n] = nnx.Param(jnp.asarray((n == "idk_norm") + 0.5 * rng.standard_normal(p[n].shape), jnp.float32))
  return model


def _reference(model, cfg, ids, lengths):
  """(the plain-mla model with the model's params, each layer's numpy choice as its mask, the plain model's
  logits under those masks): the masks are constants, as a choice carries no gradient."""
  plain = _built(cfg.replace(extra=None, indexer_types=None), 1)
  pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  for l, block in pure["blocks"].items():
    block["attn"]["params"] = {k: v for k, v in block["attn"]["params"].items() if k not in INDEX_PARAMS}
  nnx.update(plain, pure)
  h = plain.embed(ids)
  masks, chosen = [], {}
  for i, block in enumerate(plain.blocks):
    src = index_sharing.source(cfg, i)
    if src == i:  # this layer's own choice, from its input and its own indexer's weights
      x = np.asarray(block.attn_norm(h))
      chosen[i] = _numpy_choice(dict(model.blocks[i].attn.params.items()), x, cfg.layer_head(i), lengths)
    masks.append(jnp.asarray(chosen[src][:, None]))
    h = _block(block, h, masks[-1], lengths)
  return plain, masks, _head(plain, h)


# Each block and the whole reference compiled (eager, each small op compiles on its own: several times slower).
_block = nnx.jit(lambda block, h, mask, lengths: block(h, mask=mask, is_causal=True, kv_lengths=lengths))
_head = nnx.jit(lambda plain, h: plain.head(plain.final_norm(h)))


@nnx.jit
def _ref_logits(plain, masks, ids, lengths):
  h = plain.embed(ids)
  for block, mask in zip(plain.blocks, masks):
    h = block(h, mask=mask, is_causal=True, kv_lengths=lengths)
  return plain.head(plain.final_norm(h))


_logits = nnx.jit(lambda model, ids, lengths: model(ids, lengths_B=lengths))


def test_a_shared_layer_equals_the_full_layers_choice_as_a_mask():
  """The fast sibling of the next: two layers, values only."""
  cfg = _cfg(("full", "shared"))
  model = _model(cfg, seed=2)
  ids = jnp.asarray(np.random.default_rng(6).integers(0, 31, (2, 7)), jnp.int32)
  lengths = jnp.array([5, 7])
  _, masks, want = _reference(model, cfg, ids, lengths)
  assert np.asarray(masks[0]).sum(-1).max() == 3
  np.testing.assert_allclose(np.asarray(_logits(model, ids, lengths)), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_shared_layers_equal_the_full_layers_choice_as_a_mask_values_and_gradients():
  """Layers 1 and 2 attend to layer 0's top-k (numpy, from layer 0's input) as a mask on plain mla: logits
  under right padding and every parameter's gradient equal; the index weights (layer 0's only) get none."""
  cfg = _cfg()
  model = _model(cfg)
  assert [sorted(set(b.attn.params) & set(INDEX_PARAMS)) for b in model.blocks] == [sorted(INDEX_PARAMS), [], []]
  ids = jnp.asarray(np.random.default_rng(3).integers(0, 31, (2, 9)), jnp.int32)
  lengths = jnp.array([9, 6])
  plain, masks, _ = _reference(model, cfg, ids, lengths)
  m0 = np.asarray(masks[0])
  assert m0.sum(-1).max() == 3 and (np.asarray(masks[2]) == m0).all()  # the selection bites; layer 2 reuses 0

  def loss(m, f):
    return jnp.sum(jnp.where(jnp.arange(9)[None, :, None] < lengths[:, None, None], f(m), 0.0) ** 2)

  logits = np.asarray(_logits(model, ids, lengths))
  np.testing.assert_allclose(logits, np.asarray(_ref_logits(plain, masks, ids, lengths)), rtol=1e-5, atol=1e-5)
  got, g_got = nnx.jit(nnx.value_and_grad(lambda m: loss(m, lambda m: m(ids, lengths_B=lengths))))(model)
  want, g_want = nnx.jit(nnx.value_and_grad(lambda m: loss(m, lambda m: _ref_logits(m, masks, ids, lengths))))(plain)
  np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
  a, b = nnx.to_pure_dict(g_got), nnx.to_pure_dict(g_want)
  for n in INDEX_PARAMS:
    assert float(jnp.abs(a["blocks"][0]["attn"]["params"].pop(n)).max()) == 0.0
  flat_a, flat_b = jax.tree.leaves_with_path(a), jax.tree.leaves_with_path(b)
  assert [p for p, _ in flat_a] == [p for p, _ in flat_b]
  scale = max(float(jnp.abs(x).max()) for _, x in flat_b)
  for (path, x), (_, y) in zip(flat_a, flat_b):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-5 * scale, err_msg=jax.tree_util.keystr(path))
  # the choice reaches layer 1: with its own (unshared) choice from the same weights the logits move
  other = [{0: 0, 1: 1, 2: 0}[i] for i in range(3)]  # layer 1 masked by a choice of its own instead
  x1 = _numpy_choice(dict(model.blocks[0].attn.params.items()), np.random.default_rng(5).standard_normal(
      (2, 9, 22)).astype(np.float32), cfg.layer_head(0), lengths)
  moved = np.asarray(_ref_logits(plain, [masks[0], jnp.asarray(x1[:, None]), masks[2]], ids, lengths))
  assert other and np.abs(moved - logits).max() > 1e-3 * np.abs(logits).max()


@pytest.mark.slow
def test_cached_decoding_equals_the_full_pass_and_caches_no_index_keys():
  """Prefill 4 tokens and decode 5 one at a time: each step's logits are the full pass's at its position;
  the shared layer's cache holds the latent and RoPE key only (its bytes per token as attn count says)."""
  cfg = _cfg(("full", "shared", "full"))
  model = _model(cfg, seed=1)
  ids = jnp.asarray(np.random.default_rng(4).integers(0, 31, (2, 9)), jnp.int32)
  full = np.asarray(nnx.jit(lambda m, ids: m(ids))(model, ids))
  model.init_cache(2, 9)
  step = nnx.jit(lambda m, ids: m(ids, decode=True))  # one program a length (eager: each op alone)
  steps = [np.asarray(step(model, ids[:, :4]))] + [np.asarray(step(model, ids[:, t:t + 1])) for t in range(4, 9)]
  np.testing.assert_allclose(np.concatenate(steps, 1), full, rtol=1e-5, atol=1e-5 * np.abs(full).max())
  widths = [{k: v.shape[-1] for k, v in b.attn.cache.items()} for b in model.blocks]
  assert widths == [{"latent": 6, "k_rope": 4, "index_key": 6}, {"latent": 6, "k_rope": 4},
                    {"latent": 6, "k_rope": 4, "index_key": 6}]
  assert count_model.model_kv_cache_bytes_per_token(cfg) == 4 * (3 * (6 + 4) + 2 * 6)


def test_counts_in_closed_form_against_the_built_model():
  """attn count: parameters (the built tree), cache bytes per token, FLOPs: a shared layer less the indexer's
  weights Q'·J·I + D·(I + J) + 2·I, its keys (d_I a token) and its FLOPs (selection.indexer_flops)."""
  shared, full = _cfg(), _cfg(types=None)
  built = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(  # shapes only: eval_shape, no draws
      nnx.state(nnx.eval_shape(lambda: DecoderLM(shared, rngs=nnx.Rngs(0))), nnx.Param)))
  Q, D, J, I = 9, 22, 3, 6
  per_layer = Q * J * I + D * (I + J) + 2 * I
  assert count_model.model_param_count(shared) == built == count_model.model_param_count(full) - 2 * per_layer
  assert count_model.model_kv_cache_bytes_per_token(full) - count_model.model_kv_cache_bytes_per_token(shared) == (
      2 * I * 4)
  T = 37
  index_flops = 2 * T * J * (Q * I + D) + 2 * T * D * I + 2 * T * T * J * (I + 1)
  assert selection.indexer_flops(full.layer_head(1), T, T) == index_flops
  assert selection.indexer_flops(shared.layer_head(1), T, T) == 0
  a, b = (count_model.layer_type_table(c, "decoder_lm", T)[-1] for c in (full, shared))
  assert a["flops_fwd"] - b["flops_fwd"] == 2 * index_flops and a["params"] - b["params"] == 2 * per_layer
  assert a["kv_bytes_at_L"] - b["kv_bytes_at_L"] == 2 * T * I * 4


@pytest.mark.slow
def test_the_flops_a_shared_layer_saves_against_xla():
  """XLA's count of the whole model's forward (the HLO before optimisation) falls by the closed form
  selection.indexer_flops per shared layer, within test_count_selectors' 10% (XLA also counts the ReLU, the
  masking and the LayerNorm, which the closed form leaves out); d_I 32 so that the scores dominate."""
  from attn.count.measured import xla_flops
  x = {"extra": {"indexer": IX | {"head_dim": 32}}}
  ids = jnp.zeros((1, 37), jnp.int32)

  def flops(cfg):
    graph, state = nnx.split(DecoderLM(cfg, rngs=nnx.Rngs(0)))
    return xla_flops(lambda state, ids: nnx.merge(graph, state)(ids), state, ids)

  full, shared = _cfg(types=None, **x), _cfg(**x)
  closed = 2 * selection.indexer_flops(full.layer_head(1), 37, 37)
  assert closed <= flops(full) - flops(shared) <= 1.10 * closed


@pytest.mark.parametrize("types,changes,match", [
    (("shared", "full"), {}, r"indexer_types\[0\]='shared'.*first layer with the indexer"),
    (("full", "shared"), {"block_kinds": ("mlp", "attention_mlp")}, r"indexer_types\[1\]='shared'.*first layer"),
    (("full", "shared", "shared"), {"block_kinds": ("attention_mlp", "mlp", "attention_mlp")},
     r"indexer_types\[1\]='shared'.*layer 1 has no indexer"),
    (("full", "Shared"), {}, r"indexer_types\[1\]='Shared'.*one of \['full', 'shared'\]"),
    (("full",), {"num_layers": 2}, r"indexer_types=.*a list of 2 entries"),
    (("full", "shared"), {"extra": {"moba": {"block": 2, "top_k": 2}}}, r"indexer_types\[1\]='shared'.*no indexer"),
    (None, {"extra": {"indexer": IX | {"shared": True}}, "num_layers": 2}, r"extra.indexer.shared=True.*per layer|"
     r"extra.indexer.shared=True.*indexer_types"),
])
def test_refusals_by_name(types, changes, match):
  with pytest.raises(ConfigError, match=match):
    _cfg(types, **changes)


def test_a_shared_layer_after_one_without_an_indexer_and_another_top_k_are_refused():
  """"shared" right after an MLP-only block (no choice reaches it), and check_pair's refusal of a full layer
  with another top-k or form (per-layer indexer options have no config field yet: the check is called)."""
  with pytest.raises(ConfigError, match=r"indexer_types\[2\]='shared'.*layer 1 before it has no indexer"):
    _cfg(("full", "full", "shared"), block_kinds=("attention_mlp", "mlp", "attention_mlp"))
  head = _cfg().layer_head(1)
  other = head.replace(extra={"indexer": IX | {"top_k": 5}})
  with pytest.raises(ConfigError, match=r"indexer_types\[1\]='shared'.*full layer 0 has extra.indexer.top_k=5"):
    index_sharing.check_pair(head, other, "indexer_types[1]", 0)


def test_a_shared_layer_alone_is_refused_by_name():
  """A shared layer outside a model call has no choice to reuse: refused, never attending to every key."""
  from attn import api
  head = _cfg().layer_head(1)
  p = fresh_params("mla", head)  # numpy draws: api.init eager compiles one draw per shape
  assert not set(p) & set(INDEX_PARAMS)
  with pytest.raises(ConfigError, match=r"extra.indexer.shared=True"):
    jit_apply("mla", p, jnp.zeros((1, 5, 22)), cfg=head, is_causal=True)  # refused while tracing: no compile


@pytest.mark.slow
def test_shared_layers_on_the_sparse_row_equal_the_dense_path():
  """At T = 512 (T·S at the sparse row's threshold) the full layer's choice is a KeyChoice on the token kernel
  and the shared layer runs on it too: the 'heads' form on per_head (G < H), impl 'auto' against 'einsum'
  (the dense mask path), values and gradients, right padding."""
  ix = {"heads": 2, "head_dim": 4, "top_k": 37}
  cfg = ModelConfig(vocab_size=29, d_model=18, num_layers=2, num_heads=4, d_ff=20, variant="per_head", d_k=6, d_v=5,
                    num_kv_heads=2, rope_dim=2, positional="rope", norm_type="rmsnorm", max_len=512,
                    extra={"indexer": ix}, indexer_types=["full", "shared"])
  sparse = DecoderLM(cfg, rngs=nnx.Rngs(0))
  dense = DecoderLM(cfg.replace(impl="einsum"), rngs=nnx.Rngs(1))
  nnx.update(dense, nnx.state(sparse, nnx.Param))
  ids = jnp.asarray(np.random.default_rng(8).integers(0, 29, (1, 512)), jnp.int32)
  lengths = jnp.array([500])
  seen = []
  original = selection._own_choice

  def spy(*a, **kw):
    seen.append(kw["dense"])
    return original(*a, **kw)

  selection._own_choice = spy
  try:
    f = lambda m: jnp.sum(m(ids, lengths_B=lengths)[:, :500] ** 2)  # noqa: E731
    (a, ga), (b, gb) = (nnx.jit(nnx.value_and_grad(f))(m) for m in (sparse, dense))  # each compiled whole
  finally:
    selection._own_choice = original
  assert seen == [False, True]  # one choice a model call, on the sparse row for 'auto', as a mask for einsum
  np.testing.assert_allclose(float(a), float(b), rtol=1e-5)
  for (path, x), (_, y) in zip(jax.tree.leaves_with_path(nnx.to_pure_dict(ga)),
                               jax.tree.leaves_with_path(nnx.to_pure_dict(gb))):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-4, atol=2e-4 * float(jnp.abs(y).max()) + 1e-7,
                               err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow
def test_training_the_indexer_with_shared_layers():
  """record_indexer_kl: only the full layer adds a KL term (a shared layer has no indexer to train); in the
  sparse phase the shared layer attends to the full layer's choice (the model's own forward), at warm-up to
  every key (the model with top_k past the length)."""
  cfg = _cfg(("full", "shared"))
  model = _model(cfg, seed=3)
  ids = jnp.asarray(np.random.default_rng(9).integers(0, 31, (2, 9)), jnp.int32)
  plain = np.asarray(model(ids))
  every = DecoderLM(cfg.replace(extra={"indexer": IX | {"top_k": 9}}), rngs=nnx.Rngs(0))
  nnx.update(every, nnx.state(model, nnx.Param))
  for phase, want in (("sparse", plain), ("warmup", np.asarray(every(ids)))):
    with selection.record_indexer_kl(phase) as terms:
      got = np.asarray(model(ids))
    assert len(terms) == 1 and np.isfinite(float(terms[0])), phase
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max(), err_msg=phase)
  assert np.abs(np.asarray(every(ids)) - plain).max() > 1e-3 * np.abs(plain).max()  # the choice bites
