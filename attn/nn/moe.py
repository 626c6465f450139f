"""A mixture-of-experts feed-forward, computed densely: every expert on every token.

The router scores each token against the E experts and keeps the top k
(ModelConfig.moe_top_k); the layer's output is Σ_e w_e·expert_e(x), with w_e
zero for the experts not kept. Every expert runs on every token and the
zeros do the selecting, so the result is exact (the same function as a
sparse dispatch) but costs E/k times a real MoE's expert FLOPs and memory:
it exists so that gpt-oss, Mixtral and DeepSeek-V3 checkpoints load and run
exactly, not to be fast.

Routing (moe_router):
  "softmax"  p = softmax(x·W_r + b_r) over the E experts, in float32; the top
             k kept and, with moe_norm_topk, renormalised to sum 1 (Mixtral;
             gpt-oss's softmax over its top-k logits is the same numbers).
  "sigmoid"  DeepSeek-V3: s = σ(x·W_r); the choice adds a correction bias
             (a buffer, not trained by gradients: DeepSeek moves it to balance
             the load) and is group-limited: the E experts form moe_groups
             groups, each scored by the sum of its two best, and only the
             moe_topk_groups best groups compete for the top k; the weights
             are the chosen s (without the bias), renormalised with
             moe_norm_topk.
  "sqrtsoftplus"  DeepSeek-V4: s = √softplus(x·W_r), chosen with the correction bias as
             "sigmoid" (no groups), the weights the chosen s renormalised with moe_norm_topk.
Either way the weights are then multiplied by moe_routed_scaling. The first moe_hash_first
expert layers (DeepSeek-V4's hash_moe) choose no experts: a table tid2eid (vocab, k), a buffer,
gives each token id its k, weighted by the router's scores s there (a repeated expert counts
as often as it is listed), renormalised with moe_norm_topk; the model passes the token ids.

Each expert is a gated MLP, down(act(gate(x))·up(x)), of width moe_d_ff
(default d_ff), with biases when the model's dense layers have them
(dense_bias, else use_bias); with moe_swiglu_limit ℓ it is gpt-oss's clamped
SwiGLU: g = min(gate(x), ℓ), u = clip(up(x), −ℓ, ℓ), down(g·σ(1.702·g)·(u + 1)); with
moe_swiglu_form "clamp" (DeepSeek-V4) down(act(g)·u) with the same g and u, the shared experts
clamped alike; "clamp_routed" (HY-V4's Glm5NextTextExperts) the same on the routed experts only;
"clamp_after" (Ling-3, transformers' limit_after_act) clamps after the activation,
down(min(act(gate(x)), ℓ)·clip(up(x), −ℓ, ℓ)), the shared experts alike (not the dense layers'
MLPs), and "clamp_after_routed" the same on the routed experts only.
moe_gate_softcap c_g and moe_up_softcap c_u (Inkling-2's mlp_gate_softcap, mlp_up_softcap; SwiGLU experts)
make the routed experts down(cap_g(g)·σ(g)·cap_u(u)), cap_c(x) = c·tanh(x/c): the sigmoid sees the raw gate,
the caps bound the linear gate factor and the up projection (no parameters).
moe_shared_experts S adds a plain gated MLP of width S·moe_d_ff on every token
(DeepSeek's shared experts), or of width moe_shared_d_ff where set, and with
moe_shared_gate its output is scaled by σ(x·w_shared_gate), w (D, 1) (Qwen3-Next's
shared_expert_gate); the first moe_dense_first layers keep the dense
MLP of width d_ff (DeepSeek's first_k_dense_replace), or moe_layer_types says per layer
"dense" or "sparse" (Muse Spark's mlp_layer_types).

Muse Spark's pooled experts (moe_pool_width W): the router reads x at width D (its logits times
moe_router_scale, Muse Spark's output_multiplier, before the sigmoid), while the experts read
norm(x·W_in) (W_in (D, W), a "plus_one" RMSNorm at norm_eps) and run at width W; each expert's
output is RMS-normalised ("input_scaled", one scale shared by the experts, post_norm_eps) before
its routing weight, and the weighted sum goes back to D through W_out (W, D) (attn.nn.norms).

ZAYA1's router (attn.nn.hf.zaya), three options, each off by default:
  moe_router_mlp R   the router is a small network of its own: r = x·W_down + b (D -> R), then
             logits = W_out·gelu(W_2·gelu(W_1·rmsnorm(r) + b_1) + b_2) (R -> classes, GELU the erf
             form, the norm a scale at norm_eps; no bias on W_out); softmax over the classes, the
             choice made on the probabilities plus a balancing bias (`correction`, a buffer as
             DeepSeek's: it moves the choice only), the weights the chosen probabilities. With a
             skip expert its balancing bias starts at -1 (ZAYA's initialisation), the others at 0.
  moe_router_carry   EDA: each expert layer's r adds the previous expert layer's r times a learned
             s (R,) (router_states_scale): r_l = x_l·W_down + b + s_l⊙r_{l-1}, the sum carried on.
             The first expert layer of a stack has no s. The state is per token along depth, so
             decoding needs no cache for it: a model call carries it from layer to layer
             (carrying(), set around the blocks by attn.nn.models.run_blocks); an expert layer
             called on its own (outside a stack) has no state to add, as transformers' first.
  moe_skip_expert    one more routing class, E + 1, that computes nothing: its weight, when
             kept, multiplies zeros. With moe_norm_topk the kept weights are renormalised over
             the kept classes, the skip class among them (ZAYA keeps one class, unrenormalised).
Decided here: the skip class and the router network need the softmax router (ZAYA's), no groups,
no hash layers and no pooled experts; the carry needs the router network (it carries r) and a
decoder-only or encoder stack (run_blocks).
"""

from __future__ import annotations

from typing import Any, Callable

import contextlib
import contextvars

import jax
import jax.numpy as jnp
from flax import nnx

from attn.config import invalid
from attn.nn import norms

Array = jax.Array
ROUTERS = ("softmax", "sigmoid", "sqrtsoftplus")
SWIGLU_FORMS = ("gpt_oss", "clamp", "clamp_routed", "clamp_after", "clamp_after_routed")
GPT_OSS_ALPHA = 1.702  # gpt-oss's swiglu_alpha: g·σ(αg), the sigmoid approximation of GELU
GPT_OSS_LIMIT = 7.0  # gpt-oss's swiglu_limit: transformers' default, and its only value before 5.19


class Buffer(nnx.Variable):
  """State that is not a parameter (transformers' buffers): not trained, not counted."""


# ModelConfig's MoE fields and their defaults (each must keep it unless mlp = "moe").
FIELDS = {"moe_experts": 0, "moe_top_k": 0, "moe_d_ff": None, "moe_router": "softmax",
          "moe_norm_topk": True, "moe_groups": 1, "moe_topk_groups": 1, "moe_routed_scaling": 1.0,
          "moe_shared_experts": 0, "moe_dense_first": 0, "moe_swiglu_limit": None, "moe_shared_d_ff": None,
          "moe_shared_gate": False, "moe_swiglu_form": "gpt_oss", "moe_hash_first": 0, "moe_layer_types": None,
          "moe_pool_width": None, "moe_router_scale": 1.0, "moe_router_mlp": None, "moe_router_carry": False,
          "moe_skip_expert": False, "moe_gate_softcap": None, "moe_up_softcap": None}
# The router state carried between the expert layers of one model call (moe_router_carry): a holder
# {"state": r or None} set by carrying(), None outside one.
CARRY: contextvars.ContextVar = contextvars.ContextVar("attn_router_carry", default=None)


def _int(name: str, value: Any, minimum: int) -> int:
  if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
    raise invalid(name, value, f"an integer >= {minimum}")
  return value


def _positive(name: str, value: Any, what: str) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
    raise invalid(name, value, f"a positive finite number ({what})")


def check(m: Any) -> None:
  """Refuses MoE settings that cannot work or that a model without experts would ignore."""
  if m.mlp != "moe":
    for name, default in FIELDS.items():
      if getattr(m, name) != default:
        raise invalid(name, getattr(m, name), f"{default!r} when mlp={m.mlp!r}: only mlp='moe' reads it")
    return
  E = _int("moe_experts", m.moe_experts, 1)
  k = _int("moe_top_k", m.moe_top_k, 1)
  if k > E:
    raise invalid("moe_top_k", k, f"at most moe_experts={E}: the router keeps k of the E experts")
  if m.moe_d_ff is not None:
    _int("moe_d_ff", m.moe_d_ff, 1)
  if m.moe_router not in ROUTERS:
    raise invalid("moe_router", m.moe_router, f"one of {list(ROUTERS)}")
  if not isinstance(m.moe_norm_topk, bool):
    raise invalid("moe_norm_topk", m.moe_norm_topk, "True or False")
  groups, top_groups = _int("moe_groups", m.moe_groups, 1), _int("moe_topk_groups", m.moe_topk_groups, 1)
  if groups > 1 and m.moe_router != "sigmoid":
    raise invalid("moe_groups", groups, "1 with moe_router='softmax': group-limited routing is "
                  "DeepSeek-V3's sigmoid router's")
  if E % groups or E // groups < 2 and groups > 1:
    raise invalid("moe_groups", groups, f"a divisor of moe_experts={E} leaving at least 2 experts per "
                  "group (a group scores by its two best)")
  if top_groups > groups:
    raise invalid("moe_topk_groups", top_groups, f"at most moe_groups={groups}")
  if k > top_groups * (E // groups):
    raise invalid("moe_top_k", k, f"at most moe_topk_groups·experts per group = {top_groups * (E // groups)}")
  if m.moe_router == "sigmoid" and E < 2:
    raise invalid("moe_experts", E, "at least 2 with moe_router='sigmoid' (groups score by their two best)")
  _positive("moe_routed_scaling", m.moe_routed_scaling, "the routed weights' multiplier")
  _int("moe_shared_experts", m.moe_shared_experts, 0)
  for name, value in (("moe_shared_d_ff", m.moe_shared_d_ff), ("moe_shared_gate", m.moe_shared_gate)):
    if value not in (None, False) and not m.moe_shared_experts:
      raise invalid(name, value, f"{FIELDS[name]!r} with moe_shared_experts=0: it sets the shared experts")
  if m.moe_shared_d_ff is not None:
    _int("moe_shared_d_ff", m.moe_shared_d_ff, 1)
  if not isinstance(m.moe_shared_gate, bool):
    raise invalid("moe_shared_gate", m.moe_shared_gate, "True or False")
  if _int("moe_dense_first", m.moe_dense_first, 0) > m.num_layers:
    raise invalid("moe_dense_first", m.moe_dense_first, f"at most num_layers={m.num_layers}")
  if m.moe_swiglu_limit is not None:
    _positive("moe_swiglu_limit", m.moe_swiglu_limit, "gpt-oss's swiglu_limit, 7.0")
  if _int("moe_hash_first", m.moe_hash_first, 0) > m.num_layers - m.moe_dense_first or (
      m.moe_hash_first and m.moe_groups > 1):
    raise invalid("moe_hash_first", m.moe_hash_first, f"at most num_layers - moe_dense_first = "
                  f"{m.num_layers - m.moe_dense_first} expert layers, without moe_groups (a table picks the experts)")
  _check_muse(m)
  _check_zaya(m)
  _check_softcaps(m)
  if m.moe_swiglu_form not in SWIGLU_FORMS or (m.moe_swiglu_form != "gpt_oss" and m.moe_swiglu_limit is None):
    raise invalid("moe_swiglu_form", m.moe_swiglu_form, f"one of {list(SWIGLU_FORMS)}, and \"gpt_oss\" without "
                  "moe_swiglu_limit (the form of the clamped SwiGLU)")


def _check_muse(m: Any) -> None:
  """moe_layer_types, moe_pool_width and moe_router_scale (Muse Spark's experts)."""
  kinds = m.moe_layer_types
  if kinds is not None:
    if not isinstance(kinds, tuple) or len(kinds) != m.num_layers or set(kinds) - {"dense", "sparse"}:
      raise invalid("moe_layer_types", kinds, f"None or {m.num_layers} entries (num_layers) of 'dense' / 'sparse'")
    if m.moe_dense_first or m.moe_hash_first:
      raise invalid("moe_layer_types", kinds, f"None with moe_dense_first={m.moe_dense_first}, moe_hash_first="
                    f"{m.moe_hash_first}: it says for every layer whether it has experts")
  W = m.moe_pool_width
  if W is not None:
    _int("moe_pool_width", W, 1)
    bias = m.use_bias if m.dense_bias is None else m.dense_bias
    if m.moe_shared_experts or bias or m.moe_swiglu_limit is not None:
      raise invalid("moe_pool_width", W, f"None with moe_shared_experts={m.moe_shared_experts}, dense biases "
                    f"{bias}, moe_swiglu_limit={m.moe_swiglu_limit}: pooled experts are Muse Spark's (no shared "
                    "expert, no bias, plain SwiGLU)")
    if m.norm_type == "layernorm":
      raise invalid("moe_pool_width", W, "None with norm_type='layernorm': the pooled experts' norms are RMSNorms")
  _positive("moe_router_scale", m.moe_router_scale, "the router's logits times it; 1.0: off")


def _check_zaya(m: Any) -> None:
  """moe_router_mlp, moe_router_carry and moe_skip_expert (ZAYA1's router; module docstring)."""
  R = m.moe_router_mlp
  for name in ("moe_router_carry", "moe_skip_expert"):
    if not isinstance(getattr(m, name), bool):
      raise invalid(name, getattr(m, name), "True or False")
  if R is not None:
    _int("moe_router_mlp", R, 1)
  if R is None and not m.moe_skip_expert:
    if m.moe_router_carry:
      raise invalid("moe_router_carry", True, "False without moe_router_mlp: the carried state is the router "
                    "network's r (ZAYA's EDA)")
    return
  what = "moe_router_mlp" if R is not None else "moe_skip_expert"
  value = R if R is not None else True
  if (m.moe_router != "softmax" or m.moe_groups != 1 or m.moe_hash_first or m.moe_pool_width is not None
      or m.moe_router_scale != 1.0):
    raise invalid(what, value, f"{FIELDS[what]!r} with moe_router={m.moe_router!r}, moe_groups={m.moe_groups}, "
                  f"moe_hash_first={m.moe_hash_first}, moe_pool_width={m.moe_pool_width}, moe_router_scale="
                  f"{m.moe_router_scale}: ZAYA's router and skip expert are a softmax router's, without groups, "
                  "hash layers or pooled experts")
  if m.moe_router_carry and m.num_decoder_layers:
    raise invalid("moe_router_carry", True, f"False with num_decoder_layers={m.num_decoder_layers}: the router "
                  "state is carried along one decoder-only or encoder stack")


def classes(m: Any) -> int:
  """The router's classes: the E experts, and the skip expert (moe_skip_expert)."""
  return m.moe_experts + (1 if m.moe_skip_expert else 0)


@contextlib.contextmanager
def carrying(blocks):
  """Around one call of a stack of blocks: a fresh holder of the router state (moe_router_carry), or
  nothing where no expert layer carries one."""
  if not any(getattr(getattr(getattr(b, "mlp", None), "router_net", None), "carry_scale", None) is not None
             for b in blocks):
    yield None
    return
  holder = {"state": None}
  token = CARRY.set(holder)
  try:
    yield holder
  finally:
    CARRY.reset(token)


def _check_softcaps(m: Any) -> None:
  """moe_gate_softcap and moe_up_softcap (Inkling-2's softcapped SwiGLU): positive, on plain SwiGLU experts."""
  for name in ("moe_gate_softcap", "moe_up_softcap"):
    c = getattr(m, name)
    if c is None:
      continue
    _positive(name, c, "the soft-cap c of c·tanh(x/c); None: no cap")
    if m.activation != "silu" or m.moe_swiglu_limit is not None or m.moe_pool_width is not None:
      raise invalid(name, c, f"None with activation={m.activation!r}, moe_swiglu_limit={m.moe_swiglu_limit}, "
                    f"moe_pool_width={m.moe_pool_width}: the soft-caps are Inkling-2's, on SwiGLU experts "
                    "(activation 'silu') with no clamp and no pooling")


def softcapped_swiglu(gate: Array, up: Array, gate_cap: float | None, up_cap: float | None) -> Array:
  """Inkling-2's experts' activation, cap(g)·σ(g)·cap(u), cap(x) = c·tanh(x/c) (no cap where c is None:
  g·σ(g)·u, SwiGLU), in float32, returned in gate's dtype: the sigmoid sees the raw gate."""
  g, u = gate.astype(jnp.float32), up.astype(jnp.float32)
  capped = lambda x, c: x if c is None else c * jnp.tanh(x / c)
  return (capped(g, gate_cap) * jax.nn.sigmoid(g) * capped(u, up_cap)).astype(gate.dtype)


def route(m: Any, logits_BTE: Array, correction_E: Array | None = None) -> Array:
  """The routing weights w (B,T,E), float32: zero but for each token's top k experts (E: the router's
  classes, the skip expert's included; a softmax router's correction is ZAYA's balancing bias)."""
  E, k = m.moe_experts, m.moe_top_k
  logits_BTE = logits_BTE.astype(jnp.float32)
  if m.moe_router == "softmax":
    scores_BTE = jax.nn.softmax(logits_BTE, axis=-1)
    choice_BTE = scores_BTE if correction_E is None else scores_BTE + correction_E.astype(jnp.float32)
  else:
    scores_BTE = (jax.nn.sigmoid(logits_BTE) if m.moe_router == "sigmoid"
                  else jnp.sqrt(jax.nn.softplus(logits_BTE)))
    choice_BTE = scores_BTE + correction_E.astype(jnp.float32)
    if m.moe_groups > 1:
      grouped_BTNE = choice_BTE.reshape(*choice_BTE.shape[:-1], m.moe_groups, E // m.moe_groups)
      group_BTN = jax.lax.top_k(grouped_BTNE, 2)[0].sum(-1)
      kept_BTN = _top_mask(group_BTN, m.moe_topk_groups)
      choice_BTE = jnp.where(jnp.repeat(kept_BTN, E // m.moe_groups, axis=-1), choice_BTE, -jnp.inf)
  keep_BTE = _top_mask(choice_BTE, k)
  w_BTE = jnp.where(keep_BTE, scores_BTE, 0.0)
  if m.moe_norm_topk:
    w_BTE = w_BTE / (w_BTE.sum(-1, keepdims=True) + (0.0 if m.moe_router == "softmax" else 1e-20))
  return w_BTE * m.moe_routed_scaling


def hashed(m: Any, logits_BTE: Array, experts_BTk: Array) -> Array:
  """The routing weights (B,T,E) of a hash layer: the scores at the table's experts (module docstring)."""
  logits_BTE = logits_BTE.astype(jnp.float32)
  scores_BTE = {"softmax": lambda a: jax.nn.softmax(a, axis=-1), "sigmoid": jax.nn.sigmoid,
                "sqrtsoftplus": lambda a: jnp.sqrt(jax.nn.softplus(a))}[m.moe_router](logits_BTE)
  w_BTE = jax.nn.one_hot(experts_BTk, logits_BTE.shape[-1], dtype=jnp.float32).sum(-2) * scores_BTE
  if m.moe_norm_topk:
    w_BTE = w_BTE / (w_BTE.sum(-1, keepdims=True) + (0.0 if m.moe_router == "softmax" else 1e-20))
  return w_BTE * m.moe_routed_scaling


def _top_mask(x_BTE: Array, k: int) -> Array:
  """True at the k largest entries of each row (lax.top_k's ties: the lower index first)."""
  _, idx_BTk = jax.lax.top_k(x_BTE, k)
  return jax.nn.one_hot(idx_BTk, x_BTE.shape[-1], dtype=jnp.bool_).any(-2)


class RouterNet(nnx.Module):
  """ZAYA1's router network (moe_router_mlp R; module docstring): x -> r (D -> R), the state carried in
  (carried: this expert layer adds the previous one's r times carry_scale), then r -> the logits."""

  def __init__(self, m: Any, param: Callable, carried: bool):
    R, C, dt = m.moe_router_mlp, classes(m), jnp.dtype(m.param_dtype)
    self.eps = m.norm_eps
    self.down, self.down_b = param((m.d_model, R), m.d_model), nnx.Param(jnp.zeros((R,), dt))
    self.carry_scale = nnx.Param(jnp.ones((R,), dt)) if carried else None  # ZAYA's router_states_scale
    self.norm = nnx.Param(jnp.ones((R,), dt))
    self.fc1, self.fc1_b = param((R, R), R), nnx.Param(jnp.zeros((R,), dt))
    self.fc2, self.fc2_b = param((R, R), R), nnx.Param(jnp.zeros((R,), dt))
    self.out = param((R, C), R)

  def __call__(self, x_BTD: Array) -> Array:
    """The logits (B,T,classes), float32; r carried on to the next expert layer of the model call."""
    f = lambda a: a[...].astype(jnp.float32)  # noqa: E731
    r_BTR = jnp.einsum("BTD,DR->BTR", x_BTD.astype(jnp.float32), f(self.down)) + f(self.down_b)
    holder = CARRY.get()
    if self.carry_scale is not None and holder is not None and holder["state"] is not None:
      r_BTR = r_BTR + holder["state"] * f(self.carry_scale)
    if holder is not None:
      holder["state"] = r_BTR
    h_BTR = norms.rms(r_BTR, self.norm[...], self.eps, "scale")
    h_BTR = jax.nn.gelu(jnp.einsum("BTR,RS->BTS", h_BTR, f(self.fc1)) + f(self.fc1_b), approximate=False)
    h_BTR = jax.nn.gelu(jnp.einsum("BTR,RS->BTS", h_BTR, f(self.fc2)) + f(self.fc2_b), approximate=False)
    return jnp.einsum("BTR,RC->BTC", h_BTR, f(self.out))


class MoE(nnx.Module):
  """The expert feed-forward of one layer: router, E gated experts (+ shared ones), computed densely."""

  def __init__(self, m: Any, *, rngs: nnx.Rngs, activation: Callable[[Array], Array],
               shared: nnx.Module | None = None, hashed: bool = False, carried: bool = False):
    self.m, self.activation, self.shared = m, activation, shared
    E, D, F = m.moe_experts, m.d_model, m.moe_d_ff or m.d_ff
    bias = m.use_bias if m.dense_bias is None else m.dense_bias
    dt = jnp.dtype(m.param_dtype)
    self.compute = jnp.dtype(m.dtype)

    def param(shape, fan_in):
      return nnx.Param((jax.random.normal(rngs.params(), shape) / jnp.sqrt(fan_in)).astype(dt))

    C, net = classes(m), m.moe_router_mlp is not None  # the skip expert a class; ZAYA's router network
    self.router_w = None if net else param((D, C), D)
    self.router_b = nnx.Param(jnp.zeros((C,), dt)) if bias and not net else None
    self.router_net = RouterNet(m, param, carried) if net else None
    # DeepSeek's correction bias; ZAYA's balancing biases (router network), the skip class's starting at -1
    self.correction = Buffer(jnp.zeros((C,), jnp.float32).at[E:].set(-1.0)) if net else Buffer(
        jnp.zeros((E,), jnp.float32)) if m.moe_router != "softmax" and not hashed else None
    self.tid2eid = Buffer(jnp.zeros((m.vocab_size, m.moe_top_k), jnp.int32)) if hashed else None
    W = m.moe_pool_width  # Muse Spark: the experts run at width W between two projections
    self.pool_in = param((D, W), D) if W else None
    self.pool_norm = nnx.Param(jnp.zeros((W,), dt)) if W else None  # "plus_one", norm_eps
    self.expert_norm = nnx.Param(jnp.zeros((W,), dt)) if W else None  # "input_scaled", post_norm_eps
    self.pool_out = param((W, D), W) if W else None
    X = W or D  # the experts' input and output width
    self.w_gate, self.w_up, self.w_down = param((E, X, F), X), param((E, X, F), X), param((E, F, X), F)
    self.b_gate = nnx.Param(jnp.zeros((E, F), dt)) if bias else None
    self.b_up = nnx.Param(jnp.zeros((E, F), dt)) if bias else None
    self.b_down = nnx.Param(jnp.zeros((E, D), dt)) if bias else None
    self.shared_gate = param((D, 1), D) if m.moe_shared_gate else None

  def weights(self, x_BTD: Array, tokens_BT: Array | None = None) -> Array:
    """The routing weights (B,T,E) of x's tokens (zero outside each token's top k); a hash layer reads
    the token ids."""
    if self.router_net is not None:
      logits_BTE = self.router_net(x_BTD)
    else:
      logits_BTE = jnp.einsum("BTD,DE->BTE", x_BTD.astype(jnp.float32), self.router_w[...].astype(jnp.float32))
    if self.router_b is not None:
      logits_BTE = logits_BTE + self.router_b[...].astype(jnp.float32)
    if self.m.moe_router_scale != 1.0:  # Muse Spark's output_multiplier
      logits_BTE = logits_BTE * self.m.moe_router_scale
    if self.tid2eid is not None:
      if tokens_BT is None:
        raise invalid("tokens", None, "the token ids: a hash-routed expert layer (moe_hash_first) picks its "
                      "experts by them (a DecoderLM passes them)")
      return hashed(self.m, logits_BTE, self.tid2eid[...][tokens_BT])
    w_BTE = route(self.m, logits_BTE, None if self.correction is None else self.correction[...])
    return w_BTE[..., :self.m.moe_experts] if self.m.moe_skip_expert else w_BTE  # the skip class: nothing

  def __call__(self, x_BTD: Array, tokens_BT: Array | None = None) -> Array:
    c = self.compute
    x = x_BTD.astype(c)
    if self.pool_in is not None:  # Muse Spark: D -> W, a norm, the experts at W
      x = norms.rms(jnp.einsum("BTD,DW->BTW", x, self.pool_in[...].astype(c)), self.pool_norm[...],
                    self.m.norm_eps, "plus_one")
    gate_BTEF = jnp.einsum("BTD,EDF->BTEF", x, self.w_gate[...].astype(c))
    up_BTEF = jnp.einsum("BTD,EDF->BTEF", x, self.w_up[...].astype(c))
    if self.b_gate is not None:
      gate_BTEF, up_BTEF = gate_BTEF + self.b_gate[...].astype(c), up_BTEF + self.b_up[...].astype(c)
    limit = self.m.moe_swiglu_limit
    if limit is not None and self.m.moe_swiglu_form in ("clamp", "clamp_routed"):  # DeepSeek-V4, HY-V4
      h_BTEF = self.activation(jnp.minimum(gate_BTEF, limit)) * jnp.clip(up_BTEF, -limit, limit)
    elif limit is not None and self.m.moe_swiglu_form in ("clamp_after", "clamp_after_routed"):  # Ling-3
      h_BTEF = jnp.minimum(self.activation(gate_BTEF), limit) * jnp.clip(up_BTEF, -limit, limit)
    elif limit is not None:  # gpt-oss
      gate_BTEF = jnp.minimum(gate_BTEF, limit)
      h_BTEF = gate_BTEF * jax.nn.sigmoid(GPT_OSS_ALPHA * gate_BTEF) * (jnp.clip(up_BTEF, -limit, limit) + 1)
    elif self.m.moe_gate_softcap is not None or self.m.moe_up_softcap is not None:  # Inkling-2
      h_BTEF = softcapped_swiglu(gate_BTEF, up_BTEF, self.m.moe_gate_softcap, self.m.moe_up_softcap)
    else:
      h_BTEF = self.activation(gate_BTEF) * up_BTEF
    y_BTED = jnp.einsum("BTEF,EFD->BTED", h_BTEF, self.w_down[...].astype(c))
    if self.b_down is not None:
      y_BTED = y_BTED + self.b_down[...].astype(c)
    if self.expert_norm is not None:  # each expert's output normed, then weighted, then W -> D
      eps = self.m.norm_eps if self.m.post_norm_eps is None else self.m.post_norm_eps
      y_BTED = norms.rms(y_BTED, self.expert_norm[...], eps, "input_scaled")
    out_BTD = jnp.einsum("BTE,BTED->BTD", self.weights(x_BTD, tokens_BT).astype(c), y_BTED)
    if self.pool_out is not None:
      out_BTD = jnp.einsum("BTW,WD->BTD", out_BTD, self.pool_out[...].astype(c))
    if self.shared is None:
      return out_BTD
    shared_BTD = self.shared(x_BTD)
    if self.shared_gate is not None:
      shared_BTD = jax.nn.sigmoid(jnp.einsum("BTD,DO->BTO", x, self.shared_gate[...].astype(c))) * shared_BTD
    return out_BTD + shared_BTD
