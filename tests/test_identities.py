"""Identities between variants: split input, one head vs h heads (effective counts: test_count.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attn
from attn import ConfigError, HeadConfig
from attn.conversion import convert
from attn.variants.base import Options
from conftest import CONFIGS, tier
from conftest import fresh_params as fresh
from conftest import randn as np_randn

B, T, S = 2, 5, 7


# Fast: G < H with d_v != d_k and biases, and G = 1 without biases; the plain config and dv_ne_dk slow.
@pytest.mark.parametrize("cname", [pytest.param(c, marks=() if c in ("gqa", "mqa_nobias") else pytest.mark.slow)
                                   for c in ["base", "dv_ne_dk", "gqa", "mqa_nobias"]])
def test_split_input_is_a_block_diagonal_per_head_layer(cname):
  cfg = CONFIGS[cname]
  D, H, G = cfg.d_model, cfg.num_heads, cfg.num_kv_heads
  p = fresh("split_input", cfg)
  full = convert(p, "split_input", "per_head", cfg)
  for name, n in (("w_q", H), ("w_k", G), ("w_v", G)):
    w = np.asarray(full[name])  # (D, heads, width)
    rows = np.arange(D) // (D // n)
    for head in range(n):
      np.testing.assert_array_equal(w[rows != head, head], 0.0)
      np.testing.assert_array_equal(w[rows == head, head], np.asarray(p[name][head]))
  x = np_randn(2, (B, T, D))
  ctx = np_randn(3, (B, S, D))
  apply = jax.jit(attn.apply, static_argnums=0, static_argnames="cfg")
  np.testing.assert_allclose(apply("per_head", full, x, ctx, cfg=cfg),
                             apply("split_input", p, x, ctx, cfg=cfg), atol=1e-5, rtol=1e-5)
  # A smaller model: a generic per_head layer has more parameters and more degrees of freedom.
  assert attn.count.param_counts("split_input", cfg)["stored"] < attn.count.param_counts("per_head", cfg)["stored"]
  assert (attn.VARIANTS["split_input"].effective_param_count(cfg)
          < attn.VARIANTS["per_head"].effective_param_count(cfg))


def test_split_input_requires_heads_dividing_d_model():
  with pytest.raises(ConfigError, match="num_heads=6.*d_model=20"):
    attn.init("split_input", jax.random.PRNGKey(0), CONFIGS["h_not_dividing_D"])


def test_h_heads_are_not_one_wide_head_made_of_the_same_matrices():
  """Seed question 5: the same Q, K, V, but h attention matrices instead of one."""
  D, H = 32, 8
  multi = HeadConfig(d_model=D, num_heads=H)
  # The same scale for both, so the only difference is one softmax vs h.
  single = HeadConfig(d_model=D, num_heads=1, d_k=D, d_v=D, scale=multi.score_scale)
  p8 = fresh("per_head", multi)
  p8 |= {"w_q": 3 * p8["w_q"], "w_k": 3 * p8["w_k"]}  # logits O(1): attention far from uniform
  p1 = {n: a.reshape(attn.param_shapes("per_head", single)[n]) for n, a in p8.items()}
  x = np_randn(2, (B, T, D))

  @jax.jit  # one compile for the six projections, not one per operation
  def projections(p8, p1, x):
    return [((jnp.einsum("BTD,DHK->BTHK", x, p8[f"w_{n}"]) + p8[f"b_{n}"]).reshape(B, T, 1, D),
             jnp.einsum("BTD,DHK->BTHK", x, p1[f"w_{n}"]) + p1[f"b_{n}"]) for n in ("q", "k", "v")]

  for of8, of1 in projections(p8, p1, x):  # the projections are identical
    np.testing.assert_allclose(of8, of1, rtol=1e-6, atol=1e-6)
  apply = jax.jit(attn.apply, static_argnums=0, static_argnames=("cfg", "return_weights"))
  y8, w8 = (np.asarray(a, np.float64) for a in apply("per_head", p8, x, cfg=multi, return_weights=True))
  y1, w1 = (np.asarray(a, np.float64) for a in apply("per_head", p1, x, cfg=single, return_weights=True))
  rel = float(np.linalg.norm(y8 - y1) / np.linalg.norm(y8))
  assert rel > 0.1, rel
  # What one head loses: its logits are the sum of the h heads' logits, so its single
  # softmax is the normalised product of theirs, up to a constant along each row.
  log_ratio = np.log(w1[:, 0]) - np.log(w8).sum(axis=1)
  np.testing.assert_allclose(log_ratio - log_ratio[..., :1], 0.0, atol=1e-3)
  assert float(np.max(np.abs(w8[:, 0] - w8[:, 1]))) > 0.05  # and h distinct matrices


def _per_head_loop(params, x, c, cfg, mask):
  """h separate linear layers written out in float64 numpy, one head at a time."""
  p = {k: np.asarray(v, np.float64) for k, v in params.items()}
  x, c = np.asarray(x, np.float64), np.asarray(c, np.float64)
  H, G = cfg.num_heads, cfg.num_kv_heads
  y = np.zeros(x.shape[:2] + (cfg.d_model,)) + p.get("b_o", 0.0)
  for h in range(H):
    g = h // (H // G)  # query heads of one key/value group are adjacent
    q = x @ p["w_q"][:, h] + (p["b_q"][h] if "b_q" in p else 0.0)
    k = c @ p["w_k"][:, g] + (p["b_k"][g] if "b_k" in p else 0.0)
    v = c @ p["w_v"][:, g] + (p["b_v"][g] if "b_v" in p else 0.0)
    s = np.einsum("btk,bsk->bts", q, k) * cfg.score_scale
    keep = np.broadcast_to(mask[:, h if mask.shape[1] > 1 else 0], s.shape)
    s = np.where(keep, s, -np.inf)
    row_max = np.max(s, axis=-1, keepdims=True)
    e = np.where(keep, np.exp(s - np.where(np.isfinite(row_max), row_max, 0.0)), 0.0)
    total = e.sum(-1, keepdims=True)
    w = np.divide(e, total, out=np.zeros_like(e), where=total > 0)  # blank rows give zeros
    y = y + (w @ v) @ p["w_o"][h]
  return y


@pytest.mark.parametrize("cname", [pytest.param(c, marks=tier("per_head", c)) for c in sorted(CONFIGS)])
def test_per_head_is_a_loop_of_h_linear_layers(cname):
  """per_head computes its heads together; a literal loop over heads gives the same output."""
  cfg = CONFIGS[cname]
  S_ = S + 2  # cross-attention: the context is longer than the queries
  x, c = np_randn(1, (B, T, cfg.d_model)), np_randn(2, (B, S_, cfg.d_model))
  params = fresh("per_head", cfg, seed=3)
  keep = np.random.default_rng(4).random((B, cfg.num_heads, T, S_)) < 0.6
  keep[0, :, 1] = False  # a query row that sees no key, in every head
  keep[1, -1] = False  # one head sees nothing at all in the second example
  y, _ = jax.jit(lambda p, x, c, keep: attn.VARIANTS["per_head"].apply(  # one compile, not op by op
      p, x, c, cfg=cfg, opts=Options(mask=keep)))(params, x, c, jnp.asarray(keep))
  np.testing.assert_allclose(np.asarray(y), _per_head_loop(params, x, c, cfg, keep),
                             rtol=1e-5, atol=1e-5)
  # A row that sees no key in any head is the output bias alone, not NaN.
  np.testing.assert_allclose(np.asarray(y)[0, 1],
                             np.broadcast_to(np.asarray(params.get("b_o", 0.0)), (cfg.d_model,)),
                             atol=1e-6)
