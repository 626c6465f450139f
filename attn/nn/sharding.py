"""How each variant's arrays split over a mesh axis "heads": tensor parallelism by heads (Megatron-LM).

Every parameter has one letter per axis: the canonical layout's here (CANONICAL),
the rest on the records that own them (below). The README's dimension letters
where they apply (D model width, H query heads, G key/value heads, K, V), and
a variant's own for the rest (C mla's latent, Q its query latent, R its RoPE
key width, J collaborative's shared width, E split_input's D/H input slice,
P fused's packed Q|K|V columns, grouped_lowrank's output groups, O its rank). With M devices
on "heads" (M must divide H):

  H  split: each device holds H/M query heads (their W^Q columns and biases,
     their W^O rows, their W_h in merged, their m_h in collaborative).
  G  split when M divides G, so that device d holds the kv heads its query
     heads read (heads are contiguous: h reads g = h // (H/G)); replicated
     otherwise (G < M, e.g. multi-query attention), every device then holding
     every kv head and using those of its own query heads.
  P  fused's (D, H·K + G·K + G·V) matrix: split into M equal column blocks
     when M divides its width, else replicated. The blocks are not head
     aligned (the columns are [Q heads | K heads | V heads]), so XLA moves the
     projected q, k, v to their heads' devices after the one packed matmul;
     per_head's layout, three matrices, needs no such move. grouped_lowrank's
     A (g, H/g·V, r) and B (g·r, D) split by groups where M divides g: each
     device then holds whole groups of its own heads (B's g·r rows split wherever
     M divides g·r, a plain block split where M does not divide g).
  any other letter, and None (the whole array): replicated. Shared arrays
     are: two_stage's D×D first stage, mla's latent projections W^DKV, W^DQ,
     W^KR, collaborative's shared W̃_Q, W̃_K, talking_heads' H×H mixes
     (mixing needs every head's logits; XLA gathers them).

W^O is split by its input rows, the heads, so each device projects its heads'
outputs to a partial (B,T,D) and one all-reduce sums them; XLA inserts it from
these shardings, as it inserts every other collective. Everything outside the
attention layers (embeddings, MLPs, norms) is replicated over "heads".

CANONICAL is the rule for the canonical layout's names; each variant's record
declares its other parameters and the names it uses otherwise (Variant.sharding),
each head mechanism's record its own (Mechanism.sharding: gates and sinks split
with their heads, QK-norm scales replicated). A parameter of a variant that
declares letters but not for that name is refused by name; a variant that
declares none (a first draft, a plugin) has all its own parameters replicated
over "heads", the canonical names too, with a warning saying so (tests check every built-in's parameters are declared).
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
from flax import nnx
from jax.sharding import PartitionSpec

from attn import api
from attn.config import HeadConfig, invalid
from attn.nn.attention import MultiHeadAttention
from attn.variants import mechanisms
from attn.variants.base import Variant

HEADS = "heads"  # the mesh axis heads split over

CANONICAL = {"w_q": "DHK", "w_k": "DGK", "w_v": "DGV", "w_o": "HVD",
             "b_q": "HK", "b_k": "GK", "b_v": "GV", "b_o": "D"}

class ReplicatedWarning(UserWarning):
  """A variant that declares no sharding letters: its parameters are replicated over "heads"."""


def axes(variant: str | Variant, name: str) -> str | None:
  """The letters of parameter `name` of `variant` (None: replicated); refuses an undeclared one."""
  v = api.get_variant(variant)
  own = v.sharding
  from_mechanisms = mechanisms.letters()
  if name in from_mechanisms:
    return from_mechanisms[name]
  if own is None:  # not even the canonical names: a draft's w_o need not be (H, V, D)
    warnings.warn(f"attn: variant {v.name!r} declares no sharding letters (Variant.sharding): its "
                  f"parameter {name!r} is replicated over the mesh's {HEADS!r} axis", ReplicatedWarning,
                  stacklevel=2)
    return None
  if name in own:
    return own[name]
  if name in CANONICAL:
    return CANONICAL[name]
  raise invalid(f"{v.name}.{name}", name,
                f"a parameter declared in variant {v.name!r}'s record (Variant.sharding) or the "
                "canonical layout: say how it splits over the mesh's heads axis")


def _axis_spec(letter: str, size: int, cfg: HeadConfig, heads: int) -> str | None:
  if letter == "H":
    return HEADS
  if letter == "G":
    return HEADS if cfg.num_kv_heads % heads == 0 else None
  if letter == "P":
    return HEADS if size % heads == 0 else None
  return None


def param_specs(variant: str | Variant, cfg: HeadConfig, heads: int) -> dict[str, PartitionSpec]:
  """name -> PartitionSpec of each parameter of `variant` for cfg over `heads` devices (the rule above)."""
  v = api.check_config(variant, cfg)
  if cfg.num_heads % heads:
    raise invalid("heads", heads, f"a divisor of num_heads={cfg.num_heads}")
  out = {}
  from_mechanisms = mechanisms.names()
  for name, shape in api.param_shapes(v, cfg).items():
    letters = axes(v, name)
    if letters is None or heads == 1:
      out[name] = PartitionSpec()
      continue
    if name in from_mechanisms:  # a headwise gate has no V axis: its letters stop at its rank
      letters = letters[:len(shape)]
    if len(letters) != len(shape):
      raise invalid(f"{v.name}.sharding[{name!r}]", letters, f"{len(shape)} letters, one per axis of {shape}")
    out[name] = PartitionSpec(*[_axis_spec(a, n, cfg, heads) for a, n in zip(letters, shape)])
  return out


def _keys(path) -> tuple:
  return tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", None))) for k in path)


def model_specs(model: nnx.Module, params: Any, heads: int) -> Any:
  """A PartitionSpec per leaf of `params` (nnx.state(model, nnx.Param)): attention by the table, rest replicated."""
  layers = {}
  for path, node in nnx.iter_graph(model):
    if isinstance(node, MultiHeadAttention):
      for name, spec in param_specs(node.variant, node.cfg, heads).items():
        layers[tuple(path) + ("params", name)] = spec

  def spec(path, _):
    keys = _keys(path)
    keys = keys[:-1] if keys and keys[-1] == "value" else keys
    return layers.get(keys, PartitionSpec())

  return jax.tree_util.tree_map_with_path(spec, params)
