"""Key selection as head mechanisms: MoBA and the lightning indexer, on any softmax variant.

Both act at the attention core of the shared path (base.core), on the queries
and keys as the kernel receives them (after QK-norm and RoPE, or the cache's
while decoding): they choose, per query, the keys it may attend to
(attn.kernel.select defines the choice), and the attention is the layer's
softmax attention restricted to them. The choice has no gradient (as in both
papers: MoBA's gate is a top-k; DSA trains its indexer apart, which is not
here). Options live in HeadConfig.extra:

  moba     {"block": 64, "top_k": 4}: blocks of `block` keys, top_k blocks per query
           head, its own block one of them (Lu et al. 2025). No parameters.
  indexer  {"heads": 4, "head_dim": 32, "top_k": 2048}: n_I index heads of d_I
           (DeepSeek-V3.2's lightning indexer), one set of top_k keys per query
           shared by every head. Parameters: w_iq (H, K - r, n_I, d_I) maps a query's
           unrotated dims (all heads') to its index queries, w_ik (G, K - r, d_I) a key's
           to its one index key, w_iw (H, K - r, n_I) to the weights per index head;
           r = rope_dim. Reading the unrotated dims keeps the choice position-free
           (RoPE shifts leave it) and the same from the cache's keys. DeepSeek-V3.2
           reads the layer's input and its query latent instead, with a LayerNorm and
           partial RoPE on the index key: not done here (that needs the index keys
           cached beside k and v).

Where the work is saved: at T·S >= kernel.BLOCKED_MIN_SCORES ("auto" or "blocked",
no dense mask, window, sinks or other probability), MoBA runs attn.kernel.gathered
(each chosen (query, block) pair computed once: B·H·T·top_k·block scores) and the
indexer attn.kernel.sparse (the blocked kernel over the key blocks holding a
chosen token, masked inside; its queries scored 256 at a time): no T×S float
array. (Mechanism.select returns, for that path, the kernel and its arguments;
for the dense path, a boolean mask.) Elsewhere the selection becomes a
dense mask ANDed into the call's, and the layer's own path runs (every option;
the definition the sparse path equals). return_weights at long T is refused: it
would build the (B,H,T,S) array selection exists to avoid.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp

from attn.config import HeadConfig, invalid
from attn.kernel import gathered, masks, select, sparse
from attn.kernel.impls import BLOCKED_MIN_SCORES, is_long
from attn.variants.mechanism import Mechanism

Array = jax.Array
Params = dict[str, Array]

SELECTORS = ("moba", "indexer", "nsa")  # nsa: attn.variants.nsa
INDEX_BLOCK = 128  # the key blocks the sparse kernel visits for the indexer (a multiple of 32)
INDEX_CHUNK = 256  # queries the indexer scores at a time on the sparse path


def _opts(cfg: HeadConfig, name: str) -> dict:
  return {**DEFAULTS[name], **dict((cfg.extra or {}).get(name) or {})}


def _positive(name: str, key: str, value) -> None:
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
    raise invalid(f"extra.{name}.{key}", value, "a positive integer")


def _check(name: str, cfg: HeadConfig) -> None:
  """Options positive integers; one selector a layer; softmax heads, no window; the indexer needs
  unrotated dims."""
  o = _opts(cfg, name)
  for key in DEFAULTS[name]:
    _positive(name, key, o[key])
  others = [n for n in SELECTORS if n != name and n in (cfg.extra or {})]
  if others:
    raise invalid(f"extra.{others[0]}", dict(cfg.extra[others[0]]),
                  f"absent with extra.{name}: one key selection a layer")
  if cfg.probability != "softmax":
    raise invalid("probability", cfg.probability, f'"softmax" with key selection (extra.{name}): a '
                  "selection restricts a softmax head's keys")
  if cfg.window is not None:
    raise invalid("window", cfg.window, f"None with key selection (extra.{name}): a window's decoding "
                  "cache is a ring whose slots are not positions, so MoBA's blocks and the indexer's "
                  "ties would not be the full pass's")
  if name == "indexer" and cfg.rope_dim >= cfg.d_k:
    raise invalid("rope_dim", cfg.rope_dim, f"below d_k={cfg.d_k} with extra.indexer: the index heads "
                  "read a head's unrotated dims")


# MoBA

def _moba_select(params: Params, q_BTHK, k_BSGK, *, cfg: HeadConfig, is_causal, kv_lengths, mask,
                 dense: bool):
  del params
  o = _opts(cfg, "moba")
  block = min(o["block"], k_BSGK.shape[1])
  if dense:
    return select.moba_mask(q_BTHK, k_BSGK, block=block, top_k=o["top_k"], is_causal=is_causal,
                            kv_lengths=kv_lengths, mask=mask)
  idx, chosen = select.moba_top(q_BTHK, k_BSGK, block=block, top_k=o["top_k"], is_causal=is_causal,
                                kv_lengths=kv_lengths)
  return gathered.attention, {"idx_BHTk": idx, "valid_BHTk": chosen, "block": block}


def _moba_flops(cfg: HeadConfig, T: int, S: int) -> int:
  """Gate scores 2·T·N·H·K (N = ceil(S / block)) and block means S·G·K."""
  N = select.num_blocks(S, min(_opts(cfg, "moba")["block"], S))
  return 2 * T * N * cfg.num_heads * cfg.d_k + S * cfg.num_kv_heads * cfg.d_k


def moba_keys(cfg: HeadConfig, T: int) -> int:
  """Keys MoBA attends to over T causal queries (S = T): per query its own block's keys up to
  itself and top_k - 1 whole earlier blocks (all of them while fewer exist)."""
  o = _opts(cfg, "moba")
  b, k = o["block"], o["top_k"]
  full, rest = divmod(T, b)
  total = full * b * (b + 1) // 2 + rest * (rest + 1) // 2  # own blocks, causally
  for c in range(full + (rest > 0)):  # block c's queries each see min(top_k - 1, c) earlier blocks
    total += (b if c < full else rest) * min(k - 1, c) * b
  return total


MOBA = Mechanism(
    name="moba", defaults={"block": 64, "top_k": 4}, check=lambda cfg: _check("moba", cfg),
    select=_moba_select,
    param_count=lambda cfg: 0, effective_param_count=lambda cfg: 0, flops=_moba_flops,
    score_weights=lambda cfg: 0,
    examples=(("moba block 2, top 2", {"extra": {"moba": {"block": 2, "top_k": 2}}}, "0",
               "2·T·⌈S/b⌉·H·K + S·G·K (the core: top_k·b keys a query, not S)"),),
    help="moba: {block, top_k}: each query head attends to top_k blocks of keys by q·(mean key), "
         "its own among them")


# The lightning indexer

def _index_width(cfg: HeadConfig) -> int:
  return cfg.d_k - cfg.rope_dim


def _indexer_init(key: Array, cfg: HeadConfig, dtype=jnp.float32) -> Params:
  o = _opts(cfg, "indexer")
  H, G, C, J, I = cfg.num_heads, cfg.num_kv_heads, _index_width(cfg), o["heads"], o["head_dim"]
  kq, kk, kw = jax.random.split(key, 3)
  normal = lambda k, shape, fan: (jax.random.normal(k, shape, jnp.float32) / jnp.sqrt(fan)).astype(dtype)
  return {"w_iq": normal(kq, (H, C, J, I), H * C), "w_ik": normal(kk, (G, C, I), G * C),
          "w_iw": normal(kw, (H, C, J), H * C)}


def index_inputs(params: Params, q_BTHK, k_BSGK, cfg: HeadConfig):
  """(index queries (B,T,J,I), index keys (B,S,I), weights (B,T,J)) from the heads' unrotated dims."""
  r, G = cfg.rope_dim, cfg.num_kv_heads
  if q_BTHK.shape[2:] != (cfg.num_heads, cfg.d_k) or k_BSGK.shape[2:] not in ((G, cfg.d_k), (1, cfg.d_k)):
    raise invalid("extra.indexer", dict(cfg.extra["indexer"]),
                  f"a layer whose kernel reads per-head queries (H, d_k) and keys (G, d_k); got "
                  f"{tuple(q_BTHK.shape[2:])} and {tuple(k_BSGK.shape[2:])} (e.g. mla's absorbed latent form)")
  if k_BSGK.shape[2] != G:
    k_BSGK = jnp.broadcast_to(k_BSGK, (*k_BSGK.shape[:2], G, cfg.d_k))
  qn, kn = (jax.lax.stop_gradient(a[..., r:]).astype(jnp.float32) for a in (q_BTHK, k_BSGK))
  w_iq, w_ik, w_iw = (jax.lax.stop_gradient(params[n]).astype(jnp.float32) for n in ("w_iq", "w_ik", "w_iw"))
  return (jnp.einsum("BTHC,HCJI->BTJI", qn, w_iq), jnp.einsum("BSGC,GCI->BSI", kn, w_ik),
          jnp.einsum("BTHC,HCJ->BTJ", qn, w_iw))


def _indexer_select(params: Params, q_BTHK, k_BSGK, *, cfg: HeadConfig, is_causal, kv_lengths, mask,
                    dense: bool):
  top_k = _opts(cfg, "indexer")["top_k"]
  qi, ki, w = index_inputs(params, q_BTHK, k_BSGK, cfg)
  S = k_BSGK.shape[1]
  if dense:
    return select.indexer_tokens(qi, ki, w, top_k=top_k, is_causal=is_causal, kv_lengths=kv_lengths,
                                 mask=mask, chunk=None if not is_long(qi.shape[1], S) else INDEX_CHUNK)[:, None]
  bits = select.indexer_bits(qi, ki, w, top_k=top_k, is_causal=is_causal, kv_lengths=kv_lengths,
                             chunk=INDEX_CHUNK)
  return sparse.attention, {"blocks_BHTN": select.token_blocks(bits, INDEX_BLOCK, S),
                            "block_k": INDEX_BLOCK, "bits_BTW": bits}


def _indexer_params(cfg: HeadConfig) -> int:
  o = _opts(cfg, "indexer")
  H, G, C, J, I = cfg.num_heads, cfg.num_kv_heads, _index_width(cfg), o["heads"], o["head_dim"]
  return C * (H * J * I + G * I + H * J)


def indexer_flops(cfg: HeadConfig, T: int, S: int) -> int:
  """Index queries 2·T·H·C·J·I, weights 2·T·H·C·J, index keys 2·S·G·C·I (C = K - rope_dim);
  scores 2·T·S·J·I and their weighted sum 2·T·S·J (ReLU and top-k not counted)."""
  o = _opts(cfg, "indexer")
  H, G, C, J, I = cfg.num_heads, cfg.num_kv_heads, _index_width(cfg), o["heads"], o["head_dim"]
  return 2 * T * H * C * J * (I + 1) + 2 * S * G * C * I + 2 * T * S * J * (I + 1)


def indexer_keys(cfg: HeadConfig, T: int) -> int:
  """Keys the indexer attends to over T causal queries (S = T): min(t + 1, top_k) each."""
  k = _opts(cfg, "indexer")["top_k"]
  if k >= T:
    return T * (T + 1) // 2
  return k * (k + 1) // 2 + (T - k) * k


INDEXER = Mechanism(
    name="indexer", defaults={"heads": 4, "head_dim": 32, "top_k": 2048},
    check=lambda cfg: _check("indexer", cfg), init=_indexer_init, select=_indexer_select,
    sharding={"w_iq": "HKJI", "w_ik": "GKI", "w_iw": "HKJ"}, param_count=_indexer_params,
    flops=indexer_flops, score_weights=lambda cfg: 0,
    examples=(("indexer 2 heads of 3, top 3", {"extra": {"indexer": {"heads": 2, "head_dim": 3, "top_k": 3}}},
               "C·(H·J·I + G·I + H·J), C = K − r",
               "2·T·H·C·J·(I + 1) + 2·S·G·C·I + 2·T·S·J·(I + 1) (the core: top_k keys a query)"),),
    help="indexer: {heads, head_dim, top_k}: DeepSeek-V3.2's lightning indexer, each query's top_k "
         "keys by Σ_j w_j·ReLU(q_j·k), shared by every head")

RECORDS = (MOBA, INDEXER)
DEFAULTS = {m.name: dict(m.defaults) for m in RECORDS}


def selected_core_flops(cfg: HeadConfig, T: int) -> int:
  """The attention core's FLOPs over T causal queries with the layer's selection: 2·H·(K + V) per
  (query, key) pair it attends to; without one, the causal triangle's."""
  pairs = T * (T + 1) // 2
  if "moba" in (cfg.extra or {}):
    pairs = moba_keys(cfg, T)
  elif "indexer" in (cfg.extra or {}):
    pairs = indexer_keys(cfg, T)
  return 2 * pairs * cfg.num_heads * (cfg.d_k + cfg.d_v)


# The core (base.core calls this when a mechanism with `select` is on)

def attend(m: Mechanism, params: Params, q_BTHK: Array, k_BSGK: Array, v_BSGV: Array, *, cfg: HeadConfig,
           opts, kernel_args: dict, explicit: bool):
  """(o (B,T,H,V), None) from the sparse kernel, or (None, opts with the selection's mask ANDed in)."""
  T, S = q_BTHK.shape[1], k_BSGK.shape[1]
  name, fn = m.name, m.select
  long = is_long(T, S)
  if opts.return_weights and long:
    raise invalid("return_weights", True, f"False with key selection (extra.{name}) at T·S >= "
                  f"{BLOCKED_MIN_SCORES}: the weights are the (B,H,T,S) array a selection avoids")
  impl = opts.impl or "auto"
  plain = (opts.mask is None and kernel_args["window"] is None and kernel_args["sinks"] is None
           and kernel_args["probability"] == "softmax" and not explicit)
  if long and plain and impl in ("auto", "blocked"):
    run, chosen = fn(params, q_BTHK, k_BSGK, cfg=cfg, is_causal=opts.is_causal,
                     kv_lengths=opts.kv_lengths, mask=None, dense=False)
    o = run(q_BTHK, k_BSGK, v_BSGV, **chosen, scale=cfg.score_scale, is_causal=opts.is_causal,
            kv_lengths=opts.kv_lengths, softcap=kernel_args["softcap"])
    return o, opts
  window = kernel_args["window"]
  seen = masks.combine_masks(opts.mask, None if window is None else masks.window_mask(T, S, window))
  keep = fn(params, q_BTHK, k_BSGK, cfg=cfg, is_causal=opts.is_causal, kv_lengths=opts.kv_lengths,
            mask=seen, dense=True)
  return None, opts.replace(mask=masks.combine_masks(opts.mask, keep))
