"""compressed_shared: DeepSeek-V4's attention layer whole: one projection serving as keys and
values, a low-rank query, the window, sinks, compressed entries (optional) and the grouped
low-rank output.

Per layer, with ε = cfg.latent_norm_eps (None: 1e-6, V4's rms_norm_eps):
  query     c_q = RMSNorm(x·W_DQ)·s_q (Q = cfg.q_latent_dim, learned scale), q = c_q·W_UQ (H,K),
            then each head RMS-normalised without a scale (V4's q_a_norm, q_b_proj, q_b_norm);
            q_latent_dim None: q = x·W_Q (H,K), normalised the same way;
  key=value k = RMSNorm(x·W_KV)·s_kv per kv head (V4's kv_proj and kv_norm): rotated by RoPE at its
            position, and the same rotated vector is the value (V4's K = V);
  entries   with cfg.compress_block = m, the `compressed` variant's pooling of blocks of m tokens
            (two series with cfg.compress_overlap: V4's CSA, m = 4; one: HCA, m = 128) on the key
            part only (W_CK, W_ZK, b_CK, its norm scale), rotated at the block's first position and
            used as key and value; None: no entries (V4's sliding_attention layers);
  attention one softmax over the window's tokens and the ended entries, with the sinks
            (attn.kernel.compressed, or attn.kernel without entries), scale 1/√K;
  output    each head's output turned back by RoPE at the query's position (angle −t: the value
            part of an entry or token at s then carries R(s − t), a relative rotation), then
            grouped_lowrank's output (o_groups groups, rank o_rank, then W_OB).

RoPE acts on the first rope_dim dims (attn's convention: the family permutes V4's trailing rope
slice to the front); transformers' interleaved pairs are rope_layout "interleaved". Keys and values
being one vector, d_v must equal d_k. With use_bias: b_q on the query heads (before their norm), b_kv on
the shared projection (before its norm), b_o on the output (V4 has none).

Refused by name: d_v ≠ d_k, probability other than softmax, a key
selection (V4's lightning indexer over the entries is not implemented: moba, indexer), mechanisms
on the logits outside the kernel, qk_norm (the variant's own norms stand in its place), a gate.

Decoding (init_cache / decode_cached): the window's ring of keys (one vector per token and kv
head: keys are the values), the entries of ended blocks and the compressor's inputs of the last
P·m tokens, as `compressed` holds them but with the key part only. After L tokens:
(min(L, window) + L // m + 2·P²·m)·G·K numbers (kv_cache_elements; without entries
min(L, window)·G·K).

Params: D·Q + Q + Q·H·K (D·H·K without the latent) + D·G·K + G·K + H·K·r + g·r·D, with entries
P·G·(2·D + m)·K + G·K, with the indexer P·(2·D + m)·I + I + Q·n·I + D·n.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attn import kernel
from attn.config import HeadConfig, invalid
from attn.kernel import compressed as ckernel
from attn.kernel import masks
from attn.variants import cache as kv_cache
from attn.variants import compressed, grouped_lowrank, mechanisms, rope
from attn.variants.base import (Options, Params, Variant, add_bias, bias, gate_heads, no_circuits, normal,
                                project_heads)

NORM_EPS = 1e-6  # V4's rms_norm_eps


def indexed(cfg: HeadConfig) -> bool:
  """Whether the layer chooses its entries with an indexer (cfg.compress_index_heads > 0)."""
  return cfg.compress_index_heads > 0


def eps(cfg: HeadConfig) -> float:
  return NORM_EPS if cfg.latent_norm_eps is None else cfg.latent_norm_eps


def _series(cfg: HeadConfig) -> int:
  return 2 if cfg.compress_overlap else 1


def check(cfg: HeadConfig) -> None:
  if cfg.d_v != cfg.d_k:
    raise invalid("d_v", cfg.d_v, f"d_k={cfg.d_k} for variant compressed_shared: one projection is the "
                  "keys and the values")
  if cfg.compress_overlap and cfg.compress_block is None:
    raise invalid("compress_overlap", True, "False without compress_block: there are no entries to overlap")
  if indexed(cfg) and (cfg.compress_block is None or cfg.q_latent_dim is None
                       or cfg.compress_index_dim < cfg.rope_dim):
    raise invalid("compress_index_heads", cfg.compress_index_heads, "0 unless compress_block and q_latent_dim "
                  f"are set and compress_index_dim >= rope_dim={cfg.rope_dim}: the indexer scores the entries "
                  "from the query latent, its keys rotated as the layer's")
  if cfg.qk_norm or cfg.gate is not None:
    raise invalid("qk_norm, gate", (cfg.qk_norm, cfg.gate), "(False, None) for variant compressed_shared: "
                  "its queries and keys have their own norms, its output no gate")
  compressed.check(cfg)


def init(key, cfg: HeadConfig, dtype=jnp.float32) -> Params:
  D, H, G, K, Q = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_k, cfg.q_latent_dim
  g, r = cfg.o_groups, grouped_lowrank.rank(cfg)
  ks = jax.random.split(key, 11)
  query = {"w_q": normal(ks[0], (D, H, K), D, dtype)} if Q is None else {
      "w_dq": normal(ks[0], (D, Q), D, dtype), "q_latent_norm": jnp.ones((Q,), dtype),
      "w_uq": normal(ks[1], (Q, H, K), Q, dtype)}
  params = query | {
      "w_kv": normal(ks[2], (D, G, K), D, dtype),
      "kv_norm": jnp.ones((G, K), dtype), "w_oa": normal(ks[3], (g, H // g * K, r), H // g * K, dtype),
      "w_ob": normal(ks[4], (g * r, D), g * r, dtype)}
  params = add_bias(params, cfg, {"b_q": (H, K), "b_kv": (G, K), "b_o": (D,)}, dtype)
  m = cfg.compress_block
  if m is not None:
    P = _series(cfg)
    params |= {"w_ck": normal(ks[5], (D, P, G, K), D, dtype), "w_zk": normal(ks[6], (D, P, G, K), D, dtype),
               "b_ck": jnp.zeros((P, m, G, K), dtype), "n_ck": jnp.ones((G, K), dtype)}
  if indexed(cfg):
    n, I = cfg.compress_index_heads, cfg.compress_index_dim
    params |= {"w_ic": normal(ks[7], (D, P, 1, I), D, dtype), "w_iz": normal(ks[8], (D, P, 1, I), D, dtype),
               "b_ic": jnp.zeros((P, m, 1, I), dtype), "n_ic": jnp.ones((1, I), dtype),
               "w_iq": normal(ks[9], (Q, n, I), Q, dtype), "w_iw": normal(ks[10], (D, n), D, dtype)}
  return params


def _rms(x, scale, e: float):
  """RMSNorm over the last axis in float32, times scale (None: no scale), in x's dtype."""
  y = x.astype(jnp.float32)
  y = y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + e)
  return (y if scale is None else y * scale.astype(jnp.float32)).astype(x.dtype)


def queries(params: Params, x_BTD, cfg: HeadConfig):
  """(B,T,H,K), unrotated: the latent normalised with its scale (q_latent_dim None: one projection
  W_Q), each head without one."""
  e = eps(cfg)
  if "w_q" in params:  # no latent (q_latent_dim None)
    return _rms(project_heads(x_BTD, params["w_q"], bias(params, "b_q")), None, e)
  c_BTQ = latent(params, x_BTD, cfg)
  return _rms(jnp.einsum("BTQ,QHK->BTHK", c_BTQ, params["w_uq"]) + bias(params, "b_q"), None, e)


def latent(params: Params, x_BTD, cfg: HeadConfig):
  """(B,T,Q): the query latent, normalised with its scale (the queries' and the indexer's input)."""
  return _rms(x_BTD @ params["w_dq"], params["q_latent_norm"], eps(cfg))


def keys(params: Params, x_BTD, cfg: HeadConfig):
  """(B,S,G,K), unrotated: the shared projection, normalised with its scale."""
  return _rms(project_heads(x_BTD, params["w_kv"], bias(params, "b_kv")), params["kv_norm"], eps(cfg))


# The entries' parameters (projections, gate logits, slot biases, norm scale) and the indexer's.
_MAIN, _INDEX = ("w_ck", "w_zk", "b_ck", "n_ck"), ("w_ic", "w_iz", "b_ic", "n_ic")


def _finish(params: Params, ck_BNGK, positions_N, cfg: HeadConfig, names=_MAIN):
  return rope.rotate(_rms(ck_BNGK, params[names[3]], eps(cfg)), positions_N, cfg)


def entries(params: Params, x_BSD, cfg: HeadConfig, key_positions=None, names=_MAIN):
  """(B, S // m, G, K): the entries of the complete blocks, normalised and rotated (names=_INDEX: the
  indexer's keys, (B, S // m, 1, I))."""
  m = cfg.compress_block
  c, z = (compressed._project(x_BSD, params[n]) for n in names[:2])
  ck = ckernel.pool(c, z, params[names[2]], m)
  N = ck.shape[1]
  pos = jnp.arange(N) * m if key_positions is None else jnp.asarray(key_positions)[..., :N * m:m]
  return _finish(params, ck, pos, cfg, names)


def select(params: Params, x_BTD, c_BTQ, ik_BN1I, ended_BTN, cfg: HeadConfig, pos_T):
  """(B,1,T,N): the entries the indexer keeps for each query, of those that have ended: the top
  compress_index_topk by Σ_h w_h·ReLU(q_h·k)/√I, w = x·W_IW/√n, q_h the latent through W_IQ, rotated.
  Exact ties at the k-th score (ReLU's zeros make them possible) keep the lower entries (lax.top_k);
  torch's topk, which transformers uses, leaves their order unspecified."""
  n, I, k = cfg.compress_index_heads, cfg.compress_index_dim, cfg.compress_index_topk
  N = ik_BN1I.shape[1]
  iq = rope.rotate(jnp.einsum("BTQ,QhI->BThI", c_BTQ, params["w_iq"]), pos_T, cfg)
  s = jax.nn.relu(jnp.einsum("BThI,BNI->BThN", iq.astype(jnp.float32), ik_BN1I[:, :, 0].astype(jnp.float32)))
  w = (x_BTD @ params["w_iw"]).astype(jnp.float32) * n ** -0.5
  score = jnp.einsum("BThN,BTh->BTN", s * I ** -0.5, w)
  score = jnp.where(ended_BTN, score, -jnp.inf)
  _, top = jax.lax.top_k(score, min(k, N))
  kept = jax.nn.one_hot(top, N, dtype=jnp.bool_).any(-2) & ended_BTN
  return kept[:, None]


def _ended(N: int, m: int, pos, key_pos=None):
  """(1|B, T, N): entry n has ended for the query at pos: the position of its last token, (n + 1)·m − 1
  (or key_pos's entry there), is at most pos."""
  pos = jnp.asarray(pos)
  pos = pos[None] if pos.ndim == 1 else pos
  if key_pos is None:
    return (jnp.arange(N) + 1) * m <= pos[..., None] + 1
  ends = jnp.asarray(key_pos)[..., m - 1::m][..., :N]
  ends = ends[None] if ends.ndim == 1 else ends
  return ends[:, None, :] <= pos[..., None]


def _output(params: Params, x_BTD, o_BTHK, pos_T, cfg: HeadConfig, head_mask):
  o_BTHK = rope.rotate(o_BTHK, -jnp.asarray(pos_T), cfg)  # V4's de-rotation at the query's position
  o_BTHK = gate_heads(o_BTHK, head_mask)
  return grouped_lowrank.grouped_output(params, o_BTHK, bias(params, "b_o")).astype(x_BTD.dtype)


def _attend(params: Params, q, k, ck, *, cfg: HeadConfig, opts: Options, entry_mask=None, window="layer"):
  if cfg.compress_block is not None:
    return compressed._core(params, q, k, k, ck, ck, cfg=cfg, opts=opts, entry_mask=entry_mask, window=window)
  args = mechanisms.kernel_args(params, cfg)
  if window != "layer":
    args = args | {"window": window}
  out = kernel.attention(q, k, k, opts.mask, is_causal=opts.is_causal, kv_lengths=opts.kv_lengths,
                         scale=cfg.score_scale, return_weights=opts.return_weights, impl=opts.impl or "auto",
                         **args)
  return out if opts.return_weights else (out, None)


def apply(params: Params, x_BTD, context_BSD=None, *, cfg: HeadConfig, opts: Options = Options()):
  """The layer (module docstring): y (B,T,D) and, with return_weights, weights over the tokens."""
  c_BSD = x_BTD if context_BSD is None else context_BSD
  T, S = x_BTD.shape[1], c_BSD.shape[1]
  pos_q, pos_k = (jnp.arange(T), jnp.arange(S)) if opts.qk_positions is None else opts.qk_positions
  q = rope.rotate(queries(params, x_BTD, cfg), pos_q, cfg)
  k = rope.rotate(keys(params, c_BSD, cfg), pos_k, cfg)
  kpos = None if opts.qk_positions is None else pos_k
  ck = None if cfg.compress_block is None else entries(params, c_BSD, cfg, kpos)
  chosen = None
  if indexed(cfg):
    ik = entries(params, c_BSD, cfg, kpos, _INDEX)
    # The candidates: the entries the call's masks show (every head), and with causality those that have ended.
    m, N = cfg.compress_block, ik.shape[1]
    shown = masks.combine_masks(ckernel.entry_mask(opts.mask, S, m, _series(cfg) * m),
                                ckernel.structured_entries(T, S, N, m, False, opts.kv_lengths))
    ended = _ended(N, m, pos_q, pos_k) if opts.is_causal else jnp.ones((1, T, N), bool)
    if shown is not None:
      ended = ended & jnp.broadcast_to(shown, (*shown.shape[:2], T, N)).all(1)
    chosen = select(params, x_BTD, latent(params, x_BTD, cfg), ik, ended, cfg, pos_q)
  o, w = _attend(params, q, k, ck, cfg=cfg, opts=opts, entry_mask=chosen)
  return _output(params, x_BTD, o, pos_q, cfg, opts.head_mask), w


# Decoding

def init_cache(params: Params, cfg: HeadConfig, batch_size: int, max_len: int, dtype=jnp.float32) -> dict:
  """Empty cache (module docstring): the key ring k; with entries ck and the compressor's last P·m
  tokens' inputs."""
  del params
  G, K, m = cfg.num_kv_heads, cfg.d_k, cfg.compress_block
  z = lambda *shape: jnp.zeros((batch_size, *shape), dtype)  # noqa: E731
  out = {"k": z(kv_cache.slots(cfg, max_len), G, K)}
  if m is not None:
    P = _series(cfg)
    out |= {"ck": z(max_len // m, G, K), "buf_c": z(P * m, P, G, K), "buf_z": z(P * m, P, G, K)}
    if indexed(cfg):
      I = cfg.compress_index_dim
      out |= {"ik": z(max_len // m, 1, I), "buf_ic": z(P * m, P, 1, I), "buf_iz": z(P * m, P, 1, I)}
  return out


def _step_entries(params: Params, cache: dict, new: tuple, index, T: int, cfg: HeadConfig,
                  names=_MAIN, bufs=("buf_c", "buf_z", "ck")):
  """The entries of the blocks that end inside this step and their slots (past the end where none),
  pooled from the buffered and the new compressor inputs (compressed._step_entries, key part only)."""
  m, P = cfg.compress_block, _series(cfg)
  L = P * m
  order = (index + jnp.arange(L)) % L
  pos = index - L + jnp.arange(L + T)
  c = jnp.concatenate([cache[bufs[0]][:, order], new[0].astype(cache[bufs[0]].dtype)], axis=1)
  z = jnp.concatenate([cache[bufs[1]][:, order], new[1].astype(cache[bufs[1]].dtype)], axis=1)
  z = jnp.where((pos >= 0)[None, :, None, None, None], z, -jnp.inf)  # slots before position 0 weigh 0
  J = T // m + 1
  n_J = index // m + jnp.arange(J)
  valid_J = (n_J + 1) * m <= index + T
  start_J = m - index % m + jnp.arange(J) * m

  def one(start):
    cs, zs = (jax.lax.dynamic_slice_in_dim(a, start, L, axis=1) for a in (c, z))
    return ckernel.pool(cs, zs, params[names[2]], m)[:, -1]

  ck = _finish(params, jnp.moveaxis(jax.vmap(one)(start_J), 0, 1), n_J * m, cfg, names)
  return ck, jnp.where(valid_J, n_J, cache[bufs[2]].shape[1] + 1)


def decode_cached(params: Params, x_BTD, cache: dict, index, *, cfg: HeadConfig, head_mask=None):
  """y for x's tokens at positions index.. and the cache with them (module docstring)."""
  T = x_BTD.shape[1]
  m = cfg.compress_block
  pos_T = index + jnp.arange(T)
  q = rope.rotate(queries(params, x_BTD, cfg), pos_T, cfg)
  k = rope.rotate(keys(params, x_BTD, cfg), pos_T, cfg)
  out = dict(cache)
  n_slots = cache["k"].shape[1]
  if cfg.window is not None:
    mask = kv_cache.ring_mask(index, T, n_slots, cfg.window)
    k_all = jnp.concatenate([cache["k"], k.astype(cache["k"].dtype)], axis=1)
    w = min(T, n_slots)
    slot_W = (index + T - w + jnp.arange(w)) % n_slots
    out["k"] = cache["k"].at[:, slot_W].set(k[:, T - w:].astype(cache["k"].dtype))
  else:
    mask = kv_cache.causal_mask(index, T, n_slots)
    out["k"] = jax.lax.dynamic_update_slice_in_dim(cache["k"], k.astype(cache["k"].dtype), index, 1)
    k_all = out["k"]
  opts = Options(mask=mask, head_mask=head_mask)
  if m is None:
    o, _ = _attend(params, q, k_all, None, cfg=cfg, opts=opts, window=None)
    return _output(params, x_BTD, o, pos_T, cfg, head_mask), out
  L = _series(cfg) * m
  keep = min(T, L)
  slot_M = (index + T - keep + jnp.arange(keep)) % L
  for names, bufs in ((_MAIN, ("buf_c", "buf_z", "ck")), (_INDEX, ("buf_ic", "buf_iz", "ik"))):
    if bufs[2] not in cache:
      continue
    new = tuple(compressed._project(x_BTD, params[n]) for n in names[:2])
    e, slot_J = _step_entries(params, cache, new, index, T, cfg, names, bufs)
    out[bufs[2]] = cache[bufs[2]].at[:, slot_J].set(e.astype(cache[bufs[2]].dtype), mode="drop")
    for name, a in zip(bufs[:2], new):
      out[name] = cache[name].at[:, slot_M].set(a[:, T - keep:].astype(cache[name].dtype))
  ended = _ended(out["ck"].shape[1], m, pos_T)
  chosen = ended[None] if not indexed(cfg) else select(params, x_BTD, latent(params, x_BTD, cfg), out["ik"],
                                                       ended, cfg, pos_T)
  o, _ = _attend(params, q, k_all, out["ck"], cfg=cfg, opts=opts, entry_mask=chosen, window=None)
  return _output(params, x_BTD, o, pos_T, cfg, head_mask), out


def kv_cache_elements(cfg: HeadConfig, length: int) -> int:
  """Numbers the cache holds for `length` tokens: one key (= value) per token of the window (or
  every token), length // m entries and the compressor's inputs of P·m tokens (P series, the
  inputs and the gates): (min(length, window) + length // m + 2·P²·m)·G·K."""
  G, K, m = cfg.num_kv_heads, cfg.d_k, cfg.compress_block
  tokens = length if cfg.window is None else min(cfg.window, length)
  if m is None:
    return tokens * G * K
  P = _series(cfg)
  index = (length // m + 2 * P * P * m) * cfg.compress_index_dim if indexed(cfg) else 0
  return (tokens + length // m + 2 * P * P * m) * G * K + index


def param_count(cfg: HeadConfig) -> int:
  D, H, G, K, Q, m = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_k, cfg.q_latent_dim, cfg.compress_block
  g, r = cfg.o_groups, grouped_lowrank.rank(cfg)
  own = (D * H * K if Q is None else D * Q + Q + Q * H * K) + D * G * K + G * K + H * K * r + g * r * D
  own += (H * K + G * K + D) if cfg.use_bias else 0
  if indexed(cfg):
    n, I = cfg.compress_index_heads, cfg.compress_index_dim
    own += _series(cfg) * (2 * D + m) * I + I + Q * n * I + D * n
  return own + (0 if m is None else _series(cfg) * G * (2 * D + m) * K + G * K)


def flops(cfg: HeadConfig, T: int, S: int) -> int:
  """The projections (query through its latent, the shared key, the compressor's two maps), the core
  over S + S // m keys (unmasked, as per_head's) and the grouped output."""
  D, H, G, K, Q, m = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_k, cfg.q_latent_dim, cfg.compress_block
  g, r = cfg.o_groups, grouped_lowrank.rank(cfg)
  N = 0 if m is None else S // m
  proj = 2 * T * (D * H * K if Q is None else D * Q + Q * H * K) + 2 * S * D * G * K + 2 * T * (H * K * r + g * r * D)
  comp = 0 if m is None else 4 * S * D * _series(cfg) * G * K
  if indexed(cfg):  # its compressor, queries, head weights and scores
    n, I = cfg.compress_index_heads, cfg.compress_index_dim
    comp += 4 * S * D * _series(cfg) * I + 2 * T * (Q * n * I + D * n) + 2 * T * N * n * I
  return proj + comp + 2 * T * (S + N) * H * 2 * K


def score_weights(cfg: HeadConfig) -> int:
  """The weights the scores read: the query's (latent, its scale, W_UQ; or W_Q), W_KV and its scale, and
  with entries W_CK, W_ZK and their norm scale (compressed's); no biases (attn.count's rule). The
  indexer's weights choose entries, no score of the layer reads them: not counted."""
  D, H, G, K, Q, m = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_k, cfg.q_latent_dim, cfg.compress_block
  query = D * H * K if Q is None else D * Q + Q + Q * H * K
  out = query + D * G * K + G * K
  return out + (0 if m is None else (2 * D * _series(cfg) + 1) * G * K)


VARIANT = Variant(
    name="compressed_shared",
    lacks={"qkv_heads": "compressed_shared pools blocks of keys and values into a cache of its own"},
    init=init,
    apply=apply,
    param_count=param_count,
    flops=flops,
    score_weights=score_weights,
    check=check,
    sharding={"w_q": "DHK", "b_kv": "GK", "w_dq": "DQ", "q_latent_norm": "Q", "w_uq": "QHK", "w_kv": "DGK",
              "kv_norm": "GK",
              "w_oa": "PVO", "w_ob": "PD", "w_ck": "DYGK", "w_zk": "DYGK", "b_ck": "YWGK", "n_ck": "GK",
              "w_ic": "DYZI", "w_iz": "DYZI", "b_ic": "YWZI", "n_ic": "ZI", "w_iq": "QJI", "w_iw": "DJ"},
    fields=("compress_block", "compress_overlap", "compress_index_heads", "compress_index_dim",
            "compress_index_topk", "o_groups", "o_rank"),
    circuits=no_circuits("compressed_shared", "a variant with per-head W_QK: compressed_shared's queries "
                         "pass through norms and its entries are pooled by an input-dependent softmax"),
    init_cache=init_cache,
    decode_cached=decode_cached,
    kv_cache_elements=kv_cache_elements,
)
