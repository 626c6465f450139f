"""The old path of `attn count` (now attn/cli/count.py), kept for imports; the work is attn.count.report and
attn.count.tables."""

from attn.cli.count import add_arguments, run  # noqa: F401
from attn.count.report import published_report, table3_report  # noqa: F401
from attn.count.tables import NOT_DEFINED, markdown  # noqa: F401
from attn.experiments.running.model_counts import config_rows  # noqa: F401
