"""The old path of `attn reproduce` (now attn/cli/reproduce.py), kept for imports; the work is
attn.experiments.reading.reproduce."""

from attn.cli.reproduce import TITLES, add_arguments, run  # noqa: F401
