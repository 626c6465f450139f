"""The seed questions answered for one config, in one screen (`attn demo`, attn/cli/demo.py).

For each variant: stored and effective parameters and the number of attention
matrices per layer; for each conversion registered in attn.convert that applies
to the config (and the round trip of a lossy one through its exact inverse):
the max error between the two sides on random inputs (float32, self- and
cross-attention, causal and padding masks); and the one-wide-head vs
h-narrow-heads comparison.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp

import attn
from attn import api
from attn.config import HeadConfig
from attn.conversion import CONVERTERS, REGROUPERS, Converter
from attn.variants.base import Params

B, T, S = 2, 16, 24


def random_params(variant: str, cfg: HeadConfig, seed: int) -> Params:
  """Freshly initialised params with random biases too (init makes biases zero)."""
  params = attn.init(variant, jax.random.PRNGKey(seed), cfg)
  keys = jax.random.split(jax.random.PRNGKey(seed + 1), len(params))
  return {n: a + 0.5 * jax.random.normal(k, a.shape) if n.startswith("b") else a
          for k, (n, a) in zip(keys, sorted(params.items()))}


def as_one_head(params: Params, cfg: HeadConfig) -> tuple[Params, HeadConfig]:
  """The same concatenated W_Q, W_K, W_V, W_O read as one head of width H·d_k (seed question 5)."""
  D, H, K, V = cfg.d_model, cfg.num_heads, cfg.d_k, cfg.d_v
  if cfg.num_kv_heads < H:  # give every query head its own copy of its kv head first
    params = attn.convert(params, "per_head", "per_head", cfg, dst_cfg=cfg.replace(num_kv_heads=H))
  one = HeadConfig(d_model=D, num_heads=1, d_k=H * K, d_v=H * V, use_bias=cfg.use_bias,
                   scale=cfg.score_scale)
  out = {"w_q": params["w_q"].reshape(D, 1, H * K), "w_k": params["w_k"].reshape(D, 1, H * K),
         "w_v": params["w_v"].reshape(D, 1, H * V), "w_o": params["w_o"].reshape(1, H * V, D)}
  if cfg.use_bias:
    out.update(b_q=params["b_q"].reshape(1, -1), b_k=params["b_k"].reshape(1, -1),
               b_v=params["b_v"].reshape(1, -1), b_o=params["b_o"])
  return out, one


def max_error(path: list[str], cfg: HeadConfig, inputs, *, dst_cfg: HeadConfig | None = None,
              seed: int = 0) -> tuple[float, float]:
  """Converts random params along `path` of variants; (max |Δy| / max |y| over the inputs,
  the largest relative error the conversions report)."""
  params = converted = random_params(path[0], cfg, seed)
  dst_cfg = dst_cfg or cfg
  rel = 0.0
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", attn.LossyConversionWarning)
    for i, (src, dst) in enumerate(zip(path, path[1:])):
      c_src, c_dst = (cfg if i == 0 else dst_cfg), dst_cfg
      converted, r = attn.convert(converted, src, dst, c_src,
                                  dst_cfg=None if c_src == c_dst else c_dst, return_error=True)
      rel = max(rel, r)
  err = 0.0
  for x, ctx, mask in inputs:
    y1 = attn.apply(path[0], params, x, ctx, cfg=cfg, mask=mask)
    y2 = attn.apply(path[-1], converted, x, ctx, cfg=dst_cfg, mask=mask)
    err = max(err, float(jnp.abs(y1 - y2).max() / jnp.abs(y1).max()))
  return err, rel


def make_inputs(cfg: HeadConfig, seed: int = 0):
  kx, kc = jax.random.split(jax.random.PRNGKey(seed + 100))
  x = jax.random.normal(kx, (B, T, cfg.d_model))
  ctx = jax.random.normal(kc, (B, S, cfg.d_model))
  padding = attn.padding_mask(jnp.array([S, S // 2]), S)
  return [(x, None, None), (x, None, attn.causal_mask(T)), (x, ctx, padding)]


def _applies(c: Converter, src: str, dst: str, cfg: HeadConfig) -> bool:
  try:
    api.check_config(src, cfg)
    api.check_config(dst, cfg)
    c.check(cfg)
  except attn.ConfigError:
    return False
  return True


def _claim(c: Converter, cfg: HeadConfig) -> str:
  """'src -> dst (exact|lossy): the first line of the converter's docstring' at cfg."""
  doc = (c.fn.__doc__ or "").strip().splitlines()
  return f"{c.name} ({'exact' if c.is_exact(cfg) else 'lossy, error reported'})" + (
      f": {doc[0]}" if doc else "")


def identities(cfg: HeadConfig) -> list[tuple[str, float, float]]:
  """(claim, max output error, reported conversion error) for every registered conversion.

  Every converter in attn.conversion.CONVERTERS whose variants and check accept
  cfg; after a lossy one, the round trip through its exact inverse; with
  grouped heads, the kv regroupers between cfg and one kv head (MQA).
  """
  inputs = make_inputs(cfg)
  rows = []
  for (src, dst), c in sorted(CONVERTERS.items()):
    if not _applies(c, src, dst, cfg):
      continue
    rows.append((_claim(c, cfg), *max_error([src, dst], cfg, inputs)))
    inverse = CONVERTERS.get((dst, src))
    if (not c.is_exact(cfg) and inverse is not None and inverse.is_exact(cfg)
        and _applies(inverse, dst, src, cfg)):
      rows.append((f"{dst} -> {src} -> {dst} (exact: {c.name} undoes {inverse.name})",
                   *max_error([dst, src, dst], cfg, inputs)))
  if cfg.num_kv_heads > 1:
    mqa = cfg.replace(num_kv_heads=1)
    for kind, c in sorted(REGROUPERS.items()):
      src_cfg, dst_cfg = (mqa, cfg) if kind == "more" else (cfg, mqa)
      rows.append((f"{_claim(c, src_cfg)} [G {src_cfg.num_kv_heads} -> {dst_cfg.num_kv_heads}]",
                   *max_error(["per_head", "per_head"], src_cfg, inputs, dst_cfg=dst_cfg)))
  return rows


def variant_rows(cfg: HeadConfig) -> list[tuple[str, int, int, int]]:
  rows = []
  for name, v in attn.VARIANTS.items():
    try:
      v.check(cfg)
    except attn.ConfigError:
      continue
    counts = attn.count.param_counts(name, cfg)  # measured where a plugin gives no closed form
    rows.append((name, counts["analytic"], counts["effective"], cfg.num_heads))
  return rows


def one_head_vs_many(cfg: HeadConfig) -> float:
  params = random_params("per_head", cfg, seed=7)
  one, cfg1 = as_one_head(params, cfg)
  x = make_inputs(cfg)[0][0]
  y_h = attn.apply("per_head", params, x, cfg=cfg)
  y_1 = attn.apply("per_head", one, x, cfg=cfg1)
  return float(jnp.abs(y_h - y_1).max() / jnp.abs(y_h).max())


def report(cfg: HeadConfig) -> str:
  """The demo's screen for cfg: the variants' counts, every conversion's identity, one head vs many."""
  lines = [f"attn demo: d_model={cfg.d_model} h={cfg.num_heads} d_k={cfg.d_k} d_v={cfg.d_v} "
           f"kv_heads={cfg.num_kv_heads} bias={cfg.use_bias}; inputs B={B} T={T} (context S={S})\n",
           "| variant | stored params / layer | effective params | attention matrices |",
           "|---|---:|---:|---:|"]
  for name, stored, eff, n_att in variant_rows(cfg):
    lines.append(f"| {name} | {stored:,} | {'n/a' if eff is None else f'{eff:,}'} | {n_att} |")
  lines += ["\n| identity | max abs error of y / max abs y | reported conversion error |", "|---|---:|---:|"]
  for claim, err, rel in identities(cfg):
    lines.append(f"| {claim} | {err:.2e} | {rel:.2e} |")
  if cfg.num_heads > 1:
    diff = one_head_vs_many(cfg)
    lines.append(f"\nQ5: {cfg.num_heads} heads of width {cfg.d_k} vs 1 head of width {cfg.num_heads * cfg.d_k}"
                 f" from the same concatenated matrices: {cfg.num_heads} attention matrices vs 1;"
                 f" max |y_h - y_1| / max |y_h| = {diff:.3f} (not the same function)")
  return "\n".join(lines)
