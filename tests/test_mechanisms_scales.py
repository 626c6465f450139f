"""Issue 53's head mechanisms: fixed-scale QK-norm, softplus gates, a value scale, per-layer RoPE bases.

Each is compared with a naive numpy layer written from the families' formulas (one query head at a
time, sharing no code with attn.variants), or with an identity between two configurations of attn
(a value scale is the same function as W_V and b_V scaled; a NoPE entry of layer_rope_theta the same
layer as a _nope layer type). Shapes are awkward: d_v != d_k, h not dividing d_model, G < H, a fully
padded batch row. The kit (attn.testing.check_variant, check_mechanism) checks decoding against the
full pass and the closed-form counts against XLA and the Jacobian.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attn
from attn import ConfigError, HeadConfig, count, testing
from attn.count import measured
from attn.nn import DecoderLM
from attn.nn.config import ModelConfig
from attn.variants import mechanisms
from conftest import jit_apply, randn, random_params

B, T = 2, 5
AWKWARD = HeadConfig(d_model=20, num_heads=6, d_k=4, d_v=3, num_kv_heads=2)


def _softplus(z):
  return np.logaddexp(0.0, z)


def naive(p, x, cfg: HeadConfig, lengths):
  """per_head's layer, causal with keys past lengths[b] masked, one head at a time, in float64."""
  p = {k: np.asarray(v, np.float64) for k, v in p.items()}
  x = np.asarray(x, np.float64)
  R, y = cfg.num_heads // cfg.num_kv_heads, np.zeros(x.shape)
  scale = 1.0 / np.sqrt(cfg.d_k) if cfg.scale is None else cfg.scale
  for b in range(x.shape[0]):
    for h in range(cfg.num_heads):
      g = h // R
      q = x[b] @ p["w_q"][:, h] + p.get("b_q", np.zeros((cfg.num_heads, cfg.d_k)))[h]
      k = x[b] @ p["w_k"][:, g] + p.get("b_k", np.zeros((cfg.num_kv_heads, cfg.d_k)))[g]
      v = x[b] @ p["w_v"][:, g] + p.get("b_v", np.zeros((cfg.num_kv_heads, cfg.d_v)))[g]
      if cfg.qk_norm == "fixed":  # Muse Spark: x / rms(x), the queries times qk_scale_factor
        q = q / np.sqrt((q ** 2).mean(-1, keepdims=True) + cfg.qk_norm_eps) * cfg.qk_scale_factor
        k = k / np.sqrt((k ** 2).mean(-1, keepdims=True) + cfg.qk_norm_eps)
      if cfg.value_scale is not None:  # MiMo-V2-Flash: v · attention_value_scale
        v = v * cfg.value_scale
      logits = q @ k.T * scale
      keep = np.tril(np.ones((T, T), bool)) & (np.arange(T)[None, :] < lengths[b])
      logits = np.where(keep, logits, -np.inf)
      top = np.max(logits, -1, keepdims=True)
      top = np.where(np.isfinite(top), top, 0.0)
      e = np.where(keep, np.exp(logits - top), 0.0)
      den = e.sum(-1, keepdims=True)
      o = np.where(den > 0, e / np.where(den > 0, den, 1.0), 0.0) @ v
      if cfg.gate is not None:
        z = np.einsum("TD,D...->T...", x[b], p["w_gate"][:, h]) + p.get("b_gate", np.zeros(p["w_gate"].shape[1:]))[h]
        gate = _softplus(z) if cfg.gate_activation == "softplus" else 1.0 / (1.0 + np.exp(-z))
        o = o * (gate[:, None] if cfg.gate == "headwise" else gate)
      y[b] += o @ p["w_o"][h]
  return y + p.get("b_o", 0.0)


CASES = {
    "qk_norm_fixed": dict(qk_norm="fixed", qk_scale_factor=5.473),
    "softplus_headwise": dict(gate="headwise", gate_activation="softplus"),
    "softplus_elementwise": dict(gate="elementwise", gate_activation="softplus", use_bias=False),
    "value_scale": dict(value_scale=0.707, d_k=5, d_v=3),  # MiMo's narrower values
    "all": dict(qk_norm="fixed", qk_scale_factor=2.0, gate="elementwise", gate_activation="softplus",
                value_scale=1.7),
}


# "all" holds fixed QK-norm, the softplus elementwise gate and the value scale together; a headwise
# gate cannot join it. Each alone runs in the slow tier.
@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in ("all", "softplus_headwise") else pytest.mark.slow)
                                  for n in sorted(CASES)])
def test_against_naive(name):
  cfg = AWKWARD.replace(**CASES[name])
  p = random_params(jax.eval_shape(lambda: attn.init("per_head", jax.random.key(0), cfg)), 3)
  x = randn(4, (B, T, cfg.d_model))
  lengths = np.array([T, 0])  # the second row fully padded: zeros, not NaN
  got = jit_apply("per_head", p, x, cfg=cfg, is_causal=True, kv_lengths=lengths)
  np.testing.assert_allclose(np.asarray(got), naive(p, x, cfg, lengths), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("variant, names", [("per_head", ("w_v", "b_v")),
                                            pytest.param("fused", ("w_o",), marks=pytest.mark.slow)])
def test_value_scale_is_scaled_values(variant, names):
  """value_scale s is W_V and b_V times s (per_head), or W_O times s (fused: its q, k, v in one matrix)."""
  cfg = AWKWARD.replace(d_k=6, d_v=4, sinks=True, gate="headwise")
  p = random_params(jax.eval_shape(lambda: attn.init(variant, jax.random.key(1), cfg)), 5)
  x = randn(6, (B, T, cfg.d_model))
  scaled = {n: (a * 0.37 if n in names else a) for n, a in p.items()}
  want = jit_apply(variant, scaled, x, cfg=cfg, is_causal=True)
  got = jit_apply(variant, p, x, cfg=cfg.replace(value_scale=0.37), is_causal=True)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_fixed_norm_forgets_the_scale_of_queries_and_keys():
  """No learned scale: the weights are the same with W_Q, b_Q, W_K and b_K a thousand times larger
  (learned QK-norm keeps this too; the plain layer's softmax saturates instead)."""
  cfg = AWKWARD.replace(qk_norm="fixed", qk_scale_factor=3.0, qk_norm_eps=1e-12)
  p = random_params(jax.eval_shape(lambda: attn.init("per_head", jax.random.key(2), cfg)), 7)
  big = {n: (a * 1e3 if n in ("w_q", "b_q", "w_k", "b_k") else a) for n, a in p.items()}
  x = randn(8, (1, T, cfg.d_model))
  _, w = jit_apply("per_head", p, x, cfg=cfg, return_weights=True, is_causal=True)
  _, w_big = jit_apply("per_head", big, x, cfg=cfg, return_weights=True, is_causal=True)
  np.testing.assert_allclose(np.asarray(w_big), np.asarray(w), rtol=1e-4, atol=1e-6)
  _, plain = jit_apply("per_head", big, x, cfg=AWKWARD, return_weights=True, is_causal=True)
  assert not np.allclose(np.asarray(plain), np.asarray(w), atol=1e-3)


@pytest.mark.slow  # 5-13 s each: the fast tier has test_against_naive and test_counts_closed_form
@pytest.mark.parametrize("variant", ["per_head", "talking_heads", "differential", "gla"])
def test_kit_fixed_norm_and_softplus(variant):
  """The kit at one config per variant: counts closed form = measured (Jacobian rank, XLA's FLOPs),
  calls, decoding = the full pass. A linear head (gla) takes the softplus gate and the value scale,
  and refuses fixed QK-norm by name."""
  cfg = HeadConfig(d_model=8, num_heads=4, d_k=3, d_v=2, num_kv_heads=2, gate="headwise",
                   gate_activation="softplus", value_scale=0.5)
  if variant == "gla":
    with pytest.raises(ConfigError, match="qk_norm"):
      attn.api.check_config(variant, cfg.replace(qk_norm="fixed", qk_scale_factor=2.0))
  else:
    cfg = cfg.replace(qk_norm="fixed", qk_scale_factor=2.0, qk_norm_eps=1e-12)
  testing.check_variant(variant, configs=(cfg,))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qk_norm", "gate", "value_scale"])
def test_check_mechanism_thorough(name):
  """Every example of the record alone (fixed QK-norm and the softplus gate among them), per_head."""
  testing.check_mechanism(mechanisms.MECHANISMS[name], variants=["per_head", "fused"], thorough=True)


@pytest.mark.slow
def test_check_mechanism_value_scale():
  testing.check_mechanism(mechanisms.MECHANISMS["value_scale"])


def test_counts_closed_form():
  """attn count: fixed QK-norm adds no parameter and counts K + rope_dim/2 fewer effective ones than
  learned QK-norm (its scales); the softplus gate counts as σ's; the value scale adds nothing. All in
  closed form (no figure measured)."""
  base = AWKWARD.replace(rope_dim=2)
  learned, fixed = base.replace(qk_norm=True), base.replace(qk_norm="fixed", qk_scale_factor=4.0)
  soft = base.replace(gate="elementwise", gate_activation="softplus")
  scaled = base.replace(value_scale=2.0)
  for cfg in (fixed, soft, scaled):
    assert count.measured_figures("per_head", cfg) == []
  c = {name: count.param_counts("per_head", cfg) for name, cfg in
       (("base", base), ("learned", learned), ("fixed", fixed), ("soft", soft), ("scaled", scaled),
        ("sigmoid", base.replace(gate="elementwise")))}
  assert c["learned"]["analytic"] - c["fixed"]["analytic"] == 2 * base.d_k
  assert c["fixed"]["analytic"] == c["base"]["analytic"] == c["scaled"]["analytic"]
  assert c["fixed"]["effective"] < c["learned"]["effective"]  # no scales, and a rotation gauge
  assert c["soft"] == c["sigmoid"] and c["scaled"] == c["base"]
  assert count.flops("per_head", scaled, T) == count.flops("per_head", base, T)


@pytest.mark.parametrize("variant, cfg", [
    ("per_head", HeadConfig(d_model=6, num_heads=3, d_k=2, d_v=3, num_kv_heads=1, use_bias=False)),
    pytest.param("per_head", HeadConfig(d_model=8, num_heads=4, d_k=4, d_v=2, num_kv_heads=2, rope_dim=2,
                                        rope_theta=100.0), marks=pytest.mark.slow),
    pytest.param("differential", HeadConfig(d_model=8, num_heads=4, d_k=3, d_v=2, num_kv_heads=2),
                 marks=pytest.mark.slow),
    pytest.param("talking_heads", HeadConfig(d_model=8, num_heads=4, d_k=4, d_v=2, num_kv_heads=2, rope_dim=2,
                                             rope_theta=100.0), marks=pytest.mark.slow),
])
def test_fixed_norm_effective_count_is_the_jacobian_rank(variant, cfg):
  """The closed form (the maps up to scale, less each kv group's rotation gauge: O(K − r) and one turn
  per RoPE pair) against the rank of the layer's Jacobian in its parameters."""
  cfg = cfg.replace(qk_norm="fixed", qk_scale_factor=2.5, qk_norm_eps=1e-12)  # eps: the ideal norm
  assert count.param_counts(variant, cfg)["effective"] == measured.jacobian_rank(variant, cfg)


@pytest.mark.parametrize("change, field", [
    (dict(qk_norm="fixed", qk_scale_factor=0.0), "qk_scale_factor"),
    (dict(qk_norm="fixed", qk_scale_factor=-1.0), "qk_scale_factor"),
    (dict(qk_norm=True, qk_scale_factor=2.0), "qk_scale_factor"),
    (dict(qk_norm="fixed", qk_norm_plus_one=True), "qk_norm_plus_one"),
    (dict(gate="headwise", gate_activation="tanh"), "gate_activation"),
    (dict(gate_activation="softplus"), "gate_activation"),
    (dict(value_scale=0.0), "value_scale"),
    (dict(value_scale=float("nan")), "value_scale"),
])
def test_bad_options_refused(change, field):
  with pytest.raises(ConfigError, match=rf"^{field}="):
    AWKWARD.replace(**change)


def _model(**changes):
  return ModelConfig(**dict(vocab_size=13, d_model=12, num_layers=3, num_heads=3, d_ff=16, num_kv_heads=1,
                            variant="per_head", positional="rope", rope_dim=4, max_len=16) | changes)


def test_layer_rope_theta_heads():
  """Each layer's head as written here: the base given, 0 = the _nope layer type's head."""
  thetas = _model(layer_rope_theta=[1000.0, 0, 50.0], rope_scaling="linear", rope_factor=2.0)
  types = _model(layer_types=["full_attention", "full_attention_nope", "full_attention"], rope_theta=1000.0,
                 rope_scaling="linear", rope_factor=2.0)
  assert thetas.layer_head(0) == types.layer_head(0)
  assert thetas.layer_head(1) == types.layer_head(1) and thetas.layer_head(1).rope_dim == 0
  assert thetas.layer_head(2) == types.layer_head(2).replace(rope_theta=50.0)  # scaling kept


@pytest.mark.slow  # three small models and a decode: ~20 s
def test_layer_rope_theta():
  """A base per layer: 0 is the _nope layer type's layer, a base the model's with rope_theta set to it
  (two models, one set of weights, the same logits); decoding one token at a time = the full pass."""
  thetas = _model(layer_rope_theta=[1000.0, 0, 50.0])
  assert [thetas.layer_head(i).rope_theta for i in (0, 2)] == [1000.0, 50.0]
  assert thetas.layer_head(1).rope_dim == 0 and thetas.layer_head(0).rope_dim == 4
  ids = jnp.asarray(np.random.default_rng(0).integers(0, 13, (B, 7)), jnp.int32)
  a = DecoderLM(thetas, rngs=nnx.Rngs(0))
  same = DecoderLM(_model(layer_rope_theta=[1000.0, 0, 1000.0]), rngs=nnx.Rngs(0))
  types = DecoderLM(_model(layer_types=["full_attention", "full_attention_nope", "full_attention"],
                           rope_theta=1000.0), rngs=nnx.Rngs(0))
  for m in (same, types):
    nnx.update(m, nnx.state(a))
  np.testing.assert_allclose(np.asarray(same(ids)), np.asarray(types(ids)), rtol=1e-5, atol=1e-5)
  full = a(ids)
  assert not np.allclose(np.asarray(full), np.asarray(types(ids)), atol=1e-4)  # layer 2's base reads
  a.init_cache(B, 7)
  outs = [a(ids[:, :4], decode=True)] + [a(ids[:, i:i + 1], decode=True) for i in range(4, 7)]
  np.testing.assert_allclose(jnp.concatenate(outs, 1), full, atol=3e-5, rtol=3e-5)


@pytest.mark.parametrize("thetas, field", [
    ([1.0, 2.0], "layer_rope_theta"),
    ([1.0, -2.0, 3.0], r"layer_rope_theta\[1\]"),
    ([1.0, True, 3.0], r"layer_rope_theta\[1\]"),
    ("10000", "layer_rope_theta"),
])
def test_layer_rope_theta_refused(thetas, field):
  with pytest.raises(ConfigError, match=rf"^{field}="):
    _model(layer_rope_theta=thetas)


def test_layer_rope_theta_refused_against_other_settings():
  with pytest.raises(ConfigError, match=r"^layer_rope_theta\[1\]="):
    _model(layer_rope_theta=[1.0, 2.0, 3.0], layer_types=["full_attention", "full_attention_nope", "full_attention"])
  with pytest.raises(ConfigError, match=r"^sliding_rope_theta="):
    _model(layer_rope_theta=[1.0, 2.0, 3.0], window=2, sliding_rope_theta=5.0)
  with pytest.raises(ConfigError, match=r"^layer_rope_theta="):
    ModelConfig(vocab_size=13, d_model=12, num_layers=2, num_heads=3, d_ff=16, layer_rope_theta=[1.0, 0.0])


def test_layer_num_heads_counts_are_what_the_model_stores():
  """Query heads per layer (Laguna's): each layer's q and o by its own heads, the model's count = the
  parameters the model stores, the per-type FLOPs each layer's own."""
  cfg = _model(layer_num_heads=[3, 1, 2], d_k=4, d_v=4, num_kv_heads=1, layer_types=["full_attention"] * 3)
  assert [cfg.layer_head(i).num_heads for i in range(3)] == [3, 1, 2]
  model = nnx.eval_shape(lambda: DecoderLM(cfg, rngs=nnx.Rngs(0)))
  stored = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert count.model_param_count(cfg, "decoder_lm") == stored
  row = count.layer_type_table(cfg, "decoder_lm", 8)[0]
  assert row["flops_fwd"] == sum(count.flops("per_head", cfg.layer_head(i), 8) for i in range(3))


@pytest.mark.parametrize("heads, field", [
    ([3, 3], "layer_num_heads"),
    ([3, 0, 3], r"layer_num_heads\[1\]"),
    ([3, 2, 3], r"layer_num_heads\[1\]"),  # not a multiple of the 3 kv heads
])
def test_layer_num_heads_refused(heads, field):
  with pytest.raises(ConfigError, match=rf"^{field}="):
    _model(layer_num_heads=heads, num_kv_heads=3, num_heads=3, d_k=4)


@pytest.mark.slow  # a model and a decode: ~10 s
def test_layer_num_heads_decoding_equals_the_full_pass():
  cfg = _model(layer_num_heads=[3, 1, 2], d_k=4, d_v=4, num_kv_heads=1)
  ids = jnp.asarray(np.random.default_rng(1).integers(0, 13, (B, 7)), jnp.int32)
  m = DecoderLM(cfg, rngs=nnx.Rngs(0))
  full = m(ids)
  m.init_cache(B, 7)
  outs = [m(ids[:, :4], decode=True)] + [m(ids[:, i:i + 1], decode=True) for i in range(4, 7)]
  np.testing.assert_allclose(jnp.concatenate(outs, 1), full, atol=3e-5, rtol=3e-5)


def test_per_layer_settings_and_new_options_through_toml():
  from attn.experiments.running import config as config_lib
  from conftest import TINY_MQAR
  keys = ('positional = "rope"\nrope_dim = 4\nlayer_rope_theta = [0]\nlayer_num_heads = [2]\nqk_norm = "fixed"\n'
          'qk_scale_factor = 3\ngate = "headwise"\ngate_activation = "softplus"\nvalue_scale = 0.5\n')
  model = config_lib.loads(TINY_MQAR + keys, "a.toml", []).trials[0].config["model"]
  cfg = ModelConfig(**model)
  assert cfg.layer_rope_theta == (0.0,) and cfg.layer_num_heads == (2,) and cfg.layer_head(0).rope_dim == 0
  assert (cfg.qk_scale_factor, cfg.gate_activation, cfg.value_scale) == (3.0, "softplus", 0.5)
  with pytest.raises(ConfigError, match=r"model.layer_rope_theta='x' is not allowed: a list of numbers"):
    config_lib.loads(TINY_MQAR + keys.replace("layer_rope_theta = [0]", 'layer_rope_theta = "x"'), "b.toml", [])
