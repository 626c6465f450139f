"""attn: compare multi-head attention head configurations by exact identities and experiments."""

from attn import host_memory as _host_memory

if _host_memory.is_attn_command():  # before jax loads: re-exec with mimalloc (attn.host_memory)
  _host_memory.use_kept_allocator()

from attn import kernel
from attn.kernel import masks
from attn.api import apply, get_variant, init, param_shapes
from attn.config import HEAD_PRESETS, ConfigError, HeadConfig, single_head, vaswani_base
from attn.convert import LossyConversionWarning, convert
from attn.kernel import attention
from attn.kernel.masks import causal_mask, combine_masks, padding_mask
from attn.variants import VARIANTS
from attn import nn
from attn.nn import MultiHeadAttention
from attn import count
from attn import analysis
from attn import testing
from attn.registry import register
from attn.variants.base import Options, Variant, attend_and_project, normal, project_heads
from attn.variants.mechanism import Mechanism
from attn.variants.mechanisms import MECHANISMS

__all__ = [
    "HEAD_PRESETS", "MECHANISMS", "Mechanism", "Options", "VARIANTS", "Variant",
    "attend_and_project", "normal", "project_heads", "register", "testing", "analysis", "ConfigError", "HeadConfig", "LossyConversionWarning",
    "apply", "attention", "count", "causal_mask", "combine_masks", "convert", "get_variant",
    "MultiHeadAttention", "init", "kernel", "masks", "nn", "padding_mask", "param_shapes",
    "single_head", "vaswani_base",
]
