"""Analysis of attention layers: per-head circuits (W_QK, W_OV), spectra and effective rank,
attention statistics on data, head importance and pruning curves."""

from attn.analysis.attention_stats import attention_stats, head_js, js_divergence
from attn.analysis.circuits import circuit_factors, circuits
from attn.analysis.importance import (gate_gradients, head_importance, prunable_fraction,
                                      pruning_curve, pruning_gates, pruning_order, pruning_steps)
from attn.analysis.spectrum import effective_rank, spectrum, spectrum_of_product

__all__ = ["attention_stats", "circuit_factors", "circuits", "effective_rank", "gate_gradients",
           "head_importance", "head_js", "js_divergence", "prunable_fraction", "pruning_curve",
           "pruning_gates", "pruning_order", "pruning_steps", "spectrum", "spectrum_of_product"]
