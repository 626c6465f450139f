"""NemotronH in and out: a tiny random NemotronHForCausalLM built in code (no download), read by
attn.nn.hf.from_hf into a DecoderLM of single-mixer blocks (ModelConfig.block_kinds: Mamba-2, attention
and relu² MLP layers, each its own residual); logits under right padding, cached greedy decoding,
to_hf bit for bit, `attn count --hf` and the refusals, against transformers."""

import json

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from attn import ConfigError, cli
from attn.nn import hf
from attn.nn.decoding import generate
from hf_hybrid import (  # tests/hf_hybrid.py
    assert_greedy_decoding_equal, assert_logits_equal_under_right_padding, assert_to_hf_and_back_exact, nnx_state)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.nemotron_h", reason="this transformers has no nemotron_h")

KINDS = ["linear_attention", "mlp", "full_attention", "mlp", "linear_attention"]
PATTERN = "M-*-M"  # KINDS as hybrid_override_pattern


def _has_mlp_layers() -> bool:
  try:
    return transformers.NemotronHConfig(hybrid_override_pattern="M-*").hybrid_override_pattern == "M-*"
  except (KeyError, ValueError):  # 5.3 to 5.5's NemotronH has Mamba, attention and expert layers only
    return False


if not _has_mlp_layers():
  pytest.skip(f"transformers {transformers.__version__}'s NemotronH has no MLP layers ('-')", allow_module_level=True)


def tiny(**changes):
  """Awkward sizes: 3 query heads over 1 kv head of 8 (d_model 24); 4 Mamba heads of 5 over 2 groups
  with a state of 6, a convolution of 4; MLPs of 20; chunk_size 4 so transformers' scan runs chunks.
  The layers as hybrid_override_pattern, which every release reads: a layers_block_type list of one release's
  names is refused by the others' validate_layer_type (5.3 to 5.12: "mamba", "attention"; 5.13 on:
  "linear_attention", "full_attention")."""
  kw = dict(vocab_size=50, hidden_size=24, hybrid_override_pattern=PATTERN, num_attention_heads=3,
            num_key_value_heads=1, head_dim=8, intermediate_size=20, mamba_num_heads=4, mamba_head_dim=5,
            ssm_state_size=6, n_groups=2, conv_kernel=4, chunk_size=4, max_position_embeddings=64, tie_word_embeddings=False,
            eos_token_id=None)  # transformers' generate would stop at NemotronH's eos 2, attn's runs on
  return transformers.NemotronHConfig(**{**kw, **changes})


def skip_the_scan_of_5_3_to_5_14():
  """Skips a full-pass comparison against a transformers whose NemotronH scan is wrong past its first chunk:
  NemotronHMamba2Mixer.torch_forward of 5.3 to 5.14 passes the states between chunks as
  `(decay_chunk[..., None, None] * states_permuted[:, :, None, ...]).sum(dim=2)`, a sum over the receiving
  chunk in place of the sending one (Mamba2Mixer's sums the sender), fixed in 5.15. Its
  logits then hang on chunk_size (13 tokens: 2.7e-3 of the largest at 4 against 128, in float64 too), and attn
  equals its single-chunk pass (4e-7). Greedy decoding, the counts and the round trips are unaffected."""
  version = tuple(int(p) for p in transformers.__version__.split(".")[:2])
  if version < (5, 15):
    pytest.skip(f"NemotronH's full pass against transformers {transformers.__version__}: 5.3 to 5.14 sum the "
                "Mamba scan's inter-chunk states over the wrong chunk (fixed in 5.15)")


def skip_without_a_cache_for_mlp_layers(config):
  """Skips a comparison with transformers' generate where its DynamicCache cannot hold NemotronH's MLP layers: 5.14's
  DYNAMIC_LAYER_TYPE_MAPPING (cache_utils) has 'moe' but no 'mlp' (5.15 adds it), so DynamicCache(config=...)
  raises KeyError: 'mlp' inside generate. Found by building that cache, not by the version."""
  try:
    transformers.DynamicCache(config=config)
  except KeyError as e:
    pytest.skip(f"transformers {transformers.__version__}'s DynamicCache has no layer for NemotronH's {e} layers "
                "(cache_utils' DYNAMIC_LAYER_TYPE_MAPPING of 5.14): its generate raises")


def build(config, seed=0):
  torch.manual_seed(seed)
  model = transformers.NemotronHForCausalLM(config).eval()
  with torch.no_grad():  # norms, D and dt_bias start at 1 and conv biases at 0: move them so they are read
    for name, p in model.named_parameters():
      if name.endswith(("norm.weight", "norm_f.weight", ".D", "dt_bias")):
        p.normal_(1.0, 0.2)
      elif name.endswith("conv1d.bias"):
        p.normal_(0.0, 0.2)
  return model


@pytest.fixture(scope="module")
def live():
  return build(tiny())


def test_cached_greedy_decoding_equals_transformers(live):
  """The fast test: Mamba states and KV caches through MLP-only blocks, six tokens."""
  skip_without_a_cache_for_mlp_layers(live.config)
  loaded = hf.from_hf(live)
  assert loaded.family == "nemotron_h"
  cfg = loaded.config
  assert cfg.block_kinds == ("attention", "mlp", "attention", "mlp", "attention")
  assert [None if b.attn is None else b.attn.variant for b in loaded.model.blocks] == [
      "mamba2", None, "per_head", None, "mamba2"]
  prompt = np.random.default_rng(1).integers(0, 50, (1, 5))
  with torch.no_grad():
    want = live.generate(torch.tensor(prompt), max_new_tokens=6, do_sample=False).numpy()
  got = np.asarray(generate(loaded.model, jnp.asarray(prompt), 6))
  np.testing.assert_array_equal(got, want)


@pytest.mark.slow
def test_logits_equal_transformers_under_right_padding(live):
  skip_the_scan_of_5_3_to_5_14()
  loaded = hf.from_hf(live)
  assert_logits_equal_under_right_padding(live, loaded)


@pytest.mark.slow
@pytest.mark.parametrize("changes", [
    dict(),
    dict(hybrid_override_pattern="*MM-", num_attention_heads=2,
         num_key_value_heads=2, head_dim=6, mamba_num_heads=3, mamba_head_dim=7, ssm_state_size=4, n_groups=1,
         conv_kernel=3, mlp_bias=True, tie_word_embeddings=True),  # never tied by transformers: read apart
])
def test_cached_greedy_decoding_over_many_tokens_and_sizes(changes):
  model = build(tiny(**changes), seed=5)
  skip_without_a_cache_for_mlp_layers(model.config)
  loaded = hf.from_hf(model)
  prompt = np.random.default_rng(4).integers(0, 50, (2, 4))
  assert_greedy_decoding_equal(model, loaded, prompt, 30)


def test_to_hf_and_back_is_exact(live):
  out = assert_to_hf_and_back_exact(live, "NemotronHForCausalLM", logits=False)
  assert out.config.hybrid_override_pattern == PATTERN


def test_count_hf_equals_transformers_parameters(live, tmp_path, capsys):
  live.save_pretrained(tmp_path / "ckpt")
  code = cli.main(["count", "--hf", str(tmp_path / "ckpt"), "--format", "json", "--dtype", "bfloat16"])
  out = capsys.readouterr()
  assert code == 0, out.err
  report = json.loads(out.out)
  assert report["total"] == sum(p.numel() for p in live.parameters())
  from_dir = hf.from_hf(str(tmp_path / "ckpt"))  # save_pretrained names the body backbone.*, as the releases do
  for a, b in zip(jax.tree.leaves(nnx_state(from_dir.model)), jax.tree.leaves(nnx_state(hf.from_hf(live).model)),
                  strict=True):
    np.testing.assert_array_equal(a, b)
  rows = {r["type"]: r for r in report["layer_types"]}
  assert rows["linear_attention"]["layers"] == 2 and rows["full_attention"]["layers"] == 1  # MLP blocks: none
  # H·K·V float32 + (W − 1)·(HV + 2GK) numbers per sequence, 4 bytes each, per Mamba layer
  assert rows["linear_attention"]["state_bytes_per_layer"] == 4 * (4 * 6 * 5 + 3 * (4 * 5 + 2 * 2 * 6))
  assert rows["full_attention"]["kv_bytes_per_token_per_layer"] == 2 * 1 * 2 * 8  # bf16 k and v, G=1, K=8


def test_the_old_pattern_reads_as_the_list():
  config = {k: v for k, v in tiny().to_dict().items() if k not in ("layers_block_type", "layer_types")}
  cfg = hf.model_config({**config, "hybrid_override_pattern": "M-*-M"})
  assert cfg.block_kinds == ("attention", "mlp", "attention", "mlp", "attention")
  assert cfg.layer_types == ("linear_attention", "full_attention", "full_attention", "full_attention",
                             "linear_attention")
  legacy = hf.model_config({**config, "layers_block_type": ["mamba", "mlp", "attention", "mlp", "mamba"]})
  assert (legacy.block_kinds, legacy.layer_types) == (cfg.block_kinds, cfg.layer_types)


@pytest.mark.parametrize("changes, field", [
    (dict(layers_block_type=["linear_attention", "moe", "full_attention"]), r"config.layers_block_type\[1\]"),
    (dict(num_nextn_predict_layers=1), "config.num_nextn_predict_layers"),
    (dict(attention_bias=True), "config.attention_bias"),
    (dict(use_bias=True), "config.use_bias"),
    (dict(use_conv_bias=False), "config.use_conv_bias"),
    (dict(mamba_hidden_act="gelu"), "config.mamba_hidden_act"),
    (dict(layer_norm_epsilon=1e-6), "config.layer_norm_epsilon"),
    (dict(sliding_window=4), "config.sliding_window"),
])
def test_what_attn_does_not_run_is_refused_before_any_weight(changes, field):
  config = {**tiny().to_dict(), **changes}
  with pytest.raises(ConfigError, match=f"{field}=.* is not allowed"):
    hf.model_config(config)


def test_another_epsilon_is_read_without_mamba_layers():
  """layer_norm_epsilon only binds where the mamba2 gated norm reads it."""
  config = {**tiny().to_dict(), "layers_block_type": ["full_attention", "mlp"], "layer_norm_epsilon": 1e-6}
  cfg = hf.model_config(config)
  assert cfg.norm_eps == 1e-6 and cfg.linear_head is None


@pytest.mark.slow
def test_the_family_kit_passes():
  skip_the_scan_of_5_3_to_5_14()
  from attn.testing import check_family
  measured = check_family("nemotron_h", tiny().to_dict())
  assert measured["logits_relative"] is not None and measured["logits_relative"] < 1e-4


@pytest.mark.slow
def test_another_variant_converts_the_attention_layers_only_and_writes_back(live):
  """variant= converts the attention layers (exactly, to fused); Mamba and MLP blocks are kept as they are.
  The model to_hf builds has transformers' default chunk_size (128, not the live model's 4)."""
  skip_the_scan_of_5_3_to_5_14()
  loaded = hf.from_hf(live, variant="fused")
  assert [None if b.attn is None else b.attn.variant for b in loaded.model.blocks] == [
      "mamba2", None, "fused", None, "mamba2"]
  assert max(loaded.errors) == 0.0
  out = hf.to_hf(loaded)
  tok = torch.tensor(np.random.default_rng(6).integers(0, 50, (1, 7)))
  with torch.no_grad():
    got, want = out(tok).logits.numpy(), live(tok).logits.numpy()
  np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max())
