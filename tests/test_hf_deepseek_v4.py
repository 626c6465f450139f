"""DeepSeek-V4 (deepseek_v4, attn.nn.hf.deepseek_v4): tiny random models built in code with transformers' own
classes (nothing downloaded), against transformers itself: logits under right padding, cached greedy
decoding, to_hf bit for bit, `attn count --hf` against transformers' parameter count; refusals by name.

The model: 4 query heads of 16 over d_model 24 (h·d_k ≠ d_model), one shared kv head whose rotated key is
the value, a query latent of 12, RoPE on the last 8 dims of each head (interleaved, at 50 in the sliding
layer and 700 in the compressed ones), a window of 5, sinks, entries of 4 tokens (compressed sparse
attention with its overlap and an indexer of 2 heads of 10 keeping 2 entries per query, and heavily
compressed attention at a tiny rate, so that 19 tokens give several), the grouped output (2 groups of
rank 6),
3 residual streams, 4 experts (2 kept) with the sqrtsoftplus router, its correction bias and the
clamped SwiGLU; the first layer's experts are hash-routed (a random tid2eid table, repeats included).
Tests that build a transformers model skip where the installed release lacks
deepseek_v4 (CI's floor, 4.51.1).
"""

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from attn import ConfigError, cli
from attn.nn import hf
from attn.nn.config import ModelConfig
from attn.nn.hf import deepseek_v4

sys.path.insert(0, str(Path(__file__).parent))
import hf_hybrid  # noqa: E402

TOL = 1e-4  # relative to the largest logit, float32
TOTAL = 42_090  # KW's parameters: transformers' count (the slow test) and the closed form (the fast one)
SWA, HCA, CSA = "sliding_attention", "heavily_compressed_attention", "compressed_sparse_attention"
KW = dict(vocab_size=61, hidden_size=24, moe_intermediate_size=20, num_hidden_layers=3, num_attention_heads=4,
          num_key_value_heads=1, head_dim=16, q_lora_rank=12, partial_rotary_factor=0.5, num_experts_per_tok=2,
          n_routed_experts=4, n_shared_experts=1, layer_types=[SWA, CSA, HCA],
          compress_rates={CSA: 4, HCA: 4}, mlp_layer_types=["hash_moe", "moe", "moe"], hc_mult=3, hc_sinkhorn_iters=5,
          sliding_window=5, o_groups=2, o_lora_rank=6, index_n_heads=2, index_head_dim=10, index_topk=2,
          max_position_embeddings=64, rope_theta=50.0, compress_rope_theta=700.0, swiglu_limit=1.5,
          pad_token_id=None, bos_token_id=None, eos_token_id=None)


def _transformers():
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  pytest.importorskip("transformers.models.deepseek_v4", reason=f"deepseek_v4 is not in transformers "
                      f"{transformers.__version__}")
  return torch, transformers


def _unclamped_shared_expert(kw=KW) -> bool:
  """Whether the installed release's DeepseekV4MLP (the shared expert) lacks swiglu_limit (5.8 and 5.9)."""
  _, transformers = _transformers()
  from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4
  return not hasattr(v4.DeepseekV4MLP(transformers.DeepseekV4Config(**kw)), "limit")


def _model(kw=KW, seed=0):
  """A random DeepseekV4ForCausalLM, every weight and the correction bias moved off its initial value. Where the
  release's shared expert has no swiglu_limit (5.8 and 5.9: DeepseekV4MLP computes its SwiGLU unclamped, 5.10 on
  clamp it as the routed experts and attn), a limit nothing reaches: the clamp's checks are left out there."""
  torch, transformers = _transformers()
  if _unclamped_shared_expert(kw):
    kw = kw | {"swiglu_limit": 1e4}
  torch.manual_seed(seed)
  m = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**kw)).eval()
  with torch.no_grad():
    for p in m.parameters():
      p.add_(0.3 * torch.randn_like(p))
    for name, b in m.named_buffers():
      if name.endswith("e_score_correction_bias"):
        b.add_(0.1 * torch.randn_like(b))
      if name.endswith("tid2eid"):
        b.copy_(torch.randint(0, kw["n_routed_experts"], b.shape))
  return m


def test_one_layer_equals_transformers_attention():
  """The fast tier's check against transformers: one compressed sparse attention layer (its indexer
  keeping 2 of the entries) as DeepseekV4Attention computes it and as compressed_shared does with the
  weights attention_in reads (the head dims permuted; the release's names as module_name reads them), 13 causal
  tokens under the window."""
  torch, transformers = _transformers()
  import jax
  import jax.numpy as jnp
  from attn.nn.hf.base import Weights
  from attn.variants import VARIANTS
  from attn.variants.base import Options
  from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4
  config = transformers.DeepseekV4Config(**KW)
  config._attn_implementation = "eager"
  torch.manual_seed(0)
  layer = v4.DeepseekV4Attention(config, 1).eval()
  with torch.no_grad():
    for p in layer.parameters():
      p.copy_(0.5 * torch.randn_like(p))
  T = 13
  x = torch.randn(2, T, KW["hidden_size"])
  pos = torch.arange(T)[None].expand(2, -1)
  rotary = v4.DeepseekV4RotaryEmbedding(config)
  angles = {kind: rotary(x, pos, layer_type=kind) for kind in ("main", "compress")}
  q, k = torch.arange(T)[:, None], torch.arange(T)[None]
  mask = torch.zeros(2, 1, T, T).masked_fill(~((k <= q) & (q - k < KW["sliding_window"])), float("-inf"))
  with torch.no_grad():
    want = layer(x, angles, pos, mask)[0].numpy()
  cfg = hf.model_config({"model_type": "deepseek_v4", **KW})
  named = {deepseek_v4.module_name(f"a.{k}"): t.numpy() for k, t in layer.state_dict().items()}  # 5.8, 5.9: 5.10's
  params = deepseek_v4.attention_in(Weights(named), "a", cfg, 1)
  run = jax.jit(lambda p, x: VARIANTS["compressed_shared"].apply(p, x, cfg=cfg.layer_head(1),
                                                                  opts=Options(is_causal=True))[0])
  got = run({k: jnp.asarray(a) for k, a in params.items()}, jnp.asarray(x.numpy()))
  assert np.abs(np.asarray(got) - want).max() <= TOL * np.abs(want).max()


@pytest.mark.slow
def test_logits_equal_transformers_under_right_padding():
  """At every real position (transformers' compressed entries ignore the padding mask, so a padded
  query there sees entries attn's lengths hide: the padded positions differ, and nothing reads them)."""
  torch, _ = _transformers()
  import jax.numpy as jnp
  # Seed 0's instance without the clamp meets an exact tie in the indexer's top-k (ReLU's zeros) at position 15,
  # where torch and lax keep different entries (the same on 5.25 with that limit): seed 5 has none.
  m = _model(seed=5 if _unclamped_shared_expert() else 0)
  loaded = hf.from_hf(m)
  cfg = loaded.config
  assert cfg.layer_heads == {HCA: {"compress_block": 4}, CSA: {
      "compress_block": 4, "compress_overlap": True, "compress_index_heads": 2, "compress_index_dim": 10,
      "compress_index_topk": 2}} and cfg.sliding_rope_theta == 50.0
  assert cfg.rope_theta == 700.0 and cfg.rope_dim == 8 and cfg.hc_mult == 3 and cfg.moe_hash_first == 1
  ids = np.random.default_rng(1).integers(0, 61, (2, 19))
  lengths = np.array([19, 13])
  mask = (np.arange(19)[None] < lengths[:, None]).astype(np.int64)
  with torch.no_grad():
    want = m(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask)).logits.numpy()
  got = np.asarray(loaded.model(jnp.asarray(ids), lengths_B=jnp.asarray(lengths)))
  for b, n in enumerate(lengths):
    assert np.abs(got[b, :n] - want[b, :n]).max() <= TOL * np.abs(want[b, :n]).max()
  # The indexer chooses: keeping every entry (top-k 64) changes the logits where more than 2 have ended.
  config, state = hf.to_hf_state(loaded)
  every = np.asarray(hf.from_hf((config | {"index_topk": 64}, state)).model(jnp.asarray(ids)))
  assert np.abs(every[0, :11] - got[0, :11]).max() == 0 and np.abs(every[0, 12:] - got[0, 12:]).min() > 0


@pytest.mark.slow
def test_yarn_on_the_compressed_layers():
  """V4's compress RoPE with yarn (attention_factor forced to 1, as transformers' config does), the sliding
  layer's plain; 30 tokens, an indexer of 4 heads (where its top-k meets exact ties, ReLU's zeros, torch's
  topk and lax.top_k may keep different entries: docs/compressed.md; none here)."""
  torch, _ = _transformers()
  import jax.numpy as jnp
  kw = KW | dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
                 index_n_heads=4)
  m = _model(kw)
  loaded = hf.from_hf(m)
  assert (loaded.config.rope_scaling, loaded.config.rope_attention_factor) == ("yarn", 1.0)
  ids = np.random.default_rng(0).integers(0, 61, (2, 30))
  with torch.no_grad():
    want = m(input_ids=torch.as_tensor(ids)).logits.numpy()
  got = np.asarray(loaded.model(jnp.asarray(ids)))
  assert np.abs(got - want).max() <= TOL * np.abs(want).max()


@pytest.mark.slow
def test_to_hf_bit_for_bit_and_family_contract():
  """to_hf writes transformers' tensors back bit for bit (the head dims' permutation undone), and the
  family contract (attn.testing.check_family) holds."""
  _transformers()
  from attn.testing import check_family
  m = _model(seed=2)
  hf_hybrid.assert_to_hf_and_back_exact(m, "DeepseekV4ForCausalLM")
  assert check_family("deepseek_v4", m)["logits_relative"] <= TOL
  # The multi-token-prediction module is read and ignored with a note; fp8 scales are refused by name.
  config, state = hf.to_hf_state(hf.from_hf(m))
  with pytest.warns(UserWarning, match="mtp"):
    hf.from_hf((config, {**state, "mtp.0.emb.weight": np.zeros((3,), np.float32)}))
  with pytest.raises(ConfigError, match="scale"):
    hf.from_hf((config, {**state, "model.layers.0.mlp.experts.0.w1.scale": np.zeros((3,), np.float32)}))


@pytest.mark.slow
def test_cached_greedy_decoding_equals_transformers():
  """12 tokens after a prompt of 6: the window's ring, entries ending inside steps, the streams."""
  _transformers()
  m = _model(seed=3)
  prompt = np.random.default_rng(4).integers(0, 61, (2, 6))
  hf_hybrid.assert_greedy_decoding_equal(m, hf.from_hf(m), prompt, 12)


@pytest.mark.slow
def test_count_hf_equals_transformers_parameter_count(tmp_path, capsys):
  m = _model()
  m.save_pretrained(tmp_path / "v4")
  code = cli.main(["count", "--hf", str(tmp_path / "v4"), "--format", "json"])
  out = capsys.readouterr()
  assert code == 0, out.err
  assert json.loads(out.out)["total"] == sum(p.numel() for p in m.parameters()) == TOTAL


def test_count_hf_by_hand_from_config_json_alone(tmp_path, capsys):
  """`attn count --hf` on KW's config.json (no transformers) against the closed form written here (the slow
  test above checks the same total against transformers' own count)."""
  (tmp_path / "v4").mkdir()
  (tmp_path / "v4" / "config.json").write_text(json.dumps({"model_type": "deepseek_v4", **KW}))
  code = cli.main(["count", "--hf", str(tmp_path / "v4"), "--format", "json"])
  out = capsys.readouterr()
  assert code == 0, out.err
  D, H, K, Q, N, E, F, n, g, r, m, nI, I = 24, 4, 16, 12, 61, 4, 20, 3, 2, 6, 4, 2, 10
  attn_ = D * Q + Q + Q * H * K + D * K + K + H * K * r + g * r * D + H  # ... + sinks
  compressor = 2 * D * K + m * K + K
  csa = 2 * (2 * D * K + m * K) + K + 2 * (2 * D * I + m * I) + I + Q * nI * I + D * nI  # two series, indexer
  experts = D * E + E * 3 * D * F + 3 * D * F  # router, experts, the shared one (tid2eid and the bias: buffers)
  hc = 2 * ((2 + n) * n * (n * D + 1) + 3)
  report = json.loads(out.out)
  assert report["breakdown"]["attention (sliding_attention)"] == attn_
  assert report["breakdown"]["attention (heavily_compressed_attention)"] == attn_ + compressor
  assert report["breakdown"]["attention (compressed_sparse_attention)"] == attn_ + csa
  total = 3 * (attn_ + experts + hc + 2 * D) + compressor + csa + 2 * N * D + D + n * (n * D + 1) + 1
  assert report["total"] == total == TOTAL


@pytest.mark.parametrize("change, field", [
    (dict(layer_types=[SWA, "full_attention", HCA]), "layer_types"),
    (dict(index_head_dim=6), "index_head_dim"),
    (dict(mlp_layer_types=["moe", "hash_moe", "moe"]), "mlp_layer_types"),
    (dict(num_key_value_heads=2), "num_key_value_heads"),
    (dict(hc_mult=1), "hc_mult"),
    (dict(quantization_config={"quant_method": "fp8"}), "quantization_config"),
    (dict(scoring_func="softmax"), "scoring_func"),
    (dict(rope_parameters={"main": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50.0},
                           "compress": {"rope_type": "default", "rope_theta": 700.0}}), "rope_parameters.main"),
    (dict(attention_bias=True), "attention_bias")])
def test_what_attn_does_not_run_is_refused_by_name_before_any_weight(change, field):
  """From the config alone (no weights, no transformers): the parameter, its value and what is allowed."""
  with pytest.raises(ConfigError, match=field):
    hf.model_config({"model_type": "deepseek_v4", **KW, **change})


def test_read_and_ignored_with_a_note_where_transformers_ignores_them():
  with pytest.warns(UserWarning, match="norm_topk_prob"):
    cfg = hf.model_config({"model_type": "deepseek_v4", **KW, "norm_topk_prob": False})
  assert cfg.moe_norm_topk  # V4's router renormalises whatever the config says


def test_head_permutation_moves_the_trailing_rope_slice_first():
  j = deepseek_v4.perm(6, 2)
  assert list(j) == [4, 5, 0, 1, 2, 3]
  assert list(np.argsort(j)[j]) == list(range(6))


def _random_state(seed: int = 0) -> tuple[ModelConfig, dict[str, np.ndarray]]:
  """KW's ModelConfig and a random checkpoint of it under the names to_hf_state writes (no transformers; the
  model's shapes only, nothing initialised)."""
  import jax
  from flax import nnx
  from attn.nn.hf.load import WEIGHTS
  from attn.nn.models import MODELS
  cfg = hf.model_config({"model_type": "deepseek_v4", **KW})
  model = nnx.eval_shape(lambda: MODELS["decoder_lm"](cfg, rngs=nnx.Rngs(0)))
  pure = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), nnx.to_pure_dict(nnx.state(model, WEIGHTS)))
  shapes = deepseek_v4.weights_out(pure, cfg)
  rng = np.random.default_rng(seed)
  return cfg, {k: (rng.integers(0, KW["n_routed_experts"], s.shape) if k.endswith("tid2eid")
                   else rng.standard_normal(s.shape)).astype(np.float32) for k, s in shapes.items()}


def test_indexer_weights_proj_of_transformers_5_9_and_of_the_release_read_as_5_10s():
  """transformers 5.8 and 5.9 hold (and save) the indexer's weights_proj on the indexer, 5.10 on in its scorer,
  DeepSeek's release as attn.indexer.weights_proj: a checkpoint under either older name (and 5.8's saved experts)
  reads to the same parameters bit for bit, every tensor read; a name neither layout has is refused naming it and
  the family."""
  import jax
  from attn.nn.hf.base import Weights
  cfg, state = _random_state()
  new = "model.layers.1.self_attn.compressor.indexer.scorer.weights_proj.weight"
  assert new in state  # the CSA layer's (KW: layer 1)

  def read(sd):
    w = Weights(sd, "model.", family="deepseek_v4")
    pure = deepseek_v4.weights_in(w, cfg)
    assert not w.unused()
    return jax.tree.leaves(pure)

  want = read(state)
  for old in ("model.layers.1.self_attn.compressor.indexer.weights_proj.weight",  # transformers 5.8 and 5.9
              "model.layers.1.attn.indexer.weights_proj.weight"):  # DeepSeek's release
    got = read({(old if k == new else k): a for k, a in state.items()})
    assert len(got) == len(want)
    for a, b in zip(got, want):
      np.testing.assert_array_equal(a, b)
  # transformers 5.8's save_pretrained: each expert as experts..{e}.w1 / w3 / w2 (gate, up, down), the name too.
  # to_hf_state writes the installed release's layout: fused (5) or one module per expert (4, the floor).
  w = {"gate": "w1", "up": "w3", "down": "w2"}
  split = {re.sub(r"\.experts\.(\d+)\.(gate|up|down)_proj\.", lambda m: f".experts..{m[1]}.{w[m[2]]}.", k): a
           for k, a in state.items() if not k.endswith((".experts.gate_up_proj", ".experts.down_proj"))}
  F = KW["moe_intermediate_size"]
  for k in [k for k in state if k.endswith(".experts.gate_up_proj")]:
    at = k[:-len("gate_up_proj")]
    for e, (gate_up, down) in enumerate(zip(state[k], state[f"{at}down_proj"])):
      split |= {f"{at}.{e}.w1.weight": gate_up[:F], f"{at}.{e}.w3.weight": gate_up[F:], f"{at}.{e}.w2.weight": down}
  assert any(".experts..0.w1." in k for k in split)
  split[new.replace("scorer.", "")] = split.pop(new)
  got = read(split)
  for a, b in zip(got, want, strict=True):
    np.testing.assert_array_equal(a, b)
  bad = {(new.replace("scorer", "score") if k == new else k): a for k, a in state.items()}
  with pytest.raises(ConfigError, match=r"no tensor 'layers\.1\.self_attn\.compressor\.indexer\.scorer\."
                     r"weights_proj\.weight'.*family 'deepseek_v4'"):
    read(bad)


def test_to_hf_writes_the_installed_releases_indexer_name():
  """live_names: the scorer's name where the release holds the older one (5.8 and 5.9), unchanged otherwise."""
  cfg, state = _random_state()
  new = "model.layers.1.self_attn.compressor.indexer.scorer.weights_proj.weight"
  old = new.replace("scorer.", "")
  older = frozenset(old if k == new else k for k in state)
  out = deepseek_v4.live_names(state, cfg, older)
  assert set(out) == older and out[old] is state[new]
  assert deepseek_v4.live_names(state, cfg, frozenset(state)).keys() == state.keys()
