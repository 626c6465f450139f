"""Counting: parameters (analytic, stored, effective), FLOPs, KV-cache bytes; per layer and per model.

  layer     one attention layer (HeadConfig, any registered variant), checked once into a
            Layer: the counts, FLOPs and KV cache, the layer and mechanism tables
  model     whole models (ModelConfig): by component, per layer type, active per token
  measured  what has no closed form, measured (XLA's cost analysis, the Jacobian's rank)
  hf        a Hugging Face checkpoint's config.json read into a ModelConfig and counted
  presets   published models (Vaswani's Table 3, BERT, GPT-2) as ModelConfigs
  report    `attn count`'s reports as data, and which one its flags ask for
  tables    those reports as Markdown, CSV or JSON (`attn count` is attn/cli/count.py)
"""

from attn.count.layer import (MEASURED_COLUMNS, Layer, check_layer, check_length, flops,
                              kv_cache_bytes, kv_cache_bytes_per_token, layer_table, measured_figures,
                              mechanism_table, param_counts, score_weight_count, state_bytes,
                              state_crossover)
from attn.count.model import (DTYPE, MODEL_KINDS, active_param_count, expert_params, layer_type_table,
                              model_kv_cache_bytes, model_kv_cache_bytes_per_token,
                              model_param_breakdown, model_param_count, model_state_bytes,
                              shared_flops_saved)

__all__ = [
    "DTYPE", "Layer", "MEASURED_COLUMNS", "MODEL_KINDS", "active_param_count", "check_layer", "check_length",
    "expert_params", "flops", "kv_cache_bytes", "kv_cache_bytes_per_token", "layer_table", "layer_type_table",
    "measured_figures", "mechanism_table", "model_kv_cache_bytes", "model_kv_cache_bytes_per_token",
    "model_param_breakdown", "model_param_count", "model_state_bytes", "param_counts",
    "score_weight_count", "shared_flops_saved", "state_bytes", "state_crossover",
]
