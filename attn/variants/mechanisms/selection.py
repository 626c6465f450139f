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
  indexer  {"heads": 4, "head_dim": 32, "top_k": 2048, "form": "heads"}: n_I index heads
           of d_I (DeepSeek-V3.2's lightning indexer), one set of top_k keys per query
           shared by every head. Two forms (docs/key_selection.md):
           "heads" (the default, any variant with per-head queries and keys): w_iq
           (H, K - r, n_I, d_I) maps a query's unrotated dims (all heads') to its index
           queries, w_ik (G, K - r, d_I) a key's to its one index key, w_iw (H, K - r, n_I)
           to the weights per index head; r = rope_dim. Position-free, and the same from
           the cache's keys.
           "deepseek" (DeepSeek-V3.2 as transformers' DeepseekV32Indexer; mla with a query
           latent): index queries from the query latent c_q (after its RMSNorm), w_idq
           (Q', n_I, d_I); the one index key LayerNorm(x·w_idk) (w_idk (D, d_I), scale
           idk_norm and bias idk_bias, eps 1e-6); RoPE on the first rope_dim dims of both
           at their positions, in layout "rope_layout" ("half", DeepSeek-V3.2's, or
           "interleaved", GLM-5's; "rope_dims" "last" rotates the last rope_dim dims instead,
           HY-V4's; "norm_eps" the LayerNorm's epsilon, HY-V4's rms_norm_eps); the weights
           x·w_idw (D, n_I) · n_I^-1/2; scores
           · d_I^-1/2. The variant computes these (index_queries, index_keys) and hands them
           to the core in Options.index; its decoding cache holds the index keys.
           "shared" (False; set per layer by ModelConfig.indexer_types, attn.nn.index_sharing,
           never on a model's extra): the layer reuses the previous full layer's choice
           (GLM-5's IndexShare): no index parameters, no index keys cached, no index FLOPs;
           its select hands back what that layer's select returned in the same model call
           (SHARED_CHOICE).

Where the work is saved: where the kernel's table sends a key choice to its rows
(attn.kernel.impls.selects: T·S >= kernel.BLOCKED_MIN_SCORES, "auto" or "blocked",
no dense mask, window, sinks or other probability), MoBA runs the "gathered" row
(attn.kernel.gathered: each chosen (query, block) pair computed once:
B·H·T·top_k·block scores) and the indexer the "sparse" row (attn.kernel.sparse: the
blocked kernel over the key blocks holding a chosen token, masked inside; its queries
scored 256 at a time): no T×S float array. (Mechanism.select returns, for that path,
a kernel.KeyChoice; for the dense path, a boolean mask: attn.variants.mechanisms.choice.)
Elsewhere the selection becomes a
dense mask ANDed into the call's, and the layer's own path runs (every option;
the definition the sparse path equals). return_weights at long T is refused: it
would build the (B,H,T,S) array selection exists to avoid.
"""

from __future__ import annotations

import contextlib
import contextvars
import numbers
from typing import Iterator

import jax
import jax.numpy as jnp

from attn import kernel
from attn.config import HeadConfig, invalid
from attn.kernel import masks, select
from attn.kernel.impls import is_long
from attn.variants import rope
from attn.variants.mechanisms import choice
from attn.variants.mechanisms.record import Mechanism

Array = jax.Array
Params = dict[str, Array]

SELECTORS = ("moba", "indexer", "nsa", "kpool", "qsa", "block_indexer")  # nsa, the pooled: own modules
INDEX_BLOCK = 128  # the key blocks the sparse kernel visits for the indexer (a multiple of 32)
INDEX_CHUNK = 256  # queries the indexer scores at a time on the sparse path


def _opts(cfg: HeadConfig, name: str) -> dict:
  return {**DEFAULTS[name], **dict((cfg.extra or {}).get(name) or {})}


FORMS = ("heads", "deepseek")  # extra.indexer.form (module docstring)
INDEX_ROPE_LAYOUTS = ("half", "interleaved")  # extra.indexer.rope_layout, the deepseek form's
INDEX_NORM_EPS = 1e-6  # DeepseekV32Indexer's k_norm: nn.LayerNorm(d_I, eps=1e-6); extra.indexer.norm_eps
INDEX_ROPE_DIMS = ("first", "last")  # extra.indexer.rope_dims: which rope_dim dims of an index head rotate
_STRINGS = {"form": FORMS, "rope_layout": INDEX_ROPE_LAYOUTS, "rope_dims": INDEX_ROPE_DIMS}


def options_of(cfg: HeadConfig, name: str = "indexer") -> dict:
  """A selector's options under cfg, its defaults filled in."""
  return _opts(cfg, name)


def is_deepseek(cfg: HeadConfig) -> bool:
  """Whether the layer has the indexer in DeepSeek-V3.2's form (reads x and the query latent)."""
  return "indexer" in (cfg.extra or {}) and _opts(cfg, "indexer")["form"] == "deepseek"


def is_shared(cfg: HeadConfig) -> bool:
  """Whether the layer reuses an earlier layer's indexer choice (extra.indexer.shared; indexer_types)."""
  return "indexer" in (cfg.extra or {}) and _opts(cfg, "indexer")["shared"] is True


def computes_index(cfg: HeadConfig) -> bool:
  """Whether the variant computes (and caches) the deepseek form's index queries and keys: the form,
  on a layer that makes its own choice."""
  return is_deepseek(cfg) and not is_shared(cfg)


def unshared(cfg: HeadConfig) -> HeadConfig:
  """cfg as a layer that makes its own choice (a shared layer measured alone: the choice carries no
  gradient, so the indexer's weights add nothing to the Jacobian's rank and its rank is the shared layer's);
  the lightning indexer's or the K-pool indexer's (attn.variants.mechanisms.pooled) alike."""
  names = [n for n in ("indexer", "kpool") if dict((cfg.extra or {}).get(n) or {}).get("shared") is True]
  if not names:
    return cfg
  extra = dict(cfg.extra)
  extra[names[0]] = {k: v for k, v in dict(extra[names[0]]).items() if k != "shared"}
  return cfg.replace(extra=extra)


# Set by attn.nn.index_sharing around each layer of a model call with shared indexer layers:
# ("record", {dense: choice}) on a full layer whose choice a later layer reuses (its select stores
# what it returns, keyed by its `dense` argument), ("reuse", that dict) on a shared layer.
SHARED_CHOICE: contextvars.ContextVar = contextvars.ContextVar("attn_shared_choice", default=None)



def check_alone(cfg: HeadConfig, name: str, what: str) -> None:
  """The refusals every key selection shares (extra.NAME; what: what a window's ring would break): one
  selection a layer, a softmax head, no window."""
  others = [n for n in SELECTORS if n != name and n in (cfg.extra or {})]
  if others:
    raise invalid(f"extra.{others[0]}", dict(cfg.extra[others[0]]),
                  f"absent with extra.{name}: one key selection a layer")
  if cfg.probability != "softmax":
    raise invalid("probability", cfg.probability, f'"softmax" with key selection (extra.{name}): a '
                  "selection restricts a softmax head's keys")
  if cfg.window is not None:
    raise invalid("window", cfg.window, f"None with key selection (extra.{name}): a window's decoding "
                  f"cache is a ring whose slots are not positions, so {what} would not be the full pass's")

def _positive(name: str, key: str, value) -> None:
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
    raise invalid(f"extra.{name}.{key}", value, "a positive integer")


def _check(name: str, cfg: HeadConfig) -> None:
  """Options positive integers; one selector a layer; softmax heads, no window; the indexer needs
  unrotated dims."""
  o = _opts(cfg, name)
  for key in DEFAULTS[name]:
    if key == "shared":
      if not isinstance(o[key], bool):
        raise invalid("extra.indexer.shared", o[key], "True or False (set per layer by indexer_types)")
      continue
    if key == "norm_eps":
      v = o[key]
      if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
        raise invalid("extra.indexer.norm_eps", v, "a positive finite number (the index key LayerNorm's epsilon)")
      continue
    if key in _STRINGS:
      if o[key] not in _STRINGS[key]:
        raise invalid(f"extra.{name}.{key}", o[key], f"one of {list(_STRINGS[key])}")
      continue
    _positive(name, key, o[key])
  check_alone(cfg, name, "MoBA's blocks and the indexer's ties")
  if name == "indexer" and o["form"] == "deepseek":
    if o["head_dim"] < cfg.rope_dim or o["head_dim"] % 2:
      raise invalid("extra.indexer.head_dim", o["head_dim"], f"an even number >= rope_dim={cfg.rope_dim}: the "
                    "deepseek form rotates the first rope_dim dims of each index query and key")
    if cfg.q_latent_dim is None:
      raise invalid("extra.indexer.form", "deepseek", "'heads' without q_latent_dim: the deepseek form reads "
                    "the query latent (mla with q_latent_dim)")
  elif name == "indexer" and (o["rope_dims"], o["norm_eps"]) != ("first", INDEX_NORM_EPS):
    raise invalid("extra.indexer.rope_dims, norm_eps", (o["rope_dims"], o["norm_eps"]), f"('first', "
                  f"{INDEX_NORM_EPS}) (unset) with form 'heads': they shape the deepseek form's index keys")
  elif name == "indexer" and o["rope_layout"] != "half":
    raise invalid("extra.indexer.rope_layout", o["rope_layout"], "'half' (unset) with form 'heads': that form "
                  "reads unrotated dims")
  elif name == "indexer" and cfg.rope_dim >= cfg.d_k:
    raise invalid("rope_dim", cfg.rope_dim, f"below d_k={cfg.d_k} with extra.indexer: the index heads "
                  "read a head's unrotated dims")


# MoBA

def _moba_select(params: Params, q_BTHK, k_BSGK, *, cfg: HeadConfig, is_causal, kv_lengths, mask,
                 dense: bool, index=None):
  del params, index
  o = _opts(cfg, "moba")
  block = min(o["block"], k_BSGK.shape[1])
  if dense:
    return select.moba_mask(q_BTHK, k_BSGK, block=block, top_k=o["top_k"], is_causal=is_causal,
                            kv_lengths=kv_lengths, mask=mask)
  idx, chosen = select.moba_top(q_BTHK, k_BSGK, block=block, top_k=o["top_k"], is_causal=is_causal,
                                kv_lengths=kv_lengths)
  return kernel.KeyChoice("gathered", {"idx_BHTk": idx, "valid_BHTk": chosen, "block": block})


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
  if o["shared"]:  # reuses another layer's choice: holds no index weights
    return {}
  H, G, C, J, I = cfg.num_heads, cfg.num_kv_heads, _index_width(cfg), o["heads"], o["head_dim"]
  kq, kk, kw = jax.random.split(key, 3)
  normal = lambda k, shape, fan: (jax.random.normal(k, shape, jnp.float32) / jnp.sqrt(fan)).astype(dtype)
  if o["form"] == "deepseek":
    D, Q = cfg.d_model, cfg.q_latent_dim
    return {"w_idq": normal(kq, (Q, J, I), Q), "w_idk": normal(kk, (D, I), D), "w_idw": normal(kw, (D, J), D),
            "idk_norm": jnp.ones((I,), dtype), "idk_bias": jnp.zeros((I,), dtype)}
  return {"w_iq": normal(kq, (H, C, J, I), H * C), "w_ik": normal(kk, (G, C, I), G * C),
          "w_iw": normal(kw, (H, C, J), H * C)}


def _index_rope(cfg: HeadConfig) -> HeadConfig:
  return cfg.replace(rope_layout=_opts(cfg, "indexer")["rope_layout"])


def index_keys(params: Params, c_BSD: Array, positions, cfg: HeadConfig) -> Array:
  """The deepseek form's one index key per token (B,S,d_I) float32: LayerNorm(c·w_idk), its first
  rope_dim dims rotated at `positions` ((S,) or (B,S)). What a decoding cache holds beside k and v.
  c is detached; the parameters are not (index_inputs says why)."""
  return _rotate_index(normed_index_key(params, c_BSD, _opts(cfg, "indexer")["norm_eps"]), positions, cfg)


def normed_index_key(params: Params, c_BSD: Array, eps: float = INDEX_NORM_EPS) -> Array:
  """LayerNorm(c·w_idk) (scale idk_norm, bias idk_bias) float32, c detached: the deepseek form's index key
  before RoPE (DeepseekV32Indexer's, GLM-5.3-Flash's K-pool indexer's)."""
  k = jax.lax.stop_gradient(c_BSD).astype(jnp.float32) @ params["w_idk"].astype(jnp.float32)
  mean = jnp.mean(k, -1, keepdims=True)
  k = (k - mean) * jax.lax.rsqrt(jnp.mean(jnp.square(k - mean), -1, keepdims=True) + eps)
  return k * params["idk_norm"].astype(jnp.float32) + params["idk_bias"].astype(jnp.float32)


def _rotate_index(a: Array, positions, cfg: HeadConfig) -> Array:
  """RoPE on an index head's first rope_dim dims, or on its last (extra.indexer.rope_dims; HY-V4's)."""
  if _opts(cfg, "indexer")["rope_dims"] == "first" or not cfg.rope_dim:
    return rope.rotate(a, positions, _index_rope(cfg))
  cut = a.shape[-1] - cfg.rope_dim
  return jnp.concatenate([a[..., :cut], rope.rotate(a[..., cut:], positions, _index_rope(cfg))], -1)


def index_queries(params: Params, x_BTD: Array, lat_BTQ: Array, positions, cfg: HeadConfig):
  """The deepseek form's (index queries (B,T,n_I,d_I), weights (B,T,n_I)), float32, the scales
  d_I^-1/2 (scores) and n_I^-1/2 (weights) folded in: the queries from the query latent, rotated at
  `positions`; the weights from x."""
  o = _opts(cfg, "indexer")
  f32 = lambda a: jax.lax.stop_gradient(a).astype(jnp.float32)  # noqa: E731  (inputs detached, as index_inputs)
  qi = jnp.einsum("BTQ,QJI->BTJI", f32(lat_BTQ), params["w_idq"].astype(jnp.float32))
  qi = _rotate_index(qi, positions, cfg) * o["head_dim"] ** -0.5
  w = f32(x_BTD) @ params["w_idw"].astype(jnp.float32) * o["heads"] ** -0.5
  return qi, w


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
  # The inputs are detached, the parameters not: the choice itself stops every gradient (select), and
  # the indexer's own loss (record_indexer_kl) reaches only its parameters.
  w_iq, w_ik, w_iw = (params[n].astype(jnp.float32) for n in ("w_iq", "w_ik", "w_iw"))
  return (jnp.einsum("BTHC,HCJI->BTJI", qn, w_iq), jnp.einsum("BSGC,GCI->BSI", kn, w_ik),
          jnp.einsum("BTHC,HCJ->BTJ", qn, w_iw))


def _indexer_select(params: Params, q_BTHK, k_BSGK, *, cfg: HeadConfig, is_causal, kv_lengths, mask,
                    dense: bool, index=None):
  return reuse_or_record("indexer", is_shared(cfg), dense, lambda: _own_choice(
      params, q_BTHK, k_BSGK, cfg=cfg, is_causal=is_causal, kv_lengths=kv_lengths, mask=mask, dense=dense,
      index=index))


def _reused(state, dense: bool, name: str = "indexer"):
  """A shared layer's choice: the one its full layer's select returned in this model call."""
  if state is None or state[0] != "reuse" or dense not in state[1]:
    raise invalid(f"extra.{name}.shared", True, "False outside a model whose earlier full indexer layer chose "
                  "in the same call (ModelConfig.indexer_types; a shared layer alone has no choice to reuse)")
  return state[1][dense]


def reuse_or_record(name: str, cfg_shared: bool, dense: bool, choose):
  """A selector's select under indexer_types (attn.nn.index_sharing): a shared layer's choice is the one its
  full layer's select returned in this model call; a full layer's, choose(), is recorded where a later
  layer reuses it. name: the selector's extra key (indexer, kpool), for the refusal."""
  state = SHARED_CHOICE.get()
  if cfg_shared:
    return _reused(state, dense, name)
  out = choose()
  if state is not None and state[0] == "record":
    state[1][dense] = out
  return out


def _own_choice(params: Params, q_BTHK, k_BSGK, *, cfg: HeadConfig, is_causal, kv_lengths, mask, dense: bool,
                index=None):
  top_k = _opts(cfg, "indexer")["top_k"]
  if is_deepseek(cfg):
    if index is None:
      raise invalid("extra.indexer.form", "deepseek", "'heads' here: the deepseek form's index queries and "
                    "keys come from the variant (Options.index; mla computes them)")
    qi, ki, w = index
  else:
    qi, ki, w = index_inputs(params, q_BTHK, k_BSGK, cfg)
  S = k_BSGK.shape[1]
  if dense:
    return select.indexer_tokens(qi, ki, w, top_k=top_k, is_causal=is_causal, kv_lengths=kv_lengths,
                                 mask=mask, chunk=None if not is_long(qi.shape[1], S) else INDEX_CHUNK)[:, None]
  idx = select.indexer_top(qi, ki, w, top_k=top_k, is_causal=is_causal, kv_lengths=kv_lengths)
  bits = select.indices_to_bits(idx, S)  # the same set as indexer_bits; idx lets heads that share keys gather
  return kernel.KeyChoice("sparse", {"blocks_BHTN": select.token_blocks(bits, INDEX_BLOCK, S),
                                     "block_k": INDEX_BLOCK, "bits_BTW": bits, "idx_BTk": idx})


def _indexer_params(cfg: HeadConfig) -> int:
  o = _opts(cfg, "indexer")
  if o["shared"]:
    return 0
  H, G, C, J, I = cfg.num_heads, cfg.num_kv_heads, _index_width(cfg), o["heads"], o["head_dim"]
  if o["form"] == "deepseek":  # w_idq, w_idk, the LayerNorm's scale and bias, w_idw
    return cfg.q_latent_dim * J * I + cfg.d_model * (I + J) + 2 * I
  return C * (H * J * I + G * I + H * J)


def indexer_flops(cfg: HeadConfig, T: int, S: int) -> int:
  """Index queries 2·T·H·C·J·I, weights 2·T·H·C·J, index keys 2·S·G·C·I (C = K - rope_dim);
  scores 2·T·S·J·I and their weighted sum 2·T·S·J (ReLU and top-k not counted); 0 on a shared layer."""
  o = _opts(cfg, "indexer")
  if o["shared"]:
    return 0
  H, G, C, J, I = cfg.num_heads, cfg.num_kv_heads, _index_width(cfg), o["heads"], o["head_dim"]
  if o["form"] == "deepseek":  # index queries 2·T·Q'·J·I, weights 2·T·D·J, keys 2·S·D·I, the scores
    return 2 * T * J * (cfg.q_latent_dim * I + cfg.d_model) + 2 * S * cfg.d_model * I + 2 * T * S * J * (I + 1)
  return 2 * T * H * C * J * (I + 1) + 2 * S * G * C * I + 2 * T * S * J * (I + 1)


def indexer_keys(cfg: HeadConfig, T: int) -> int:
  """Keys the indexer attends to over T causal queries (S = T): min(t + 1, top_k) each."""
  k = _opts(cfg, "indexer")["top_k"]
  if k >= T:
    return T * (T + 1) // 2
  return k * (k + 1) // 2 + (T - k) * k


INDEXER = Mechanism(
    name="indexer", defaults={"heads": 4, "head_dim": 32, "top_k": 2048, "form": "heads", "rope_layout": "half",
                              "shared": False, "rope_dims": "first", "norm_eps": INDEX_NORM_EPS},
    check=lambda cfg: _check("indexer", cfg), init=_indexer_init, select=_indexer_select,
    attend=lambda *a, **kw: _indexer_attend(*a, **kw),
    needs=lambda cfg: {} if is_deepseek(cfg) or is_shared(cfg) else {
        "qk_heads": "its 'heads' form reads each head's unrotated query and key dims; form 'deepseek' reads the "
                    "query latent instead (mla with q_latent_dim)"},
    sharding={"w_iq": "HKJI", "w_ik": "GKI", "w_iw": "HKJ", "w_idq": "QJI", "w_idk": "DI", "w_idw": "DJ",
              "idk_norm": "I", "idk_bias": "I"}, param_count=_indexer_params,
    flops=indexer_flops, score_weights=lambda cfg: 0,
    examples=(("indexer 2 heads of 3, top 3", {"extra": {"indexer": {"heads": 2, "head_dim": 3, "top_k": 3}}},
               "C·(H·J·I + G·I + H·J), C = K − r",
               "2·T·H·C·J·(I + 1) + 2·S·G·C·I + 2·T·S·J·(I + 1) (the core: top_k keys a query)"),),
    help="indexer: {heads, head_dim, top_k, form, rope_layout, shared}: DeepSeek-V3.2's lightning indexer, each "
         "query's top_k keys by Σ_j w_j·ReLU(q_j·k), shared by every head; form 'heads' reads the heads' "
         "unrotated dims, 'deepseek' (mla with a query latent) the query latent and x, as DeepSeek-V3.2; "
         "shared: set per layer by ModelConfig.indexer_types (the previous full layer's choice reused)")

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


# The core: a select's choice goes through attn.variants.mechanisms.choice (the one hook). The indexer's
# attend only adds the recording of its training (below) around it.

def _indexer_attend(params: Params, x_BTD, q_BTHK: Array, k_BSGK: Array, v_BSGV: Array, *, cfg: HeadConfig,
                    opts, kernel_args: dict, explicit: bool):
  """The indexer at the core: under record_indexer_kl the phase's mask and KL term, else its select."""
  del x_BTD
  recording = INDEXER_KL.get()
  if recording is not None:
    return _record_kl(*recording, params, q_BTHK, k_BSGK, cfg=cfg, opts=opts, kernel_args=kernel_args)
  return choice.selected(INDEXER, params, q_BTHK, k_BSGK, v_BSGV, cfg=cfg, opts=opts, kernel_args=kernel_args,
                         explicit=explicit)


# Training the indexer (DeepSeek-V3.2, DeepSeek-AI 2025, §2.1). A trainer opens record_indexer_kl(phase)
# around the model's forward pass; each indexer layer run inside then attends as the phase says and
# appends its KL term. The target p_t is the layer's attention weights summed over its heads and
# L1-normalised over the keys (the dense ones at warm-up, the selected ones in the sparse phase), under
# stop_gradient; the indexer's distribution is Softmax(I_t) over the same keys. I's inputs are detached,
# so the term trains only the indexer's parameters, and the selection has no gradient, so the language
# model's loss never reaches them.

PHASES = ("warmup", "sparse", "dense")
# Parameter names of the indexer (both forms): what the warm-up trains, everything else frozen.
INDEXER_PARAMS = frozenset({"w_iq", "w_ik", "w_iw", "w_idq", "w_idk", "w_idw", "idk_norm", "idk_bias"})
INDEXER_KL: contextvars.ContextVar = contextvars.ContextVar("attn_indexer_kl", default=None)


@contextlib.contextmanager
def record_indexer_kl(phase: str) -> Iterator[list]:
  """Yields a list; each indexer layer run inside appends its KL term, a float32 scalar (the mean over
  the batch's queries that see a key of D_KL(p_t || Softmax(I_t))), at trace time.

  phase "warmup": the layer attends to every visible key (dense attention, no selection) and p_t is over
  them; "sparse": the layer attends to its selection (the dense-mask path) and p_t, Softmax(I_t) are over
  the selected keys; "dense" (train.indexer "staged"'s first phase): the layer attends to every visible
  key and appends nothing (the indexer is not run).
  """
  if phase not in PHASES:
    raise invalid("phase", phase, f"one of {list(PHASES)}")
  terms: list = []
  token = INDEXER_KL.set((phase, terms))
  try:
    yield terms
  finally:
    INDEXER_KL.reset(token)


def _record_kl(phase: str, terms: list, params: Params, q_BTHK, k_BSGK, *, cfg: HeadConfig, opts, kernel_args):
  """record_indexer_kl's work for one layer: appends its KL term; returns the opts to attend with."""
  if phase == "dense":
    return opts
  if is_shared(cfg):  # no indexer here to train: attend as the phase says, with the full layer's choice
    if phase == "warmup":
      return opts
    keep = INDEXER.select(params, q_BTHK, k_BSGK, cfg=cfg, is_causal=opts.is_causal, kv_lengths=opts.kv_lengths,
                          mask=opts.mask, dense=True, index=opts.index)
    return opts.replace(mask=masks.combine_masks(opts.mask, keep))
  T, S = q_BTHK.shape[1], k_BSGK.shape[1]
  qi, ki, w = opts.index if is_deepseek(cfg) else index_inputs(params, q_BTHK, k_BSGK, cfg)
  seen = masks.combine_masks(opts.mask, kernel.structured_mask(T, S, opts.is_causal, opts.kv_lengths))
  if phase == "sparse":
    keep = INDEXER.select(params, q_BTHK, k_BSGK, cfg=cfg, is_causal=opts.is_causal, kv_lengths=opts.kv_lengths,
                          mask=opts.mask, dense=True, index=opts.index)
    opts = opts.replace(mask=masks.combine_masks(opts.mask, keep))
    seen = masks.combine_masks(seen, keep)
  logits = kernel.scores(jax.lax.stop_gradient(q_BTHK), jax.lax.stop_gradient(k_BSGK)) * cfg.score_scale
  if kernel_args["softcap"] is not None:
    logits = kernel_args["softcap"] * jnp.tanh(logits / kernel_args["softcap"])
  B, H = logits.shape[:2]
  seen_BHTS = jnp.broadcast_to(True if seen is None else seen, (B, H, T, S))
  p_BTS = jax.lax.stop_gradient(kernel.masked_probabilities(logits, seen_BHTS, kernel_args["sinks"]).sum(1))
  p_BTS = p_BTS / jnp.maximum(p_BTS.sum(-1, keepdims=True), 1e-30)
  keys_BTS = seen_BHTS.any(1)
  # A finite floor, not -inf: a row that sees no key stays finite (and has no term), in value and gradient.
  log_q = jax.nn.log_softmax(jnp.where(keys_BTS, select.index_scores(qi, ki, w), -1e30), axis=-1)
  kl_BT = jnp.sum(jnp.where(p_BTS > 0, p_BTS * (jnp.log(jnp.where(p_BTS > 0, p_BTS, 1.0)) - log_q), 0.0), -1)
  rows_BT = keys_BTS.any(-1)
  terms.append(jnp.sum(jnp.where(rows_BT, kl_BT, 0.0)) / jnp.maximum(rows_BT.sum(), 1))
  return opts
