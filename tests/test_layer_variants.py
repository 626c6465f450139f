"""Layer types with their own variant (ModelConfig.layer_heads[type]["variant"]): Gemma 4's mix, keys
equal to values with the value norm and wider heads with fewer kv heads on the global layers, per_head
with the value norm on the sliding ones, and the last layers reading earlier layers' keys and values
(kv_source, kv_sharing.last_layers). Checked against the stack written by hand with attn.apply per
layer (each layer's own variant and head; a sharing layer as cross-attention on its source's input
with its source's key weights), decoding against the full pass, and refusals by name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attn
from attn import ConfigError, HeadConfig
from attn.nn import kv_sharing
from attn.nn.models import DecoderLM, _norm
from attn.nn.config import ModelConfig

TYPES = ("sliding_attention", "full_attention") * 3
# h = 4 does not divide d_model = 14; sliding: 2 kv heads of 4 (rotated whole); global: 1 kv head of 6,
# keys equal to values, 2 of its 6 dims rotated; the last two layers share (layer 4 reads 2, 5 reads 3).
BASE = dict(vocab_size=13, d_model=14, num_layers=6, num_heads=4, d_ff=16, d_k=4, d_v=4, num_kv_heads=2,
            variant="per_head", max_len=12, positional="rope", rope_dim=4, rope_theta=1000.0, window=3,
            layer_types=TYPES, value_norm_eps=1e-6, qk_norm=True, norm="sandwich", norm_type="rmsnorm",
            mlp="gated", scale=1.0, use_bias=False)
GLOBAL = {"full_attention": {"variant": "k_eq_v", "d_k": 6, "d_v": 6, "num_kv_heads": 1, "rope_dim": 2}}
SHARED = kv_sharing.last_layers(TYPES, 2)
KV_NAMES = ("w_k", "w_v", "b_k", "b_v", "w_kv", "b_kv", "k_norm")


def _cfg(**changes):
  return ModelConfig(**(BASE | dict(layer_heads=GLOBAL, kv_source=SHARED) | changes))


def test_each_type_has_its_variant_and_head():
  cfg = _cfg()
  assert SHARED == (0, 1, 2, 3, 2, 3)
  assert [cfg.layer_variant(i) for i in range(6)] == ["per_head", "k_eq_v"] * 3
  local = dict(d_model=14, num_heads=4, d_k=4, d_v=4, num_kv_heads=2, rope_dim=4, rope_theta=1000.0,
               value_norm_eps=1e-6, qk_norm=True, scale=1.0, use_bias=False)
  glob = local | dict(d_k=6, d_v=6, num_kv_heads=1, rope_dim=2)
  assert cfg.layer_head(0) == HeadConfig(**local, window=3, layer=1)
  assert cfg.layer_head(5) == HeadConfig(**glob, layer=6)
  model = nnx.eval_shape(lambda: DecoderLM(cfg, rngs=nnx.Rngs(0)))  # shapes only
  names = [sorted(b.attn.params) for b in model.blocks]
  assert names[0] == ["k_norm", "q_norm", "w_k", "w_o", "w_q", "w_v"]
  assert names[1] == ["k_norm", "q_norm", "w_kv", "w_o", "w_q"]
  assert [b.attn.variant for b in model.blocks] == ["per_head", "k_eq_v"] * 3
  hash(cfg)


def _tokens(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).integers(0, 13, shape), jnp.int32)


def _by_hand(model, tokens, types=TYPES):
  """Block by block with attn.apply in each layer's own variant; a sharing layer as cross-attention
  on its source's normed input with its source's key (and value) weights and key norm."""
  cfg = model.cfg
  h = model.embed(tokens)
  inputs = {}
  for i, block in enumerate(model.blocks):
    variant = "k_eq_v" if types[i] == "full_attention" else "per_head"
    head, p, src = cfg.layer_head(i), dict(block.attn.params_dict()), cfg.kv_source[i]

    def attend(a, i=i, p=p, head=head, src=src, variant=variant):
      inputs[i] = a
      if src == i:
        return attn.apply(variant, p, a, cfg=head, is_causal=True)
      kv = {n: x for n, x in model.blocks[src].attn.params_dict().items() if n in KV_NAMES}
      return attn.apply(variant, p | kv, a, inputs[src], cfg=head, is_causal=True)

    h = block._residual(block.attn_norm, attend, h, block.attn_post_norm)
    h = block._residual(block.mlp_norm, block.mlp, h, block.mlp_post_norm)
  return model.head(_norm(model.final_norm, h))


# Compiled whole, as the model is below (op by op, each small op compiles on its own: 8 s -> 2 s of CPU).
_by_hand_jit = nnx.jit(_by_hand, static_argnums=2)


def _randomize(model, seed):
  """Norm scales away from 1, so a norm read from the wrong layer shows."""
  state = nnx.state(model, nnx.Param)
  leaves, tree = jax.tree.flatten(state)
  rng = np.random.default_rng(seed)  # drawn with numpy: jax.random would compile once per new shape
  leaves = [jnp.asarray(np.asarray(a) + 0.3 * rng.standard_normal(a.shape), a.dtype) for a in leaves]
  nnx.update(model, jax.tree.unflatten(tree, leaves))


def test_three_layers_mixed_and_shared_equal_the_stack_by_hand():
  """The fast sibling of the six-layer test below: sliding per_head, global k_eq_v, and a global layer
  reading the first one's keys and values."""
  types = TYPES[:2] + ("full_attention",)
  cfg = _cfg(num_layers=3, layer_types=types, kv_source=kv_sharing.last_layers(types, 1))
  assert cfg.kv_source == (0, 1, 1)
  model = DecoderLM(cfg, rngs=nnx.Rngs(6))
  _randomize(model, 7)
  tokens = _tokens(8, (2, 5))
  got = nnx.jit(lambda m, t: m(t))(model, tokens)  # compiled whole: op by op, each small op compiles alone
  np.testing.assert_allclose(got, _by_hand_jit(model, tokens, types), atol=3e-5, rtol=3e-5)


@pytest.mark.slow
def test_the_mixed_stack_equals_the_stack_by_hand():
  model = DecoderLM(_cfg(), rngs=nnx.Rngs(0))
  _randomize(model, 1)
  tokens = _tokens(2, (2, 7))
  got = nnx.jit(lambda m, t: m(t))(model, tokens)
  np.testing.assert_allclose(got, _by_hand_jit(model, tokens, TYPES), atol=3e-5, rtol=3e-5)
  # Sharing changes the function (the by-hand stack above would not see it otherwise).
  alone = DecoderLM(_cfg(kv_source=None), rngs=nnx.Rngs(0))
  nnx.update(alone, nnx.state(model, nnx.Param))
  assert float(jnp.abs(got - nnx.jit(lambda m, t: m(t))(alone, tokens)).max()) > 1e-3


@pytest.mark.slow
def test_cached_decoding_with_shared_caches_equals_the_full_pass():
  model = DecoderLM(_cfg(), rngs=nnx.Rngs(3))
  _randomize(model, 4)
  tokens = _tokens(5, (2, 9))
  full = nnx.jit(lambda m, t: m(t))(model, tokens)
  model.init_cache(2, 10)
  assert [b.attn.cache is not None for b in model.blocks] == [True] * 4 + [False] * 2
  step = nnx.jit(lambda m, t: m(t, decode=True))
  outs, i = [], 0
  for T in (4, 1, 1, 1, 1, 1):  # a prompt longer than the sliding ring, then single tokens
    outs.append(step(model, tokens[:, i:i + T]))
    i += T
  np.testing.assert_allclose(jnp.concatenate(outs, 1), full, atol=3e-5, rtol=3e-5)


@pytest.mark.parametrize("changes, match", [
    (dict(kv_source=(0, 1, 2, 3, 5, 3)),
     r"kv_source\[4\]=5 is not allowed: 4 \(its own keys and values\) or an earlier"),
    (dict(kv_source=(0, 1, 2, 3, 4, 4)), r"kv_source\[5\]=4 is not allowed: a layer of the same variant"),
    (dict(kv_source=(0, 1, 2, 1, 2, 3)), r"kv_source\[5\]=3 is not allowed: a layer with its own keys and values: "
                                         r"layer 3 reads layer 1's"),
    (dict(kv_source=(0, 1, 2, 3, 4, 4), layer_heads={"full_attention": {"d_k": 6, "d_v": 6, "num_kv_heads": 1}}),
     r"kv_source\[5\]=4 is not allowed: a layer with the same head: layer 4 differs from layer 5 in "
     r"\['d_k', 'd_v', 'num_kv_heads', .*'window'\]"),
    (dict(kv_source=(0, 1, 2, 3, 4, 5)), None),
    (dict(kv_source=(0, 1, 2, 3, 2, 3), layer_heads={"full_attention": GLOBAL["full_attention"] | {"d_v": 4}}),
     r"layer_types\[1\]='full_attention': d_v=4 is not allowed: equal to d_k=6 for k_eq_v"),
    (dict(layer_heads={"full_attention": {"variant": "nope"}}), r"layer_heads.full_attention.variant='nope'"),
    (dict(layer_heads={"full_attention": {"value_norm_eps": -1.0}}), r"layer_heads.full_attention.value_norm_eps=-1.0"),
    (dict(layer_heads={"full_attention": GLOBAL["full_attention"] | {"variant": "merged"}}),
     r"value_norm_eps=1e-06 is not allowed: it must be unset \(None\) for variant 'merged'"),
])
def test_bad_mixes_are_refused_by_name(changes, match):
  if match is None:  # every layer its own keys and values: nothing to refuse
    assert _cfg(**changes).kv_source == (0, 1, 2, 3, 4, 5)
    return
  with pytest.raises(ConfigError, match=match):
    _cfg(**changes)


def test_last_layers_follows_transformers_rule_and_refuses_by_name():
  assert kv_sharing.last_layers(TYPES, 0) is None
  assert kv_sharing.last_layers(TYPES, 3) == (0, 1, 2, 1, 2, 1)
  with pytest.raises(ConfigError, match=r"num_kv_shared_layers=6 is not allowed: an integer in \[0, 6\)"):
    kv_sharing.last_layers(TYPES, 6)
  with pytest.raises(ConfigError, match=r"num_kv_shared_layers=5 is not allowed: at most 4: layer 1 "
                     r"\(full_attention\) would share with no earlier full_attention layer"):
    kv_sharing.last_layers(TYPES, 5)
