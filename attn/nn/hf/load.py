"""from_hf and to_hf for every family of FAMILIES, through its record alone; the model it loads, converted.

from_hf: config.json -> the family (by model_type) -> its refusals and config
reader (everything refused by name before a weight is read) -> its weight names
in -> an attn model holding exactly those arrays -> converted to another
variant or fewer kv heads if asked. It returns a Loaded for every family, and
the model remembers its family (model.hf_family), so to_hf(model) writes it back
without being told.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any, Iterator

import jax.numpy as jnp
import numpy as np
from flax import nnx

from attn.config import did_you_mean, invalid
from attn.conversion import CONVERTERS, TOLERANCE, LossyConversionWarning, convert
from attn.nn.hf import (bailing_hybrid, bert, deepseek_v3, deepseek_v32, deepseek_v4, gemma2, gemma3, gemma4,
                         glm5_next, gpt2, gpt_oss, granite_swa, hy_v4, inkling2, kimi_linear, laguna, llama,
                         mimo_v2_flash, muse_spark, nemotron_h, olmo2, olmo_hybrid, phi3, qwen3_5, qwen3_next, smollm3,
                         zaya)
from attn.nn.hf.base import Family, Weights, check_fields, refuse, require
from attn.nn.hf.files import read_config, read_object, read_shapes, read_weights
from attn.nn.config import ModelConfig
from attn.nn.models import MODELS
from attn.nn.moe import Buffer
from attn.registry import Registry

# What a checkpoint holds: parameters and buffers (DeepSeek-V3's expert-correction bias), not KV caches.
WEIGHTS = (nnx.Param, Buffer)


def _builtins() -> tuple[Family, ...]:
  """attn's own families: one line per family module."""
  return (gpt2.GPT2, bert.BERT, llama.LLAMA, llama.MISTRAL, llama.QWEN2, llama.QWEN3, gemma2.GEMMA2, gemma3.GEMMA3,
          smollm3.SMOLLM3, phi3.PHI3, gpt_oss.GPT_OSS, olmo2.OLMO2, deepseek_v3.DEEPSEEK_V3,
          qwen3_next.QWEN3_NEXT, kimi_linear.KIMI_LINEAR, qwen3_5.QWEN3_5, qwen3_5.QWEN3_5_MOE,
          deepseek_v32.DEEPSEEK_V32, deepseek_v32.GLM_MOE_DSA, gemma4.GEMMA4, nemotron_h.NEMOTRON_H,
          deepseek_v4.DEEPSEEK_V4, hy_v4.HY_V4, olmo_hybrid.OLMO_HYBRID, granite_swa.GRANITE_SWA,
          mimo_v2_flash.MIMO_V2_FLASH, laguna.LAGUNA, bailing_hybrid.BAILING_HYBRID, muse_spark.MUSE_SPARK,
          glm5_next.GLM5_NEXT, zaya.ZAYA, inkling2.INKLING2_TEXT, inkling2.INKLING2)


FAMILIES: Registry[Family] = Registry("family", "attn.hf_families", Family, _builtins,
                                      required=("model_types", "architectures", "config_in", "weights_in"))
# Issue 51's pooled-selection families: what attn does not run yet, read from transformers 5.25's modeling files
# (the image-text wrappers' vision towers aside: attn would read text_config, which is refused the same).
_QWEN4_EXP = ("Qwen4-Exp's text model needs what attn does not run yet: its residual is hc_count streams mixed by "
              "gated residuals (hc_lowrank: a low-rank sigmoid mixer, no comb; attn's hyper-connections are mHC "
              "and iHC) closed by that mixer in place of a final norm, and its indexed_attention layers choose "
              "keys with the QSA indexer computed from x (index_qk_proj; indexer_budget, indexer_compress_ratio, "
              "indexer_kv_heads), each pooled key RMS-normalised and rotated at its block's first position "
              "(attn's qsa mechanism reads the heads' own unrotated dims); per-layer n-gram embeddings too where "
              "ple_layer_ids is set")
# Model types no family reads, refused with the reason.
REFUSED = {"llama4_text": "its local layers attend within fixed chunks (attention_chunk_size), which attn's "
                          "windows do not express, and its feed-forward is a mixture of experts",
           "mixtral": "no family reads its experts (block_sparse_moe) yet",
           "qwen3_5": "it is Qwen3.5's vision-language wrapper (text under text_config and model.language_model.); "
                      "attn reads the text model, model_type qwen3_5_text",
           "qwen3_5_moe": "it is Qwen3.5's vision-language wrapper; attn reads the text model, model_type "
                          "qwen3_5_moe_text",
           "falcon_h1": "its layers run attention and Mamba-2 side by side (with muP multipliers), where a "
                        "block of attn's DecoderLM has one attention layer",
           "gemma4": "its vision and audio towers are not attn's: save its text model (model_type gemma4_text, "
                     "Gemma4ForCausalLM) and load that",
           "mistral_large4_text": "no family reads it yet: its learned LeRoPE frequencies and per-head log-position "
                                  "query scales, NoPE mla layers, mla layers reading another's latent "
                                  "(kv_source_layers) and an indexer on x instead of a query latent are not attn's "
                                  "(docs/key_selection.md)",
           "mistral_large4": "it is Mistral Large 4's image-text wrapper (Pixtral tower), and no family reads its "
                             "text model (mistral_large4_text) yet (docs/key_selection.md)",
           "muse_spark_text": "it is Muse Spark's text model saved alone (MuseSparkTextModel), which has no LM head "
                              "in transformers: attn reads the checkpoint with its towers, model_type muse_spark "
                              "(MuseSparkForConditionalGeneration), whose text model it loads",
           **{kind: _QWEN4_EXP for kind in ("qwen4_exp", "qwen4_exp_text")}}


def _by_model_type() -> dict[str, Family]:
  out: dict[str, Family] = {}
  for family in FAMILIES.values():
    for kind in family.model_types:
      if kind in out:
        raise invalid(f"family {family.name!r} ({FAMILIES.source(family.name)}).model_types", family.model_types,
                      f"model types no other family reads: {kind!r} is family {out[kind].name!r}'s "
                      f"({FAMILIES.source(out[kind].name)})")
      out[kind] = family
  return out


def family_for(hf: dict[str, Any]) -> Family:
  """The family that reads a config's model_type; an unknown or refused one is refused by name."""
  kind, known = hf.get("model_type"), _by_model_type()
  if kind in known:
    return known[kind]
  why = f": {kind} is refused, {REFUSED[kind]}" if kind in REFUSED else ""
  broken = FAMILIES.broken()  # a plugin family that failed to import may be the one meant
  why += f" (not loaded: {'; '.join(broken.values())})" if broken else ""
  guess = "" if kind in REFUSED else did_you_mean(kind, known)  # a refused type is no typo of a near name
  raise invalid("config.model_type", kind, f"{guess}one of {sorted(known)}{why}")


def model_config(hf: dict[str, Any], variant: str | None = None, num_kv_heads: int | None = None) -> ModelConfig:
  """The ModelConfig of a Hugging Face config dict, in `variant` (default: as the checkpoint holds it) with
  num_kv_heads; unsupported settings are refused by name."""
  family = family_for(hf)
  refuse(hf, family.refusals)
  cfg = family.config_in(hf)
  if not isinstance(cfg, ModelConfig) or cfg.variant != family.variant:
    raise invalid(f"family {family.name!r}.config_in", type(cfg).__name__,
                  f"a function returning a ModelConfig with variant={family.variant!r}")
  variant = family.variant if variant is None else variant
  if variant != family.variant and (family.variant, variant) not in CONVERTERS:
    known = sorted(f"{dst} ({'exact' if c.exact else 'lossy'})" for (src, dst), c in CONVERTERS.items()
                   if src == family.variant)
    raise invalid("variant", variant, f"{family.variant} or one converted from it: {', '.join(known)}")
  return cfg.replace(variant=variant, num_kv_heads=cfg.num_kv_heads if num_kv_heads is None else num_kv_heads)


@dataclasses.dataclass(frozen=True)
class Loaded:
  """What from_hf returns for every family; unpacks as (model, config).

  errors: each layer's relative error of the conversion on load (attn.convert's return_error; zeros
  when nothing was converted or the conversion was exact).
  """

  model: nnx.Module
  config: ModelConfig
  family: str
  errors: tuple[float, ...]

  @property
  def error(self) -> float:
    """The largest layer's conversion error."""
    return max(self.errors, default=0.0)

  def __iter__(self) -> Iterator[Any]:
    return iter((self.model, self.config))


def from_hf(source: Any, variant: str | None = None, num_kv_heads: int | None = None,
            latent_dim: int | None = None) -> Loaded:
  """A Hugging Face model (a transformers object, a save_pretrained directory, or to_hf_state's
  (config, state dict) pair) as an attn model.

  variant (default: the family's own layout, per_head for every built-in) and num_kv_heads convert
  every layer through attn.convert; variant="mla" with latent_dim=d_c converts the heads to latent
  attention as TransMLA and MHA2MLA do (a truncated SVD of [W_K | W_V] per layer). A lossy
  conversion warns (LossyConversionWarning); Loaded.errors holds each layer's error.
  """
  is_dir = isinstance(source, (str, os.PathLike))
  if is_dir:
    hf, weights = read_config(source), None
  elif isinstance(source, tuple) and len(source) == 2 and all(isinstance(x, dict) for x in source):
    hf, weights = source  # to_hf_state's (config, state dict)
  else:
    hf, weights = read_object(source, {a for f in FAMILIES.values() for a in f.architectures})
  family = family_for(hf)
  cfg = model_config(hf)
  variant = family.variant if variant is None else variant
  if latent_dim is not None and variant != "mla":
    raise invalid("latent_dim", latent_dim, 'None unless variant="mla" (the latent width d_c of mla)')
  dst = model_config(hf, variant, num_kv_heads)  # a bad variant or G is refused before any weights are read
  _convertible(cfg, variant, num_kv_heads, latent_dim)
  if latent_dim is not None:
    dst.replace(latent_dim=latent_dim)  # a bad d_c, or RoPE over the whole head, refused here
  shapes = read_shapes(source) if is_dir else {k: np.shape(a) for k, a in weights.items()}
  _read(family, cfg, {k: np.broadcast_to(np.float32(0), s) for k, s in shapes.items()})  # names, before weights
  pure, cfg = _read(family, cfg, read_weights(source) if is_dir else weights)
  model = build(family.model, cfg, pure)
  model.hf_family = family.name
  if variant == cfg.variant and num_kv_heads in (None, cfg.num_kv_heads) and latent_dim is None:
    return Loaded(model, cfg, family.name, (0.0,) * len(_blocks(pure)))
  model, cfg, errors = convert_model(model, cfg, variant, num_kv_heads, latent_dim)
  return Loaded(model, cfg, family.name, tuple(errors))


def _read(family: Family, cfg: ModelConfig, arrays: dict[str, Any]) -> tuple[dict[str, Any], ModelConfig]:
  """(the model's arrays, cfg completed from the names) of a checkpoint's tensors; a tensor missing, of
  another shape, or that the family does not read is refused naming it and the family. Run first on
  zero-strided placeholders of the header's shapes, so that a checkpoint of unknown names is refused
  before any weight is read."""
  w = Weights(arrays, family.prefix, family.ignored, family.released, family.name)
  if family.from_names is not None:
    cfg = family.from_names(cfg, w.names)
  pure = family.weights_in(w, cfg)
  if w.unused():
    raise invalid("checkpoint", w.unknown()[:4], f"only tensors family {family.name!r} reads (the names "
                  f"transformers and the releases of {family.model_types[0]} use); it does not know these")
  return pure, cfg


def _blocks(pure: dict[str, Any]) -> dict[Any, Any]:
  return pure["blocks"] if "blocks" in pure else pure["encoder"]["blocks"]


def _flat(tree: dict[str, Any], prefix: tuple = ()) -> dict[tuple, Any]:
  out = {}
  for k, v in tree.items():
    out |= _flat(v, prefix + (k,)) if isinstance(v, dict) else {prefix + (k,): v}
  return out


def _unflat(flat: dict[tuple, Any]) -> dict[str, Any]:
  out: dict = {}
  for key, a in flat.items():
    node = out
    for k in key[:-1]:
      node = node.setdefault(k, {})
    node[key[-1]] = a
  return out


def build(kind: str, cfg: ModelConfig, pure: dict[str, Any]) -> nnx.Module:
  """The attn model of `kind` holding exactly the arrays of `pure` (shapes checked, nothing random)."""
  abstract = nnx.eval_shape(lambda: MODELS[kind](cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  want, got = _flat(nnx.to_pure_dict(state)), _flat(pure)
  if set(want) != set(got):
    raise invalid("checkpoint", sorted(set(want) ^ set(got))[:4], f"the parameters of {kind}")
  for key, a in got.items():
    if tuple(a.shape) != tuple(want[key].shape):
      raise invalid(f"checkpoint {'.'.join(map(str, key))}.shape", tuple(a.shape),
                    f"{tuple(want[key].shape)} from config.json")
  nnx.replace_by_pure_dict(state, _unflat({k: jnp.asarray(a) for k, a in got.items()}))
  return nnx.merge(graphdef, state)


def _convertible(cfg: ModelConfig, variant: str, num_kv_heads: int | None, latent_dim: int | None) -> None:
  """Refuses converting a model whose layer types have heads of their own (layer_heads) or whose layers
  share keys and values (kv_source): convert_model converts every layer with the model's one head."""
  if variant == cfg.variant and num_kv_heads in (None, cfg.num_kv_heads) and latent_dim is None:
    return
  for name in ("layer_heads", "kv_source"):
    if getattr(cfg, name) is not None:
      raise invalid("variant, num_kv_heads", (variant, num_kv_heads), f"the model's own ({cfg.variant!r}, "
                    f"None): it has {name}, and converting converts every layer with one head")


def convert_model(model: nnx.Module, cfg: ModelConfig, variant: str, num_kv_heads: int | None = None,
                  latent_dim: int | None = None) -> tuple[nnx.Module, ModelConfig, list[float]]:
  """The same model in another variant and/or with fewer kv heads; (model, cfg, per-layer error).

  Each layer's attention goes through attn.convert: exact conversions give
  error 0; mean-pooled kv heads (Ainslie et al. 2023) give the relative
  Frobenius error of the key/value weights they discard. Only parameters are read, so
  a model that has decoded converts too; the converted one starts without KV caches
  and keeps the family it was loaded from.
  """
  _convertible(cfg, variant, num_kv_heads, latent_dim)
  dst_cfg = cfg.replace(variant=variant, num_kv_heads=cfg.num_kv_heads if num_kv_heads is None else num_kv_heads,
                        latent_dim=cfg.latent_dim if latent_dim is None else latent_dim)
  # The KV caches that init_cache or generate leave in a model hold the source's layout (its
  # kv heads, its variant's entries): build would take them for parameters and refuse them.
  pure = nnx.to_pure_dict(nnx.state(model, WEIGHTS))
  blocks = _blocks(pure)
  errors = []
  with warnings.catch_warnings():  # one warning for the model below, not one per layer
    warnings.simplefilter("ignore", LossyConversionWarning)
    for l in sorted(blocks):
      if "attn" not in blocks[l] or cfg.layer_variant(int(l)) != cfg.variant:
        errors.append(0.0)  # an MLP-only block (block_kinds), or a linear layer of its own variant: kept
        continue
      # latent_dim is mla's alone: the source carries the target's, as attn.convert wants.
      params, err = convert(blocks[l]["attn"]["params"], cfg.variant, variant,
                            cfg.head.replace(latent_dim=dst_cfg.head.latent_dim),
                            dst_cfg=dst_cfg.head, return_error=True)
      blocks[l]["attn"]["params"] = dict(params)
      errors.append(float(err))
  if max(errors, default=0.0) > TOLERANCE:
    warnings.warn(f"{cfg.variant} -> {variant} with {dst_cfg.head.num_kv_heads} kv heads is lossy: relative "
                  f"error up to {max(errors):.3g} (layer {int(np.argmax(errors))})", LossyConversionWarning,
                  stacklevel=2)
  kind = next(k for k, cls in MODELS.items() if type(model) is cls)
  out = build(kind, dst_cfg, pure)
  if getattr(model, "hf_family", None) is not None:
    out.hf_family = model.hf_family
  return out, dst_cfg, errors


# ---- writing: an attn model as a transformers model (needs torch).

def _fits(family: Family, model: nnx.Module, cfg: ModelConfig) -> int | None:
  """How many of the family's fixed fields cfg breaks; None when the model is not the family's kind."""
  if not isinstance(model, MODELS[family.model]):
    return None
  return sum(getattr(cfg, name) != want for name, want in family.fixed.items())


def _family_of(model: nnx.Module, cfg: ModelConfig, model_type: str | None) -> Family:
  """The family named (a family or a model type), the one the model was loaded from, or else the
  one whose fixed fields it breaks fewest (a hand-built GPT-2 or BERT); a tie is refused."""
  name = model_type if model_type is not None else getattr(model, "hf_family", None)
  if name is not None:
    return FAMILIES[name] if name in FAMILIES else _by_model_type().get(name) or FAMILIES.resolve(name, "model_type")
  misses = {f.name: m for f in FAMILIES.values() if (m := _fits(f, model, cfg)) is not None}
  best = [n for n, m in misses.items() if m == min(misses.values())]
  if len(best) != 1:
    raise invalid("model_type", None, f"one of {sorted(FAMILIES)}: this {type(model).__name__} was not loaded "
                  f"by from_hf, and {' and '.join(sorted(best)) or 'no family'} fit it alike")
  return FAMILIES[best[0]]


def _load(hf: Any, sd: dict[str, Any], name: str, unheld: tuple[str, ...] = ()) -> Any:
  """hf with the arrays of sd (float32), every parameter set (but those under `unheld`, Family.unheld) and
  nothing left over; eval mode."""
  torch, transformers = require("torch"), require("transformers")
  tensors = {k: torch.from_numpy(np.array(v, np.float32)) for k, v in sd.items()}
  missing, unexpected = hf.load_state_dict(tensors, strict=False)
  tied = set(getattr(hf, "_tied_weights_keys", None) or {})
  left = [k for k in missing if not k.endswith((".attn.bias", ".attn.masked_bias")) and k not in tied
          and not k.startswith(unheld)]
  if left or unexpected:  # a transformers release whose names differ from these
    raise invalid(f"transformers.{name}", transformers.__version__,
                  f"a release with the usual parameter names (missing {left}, unexpected {unexpected})")
  return hf.eval()


def _resolve(model: Any, model_config: ModelConfig | None, model_type: str | None):
  """(attn model, its config, its family) of what to_hf was given; what no family holds is refused."""
  if isinstance(model, Loaded):
    model_config, model_type = model_config or model.config, model_type or model.family
    model = model.model
  cfg = model_config if model_config is not None else getattr(model, "cfg", None)
  if not isinstance(model, nnx.Module) or not isinstance(cfg, ModelConfig):
    raise invalid("model", type(model).__name__, "an attn model (attn.nn.DecoderLM, Encoder) and its ModelConfig")
  family = _family_of(model, cfg, model_type)
  if not isinstance(model, MODELS[family.model]):
    raise invalid("model", type(model).__name__, f"an attn.nn.{MODELS[family.model].__name__}: "
                  f"{family.name} maps onto one")
  if family.weights_out is None:
    raise invalid("model_type", family.name, "a family with weights_out: this one is read-only")
  check_fields(cfg, family)
  if family.check_out is not None:
    family.check_out(cfg)
  return model, cfg, family


def _state(model: nnx.Module, cfg: ModelConfig, family: Family) -> tuple[dict, dict, ModelConfig]:
  """(HF config keywords, HF state dict, the config they were written from)."""
  out_cfg = cfg.replace(variant=family.variant,
                        num_kv_heads=cfg.head.num_kv_heads if family.grouped else cfg.num_heads)
  pure = nnx.to_pure_dict(nnx.state(model, WEIGHTS))
  same = cfg.variant == family.variant and out_cfg.num_kv_heads == cfg.num_kv_heads
  for l, block in _blocks(pure).items():
    if same or "attn" not in block or (cfg.layer_types and cfg.layer_variant(int(l)) != cfg.variant):
      continue  # nothing to convert, an MLP-only block, or a layer of its type's own variant, written as it is
    block["attn"]["params"] = convert(block["attn"]["params"], cfg.variant, family.variant, cfg.head,
                                      dst_cfg=out_cfg.head)
  sd = {k: np.asarray(v) for k, v in family.weights_out(pure, out_cfg).items()}
  return dict(family.config_out(out_cfg)), sd, out_cfg


def to_hf_state(model: Any, model_config: ModelConfig | None = None,
                model_type: str | None = None) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  """(config.json as a dict, the state dict as numpy arrays) of what to_hf builds, without torch.

  from_hf takes the pair back: from_hf(to_hf_state(model)) holds model's parameters exactly.
  """
  model, cfg, family = _resolve(model, model_config, model_type)
  kw, sd, _ = _state(model, cfg, family)
  return {"model_type": family.model_types[0], **kw}, sd


def to_hf(model: Any, model_config: ModelConfig | None = None, model_type: str | None = None):
  """A transformers model (eval mode, no dropout) with the same weights and outputs as `model`.

  model: what from_hf returned (a Loaded, or its model), or any attn model with its config.
  model_type (a family or a model type) is needed only for a model from_hf did not load whose
  family is ambiguous (a hand-built DecoderLM with RoPE).
  """
  model, cfg, family = _resolve(model, model_config, model_type)
  require("torch")  # transformers' models hold torch tensors
  transformers = require("transformers")
  kw, sd, out_cfg = _state(model, cfg, family)
  names = kw.get("architectures") or [None]
  cls = getattr(transformers, names[0], None) if isinstance(names[0], str) else None
  if cls is None:
    raise invalid(f"family {family.name!r}.config_out()['architectures']", kw.get("architectures"),
                  f"a list naming a model class of transformers {transformers.__version__}")
  hf_cfg = cls.config_class(**kw)
  hf_cfg._attn_implementation = "eager"  # Gemma 2's soft-cap needs it; exact for the others
  live = cls(hf_cfg, **(family.model_kwargs(out_cfg) if family.model_kwargs else {}))
  if family.live_names is not None:  # this release holds some tensors under other names or shapes
    sd = family.live_names(sd, out_cfg, frozenset(live.state_dict()))
  return _load(live, sd, cls.__name__, family.unheld)
