"""What `attn bench` times: attn's layers and the peers, as forward and forward+backward calls.

Every candidate is a dict {"fwd": call, "fb": call, "peak_bytes": int or None}
whose calls block until done. JAX candidates are compiled here (their
peak_bytes is XLA's buffer assignment for the forward+backward call); torch
candidates have none. The peers at the standard shapes are whole layers
(flax.nnx.MultiHeadAttention, torch.nn.MultiheadAttention); at the long
shapes every core sits behind the same projections: attn's fused layer with
the blocked or einsum kernel, with jax.nn.dot_product_attention, and torch's
Linear + F.scaled_dot_product_attention + Linear.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import jax
import jax.numpy as jnp

from attn import kernel
from attn.config import HeadConfig
from attn.variants import fused
from attn.variants.base import Options

Candidate = dict[str, Any]


def threads() -> int:
  """Cores this process may use: XLA's CPU thread pool uses one thread per core."""
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:
    return os.cpu_count() or 1


def block(f, *args) -> Callable[[], Any]:
  return lambda: jax.block_until_ready(f(*args))


def peak_bytes(compiled) -> int | None:
  """XLA's assigned bytes for one call: arguments + outputs + temporaries - aliased."""
  try:
    m = compiled.memory_analysis()
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
               - m.alias_size_in_bytes)
  except Exception:  # memory_analysis is not available on every backend
    return None


def jax_pair(apply: Callable, params, x, dtype, *, max_bytes: int | None = None) -> Candidate:
  """Forward and forward+backward calls of y = apply(params, x), with a fixed cotangent.

  With max_bytes, a forward+backward whose compiled buffers exceed it is not
  run: the candidate is {"skip": reason} instead.
  """
  ct = jax.random.normal(jax.random.PRNGKey(7), x.shape, jnp.float32).astype(dtype)
  # ct is an argument, not a closure constant, which XLA would try to fold into the program.
  fb = jax.jit(jax.grad(lambda p, x, ct: jnp.sum((apply(p, x) * ct).astype(jnp.float32)),
                        argnums=(0, 1))).lower(params, x, ct).compile()
  peak = peak_bytes(fb)
  if max_bytes is not None and peak is not None and peak > max_bytes:
    return {"skip": f"needs {peak / 2**30:.1f} GB of XLA buffers for forward+backward, more "
                    f"than the {max_bytes / 2**30:.1f} GB budget (half the available memory)"}
  fwd = jax.jit(apply).lower(params, x).compile()
  return {"fwd": block(fwd, params, x), "fb": block(fb, params, x, ct), "peak_bytes": peak}


def _input(B: int, T: int, D: int, dtype):
  return jax.random.normal(jax.random.PRNGKey(1), (B, T, D)).astype(dtype)


def variant_case(variant, cfg: HeadConfig, B: int, T: int, dtype, mask,
                 is_causal: bool = False) -> Candidate:
  """One registered variant at its default attention core."""
  params = variant.init(jax.random.PRNGKey(0), cfg, dtype)
  opts = Options(mask=mask, is_causal=is_causal)
  apply = lambda p, x: variant.apply(p, x, None, cfg=cfg, opts=opts)[0]
  return jax_pair(apply, params, _input(B, T, cfg.d_model, dtype), dtype)


def fused_case(cfg: HeadConfig, B: int, T: int, dtype, *, impl: str, mask=None,
               is_causal: bool = False, max_bytes: int | None = None) -> Candidate:
  """The fused variant's projections around one attention core: impl "blocked", "einsum", "xla"."""
  params = fused.init(jax.random.PRNGKey(0), cfg, dtype)
  opts = Options(mask=mask, is_causal=is_causal, impl=impl)
  apply = lambda p, x: fused.apply(p, x, None, cfg=cfg, opts=opts)[0]
  return jax_pair(apply, params, _input(B, T, cfg.d_model, dtype), dtype, max_bytes=max_bytes)


def core_case(cfg: HeadConfig, B: int, T: int, dtype, *, is_causal: bool,
              window: int | None = None, impl: str = "blocked") -> Candidate:
  """The blocked attention core alone, no projections: gradients for q (the input), k and v."""
  keys = jax.random.split(jax.random.PRNGKey(3), 3)
  G, K, V = cfg.num_kv_heads, cfg.d_k, cfg.d_v
  q = jax.random.normal(keys[0], (B, T, cfg.num_heads, K)).astype(dtype)
  kv = {"k": jax.random.normal(keys[1], (B, T, G, K)).astype(dtype),
        "v": jax.random.normal(keys[2], (B, T, G, V)).astype(dtype)}
  apply = lambda p, q: kernel.attention(q, p["k"], p["v"], is_causal=is_causal, window=window,
                                        impl=impl)
  return jax_pair(apply, kv, q, dtype)


def _selection_inputs(cfg: HeadConfig, B: int, T: int, dtype):
  """(q, params with k, v and the selector's own, x, the selecting mechanism) of random inputs."""
  from attn.variants import mechanisms
  keys = jax.random.split(jax.random.PRNGKey(3), 5)
  G, K, V = cfg.num_kv_heads, cfg.d_k, cfg.d_v
  q = jax.random.normal(keys[0], (B, T, cfg.num_heads, K)).astype(dtype)
  params = {"k": jax.random.normal(keys[1], (B, T, G, K)).astype(dtype),
            "v": jax.random.normal(keys[2], (B, T, G, V)).astype(dtype)}
  m = mechanisms.selector(cfg)
  if m.init is not None:
    params.update(m.init(keys[3], cfg, dtype))
  x = jax.random.normal(keys[4], (B, T, cfg.d_model)).astype(dtype)  # nsa's gates read the input
  return q, params, x, m


def selection_core_case(cfg: HeadConfig, B: int, T: int, dtype) -> Candidate:
  """The attention core with cfg's key selection (extra: moba, indexer or nsa), causal, no projections:
  the selector and the kernels that compute only the chosen keys (base.core at T·S past the blocked
  threshold); gradients for q (the input), k, v and the selector's parameters."""
  from attn.variants import base
  q, params, x, _ = _selection_inputs(cfg, B, T, dtype)
  opts = base.Options(is_causal=True, impl="blocked")
  apply = lambda p, q: base.core(p, q, p["k"], p["v"], cfg=cfg, opts=opts, x_BTD=x)[0]
  return jax_pair(apply, params, q, dtype)


def selector_case(cfg: HeadConfig, B: int, T: int, dtype) -> Candidate:
  """cfg's key selection alone (extra: moba or indexer), causal: what selection_core_case's core spends
  choosing the keys (MoBA's block means and top-k, the indexer's scores and top-k), on the same inputs.
  A selection has no gradient, so its forward is also its share of the core's forward+backward: "fb"
  times the forward again."""
  q, params, _, m = _selection_inputs(cfg, B, T, dtype)
  select = lambda p, q: m.select(p, q, p["k"], cfg=cfg, is_causal=True, kv_lengths=None, mask=None,
                                 dense=False, index=None).args
  fwd = jax.jit(select).lower(params, q).compile()
  call = block(fwd, params, q)
  return {"fwd": call, "fb": call, "peak_bytes": peak_bytes(fwd)}


def flax_case(cfg: HeadConfig, B: int, T: int, dtype, mask) -> Candidate:
  from flax import nnx
  layer = nnx.MultiHeadAttention(
      num_heads=cfg.num_heads, in_features=cfg.d_model, qkv_features=cfg.num_heads * cfg.d_k,
      out_features=cfg.d_model, decode=False, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0))
  graph, state = nnx.split(layer)
  apply = lambda s, x: nnx.merge(graph, s)(x, mask=mask, deterministic=True)
  return jax_pair(apply, state, _input(B, T, cfg.d_model, dtype), dtype)


def _torch_dtype(torch, dtype_name: str):
  return {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]


def torch_device(torch) -> str:
  """"cuda" when torch sees a GPU (the bench then runs torch there, beside jax's), else "cpu"."""
  return "cuda" if torch.cuda.is_available() else "cpu"


def _torch_calls(torch, layer, params, B: int, T: int, D: int, tdtype) -> Candidate:
  """Forward (no grad) and forward+backward (grads of params and x) calls of a torch layer."""
  torch.manual_seed(0)
  device = torch_device(torch)
  x = torch.randn(B, T, D, dtype=tdtype, device=device)
  ct = torch.randn(B, T, D, dtype=tdtype, device=device)
  params = list(params)
  sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

  def fwd():
    with torch.no_grad():
      layer(x)
    sync()

  def fb():
    xg = x.detach().requires_grad_(True)
    for p in params:
      p.grad = None
    layer(xg).backward(ct)
    sync()
  return {"fwd": fwd, "fb": fb, "peak_bytes": None}


def torch_mha_case(cfg: HeadConfig, B: int, T: int, dtype_name: str,
                   causal: bool) -> Candidate | None:
  """torch.nn.MultiheadAttention, when installed and K = D / H (torch's only option)."""
  try:
    import torch
  except ImportError:
    return None
  if cfg.num_heads * cfg.d_k != cfg.d_model:
    return None
  torch.set_num_threads(threads())
  torch.manual_seed(0)
  mha = torch.nn.MultiheadAttention(cfg.d_model, cfg.num_heads, batch_first=True).to(
      _torch_dtype(torch, dtype_name)).to(torch_device(torch))
  # torch's boolean attn_mask is True where attention is NOT allowed.
  kw = {"need_weights": False}
  if causal:
    kw.update(attn_mask=torch.ones(T, T, dtype=torch.bool, device=torch_device(torch)).triu(1),
              is_causal=True)
  return _torch_calls(torch, lambda x: mha(x, x, x, **kw)[0], mha.parameters(), B, T,
                      cfg.d_model, _torch_dtype(torch, dtype_name))


# torch SDPA's backends by attn bench's name: torch.nn.attention.SDPBackend members.
SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                 "math": "MATH"}


def torch_sdpa_case(cfg: HeadConfig, B: int, T: int, dtype_name: str,
                    causal: bool, backend: str | None = None) -> Candidate | None:
  """torch Linear(D, 3·H·K) + F.scaled_dot_product_attention + Linear(H·K, D), when installed.

  backend, one of SDPA_BACKENDS, pins SDPA to that kernel (torch.nn.attention.sdpa_kernel); a
  backend that cannot run here gives {"skip": reason}.
  """
  try:
    import torch
  except ImportError:
    return None
  if cfg.d_k != cfg.d_v or cfg.num_kv_heads != cfg.num_heads:
    return None
  torch.set_num_threads(threads())
  tdtype, device = _torch_dtype(torch, dtype_name), torch_device(torch)
  torch.manual_seed(0)
  H, K, D = cfg.num_heads, cfg.d_k, cfg.d_model
  qkv = torch.nn.Linear(D, 3 * H * K).to(tdtype).to(device)
  out = torch.nn.Linear(H * K, D).to(tdtype).to(device)
  pin = None
  if backend is not None:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    pin = lambda: sdpa_kernel(getattr(SDPBackend, SDPA_BACKENDS[backend]))

  def layer(x):
    q, k, v = qkv(x).view(B, T, 3, H, K).permute(2, 0, 3, 1, 4)
    # torch's is_causal is top-left aligned; with T = S it is attn's causal mask.
    if pin is None:
      o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    else:
      with pin():
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return out(o.transpose(1, 2).reshape(B, T, H * K))
  case = _torch_calls(torch, layer, [*qkv.parameters(), *out.parameters()], B, T, D, tdtype)
  if backend is not None:
    try:  # a pinned backend that cannot run this call raises on the first call
      case["fb"]()
    except RuntimeError as e:
      return {"skip": f"torch SDPA's {backend} backend does not run here ({str(e).splitlines()[0][:160]})"}
  return case


def matmul_cases(dtype, dtype_name: str, n: int) -> dict[str, Callable[[], Any]]:
  """An n³ matmul in jnp (and torch): the machine's rate, measured in the same rounds."""
  a = jax.random.normal(jax.random.PRNGKey(2), (n, n)).astype(dtype)
  cases = {"jnp": block(jax.jit(jnp.matmul), a, a)}
  try:
    import torch
    device = torch_device(torch)
    ta = torch.randn(n, n, dtype=_torch_dtype(torch, dtype_name), device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    cases["torch"] = lambda: (ta @ ta, sync())
  except ImportError:
    pass
  return cases


def available_bytes() -> int | None:
  """MemAvailable from /proc/meminfo, or None where there is none."""
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return None
