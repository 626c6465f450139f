"""Every head parameterization, by name. A new variant is one file plus one line here."""

from attn.variants import fused, per_head
from attn.variants import collaborative, merged, split_input, two_stage
from attn.variants import mla, talking_heads
from attn.variants import differential, tpa
from attn.variants.base import Variant

VARIANTS: dict[str, Variant] = {
    "per_head": per_head.VARIANT,
    "fused": fused.VARIANT,
    "merged": merged.VARIANT,
    "two_stage": two_stage.VARIANT,
    "split_input": split_input.VARIANT,
    "collaborative": collaborative.VARIANT,
    "mla": mla.VARIANT,
    "talking_heads": talking_heads.VARIANT,
    "differential": differential.VARIANT,
    "tpa": tpa.VARIANT,
}
