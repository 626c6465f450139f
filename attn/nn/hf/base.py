"""The checkpoint-family record, the checkpoint reader every family reads through, and shared checks.

A Family is one record per Hugging Face model family: which config.json
model_types it reads, a config reader (HF config dict -> ModelConfig, refusing
what attn cannot express by name before any weight is read), the weight names
in (checkpoint tensors -> attn's arrays) and out (attn's arrays -> a
transformers state dict, plus the transformers config), and its refusals.
Families live in attn.nn.hf.FAMILIES (attn.registry): the built-ins, the
entry points of group `attn.hf_families`, and FAMILIES.register(record).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, Mapping

import numpy as np

from attn.config import invalid
from attn.nn.config import ModelConfig
from attn.nn.models import MODELS

# Checkpoint names that are buffers, not weights (causal masks, ids, RoPE frequencies).
BUFFERS = (".attn.bias", ".attn.masked_bias", "embeddings.position_ids", "embeddings.token_type_ids",
           "rotary_emb.inv_freq", "embed_tokens.embed_scale")
# HF activation name -> attn's: tanh forms are "gelu", the erf form "gelu_exact".
ACTIVATIONS = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "gelu_fast": "gelu",
               "gelu": "gelu_exact", "gelu_python": "gelu_exact", "relu": "relu", "silu": "silu",
               "swish": "silu"}
# ModelConfig fields every family writes (sizes) or that an HF model does not hold (init, the
# compute dtypes). A variant's own widths (collab_width, latent_dim, ...) are gone once its heads
# are converted to the family's layout on the way out: that conversion refuses what it can't.
MAPPED = frozenset({"vocab_size", "d_model", "num_layers", "num_heads", "d_ff", "d_k", "d_v", "num_kv_heads",
                    "collab_width", "latent_dim", "q_latent_dim", "q_rank", "kv_rank", "variant", "max_len",
                    "activation", "embed_init_std", "norm_eps", "pooling", "share_src_tgt_embeddings", "dtype",
                    "param_dtype", "impl"})  # impl: how attn computes, not what the checkpoint holds


def require(module: str) -> Any:
  """An optional module of the hf extra, imported; its absence is refused with how to install it."""
  try:
    return importlib.import_module(module)
  except ImportError:
    raise invalid("import", module, "an installed module: pip install -e '.[hf]' (transformers, "
                  "safetensors, tokenizers; to_hf and live transformers models also need torch)") from None


class Weights:
  """A checkpoint's tensors by name as float32 numpy: the family's prefix dropped, buffers and the
  heads it ignores skipped; every read is marked, so what is left over can be refused."""

  def __init__(self, arrays: Mapping[str, Any], prefix: str = "", ignored: tuple[str, ...] = (),
               released: Callable[[dict[str, Any]], dict[str, Any]] | None = None, family: str = ""):
    self.arrays, self.used, self.family, self.stored = {}, set(), family, {}
    origin = {}  # a renamed tensor's name -> the name the checkpoint stores it by (what refusals name)
    if released is not None:
      for name, a in arrays.items():
        alone = released({name: a})
        if len(alone) == 1:
          origin[next(iter(alone))] = name
      arrays = released(dict(arrays))
    for renamed, a in arrays.items():
      stored = origin.get(renamed, renamed)
      k = renamed[len(prefix):] if prefix and renamed.startswith(prefix) else renamed
      if not k.endswith(BUFFERS) and not k.startswith(ignored):
        k = k.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
        self.arrays[k], self.stored[k] = a, stored

  @property
  def names(self) -> frozenset[str]:
    return frozenset(self.arrays)

  def __contains__(self, name: str) -> bool:
    return name in self.arrays

  def __call__(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
    """The tensor `name`; with shape, one of another shape is refused with both shapes."""
    if name not in self.arrays:
      of = f" (family {self.family!r})" if self.family else ""
      raise invalid("checkpoint", f"no tensor {name!r}",
                    f"a checkpoint of the config's model{of}; it has {sorted(self.arrays)[:8]}...")
    self.used.add(name)
    a = np.asarray(self.arrays[name], np.float32)
    if shape is not None and tuple(a.shape) != tuple(shape):
      raise invalid(f"checkpoint {name}.shape", tuple(a.shape), f"{tuple(shape)} from config.json")
    return a

  def norm(self, name: str) -> dict[str, np.ndarray]:
    """A LayerNorm's {"scale", "bias"}."""
    return {"scale": self(f"{name}.weight"), "bias": self(f"{name}.bias")}

  def linear(self, name: str) -> dict[str, np.ndarray]:
    """A torch Linear (out, in) as nnx.Linear's {"kernel": (in, out), "bias"}."""
    return {"kernel": self(f"{name}.weight").T, "bias": self(f"{name}.bias")}

  def unused(self) -> list[str]:
    return sorted(set(self.arrays) - self.used)

  def unknown(self) -> list[str]:
    """The tensors not read, under the names the checkpoint stores them by."""
    return sorted(self.stored.get(k, k) for k in self.unused())


def _is_strings(value: Any) -> bool:
  return isinstance(value, tuple) and all(isinstance(v, str) and v for v in value)


@dataclasses.dataclass(frozen=True)
class Family:
  """One checkpoint family: model types, config reader, weight names in and out, refusals.

  name          the registry's key and the name to_hf's model_type takes
  model_types   the config.json model_type values it reads
  architectures the transformers classes it reads as live objects (to_hf builds the one its
                config_out names)
  config_in     HF config dict -> ModelConfig with variant=`variant`; refuses by name what attn
                cannot express, before any weight is read
  weights_in    (Weights, ModelConfig) -> the attn model's arrays as nested dicts (nnx.to_pure_dict's
                shape), attention in the `variant` layout
  weights_out   (the model's arrays, attention converted to `variant` with the family's kv heads,
                ModelConfig) -> the transformers state dict; None: the family is read-only
  config_out    ModelConfig -> the transformers config's keywords, with "architectures": [class]
  model         the attn model it maps onto, a key of attn.nn.MODELS
  variant       the attention layout its checkpoints hold (from_hf converts from it, to_hf to it)
  grouped       whether it stores fewer key/value heads than query heads; if not, to_hf repeats them
  prefix        the name prefix of its task models' tensors (GPT2LMHeadModel's "transformer.")
  ignored       tensor-name starts it does not read (a tied lm_head, a next-sentence head)
  refusals      config key -> (allowed values, why): any other value is refused by name before
                config_in runs (a key that is absent is allowed: older configs lack newer switches)
  fixed         ModelConfig field -> the value the family requires on the way out
  mapped        more ModelConfig fields config_out writes; any field outside MAPPED, mapped and
                fixed must keep its default
  from_names    (ModelConfig, tensor names) -> the ModelConfig completed with what only the
                tensors tell (BERT's pooler and masked-LM head)
  released      the checkpoint's tensors by name -> the same under the names weights_in reads: what
                transformers' conversion mapping does on load (the names save_pretrained writes and the
                releases hold, renamed, split or stacked); names it does not know pass through unchanged
  check_out     more refusals of to_hf (ModelConfig -> None, ConfigError naming the field)
  model_kwargs  ModelConfig -> keywords of the transformers model's constructor
  held_zeros    ModelConfig -> parameters per attention layer that attn holds as zeros and the checkpoint
                does not have (MiMo-V2-Flash's o_proj bias): `attn count --hf` leaves them out
  counted_buffers  ModelConfig -> tensors of the feed-forward that attn holds as buffers and transformers
                counts as parameters (Laguna's correction bias): `attn count --hf` adds them
  left_out      HF config dict -> notes on what the checkpoint holds that attn neither reads nor counts (a
                wrapper's vision and audio towers, under `ignored`): `attn count --hf` prints them
  live_names    (to_hf's state dict, the ModelConfig, the names the installed transformers model holds) -> the
                state dict under those names, where a release holds a tensor otherwise than weights_out writes
                it (OLMo-Hybrid's convolution as q_conv1d, k_conv1d and v_conv1d in transformers 5.3 to 5.14)
  unheld        name starts of the transformers model's parameters attn holds none of (GLM-5.3-Flash's vision
                tower, Muse Spark's towers): to_hf leaves them at transformers' initialisation instead of refusing
                them as missing, and attn.testing.check_family compares the rest
  """

  name: str
  model_types: tuple[str, ...]
  architectures: tuple[str, ...]
  config_in: Callable[[dict[str, Any]], ModelConfig]
  weights_in: Callable[[Weights, ModelConfig], dict[str, Any]]
  weights_out: Callable[[dict[str, Any], ModelConfig], dict[str, Any]] | None = None
  config_out: Callable[[ModelConfig], dict[str, Any]] | None = None
  model: str = "decoder_lm"
  variant: str = "per_head"
  grouped: bool = True
  prefix: str = ""
  ignored: tuple[str, ...] = ()
  refusals: Mapping[str, tuple[tuple[Any, ...], str]] = dataclasses.field(default_factory=dict)
  fixed: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  mapped: frozenset[str] = frozenset()
  from_names: Callable[[ModelConfig, frozenset[str]], ModelConfig] | None = None
  released: Callable[[dict[str, Any]], dict[str, Any]] | None = None
  check_out: Callable[[ModelConfig], None] | None = None
  model_kwargs: Callable[[ModelConfig], dict[str, Any]] | None = None
  held_zeros: Callable[[ModelConfig], int] | None = None
  counted_buffers: Callable[[ModelConfig], int] | None = None
  left_out: Callable[[dict[str, Any]], list[str]] | None = None
  live_names: Callable[[dict[str, Any], ModelConfig, frozenset[str]], dict[str, Any]] | None = None
  unheld: tuple[str, ...] = ()

  def __post_init__(self):
    where = f"Family {self.name!r}"
    for field in ("model_types", "architectures", "ignored", "unheld"):
      value = getattr(self, field)
      if not _is_strings(value) or (field == "model_types" and not value):
        raise invalid(f"{where}.{field}", value, "a tuple of non-empty strings" +
                      (" (at least one)" if field == "model_types" else ""))
    for field in ("config_in", "weights_in", "weights_out", "config_out", "from_names", "released", "check_out",
                  "model_kwargs", "held_zeros", "counted_buffers", "left_out", "live_names"):
      value = getattr(self, field)
      if value is not None and not callable(value):
        raise invalid(f"{where}.{field}", value, "a function (or None where optional)")
    if (self.weights_out is None) != (self.config_out is None):
      raise invalid(f"{where}.weights_out", self.weights_out, "given with config_out, or both None (read-only)")
    if self.model not in MODELS:
      raise invalid(f"{where}.model", self.model, f"one of {sorted(MODELS)}")
    if not isinstance(self.prefix, str) or not isinstance(self.variant, str):
      raise invalid(f"{where}.prefix, variant", (self.prefix, self.variant), "strings")
    for key, rule in self.refusals.items():
      if not (isinstance(rule, tuple) and len(rule) == 2 and isinstance(rule[0], tuple) and rule[0]
              and isinstance(rule[1], str)):
        raise invalid(f"{where}.refusals[{key!r}]", rule, "(allowed values as a non-empty tuple, why)")
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    for field in ("fixed", "mapped"):
      unknown = sorted(set(getattr(self, field)) - fields)
      if unknown:
        raise invalid(f"{where}.{field}", unknown, "ModelConfig field names")


# ---- reading a config: refusals by name.

_REQUIRED = object()


def get(hf: dict[str, Any], *names: str, default: Any = _REQUIRED) -> Any:
  """The first of names in the config; a missing required one is refused by name."""
  for name in names:
    if name in hf:
      return hf[name]
  if default is _REQUIRED:
    raise invalid(f"config.{names[0]}", None, f"a value: a {hf.get('model_type')} config.json has one")
  return default


def refuse(hf: dict[str, Any], refusals: Mapping[str, tuple[tuple[Any, ...], str]]) -> None:
  """Refuses config[key] unless it is one of the allowed values (or absent)."""
  for key, (allowed, why) in refusals.items():
    value = hf.get(key, allowed[0])
    if value not in allowed:
      raise invalid(f"config.{key}", value, f"{allowed[0]!r}: {why}")


def activation(hf: dict[str, Any], name: str, default: str) -> str:
  act = hf.get(name, default)
  if act not in ACTIVATIONS:
    raise invalid(f"config.{name}", act, f"one of {sorted(ACTIVATIONS)}")
  return ACTIVATIONS[act]


def activation_out(cfg: ModelConfig, names: tuple[str, ...]) -> str:
  """The first of HF's names (in order of preference) that is cfg.activation in attn."""
  for n in names:
    if ACTIVATIONS.get(n) == cfg.activation:
      return n
  raise invalid("activation", cfg.activation, f"one of {sorted({ACTIVATIONS[n] for n in names})}")


def divisible(D: int, H: int, field: str) -> None:
  if D % H:
    raise invalid(field, H, f"a divisor of the width {D}")


# ---- writing: refusals of what a family cannot hold.

def check_fields(cfg: ModelConfig, family: Family) -> None:
  """Refuses a field the family cannot hold: `fixed` values, and defaults outside what it maps."""
  for name, want in family.fixed.items():
    if getattr(cfg, name) != want:
      raise invalid(name, getattr(cfg, name), f"{want!r}: {family.name} has it so")
  linear = [i for i, kind in enumerate(cfg.layer_types or ()) if kind == "linear_attention"]
  if linear and "linear_head" not in family.mapped:  # a state head's parameters have no place there
    raise invalid(f"layer_types[{linear[0]}]", "linear_attention", f"a softmax layer type: "
                  f"{family.name} has no linear-attention layers")
  free = MAPPED | family.mapped | set(family.fixed)
  for f in dataclasses.fields(ModelConfig):
    if f.name not in free and getattr(cfg, f.name) != f.default:
      raise invalid(f.name, getattr(cfg, f.name), f"{f.default!r}: {family.name} has no such setting")


def heads_of_width(cfg: ModelConfig, family: str) -> None:
  """Refuses heads other than D/H wide (GPT-2's and BERT's)."""
  D, H = cfg.d_model, cfg.num_heads
  if cfg.head.d_k * H != D or cfg.head.d_v * H != D:
    raise invalid("d_k, d_v", (cfg.head.d_k, cfg.head.d_v), f"d_model / num_heads = {D / H:g}: "
                  f"{family}'s heads are D/H wide")


def zero(a: Any, name: str, family: str) -> None:
  """Refuses a nonzero bias the family has no place for."""
  if np.any(np.asarray(a) != 0):
    raise invalid(name, "nonzero", f"zeros: {family} has no such bias")


def decoder_in(w: Callable, blocks: dict, norm: Callable, cfg: ModelConfig, N: int, D: int) -> dict[str, Any]:
  """A decoder's embedding, blocks, final norm and untied head under transformers' names; a tied
  head that the source lists anyway (a live model's state_dict) is read, so that it counts as read."""
  out = {"embed": {"token": w("embed_tokens.weight", (N, D))}, "blocks": blocks, "final_norm": norm("norm")}
  if cfg.tie_embeddings:
    if "lm_head.weight" in w:
      w("lm_head.weight", (N, D))
  else:
    out["head"] = {"linear": {"kernel": w("lm_head.weight", (N, D)).T}}
  return out
