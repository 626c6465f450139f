"""What the hybrid families' tests share (tests/test_hf_{qwen3_next,qwen3_5,kimi_linear,nemotron_h,olmo_hybrid}.py):
the exact round trip through to_hf, logits under right padding, and greedy decoding checked against
attn's own full pass.
Callers have skipped already where torch or their transformers model is missing."""

import jax
import jax.numpy as jnp
import numpy as np

from attn.nn import hf


def nnx_state(model) -> dict:
  """The model's parameters and buffers (DeepSeek's expert-correction bias) as plain arrays."""
  from flax import nnx
  from attn.nn.moe import Buffer
  return nnx.to_pure_dict(nnx.state(model, (nnx.Param, Buffer)))


def full_pass_check(model, prompt, decoded):
  """Token T + i is the argmax of attn's full (uncached) pass at T + i − 1: by induction, greedy
  decoding by passing the whole prefix at every step gives `decoded`."""
  T = prompt.shape[1]
  logits = np.asarray(model(jnp.asarray(decoded[:, :-1])))
  return np.concatenate([decoded[:, :T], logits[:, T - 1:].argmax(-1)], 1)


def assert_to_hf_and_back_exact(live, architecture: str, logits: bool = True):
  """to_hf(from_hf(live)) writes live's tensors bit for bit (names and values), from_hf of it holds
  the loaded parameters bit for bit, and (logits) the model it builds gives live's logits bit for
  bit on one random row. Returns the transformers model to_hf built."""
  import torch
  loaded = hf.from_hf(live)
  out = hf.to_hf(loaded)
  assert type(out).__name__ == architecture
  ours = {k: v.detach().numpy() for k, v in out.state_dict().items()}
  theirs = {k: v.detach().numpy() for k, v in live.state_dict().items()}
  assert set(ours) == set(theirs)
  for name, a in theirs.items():
    np.testing.assert_array_equal(ours[name], a, err_msg=name)
  back = hf.from_hf(out)
  for a, b in zip(jax.tree.leaves(nnx_state(back.model)), jax.tree.leaves(nnx_state(loaded.model)), strict=True):
    np.testing.assert_array_equal(a, b)
  if logits:
    out.set_attn_implementation(live.config._attn_implementation)  # to_hf builds eager
    tok = torch.tensor(np.random.default_rng(2).integers(0, 50, (1, 7)))
    with torch.no_grad():  # the same tensors in the same modules: the same logits, bit for bit
      np.testing.assert_array_equal(out(tok).logits.numpy(), live(tok).logits.numpy())
  return out


def assert_greedy_decoding_equal(live, loaded, prompt, steps: int):
  """attn's cached greedy decoding of `steps` tokens equals transformers' generate() on `live` and
  attn's own full pass (full_pass_check)."""
  import torch
  from attn.nn.decoding import generate
  with torch.no_grad():
    want = live.generate(torch.tensor(prompt), max_new_tokens=steps, do_sample=False).numpy()
  got = np.asarray(generate(loaded.model, jnp.asarray(prompt), steps))
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(got, full_pass_check(loaded.model, prompt, got))


def assert_logits_equal_under_right_padding(live, loaded, T=9, pad_from=6, seed=0):
  """Two rows of T random tokens, the second padded after pad_from: attn's logits (lengths_B) within 1e-4 of
  the largest of transformers' (attention_mask) at every real position."""
  import torch
  tok = np.random.default_rng(seed).integers(0, 50, (2, T))
  mask = np.ones((2, T), np.int64)
  mask[1, pad_from:] = 0
  with torch.no_grad():
    want = live(torch.tensor(tok), attention_mask=torch.tensor(mask)).logits.numpy()
  got = np.asarray(loaded.model(jnp.asarray(tok), lengths_B=jnp.asarray(mask.sum(1))))
  scale = np.abs(want).max()
  np.testing.assert_allclose(got[0], want[0], atol=1e-4 * scale)
  np.testing.assert_allclose(got[1, :pad_from], want[1, :pad_from], atol=1e-4 * scale)
