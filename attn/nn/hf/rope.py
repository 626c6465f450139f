"""RoPE settings of a Hugging Face config in and out: rope_theta and the scaling types attn implements.

transformers 5 reads rope_parameters; 4 reads rope_scaling ("type" in older
files, "rope_type" in newer) beside a top-level rope_theta. Types "default",
"linear", "llama3" (Llama 3.1/3.2's frequency scaling) and "yarn" (gpt-oss,
DeepSeek-V3: beta_fast, beta_slow, truncate, and attention_factor, given or
from mscale / mscale_all_dim as transformers derives it) map onto HeadConfig's
rope_scaling fields and go back out in both spellings; others (dynamic,
longrope, ...) are refused by name, and so is a partial rotary width unless the
family reads it (Phi-3: rotary_fraction).
"""

from __future__ import annotations

import json
import math
from typing import Any

from attn.config import ROPE_SCALINGS, invalid
from attn.nn.hf.base import refuse
from attn.nn.config import ModelConfig

ROPE_TYPES = ("default", *(k for k in ROPE_SCALINGS if k))  # transformers' rope_type values attn implements


def rotary_fraction(hf: dict[str, Any]) -> float:
  """partial_rotary_factor (Phi-3's fraction of each head that rotates), from rope_parameters (5) or the top level (4)."""
  params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
  where = "rope_parameters" if "partial_rotary_factor" in params else ""
  f = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
  if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1:
    raise invalid(f"config.{where + '.' if where else ''}partial_rotary_factor", f, "a fraction in (0, 1]")
  return float(f)


def rope_from_hf(hf: dict[str, Any], partial: bool = False) -> dict[str, Any]:
  """The HeadConfig RoPE fields (rope_theta, and rope_scaling with its parameters) of a config.

  transformers 5 reads rope_parameters; 4 reads rope_scaling ("type" in older
  files, "rope_type" in newer) beside a top-level rope_theta. A rope_scaling,
  where present, wins, as in both (5 takes it over rope_parameters). Types
  other than ROPE_TYPES (dynamic, longrope, ...) are refused by name, and so is a
  partial_rotary_factor unless partial (the family reads it: rotary_fraction).
  """
  where = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
  params = hf.get(where) or {}
  if params and all(isinstance(v, dict) for v in params.values()):  # one per layer type
    kinds = {json.dumps(v, sort_keys=True) for v in params.values()}
    if len(kinds) > 1:
      raise invalid(f"config.{where}", params, "the same RoPE for every layer type")
    params = next(iter(params.values()))
  kind = params.get("rope_type", params.get("type", "default"))
  if kind not in ROPE_TYPES:
    raise invalid(f"config.{where}.rope_type", kind, f"one of {list(ROPE_TYPES)}: attn implements "
                  "plain RoPE and its linear, llama3 and yarn scaling (not dynamic, longrope, ...)")
  if not partial:
    refuse(hf, {"partial_rotary_factor": ((1.0,), "attn's loader rotates the whole head")})
  if not partial and params.get("partial_rotary_factor", 1.0) != 1.0:
    raise invalid(f"config.{where}.partial_rotary_factor", params["partial_rotary_factor"],
                  "1.0: attn's loader rotates the whole head")
  out = {"rope_theta": float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))}
  if kind == "default":
    return out

  def number(key: str, value: Any, integer: bool = False) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
        or (integer and value != int(value)):
      raise invalid(f"config.{key}", value, f"{'an integer' if integer else 'a number'}: {kind} RoPE reads it")
    return int(value) if integer else float(value)

  out |= {"rope_scaling": kind, "rope_factor": number(f"{where}.factor", params.get("factor"))}
  # As transformers 5: a top-level original_max_position_embeddings first (Phi-3 keeps it
  # there), else the rope dict's, else max_position_embeddings.
  key = "original_max_position_embeddings"
  orig = (key, hf[key]) if key in hf else (f"{where}.{key}", params.get(key, hf.get("max_position_embeddings")))
  if kind == "llama3":
    out |= {"rope_low_freq_factor": number(f"{where}.low_freq_factor", params.get("low_freq_factor")),
            "rope_high_freq_factor": number(f"{where}.high_freq_factor", params.get("high_freq_factor")),
            "rope_original_max_len": number(*orig, integer=True)}
  if kind == "yarn":
    out |= {"rope_original_max_len": number(*orig, integer=True), "rope_truncate": bool(params.get("truncate", True)),
            "rope_attention_factor": _attention_factor(params, out["rope_factor"], where, number)}
    for name in ("beta_fast", "beta_slow"):  # transformers: a missing (or 0) beta takes its default
      if params.get(name):
        out[f"rope_{name}"] = number(f"{where}.{name}", params[name])
  return out


def _attention_factor(params: dict[str, Any], factor: float, where: str, number: Any) -> float | None:
  """yarn's attention_factor: given, or DeepSeek's mscale ratio, or None (attn's default 0.1·ln(factor) + 1)."""
  if params.get("attention_factor") is not None:
    return number(f"{where}.attention_factor", params["attention_factor"])
  m, m_all = params.get("mscale"), params.get("mscale_all_dim")
  if not (m and m_all):
    return None
  scale = lambda k: 1.0 if factor <= 1 else 0.1 * k * math.log(factor) + 1.0  # noqa: E731
  return scale(number(f"{where}.mscale", m)) / scale(number(f"{where}.mscale_all_dim", m_all))


def rope_to_hf(cfg: ModelConfig) -> dict[str, Any]:
  """rope_from_hf's inverse: the keys transformers 4 reads (rope_theta, rope_scaling) and 5's rope_parameters.

  transformers 5 takes a rope_scaling over rope_parameters; the two hold the same here.
  """
  rope = {"rope_type": cfg.rope_scaling or "default"}
  if cfg.rope_scaling:
    rope["factor"] = cfg.rope_factor
  if cfg.rope_scaling == "llama3":
    rope |= {"low_freq_factor": cfg.rope_low_freq_factor, "high_freq_factor": cfg.rope_high_freq_factor,
             "original_max_position_embeddings": cfg.rope_original_max_len}
  if cfg.rope_scaling == "yarn":
    rope["original_max_position_embeddings"] = cfg.rope_original_max_len
    defaults = {"beta_fast": 32.0, "beta_slow": 1.0, "truncate": True}  # transformers' (and HeadConfig's)
    rope |= {k: v for k in defaults if (v := getattr(cfg, f"rope_{k}")) != defaults[k]}
    if cfg.rope_attention_factor is not None:
      rope["attention_factor"] = cfg.rope_attention_factor
  out = {"rope_theta": cfg.rope_theta, "rope_parameters": rope | {"rope_theta": cfg.rope_theta}}
  return out | ({"rope_scaling": rope} if cfg.rope_scaling else {})
