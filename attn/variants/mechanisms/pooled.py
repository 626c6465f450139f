"""Pooled key selection as head mechanisms: GLM-5.3's K-pool, Qwen4-Exp's compressed indexer (QSA) and
MiniMax-M3's block indexer, on any softmax variant (attn.kernel.pooled defines the choices).

Each reads, as the "heads" form of the lightning indexer does (attn.variants.mechanisms.selection),
the heads' unrotated query and key dims (K - rope_dim = C), so it works from a decoding cache's
keys and caches nothing of its own; the checkpoints compute their index inputs from x instead
(the pooling, scoring, budget and tail rules are theirs, tested against transformers). Options in
HeadConfig.extra:

  kpool          {"heads": 4, "head_dim": 32, "top_k": 2048, "kpool": 16, "always_select_tail": True,
                 "form": "heads"} (glm5_next: index_n_heads, index_head_dim, index_topk, index_kpool,
                 index_kpool_always_select_tail). w_iq (H, C, J, I), w_iw (H, C, J), w_ik
                 (G, C, I), the gate w_ig (G, C, I) and ape (kpool, I). top_k / kpool pools a query.
                 form "deepseek" (GLM-5.3-Flash's Glm5NextTextIndexer; mla with a query latent):
                 computed from x and the query latent as the lightning indexer's deepseek form
                 (attn.variants.mechanisms.selection), without RoPE: index queries c_q·w_idq
                 (Q', J, I), the one index key LayerNorm(x·w_idk) (w_idk (D, I), idk_norm,
                 idk_bias, eps 1e-6), weights x·w_idw (D, J)·J^-1/2, the gate x·w_idg (D, I)
                 (index_kpool_compress_gate), ape (kpool, I). The variant computes them (mla:
                 index_queries, index_keys) and hands them over in Options.index; its decoding
                 cache holds each token's index key and gate (2·I numbers).
                 "shared" (False; set per layer by ModelConfig.indexer_types, attn.nn.index_sharing,
                 never on a model's extra): the layer reuses the previous full layer's choice (as the
                 lightning indexer's shared layers): no index parameters, FLOPs or cache.
  qsa            {"heads": 4, "head_dim": 32, "kv_heads": 1, "budget": 2048, "compress_ratio": 16}
                 (qwen4_exp: indexer_n_heads, indexer_head_dim, indexer_kv_heads, indexer_budget,
                 indexer_compress_ratio). w_iq (H, C, J, I), w_ik (G, C, E, I), RMSNorm scales
                 iq_norm and ik_norm (I,). budget / compress_ratio blocks a query plus its tail.
  block_indexer  {"head_dim": 32, "block": 128, "top_k": 16, "local": 1} (MiniMax-M3: index_head_dim,
                 index_block_size, index_topk_blocks, index_local_blocks; index heads = kv heads).
                 w_iq (H, C, I): a kv group's index query sums its query heads'; w_ik (G, C, I).
                 top_k blocks a kv group and query, the `local` last ones among them.

Where the work is saved: on the key-selection rows (attn.kernel.impls.selects: long calls, no dense
mask). The choice leaves in its own form, and attn.kernel.selected.key_choice (the kernel's one rule)
picks the row: the block indexer's whole key blocks (per kv group) run on the gathered kernel (MoBA's);
K-pool's and QSA's pool ids (with the tail as its own pool) on attn.kernel.tokens, each pool gathered
whole, with at least TOKENS_MIN_SHARE query heads a kv head, else on the block-skipping kernel over
the chosen tokens' 128-key blocks and their bits. Elsewhere the choice is a dense mask on the layer's
own path (the reference).
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp

from attn.config import HeadConfig, invalid
from attn.kernel import pooled, select, selected
from attn.variants.mechanisms.record import Mechanism
from attn.variants.mechanisms import selection
from attn.variants.mechanisms.selection import INDEX_BLOCK

Array = jax.Array
Params = dict[str, Array]

NAMES = ("kpool", "qsa", "block_indexer")
DEFAULTS = {
    "kpool": {"heads": 4, "head_dim": 32, "top_k": 2048, "kpool": 16, "always_select_tail": True,
              "form": "heads", "shared": False},
    "qsa": {"heads": 4, "head_dim": 32, "kv_heads": 1, "budget": 2048, "compress_ratio": 16},
    "block_indexer": {"head_dim": 32, "block": 128, "top_k": 16, "local": 1},
}


def options(cfg: HeadConfig, name: str) -> dict:
  """A pooled selector's options under cfg, its defaults filled in."""
  return {**DEFAULTS[name], **dict((cfg.extra or {}).get(name) or {})}


def _int(name: str, key: str, value, least: int = 1) -> None:
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
    raise invalid(f"extra.{name}.{key}", value, "a positive integer" if least == 1 else f"an integer >= {least}")


def _check(name: str, cfg: HeadConfig) -> None:
  """Options (integers that divide where the checkpoints need it); one selector a layer; softmax heads
  with unrotated dims; no window. Before any tracing."""
  o = options(cfg, name)
  unknown = sorted(set(o) - set(DEFAULTS[name]))
  if unknown:
    raise invalid(f"extra.{name}.{unknown[0]}", o[unknown[0]], f"one of the options {sorted(DEFAULTS[name])}")
  for key, value in o.items():
    if key in ("always_select_tail", "shared"):
      if not isinstance(value, bool):
        raise invalid(f"extra.{name}.{key}", value, "true or false" + (
            " (set per layer by indexer_types)" if key == "shared" else ""))
    elif key == "form":
      if value not in FORMS:
        raise invalid(f"extra.{name}.form", value, f"one of {list(FORMS)}")
    else:
      _int(name, key, value, 0 if key == "local" else 1)
  if name == "kpool" and o["top_k"] % o["kpool"]:
    raise invalid("extra.kpool.top_k", o["top_k"], f"a multiple of kpool={o['kpool']} (top_k / kpool pools "
                  "a query, as glm5_next requires)")
  if name == "qsa":
    if o["budget"] % o["compress_ratio"]:
      raise invalid("extra.qsa.budget", o["budget"], f"a multiple of compress_ratio={o['compress_ratio']} "
                    "(budget / compress_ratio blocks a query, as qwen4_exp requires)")
    if o["heads"] % o["kv_heads"]:
      raise invalid("extra.qsa.kv_heads", o["kv_heads"], f"a divisor of heads={o['heads']} (each index key "
                    "head serves heads / kv_heads index query heads; Qwen4-Exp ships 1)")
  if name == "block_indexer" and o["local"] > o["top_k"]:
    raise invalid("extra.block_indexer.local", o["local"], f"<= top_k={o['top_k']} (the local blocks take "
                  "top-k places; more would drop the query's own block)")
  selection.check_alone(cfg, name, "the pools")
  if is_deepseek(cfg) and cfg.q_latent_dim is None:
    raise invalid("extra.kpool.form", "deepseek", "'heads' without q_latent_dim: the deepseek form reads the "
                  "query latent (mla with q_latent_dim)")
  if cfg.rope_dim >= cfg.d_k:
    raise invalid("rope_dim", cfg.rope_dim, f"below d_k={cfg.d_k} with extra.{name}: the index heads "
                  "read a head's unrotated dims")


FORMS = ("heads", "deepseek")  # extra.kpool.form (module docstring)


def is_deepseek(cfg: HeadConfig) -> bool:
  """Whether the layer has the K-pool indexer in GLM-5.3-Flash's form (reads x and the query latent)."""
  return "kpool" in (cfg.extra or {}) and options(cfg, "kpool")["form"] == "deepseek"


def is_shared(cfg: HeadConfig) -> bool:
  """Whether the layer reuses an earlier layer's K-pool choice (extra.kpool.shared; indexer_types)."""
  return "kpool" in (cfg.extra or {}) and options(cfg, "kpool")["shared"] is True


def computes_index(cfg: HeadConfig) -> bool:
  """Whether the variant computes (and caches) the K-pool indexer's index inputs: its deepseek form, on a layer
  that makes its own choice."""
  return is_deepseek(cfg) and not is_shared(cfg)


def index_width(cfg: HeadConfig) -> int:
  """Numbers a decoding cache holds per token for the deepseek-form K-pool indexer: its key and gate, 2·I."""
  return 2 * options(cfg, "kpool")["head_dim"] if computes_index(cfg) else 0


def index_keys(params: Params, c_BSD, cfg: HeadConfig) -> Array:
  """(B,S,2·I) float32: each token's [index key LayerNorm(c·w_idk) | gate c·w_idg] (the deepseek form); c is
  detached, the parameters not."""
  g = jax.lax.stop_gradient(c_BSD).astype(jnp.float32) @ params["w_idg"].astype(jnp.float32)
  return jnp.concatenate([selection.normed_index_key(params, c_BSD), g], -1)


def index_queries(params: Params, x_BTD, lat_BTQ, cfg: HeadConfig):
  """(index queries (B,T,J,I), weights (B,T,J) with J^-1/2 folded in), float32, of the deepseek form:
  the queries from the query latent, the weights from x (inputs detached)."""
  f32 = lambda a: jax.lax.stop_gradient(a).astype(jnp.float32)  # noqa: E731
  qi = jnp.einsum("BTQ,QJI->BTJI", f32(lat_BTQ), params["w_idq"].astype(jnp.float32))
  return qi, f32(x_BTD) @ params["w_idw"].astype(jnp.float32) * options(cfg, "kpool")["heads"] ** -0.5


def _width(cfg: HeadConfig) -> int:
  return cfg.d_k - cfg.rope_dim


def _init(name: str, key: Array, cfg: HeadConfig, dtype=jnp.float32) -> Params:
  o = options(cfg, name)
  H, G, C, I = cfg.num_heads, cfg.num_kv_heads, _width(cfg), o["head_dim"]
  ks = jax.random.split(key, 5)
  normal = lambda k, shape, fan: (jax.random.normal(k, shape, jnp.float32) / jnp.sqrt(fan)).astype(dtype)  # noqa: E731
  if name == "kpool" and o["shared"]:  # reuses another layer's choice: holds no index weights
    return {}
  if name == "kpool" and o["form"] == "deepseek":
    D, Q, J, P = cfg.d_model, cfg.q_latent_dim, o["heads"], o["kpool"]
    return {"w_idq": normal(ks[0], (Q, J, I), Q), "w_idk": normal(ks[1], (D, I), D), "w_idw": normal(ks[2], (D, J), D),
            "idk_norm": jnp.ones((I,), dtype), "idk_bias": jnp.zeros((I,), dtype),
            "w_idg": normal(ks[3], (D, I), D), "ape": jnp.zeros((P, I), dtype)}
  if name == "kpool":
    J, P = o["heads"], o["kpool"]
    return {"w_iq": normal(ks[0], (H, C, J, I), H * C), "w_iw": normal(ks[1], (H, C, J), H * C),
            "w_ik": normal(ks[2], (G, C, I), G * C), "w_ig": normal(ks[3], (G, C, I), G * C),
            "ape": jnp.zeros((P, I), dtype)}  # glm5_next starts the offsets' rows at zero
  if name == "qsa":
    J, E = o["heads"], o["kv_heads"]
    return {"w_iq": normal(ks[0], (H, C, J, I), H * C), "w_ik": normal(ks[1], (G, C, E, I), G * C),
            "iq_norm": jnp.ones((I,), dtype), "ik_norm": jnp.ones((I,), dtype)}
  return {"w_iq": normal(ks[0], (H, C, I), C * H // G), "w_ik": normal(ks[1], (G, C, I), G * C)}


def _heads(name: str, cfg: HeadConfig, q_BTHK, k_BSGK):
  """The heads' unrotated dims (B,T,H,C), (B,S,G,C), float32 and detached."""
  r, G = cfg.rope_dim, cfg.num_kv_heads
  if q_BTHK.shape[2:] != (cfg.num_heads, cfg.d_k) or k_BSGK.shape[2:] not in ((G, cfg.d_k), (1, cfg.d_k)):
    raise invalid(f"extra.{name}", dict(cfg.extra[name]),
                  f"a layer whose kernel reads per-head queries (H, d_k) and keys (G, d_k); got "
                  f"{tuple(q_BTHK.shape[2:])} and {tuple(k_BSGK.shape[2:])} (e.g. mla's absorbed latent form)")
  if k_BSGK.shape[2] != G:
    k_BSGK = jnp.broadcast_to(k_BSGK, (*k_BSGK.shape[:2], G, cfg.d_k))
  return tuple(jax.lax.stop_gradient(a[..., r:]).astype(jnp.float32) for a in (q_BTHK, k_BSGK))


def _rms(x, scale, eps: float = pooled.RMS_EPS):
  return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * scale.astype(jnp.float32)


def index_inputs(name: str, params: Params, q_BTHK, k_BSGK, cfg: HeadConfig) -> dict:
  """The selector's index inputs from the heads (module docstring): kpool (qi, w, ki, gate), qsa
  (qi, raw ki), block_indexer (qi per kv group, ki)."""
  qn, kn = _heads(name, cfg, q_BTHK, k_BSGK)
  f = {n: a.astype(jnp.float32) for n, a in params.items()}
  o = options(cfg, name)
  if name == "kpool":
    return {"qi": jnp.einsum("BTHC,HCJI->BTJI", qn, f["w_iq"]),
            "w": jnp.einsum("BTHC,HCJ->BTJ", qn, f["w_iw"]) * o["heads"] ** -0.5,
            "ki": jnp.einsum("BSGC,GCI->BSI", kn, f["w_ik"]), "gate": jnp.einsum("BSGC,GCI->BSI", kn, f["w_ig"])}
  if name == "qsa":
    return {"qi": _rms(jnp.einsum("BTHC,HCJI->BTJI", qn, f["w_iq"]), f["iq_norm"]),
            "ki": jnp.einsum("BSGC,GCEI->BSEI", kn, f["w_ik"])}
  B, T, H, C = qn.shape
  G = cfg.num_kv_heads
  w = f["w_iq"].reshape(G, H // G, C, -1)
  return {"qi": jnp.einsum("BTGRC,GRCI->BTGI", qn.reshape(B, T, G, H // G, C), w),
          "ki": jnp.einsum("BSGC,GCI->BSI", kn, f["w_ik"])}


def choose(name: str, inputs: dict, L_BT: Array, cfg: HeadConfig, units: bool = False) -> Array:
  """The choice as block ids (block_indexer: (B,G,T,k)) or token indices (kpool, qsa: (B,1,T,k); units:
  as pool ids, pooled.pool_units)."""
  o = options(cfg, name)
  x = {n: jax.lax.stop_gradient(a) for n, a in inputs.items()}
  if name == "block_indexer":
    return pooled.block_top(x["qi"], x["ki"], L_BT, block=o["block"], top_k=o["top_k"], local=o["local"])
  S = x["ki"].shape[1]
  if name == "kpool":
    P, n, tail = o["kpool"], o["top_k"] // o["kpool"], o["always_select_tail"]
    pk = pooled.kpool_keys(x["ki"], x["gate"], x["ape"], P)
    pools = pooled.pool_top(lambda q, w: pooled.kpool_scores(q, pk, w), (x["qi"], x["w"]), L_BT,
                            N=S // P, pool=P, n=n)
  else:
    P, n, tail = o["compress_ratio"], o["budget"] // o["compress_ratio"], True
    pk = pooled.qsa_keys(x["ki"], x["ik_norm"], P)
    pools = pooled.pool_top(lambda q: pooled.qsa_scores(q, pk), (x["qi"],), L_BT, N=S // P, pool=P, n=n)
  return (pooled.pool_units if units else pooled.pool_tokens)(pools, L_BT, pool=P, tail=tail)[:, None]


def _select(name: str, params: Params, q_BTHK, k_BSGK, *, cfg: HeadConfig, is_causal, kv_lengths, mask,
            dense: bool, index=None):
  if name != "kpool":
    return _own(name, params, q_BTHK, k_BSGK, cfg=cfg, is_causal=is_causal, kv_lengths=kv_lengths, mask=mask,
                dense=dense, index=index)
  return selection.reuse_or_record("kpool", is_shared(cfg), dense, lambda: _own(
      name, params, q_BTHK, k_BSGK, cfg=cfg, is_causal=is_causal, kv_lengths=kv_lengths, mask=mask, dense=dense,
      index=index))


def _own(name: str, params: Params, q_BTHK, k_BSGK, *, cfg: HeadConfig, is_causal, kv_lengths, mask,
         dense: bool, index=None):
  """The layer's own choice (not reused)."""
  B, T, H = q_BTHK.shape[:3]
  S, G = k_BSGK.shape[1], cfg.num_kv_heads
  L = pooled.last_key(T, S, is_causal=is_causal, kv_lengths=kv_lengths, mask=mask if dense else None, B=B)
  if name == "kpool" and is_deepseek(cfg):
    if index is None:
      raise invalid("extra.kpool.form", "deepseek", "'heads' here: the deepseek form's index inputs come from "
                    "the variant (Options.index; mla computes them)")
    qi, kg, w = index
    I = options(cfg, name)["head_dim"]
    inputs = {"qi": qi, "w": w, "ki": kg[..., :I], "gate": kg[..., I:]}
  else:
    inputs = index_inputs(name, params, q_BTHK, k_BSGK, cfg)
  if name == "kpool":
    inputs["ape"] = jax.lax.stop_gradient(params["ape"]).astype(jnp.float32)
  if name == "qsa":
    inputs["ik_norm"] = jax.lax.stop_gradient(params["ik_norm"]).astype(jnp.float32)
  o = options(cfg, name)
  chosen = choose(name, inputs, L, cfg, units=not dense)
  if dense:
    tok = pooled.block_tokens(chosen, block=o["block"]) if name == "block_indexer" else chosen
    m = pooled.token_mask(tok, S)
    return jnp.repeat(m, H // G, axis=1) if m.shape[1] > 1 else m
  if name == "block_indexer":  # whole key blocks, one choice per kv group; the kernel's rule picks the row
    return selected.key_choice(H, G, S, blocks_BGTk=chosen, block=o["block"], token_block=INDEX_BLOCK)
  unit = o["kpool"] if name == "kpool" else o["compress_ratio"]
  return selected.key_choice(H, G, S, units_BGTk=chosen, unit=unit, token_block=INDEX_BLOCK)


# Counts in closed form (S = T where a pair count needs it; C = K - rope_dim).

def param_count(name: str, cfg: HeadConfig) -> int:
  o = options(cfg, name)
  H, G, C, I = cfg.num_heads, cfg.num_kv_heads, _width(cfg), o["head_dim"]
  if name == "kpool" and o["shared"]:
    return 0
  if name == "kpool" and o["form"] == "deepseek":  # w_idq, w_idk, its LayerNorm, w_idw, w_idg, ape
    return cfg.q_latent_dim * o["heads"] * I + cfg.d_model * (2 * I + o["heads"]) + 2 * I + o["kpool"] * I
  if name == "kpool":
    J = o["heads"]
    return C * (H * J * I + H * J + 2 * G * I) + o["kpool"] * I
  if name == "qsa":
    return C * (o["heads"] * H * I + G * o["kv_heads"] * I) + 2 * I
  return C * (H + G) * I


def flops(name: str, cfg: HeadConfig, T: int, S: int) -> int:
  """The selector's forward FLOPs (norms, softmax, masks and top-k not counted):
  kpool  2·T·H·C·J·(I + 1) + 4·S·G·C·I + 2·N·P·I (the gated sums) + 2·T·N·J·(I + 1), N = ⌊S/P⌋;
         its deepseek form 2·T·J·(Q'·I + D) + 4·S·D·I + 2·N·P·I + 2·T·N·J·(I + 1);
  qsa    2·T·H·C·J·I + 2·S·G·C·E·I + N·P·E·I (the means) + T·N·J·(2·I + 1);
  block_indexer  2·T·H·C·I + 2·S·G·C·I + 2·T·N·b·G·I (every token score, N = ⌈S/b⌉)."""
  o = options(cfg, name)
  H, G, C, I = cfg.num_heads, cfg.num_kv_heads, _width(cfg), o["head_dim"]
  if name == "kpool":
    J, P = o["heads"], o["kpool"]
    N = S // P
    if o["shared"]:
      return 0
    if o["form"] == "deepseek":
      return 2 * T * J * (cfg.q_latent_dim * I + cfg.d_model) + 4 * S * cfg.d_model * I + 2 * N * P * I \
          + 2 * T * N * J * (I + 1)
    return 2 * T * H * C * J * (I + 1) + 4 * S * G * C * I + 2 * N * P * I + 2 * T * N * J * (I + 1)
  if name == "qsa":
    J, E, P = o["heads"], o["kv_heads"], o["compress_ratio"]
    N = S // P
    return 2 * T * H * C * J * I + 2 * S * G * C * E * I + N * P * E * I + T * N * J * (2 * I + 1)
  b = o["block"]
  return 2 * T * H * C * I + 2 * S * G * C * I + 2 * T * select.num_blocks(S, b) * b * G * I


def keys(name: str, cfg: HeadConfig, T: int) -> int:
  """(query, key) pairs a head attends to over T causal queries (S = T, no padding): kpool and qsa
  min(n, ⌊(t+1)/P⌋)·P + (t+1) mod P (the tail; kpool only with always_select_tail); block_indexer
  its own block up to t and min(top_k, ⌊t/b⌋ + 1) - 1 whole earlier blocks (the own block is
  forced with local >= 1; with local 0 this assumes it wins a place)."""
  o = options(cfg, name)
  total = 0
  if name == "block_indexer":
    b, k = o["block"], o["top_k"]
    for t in range(T):
      total += t % b + 1 + (min(k, t // b + 1) - 1) * b
    return total
  if name == "kpool":
    P, n, tail = o["kpool"], o["top_k"] // o["kpool"], o["always_select_tail"]
  else:
    P, n, tail = o["compress_ratio"], o["budget"] // o["compress_ratio"], True
  for t in range(T):
    total += min(n, (t + 1) // P) * P + ((t + 1) % P if tail else 0)
  return total


_HELP = {
    "kpool": "kpool: {heads, head_dim, top_k, kpool, always_select_tail, form, shared}: GLM-5.3-Flash's K-pool indexer: "
             "index keys pooled over kpool tokens by a learned gate, top_k / kpool complete pools a query by "
             "Σ_j w_j·ReLU(q_j·k̄), plus its own incomplete pool (the tail); form 'heads' reads the heads' "
             "unrotated dims, 'deepseek' (mla with a query latent) x and the query latent, as GLM-5.3-Flash; shared: "
             "set per layer by ModelConfig.indexer_types",
    "qsa": "qsa: {heads, head_dim, kv_heads, budget, compress_ratio}: Qwen4-Exp's compressed indexer: "
           "RMSNorm(mean) of compress_ratio keys, budget / compress_ratio blocks a query by Σ_j ReLU(q_j·k̄), "
           "plus its tail",
    "block_indexer": "block_indexer: {head_dim, block, top_k, local}: MiniMax-M3's block indexer: one index "
                     "query per kv group, blocks scored by their largest q·k, top_k blocks a group, the "
                     "`local` last always",
}
_EXAMPLES = {
    "kpool": (("kpool 2 heads of 3, pools of 2, top 4", {"extra": {"kpool": {"heads": 2, "head_dim": 3,
                                                                             "top_k": 4, "kpool": 2}}},
               "C·(H·J·I + H·J + 2·G·I) + P·I", "2·T·H·C·J·(I + 1) + 4·S·G·C·I + 2·N·P·I + 2·T·N·J·(I + 1)"),),
    "qsa": (("qsa 2 heads of 4, blocks of 2, budget 4", {"extra": {"qsa": {"heads": 2, "head_dim": 4, "budget": 4,
                                                                           "compress_ratio": 2}}},
             "C·(J·H·I + G·E·I) + 2·I", "2·T·H·C·J·I + 2·S·G·C·E·I + N·P·E·I + T·N·J·(2·I + 1)"),),
    "block_indexer": (("block_indexer width 3, blocks of 2, top 2", {"extra": {"block_indexer": {
        "head_dim": 3, "block": 2, "top_k": 2}}}, "C·(H + G)·I", "2·T·H·C·I + 2·S·G·C·I + 2·T·N·b·G·I"),),
}
_SHARDING = {
    "kpool": {"w_iq": "HKJI", "w_iw": "HKJ", "w_ik": "GKI", "w_ig": "GKI", "ape": None, "w_idq": "QJI", "w_idk": "DI",
              "w_idw": "DJ", "idk_norm": "I", "idk_bias": "I", "w_idg": "DI"},
    "qsa": {"w_iq": "HKJI", "w_ik": "GKEI", "iq_norm": "I", "ik_norm": "I"},
    "block_indexer": {"w_iq": "HKI", "w_ik": "GKI"},
}


def _record(name: str) -> Mechanism:
  return Mechanism(
      name=name, defaults=DEFAULTS[name], check=lambda cfg: _check(name, cfg),
      init=lambda key, cfg, dtype=jnp.float32: _init(name, key, cfg, dtype),
      select=lambda *a, **kw: _select(name, *a, **kw),
      needs=lambda cfg: {} if name == "kpool" and (is_deepseek(cfg) or is_shared(cfg)) else {
          "qk_heads": f"{name} reads each head's unrotated query and key dims" + (
              "; form 'deepseek' reads x and the query latent instead (mla with q_latent_dim)"
              if name == "kpool" else "")},
      sharding=_SHARDING[name], param_count=lambda cfg: param_count(name, cfg),
      flops=lambda cfg, T, S: flops(name, cfg, T, S), score_weights=lambda cfg: 0,
      examples=_EXAMPLES[name], help=_HELP[name])


KPOOL, QSA, BLOCK_INDEXER = (_record(n) for n in NAMES)
RECORDS = (KPOOL, QSA, BLOCK_INDEXER)
