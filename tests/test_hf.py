"""Hugging Face interop: GPT-2 and BERT in (from_hf), GPT-2 out (to_hf), `attn eval`, `attn analyze --hf`.

The fast tier reads a GPT-2 directory written with safetensors' numpy API and
checks it against a float64 numpy GPT-2 written here, plus every refusal. The
slow tier compares against transformers' own models (tiny, random, built here;
nothing is downloaded: HF_HUB_OFFLINE=1) and runs the commands end to end.
"""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from flax import nnx

from attn import cli
from attn.config import ConfigError
from attn.nn import hf, interop

os.environ["HF_HUB_OFFLINE"] = "1"
TOL = 1e-4  # the parity bar, float32
# Awkward sizes: 3 heads of width 4, d_ff not 4·D, odd lengths; weights large enough that errors show.
GPT2 = dict(vocab_size=29, n_positions=16, n_embd=12, n_layer=2, n_head=3, n_inner=20)
BERT = dict(vocab_size=31, hidden_size=12, num_hidden_layers=2, num_attention_heads=3, intermediate_size=20,
            max_position_embeddings=16, type_vocab_size=2)


def _tokens(seed, vocab, B=3, T=9):
  """Random ids and right-padding lengths [T, a middle one, 1]: HF's attention_mask is ones then zeros."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, vocab, (B, T))
  lengths = np.array([T, int(rng.integers(2, T)), 1])[:B]
  return ids, lengths, (np.arange(T) < lengths[:, None]).astype(np.int64)


# ---- fast: a safetensors directory against a numpy GPT-2.

def _np_gpt2_weights(seed, c, prefix="transformer."):
  rng = np.random.default_rng(seed)
  D, F, L = c["n_embd"], c["n_inner"], c["n_layer"]
  r = lambda *s: (0.4 * rng.standard_normal(s)).astype(np.float32)
  w = {"wte.weight": r(c["vocab_size"], D), "wpe.weight": r(c["n_positions"], D),
       "ln_f.weight": 1 + r(D), "ln_f.bias": r(D)}
  for l in range(L):
    p = f"h.{l}."
    w |= {p + "ln_1.weight": 1 + r(D), p + "ln_1.bias": r(D), p + "ln_2.weight": 1 + r(D), p + "ln_2.bias": r(D),
          p + "attn.c_attn.weight": r(D, 3 * D), p + "attn.c_attn.bias": r(3 * D),
          p + "attn.c_proj.weight": r(D, D), p + "attn.c_proj.bias": r(D),
          p + "mlp.c_fc.weight": r(D, F), p + "mlp.c_fc.bias": r(F), p + "mlp.c_proj.weight": r(F, D),
          p + "mlp.c_proj.bias": r(D), p + "attn.bias": np.tril(np.ones((16, 16), np.float32))}  # a mask buffer
  return {prefix + k: v for k, v in w.items()}


def _np_gpt2_logits(w, c, ids, lengths):
  """GPT-2 in float64 numpy: pre-norm blocks, tanh gelu, causal and key-padding masks, tied output."""
  w = {k.removeprefix("transformer."): v.astype(np.float64) for k, v in w.items()}
  H, eps = c["n_head"], 1e-5

  def ln(x, n):
    x = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + eps)
    return x * w[n + ".weight"] + w[n + ".bias"]

  gelu = lambda x: 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))
  B, T = ids.shape
  x = w["wte.weight"][ids] + w["wpe.weight"][:T]
  allowed = np.tril(np.ones((T, T), bool))[None, None] & (np.arange(T) < lengths[:, None])[:, None, None, :]
  for l in range(c["n_layer"]):
    p = f"h.{l}."
    h = ln(x, p + "ln_1") @ w[p + "attn.c_attn.weight"] + w[p + "attn.c_attn.bias"]
    q, k, v = (a.reshape(B, T, H, -1) for a in np.split(h, 3, axis=-1))
    s = np.einsum("BTHK,BSHK->BHTS", q, k) / np.sqrt(q.shape[-1])
    s = np.where(allowed, s, -np.inf)
    prob = np.exp(s - s.max(-1, keepdims=True))
    prob /= prob.sum(-1, keepdims=True)
    o = np.einsum("BHTS,BSHK->BTHK", prob, v).reshape(B, T, -1)
    x = x + o @ w[p + "attn.c_proj.weight"] + w[p + "attn.c_proj.bias"]
    h = gelu(ln(x, p + "ln_2") @ w[p + "mlp.c_fc.weight"] + w[p + "mlp.c_fc.bias"])
    x = x + h @ w[p + "mlp.c_proj.weight"] + w[p + "mlp.c_proj.bias"]
  return ln(x, "ln_f") @ w["wte.weight"].T


def _write_dir(path, config, weights):
  """config.json, and model.safetensors written with safetensors' numpy API unless weights is None."""
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config, f)
  if weights is not None:
    save_file = pytest.importorskip("safetensors.numpy").save_file
    save_file(weights, os.path.join(path, "model.safetensors"))
  return str(path)


def test_gpt2_directory_matches_numpy_gpt2(tmp_path):
  pytest.importorskip("safetensors")
  c = GPT2 | {"model_type": "gpt2"}
  w = _np_gpt2_weights(0, c)
  model, cfg = interop.from_hf(_write_dir(tmp_path / "gpt2", c, w))
  assert (cfg.num_heads, cfg.d_ff, cfg.norm_eps, cfg.activation) == (3, 20, 1e-5, "gelu")
  ids, lengths, _ = _tokens(1, c["vocab_size"])
  forward = nnx.jit(lambda m, ids, lengths: m(ids, lengths_B=lengths))  # one compile, not one per op
  got = np.asarray(forward(model, ids.astype(np.int32), lengths.astype(np.int32)))
  np.testing.assert_allclose(got, _np_gpt2_logits(w, c, ids, lengths), atol=TOL, rtol=0)


def test_refuses_what_is_not_a_supported_checkpoint(tmp_path):
  pytest.importorskip("safetensors")
  with pytest.raises(ConfigError, match="config.json"):
    hf.from_hf(str(tmp_path))  # a directory without config.json
  with pytest.raises(ConfigError, match="config.json"):
    hf.from_hf(str(tmp_path / "missing"))
  with pytest.raises(ConfigError, match=r"source='list'.*GPT2LMHeadModel"):
    hf.from_hf([1, 2])
  cases = [({"model_type": "falcon"}, r"config.model_type='falcon'.*\['bailing_hybrid', 'bert', 'deepseek_v3', 'deepseek_v32', 'deepseek_v4', 'gemma2', 'gemma3_text', 'gemma4_text', 'glm5_next', 'glm5_next_text', 'glm_moe_dsa', 'gpt2'"),
           ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=True"),
           ({"activation_function": "quick_gelu"}, "activation_function='quick_gelu'"),
           ({"add_cross_attention": True}, "add_cross_attention=True"),
           ({"tie_word_embeddings": False}, "tie_word_embeddings=False")]
  for i, (change, match) in enumerate(cases):
    path = _write_dir(tmp_path / f"c{i}", GPT2 | {"model_type": "gpt2"} | change, None)
    with pytest.raises(ConfigError, match=match):
      hf.from_hf(path)
  no_vocab = {k: v for k, v in GPT2.items() if k != "vocab_size"} | {"model_type": "gpt2"}
  with pytest.raises(ConfigError, match="config.vocab_size=None"):
    hf.from_hf(_write_dir(tmp_path / "no_vocab", no_vocab, None))
  bert = BERT | {"model_type": "bert", "position_embedding_type": "relative_key"}
  with pytest.raises(ConfigError, match="position_embedding_type='relative_key'"):
    hf.from_hf(_write_dir(tmp_path / "bert", bert, None))
  path = _write_dir(tmp_path / "pickle", GPT2 | {"model_type": "gpt2"}, None)
  open(os.path.join(path, "pytorch_model.bin"), "wb").close()
  with pytest.raises(ConfigError, match=r"model.safetensors.*pytorch_model.bin.*never pickle"):
    hf.from_hf(path)
  with pytest.raises(ConfigError, match=r"variant='split_input'.*per_head or one converted from it: .*merged "
                                       r"\(exact\)"):
    hf.from_hf(path, variant="split_input")  # refused before the weights are looked for
  with pytest.raises(ConfigError, match="num_kv_heads=2"):
    hf.from_hf(path, num_kv_heads=2)  # not a divisor of 3 heads
  w = _np_gpt2_weights(0, GPT2 | {"model_type": "gpt2"})
  del w["transformer.h.1.mlp.c_fc.bias"]
  with pytest.raises(ConfigError, match="h.1.mlp.c_fc.bias"):
    hf.from_hf(_write_dir(tmp_path / "short", GPT2 | {"model_type": "gpt2"}, w))
  from attn.nn.config import ModelConfig
  with pytest.raises(ConfigError, match=r"norm_eps=0.0 .*positive"):
    ModelConfig(vocab_size=5, d_model=4, num_layers=1, num_heads=1, d_ff=4, norm_eps=0.0)
  with pytest.raises(ConfigError, match=r"activation='gelu_new'.*'gelu_exact'"):
    ModelConfig(vocab_size=5, d_model=4, num_layers=1, num_heads=1, d_ff=4, activation="gelu_new")
  with pytest.raises(ConfigError, match="right padding"):
    hf.lengths_from_attention_mask([[0, 1, 1], [1, 1, 1]])
  np.testing.assert_array_equal(hf.lengths_from_attention_mask([[1, 1, 0], [1, 1, 1]]), [2, 3])


def _eval(capsys, *argv):
  code = cli.main(["eval", *argv])
  out = capsys.readouterr()
  return code, out.out, out.err


def test_eval_refuses_bad_checkpoints(tmp_path, capsys):
  text = tmp_path / "a.txt"
  text.write_text("some text " * 20)
  code, _, err = _eval(capsys, "--hf", str(tmp_path), "--text", str(text))
  assert code == 2 and "attn eval: error: source=" in err and "config.json" in err
  bert = _write_dir(tmp_path / "bert", BERT | {"model_type": "bert"}, None)
  code, _, err = _eval(capsys, "--hf", bert, "--text", str(text))
  assert code == 2 and "tokenizer.json, or vocab.json + merges.txt" in err
  gpt2 = _write_dir(tmp_path / "gpt2", GPT2 | {"model_type": "gpt2"}, None)
  code, _, err = _eval(capsys, "--hf", gpt2, "--text", str(text))
  assert code == 2 and "tokenizer.json, or vocab.json + merges.txt" in err


def test_tokenizer_from_either_file_layout(tmp_path):
  tokenizers = pytest.importorskip("tokenizers")
  from attn.experiments.data import hf_text
  text = "multi-head attention: a query, a key and a value per head; héads ≠ heads\n" * 30
  tok = tokenizers.ByteLevelBPETokenizer()
  tok.train_from_iterator([text], vocab_size=300, min_frequency=2, show_progress=False)
  (tmp_path / "single").mkdir()
  (tmp_path / "pair").mkdir()
  tok.save(str(tmp_path / "single" / "tokenizer.json"))
  tok.save_model(str(tmp_path / "pair"))  # GPT-2's vocab.json + merges.txt
  want = tok.encode(text).ids
  for layout in ("single", "pair"):
    assert hf_text.load_tokenizer(str(tmp_path / layout)).encode(text).ids == want, layout


# ---- slow: against transformers' own GPT-2 and BERT.

def _transformers():
  pytest.importorskip("torch")
  return pytest.importorskip("transformers")


def _randomize(torch, m, seed):
  """Every parameter redrawn (biases and LayerNorms too), so that no term hides behind an init of 0 or 1."""
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in m.named_parameters():
      norm_scale = name.endswith("LayerNorm.weight") or ".ln_" in name and name.endswith(".weight")
      p.copy_(0.3 * torch.randn(p.shape, generator=g) + (1.0 if norm_scale else 0.0))
  return m.eval()


def _gpt2(seed=0, **changes):
  transformers = _transformers()
  import torch
  cfg = transformers.GPT2Config(**(GPT2 | changes), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
  return _randomize(torch, transformers.GPT2LMHeadModel(cfg), seed)


def _hf_logits(m, ids, mask):
  import torch
  with torch.no_grad():
    return m(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).logits.numpy()


def _max_diff(a, b):
  return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


@pytest.mark.slow
@pytest.mark.parametrize("activation", ["gelu_new", "gelu"])
def test_gpt2_logits_match_transformers(tmp_path, activation):
  m = _gpt2(1, activation_function=activation)
  ids, lengths, mask = _tokens(2, GPT2["vocab_size"])
  ref = _hf_logits(m, ids, mask)
  m.save_pretrained(tmp_path)
  for source in (m, str(tmp_path)):
    model, cfg = interop.from_hf(source)
    got = model(ids.astype(np.int32), lengths_B=lengths.astype(np.int32))
    print(f"GPT-2 ({activation}) logits from {type(source).__name__}: max abs diff {_max_diff(got, ref):.2e}")
    assert _max_diff(got, ref) < TOL  # every position, padded ones included
    assert cfg.activation == {"gelu_new": "gelu", "gelu": "gelu_exact"}[activation]


@pytest.mark.slow
@pytest.mark.parametrize("pooler", [True, False])
def test_bert_hidden_and_pooled_match_transformers(tmp_path, pooler):
  transformers = _transformers()
  import torch
  cfg = transformers.BertConfig(**BERT, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
  m = _randomize(torch, transformers.BertModel(cfg, add_pooling_layer=pooler), 3)
  ids, lengths, mask = _tokens(4, BERT["vocab_size"])
  types = np.random.default_rng(5).integers(0, 2, ids.shape)
  with torch.no_grad():
    out = m(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), token_type_ids=torch.from_numpy(types))
  m.save_pretrained(tmp_path)
  for source in (m, str(tmp_path)):
    model, mcfg = interop.from_hf(source)
    assert (mcfg.norm_eps, mcfg.activation, mcfg.norm, mcfg.pooler) == (1e-12, "gelu_exact", "post", pooler)
    got = model(ids.astype(np.int32), types.astype(np.int32), lengths.astype(np.int32))
    hidden = got[0] if pooler else got
    print(f"BERT from {type(source).__name__}: hidden max abs diff {_max_diff(hidden, out.last_hidden_state):.2e}"
          + (f", pooled {_max_diff(got[1], out.pooler_output):.2e}" if pooler else ""))
    assert _max_diff(hidden, out.last_hidden_state) < TOL
    if pooler:
      assert _max_diff(got[1], out.pooler_output) < TOL


@pytest.mark.slow
def test_variants_and_kv_heads_on_load():
  m = _gpt2(6)
  ids, lengths, mask = _tokens(7, GPT2["vocab_size"])
  ref = _hf_logits(m, ids, mask)
  for variant in ("fused", "merged", "collaborative"):  # exact conversions: the same logits
    model, cfg = interop.from_hf(m, variant=variant)
    assert cfg.variant == variant
    assert _max_diff(model(ids.astype(np.int32), lengths_B=lengths.astype(np.int32)), ref) < TOL, variant
  model, cfg = loaded = interop.from_hf(m, num_kv_heads=3)  # G = H: nothing pooled
  assert loaded.error == 0.0 and _max_diff(model(ids.astype(np.int32), lengths_B=lengths.astype(np.int32)), ref) < TOL
  want = max(_kv_error_of(m, 1))
  with pytest.warns(UserWarning, match="lossy"):
    model, cfg = loaded = interop.from_hf(m, num_kv_heads=1)
  assert cfg.head.num_kv_heads == 1 and abs(loaded.error - want) < 1e-5 * want
  w_k = np.asarray(model.blocks[0].attn.params["w_k"][...])
  np.testing.assert_allclose(w_k[:, 0], m.transformer.h[0].attn.c_attn.weight.detach().numpy()[:, 12:24]
                             .reshape(12, 3, 4).mean(1), atol=1e-6)
  with pytest.warns(UserWarning, match="lossy"):
    loaded = interop.from_hf(m, variant="merged", num_kv_heads=1)
  assert loaded.config.variant == "merged" and abs(loaded.error - want) < 1e-5 * want


@pytest.mark.slow
def test_to_hf_logits_and_exact_round_trip():
  _transformers()
  import jax
  from flax import nnx
  from attn.nn import DecoderLM
  from attn.nn.config import ModelConfig
  for variant, activation in (("per_head", "gelu"), ("fused", "gelu_exact")):
    cfg = ModelConfig(vocab_size=23, d_model=12, num_layers=2, num_heads=3, d_ff=20, variant=variant,
                      max_len=16, activation=activation, norm_eps=1e-6, embed_init_std=0.5)
    model = DecoderLM(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(8)  # biases and LayerNorms away from 0 and 1
    nnx.update(model, jax.tree.map(lambda a: a + 0.3 * rng.standard_normal(a.shape).astype(a.dtype),
                                   nnx.state(model)))
    m = interop.to_hf(model, cfg)
    ids, lengths, mask = _tokens(9, cfg.vocab_size)
    ours = model(ids.astype(np.int32), lengths_B=lengths.astype(np.int32))
    print(f"to_hf ({variant}, {activation}): logits max abs diff {_max_diff(ours, _hf_logits(m, ids, mask)):.2e}")
    assert _max_diff(ours, _hf_logits(m, ids, mask)) < TOL
    back, back_cfg = interop.from_hf(m, variant=variant)
    assert back_cfg == cfg.replace(embed_init_std=back_cfg.embed_init_std)
    leaves = lambda m: dict(jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(m)))[0])
    sent, returned = leaves(model), leaves(back)
    assert sent.keys() == returned.keys()
    for k in sent:
      assert np.array_equal(np.asarray(sent[k]), np.asarray(returned[k])), k  # exact, not close
  with pytest.raises(ConfigError, match="norm='post'"):
    interop.to_hf(model, cfg.replace(norm="post"))
  with pytest.raises(ConfigError, match=r"d_k, d_v=\(5, 4\)"):
    interop.to_hf(model, cfg.replace(d_k=5))


def _tiny_checkpoint(root, seed=10):
  """A tiny GPT-2 saved with save_pretrained and a byte-level BPE trained here on two text files."""
  _transformers()
  tokenizers = pytest.importorskip("tokenizers")
  texts = root / "texts"
  texts.mkdir()
  rng = np.random.default_rng(seed)
  words = ["head", "query", "key", "value", "softmax", "matrix", "rank", "the", "of", "attention"]
  for name in ("a.txt", "b.txt"):
    (texts / name).write_text("\n".join(" ".join(rng.choice(words, 9)) for _ in range(40)))
  tok = tokenizers.ByteLevelBPETokenizer()
  tok.train_from_iterator([(texts / n).read_text() for n in ("a.txt", "b.txt")], vocab_size=280,
                          min_frequency=2, show_progress=False)
  m = _gpt2(seed, vocab_size=tok.get_vocab_size(), n_positions=32, n_head=4, n_embd=16)
  m.save_pretrained(root / "gpt2")
  tok.save(str(root / "gpt2" / "tokenizer.json"))
  return m, tok, str(root / "gpt2"), str(texts)


def _hf_loss(m, ids_per_doc, seq_len):
  """Mean next-token NLL of the HF model over windows of seq_len + 1 tokens overlapping by one."""
  import torch
  total = count = 0.0
  for ids in ids_per_doc:
    for start in range(0, len(ids) - 1, seq_len):
      chunk = torch.tensor(ids[start:start + seq_len + 1])[None]
      with torch.no_grad():
        logp = torch.log_softmax(m(chunk[:, :-1]).logits.double(), -1)
      total -= float(logp[0].gather(-1, chunk[0, 1:, None]).sum())
      count += chunk.shape[1] - 1
  return total / count


@pytest.mark.slow
def test_eval_end_to_end(tmp_path, capsys):
  from attn.experiments.data import corpus
  m, tok, ckpt, texts = _tiny_checkpoint(tmp_path)
  code, out, err = _eval(capsys, "--hf", ckpt, "--text", texts, "--num-kv-heads", "2", "--seq-len", "24",
                         "--max-tokens", "100000")
  assert code == 0, err
  rows = {r[0]: r for r in (line.strip("|").split("|") for line in out.splitlines() if line.startswith("| "))}
  rows = {k.strip(): [c.strip() for c in v] for k, v in rows.items()}
  held = corpus.load(texts, "**/*").heldout.tobytes().split(b"\0")
  ids = [tok.encode(d.decode()).ids for d in held if d]
  want = _hf_loss(m, ids, 24)
  print(out)
  assert abs(float(rows["original"][4]) - want) < 1e-4
  assert float(rows["original"][5]) == pytest.approx(math.exp(want), rel=1e-3)
  assert abs(float(rows["converted"][3]) - max(_kv_error_of(m, 2))) < 1e-4
  # The converted model is GPT-2 with each kv head replaced by its group's mean: build that in torch.
  import torch
  D, H = 16, 4
  with torch.no_grad():
    for block in m.transformer.h:
      for part in (block.attn.c_attn.weight, block.attn.c_attn.bias):
        kv = part[..., D:].reshape(*part.shape[:-1], 2, 2, H // 2, D // H)
        part[..., D:] = kv.mean(-2, keepdim=True).expand_as(kv).reshape(*part.shape[:-1], 2 * D)
  assert abs(float(rows["converted"][4]) - _hf_loss(m, ids, 24)) < 1e-4


def _kv_error_of(m, G):
  D, H = m.config.n_embd, m.config.n_head
  errors = []
  for block in m.transformer.h:
    w, b = block.attn.c_attn.weight.detach().numpy(), block.attn.c_attn.bias.detach().numpy()
    parts = [w[:, D:2 * D].reshape(D, G, H // G, -1), w[:, 2 * D:].reshape(D, G, H // G, -1),
             b[D:2 * D].reshape(G, H // G, -1), b[2 * D:].reshape(G, H // G, -1)]
    lost = sum(float(((a - a.mean(a.ndim - 2, keepdims=True)) ** 2).sum()) for a in parts)
    errors.append(math.sqrt(lost / sum(float((a ** 2).sum()) for a in parts)))
  return errors


@pytest.mark.slow
def test_analyze_hf_end_to_end(tmp_path, capsys):
  _, _, ckpt, texts = _tiny_checkpoint(tmp_path, seed=11)
  out_dir = tmp_path / "analysis"
  code = cli.main(["analyze", "--hf", ckpt, "--text", texts, "--out", str(out_dir), "--seq-len", "16",
                   "--batch-size", "2", "--batches", "1", "--no-plots"])
  assert code == 0, capsys.readouterr().err
  a = json.loads((out_dir / "analysis.json").read_text())
  assert (a["num_layers"], a["num_heads"], a["d_k"]) == (2, 4, 4)
  assert len(a["layers"][1]["qk"]["effective_rank"]) == 4 and math.isfinite(a["eval"]["loss"])
  assert a["pruning"]["heads_off"][0] == 0 and a["hf"] == os.path.abspath(ckpt)
  code = cli.main(["analyze", "--hf", ckpt, "--out", str(out_dir)])
  assert code == 2 and "--text=None" in capsys.readouterr().err


@pytest.mark.slow
def test_directory_load_needs_neither_torch_nor_transformers(tmp_path):
  pytest.importorskip("safetensors")
  c = GPT2 | {"model_type": "gpt2"}
  path = _write_dir(tmp_path / "gpt2", c, _np_gpt2_weights(0, c))
  code = ("import sys; from attn.nn import interop; interop.from_hf(sys.argv[1]); "
          "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; assert not bad, bad")
  subprocess.run([sys.executable, "-c", code, path], check=True, timeout=120)


def test_mla_on_load_returns_every_layers_error():
  m = _gpt2(6)  # D = 12, H = 3, K = V = 4, 2 layers
  ids, lengths, mask = _tokens(7, GPT2["vocab_size"])
  ref = _hf_logits(m, ids, mask)
  model, cfg = loaded = interop.from_hf(m, variant="mla", latent_dim=12)  # d_c = D: exact
  errors = loaded.errors
  assert cfg.variant == "mla" and cfg.head.latent_dim == 12 and len(errors) == GPT2["n_layer"]
  assert max(errors) < 1e-5
  forward = nnx.jit(lambda m, ids, lengths: m(ids, lengths_B=lengths))  # one compile, not one per op
  ids_, lengths_ = ids.astype(np.int32), lengths.astype(np.int32)
  assert _max_diff(forward(model, ids_, lengths_), ref) < TOL
  with pytest.warns(UserWarning, match="lossy"):
    model, cfg = loaded = interop.from_hf(m, variant="mla", latent_dim=4)
  errors = loaded.errors
  for layer, err in enumerate(errors):  # the truncated SVD's share of [W_K | W_V], layer by layer
    attn_w = m.transformer.h[layer].attn.c_attn.weight.detach().numpy()
    s = np.linalg.svd(attn_w[:, 12:], compute_uv=False)
    assert err == pytest.approx(np.sqrt((s[4:] ** 2).sum() / (s ** 2).sum()), rel=1e-4)
  # Out again: the latent heads go back to per_head (exactly) and the lossy model is what GPT-2 holds.
  out = _hf_logits(interop.to_hf(model, cfg), ids, mask)
  assert _max_diff(forward(model, ids_, lengths_), out) < TOL
  assert _max_diff(out, ref) > 100 * TOL  # the truncation changed the function: the comparison can fail
  with pytest.raises(ConfigError, match="latent_dim=4 is not allowed"):
    interop.from_hf(m, latent_dim=4)
