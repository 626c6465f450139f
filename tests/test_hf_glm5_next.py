"""GLM-5.3-Flash's text model in and out: a tiny random Glm5NextForConditionalGeneration built in code (no download)
and written by transformers' own save_pretrained, read by attn.nn.hf.from_hf as a hybrid DecoderLM (kda layers with
the bounded decay, NoPE mla layers choosing keys with the K-pool indexer on x and the query latent, mHC streams
closed by their mean, DeepSeek's experts with every SwiGLU clamped); logits under right padding, cached greedy
decoding, to_hf bit for bit, `attn count --hf` and the refusals, against transformers.

The fast tier reads config.json dicts written here, without torch; everything that builds a transformers model is
slow and skips by name where transformers has no glm5_next (it has from 5.25; the floor 4.51.1 has not).
"""

import json
import shutil
import warnings

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from attn import ConfigError, HeadConfig, api, cli, count
from attn.count import layer
from attn.nn import hf

# The indexed layers as every release reads them (attn.nn.hf.glm5_next.KINDS: 5.16 calls them
# deepseek_sparse_attention, 5.25 indexed_attention, each refusing the other's name).
KINDS = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
# 4 mla heads of d_k 6 (NoPE) and d_v 7 on a latent of 5 and a query latent of 6; 8 index heads of 8 (many, so
# that no two pools tie at a ReLU score of 0: torch's top-k orders ties its own way), top 8 in pools of 4; 2 kda
# heads of 8; 8 experts in 2 groups, the first layer dense; 2 streams; the clamp at 0.5, where it binds.
TEXT = {"vocab_size": 53, "hidden_size": 32, "intermediate_size": 40, "moe_intermediate_size": 12,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 8,
        "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "q_lora_rank": 6, "kv_lora_rank": 5,
        "qk_nope_head_dim": 6, "v_head_dim": 7, "index_n_heads": 8, "index_head_dim": 8, "index_topk": 8,
        "index_kpool": 4, "linear_head_dim": 8, "linear_num_heads": 2, "hc_mult": 2, "pad_token_id": 0,
        "swiglu_limit": 0.5, "routed_scaling_factor": 1.5, "layer_types": KINDS, "indexer_types": ["full"] * 4,
        "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"]}
VISION = {"depth": 1, "hidden_size": 16, "num_heads": 2, "intermediate_size": 16, "out_hidden_size": 32,
          "patch_size": 4, "projection_intermediate_size": 16, "image_size": 8}


def release_config(**changes):
  """The wrapper's config.json as save_pretrained writes it (text under text_config), text fields changed."""
  return {"model_type": "glm5_next", "architectures": ["Glm5NextForConditionalGeneration"],
          "text_config": TEXT | {"model_type": "glm5_next_text", "rms_norm_eps": 1e-5, "qk_rope_head_dim": 0,
                                 "linear_lower_bound": -5.0, "hidden_act": "silu"} | changes,
          "vision_config": VISION, "tie_word_embeddings": False}


def _read(hf_cfg):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    return hf.model_config(hf_cfg)


def test_a_config_json_is_read_without_torch():
  """The fast sibling: the wrapper's config.json (and the flat text config) as attn's layers, the vision tower
  named as not read, and what config_out writes read back to the same config."""
  with pytest.warns(UserWarning, match="vision tower .* not read"):
    cfg = hf.model_config(release_config())
  assert cfg.layer_types == ("linear_attention", "full_attention") * 2 and cfg.variant == "mla"
  assert cfg.rope_dim == 0 and cfg.positional == "none" and cfg.head.d_k == 6 and cfg.latent_norm_eps == 1e-5
  assert dict(cfg.head.extra["kpool"]) == {"heads": 8, "head_dim": 8, "top_k": 8, "kpool": 4,
                                           "always_select_tail": True, "form": "deepseek"}
  kda = cfg.layer_head(0)
  assert (kda.num_heads, kda.d_k, kda.kda_lower_bound, kda.kda_full_rank, kda.extra) == (2, 8, -5.0, False, None)
  assert (cfg.hc_mult, cfg.hc_head, cfg.hc_form) == (2, "mean", "mhc")
  assert (cfg.moe_swiglu_limit, cfg.moe_swiglu_form, cfg.moe_dense_first) == (0.5, "clamp", 1)
  family = hf.FAMILIES["glm5_next"]
  family.check_out(cfg)
  out = family.config_out(cfg)
  assert out["text_config"]["layer_types"] == KINDS and out["architectures"] == ["Glm5NextForConditionalGeneration"]
  assert _read(out | {"model_type": "glm5_next"}) == cfg
  flat = release_config()["text_config"] | {"model_type": "glm5_next_text"}
  assert _read(flat) == cfg
  soft = _read(release_config(linear_lower_bound=None))
  assert soft.layer_head(0).kda_lower_bound is None  # the softplus decay


@pytest.mark.parametrize("changes, field", [
    (dict(indexer_types=["full", "full", "full", "shared"]), r"config.indexer_types\[3\]"),
    (dict(layer_types=["linear_attention"] + ["indexed_attention"] * 3, indexer_types=["full", "full", "shared",
                                                                                      "shared"]),
     r"config.indexer_types\[3\]"),
    (dict(qk_rope_head_dim=2), "config.qk_rope_head_dim"),
    (dict(hidden_act="gelu"), "config.hidden_act"),
    (dict(attention_bias=True), "config.attention_bias"),
    (dict(mlp_layer_types=["dense"] * 4), "config.swiglu_limit"),
    (dict(layer_types=["linear_attention", "mamba", "linear_attention", "indexed_attention"]), "config.layer_types"),
    (dict(linear_lower_bound=1.0), "config.linear_lower_bound"),
    (dict(q_lora_rank=None), "config.q_lora_rank"),
])
def test_what_attn_does_not_run_is_refused_before_any_weight(changes, field):
  with pytest.raises(ConfigError, match=f"{field}=.* is not allowed"):
    _read(release_config(**changes))


def test_the_new_options_are_validated_and_counted():
  """kpool's deepseek form needs a query latent and counts its parameters in closed form; hc_head is one of its
  values, and "mean" only with streams to close."""
  ix = {"heads": 2, "head_dim": 3, "top_k": 4, "kpool": 2, "form": "deepseek"}
  head = HeadConfig(d_model=12, num_heads=2, d_k=4, d_v=5, latent_dim=3, q_latent_dim=5, use_bias=False,
                    extra={"kpool": ix})
  shapes = api.param_shapes("mla", head)
  assert shapes["w_idq"] == (5, 2, 3) and shapes["w_idg"] == (12, 3) and shapes["ape"] == (2, 3)
  assert layer.check_layer("mla", head).analytic_params() == sum(int(np.prod(s)) for s in shapes.values())
  with pytest.raises(ConfigError, match=r"extra.kpool.form='deepseek' is not allowed: 'heads' without q_latent_dim"):
    api.check_config("mla", head.replace(q_latent_dim=None))
  with pytest.raises(ConfigError, match=r"extra.kpool.form='x' is not allowed: one of \['heads', 'deepseek'\]"):
    api.check_config("mla", head.replace(extra={"kpool": ix | {"form": "x"}}))
  cfg = _read(release_config())
  with pytest.raises(ConfigError, match=r"hc_head='mean' is not allowed: .*\"learned\" \(the default\) with hc_mult=1"):
    cfg.replace(hc_mult=1)
  with pytest.raises(ConfigError, match=r"hc_head='sum' is not allowed: one of \['learned', 'mean'\]"):
    cfg.replace(hc_head="sum")
  learned = count.model_param_count(cfg.replace(hc_head="learned"))
  assert learned - count.model_param_count(cfg) == 2 * (2 * 32 + 1) + 1  # V4's HyperHead: n·(n·D + 1) + 1


# ---- against transformers (slow: each builds a transformers model).

def _modules():
  pytest.importorskip("torch")
  m = pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next",
                          reason="this transformers has no glm5_next (added in 5.25)")
  return m, pytest.importorskip("transformers.models.glm5_next.configuration_glm5_next")


def build(seed=0, **changes):
  """The tiny wrapper with its learned offsets, gates, norms, decay and correction bias moved off their inits."""
  torch = pytest.importorskip("torch")
  m, c = _modules()
  torch.manual_seed(seed)
  model = m.Glm5NextForConditionalGeneration(c.Glm5NextConfig(text_config=TEXT | changes, vision_config=VISION)).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith(("norm.weight", "norm.bias")):
        p.normal_(1.0 if name.endswith("weight") else 0.0, 0.2)
      if name.endswith(("compress_ape", "compress_gate", "hc.base", "hc.scale", "dt_bias", "A_log")):
        p.normal_(0.0, 0.5)
    for name, b in model.named_buffers():
      if name.endswith("e_score_correction_bias"):
        b.normal_(0.0, 0.1)
  return model


@pytest.fixture(scope="module")
def live():
  return build()


@pytest.fixture(scope="module")
def saved(live, tmp_path_factory):
  path = tmp_path_factory.mktemp("glm5_next") / "ckpt"
  live.save_pretrained(path)
  return str(path)


def _load(source):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    return hf.from_hf(source)


def _params(model):
  from hf_hybrid import nnx_state  # tests/hf_hybrid.py
  return jax.tree.leaves(nnx_state(model))


def _same_params(a, b):
  for x, y in zip(_params(a), _params(b), strict=True):
    np.testing.assert_array_equal(x, y)


@pytest.mark.slow
def test_a_save_pretrained_directory_loads_and_decodes_as_transformers(live, saved):
  """The directory transformers writes (the release's names: model.language_model., q/k/v_conv1d and the forget
  gate under self_attn, hc_attn_fn, one matrix per expert, the vision tower) holds the live model's text
  parameters bit for bit; cached greedy decoding equals generate and attn's own full pass."""
  from hf_hybrid import assert_greedy_decoding_equal
  names = set(hf.read_shapes(saved))
  at = "model.language_model."
  assert {at + n for n in ("layers.0.self_attn.q_conv1d.weight", "layers.0.self_attn.A_log", "layers.0.hc_attn_fn",
                           "layers.0.self_attn.f_a_proj.weight", "layers.1.self_attn.indexer.index_kpool_compress_gate",
                           "layers.1.mlp.experts.3.down_proj.weight")} <= names
  assert any(n.startswith("model.visual.") for n in names) and not any("hc_head" in n for n in names)
  with pytest.warns(UserWarning, match="vision tower"):
    loaded = hf.from_hf(saved)
  assert loaded.family == "glm5_next"
  assert [b.attn.variant for b in loaded.model.blocks] == ["kda", "mla", "kda", "mla"]
  _same_params(loaded.model, _load(live).model)
  assert_greedy_decoding_equal(live, loaded, np.random.default_rng(4).integers(0, 50, (2, 4)), 14)


@pytest.mark.slow
def test_logits_equal_transformers_under_right_padding(live, saved):
  """Two rows of 23 tokens (five pools of 4 and a tail: the top 2 pools bind), the second padded after 14: attn's
  logits within 1e-4 of transformers' largest at every real position."""
  from hf_hybrid import assert_logits_equal_under_right_padding
  assert_logits_equal_under_right_padding(live, _load(saved), T=23, pad_from=14)


@pytest.mark.slow
def test_to_hf_saved_again_round_trips_bit_for_bit(live, saved, tmp_path):
  """to_hf builds the wrapper holding live's text tensors bit for bit (its one-block vision tower at transformers'
  init: attn holds none) and live's logits bit for bit; saved again, the text tensors are the same under the same
  names and from_hf reads the same parameters."""
  import torch
  loaded = _load(saved)
  out = hf.to_hf(loaded)
  assert type(out).__name__ == "Glm5NextForConditionalGeneration"
  ours = {k: v.detach().numpy() for k, v in out.state_dict().items() if not k.startswith("model.visual.")}
  theirs = {k: v.detach().numpy() for k, v in live.state_dict().items() if not k.startswith("model.visual.")}
  assert set(ours) == set(theirs)
  for name, a in theirs.items():
    np.testing.assert_array_equal(ours[name], a, err_msg=name)
  out.set_attn_implementation(live.config._attn_implementation)
  tok = torch.tensor(np.random.default_rng(2).integers(0, 50, (1, 11)))
  with torch.no_grad():
    np.testing.assert_array_equal(out(tok).logits.numpy(), live(tok).logits.numpy())
  out.save_pretrained(tmp_path / "again")
  first, again = hf.read_weights(saved), hf.read_weights(str(tmp_path / "again"))
  text = lambda sd: {k: v for k, v in sd.items() if not k.startswith("model.visual.")}  # noqa: E731
  assert set(text(first)) == set(text(again))
  for name, a in text(first).items():
    np.testing.assert_array_equal(again[name], a, err_msg=name)
  _same_params(_load(str(tmp_path / "again")).model, loaded.model)


@pytest.mark.slow
def test_count_hf_equals_transformers_text_parameters(live, saved, capsys):
  """`attn count --hf` reports the text model (the vision tower named as left out): transformers' text total."""
  code = cli.main(["count", "--hf", saved, "--format", "json"])
  out = capsys.readouterr()
  assert code == 0, out.err
  report = json.loads(out.out)
  assert report["total"] == sum(p.numel() for n, p in live.named_parameters() if not n.startswith("model.visual."))
  rows = {r["type"]: r for r in report["layer_types"]}
  assert rows["full_attention"]["kv_bytes_per_token_per_layer"] == 4 * (5 + 2 * 8)  # latent, index key and gate
  H, K, W = 2, 8, 4  # a kda layer: H·K·K float32 states + (W − 1)·3HK convolution inputs
  assert rows["linear_attention"]["state_bytes_per_layer"] == 4 * (H * K * K + (W - 1) * 3 * H * K)


@pytest.mark.slow
def test_the_family_contract_kit_passes(live):
  """attn.testing.check_family on the live wrapper: the round trip (the vision tower, Family.unheld, left out),
  save_pretrained read back, and outputs within 1e-4 at the real tokens of right-padded rows."""
  from attn import testing
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    measured = testing.check_family("glm5_next", live)
  assert measured["logits_relative"] < 1e-4


# Layer 2 reuses layer 1's choice (indexer_types "shared" right after a full indexed layer: transformers passes
# the top-k on to the next layer only); top 4 in pools of 2, so that 9 tokens already bind.
SHARED = dict(layer_types=["linear_attention", "full_attention", "full_attention", "linear_attention"],
              indexer_types=["full", "full", "shared", "full"], index_topk=4, index_kpool=2)


@pytest.mark.slow
def test_a_shared_indexer_layer_reuses_the_full_layers_choice(tmp_path):
  """The shared layer holds no indexer (in transformers and in attn) and reuses layer 1's pools: the kit (round
  trip, save_pretrained, logits at the real tokens), logits under right padding at 23 tokens and cached greedy
  decoding equal transformers'; an indexer a checkpoint holds there anyway is read, named and not used."""
  from attn import testing
  from hf_hybrid import assert_greedy_decoding_equal, assert_logits_equal_under_right_padding
  pytest.importorskip("torch")
  live = build(1, **SHARED)
  assert live.model.language_model.layers[2].self_attn.indexer is None
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    measured = testing.check_family("glm5_next", live)
  assert measured["logits_relative"] < 1e-4
  loaded = _load(live)
  assert loaded.config.indexer_types == ("full", "full", "shared", "full")
  assert "w_idq" not in loaded.model.blocks[2].attn.params and "w_idq" in loaded.model.blocks[1].attn.params
  text = sum(p.numel() for n, p in live.named_parameters() if not n.startswith("model.visual."))
  assert count.model_param_count(loaded.config) == text  # the shared layer counts no indexer, as it holds none
  assert_logits_equal_under_right_padding(live, loaded, T=23, pad_from=15, seed=1)
  assert_greedy_decoding_equal(live, loaded, np.random.default_rng(5).integers(0, 50, (2, 5)), 12)
  live.save_pretrained(tmp_path / "ckpt")

  def extra(sd):
    at = "model.language_model.layers."
    sd |= {k.replace(at + "1.", at + "2."): v for k, v in list(sd.items()) if k.startswith(at + "1.self_attn.indexer.")}
  with pytest.warns(UserWarning, match=r"7 indexer tensors of shared layers .*read and ignored"):
    again = hf.from_hf(_copy_with(str(tmp_path / "ckpt"), tmp_path / "extra", extra))
  _same_params(again.model, loaded.model)


def _copy_with(saved, path, change):
  """saved's directory copied to path with its tensors changed by change(dict) (safetensors alone)."""
  save_file = pytest.importorskip("safetensors.numpy").save_file
  shutil.copytree(saved, path)
  sd = hf.read_weights(saved)
  change(sd)
  (path / "model.safetensors").unlink()
  save_file({k: np.ascontiguousarray(v) for k, v in sd.items()}, str(path / "model.safetensors"))
  return str(path)


@pytest.mark.slow
def test_an_unknown_tensor_is_refused_by_name_and_family_before_any_weight_is_read(live, saved, tmp_path,
                                                                                   monkeypatch):
  """An unknown tensor is refused naming it as stored; a multi-token-prediction layer (layers.{L}) is read past,
  and the flat text config (glm5_next_text) reads the same checkpoint."""
  def mtp(sd):
    sd |= {k.replace("layers.3.", "layers.4."): v for k, v in list(sd.items()) if ".layers.3." in k}
  path = _copy_with(saved, tmp_path / "mtp", mtp)
  flat = json.loads((tmp_path / "mtp" / "config.json").read_text())["text_config"] | {"model_type": "glm5_next_text"}
  (tmp_path / "mtp" / "config.json").write_text(json.dumps(flat))
  _same_params(_load(path).model, _load(live).model)

  def odd(sd):
    sd["model.language_model.layers.1.self_attn.indexer.wv.weight"] = sd[
        "model.language_model.layers.1.self_attn.indexer.wk.weight"]
  path = _copy_with(saved, tmp_path / "odd", odd)
  from attn.nn.hf import load

  def no_weights(*args):
    raise AssertionError("a weight was read before the names were checked")
  monkeypatch.setattr(load, "read_weights", no_weights)
  with pytest.raises(ConfigError, match=r"checkpoint=\['model.language_model.layers.1.self_attn.indexer.wv.weight'\]"
                                        r".*'glm5_next'"):
    _load(path)
