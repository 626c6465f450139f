"""attn bench --decode: per-token decode time and KV-cache bytes of every variant at long contexts.

One attention layer (HeadConfig D=512, H=8, d_k=d_v=64, B=1, float32; mla's
latent d_c = 4·d_k = 256, no RoPE), plus per_head with G=2 (GQA) and G=1 (MQA).
A decode step is attn.variants.cache.decode_step, jitted, for one new token at
position L against a cache of L+1 slots (context length L); its time is the
median of --repeats calls, all candidates of one L timed round-robin. Cache
bytes are the arrays the cache holds (width · 4 bytes · L per layer and
sequence), checked against Variant.kv_cache_width. Baselines: the full
recompute (the fused layer re-run over all L+1 tokens, causal, for each new
token) and, when torch is installed, torch's MHA with its own k/v cache (the
new token's q, k, v projected by one Linear, written into preallocated
(1,H,L+1,d) tensors, F.scaled_dot_product_attention, the output Linear).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable

import jax
import jax.numpy as jnp

import attn
from attn.bench import peers as peers_lib
from attn.config import HeadConfig
from attn.variants import cache as kv_cache
from attn.variants.base import Options

CONTEXTS = (256, 1024, 4096)
CFG = HeadConfig(d_model=512, num_heads=8, d_k=64, d_v=64)
EXTRA_ROWS = {"per_head G=2 (GQA)": ("per_head", {"num_kv_heads": 2}),
              "per_head G=1 (MQA)": ("per_head", {"num_kv_heads": 1})}


def rows_for(variants: list[str], cfg: HeadConfig) -> dict[str, tuple[str, HeadConfig]]:
  """Row label -> (variant, config): every variant at cfg, then GQA and MQA per_head."""
  out = {v: (v, cfg) for v in variants}
  if "per_head" in variants:
    for label, (v, changes) in EXTRA_ROWS.items():
      if cfg.num_heads % changes["num_kv_heads"] == 0:
        out[label] = (v, dataclasses.replace(cfg, **changes))
  return out


def _decode_case(variant: str, cfg: HeadConfig, L: int) -> tuple[Callable[[], Any], int]:
  """A call that decodes one token at position L, and the cache's bytes per token."""
  var = attn.VARIANTS[variant]
  params = var.init(jax.random.PRNGKey(0), cfg)
  cache = kv_cache.init(var, params, cfg, 1, L + 1)
  cache = {k: jax.random.normal(jax.random.PRNGKey(1), a.shape, a.dtype) for k, a in cache.items()}
  x_B1D = jax.random.normal(jax.random.PRNGKey(2), (1, 1, cfg.d_model))
  step = jax.jit(lambda p, x, c, i: kv_cache.decode_step(var, p, x, c, i, cfg=cfg))
  index = jnp.asarray(L, jnp.int32)
  bytes_per_token = sum(a.nbytes for a in cache.values()) // (L + 1)
  assert kv_cache.width(cache, cfg) * 4 == bytes_per_token == var.kv_cache_width(cfg) * 4
  return peers_lib.block(step, params, x_B1D, cache, index), bytes_per_token


def _recompute_case(cfg: HeadConfig, L: int) -> Callable[[], Any]:
  """The fused layer over all L+1 tokens, causal: what each token costs without a cache."""
  var = attn.VARIANTS["fused"]
  params = var.init(jax.random.PRNGKey(0), cfg)
  x_BSD = jax.random.normal(jax.random.PRNGKey(2), (1, L + 1, cfg.d_model))
  causal = Options(is_causal=True)
  f = jax.jit(lambda p, x: var.apply(p, x, cfg=cfg, opts=causal)[0][:, -1])
  return peers_lib.block(f, params, x_BSD)


def _torch_case(cfg: HeadConfig, L: int) -> Callable[[], Any] | None:
  """torch MHA decoding one token against its own preallocated k/v cache; None without torch."""
  try:
    import torch
    import torch.nn.functional as F
  except ImportError:
    return None
  D, H, K = cfg.d_model, cfg.num_heads, cfg.d_k
  torch.manual_seed(0)
  qkv, out = torch.nn.Linear(D, 3 * H * K), torch.nn.Linear(H * K, D)
  k_cache, v_cache = torch.randn(1, H, L + 1, K), torch.randn(1, H, L + 1, K)
  x = torch.randn(1, 1, D)

  @torch.no_grad()
  def step():
    q, k, v = qkv(x).view(1, 1, 3, H, K).permute(2, 0, 3, 1, 4)
    k_cache[:, :, L:L + 1] = k
    v_cache[:, :, L:L + 1] = v
    o = F.scaled_dot_product_attention(q, k_cache, v_cache)
    return out(o.transpose(1, 2).reshape(1, 1, H * K))

  return step


def run_decode(variants: list[str], repeats: int, contexts=CONTEXTS, cfg: HeadConfig = CFG,
               torch_peer: bool = True, round_robin=None, log=print) -> dict[str, Any]:
  """Per context: ms per decoded token of each row, the baselines, and cache bytes per token."""
  rows = rows_for(variants, cfg)
  out: dict[str, Any] = {"cfg": dataclasses.asdict(cfg), "contexts": list(contexts),
                         "bytes_per_token": {}, "ms": {}}
  for L in contexts:
    log(f"[decode] context {L} ...")
    jax_calls, torch_calls = {}, {}
    for label, (variant, c) in rows.items():
      jax_calls[label], out["bytes_per_token"][label] = _decode_case(variant, c, L)
    jax_calls["fused, full recompute"] = _recompute_case(cfg, L)
    t = _torch_case(cfg, L) if torch_peer else None
    if t is not None:
      torch_calls["torch MHA + own k/v cache"] = t
    times = round_robin([g for g in (jax_calls, torch_calls) if g], repeats)
    out["ms"][L] = {k: 1e3 * v["median_s"] for k, v in times.items()}
  return out


def markdown(r: dict[str, Any]) -> str:
  """The table: rows × contexts, ms per token, cache MB at the longest context, time growth."""
  Ls = r["contexts"]
  labels = list(r["ms"][Ls[0]])
  head = ("| row | cache B/token | cache MB at " + str(Ls[-1]) + " | "
          + " | ".join(f"ms/token at {L}" for L in Ls) + f" | time {Ls[-1]} ÷ {Ls[0]} |")
  lines = [head, "|---|" + "---:|" * (len(Ls) + 3)]
  for label in labels:
    b = r["bytes_per_token"].get(label)
    cache = (f"{b:,} | {b * Ls[-1] / 1e6:.2f}" if b is not None else "– | –")
    ms = " | ".join(f"{r['ms'][L][label]:.3f}" for L in Ls)
    lines.append(f"| {label} | {cache} | {ms} | {r['ms'][Ls[-1]][label] / r['ms'][Ls[0]][label]:.1f} |")
  return "\n".join(lines)


def report(variants: list[str], repeats: int, quick: bool, torch_peer: bool, info: dict[str, Any], out: str | None,
           log: Callable[[str], None]) -> int:
  """`attn bench --decode`: the header, the table, and the JSON written to `out` where given; the exit status."""
  from attn.bench.timing import round_robin
  contexts = (64, 256) if quick else CONTEXTS
  print(f"# attn bench --decode\n\n{info.get('cpu_kind', info['cpu'])}, {info['cores']} cores, {info['device']}; "
        f"load average at start {info['load_average']}\n\nOne attention layer, D=512, H=8, "
        "d_k=d_v=64 (mla: d_c=256), B=1, float32, one token decoded at position L against a "
        "cache of L+1 slots (attn.bench.decode). Medians of ms per decoded token.\n")
  r = run_decode(variants, repeats, contexts, torch_peer=torch_peer, round_robin=round_robin, log=log)
  print(markdown(r))
  if out:
    with open(out, "w") as f:
      json.dump({"machine": info, "repeats": repeats, "decode": r}, f, indent=1)
    log(f"wrote {out}")
  return 0
