"""Inkling-2 (inkling2, inkling2_text): its heads are attn's, its text model's blocks are not, and from_hf says so.

The heads (slow tier): each of Inkling-2's attention layers, sliding and hybrid, equals attn's per_head layer of
the ModelConfig that reads Inkling-2's sizes (_heads: swa_* as layer_num_heads and layer_heads, the L2 clip,
qkv_conv "kv" with the convolution's residual and scale folded into its taps, value_norm_eps after the value
convolution, the elementwise sigmoid gate, sinks, the window), with what attn has no piece for at zero:
sink_proj (a zero sink logit per token is attn's learned sink at 0), relative_position_bias.proj (no bias) and
the hybrid layers' per-token taps (sconv.weight_proj: the static taps alone); the query's learned scale is folded
into w_q, and the log-position scaling is 1 below log_scaling_n_floor. A DecoderLM of those heads decodes as its
full pass.

The text model around them (block attention residuals, a relative position bias from each token, per-token
sinks and taps, convolutions on the residual, softcapped experts, a padded unembedding) is not attn's: from_hf and
`attn count --hf` refuse inkling2_text and the image-text wrapper inkling2 by name (attn.nn.hf.load.REFUSED)
before any weight is read: the default tier from config.json alone, the slow tier from the directories
transformers' own save_pretrained writes, whose tensors the refusal names are pinned. Skipped by name where
transformers lacks inkling2 (the floor, 4.51.1).
"""

import json
import os
import re

import numpy as np
import pytest

from attn import cli
from attn.config import ConfigError
from attn.nn import hf

os.environ["HF_HUB_OFFLINE"] = "1"

# What the refusal must name: the pieces attn lacks, by config key and tensor, and the heads it has.
WANT = (r"Inkling-2's text model needs what attn does not run yet: .*block attention residuals "
        r"\(attention_input, mlp_input, final_input / attn_res.*n_layers_per_attn_res_block.*relative position bias"
        r".*rel_logits_proj.*log_scaling_n_floor.*sink_proj / attn_sink_proj.*sconv.weight_proj.*"
        r"post_attention_convolution.*attn_sconv, mlp_sconv.*mlp_gate_softcap.*unpadded_vocab_size.*"
        r"its heads are attn's")
KINDS = {"inkling2_text": r"is refused, " + WANT, "inkling2": r"is refused, it is Inkling-2's image-text wrapper.*" + WANT}

# A tiny Inkling-2 text model: a sliding layer (4 heads over 2 kv heads of width 6) and a hybrid one (2 over 1, 10).
TEXT = dict(vocab_size=61, unpadded_vocab_size=57, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=10, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=6,
            sliding_window_size=3, d_rel=4, rel_extent=5, log_scaling_n_floor=64, conv_kernel_size=3,
            qk_l2_clip_threshold=0.9, moe_intermediate_size=8, n_routed_experts=4, num_experts_per_tok=2,
            n_layers_per_attn_res_block=1, layer_types=["hybrid_sliding", "hybrid"], eos_token_id=0)
VISION = dict(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, patch_size=4, projection_hidden_dim=8,
              text_hidden_size=16, posemb_grid_size=2, rope_parameters={"rope_type": "axial", "rope_theta": 100.0})
_TYPES = {"hybrid_sliding": "sliding_attention", "hybrid": "full_attention"}


def _count(capsys, path):
  code = cli.main(["count", "--hf", str(path)])
  return code, capsys.readouterr().err


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_refused_by_name_from_the_config(kind, tmp_path, capsys):
  """From a config dict, from_hf of a directory holding config.json and no weights, and `attn count --hf` (exit
  2, no near-name guess: a refused type is no typo); no torch."""
  config = {"model_type": kind, **({"text_config": TEXT} if kind == "inkling2" else TEXT)}
  with pytest.raises(ConfigError, match=rf"config.model_type='{kind}'.*{KINDS[kind]}") as e:
    hf.model_config(config)
  assert "did you mean" not in str(e.value)
  (tmp_path / "config.json").write_text(json.dumps(config))
  with pytest.raises(ConfigError, match=KINDS[kind]):
    hf.from_hf(str(tmp_path))  # there are no weights to read: the refusal comes first
  code, err = _count(capsys, tmp_path)
  assert code == 2 and "--hf: config.model_type" in err
  assert re.search(KINDS[kind], err), err


def _inkling2():
  """transformers' inkling2 modeling and configuration modules; skipped by name without them."""
  pytest.importorskip("torch")
  reason = "transformers inkling2 (added in 5.x; absent on the floor 4.51.1)"
  return (pytest.importorskip("transformers.models.inkling2.modeling_inkling2", reason=reason),
          pytest.importorskip("transformers.models.inkling2.configuration_inkling2", reason=reason))


def _heads(text: dict, rms_norm_eps: float):
  """attn's ModelConfig for Inkling-2's attention heads (its blocks aside): sliding layers with their own
  query heads (layer_num_heads), kv heads and widths (layer_heads), the window, no RoPE."""
  from attn.nn.config import ModelConfig
  types = tuple(_TYPES[t] for t in text["layer_types"])
  swa = {"d_k": text["swa_head_dim"], "d_v": text["swa_head_dim"], "num_kv_heads": text["swa_num_key_value_heads"]}
  heads = tuple(text["swa_num_attention_heads"] if t == "sliding_attention" else text["num_attention_heads"]
                for t in types)
  return ModelConfig(vocab_size=text["vocab_size"], d_model=text["hidden_size"], num_layers=len(types),
                     num_heads=text["num_attention_heads"], num_kv_heads=text["num_key_value_heads"],
                     d_k=text["head_dim"], d_v=text["head_dim"], d_ff=text["moe_intermediate_size"], max_len=32,
                     variant="per_head", positional="none", norm_type="rmsnorm", use_bias=False, layer_types=types,
                     window=text["sliding_window_size"], layer_num_heads=heads, layer_heads={"sliding_attention": swa},
                     qk_l2_clip_threshold=text["qk_l2_clip_threshold"], qkv_conv="kv",
                     qkv_conv_width=text["conv_kernel_size"], value_norm_eps=rms_norm_eps, gate="elementwise",
                     sinks=True)


def _taps(sd: dict, name: str, W: int, G: int, K: int, dynamic: bool) -> np.ndarray:
  """Inkling-2's key or value convolution as attn's taps (W, G, K), torch Conv1d's order: (conv(x) + x)/sqrt(W + 1)
  (sliding) or (static(x) + x)/sqrt(2W + 1) (hybrid, static_weight[lag], lag 0 the current token)."""
  if dynamic:
    w, scale = sd[f"{name}.sconv.static_weight"][::-1].copy(), np.sqrt(2 * W + 1)
  else:
    w, scale = sd[f"{name}.sconv.conv1d.weight"][:, 0].T.copy(), np.sqrt(W + 1)
  w[-1] += 1
  return (w / scale).reshape(W, G, K)


@pytest.mark.slow
@pytest.mark.parametrize("index", [0, 1], ids=["sliding", "hybrid"])
def test_heads_equal_inkling2_attention(index):
  """attn.apply of layer `index`'s head equals transformers' Inkling2SlidingAttention / Inkling2FullAttention
  (eager, causal and windowed masks), its relative bias, per-token sinks and per-token taps at zero."""
  modeling, configuration = _inkling2()
  import jax
  import jax.numpy as jnp
  import torch

  import attn
  config = configuration.Inkling2TextConfig(**TEXT)
  config._attn_implementation = "eager"
  cfg = _heads(TEXT, config.rms_norm_eps)
  torch.manual_seed(index)
  layer = (modeling.Inkling2SlidingAttention, modeling.Inkling2FullAttention)[index](config, index).eval()
  with torch.no_grad():
    for p in layer.parameters():
      p.normal_(0.0, 0.4)  # clips, scales and taps away from their starting points
    layer.sink_proj.weight.zero_()
    layer.relative_position_bias.proj.zero_()
    if index == 1:
      layer.k_proj.sconv.weight_proj.weight.zero_()
      layer.v_proj.sconv.weight_proj.weight.zero_()
  head = cfg.layer_head(index)
  D, H, G, K, W = head.d_model, head.num_heads, head.num_kv_heads, head.d_k, cfg.qkv_conv_width
  sd = {k: v.detach().numpy() for k, v in layer.state_dict().items()}
  params = {"w_q": sd["q_proj.linear.weight"].T.reshape(D, H, K) * sd["q_proj.norm.scale"],
            "w_k": sd["k_proj.linear.weight"].T.reshape(D, G, K), "w_v": sd["v_proj.linear.weight"].T.reshape(D, G, K),
            "w_o": sd["o_proj.linear.weight"].T.reshape(H, K, D),
            "w_gate": sd["o_proj.gate_proj.weight"].T.reshape(D, H, K), "sinks": np.zeros(H, np.float32),
            "qkv_conv_k": _taps(sd, "k_proj", W, G, K, index == 1),
            "qkv_conv_v": _taps(sd, "v_proj", W, G, K, index == 1)}
  shapes = jax.eval_shape(lambda: attn.init("per_head", jax.random.key(0), head))
  assert {k: v.shape for k, v in shapes.items()} == {k: v.shape for k, v in params.items()}
  B, T = 2, 9
  x = np.random.default_rng(index).normal(size=(B, T, D)).astype(np.float32)
  got = attn.apply("per_head", {k: jnp.asarray(v) for k, v in params.items()}, jnp.asarray(x), cfg=head,
                   is_causal=True)
  pos = torch.arange(T)
  distance = pos[:, None] - pos[None, :]
  seen = (distance >= 0) & ((distance < TEXT["sliding_window_size"]) if index == 0 else True)
  mask = torch.where(seen, 0.0, torch.finfo(torch.float32).min)[None, None].expand(B, 1, T, T)
  inputs = torch.tensor(x)
  kwargs = {"key_hidden_states": inputs, "value_hidden_states": inputs} if index == 1 else {}
  with torch.no_grad():
    want = layer(hidden_states=inputs, attention_mask=mask, relative_distance=distance,
                 position_ids=pos[None].expand(B, T), **kwargs)[0].numpy()
  np.testing.assert_allclose(np.asarray(got), want, atol=2e-6, rtol=1e-5)


@pytest.mark.slow
def test_a_decoder_of_inkling2_heads_decodes_as_its_full_pass():
  """Per-type sizes, the window's ring, the convolutions' state, the clip, the value norm, gate and sinks in one
  DecoderLM: greedy decoding through the caches equals greedy decoding by full passes."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from attn.nn.decoding import generate
  from attn.nn.models import DecoderLM
  from hf_hybrid import full_pass_check
  cfg = _heads(TEXT, 1e-6)
  sizes = [(h.num_heads, h.num_kv_heads, h.d_k, h.window) for h in map(cfg.layer_head, range(2))]
  assert sizes == [(4, 2, 6, 3), (2, 1, 10, None)]
  model = DecoderLM(cfg, rngs=nnx.Rngs(0))
  prompt = np.asarray(jax.random.randint(jax.random.key(1), (2, 5), 0, cfg.vocab_size))
  decoded = np.asarray(generate(model, jnp.asarray(prompt), 6))
  np.testing.assert_array_equal(full_pass_check(model, prompt, decoded), decoded)


# The tensors the refusal names, as save_pretrained writes them (the release's names under model.llm.): the block
# attention residuals' queries, the relative bias, the per-token sinks and taps, the residual convolutions, the
# padded unembedding; and no RoPE anywhere.
PINNED = ("attn_res.attn_queries.0", "attn_res.mlp_queries.1", "attn_res.output_query",
          "layers.0.attn.rel_logits_proj.proj", "layers.0.attn.wr_du.weight", "layers.1.attn.attn_sink_proj.weight",
          "layers.1.attn.k_sconv.weight_proj", "layers.1.attn.v_sconv.weight_proj", "layers.0.attn_sconv.weight",
          "layers.1.mlp_sconv.weight", "unembed.weight")


def _saved(tmp_path, kind: str):
  """The directory transformers' save_pretrained writes for a tiny random Inkling2ForCausalLM (inkling2_text) or
  Inkling2ForConditionalGeneration (inkling2, a one-block vision tower)."""
  modeling, configuration = _inkling2()
  import torch
  torch.manual_seed(0)
  if kind == "inkling2_text":
    model = modeling.Inkling2ForCausalLM(configuration.Inkling2TextConfig(**TEXT))
  else:
    model = modeling.Inkling2ForConditionalGeneration(configuration.Inkling2Config(text_config=TEXT,
                                                                                   vision_config=VISION))
  path = tmp_path / kind
  model.save_pretrained(str(path))
  return path


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_refused_from_what_save_pretrained_writes(kind, tmp_path, capsys):
  """from_hf and `attn count --hf` on transformers' own directory: refused by name, before any weight is read
  (the weights are there and well formed: only the config decides)."""
  path = _saved(tmp_path, kind)
  assert json.loads((path / "config.json").read_text())["model_type"] == kind
  shapes = hf.read_shapes(str(path))
  for name in PINNED:
    assert "model.llm." + name in shapes, (name, sorted(shapes)[:12])
  assert not any("rotary" in n or "inv_freq" in n for n in shapes if n.startswith("model.llm."))
  assert shapes["model.llm.unembed.weight"] == (TEXT["vocab_size"], TEXT["hidden_size"])  # padded again on save
  assert any(n.startswith("model.visual.") for n in shapes) == (kind == "inkling2")
  with pytest.raises(ConfigError, match=KINDS[kind]):
    hf.from_hf(str(path))
  code, err = _count(capsys, path)
  assert code == 2 and re.search(KINDS[kind], err), err
