"""Issue 51's pooled-selection family Qwen4-Exp (qwen4_exp) refused by name (GLM-5.3-Flash, glm5_next, is read:
tests/test_hf_glm5_next.py):
from_hf and `attn count --hf` say what each needs that attn does not run yet (attn.nn.hf.load.REFUSED),
for the image-text wrappers and their text models alike, before any weight is read.

The default tier reads config.json files written here; the slow tier loads the directories transformers'
own save_pretrained writes for tiny random models (2-3 layers, nothing downloaded), and skips by name where
the installed transformers (the floor, 4.51.1) lacks the model type.
"""

import json
import os
import re

import pytest

from attn import cli
from attn.config import ConfigError
from attn.nn import hf

os.environ["HF_HUB_OFFLINE"] = "1"

# What each refusal must name: the config keys of the pieces attn lacks.
QWEN4_EXP = r"is refused, Qwen4-Exp.*gated residuals \(hc_lowrank.*QSA indexer computed from x \(index_qk_proj.*" \
            r"ple_layer_ids"
WANT = {"qwen4_exp": QWEN4_EXP, "qwen4_exp_text": QWEN4_EXP}


def _count(capsys, path):
  code = cli.main(["count", "--hf", str(path)])
  return code, capsys.readouterr().err


@pytest.mark.parametrize("kind", sorted(WANT))
def test_refused_by_name_from_the_config(kind, tmp_path, capsys):
  """from a config dict, and `attn count --hf` on a directory holding only config.json (exit 2, no
  near-name guess: a refused type is no typo)."""
  with pytest.raises(ConfigError, match=rf"config.model_type='{kind}'.*{WANT[kind]}") as e:
    hf.model_config({"model_type": kind, "num_hidden_layers": 2})
  assert "did you mean" not in str(e.value)
  (tmp_path / "config.json").write_text(json.dumps({"model_type": kind, "num_hidden_layers": 2}))
  code, err = _count(capsys, tmp_path)
  assert code == 2 and "--hf: config.model_type" in err
  assert re.search(WANT[kind], err), err


# Tiny random models as transformers builds them: the text models' pieces the refusals name are all present
# (gated-delta and QSA layers), the wrapper with a one-block vision tower. The QSA layers as the released checkpoint
# names them, "full_attention": each release maps it to its own name (5.16 qwen_sparse_attention, 5.25
# indexed_attention) and its validate_architecture refuses the other's.
QWEN_TEXT = {"vocab_size": 53, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 8, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
             "linear_num_key_heads": 2, "linear_num_value_heads": 4, "moe_intermediate_size": 12,
             "shared_expert_intermediate_size": 12, "num_experts": 4, "num_experts_per_tok": 2, "hc_count": 2,
             "hc_lowrank": 8, "layer_types": ["linear_attention", "full_attention"], "indexer_n_heads": 2,
             "indexer_kv_heads": 1, "indexer_head_dim": 8, "indexer_budget": 4, "indexer_compress_ratio": 2,
             "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}}
VISION = {"depth": 1, "hidden_size": 16, "num_heads": 2, "intermediate_size": 16, "out_hidden_size": 32,
          "patch_size": 4}


def _saved(tmp_path, module: str, build):
  """The directory save_pretrained writes for build(transformers module); skipped by name without it."""
  torch = pytest.importorskip("torch")
  mod = pytest.importorskip(f"transformers.models.{module}.modeling_{module}",
                            reason=f"transformers {module} (added in 5.x; absent on the floor)")
  cfg = pytest.importorskip(f"transformers.models.{module}.configuration_{module}")
  torch.manual_seed(0)
  model = build(mod, cfg)
  path = tmp_path / module
  model.save_pretrained(str(path))
  return path


CASES = {
    "qwen4_exp_text": ("qwen4_exp", lambda m, c: m.Qwen4ExpForCausalLM(c.Qwen4ExpTextConfig(**QWEN_TEXT))),
    "qwen4_exp": ("qwen4_exp", lambda m, c: m.Qwen4ExpForConditionalGeneration(c.Qwen4ExpConfig(
        text_config=QWEN_TEXT, vision_config=VISION | {"num_position_embeddings": 16}))),
}


# The tensors each refusal rests on, as save_pretrained writes them (under the text model's prefix): Qwen4-Exp's
# index_qk_proj and gated-residual mixers, and no final norm (the mixer closes the stack).
_QWEN = (("layers.1.self_attn.indexer.index_qk_proj.weight",
          "layers.0.attn_hyper_connection.input_mix_weight_up.weight",
          "layers.0.attn_hyper_connection.block_inject_weight.weight",
          "hyper_connection_mixer.input_mix_weight_down.weight"), ("norm.", "layers.0.self_attn"))
PINNED = {"qwen4_exp_text": _QWEN, "qwen4_exp": _QWEN}


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(CASES))
def test_refused_from_what_save_pretrained_writes(kind, tmp_path, capsys):
  """from_hf and `attn count --hf` on transformers' own save_pretrained directory: the refusal by name,
  before any weight is read (the weights are there and well formed: only the config decides)."""
  module, build = CASES[kind]
  path = _saved(tmp_path, module, build)
  assert json.loads((path / "config.json").read_text())["model_type"] == kind
  names = set(hf.read_shapes(str(path)))
  at = "model.language_model." if kind == "qwen4_exp" else "model."
  for name in PINNED[kind][0]:  # what the refusal says the checkpoint holds, and does not
    assert at + name in names, (name, sorted(names)[:12])
  for part in PINNED[kind][1]:
    assert not any(n.startswith(at + part) for n in names), part
  with pytest.raises(ConfigError, match=WANT[kind]):
    hf.from_hf(str(path))
  code, err = _count(capsys, path)
  assert code == 2 and re.search(WANT[kind], err), err
