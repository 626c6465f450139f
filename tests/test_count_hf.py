"""`attn count --hf DIR`: a checkpoint's config counted by component, equal to transformers' own count."""

import json

import pytest

from attn import cli

# A tiny Llama config.json, counted by hand below (no transformers needed).
LLAMA = {"model_type": "llama", "vocab_size": 97, "hidden_size": 64, "intermediate_size": 96,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
         "tie_word_embeddings": False}


def run_cli(capsys, *argv):
  code = cli.main(["count", *argv])
  out = capsys.readouterr()
  return code, out.out, out.err


def write(tmp_path, hf, name="ckpt"):
  d = tmp_path / name
  d.mkdir()
  (d / "config.json").write_text(json.dumps(hf))
  return d


def test_config_only_directory_counts_by_hand(tmp_path, capsys):
  code, out, err = run_cli(capsys, "--hf", str(write(tmp_path, LLAMA)), "--format", "json", "--seq-len", "40",
                           "--dtype", "bfloat16")
  assert code == 0, err
  r = json.loads(out)
  D, H, G, K, F, V, L = 64, 4, 2, 16, 96, 97, 4
  attention = D * H * K + 2 * D * G * K + H * K * D
  assert r["breakdown"]["attention (full_attention)"] == L * attention
  assert r["breakdown"]["mlp"] == L * 3 * D * F
  assert r["total"] == L * (attention + 3 * D * F + 2 * D) + D + 2 * V * D == 135_872
  assert r["active_per_token"] == r["total"]
  (row,) = r["layer_types"]
  assert row["kv_bytes_per_token_per_layer"] == 2 * G * K * 2  # keys and values, bf16
  assert r["kv_bytes_at"]["40"] == L * 40 * 2 * G * K * 2
  # 8,192 and 131,072 are past the config's max_position_embeddings = 256: its context instead, and a note
  assert list(r["kv_bytes_at"]) == ["40", "256"] and r["kv_bytes_at"]["256"] == L * 256 * 2 * G * K * 2
  assert r["notes"][-1] == ("KV cache at 8,192 and 131,072 tokens left out: past the model's context of 256 "
                            "(max_position_embeddings); shown at 256")
  code, out, err = run_cli(capsys, "--hf", str(write(tmp_path, LLAMA | {"max_position_embeddings": 131072}, "long")),
                           "--format", "json", "--seq-len", "40", "--dtype", "bfloat16")
  r = json.loads(out)
  assert list(r["kv_bytes_at"]) == ["8192", "131072", "40"] and r["notes"] == []
  assert r["kv_bytes_at"]["131072"] == L * 131072 * 2 * G * K * 2


def test_windows_and_longrope_count_as_stored(tmp_path, capsys):
  """Alternating windows cache min(L, window); a longrope config is counted and the note says why."""
  hf = LLAMA | {"model_type": "phi3", "partial_rotary_factor": 0.5, "pad_token_id": 0, "sliding_window": None,
                "rope_scaling": {"type": "longrope", "long_factor": [1.0] * 4, "short_factor": [1.0] * 4},
                "original_max_position_embeddings": 128}
  code, out, err = run_cli(capsys, "--hf", str(write(tmp_path, hf)), "--format", "json")
  assert code == 0, err
  r = json.loads(out)
  assert "longrope" in r["notes"][0] and r["total"] == 135_872
  code, out, err = run_cli(capsys, "--hf", str(write(tmp_path, LLAMA | {"model_type": "gpt_oss",
      "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 32, "swiglu_limit": 7.0,
      "attention_bias": True, "layer_types": ["sliding_attention", "full_attention"] * 2}, "oss")),
      "--format", "json", "--dtype", "bfloat16")
  assert code == 0, err
  r = json.loads(out)
  sliding, full = r["layer_types"]
  assert (sliding["type"], full["type"]) == ("sliding_attention", "full_attention")
  assert sliding["kv_bytes_at"]["256"] == 2 * 32 * 2 * 2 * 16 * 2  # at the context, 256: the window's 32 cached
  assert full["kv_bytes_at"]["256"] == 2 * 256 * 2 * 2 * 16 * 2
  expert = 3 * 64 * 96 + 2 * 96 + 64
  assert r["total"] - r["active_per_token"] == 4 * 2 * expert  # 2 of 4 experts idle in each of 4 layers


@pytest.mark.parametrize("case", ["missing", "no_config", "file", "model_type", "stored_typo"])
def test_bad_hf_exits_2_naming_the_flag(tmp_path, capsys, case):
  target = {"missing": str(tmp_path / "nope"), "stored_typo": "llama-3.1-8x"}.get(case)
  if case == "no_config":
    (tmp_path / "empty").mkdir()
    target = str(tmp_path / "empty")
  elif case == "file":
    target = str(write(tmp_path, LLAMA) / "config.json")
  elif case == "model_type":
    target = str(write(tmp_path, LLAMA | {"model_type": "mixtral"}))
  code, out, err = run_cli(capsys, "--hf", target)
  assert code == 2 and out == "" and "Traceback" not in err
  assert "--hf" in err and (repr(target) in err or "mixtral" in err)
  assert ("one of" in err) if case == "model_type" else "config.json" in err


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "gemma3_text", "gpt_oss", "phi3", "smollm3"])
def test_total_equals_transformers_parameter_count(tmp_path, capsys, family):
  pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  since = {"gpt_oss": ("GptOssConfig", "4.55"), "smollm3": ("SmolLM3Config", "4.53")}
  if family in since and not hasattr(transformers, since[family][0]):
    pytest.skip(f"{family} needs transformers >= {since[family][1]} (this is {transformers.__version__})")
  common = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0)
  config = {"llama": lambda: transformers.LlamaConfig(**common, head_dim=24, attention_bias=True),
            "gemma3_text": lambda: transformers.Gemma3TextConfig(**common, head_dim=24, sliding_window=32),
            "gpt_oss": lambda: transformers.GptOssConfig(**common, head_dim=16, num_local_experts=4,
                                                         num_experts_per_tok=2, sliding_window=32),
            "phi3": lambda: transformers.Phi3Config(**common, partial_rotary_factor=0.5),
            "smollm3": lambda: transformers.SmolLM3Config(**common)}[family]()
  model = transformers.AutoModelForCausalLM.from_config(config)
  model.save_pretrained(tmp_path / family)
  code, out, err = run_cli(capsys, "--hf", str(tmp_path / family), "--format", "json")
  assert code == 0, err
  assert json.loads(out)["total"] == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name, published", [("gemma-3-1b", 999_885_952), ("llama-3.1-8b", 8_030_261_248)])
def test_stored_published_configs_count_to_the_published_total(capsys, name, published):
  """keras-hub's gemma3_1b "params" and the Llama 3.1 8B checkpoint's safetensors total, to the parameter."""
  code, out, err = run_cli(capsys, "--hf", name, "--format", "json")
  assert code == 0, err
  assert json.loads(out)["total"] == published
