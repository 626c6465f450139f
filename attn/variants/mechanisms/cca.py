"""cca: ZAYA1's compressed convolutional attention (Figliolia et al. 2025, arXiv 2510.04476), as one mechanism at
on_qkv.

With W₀ = cca_depthwise_width, W₁ = cca_grouped_width, R = H/G, and q, k, v the layer's projections (biases
included), for self-attention (queries and keys of one length, token t's query beside its key):

  conv         each query and key channel through a causal depthwise convolution of W₀ taps plus a bias
               (cca_dw_*), then each head's K channels through a causal K×K convolution of W₁ taps plus a
               bias (cca_gc_*: torch's Conv1d with groups = H + G); the W₀ + W₁ − 2 tokens before the first
               are zeros, before the depthwise stage (ZAYA's F.pad), so the intermediate there is its bias
  q–k mean     q̄_h = (q_h + k_g(h))/2, k̄_g = the mean of q̄ over g's R query heads; query = conv(q) + q̄,
               key = conv(k) + k̄. With keys of another length (a context) no token has both a query and a
               key: each keeps its own projection (q̄ = q, k̄ = k); a context as long as x is paired token for
               token, as in self-attention (the hook sees lengths, not where the keys came from)
  values       the G·V value channels, flattened head-major, in halves: the first current, the second the
               previous token's (ZAYA's v_proj_current and v_proj_delayed, concatenated then split into
               heads: for G = 1 half of each head, for even G the first G/2 heads current and the rest
               delayed); the first token's delayed half is the value of a zero token, params["b_v"] (per_head's;
               0 where the variant holds no b_v)
  norm         queries and keys scaled to L2 norm √K, x·√K/max(‖x‖, eps) with eps the dtype's machine
               epsilon (ZAYA's ZayaQKNorm), the keys then times cca_temp (G,), a learned scale per kv head

before the other mechanisms' on_qk and RoPE. Decoding keeps the last W₀ + W₁ − 2 query and key projections
and the last token's value (less b_v) as the record's state, so cached decoding equals the full pass.
Counts: params (H + G)·K·(W₀ + W₁·K + 2) + G, every one read by the scores; FLOPs 2·(W₀ + W₁·K)·K·(T·H + S·G)
(the mean, the shift and the norm elementwise, not counted); the effective count is measured.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from attn.config import HeadConfig
from attn.variants.mechanisms.record import Mechanism

Array = jax.Array
Params = dict[str, Array]


def _heads(cfg: HeadConfig) -> dict[str, int]:
  return {"q": cfg.num_heads, "k": cfg.num_kv_heads}


def history(cfg: HeadConfig) -> int:
  """Tokens of query and key projections the two convolutions read before the current one."""
  return cfg.cca_depthwise_width + cfg.cca_grouped_width - 2


def _init(key: Array, cfg: HeadConfig, dtype=jnp.float32) -> Params:
  """Both convolutions the identity on their last tap (torch's order: it multiplies the current token) plus
  U(−1, 1)/√fan-in on every tap, zero biases, temperatures 1. (transformers starts cca_temp at 0, which makes
  every key 0 and no score depend on the keys until it moves.)"""
  W0, W1, K, out = cfg.cca_depthwise_width, cfg.cca_grouped_width, cfg.d_k, {}
  for i, (c, N) in enumerate(_heads(cfg).items()):
    kd, kg = jax.random.split(jax.random.fold_in(key, i))
    dw = jax.random.uniform(kd, (W0, N, K), jnp.float32, -1.0, 1.0) / W0 ** 0.5
    gc = jax.random.uniform(kg, (W1, N, K, K), jnp.float32, -1.0, 1.0) / (W1 * K) ** 0.5
    out |= {f"cca_dw_{c}": dw.at[W0 - 1].add(1.0).astype(dtype), f"cca_dw_bias_{c}": jnp.zeros((N, K), dtype),
            f"cca_gc_{c}": gc.at[W1 - 1].add(jnp.eye(K)).astype(dtype), f"cca_gc_bias_{c}": jnp.zeros((N, K), dtype)}
  return out | {"cca_temp": jnp.ones((cfg.num_kv_heads,), dtype)}


def convolve(x_BTNK: Array, dw_WNK: Array, dw_bias_NK: Array, gc_WNIO: Array, gc_bias_NO: Array,
             state_BPNK: Array | None = None) -> tuple[Array, Array]:
  """(y, new state): x preceded by state (its last W₀ + W₁ − 2 tokens; zeros when None) through the depthwise
  convolution, then each head's grouped one; in float32, returned in x's dtype."""
  W0, W1 = dw_WNK.shape[0], gc_WNIO.shape[0]
  B, T, N, K = x_BTNK.shape
  if state_BPNK is None:
    state_BPNK = jnp.zeros((B, W0 + W1 - 2, N, K), x_BTNK.dtype)
  padded = jnp.concatenate([state_BPNK.astype(x_BTNK.dtype), x_BTNK], axis=1)
  f32, dw, gc = padded.astype(jnp.float32), dw_WNK.astype(jnp.float32), gc_WNIO.astype(jnp.float32)
  mid = T + W1 - 1  # the depthwise outputs the grouped convolution reads
  h = sum(dw[j] * f32[:, j:j + mid] for j in range(W0)) + dw_bias_NK.astype(jnp.float32)
  y = sum(jnp.einsum("BTNI,NIO->BTNO", h[:, i:i + T], gc[i]) for i in range(W1)) + gc_bias_NO.astype(jnp.float32)
  return y.astype(x_BTNK.dtype), padded[:, T:]


def l2_scale(x_BTNK: Array) -> Array:
  """x·√K/max(‖x‖, eps) per head vector, eps the machine epsilon of x's dtype (ZAYA's ZayaQKNorm), in float32."""
  x = x_BTNK.astype(jnp.float32)
  norm = jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True))
  return x * (x.shape[-1] ** 0.5 / jnp.maximum(norm, float(jnp.finfo(x_BTNK.dtype).eps)))


def delayed(cfg: HeadConfig) -> np.ndarray:
  """(G, V) True on the value channels taken from the previous token: the second half, flattened head-major."""
  n = cfg.num_kv_heads * cfg.d_v
  return (np.arange(n) >= n // 2).reshape(cfg.num_kv_heads, cfg.d_v)


def _mix(params: Params, q_BTHK: Array, k_BSGK: Array, v_BSGV: Array, *, cfg: HeadConfig,
         state=None) -> tuple[Array, Array, Array]:
  B, T, H, K = q_BTHK.shape
  S, G = k_BSGK.shape[1], k_BSGK.shape[2]
  conv = {}
  for c, x in (("q", q_BTHK), ("k", k_BSGK)):
    name = f"cca_state_{c}"
    conv[c], new = convolve(x, params[f"cca_dw_{c}"], params[f"cca_dw_bias_{c}"], params[f"cca_gc_{c}"],
                            params[f"cca_gc_bias_{c}"], None if state is None or name not in state else state[name])
    if state is not None and name in state:
      state[name] = new.astype(state[name].dtype)
  q, k = q_BTHK.astype(jnp.float32), k_BSGK.astype(jnp.float32)
  if T == S:  # the q–k mean: token t's query beside its own key
    q_bar = (q + jnp.repeat(k, H // G, axis=2)) * 0.5
    k_bar = q_bar.reshape(B, T, G, H // G, K).mean(axis=3)
  else:
    q_bar, k_bar = q, k
  query = l2_scale(conv["q"].astype(jnp.float32) + q_bar)
  key = l2_scale(conv["k"].astype(jnp.float32) + k_bar) * params["cca_temp"].astype(jnp.float32)[:, None]
  fill = jnp.broadcast_to(jnp.asarray(params.get("b_v", 0.0), jnp.float32), v_BSGV.shape[2:])
  u = v_BSGV.astype(jnp.float32) - fill
  prev = jnp.zeros((B, 1, *u.shape[2:]), jnp.float32) if state is None else state["cca_state_v"].astype(jnp.float32)
  shifted = jnp.concatenate([prev, u[:, :-1]], axis=1) + fill
  if state is not None:
    state["cca_state_v"] = u[:, -1:].astype(state["cca_state_v"].dtype)
  value = jnp.where(delayed(cfg), shifted, v_BSGV.astype(jnp.float32))
  return query.astype(q_BTHK.dtype), key.astype(k_BSGK.dtype), value.astype(v_BSGV.dtype)


def _state(cfg: HeadConfig) -> dict[str, tuple[int, ...]]:
  P, K = history(cfg), cfg.d_k
  convs = {f"cca_state_{c}": (P, N, K) for c, N in _heads(cfg).items()} if P else {}
  return convs | {"cca_state_v": (1, cfg.num_kv_heads, cfg.d_v)}


def _params(cfg: HeadConfig) -> int:
  K = cfg.d_k
  return (cfg.num_heads + cfg.num_kv_heads) * K * (cfg.cca_depthwise_width + cfg.cca_grouped_width * K + 2) \
      + cfg.num_kv_heads


def _flops(cfg: HeadConfig, T: int, S: int) -> int:
  """2·W₀ per channel and token (depthwise), 2·W₁·K per output channel and token (within a head): the
  queries' H·K channels over T tokens, the keys' G·K over S."""
  K = cfg.d_k
  return 2 * (cfg.cca_depthwise_width + cfg.cca_grouped_width * K) * K * (T * cfg.num_heads + S * cfg.num_kv_heads)


CCA = Mechanism(
    name="cca", fields=("cca", "cca_depthwise_width", "cca_grouped_width"), init=_init,
    sharding={"cca_dw_q": "WHK", "cca_dw_k": "WGK", "cca_dw_bias_q": "HK", "cca_dw_bias_k": "GK",
              "cca_gc_q": "WHKK", "cca_gc_k": "WGKK", "cca_gc_bias_q": "HK", "cca_gc_bias_k": "GK", "cca_temp": "G"},
    on_qkv=_mix, state=_state, param_count=_params, flops=_flops, score_weights=_params,
    needs={"qkv_heads": "it convolves and mixes each query and key head, delays half the values, and keeps "
                        "their last projections while decoding"},
    examples=(("cca", {"cca": True}, "(H + G)·K·(W₀ + W₁·K + 2) + G", "2·(W₀ + W₁·K)·K·(T·H + S·G)"),
              ("cca 3x1", {"cca": True, "cca_depthwise_width": 3, "cca_grouped_width": 1},
               "(H + G)·K·(W₀ + W₁·K + 2) + G", "2·(W₀ + W₁·K)·K·(T·H + S·G)")),
    help="cca: ZAYA1's compressed convolutional attention: queries and keys through a depthwise then a per-head "
         "causal convolution (cca_depthwise_width, cca_grouped_width taps) plus their mean, half the values "
         "one token late, queries and keys L2-normalised, keys times a temperature per kv head")
