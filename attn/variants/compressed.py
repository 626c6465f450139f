"""compressed: per_head's heads attending to the tokens and to compressed keys and values
(DeepSeek-V4's compressed (CSA, m = 4) and heavily compressed (HCA, m = 128) attention).

Each kv head compresses the input in blocks of m = cfg.compress_block tokens (None: 4): per token a key
part c_k = x·W_CK, a value part c_v = x·W_CV and gate logits z = x·W_Z; entry n is the
softmax(z + b)-weighted sum of its block's c (per feature, b a learned bias per slot of the
block: attn.kernel.compressed.pool), then RMS-normalised with a learned scale (V4's kv_norm on the
compressor). cfg.compress_overlap (V4's CSA) gives every token two series and entry n pools 2m
slots, the previous block's first series and its own block's second. Entry keys go through the
head mechanisms' on_qk (QK-norm) as every key does, and RoPE at the position of their block's
first token (V4: n·m). Values are not rotated.

A query sees its tokens as per_head's query does (causal, kv_lengths, the layer's window: V4's
sliding window over the uncompressed recent tokens) and, in the same softmax, every entry whose
block has ended ((n + 1)·m − 1 <= its position) and whose tokens the call's masks all show,
plus the sinks (cfg.sinks, V4's per-head sinks). The kernel is attn.kernel.compressed: the
blocked kernel at long T (no T×S array), einsum otherwise.

Weights out (return_weights) are over the tokens, (B,H,T,S): a token's own weight plus, for
each entry it is pooled into, that entry's weight shared equally among the tokens the entry
pools. Rows sum to 1 (minus the sinks' share); a token a mask hides gets 0.

Decoding (init_cache / decode_cached): the cache holds the window's last tokens (a ring of
min(window, max_len) slots, or every token without a window), the compressed entries of every
ended block (max_len // m slots, normalised and rotated) and the compressor inputs of the last
P·m tokens (the block not yet complete, and with the overlap the one before it); a step pools
each block that ends inside it. Its outputs equal the causal full pass.

Not here: V4's lightning indexer on the CSA layer (its own compressor at index_head_dim, a
projection of the query latent, top-k over the entries); with attn's `indexer` mechanism on,
the layer is refused by name. Keys equal to values (V4's shared kv) are k_eq_v's, not this
variant's: here keys and values have their own projections and d_v may differ from d_k.

Params: per_head's D·(H·K + G·K + G·V) + H·V·D [+ biases], and the compressor's
P·G·(2·D + m)·(K + V) + G·(K + V): W_CK, W_CV, W_ZK, W_ZV (D,P,G,·), biases b_K, b_V (P,m,G,·),
norm scales (G,·).
FLOPs: per_head's projections, the compressor's 4·S·D·P·G·(K + V), the core 2·T·(S + S//m)·H·(K + V)
(unmasked, as per_head's counts the full T×S).
KV cache after L tokens: (min(L, window) + L // m + 2·P²·m)·G·(K + V) numbers (kv_cache_elements); per
token in the long run G·(K + V)/m with a window, G·(K + V)·(1 + 1/m) without.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attn.config import HeadConfig, invalid
from attn.kernel import compressed as ckernel
from attn.variants import cache as kv_cache
from attn.variants import mechanisms, rope
from attn.variants.base import (Options, Params, Variant, add_bias, bias, no_circuits, normal, project_heads,
                                project_out, queries_and_keys, standard_param_count,
                                standard_score_weights)

NORM_EPS = 1e-6  # V4's rms_norm_eps
DEFAULT_BLOCK = 4  # compress_block None: V4's compressed (CSA) rate


def block(cfg: HeadConfig) -> int:
  """m: cfg.compress_block, or DEFAULT_BLOCK where unset."""
  return DEFAULT_BLOCK if cfg.compress_block is None else cfg.compress_block


def check(cfg: HeadConfig) -> None:
  if cfg.probability != "softmax":
    raise invalid("probability", cfg.probability, '"softmax" for variant compressed: the tokens and '
                  "the compressed entries share one softmax")
  if mechanisms.selector(cfg) is not None:
    raise invalid("extra", dict(cfg.extra), "no key selection (moba, indexer) with variant compressed: "
                  "DeepSeek-V4's indexer over the compressed entries is not implemented")
  if mechanisms.needs_explicit_logits(cfg):
    raise invalid("extra", dict(cfg.extra), "no mechanism acting on the logits outside the kernel "
                  "with variant compressed: its kernel takes window, sinks and softcap only")


def _series(cfg: HeadConfig) -> int:
  return 2 if cfg.compress_overlap else 1


def init(key, cfg: HeadConfig, dtype=jnp.float32) -> Params:
  D, H, G, K, V, m, P = (cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_k, cfg.d_v,
                         block(cfg), _series(cfg))
  ks = jax.random.split(key, 8)
  params = {
      "w_q": normal(ks[0], (D, H, K), D, dtype), "w_k": normal(ks[1], (D, G, K), D, dtype),
      "w_v": normal(ks[2], (D, G, V), D, dtype), "w_o": normal(ks[3], (H, V, D), H * V, dtype),
      "w_ck": normal(ks[4], (D, P, G, K), D, dtype), "w_cv": normal(ks[5], (D, P, G, V), D, dtype),
      "w_zk": normal(ks[6], (D, P, G, K), D, dtype), "w_zv": normal(ks[7], (D, P, G, V), D, dtype),
      "b_ck": jnp.zeros((P, m, G, K), dtype), "b_cv": jnp.zeros((P, m, G, V), dtype),
      "n_ck": jnp.ones((G, K), dtype), "n_cv": jnp.ones((G, V), dtype),
  }
  return add_bias(params, cfg, {"b_q": (H, K), "b_k": (G, K), "b_v": (G, V), "b_o": (D,)}, dtype)


def _project(x_BSD, w_DPGX):
  D, P, G, X = w_DPGX.shape
  return (x_BSD.reshape(-1, D) @ w_DPGX.reshape(D, -1)).reshape(*x_BSD.shape[:-1], P, G, X)


def compressor_inputs(params: Params, c_BSD) -> tuple:
  """Per token (c_k, z_k, c_v, z_v), each (B,S,P,G,·)."""
  return tuple(_project(c_BSD, params[n]) for n in ("w_ck", "w_zk", "w_cv", "w_zv"))


def _norm(x_BNGX, scale_GX):
  x = x_BNGX.astype(jnp.float32)
  y = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + NORM_EPS)
  return (y * scale_GX.astype(jnp.float32)).astype(x_BNGX.dtype)


def _finish(params: Params, q_BTHK, ck_BNGK, cv_BNGV, positions_N, cfg: HeadConfig):
  """Pooled entries normalised; the keys through on_qk and RoPE at their blocks' first positions."""
  ck_BNGK, cv_BNGV = _norm(ck_BNGK, params["n_ck"]), _norm(cv_BNGV, params["n_cv"])
  _, ck_BNGK = mechanisms.on_qk(params, q_BTHK, ck_BNGK, cfg)
  if cfg.rope_dim:
    ck_BNGK = rope.rotate(ck_BNGK, positions_N, cfg)
  return ck_BNGK, cv_BNGV


def compress(params: Params, c_BSD, q_BTHK, cfg: HeadConfig, key_positions=None):
  """(keys (B,N,G,K), values (B,N,G,V)) of the N = S // m complete blocks of c."""
  m = block(cfg)
  c_k, z_k, c_v, z_v = compressor_inputs(params, c_BSD)
  ck = ckernel.pool(c_k, z_k, params["b_ck"], m)
  cv = ckernel.pool(c_v, z_v, params["b_cv"], m)
  N = ck.shape[1]
  pos = jnp.arange(N) * m if key_positions is None else jnp.asarray(key_positions)[..., :N * m:m]
  return _finish(params, q_BTHK, ck, cv, pos, cfg)


def _token_weights(w_BHTX, S: int, m: int, span: int):
  """Weights over [tokens | entries] as weights over the tokens (module docstring)."""
  tok, ent = w_BHTX[..., :S], w_BHTX[..., S:]
  N = ent.shape[-1]
  if N == 0:
    return tok
  share = jnp.repeat(ent, m, axis=-1)  # entry n over its own block
  if span > m:  # and over the previous block (entry 0 has none: its m tokens take it all)
    n_tokens = jnp.where(jnp.arange(N) == 0, m, span)
    share = jnp.repeat(ent / n_tokens, m, axis=-1)
    share = share + jnp.pad(jnp.repeat((ent / n_tokens)[..., 1:], m, axis=-1),
                            [(0, 0)] * 3 + [(0, m)])
  else:
    share = share / m
  return tok + jnp.pad(share, [(0, 0)] * 3 + [(0, S - N * m)])


def _core(params: Params, q_BTHK, k_BSGK, v_BSGV, ck, cv, *, cfg: HeadConfig, opts: Options,
          entry_mask=None, window="layer"):
  args = mechanisms.kernel_args(params, cfg)
  m = block(cfg)
  out = ckernel.attention(q_BTHK, k_BSGK, v_BSGV, ck, cv, m=m, span=_series(cfg) * m,
                          mask=opts.mask, entry_mask_=entry_mask, is_causal=opts.is_causal,
                          kv_lengths=opts.kv_lengths, scale=cfg.score_scale,
                          window=args["window"] if window == "layer" else window,
                          sinks=args["sinks"], softcap=args["softcap"],
                          return_weights=opts.return_weights,
                          impl="einsum" if opts.return_weights else "auto")
  if not opts.return_weights:
    return out, None
  o, w = out
  return o, _token_weights(w, k_BSGK.shape[1], m, _series(cfg) * m)


def apply(params: Params, x_BTD, context_BSD=None, *, cfg: HeadConfig, opts: Options = Options()):
  """Queries against the tokens (window) and the compressed entries (module docstring)."""
  c_BSD = x_BTD if context_BSD is None else context_BSD
  q_BTHK = project_heads(x_BTD, params["w_q"], bias(params, "b_q"))
  k_BSGK = project_heads(c_BSD, params["w_k"], bias(params, "b_k"))
  v_BSGV = project_heads(c_BSD, params["w_v"], bias(params, "b_v"))
  ck, cv = compress(params, c_BSD, q_BTHK, cfg,
                    None if opts.qk_positions is None else opts.qk_positions[1])
  q_BTHK, k_BSGK = queries_and_keys(params, q_BTHK, k_BSGK, cfg=cfg, opts=opts)
  o_BTHV, w = _core(params, q_BTHK, k_BSGK, v_BSGV, ck, cv, cfg=cfg, opts=opts)
  return project_out(params, x_BTD, o_BTHV, cfg=cfg, opts=opts), w


# Decoding

def init_cache(params: Params, cfg: HeadConfig, batch_size: int, max_len: int,
               dtype=jnp.float32) -> dict:
  """Empty cache (module docstring): the token ring k, v; entries ck, cv; the compressor's last
  P·m tokens' inputs."""
  del params
  G, K, V, m, P = cfg.num_kv_heads, cfg.d_k, cfg.d_v, block(cfg), _series(cfg)
  W, N = kv_cache.slots(cfg, max_len), max_len // m
  z = lambda *shape: jnp.zeros((batch_size, *shape), dtype)
  return {"k": z(W, G, K), "v": z(W, G, V), "ck": z(N, G, K), "cv": z(N, G, V),
          "buf_ck": z(P * m, P, G, K), "buf_zk": z(P * m, P, G, K),
          "buf_cv": z(P * m, P, G, V), "buf_zv": z(P * m, P, G, V)}


def _step_entries(params: Params, cache: dict, new: tuple, index, T: int, cfg: HeadConfig, q_BTHK):
  """The entries of the blocks that end inside this step, and their slots (max_len // m + 1 where
  none): pooled from the buffered and new compressor inputs."""
  m, P = block(cfg), _series(cfg)
  L = P * m
  order = (index + jnp.arange(L)) % L  # buffer slots by position: index - L .. index - 1
  pos = index - L + jnp.arange(L + T)
  stretch = []
  for name, a in zip(("buf_ck", "buf_zk", "buf_cv", "buf_zv"), new):
    s = jnp.concatenate([cache[name][:, order], a.astype(cache[name].dtype)], axis=1)
    if name.startswith("buf_z"):  # slots before position 0 weigh nothing
      s = jnp.where((pos >= 0)[None, :, None, None, None], s, -jnp.inf)
    stretch.append(s)
  J = T // m + 1
  n_J = index // m + jnp.arange(J)
  valid_J = (n_J + 1) * m <= index + T
  start_J = m - index % m + jnp.arange(J) * m  # first slot of each block's L-token stretch

  def one(start):
    c_k, z_k, c_v, z_v = (jax.lax.dynamic_slice_in_dim(s, start, L, axis=1) for s in stretch)
    return (ckernel.pool(c_k, z_k, params["b_ck"], m)[:, -1],
            ckernel.pool(c_v, z_v, params["b_cv"], m)[:, -1])

  ck_JBGK, cv_JBGV = jax.vmap(one)(start_J)
  ck, cv = _finish(params, q_BTHK, jnp.moveaxis(ck_JBGK, 0, 1), jnp.moveaxis(cv_JBGV, 0, 1),
                   n_J * m, cfg)
  N = cache["ck"].shape[1]
  return ck, cv, jnp.where(valid_J, n_J, N + 1)


def decode_cached(params: Params, x_BTD, cache: dict, index, *, cfg: HeadConfig, head_mask=None):
  """y for x's tokens at positions index.. and the cache with them (module docstring)."""
  T = x_BTD.shape[1]
  m, P = block(cfg), _series(cfg)
  pos_T = index + jnp.arange(T)
  q_BTHK = project_heads(x_BTD, params["w_q"], bias(params, "b_q"))
  k_BTGK = project_heads(x_BTD, params["w_k"], bias(params, "b_k"))
  v_BTGV = project_heads(x_BTD, params["w_v"], bias(params, "b_v"))
  new = compressor_inputs(params, x_BTD)
  ck, cv, slot_J = _step_entries(params, cache, new, index, T, cfg, q_BTHK)
  out = dict(cache)
  out["ck"] = cache["ck"].at[:, slot_J].set(ck.astype(cache["ck"].dtype), mode="drop")
  out["cv"] = cache["cv"].at[:, slot_J].set(cv.astype(cache["cv"].dtype), mode="drop")
  L = P * m
  keep = min(T, L)
  slot_M = (index + T - keep + jnp.arange(keep)) % L
  for name, a in zip(("buf_ck", "buf_zk", "buf_cv", "buf_zv"), new):
    out[name] = cache[name].at[:, slot_M].set(a[:, T - keep:].astype(cache[name].dtype))
  q_BTHK, k_BTGK = queries_and_keys(params, q_BTHK, k_BTGK, cfg=cfg,
                                    opts=Options(qk_positions=(pos_T, pos_T)))
  n_slots = cache["k"].shape[1]
  if cfg.window is not None:  # a ring: attend to [ring | new tokens], then write the new ones
    mask = kv_cache.ring_mask(index, T, n_slots, cfg.window)
    k_all = jnp.concatenate([cache["k"], k_BTGK.astype(cache["k"].dtype)], axis=1)
    v_all = jnp.concatenate([cache["v"], v_BTGV.astype(cache["v"].dtype)], axis=1)
    w = min(T, n_slots)
    slot_W = (index + T - w + jnp.arange(w)) % n_slots
    out["k"] = cache["k"].at[:, slot_W].set(k_BTGK[:, T - w:].astype(cache["k"].dtype))
    out["v"] = cache["v"].at[:, slot_W].set(v_BTGV[:, T - w:].astype(cache["v"].dtype))
  else:
    mask = kv_cache.causal_mask(index, T, n_slots)
    out["k"] = jax.lax.dynamic_update_slice_in_dim(cache["k"], k_BTGK.astype(cache["k"].dtype), index, 1)
    out["v"] = jax.lax.dynamic_update_slice_in_dim(cache["v"], v_BTGV.astype(cache["v"].dtype), index, 1)
    k_all, v_all = out["k"], out["v"]
  N = out["ck"].shape[1]
  ended = ((jnp.arange(N) + 1) * m <= (pos_T + 1)[:, None])[None, None]
  opts = Options(mask=mask, head_mask=head_mask)
  o_BTHV, _ = _core(params, q_BTHK, k_all, v_all, out["ck"], out["cv"], cfg=cfg, opts=opts,
                    entry_mask=ended, window=None)
  return project_out(params, x_BTD, o_BTHV, cfg=cfg, opts=opts), out


def kv_cache_elements(cfg: HeadConfig, length: int) -> int:
  """Numbers the cache holds for `length` tokens: the window's (or every) token's key and value,
  length // m entries, and the compressor's inputs of P·m tokens (P series, keys' and values'
  parts and gates): (min(length, window) + length // m + 2·P²·m)·G·(K + V)."""
  G, K, V, m, P = cfg.num_kv_heads, cfg.d_k, cfg.d_v, block(cfg), _series(cfg)
  tokens = length if cfg.window is None else min(cfg.window, length)
  return (tokens + length // m + 2 * P * P * m) * G * (K + V)


def param_count(cfg: HeadConfig) -> int:
  D, G, K, V, m, P = (cfg.d_model, cfg.num_kv_heads, cfg.d_k, cfg.d_v, block(cfg),
                      _series(cfg))
  return standard_param_count(cfg) + P * G * (2 * D + m) * (K + V) + G * (K + V)


def flops(cfg: HeadConfig, T: int, S: int) -> int:
  """per_head's projections, the compressor's 2·S·D·2·P·G·(K + V), the core over S + S // m keys
  (each query against every key and entry: the unmasked count, as per_head's)."""
  D, H, G, K, V, m, P = (cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_k, cfg.d_v,
                         block(cfg), _series(cfg))
  N = S // m
  proj = 2 * D * (T * H * K + S * G * K + S * G * V) + 2 * T * H * V * D
  comp = 4 * S * D * P * G * (K + V)
  return proj + comp + 2 * T * (S + N) * H * (K + V)


def score_weights(cfg: HeadConfig) -> int:
  """W_Q, W_K, and the entry keys' W_CK, W_ZK and norm scale: D·(H + G)·K + (2·D·P + 1)·G·K."""
  return standard_score_weights(cfg) + (2 * cfg.d_model * _series(cfg) + 1) * cfg.num_kv_heads * cfg.d_k


VARIANT = Variant(
    name="compressed",
    lacks={"qkv_heads": "compressed pools blocks of keys and values into a cache of its own"},
    init=init,
    apply=apply,
    param_count=param_count,
    flops=flops,
    score_weights=score_weights,
    check=check,
    # Y: the series, W: a block's slots (replicated letters; P would be fused's packed split).
    sharding={"w_ck": "DYGK", "w_cv": "DYGV", "w_zk": "DYGK", "w_zv": "DYGV", "b_ck": "YWGK",
              "b_cv": "YWGV", "n_ck": "GK", "n_cv": "GV"},
    fields=("compress_block", "compress_overlap"),
    circuits=no_circuits("compressed", "a variant with per-head W_QK: compressed's entries are "
                         "keys pooled by an input-dependent softmax, no fixed bilinear form"),
    init_cache=init_cache,
    decode_cached=decode_cached,
    kv_cache_elements=kv_cache_elements,
)
