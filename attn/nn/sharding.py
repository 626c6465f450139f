"""How each variant's arrays split over a mesh axis "heads": tensor parallelism by heads (Megatron-LM).

Every parameter is declared here by one letter per axis, DESIGN.md's letters
where they apply (D model width, H query heads, G key/value heads, K, V) and
a variant's own for the rest (C mla's latent, Q its query latent, R its RoPE
key width, J collaborative's shared width, E split_input's D/H input slice,
P fused's packed Q|K|V columns). With M devices on "heads" (M must divide H):

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
     per_head's layout, three matrices, needs no such move.
  any other letter, and None (the whole array): replicated. Shared arrays
     are: two_stage's D×D first stage, mla's latent projections W^DKV, W^DQ,
     W^KR, collaborative's shared W̃_Q, W̃_K, talking_heads' H×H mixes
     (mixing needs every head's logits; XLA gathers them).

W^O is split by its input rows, the heads, so each device projects its heads'
outputs to a partial (B,T,D) and one all-reduce sums them; XLA inserts it from
these shardings, as it inserts every other collective. Everything outside the
attention layers (embeddings, MLPs, norms) is replicated over "heads".

CANONICAL is the rule for the canonical layout's names; LAYOUTS lists each
variant's other parameters and the names it uses otherwise; MECHANISMS the head
mechanisms' (gates and sinks split with their heads, QK-norm scales replicated). A parameter of a
registered variant that neither declares is refused by name (tests check the
table against every variant's parameters).
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx
from jax.sharding import PartitionSpec

from attn import api
from attn.config import HeadConfig, invalid
from attn.nn.attention import MultiHeadAttention

HEADS = "heads"  # the mesh axis heads split over

CANONICAL = {"w_q": "DHK", "w_k": "DGK", "w_v": "DGV", "w_o": "HVD",
             "b_q": "HK", "b_k": "GK", "b_v": "GV", "b_o": "D"}

LAYOUTS: dict[str, dict[str, str | None]] = {
    "per_head": {},
    "fused": {"w_qkv": "DP", "b_qkv": "P", "w_o": "HD"},  # w_o (H·V, D): H-major rows
    "two_stage": {"w_q1": "DD", "w_k1": "DD", "w_v1": "DD", "b_q1": "D", "b_k1": "D", "b_v1": "D"},
    "split_input": {"w_q": "HEK", "w_k": "GEK", "w_v": "GEV"},
    "merged": {"w_qk": "HDD", "b_kc": "HD"},
    "collaborative": {"w_q": "DJ", "w_k": "DJ", "b_q": "J", "b_k": "J", "m": "HJ"},
    "mla": {"w_dq": "DQ", "w_uq": "QHK", "w_dkv": "DC", "w_uk": "CGK", "w_uv": "CGV",
            "w_kr": "DR", "b_kr": "R"},
    "talking_heads": {"mix_l": None, "mix_w": None},
    # X: differential's two query/key pairs, tpa's factor ranks (replicated). Each device keeps its
    # heads' head factors a^q (a^k, a^v when M divides G) and every dim factor b.
    "differential": {"w_q": "DXHK", "w_k": "DXGK", "b_q": "XHK", "b_k": "XGK", "lambda_q1": None,
                     "lambda_k1": None, "lambda_q2": None, "lambda_k2": None, "norm": None},
    "tpa": {"w_aq": "DXH", "w_bq": "DXK", "w_ak": "DXG", "w_bk": "DXK", "w_av": "DXG", "w_bv": "DXV",
            "b_aq": "XH", "b_bq": "XK", "b_ak": "XG", "b_bk": "XK", "b_av": "XG", "b_bv": "XV"},
}
# The head mechanisms' parameters (attn.variants.mechanisms), on any variant: a gate or a sink
# belongs to its head. A headwise gate has no V axis: its letters stop at the array's rank.
MECHANISMS = {"w_gate": "DHV", "b_gate": "HV", "sinks": "H", "q_norm": None, "k_norm": None}


def axes(variant: str, name: str) -> str | None:
  """The letters of parameter `name` of `variant` (None: replicated); refuses an undeclared one."""
  table = LAYOUTS.get(variant, {})
  if name in table:
    return table[name]
  if name in CANONICAL:
    return CANONICAL[name]
  if name in MECHANISMS:
    return MECHANISMS[name]
  raise invalid(f"{variant}.{name}", name,
                f"a parameter declared in attn/nn/sharding.py (LAYOUTS[{variant!r}] or CANONICAL): "
                "say how it splits over the mesh's heads axis")


def _axis_spec(letter: str, size: int, cfg: HeadConfig, heads: int) -> str | None:
  if letter == "H":
    return HEADS
  if letter == "G":
    return HEADS if cfg.num_kv_heads % heads == 0 else None
  if letter == "P":
    return HEADS if size % heads == 0 else None
  return None


def param_specs(variant: str, cfg: HeadConfig, heads: int) -> dict[str, PartitionSpec]:
  """name -> PartitionSpec of each parameter of `variant` for cfg over `heads` devices (the rule above)."""
  v = api.check_config(variant, cfg)
  if cfg.num_heads % heads:
    raise invalid("heads", heads, f"a divisor of num_heads={cfg.num_heads}")
  out = {}
  for name, shape in api.param_shapes(v.name, cfg).items():
    letters = axes(v.name, name)
    if letters is None or heads == 1:
      out[name] = PartitionSpec()
      continue
    if name in MECHANISMS:
      letters = letters[:len(shape)]
    if len(letters) != len(shape):
      raise invalid(f"LAYOUTS[{v.name!r}][{name!r}]", letters, f"{len(shape)} letters, one per axis of {shape}")
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
