"""mla and talking_heads against numpy from their papers' equations; converters, counts and CLI.

The generic suites cover both variants as they cover every registered one (test_contract,
test_count, test_convert; in the slow tier, conftest.tier). Here: second implementations
in numpy, the lossy per_head -> mla error against numpy's SVD, and numbers by hand.
"""

import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attn
from attn import ConfigError, HeadConfig, cli, count
from attn.conversion import CONVERTERS, LossyConversionWarning, convert
from attn.variants import talking_heads
from attn.variants.base import Options
from conftest import ROPE_CONFIGS, fresh_params, randn
from test_count import xla_flops
from test_rope import numpy_rotate

B, T, S = 2, 5, 7


def softmax(z):
  e = np.exp(z - z.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def numpy_mla(p, x, c, cfg, q_pos, k_pos):
  """DeepSeek-V2 §2.1 per head, in float64: c^KV = c W^DKV, k^C = c^KV W^UK, k^R = RoPE(c W^KR)."""
  p = {k: np.asarray(a, np.float64) for k, a in p.items()}
  x, c = np.asarray(x, np.float64), np.asarray(c, np.float64)
  r, b = cfg.rope_dim, cfg.use_bias
  w_q = p["w_q"] if "w_q" in p else np.einsum("DQ,QHK->DHK", p["w_dq"], p["w_uq"])
  q = np.einsum("BTD,DHK->BTHK", x, w_q) + (p["b_q"] if b else 0)
  lat = c @ p["w_dkv"]
  k_c = np.einsum("BSC,CGK->BSGK", lat, p["w_uk"])
  v = np.einsum("BSC,CGV->BSGV", lat, p["w_uv"]) + (p["b_v"] if b else 0)
  out = np.zeros(x.shape[:2] + (cfg.num_heads, cfg.d_v))
  weights = []
  for h in range(cfg.num_heads):
    g = h // cfg.group_size
    logits = np.einsum("BTK,BSK->BTS", q[:, :, h, r:], k_c[:, :, g])
    if r:
      k_r = c @ p["w_kr"] + (p["b_kr"] if b else 0)
      q_r = numpy_rotate(q[:, :, h, :r], q_pos, r, cfg.rope_theta)
      k_r = numpy_rotate(k_r, k_pos, r, cfg.rope_theta)
      logits += np.einsum("BTK,BSK->BTS", q_r, k_r)
    w = softmax(logits / np.sqrt(cfg.d_k))
    weights.append(w)
    out[:, :, h] = np.einsum("BTS,BSV->BTV", w, v[:, :, g])
  y = np.einsum("BTHV,HVD->BTD", out, p["w_o"]) + (p["b_o"] if b else 0)
  return y, np.stack(weights, 1)


MLA_CFGS = {
    "rope_qlatent": HeadConfig(d_model=20, num_heads=6, d_k=6, d_v=5, num_kv_heads=2, rope_dim=2,
                               rope_theta=50.0, latent_dim=7, q_latent_dim=9),
    "nobias_mqa": HeadConfig(d_model=18, num_heads=3, d_k=4, d_v=7, num_kv_heads=1, latent_dim=5,
                             use_bias=False),
}


@pytest.mark.slow
@pytest.mark.parametrize("cname", sorted(MLA_CFGS))
def test_mla_against_numpy(cname):
  cfg = MLA_CFGS[cname]
  p = fresh_params("mla", cfg, seed=1)
  x, c = randn(2, (B, T, cfg.d_model)), randn(3, (B, S, cfg.d_model))
  pos = np.array([[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]])
  f = jax.jit(lambda p, x, c, pos: attn.apply("mla", p, x, c, cfg=cfg, positions=pos,
                                              return_weights=True))
  for ctx, k_pos in ((None, pos), (c, np.broadcast_to(np.arange(S), (B, S)))):
    y, w = f(p, x, ctx, jnp.asarray(pos))
    y_np, w_np = numpy_mla(p, x, x if ctx is None else ctx, cfg, pos, k_pos)
    np.testing.assert_allclose(w, w_np, atol=2e-5)
    np.testing.assert_allclose(y, y_np, atol=1e-4 * np.abs(y_np).max())


def numpy_talking_heads(p, x, cfg, mask):
  """Shazeer et al. 2020: logits mixed by P_l = I + mix_l, softmax, mixed by P_w, masked again."""
  p = {k: np.asarray(a, np.float64) for k, a in p.items()}
  x = np.asarray(x, np.float64)
  R = cfg.group_size
  q = np.einsum("BTD,DHK->BHTK", x, p["w_q"]) + p["b_q"][:, None]
  k = np.repeat(np.einsum("BSD,DGK->BGSK", x, p["w_k"]) + p["b_k"][:, None], R, axis=1)
  v = np.repeat(np.einsum("BSD,DGV->BGSV", x, p["w_v"]) + p["b_v"][:, None], R, axis=1)
  logits = np.einsum("BHTK,BHSK->BHTS", q, k) / np.sqrt(cfg.d_k)
  eye = np.eye(cfg.num_heads)
  logits = np.einsum("BHTS,HI->BITS", logits, eye + p["mix_l"])
  w = softmax(np.where(mask, logits, -np.inf))
  mixed = np.where(mask, np.einsum("BHTS,HI->BITS", w, eye + p["mix_w"]), 0.0)
  y = np.einsum("BHTS,BHSV,HVD->BTD", mixed, v, p["w_o"]) + p["b_o"]
  return y, w


@pytest.mark.slow
def test_talking_heads_against_numpy_with_per_head_masks():
  """Mixed weights are masked again: a key hidden from head h gets no weight there via P_w."""
  cfg = HeadConfig(d_model=12, num_heads=4, d_k=3, d_v=5, num_kv_heads=2)
  p = fresh_params("talking_heads", cfg, seed=4)
  x = randn(5, (B, T, cfg.d_model))
  rng = np.random.default_rng(6)
  mask = rng.random((B, cfg.num_heads, T, T)) < 0.6
  mask[..., 0] = True  # no fully masked row here (numpy's softmax would be NaN)
  y, w = jax.jit(lambda p, x: attn.apply("talking_heads", p, x, cfg=cfg, mask=jnp.asarray(mask),
                                         return_weights=True))(p, x)
  y_np, w_np = numpy_talking_heads(p, x, cfg, mask)
  np.testing.assert_allclose(w, w_np, atol=2e-5)
  np.testing.assert_allclose(y, y_np, atol=1e-4 * np.abs(y_np).max())


def test_talking_heads_refuses_the_fused_kernels():
  cfg = HeadConfig(d_model=8, num_heads=2)
  for impl in ("blocked", "xla", "cudnn"):
    with pytest.raises(ConfigError, match=f"impl='{impl}' is not allowed.*talking_heads"):
      talking_heads.apply({}, np.zeros((1, 3, 8), np.float32), cfg=cfg, opts=Options(impl=impl))


CONFIGS_LOSSY = HeadConfig(d_model=10, num_heads=4, d_k=3, d_v=2, num_kv_heads=2)  # G(K+V) = 10


@pytest.mark.slow
@pytest.mark.parametrize("latent", [3, 6, 9])
def test_per_head_to_narrow_mla_is_the_truncated_svd(latent):
  """Error = relative tail of [W_K | W_V]'s singular values (numpy); shrinks as the latent grows."""
  cfg = CONFIGS_LOSSY.replace(latent_dim=latent)
  p = fresh_params("per_head", cfg, seed=7)
  stack = np.concatenate([np.asarray(p["w_k"]).reshape(cfg.d_model, -1),
                          np.asarray(p["w_v"]).reshape(cfg.d_model, -1)], 1).astype(np.float64)
  s = np.linalg.svd(stack, compute_uv=False)
  want = np.sqrt((s[latent:] ** 2).sum() / (s ** 2).sum())
  with pytest.warns(LossyConversionWarning, match="per_head -> mla is lossy"):
    m, err = convert(p, "per_head", "mla", cfg, return_error=True)
  np.testing.assert_allclose(err, want, rtol=1e-4)
  # What the latent keeps is the best rank-`latent` approximation: mla -> per_head reads it back.
  back = convert(m, "mla", "per_head", cfg)
  got = np.concatenate([np.asarray(back["w_k"]).reshape(cfg.d_model, -1),
                        np.asarray(back["w_v"]).reshape(cfg.d_model, -1)], 1)
  np.testing.assert_allclose(np.linalg.norm(got - stack) / np.linalg.norm(stack), want, rtol=1e-3)



@pytest.mark.slow
def test_per_head_to_mla_under_rope_with_two_kv_heads_pools_the_rope_key():
  cfg = ROPE_CONFIGS["rope_gqa"].replace(latent_dim=40)  # >= G·(K − r + V) = 18: only RoPE loses
  assert not CONVERTERS[("per_head", "mla")].is_exact(cfg)
  p = fresh_params("per_head", cfg, seed=8)
  with pytest.warns(LossyConversionWarning):
    m, err = convert(p, "per_head", "mla", cfg, return_error=True)
  r = cfg.rope_dim
  rk, rb = np.asarray(p["w_k"])[:, :, :r], np.asarray(p["b_k"])[:, :r]
  lost = ((rk - rk.mean(1, keepdims=True)) ** 2).sum() + ((rb - rb.mean(0)) ** 2).sum()
  total = (np.asarray(p["w_k"])[:, :, r:] ** 2).sum() + (np.asarray(p["w_v"]) ** 2).sum() + (
      rk ** 2).sum() + (rb ** 2).sum()
  np.testing.assert_allclose(err, np.sqrt(lost / total), rtol=1e-4)
  np.testing.assert_allclose(m["w_kr"], rk.mean(1), atol=1e-6)
  # With the two kv heads' rotated key dims made equal first, the conversion is exact.
  p["w_k"] = p["w_k"].at[:, 1, :r].set(p["w_k"][:, 0, :r])
  p["b_k"] = p["b_k"].at[1, :r].set(p["b_k"][0, :r])
  with warnings.catch_warnings():
    warnings.simplefilter("error", LossyConversionWarning)
    m, err = convert(p, "per_head", "mla", cfg, return_error=True)
  assert err < 1e-6
  x = randn(9, (B, T, cfg.d_model))
  np.testing.assert_allclose(attn.apply("mla", m, x, cfg=cfg),
                             attn.apply("per_head", p, x, cfg=cfg), atol=1e-5)


def test_mla_counts_and_cache_by_hand():
  D, H, K, V, C, r = 512, 8, 64, 64, 128, 32
  cfg = HeadConfig(d_model=D, num_heads=H, d_k=K, d_v=V, latent_dim=C, rope_dim=r)
  by_hand = (D * H * K + D * C + C * H * (K - r) + C * H * V + D * r + H * V * D
             + H * K + r + H * V + D)
  assert count.param_counts("mla", cfg)["analytic"] == by_hand == 706_080
  assert count.param_counts("mla", cfg)["stored"] == by_hand
  assert count.kv_cache_bytes_per_token("mla", cfg, "bfloat16") == (C + r) * 2 == 320
  q = cfg.replace(q_latent_dim=96, use_bias=False)
  assert count.param_counts("mla", q)["analytic"] == (
      D * 96 + 96 * H * K + D * C + C * H * (K - r) + C * H * V + D * r + H * V * D)
  # MHA caches 2·H·d_k, MQA 2·d_k: mla at d_c = 128 with a 32-wide RoPE key sits between.
  mqa = cfg.replace(num_kv_heads=1, rope_dim=0)
  assert count.kv_cache_bytes_per_token("per_head", mqa, "bfloat16") == 2 * K * 2 < 320 < (
      count.kv_cache_bytes_per_token("per_head", cfg, "bfloat16"))


def test_count_cli_prints_the_mla_cache(capsys):
  argv = ["count", "--variant", "mla", "--variant", "per_head", "--latent-dim", "128",
          "--rope-dim", "32"]
  assert cli.main(argv) == 0
  out = capsys.readouterr().out
  assert "caches d_c + rope_dim = 160 elements per token" in out
  assert cli.main(argv + ["--format", "json"]) == 0
  rows = {r["variant"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
  assert rows["mla"]["kv_bytes_per_token"] == 640 and rows["per_head"]["kv_bytes_per_token"] == 4096  # float32
  assert rows["mla"]["analytic"] == 706_080
  assert cli.main(["count", "--variant", "mla", "--latent-dim", "0"]) == 2
  assert "latent_dim=0 is not allowed" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("name, dims", [
    ("mla", dict(d_model=48, num_heads=4, d_k=12, d_v=20, num_kv_heads=2, latent_dim=16,
                 q_latent_dim=24, rope_dim=4)),
    ("talking_heads", dict(d_model=48, num_heads=6, d_k=8, d_v=4, num_kv_heads=3, rope_dim=4))])
def test_flops_with_latents_and_rope_agree_with_xla(name, dims):
  cfg = HeadConfig(**dims)
  Tq, Sk = 4, 12
  p = attn.init(name, jax.random.PRNGKey(0), cfg)
  f = lambda p, x, c: attn.VARIANTS[name].apply(p, x, c, cfg=cfg)[0]
  got = xla_flops(f, p, jnp.ones((1, Tq, cfg.d_model)), jnp.ones((1, Sk, cfg.d_model)))
  assert got == pytest.approx(count.flops(name, cfg, Tq, Sk), rel=0.10)


def test_deepseek_options_off_by_default_and_refused_where_meaningless():
  """latent_norm_eps and rope_mscale_all_dim default to None (attn's own mla unchanged); the mscale
  multiplies the score scale by (0.1·m·ln factor + 1)² under yarn only; bad values are refused by name."""
  cfg = MLA_CFGS["rope_qlatent"]
  assert cfg.latent_norm_eps is None and cfg.rope_mscale_all_dim is None
  assert cfg.score_scale == 1 / np.sqrt(cfg.d_k)
  assert "latent_norm" not in attn.param_shapes("mla", cfg)
  yarn = cfg.replace(rope_scaling="yarn", rope_factor=40.0, rope_mscale_all_dim=1.0)
  assert yarn.score_scale == pytest.approx((0.1 * np.log(40.0) + 1) ** 2 / np.sqrt(cfg.d_k), rel=1e-12)
  normed = cfg.replace(latent_norm_eps=1e-6)
  assert attn.param_shapes("mla", normed)["latent_norm"] == (7,)
  assert attn.param_shapes("mla", normed)["q_latent_norm"] == (9,)
  from attn.variants import VARIANTS
  stored = sum(int(np.prod(s)) for s in attn.param_shapes("mla", normed).values())
  assert VARIANTS["mla"].param_count(normed) == VARIANTS["mla"].param_count(cfg) + 7 + 9 == stored
  assert VARIANTS["mla"].effective_param_count(normed) is None  # no closed form: measured
  with pytest.raises(ConfigError, match=r"rope_mscale_all_dim=1.0.*None when rope_scaling=None"):
    cfg.replace(rope_mscale_all_dim=1.0)
  with pytest.raises(ConfigError, match=r"latent_norm_eps=0.*a positive finite number"):
    cfg.replace(latent_norm_eps=0)
  from attn.nn import interop
  with pytest.raises(ConfigError, match=r"rope_mscale_all_dim=1.0.*flax always scales"):
    interop._default_scale(yarn, "flax")
