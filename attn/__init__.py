"""attn: compare multi-head attention head configurations by exact identities and experiments.

Importing attn defines names and does nothing else: each name (and each
submodule, attn.config, attn.variants, ...) is imported on first use (PEP 562),
so `import attn` does not start jax. What the `attn` command does to its own
process (allocator, hooks, fault injection) is attn.process.
"""

import importlib

# name -> the module it comes from (submodules, attn.kernel, attn.nn, ..., need no entry)
_FROM = {
    "apply": "attn.api", "get_variant": "attn.api", "init": "attn.api", "param_shapes": "attn.api",
    "HEAD_PRESETS": "attn.config", "ConfigError": "attn.config", "HeadConfig": "attn.config",
    "single_head": "attn.config", "vaswani_base": "attn.config",
    "LossyConversionWarning": "attn.conversion", "convert": "attn.conversion",
    "attention": "attn.kernel",
    "causal_mask": "attn.kernel.masks", "combine_masks": "attn.kernel.masks",
    "padding_mask": "attn.kernel.masks",
    "VARIANTS": "attn.variants",
    "MultiHeadAttention": "attn.nn",
    "register": "attn.registry",
    "Options": "attn.variants.base", "Variant": "attn.variants.base", "attend_and_project": "attn.variants.base",
    "normal": "attn.variants.base", "project_heads": "attn.variants.base",
    "Mechanism": "attn.variants.mechanism",
    "MECHANISMS": "attn.variants.mechanisms",
}

__all__ = [
    "HEAD_PRESETS", "MECHANISMS", "Mechanism", "Options", "VARIANTS", "Variant",
    "attend_and_project", "normal", "project_heads", "register", "testing", "analysis", "ConfigError", "HeadConfig", "LossyConversionWarning",
    "apply", "attention", "count", "causal_mask", "combine_masks", "convert", "get_variant",
    "MultiHeadAttention", "init", "kernel", "masks", "nn", "padding_mask", "param_shapes",
    "single_head", "vaswani_base",
]


# name -> a module that lives deeper than attn's root (attn.masks: the kernel's masks)
_MODULES = {"masks": "attn.kernel.masks"}


def __getattr__(name: str):
  """Imports a name of __all__, or a submodule, on first use."""
  if name in _MODULES:
    value = importlib.import_module(_MODULES[name])
  elif name in _FROM:
    value = getattr(importlib.import_module(_FROM[name]), name)
  elif not name.startswith("_"):
    try:
      value = importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
      if e.name != f"{__name__}.{name}":
        raise
      raise AttributeError(f"module 'attn' has no attribute {name!r}") from None
  else:
    raise AttributeError(f"module 'attn' has no attribute {name!r}")
  globals()[name] = value
  return value


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(__all__))

