"""Analysis of attention layers: per-head circuits (W_QK, W_OV), spectra and effective rank."""

from attn.analysis.circuits import circuit_factors, circuits
from attn.analysis.spectrum import effective_rank, spectrum, spectrum_of_product

__all__ = ["circuit_factors", "circuits", "effective_rank", "spectrum", "spectrum_of_product"]
