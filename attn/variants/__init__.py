"""Every head parameterization, by name: the built-ins below, plugins of the entry-point group
`attn.variants`, and records added by `VARIANTS.register` (attn.registry). A new built-in variant
is one file plus one line in _builtins."""

from attn.registry import Registry
from attn.variants.base import Variant


def _builtins() -> list[Variant]:
  from attn.variants import fused, per_head
  from attn.variants import collaborative, merged, split_input, two_stage
  from attn.variants import mla, talking_heads
  from attn.variants import differential, tpa
  from attn.variants import gated_deltanet, kda, linear_attention, mamba2
  from attn.variants import gla
  from attn.variants import grouped_lowrank, k_eq_v
  from attn.variants import compressed
  from attn.variants import compressed_shared
  return [per_head.VARIANT, fused.VARIANT, merged.VARIANT, two_stage.VARIANT, split_input.VARIANT,
          collaborative.VARIANT, mla.VARIANT, talking_heads.VARIANT, differential.VARIANT,
          tpa.VARIANT, gated_deltanet.VARIANT, kda.VARIANT, mamba2.VARIANT, linear_attention.VARIANT,
          gla.VARIANT, k_eq_v.VARIANT, grouped_lowrank.VARIANT, compressed.VARIANT,
          compressed_shared.VARIANT]


VARIANTS: Registry[Variant] = Registry("variant", "attn.variants", Variant, _builtins,
                                       required=("init", "apply"))
