"""attn's contract as a kit: the checks attn's own tests run, for a third party's records.

check_family(family, source): a checkpoint family (attn.nn.hf.Family) on a tiny checkpoint.
"""

from attn.testing.family import check_family

__all__ = ["check_family"]
