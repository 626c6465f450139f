"""Attention over chosen tokens, one choice shared by the query heads that share keys.

A selection made once per token for a group of heads (DeepSeek's lightning indexer:
every head of the layer; a GQA model: one choice per kv group, serving its R = H/G
query heads). Each gathered key/value row then feeds all R (or H) query rows of its
token: per selected (query, key) pair 2·(K + V) numbers are read per kv head for
2·R·(K + V) FLOPs, the rule the fast sparse kernels follow (FlashMLA's sparse prefill,
fla's NSA kernel; ../shared/research/selection.md).

  idx_BGTk  (B, 1|G, T, k) int: the keys each query chose (1: one choice for every
            head; G: one per kv group). Entries outside [0, S), past kv_lengths or
            (is_causal, bottom-right aligned) in the future are ignored; duplicates
            count once (unique=True: the caller says there are none, as
            attn.kernel.select's selector guarantees, and no sort is done).

The forward pass maps over tiles of `tile` queries: the tile's chosen rows are
gathered (jnp.take), scored against all of the tile's query heads at once
(einsum 'cgrK,ckgK->cgrk'), masked with -inf, softmaxed in float32 (a fully
masked row gives zeros) and reduced against the gathered values; the log-sum-exp is
kept. Nothing of size T × S is built: the live tile is tile·k·G·(K + V) numbers.

The backward pass (custom VJP) recomputes P from the saved log-sum-exp per tile
(FlashAttention-2's rule): dq from the gathered tile; dk, dv scattered-added at the
tile's chosen rows only (tile·k rows a step, the pairs themselves: no T × S array
and no dense scatter). Softmax with softcap; no sinks, windows or dense masks.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

Array = jax.Array

TILE_BYTES = 1 << 21  # the gathered k and v rows of one tile: ~2 MiB (stays in cache)


@dataclasses.dataclass(frozen=True)
class _Plan:
  tile: int
  n_tiles: int
  scale: float
  softcap: float | None
  unit: int = 1  # keys an index names: 1 (tokens) or U (ids of U-key slices [U·i, U·i + U))


def _logits(plan: _Plan, q_GcRK, k_GckK, ok_ck):
  s = jnp.einsum("gcrK,gckK->gcrk", q_GcRK.astype(jnp.float32), k_GckK.astype(jnp.float32)) * plan.scale
  dcap = None
  if plan.softcap is not None:
    u = jnp.tanh(s / plan.softcap)
    s, dcap = plan.softcap * u, 1.0 - u * u
  return jnp.where(ok_ck[None, :, None, :], s, -jnp.inf), dcap


def _take(plan: _Plan, x_GSX, idx_ck):
  """(G,c,k·unit,X): the rows (or the unit-long slices of rows) each index names, gathered."""
  if plan.unit == 1:
    return jnp.take(x_GSX, idx_ck, axis=1)
  G, S, X = x_GSX.shape
  g = jnp.take(x_GSX.reshape(G, S // plan.unit, plan.unit, X), idx_ck, axis=1)  # (G,c,k,U,X)
  return g.reshape(G, idx_ck.shape[0], -1, X)


def _tiles(plan: _Plan, x, axis: int):
  """x's T' axis (at `axis`) cut into (n_tiles, ..., tile, ...), the tiles leading."""
  x = x.reshape(*x.shape[:axis], plan.n_tiles, plan.tile, *x.shape[axis + 1:])
  return jnp.moveaxis(x, axis, 0)


def _untile(x, axis: int):
  """_tiles' inverse for a stacked (n_tiles, ..., tile, ...) output."""
  x = jnp.moveaxis(x, 0, axis)
  return x.reshape(*x.shape[:axis], -1, *x.shape[axis + 2:])


def _forward(plan: _Plan, q_GTRK, k_GSK, v_GSV, idx_Tk, ok_Tk):
  def tile(args):
    q, idx, ok = args
    kg, vg = _take(plan, k_GSK, idx), _take(plan, v_GSV, idx)  # (G,c,k,K), (G,c,k,V)
    s, _ = _logits(plan, q, kg, ok)
    m = s.max(-1)
    m = jnp.where(m == -jnp.inf, 0.0, m)
    p = jnp.exp(s - m[..., None])
    l = p.sum(-1)
    seen = l > 0
    l_safe = jnp.where(seen, l, 1.0)
    o = jnp.einsum("gcrk,gckV->gcrV", p, vg.astype(jnp.float32)) / l_safe[..., None]
    return o, jnp.where(seen, m + jnp.log(l_safe), 0.0)

  o, lse = lax.map(tile, (_tiles(plan, q_GTRK, 1), _tiles(plan, idx_Tk, 0), _tiles(plan, ok_Tk, 0)))
  return _untile(o, 1), _untile(lse, 1)


def _backward(plan: _Plan, q_GTRK, k_GSK, v_GSV, idx_Tk, ok_Tk, o_GTRV, lse_GTR, do_GTRV):
  do_GTRV = do_GTRV.astype(jnp.float32)
  delta_GTR = jnp.einsum("gtrV,gtrV->gtr", do_GTRV, o_GTRV.astype(jnp.float32))
  G = k_GSK.shape[0]

  def tile(carry, args):
    dk_SGK, dv_SGV = carry
    q, idx, ok, lse, do, delta = args
    kg, vg = _take(plan, k_GSK, idx), _take(plan, v_GSV, idx)
    s, dcap = _logits(plan, q, kg, ok)
    p = jnp.exp(s - lse[..., None])  # 0 where masked
    dp = jnp.einsum("gcrV,gckV->gcrk", do, vg.astype(jnp.float32))
    ds = p * (dp - delta[..., None])
    if dcap is not None:
      ds = ds * dcap
    dq = jnp.einsum("gcrk,gckK->gcrK", ds, kg.astype(jnp.float32)) * plan.scale
    dkg = jnp.einsum("gcrk,gcrK->gckK", ds, q.astype(jnp.float32)) * plan.scale
    dvg = jnp.einsum("gcrk,gcrV->gckV", p, do)
    flat = idx.reshape(-1)  # added token-major (S/U, U·G·X): each chosen row (or slice) one contiguous slab
    rows = lambda d: (d.reshape(G, flat.shape[0], plan.unit, d.shape[-1]).transpose(1, 2, 0, 3)  # noqa: E731
                      .reshape(flat.shape[0], -1))
    dk_SGK = dk_SGK.at[flat].add(rows(dkg), mode="drop")
    dv_SGV = dv_SGV.at[flat].add(rows(dvg), mode="drop")
    return (dk_SGK, dv_SGV), dq

  S, K, V = k_GSK.shape[1], k_GSK.shape[2], v_GSV.shape[2]
  U = plan.unit
  init = (jnp.zeros((S // U, U * G * K), jnp.float32), jnp.zeros((S // U, U * G * V), jnp.float32))
  xs = (_tiles(plan, q_GTRK, 1), _tiles(plan, idx_Tk, 0), _tiles(plan, ok_Tk, 0), _tiles(plan, lse_GTR, 1),
        _tiles(plan, do_GTRV, 1), _tiles(plan, delta_GTR, 1))
  (dk, dv), dq = lax.scan(tile, init, xs)
  return (_untile(dq, 1).astype(q_GTRK.dtype), dk.reshape(S, G, K).swapaxes(0, 1).astype(k_GSK.dtype),
          dv.reshape(S, G, V).swapaxes(0, 1).astype(v_GSV.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _core(plan, q, k, v, idx, ok):
  return _forward(plan, q, k, v, idx, ok)[0]


def _core_fwd(plan, q, k, v, idx, ok):
  o, lse = _forward(plan, q, k, v, idx, ok)
  return o, (q, k, v, idx, ok, o, lse)


def _core_bwd(plan, res, do):
  q, k, v, idx, ok, o, lse = res
  dq, dk, dv = _backward(plan, q, k, v, idx, ok, o, lse, do)
  return dq, dk, dv, None, None


_core.defvjp(_core_fwd, _core_bwd)


def valid(idx_BGTk: Array, S: int, T: int, *, is_causal: bool, kv_lengths: Array | None = None,
          unique: bool = False) -> tuple[Array, Array]:
  """(idx, ok): the indices (sorted along k unless unique) and where each one counts: inside
  [0, min(S, kv_lengths)), not in the future under is_causal, the first of equal indices."""
  idx = jnp.asarray(idx_BGTk).astype(jnp.int32)
  B = idx.shape[0]
  if not unique:
    idx = jnp.sort(idx, axis=-1)
  limit_B = jnp.full((B,), S, jnp.int32)
  if kv_lengths is not None:
    limit_B = jnp.minimum(jnp.asarray(kv_lengths).astype(jnp.int32), S)
  ok = (idx >= 0) & (idx < limit_B[:, None, None, None])
  if is_causal:
    ok = ok & (idx <= (jnp.arange(T) + S - T)[None, None, :, None])
  if not unique:
    ok = ok & jnp.concatenate([jnp.ones_like(idx[..., :1], bool), idx[..., 1:] != idx[..., :-1]], -1)
  return jnp.where(ok, idx, 0), ok


def unit_tokens(idx_BGTk: Array, unit: int) -> Array:
  """(B,G,T,k·unit) the token indices of unit-long slices [unit·i, unit·i + unit) (-1 for none)."""
  if unit == 1:
    return idx_BGTk
  tok = idx_BGTk[..., None] * unit + jnp.arange(unit, dtype=jnp.int32)
  return jnp.where(idx_BGTk[..., None] >= 0, tok, -1).reshape(*idx_BGTk.shape[:3], -1)


def tile_rows(k: int, G: int, K: int, V: int, budget: int = TILE_BYTES) -> int:
  """Queries a tile: the gathered rows (tile·k·G·(K + V) float32) near `budget` bytes, 1 to 64."""
  c = max(1, budget // max(1, 4 * k * G * (K + V)))
  return int(min(64, 1 << (c.bit_length() - 1)))


def attention(q_BTHK: Array, k_BSGK: Array, v_BSGV: Array, idx_BGTk: Array, *, scale: float,
              is_causal: bool = False, kv_lengths: Array | None = None, softcap: float | None = None,
              unique: bool = False, tile: int | None = None, unit: int = 1) -> Array:
  """softmax(cap(scale · q kᵀ)) v of each query over the keys its head group chose (module docstring).

  q (B,T,H,K), k (B,S,G|1,K), v (B,S,G,V); idx (B, 1|G, T, k): one choice for every head or one
  per kv group. unit > 1: each index i names the slice of keys [unit·i, unit·i + unit) (pooled
  choices: one index a pool, the slice gathered whole), distinct, -1 for none. Returns (B,T,H,V) in
  q's dtype. The selection has no gradient.
  """
  B, T, H, K = q_BTHK.shape
  S, G, V = v_BSGV.shape[1], v_BSGV.shape[2], v_BSGV.shape[3]
  if k_BSGK.shape[2] != G:
    k_BSGK = jnp.broadcast_to(k_BSGK, (B, S, G, K))
  Gs, k = idx_BGTk.shape[1], idx_BGTk.shape[3]
  if idx_BGTk.shape[0] != B or idx_BGTk.shape[2] != T or Gs not in (1, G) or H % G:
    raise ValueError(f"idx_BGTk {idx_BGTk.shape}: want (B={B}, 1 or G={G}, T={T}, k) with H={H} a "
                     f"multiple of G")
  R = H // G
  idx_BGTk = lax.stop_gradient(idx_BGTk).astype(jnp.int32)
  if unit > 1:  # the slices' keys decide what counts; the slice ids are what is gathered
    _, ok = valid(unit_tokens(idx_BGTk, unit), S, T, is_causal=is_causal, kv_lengths=kv_lengths, unique=True)
    idx, k = jnp.maximum(idx_BGTk, 0), k * unit
    Su = -(-S // unit) * unit
    k_BSGK, v_BSGV = (jnp.pad(a, ((0, 0), (0, Su - S), (0, 0), (0, 0))) for a in (k_BSGK, v_BSGV))
  else:
    idx, ok = valid(idx_BGTk, S, T, is_causal=is_causal, kv_lengths=kv_lengths, unique=unique)
  Gt = G if Gs == 1 else 1  # kv heads one gathered token carries
  c = min(tile or tile_rows(k, Gt, K, V), T)
  n = -(-T // c)
  plan = _Plan(c, n, float(scale), None if softcap is None else float(softcap), int(unit))
  pad = n * c - T
  q = jnp.pad(q_BTHK, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(B, n * c, G, R, K)
  idx = jnp.pad(idx, ((0, 0), (0, 0), (0, pad), (0, 0)))
  ok = jnp.pad(ok, ((0, 0), (0, 0), (0, pad), (0, 0)))
  core = functools.partial(_core, plan)
  q = q.transpose(0, 2, 1, 3, 4)  # (B,G,T',R,K): the kv heads leading, each gathered row K long
  k_BGSK, v_BGSV = k_BSGK.transpose(0, 2, 1, 3), v_BSGV.transpose(0, 2, 1, 3)
  if Gs == 1:  # every kv head's row at each chosen token
    out = jax.vmap(core)(q, k_BGSK, v_BGSV, idx[:, 0], ok[:, 0])  # (B,G,T',R,V)
  else:  # one choice per kv group: the groups apart, one kv head each
    per = jax.vmap(core, in_axes=(0, 0, 0, 0, 0))
    out = jax.vmap(per)(q[:, :, None], k_BGSK[:, :, None], v_BGSV[:, :, None], idx, ok)[:, :, 0]
  out = out.transpose(0, 2, 1, 3, 4)
  return out.reshape(B, n * c, H, V)[:, :T].astype(q_BTHK.dtype)


def pairs(idx_BGTk: Array, S: int, T: int, *, is_causal: bool, kv_lengths=None) -> int:
  """The (query, key) pairs per head group the selection attends to (for the bench's accounting)."""
  return int(valid(idx_BGTk, S, T, is_causal=is_causal, kv_lengths=kv_lengths)[1].sum())
