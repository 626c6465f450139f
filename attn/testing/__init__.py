"""attn's contract as a kit: the checks attn's own tests run, for a third party's records.

check_variant(variant), check_mechanism(mechanism), check_effective_count(variant, cfg),
check_mechanism_counts(mechanism): a variant or head mechanism record (attn.testing.variants
  says what they check).
check_family(family, source): a checkpoint family (attn.nn.hf.Family) on a tiny checkpoint.

Every failure is an AssertionError naming the check and its record, the property, the hook where
one applies and the config, with what the record raised chained as its cause (attn.testing.failures);
verbose=True makes a pass print how many properties at how many configs it checked.
"""

from attn.testing.family import check_family
from attn.testing.variants import (AWKWARD, check_effective_count, check_mechanism, check_mechanism_counts,
                                  check_variant)

__all__ = ["AWKWARD", "check_effective_count", "check_family", "check_mechanism", "check_mechanism_counts",
           "check_variant"]
