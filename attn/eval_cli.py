"""The old path of `attn eval` (now attn/cli/eval.py), kept for imports; the scoring is
attn.experiments.reading.losses and attn.experiments.reading.checkpoint_eval."""

from attn.cli.eval import add_arguments, run  # noqa: F401
from attn.experiments.reading.losses import (MLM_RATE, MLM_SEED, OBJECTIVES, PAIR_SEED,  # noqa: F401
                                             check_checkpoint, describe, evaluate, example_losses,
                                             held_out_batches, max_positions, mlm_batches, objective,
                                             pair_seq_len)
