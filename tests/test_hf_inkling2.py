"""Inkling-2 (inkling2_text, inkling2; attn.nn.hf.inkling2): its text model, from tiny random Inkling2ForCausalLM
and Inkling2ForConditionalGeneration built with transformers' own classes (nothing downloaded), against
transformers itself: check_family (refusals, round trip, the save_pretrained directory with the release's names
read back bit for bit, logits under right padding), cached greedy decoding against generate, to_hf saved and read
back bit for bit, `attn count --hf` against transformers' count of the text model (the wrapper's vision tower left
out, and said so). The pieces one at a time against transformers' submodules: tests/test_inkling2_pieces.py.

The model: d_model 16; a sliding layer (4 heads over 2 kv heads of width 6, window 3), a hybrid one (2 over 1, width
10: three mixes, per-token taps, log scaling from position 2) and a sliding one; blocks of 2 layers; 4 experts of 8,
top 2, soft-caps that bite; 61 embedding rows and 57 unembedding rows. Every weight moved from its start (the
attention residuals' queries, which start at zero, included). Tests that build a transformers model skip where the
installed release lacks inkling2 (5.25 has it; the floor, 4.51.1, does not).
"""

import json

import numpy as np
import pytest

from attn import ConfigError, cli
from attn.nn import hf

import hf_hybrid  # tests/hf_hybrid.py

TOL = 1e-4  # relative to the largest logit, float32
TEXT = dict(vocab_size=61, unpadded_vocab_size=57, hidden_size=16, num_hidden_layers=3, num_attention_heads=2,
            num_key_value_heads=1, head_dim=10, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=6,
            sliding_window_size=3, d_rel=4, rel_extent=5, log_scaling_n_floor=3, log_scaling_alpha=0.7,
            rel_l2_clip_threshold=1.3, conv_kernel_size=3, qk_l2_clip_threshold=0.9, moe_intermediate_size=8,
            n_routed_experts=4, num_experts_per_tok=2, route_scale=2.5, n_layers_per_attn_res_block=2,
            mlp_gate_softcap=1.5, mlp_up_softcap=2.0, final_logit_softcapping=3.0, max_position_embeddings=32,
            layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding"], eos_token_id=None)
VISION = dict(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, patch_size=4, projection_hidden_dim=8,
              text_hidden_size=16, posemb_grid_size=2, rope_parameters={"rope_type": "axial", "rope_theta": 100.0})
KINDS = ("inkling2_text", "inkling2")


def _config(kind: str, **text) -> dict:
  t = {"model_type": "inkling2_text", **TEXT, **text}
  return t if kind == "inkling2_text" else {"model_type": "inkling2", "text_config": t, "vision_config": VISION}


def _modules():
  pytest.importorskip("torch")
  reason = "transformers inkling2 (added in 5.x; absent on the floor 4.51.1)"
  modeling = pytest.importorskip("transformers.models.inkling2.modeling_inkling2", reason=reason)
  _skip_the_earlier_form(modeling)
  return modeling, pytest.importorskip("transformers.models.inkling2.configuration_inkling2", reason=reason)

def _skip_the_earlier_form(modeling):
  """transformers 5.23 ships an earlier Inkling-2 (modeling_inkling2: q_proj a plain nn.Linear, no
  Inkling2QueryProjection with its L2 clip scales: 64 parameters fewer at these sizes); attn reads 5.25's form,
  the released checkpoints'. That release skips the comparisons by name (5.24 has 5.25's form)."""
  if not hasattr(modeling, "Inkling2QueryProjection"):
    pytest.skip("transformers' Inkling-2 before 5.25 is an earlier form (q_proj a plain Linear, no L2 clip "
                "scales); attn reads 5.25's")


def _model(kind: str, seed: int = 0):
  """A random Inkling2ForCausalLM or Inkling2ForConditionalGeneration, every text-model weight moved (norm scales
  near 1, the rest N(0, 0.5))."""
  modeling, configuration = _modules()
  import torch
  torch.manual_seed(seed)
  if kind == "inkling2_text":
    m = modeling.Inkling2ForCausalLM(configuration.Inkling2TextConfig(**TEXT))
  else:
    m = modeling.Inkling2ForConditionalGeneration(configuration.Inkling2Config(text_config=TEXT, vision_config=VISION))
  m.config._attn_implementation = "eager"
  with torch.no_grad():
    for name, p in [*m.named_parameters(), *m.named_buffers()]:
      if "vision_tower" in name or not p.is_floating_point():
        continue
      p.copy_(torch.rand_like(p) + 0.5 if ("norm" in name and "scale" not in name) else torch.randn_like(p) * 0.5)
  return m.eval()


def _text_count(m) -> int:
  text = m.model if hasattr(m.model, "layers") else m.model.language_model
  return sum(p.numel() for p in text.parameters()) + m.lm_head.weight.numel()


@pytest.mark.parametrize("kind", KINDS)
def test_config_read_as_written_here(kind):
  """The fast sibling of the tests against transformers: config.json alone (no torch)."""
  cfg = hf.model_config(_config(kind))
  heads = [cfg.layer_head(i) for i in range(3)]
  assert [(h.num_heads, h.num_kv_heads, h.d_k, h.window, h.rel_bias_extent, h.log_scaling_alpha,
           h.qkv_conv_dynamic) for h in heads] == [(4, 2, 6, 3, 3, None, False), (2, 1, 10, None, 5, 0.7, True),
                                                   (4, 2, 6, 3, 3, None, False)]
  assert (cfg.vocab_size, cfg.output_vocab, cfg.attn_res_block, cfg.attn_res_kv_types) == (61, 57, 2, ("full_attention",))
  assert (cfg.residual_conv, cfg.qkv_conv_width, cfg.moe_gate_softcap, cfg.moe_up_softcap, cfg.logit_softcap) == (
      3, 3, 1.5, 2.0, 3.0)
  assert (cfg.token_sinks, cfg.qk_clip_scale, cfg.rel_bias_clip, cfg.log_scaling_floor) == (True, True, 1.3, 3)
  default = hf.model_config(_config(kind, layer_types=None, num_hidden_layers=6))  # transformers' default schedule
  assert default.layer_types == ("sliding_attention",) * 5 + ("full_attention",)


@pytest.mark.parametrize("changes, match", [
    (dict(scoring_func="softmax"), r"config.scoring_func='softmax' is not allowed: 'sigmoid'"),
    (dict(layer_types=["hybrid"] * 2), r"config.layer_types=.* is not allowed: 3 of \['hybrid', 'hybrid_sliding'\]"),
    (dict(layer_types=["full_attention"] * 3), r"config.layer_types="),
    (dict(swa_num_key_value_heads=3), r"config.swa_num_key_value_heads=3 is not allowed: a divisor"),
    (dict(mlp_gate_softcap=0.0), r"config.mlp_gate_softcap=0.0 is not allowed"),
    (dict(quantization_config={"quant_method": "mxfp8"}), r"config.quantization_config=.* is not allowed"),
])
def test_what_attn_cannot_read_is_refused_by_name_before_any_weight(changes, match):
  with pytest.raises(ConfigError, match=match):
    hf.model_config(_config("inkling2_text", **changes))
  with pytest.raises(ConfigError, match="text_config"):
    hf.model_config({"model_type": "inkling2"})


def test_count_hf_by_hand_from_config_json_alone(tmp_path, capsys):
  """`attn count --hf` on config.json (no transformers) against the closed form written here; the wrapper's
  tower left out and said so."""
  D, N, Nu, E, F, W, d = 16, 61, 57, 4, 8, 3, 4

  def attention(H, G, K, extent, dynamic):
    proj = D * H * K * 3 + 2 * D * G * K  # q, o, the gate; k, v
    return proj + H * K + D * H + D * H * d + H * d + d * extent + 2 * W * G * K + (2 * D * G * W if dynamic else 0)

  experts = E * D + E * 3 * D * F  # router (the correction bias a buffer), the experts
  block = experts + 2 * W * D + 2 * D + D  # residual convolutions, two norms, the MLP input's query
  sliding, hybrid = attention(4, 2, 6, 3, False), attention(2, 1, 10, 5, True)
  total = (2 * (sliding + block) + hybrid + block + 2 * D  # the hybrid layer's k and v input norms
           + 3 * D + D + D  # the attention inputs (three queries on layer 1, one on layer 2), the final input
           + N * D + D + D + Nu * D)  # embeddings, their norm, the final norm, the unembedding
  for kind in KINDS:
    (tmp_path / kind).mkdir()
    (tmp_path / kind / "config.json").write_text(json.dumps(_config(kind)))
    code = cli.main(["count", "--hf", str(tmp_path / kind), "--format", "json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    report = json.loads(out.out)
    assert report["total"] == total, (kind, report["total"], total)
    assert any("vision tower" in n and "left out" in n for n in report.get("notes", [])) == (kind == "inkling2")


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_family_contract_and_the_save_pretrained_directory(kind, tmp_path):
  """check_family on the live model (refusals, round trip, its save_pretrained directory read back bit for bit,
  logits under right padding); from_hf of the directory, to_hf of that saved again: the same text-model tensors
  bit for bit under the release's names, and the same parameters read back."""
  import jax
  from flax import nnx
  from attn.testing import check_family
  m = _model(kind, seed=1)
  assert check_family(kind, m)["logits_relative"] <= TOL
  m.save_pretrained(tmp_path / "first")
  loaded = hf.from_hf(tmp_path / "first")
  hf.to_hf(loaded).save_pretrained(tmp_path / "again")
  first, again = hf.read_weights(tmp_path / "first"), hf.read_weights(tmp_path / "again")
  text = {k for k in first if k.startswith("model.llm.")}
  assert {"model.llm.attn_res.attn_queries.0", "model.llm.layers.1.attn.k_sconv.weight_proj",
          "model.llm.layers.0.attn.attn_sink_proj.weight", "model.llm.unembed.weight"} <= text
  assert first["model.llm.unembed.weight"].shape == (61, 16) and not first["model.llm.unembed.weight"][57:].any()
  assert all(np.array_equal(first[k], again[k]) for k in text)
  back = hf.from_hf(tmp_path / "again")
  leaves = lambda x: jax.tree.leaves(nnx.to_pure_dict(nnx.state(x.model, nnx.Param)))  # noqa: E731
  for a, b in zip(leaves(loaded), leaves(back), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_cached_greedy_decoding_equals_generate(kind, tmp_path):
  """From the save_pretrained directory: attn's cached greedy decoding (the caches, the windows' rings, the
  convolutions' states, per-token sinks and bias at the cache's positions) equals transformers' generate."""
  pytest.importorskip("torch")
  m = _model(kind, seed=4)
  m.save_pretrained(tmp_path / kind)
  prompt = np.random.default_rng(4).integers(0, 57, (2, 5))
  hf_hybrid.assert_greedy_decoding_equal(m, hf.from_hf(tmp_path / kind), prompt, 7)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_count_hf_equals_transformers_text_model(kind, tmp_path, capsys):
  m = _model(kind)
  m.save_pretrained(tmp_path / kind)
  code = cli.main(["count", "--hf", str(tmp_path / kind), "--format", "json"])
  out = capsys.readouterr()
  assert code == 0, out.err
  report = json.loads(out.out)
  assert report["total"] == _text_count(m)
  assert (report["total"] < sum(p.numel() for p in m.parameters())) == (kind == "inkling2")


@pytest.mark.slow
def test_unknown_tensor_names_refused_by_name(tmp_path):
  """A tensor under the text model's names that Inkling-2 does not have is refused naming it and the family; the
  wrapper's tower is not read."""
  m = _model("inkling2")
  m.save_pretrained(tmp_path / "w")
  config, sd = hf.read_config(tmp_path / "w"), hf.read_weights(tmp_path / "w")
  for extra in ("model.llm.layers.0.attn.q_norm.weight", "model.mtp.0.weight"):
    with pytest.raises(ConfigError, match=rf"{extra}.*'inkling2'"):
      hf.from_hf((config, {**sd, extra: np.zeros(8, np.float32)}))
  hf.from_hf((config, {**sd, "model.visual.extra.weight": np.zeros(8, np.float32)}))  # the tower's: not read
