"""Muse Spark (muse_spark, attn.nn.hf.muse_spark): its text model, from a tiny random
MuseSparkForConditionalGeneration built with transformers' own classes (nothing downloaded), against
transformers itself: logits under right padding, the directory its save_pretrained writes, cached greedy
decoding against generate, to_hf bit for bit, `attn count --hf` against transformers' count of the text
model; the towers left out and refusals by name. muse_spark_text (a text model saved alone, no LM head in
transformers) is refused by name.

The model: d_model 24, heads of 8 over 2 kv heads, three sliding layers (window 3) with RoPE and a last
full one without (layer_rope_theta 0), fixed QK-norm times 5.47, the per-head output norm and the gate,
the residual gates and Muse Spark's norms, dense first and last layers and 4 pooled experts (width 16,
top 2, routed scaling 1.5) between; the towers as small as transformers builds them. Tests that build a
transformers model skip where the installed release lacks muse_spark (5.25 has it; the floor, 4.51.1,
does not).
"""

import json

import numpy as np
import pytest

from attn import ConfigError, cli
from attn.nn import hf, norms
from attn.nn.config import ModelConfig

TOL = 1e-4  # relative to the largest logit, float32
TEXT = dict(vocab_size=53, hidden_size=24, intermediate_size=40, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, qk_scale_factor=5.47, moe_hidden_size=16, moe_intermediate_size=12,
            num_local_experts=4, num_experts_per_tok=2, routed_scaling_factor=1.5,
            mlp_layer_types=["dense", "sparse", "sparse", "dense"], sliding_window=3, max_position_embeddings=32,
            pad_token_id=None, bos_token_id=None, eos_token_id=None)
TOWERS = dict(vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 patch_size=2, pos_emb_height=4, pos_emb_width=4),
              audio_config=dict(hidden_sizes=[8, 8], depths=[1, 1], patch_sizes=[2, 2], num_hidden_layers=2,
                                out_hidden_size=24),
              out_hidden_size=16, projector_hidden_size=16)


def _config(**text):
  return {"model_type": "muse_spark", "text_config": {"model_type": "muse_spark_text", **TEXT, **text}}


def _transformers():
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  pytest.importorskip("transformers.models.muse_spark",
                      reason=f"muse_spark is not in transformers {transformers.__version__}")
  return torch, transformers


def _model(seed=0, **text):
  """A random MuseSparkForConditionalGeneration, every weight of the text model (norms, residual gates, the
  correction bias) moved."""
  torch, transformers = _transformers()
  torch.manual_seed(seed)
  cfg = transformers.MuseSparkConfig(text_config=TEXT | text, **TOWERS)
  m = transformers.MuseSparkForConditionalGeneration(cfg).eval()
  with torch.no_grad():
    for name, p in [*m.named_parameters(), *m.named_buffers()]:
      if name.startswith(("model.language_model.", "lm_head.")) and p.is_floating_point() and "inv_freq" not in name:
        p.add_(0.3 * torch.randn_like(p))
  return m


def _text_count(m) -> int:
  return sum(p.numel() for p in m.model.language_model.parameters()) + m.lm_head.weight.numel()


def test_config_read_as_written_here():
  """The fast sibling of the tests against transformers: config.json alone (no torch)."""
  cfg = hf.model_config(_config())
  heads = [cfg.layer_head(i) for i in range(4)]
  assert [(h.window, h.rope_dim if h.rope_theta else 0) for h in heads] == [(3, 8), (3, 8), (3, 8), (None, 0)]
  assert (cfg.qk_norm, cfg.qk_scale_factor, cfg.output_norm_eps, cfg.gate) == ("fixed", 5.47, 1e-5, "elementwise")
  assert cfg.norm_forms == hf.FAMILIES["muse_spark"].fixed["norm_forms"] and cfg.post_norm_eps == 1e-8
  assert (cfg.residual_gate, cfg.logit_softcap, cfg.moe_pool_width, cfg.moe_routed_scaling) == (0.3, 20.0, 16, 1.5)
  assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, True, False]
  assert cfg.moe_router_scale * cfg.logit_divisor == pytest.approx(1.0)
  thetas = hf.model_config(_config(layer_rope_theta=[10000.0, 0, 7.0, 0])).layer_rope_theta
  assert thetas == (500000.0, 0.0, 500000.0, 0.0)  # transformers reads only whether an entry is 0


def test_residual_gate_mixes_with_unit_norm():
  """α² + β² = 1 above the floor (σ(−w) = 1 − β), and α = √1e-3 at the floor."""
  import jax
  import jax.numpy as jnp
  gate = jax.jit(norms.residual_gate, static_argnums=1)  # one compile, not one per operation
  g = jnp.asarray(np.array([-3.0, -0.2, 0.0, 0.5, 4.0], np.float32))
  one, zero = jnp.asarray(np.ones(5, np.float32)), jnp.asarray(np.zeros(5, np.float32))
  a, b = np.asarray(gate(g, 0.3, one, zero)), np.asarray(gate(g, 0.3, zero, one))
  np.testing.assert_allclose(a[:4] ** 2 + b[:4] ** 2, 1.0, rtol=1e-6)
  assert float(a[4]) == pytest.approx(np.sqrt(1e-3), rel=1e-6)


@pytest.mark.parametrize("model_type", ["muse_spark_text"])
def test_text_model_alone_refused_by_name_before_any_weight(model_type):
  with pytest.raises(ConfigError, match=rf"model_type='{model_type}'.*no LM head.*model_type muse_spark"):
    hf.model_config({"model_type": model_type, **TEXT})
  with pytest.raises(ConfigError, match=rf"model_type='{model_type}'"):
    hf.from_hf(({"model_type": model_type, **TEXT}, {}))  # no tensors: the refusal comes first


@pytest.mark.parametrize("changes, match", [
    (dict(attention_bias=True), r"config.text_config.attention_bias=True is not allowed"),
    (dict(tie_word_embeddings=True), r"config.text_config.tie_word_embeddings=True"),
    (dict(layer_types=["full_attention"] * 3), r"config.text_config.layer_types="),
    (dict(layer_rope_theta=[0, 0]), r"config.text_config.layer_rope_theta=\[0, 0\]"),
    (dict(mlp_layer_types=["moe"] * 4), r"config.text_config.mlp_layer_types="),
    (dict(qk_scale_factor=0.0), r"qk_scale_factor=0.0 is not allowed"),
    (dict(residual_gate_temperature=-1.0), r"residual_gate=-1.0 is not allowed"),
    (dict(post_norm_eps=0.0), r"post_norm_eps=0.0 is not allowed"),
    (dict(output_multiplier=0.0), r"config.text_config.output_multiplier=0.0 is not allowed"),
])
def test_what_attn_cannot_read_is_refused_by_name_before_any_weight(changes, match):
  with pytest.raises(ConfigError, match=match):
    hf.model_config(_config(**changes))
  with pytest.raises(ConfigError, match="text_config"):
    hf.model_config({"model_type": "muse_spark"})


BASE = dict(vocab_size=11, d_model=8, num_layers=2, num_heads=2, d_ff=8, norm_type="rmsnorm")


@pytest.mark.parametrize("fields, match", [
    (dict(residual_gate=0.0), r"residual_gate=0.0 is not allowed: None \(x \+ y\) or a positive"),
    (dict(residual_gate=0.3, norm="post"), r"residual_gate=0.3 is not allowed: None with norm='post'"),
    (dict(norm_forms={"final": "weird"}), r"norm_forms.final='weird' is not allowed: one of"),
    (dict(norm_forms={"middle": "none"}), r"norm_forms='middle' is not allowed: a place among"),
    (dict(norm_forms={"embed": "none"}), r"norm_forms.embed='none' is not allowed: absent"),
    (dict(norm_forms={"final": "none"}, norm_type="layernorm"), r"norm_forms=.* with norm_type='layernorm'"),
    (dict(post_norm_eps=1e-8), r"post_norm_eps=1e-08 is not allowed: None with norm='pre'"),
    (dict(mlp="moe", moe_experts=2, moe_top_k=1, moe_pool_width=0), r"moe_pool_width=0 is not allowed"),
    (dict(mlp="moe", moe_experts=2, moe_top_k=1, moe_pool_width=4, moe_shared_experts=1),
     r"moe_pool_width=4 is not allowed: None with moe_shared_experts=1"),
    (dict(mlp="moe", moe_experts=2, moe_top_k=1, moe_layer_types=("sparse",)), r"moe_layer_types=\('sparse',\)"),
    (dict(mlp="moe", moe_experts=2, moe_top_k=1, moe_layer_types=("dense", "sparse"), moe_dense_first=1),
     r"moe_layer_types=.* None with moe_dense_first=1"),
    (dict(mlp="moe", moe_experts=2, moe_top_k=1, moe_router_scale=-2.0), r"moe_router_scale=-2.0 is not allowed"),
    (dict(moe_router_scale=0.5), r"moe_router_scale=0.5 is not allowed: 1.0 when mlp='plain'"),
    (dict(output_norm_eps=0.0), r"output_norm_eps=0.0 is not allowed"),
])
def test_the_new_options_refused_by_name_before_tracing(fields, match):
  with pytest.raises(ConfigError, match=match):
    ModelConfig(**(BASE | fields))


@pytest.mark.slow  # torch, transformers and compiles; test_config_read_as_written_here is the sibling
def test_family_contract_and_the_save_pretrained_directory(tmp_path):
  """check_family on the live model (round trip of the text model, refusals, save_pretrained's directory read
  back bit for bit, logits under right padding); from_hf of the directory, to_hf of that saved again, read
  once more: the same text-model tensors bit for bit, under the checkpoint's own names."""
  torch, _ = _transformers()
  from attn.testing import check_family
  m = _model(seed=2)
  assert check_family("muse_spark", m)["logits_relative"] <= TOL
  m.save_pretrained(tmp_path / "ms")
  loaded = hf.from_hf(tmp_path / "ms")
  hf.to_hf(loaded).save_pretrained(tmp_path / "again")
  first, again = hf.read_weights(tmp_path / "ms"), hf.read_weights(tmp_path / "again")
  text = {k for k in first if k.startswith(("model.language_model.", "lm_head."))}
  assert {"model.language_model.layers.1.mlp.experts.gate_up_proj", "lm_head.weight",
          "model.language_model.layers.0.post_attention_residual_gate.gate"} <= text
  assert all(np.array_equal(first[k], again[k]) for k in text)
  back = hf.from_hf(tmp_path / "again")
  for a, b in zip(*(jax_leaves(x.model) for x in (loaded, back))):
    np.testing.assert_array_equal(a, b)
  ids = np.random.default_rng(3).integers(0, 53, (2, 9))
  mask = (np.arange(9)[None, :] < np.array([[9], [5]])).astype(np.int64)
  with torch.no_grad():
    want = m(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask)).logits.numpy()
  import jax.numpy as jnp
  got = np.asarray(back.model(jnp.asarray(ids), lengths_B=jnp.asarray(mask.sum(1))))
  keep = np.arange(9)[None, :] < mask.sum(1)[:, None] + 2  # a padded query whose window holds a real key
  assert np.abs(got - want)[keep].max() <= TOL * np.abs(want[keep]).max()


def jax_leaves(model):
  import jax
  from flax import nnx
  return [np.asarray(a) for a in jax.tree.leaves(nnx.to_pure_dict(nnx.state(model, nnx.Param)))]


@pytest.mark.slow
def test_cached_greedy_decoding_equals_generate(tmp_path):
  torch, _ = _transformers()
  import jax.numpy as jnp
  m = _model(seed=4)
  m.save_pretrained(tmp_path / "ms")
  loaded = hf.from_hf(tmp_path / "ms")
  prompt = torch.as_tensor(np.random.default_rng(4).integers(0, 53, (1, 5)))
  with torch.no_grad():
    want = m.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False).numpy()
  got = np.asarray(loaded.model.generate(jnp.asarray(prompt.numpy()), 8))
  np.testing.assert_array_equal(got, want)


@pytest.mark.slow
def test_count_hf_equals_transformers_text_model_and_says_what_it_left_out(tmp_path, capsys):
  m = _model()
  m.save_pretrained(tmp_path / "ms")
  code = cli.main(["count", "--hf", str(tmp_path / "ms"), "--format", "json"])
  out = capsys.readouterr()
  assert code == 0, out.err
  report = json.loads(out.out)
  assert report["total"] == _text_count(m) < sum(p.numel() for p in m.parameters())
  assert any("vision tower" in n and "audio tower" in n and "left out" in n for n in report["notes"])


@pytest.mark.slow
def test_unknown_tensor_names_refused_by_name(tmp_path):
  """A tensor under the text model's prefix that Muse Spark's text model does not have, and one beside the
  towers, are refused naming it and the family, before any weight is read; the towers' own are not read."""
  m = _model()
  m.save_pretrained(tmp_path / "ms")
  config, sd = hf.read_config(tmp_path / "ms"), hf.read_weights(tmp_path / "ms")
  for extra in ("model.language_model.layers.0.self_attn.q_norm.weight", "model.mtp.0.weight"):
    with pytest.raises(ConfigError, match=rf"{extra}.*'muse_spark'"):
      hf.from_hf((config, {**sd, extra: np.zeros(8, np.float32)}))
  hf.from_hf((config, {**sd, "model.vision_tower.extra.weight": np.zeros(8, np.float32)}))  # a tower's: not read


def test_count_hf_by_hand_from_config_json_alone(tmp_path, capsys):
  """`attn count --hf` on the wrapper's config.json (no transformers) against the closed form written here,
  the towers left out and said so."""
  (tmp_path / "m").mkdir()
  (tmp_path / "m" / "config.json").write_text(json.dumps(_config()))
  code = cli.main(["count", "--hf", str(tmp_path / "m"), "--format", "json"])
  out = capsys.readouterr()
  assert code == 0, out.err
  D, H, G, K, N, F, E, Fe, M = 24, 4, 2, 8, 53, 40, 4, 12, 16
  attention = 3 * D * H * K + 2 * D * G * K  # q, o and the gate; k and v (the norms have no weights)
  block = 3 * D + 2 * D  # input, pre- and post-feed-forward norms (the post-attention one weightless); 2 gates
  experts = E * D + D * M + M + E * 3 * M * Fe + M + M * D  # router, pre proj, norm, experts, their norm, post
  total = 4 * (attention + block) + 2 * 3 * D * F + 2 * experts + N * D + D + N * D
  report = json.loads(out.out)
  assert report["total"] == total and any("audio tower" in n for n in report["notes"])


@pytest.mark.slow
def test_check_mechanism_output_norm():
  """The kit on the per-head output norm (decoding = full pass, counts; its effective count measured)."""
  from attn import testing
  from attn.variants import mechanisms
  testing.check_mechanism(mechanisms.MECHANISMS["output_norm"])


@pytest.mark.slow
def test_the_blocks_against_transformers_modules():
  """norms.rms in each form, the residual gate and one pooled-expert layer against transformers' own modules."""
  torch, transformers = _transformers()
  import jax.numpy as jnp
  from flax import nnx
  from transformers.models.muse_spark import modeling_muse_spark as ms
  from attn.nn import moe
  torch.manual_seed(0)
  x = torch.randn(2, 3, 16)
  w = 0.5 * torch.randn(16)
  for form, module in (("input_scaled", ms.MuseSparkTextInputScaledRMSNorm(16, eps=1e-8)),
                       ("plus_one", ms.MuseSparkTextCenteredRMSNorm(16, eps=1e-5)),
                       ("none", ms.MuseSparkRMSNorm(eps=1e-5, with_scale=False))):
    if hasattr(module, "weight"):
      module.weight.data.copy_(w)
    with torch.no_grad():
      want = module(x).numpy()
    got = norms.rms(jnp.asarray(x.numpy()), jnp.asarray(w.numpy()), module.eps if hasattr(module, "eps") else 1e-5,
                    form)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6, err_msg=form)
  cfg = transformers.MuseSparkTextConfig(**(TEXT | dict(hidden_size=16)))
  gate = ms.MuseSparkResidualGate(cfg)
  gate.gate.data.normal_()
  y = torch.randn(2, 3, 16)
  with torch.no_grad():
    want = gate(x, y).numpy()
  got = norms.residual_gate(jnp.asarray(gate.gate.detach().numpy()), 0.3, jnp.asarray(x.numpy()),
                            jnp.asarray(y.numpy()))
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)
  theirs = ms.MuseSparkMoE(transformers.MuseSparkTextConfig(**TEXT)).eval()
  with torch.no_grad():
    for p in [*theirs.parameters(), *theirs.buffers()]:
      p.normal_()
  m = hf.model_config(_config())
  ours = moe.MoE(m, rngs=nnx.Rngs(0), activation=lambda a: a * (1 / (1 + jnp.exp(-a))))
  F = m.moe_d_ff
  t = {k: v.detach().numpy() for k, v in [*theirs.named_parameters(), *theirs.named_buffers()]}
  gate_up = t["experts.gate_up_proj"]
  nnx.update(ours, nnx.State({"router_w": t["gate.weight"].T, "correction": t["gate.e_score_correction_bias"],
                              "pool_in": t["pre_expert_proj.weight"].T, "pool_norm": t["pre_expert_norm.weight"],
                              "w_gate": gate_up[:, :F].transpose(0, 2, 1), "w_up": gate_up[:, F:].transpose(0, 2, 1),
                              "w_down": t["experts.down_proj"].transpose(0, 2, 1),
                              "expert_norm": t["experts.post_expert_norm.weight"],
                              "pool_out": t["post_expert_proj.weight"].T}))
  h = torch.randn(2, 5, 24)
  with torch.no_grad():
    want = theirs(h).numpy()
  got = np.asarray(ours(jnp.asarray(h.numpy())))
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
