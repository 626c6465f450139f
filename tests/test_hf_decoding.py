"""attn's KV-cache decoding of Hugging Face models against transformers' own cached decoding.

Each Llama-like family is test_hf_families.build's tiny random model (GQA, head_dim ≠ D/H,
Mistral's window of 3 in every layer, Gemma 2's alternating windows of 3 with both soft-caps
and its sandwich norms, Qwen3's QK-norm, Llama's and Qwen2's biases). A batch of 2 prompts of
5 tokens is prefilled, then 10 tokens are decoded one at a time: 15 positions, past every
window, so each ring of 3 slots wraps several times. transformers runs the same steps with its
own cache, fed the tokens attn chose (teacher forcing): the logits of every step are compared
within TOL of the largest, and a near-tie of two logits cannot turn one token into two
diverging continuations. Tokens are compared exactly: attn's generate() against its own
steps; transformers' greedy choice against attn's wherever its top two logits are more than
2·TOL of the largest logit apart, and its generate() up to a row's first near-tie (with these
seeds one, Llama's row 1 at step 3: a gap of 1.7e-4; every other choice is compared).
The default tier runs the three families with a mechanism of their own (Gemma 2, Mistral,
Qwen3, about a second each once transformers is imported); Llama and Qwen2 run in the slow tier.

Prompts of a batch share one length: decoding is causal against one cache fill, and
DecoderLM(decode=True) refuses lengths (right padding is for the full pass only).

Conversions on load change what a layer caches (fewer kv heads; mla's latent instead of
K and V), so those models' cached decoding is checked against their own full pass.
"""

import inspect
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_hf_families import FAMILIES, TOL, build

from attn.config import ConfigError
from attn.nn import decoding, hf

PROMPT, NEW = 5, 10  # 15 positions against windows of 3
MEASURED = {}  # family -> max relative logit difference over every step, printed with -s


def _tokens(vocab, B=2, T=PROMPT, seed=5):
  return np.random.default_rng(seed).integers(0, vocab, (B, T))


def _attn_steps(model, prompt_BT, new):
  """(logits of each step, tokens chosen): the prompt prefilled, then `new` greedy tokens one at a
  time; generate()'s own jitted step (decoding._step), so generate() below reuses the compile."""
  B, T = prompt_BT.shape
  model.init_cache(B, T + new)
  logits = [np.asarray(decoding._step(model, jnp.asarray(prompt_BT, jnp.int32)))]
  chosen = []
  for i in range(new):
    chosen.append(logits[-1][:, -1].argmax(-1))
    if i + 1 < new:
      logits.append(np.asarray(decoding._step(model, jnp.asarray(chosen[-1][:, None], jnp.int32))))
  return logits, np.stack(chosen, 1)


def _hf_steps(m, prompt_BT, chosen_BN):
  """transformers' logits of the same steps with its cache, teacher-forced with attn's tokens.

  transformers 5.2 and later name the cache `cache` (argument and output), older releases
  `past_key_values`. Gemma 2 and 3 on transformers 4 size the HybridCache they make by themselves to the
  first call's length, so there the loop makes one for every position, as generate() does, and
  says where each step's tokens go (cache_position). 5 has no HybridCache: Gemma 2 makes a
  DynamicCache whose sliding-window layers grow."""
  import torch
  import transformers
  params = inspect.signature(m.forward).parameters
  key = "cache" if "cache" in params else "past_key_values"
  past = {}
  if int(transformers.__version__.split(".")[0]) < 5 and m.config.model_type in ("gemma2", "gemma3_text"):
    past = {key: transformers.HybridCache(m.config, max_batch_size=prompt_BT.shape[0],
                                          max_cache_len=prompt_BT.shape[1] + chosen_BN.shape[1],
                                          dtype=torch.float32)}
  logits, step, pos = [], prompt_BT, 0
  with torch.no_grad():
    for i in range(chosen_BN.shape[1]):
      where = {"cache_position": torch.arange(pos, pos + step.shape[1])} if "cache_position" in params else {}
      out = m(torch.from_numpy(np.asarray(step, np.int64)), use_cache=True, **past, **where)
      logits.append(out.logits.numpy())
      pos += step.shape[1]
      past, step = {key: getattr(out, key)}, chosen_BN[:, i:i + 1]
  return logits


def _hf_generate(m, prompt_BT, new):
  import torch
  m.generation_config.eos_token_id = None  # 10 tokens whatever they are (the ids are random)
  m.generation_config.pad_token_id = 0
  with torch.no_grad():
    out = m.generate(torch.from_numpy(prompt_BT), attention_mask=torch.ones(prompt_BT.shape, dtype=torch.long),
                     do_sample=False, max_new_tokens=new)
  return out.numpy()[:, prompt_BT.shape[1]:]


@pytest.mark.parametrize("family", [pytest.param(f, marks=[] if f in ("gemma2", "mistral", "qwen3")
                                                 else pytest.mark.slow) for f in sorted(FAMILIES)])
def test_cached_decoding_matches_transformers_cache(family):
  m = build(family)
  model, cfg = hf.from_hf(m)
  prompt_BT = _tokens(m.config.vocab_size)
  ours, chosen_BN = _attn_steps(model, prompt_BT, NEW)
  theirs = _hf_steps(m, prompt_BT, chosen_BN)
  assert [a.shape for a in ours] == [r.shape for r in theirs]
  scale = max(np.abs(r).max() for r in theirs)
  MEASURED[family] = max(np.abs(a - r).max() for a, r in zip(ours, theirs)) / scale
  print(f"{family}: cached decoding, max relative logit difference {MEASURED[family]:.2e}")
  assert MEASURED[family] < TOL
  # Tokens: transformers' argmax wherever its top two logits are more than 2·TOL apart (the
  # logits differ by less than TOL, so only a near-tie can choose otherwise); its generate()
  # up to the first near-tie of a row, after which the two continuations may part.
  last_BNV = np.stack([r[:, -1] for r in theirs], 1)
  top2 = np.sort(last_BNV, axis=-1)[..., -2:]
  sure_BN = top2[..., 1] - top2[..., 0] >= 2 * TOL * scale
  print(f"{family}: near-ties at (row, step) {np.argwhere(~sure_BN).tolist()}, gaps "
        f"{(np.diff(top2, axis=-1)[..., 0][~sure_BN] / scale).tolist()} of the largest logit")
  np.testing.assert_array_equal(last_BNV.argmax(-1)[sure_BN], chosen_BN[sure_BN])
  np.testing.assert_array_equal(np.asarray(model.generate(jnp.asarray(prompt_BT, jnp.int32), NEW))[:, PROMPT:],
                                chosen_BN)
  before_tie_BN = np.cumsum(~sure_BN, axis=1) == 0
  np.testing.assert_array_equal(_hf_generate(m, prompt_BT, NEW)[before_tie_BN], chosen_BN[before_tie_BN])


def test_decoding_refuses_ragged_prompts():
  model, _ = hf.from_hf(build("mistral"))
  model.init_cache(2, 8)
  with pytest.raises(ConfigError, match="lengths.*None with decode=True"):
    model(jnp.zeros((2, 4), jnp.int32), lengths_B=jnp.array([4, 2], jnp.int32), decode=True)


def _cached_equals_full_pass(model, vocab, chunks=(PROMPT,) + (1,) * NEW, B=2):
  tokens_BT = jnp.asarray(_tokens(vocab, B, sum(chunks), seed=6), jnp.int32)
  full = np.asarray(nnx.jit(lambda m, t: m(t))(model, tokens_BT))  # one compile, not one per operation
  model.init_cache(B, sum(chunks))
  got, i = [], 0
  for n in chunks:
    got.append(np.asarray(decoding._step(model, tokens_BT[:, i:i + n])))
    i += n
  rel = np.abs(np.concatenate(got, 1) - full).max() / np.abs(full).max()
  assert rel < TOL, rel


def test_a_model_that_has_decoded_converts_and_decodes_in_its_new_layout():
  """convert_model after generate(): the caches left in the model have the source's layout (G=2);
  the converted model holds parameters only, its G=1 cache made by init_cache."""
  m = build("gemma2")
  model, cfg = hf.from_hf(m)
  model.generate(jnp.asarray(_tokens(m.config.vocab_size), jnp.int32), NEW)  # leaves caches in the model
  with pytest.warns(hf.LossyConversionWarning):
    pooled, pooled_cfg, errors = hf.convert_model(model, cfg, "per_head", num_kv_heads=1)
  with pytest.warns(hf.LossyConversionWarning):
    loaded = hf.from_hf(m, num_kv_heads=1)
  assert pooled_cfg == loaded.config and tuple(errors) == loaded.errors
  loaded = loaded.model
  params = [nnx.to_pure_dict(nnx.state(x, nnx.Param)) for x in (pooled, loaded)]
  assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), *params)))
  with pytest.raises(ConfigError, match="init_cache"):
    pooled(jnp.zeros((2, 1), jnp.int32), decode=True)
  pooled.init_cache(2, PROMPT + NEW)
  # Gemma 2's local, global, local layers: rings of 3 slots, 15 slots; one kv head each.
  assert [b.attn.cache["k"][...].shape[1:3] for b in pooled.blocks] == [(3, 1), (15, 1), (3, 1)]
  _cached_equals_full_pass(pooled, m.config.vocab_size)


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_mean_pooled_kv_heads_decode_as_their_full_pass(family):
  m = build(family)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", hf.LossyConversionWarning)
    model = hf.from_hf(m, num_kv_heads=1).model
  _cached_equals_full_pass(model, m.config.vocab_size, (PROMPT, 1, 3, 1, 2, 1, 1, 1))


@pytest.mark.slow
def test_mla_on_load_decodes_its_latent_cache_as_its_full_pass():
  """mla needs rope_dim < d_k, so of the loaders it applies to GPT-2 (learned positions): each layer
  caches a latent of d_c = 4 numbers per token instead of 2·H·d_k = 24."""
  from test_hf import GPT2, _gpt2
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)  # lossy (d_c = 4 < 12); transformers' ids outside the vocab
    model = hf.from_hf(_gpt2(6), variant="mla", latent_dim=4).model
  model.init_cache(2, PROMPT + NEW)
  assert {n: c[...].shape[2:] for n, c in model.blocks[0].attn.cache.items()} == {"latent": (4,)}
  _cached_equals_full_pass(model, GPT2["vocab_size"])
