"""The old path of `attn sweep` (now attn/cli/sweep.py), kept for imports; the work is
attn.experiments.running.launch."""

from attn.cli.sweep import add_arguments, run  # noqa: F401
from attn.experiments.running.launch import EXECUTORS, check as _check, config_lib  # noqa: F401
