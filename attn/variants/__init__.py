"""Every head parameterization, by name. A new variant is one file plus one line here."""

from attn.variants import fused, per_head
from attn.variants.base import Variant

VARIANTS: dict[str, Variant] = {
    "per_head": per_head.VARIANT,
    "fused": fused.VARIANT,
}
