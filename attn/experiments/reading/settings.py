"""What each group of a sweep trained, and what its trials held fixed by choice, for reports and plots.

A case (sweep.cases) names a setting of several keys at once, and some keys of a trial are derived
(sweep.derive's d_k, d_v and d_ff; a layer schedule's types), so a case's name alone does not say what it
trained. `differences` gives each group the resolved keys in which the groups differ (an outside
mechanism's options, model.extra.NAME.OPTION, one key each), and the linear head (`linear_variant`) of a
group with linear layers. `chosen` gives the keys the sweep's config or its --set overrides name, so a
plot's "held fixed" lists what the user held, not a default nobody chose.
"""

from __future__ import annotations

import tomllib
from typing import Any

from attn.experiments.running.config import flatten_keys, show

SKIP = {"train.seed"}  # a group is its seeds' trials


def _value(v: Any) -> str:
  """A value as the group table shows it: a layer schedule's runs compressed (linear_attention×3)."""
  if isinstance(v, (list, tuple)) and v and all(isinstance(x, str) for x in v):
    runs: list[list[Any]] = []
    for x in v:
      if runs and runs[-1][0] == x:
        runs[-1][1] += 1
      else:
        runs.append([x, 1])
    return "[" + ", ".join(x if n == 1 else f"{x}×{n}" for x, n in runs) + "]"
  return show(v)


def _has_linear(model: dict[str, Any]) -> bool:
  return any("linear" in str(t) for t in (model.get("layer_types") or ())) or model.get("variant") in (
      "gated_deltanet", "kda", "mamba2", "linear")


def differences(configs: dict[str, dict[str, Any]]) -> dict[str, str]:
  """group -> "key=value, ..." for the resolved keys (task.*, model.*, train.*, the seed left out) whose
  values differ among the groups' configs, plus model.linear_variant for a group with linear layers."""
  flat = {g: {k: v for k, v in flatten_keys({s: c.get(s) or {} for s in ("task", "model", "train")}).items()
              if k not in SKIP} for g, c in configs.items()}  # a store's config.json also holds the label
  keys = list(dict.fromkeys(k for f in flat.values() for k in f))
  moving = [k for k in keys if len({repr(f.get(k)) for f in flat.values()}) > 1]
  out = {}
  for g, f in flat.items():
    shown = [k for k in moving if f.get(k) is not None]
    if _has_linear(configs[g].get("model", {})) and "model.linear_variant" in f and "model.linear_variant" not in shown:
      shown.append("model.linear_variant")
    out[g] = ", ".join(f"{k.split('.', 1)[1]}={_value(f[k])}" for k in shown)
  return out


def chosen(header: dict[str, Any]) -> set[str] | None:
  """The dotted keys the sweep's config sets ([task], [model], [train], its cases) or --set overrides name,
  and those a derive computes; None where the store keeps no config text (an older store)."""
  from attn.experiments.running.config import DERIVED
  text = header.get("config_text")
  if not isinstance(text, str):
    return None
  try:
    raw = tomllib.loads(text)
  except tomllib.TOMLDecodeError:
    return None
  keys = {f"{s}.{k}" for s in ("task", "model", "train") for k in raw.get(s, {})}
  for case in raw.get("sweep", {}).get("cases", []):
    keys |= {k for k in flatten_keys({kk: vv for kk, vv in case.items() if kk != "name"})}
  for d in raw.get("sweep", {}).get("derive", []):
    keys |= set(DERIVED.get(d, ((), ""))[0])
  keys |= {o.split("=", 1)[0].strip() for o in header.get("overrides", [])}
  return keys
