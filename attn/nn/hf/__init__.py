"""Hugging Face checkpoints in and out (`hf` extra): GPT-2, BERT, ten Llama-like decoders, MiMo-V2-Flash, Laguna,
Muse Spark (text), Inkling-2 (text), ZAYA1, Gemma 4, DeepSeek-V3(.2) and V4, GLM-5, HY-V4, eight hybrids.

Each family is one record (attn.nn.hf.base.Family: the model types it reads,
a config reader, weight names in and out, refusals) in one module: gpt2, bert,
llama (Llama, Mistral, Qwen2 and Qwen3, one LlamaLike row each), gemma2, gemma3 (text), gemma4 (text:
per-layer inputs, shared caches, k_eq_v global layers),
smollm3, phi3, gpt_oss, olmo2 (QK-norm over the whole projection, norms after each sublayer),
deepseek_v3 (latent attention in attn's mla layout, DeepSeek's experts), deepseek_v32 and
glm_moe_dsa (GLM-5) (deepseek_v3 with the lightning indexer in its deepseek form), deepseek_v4
(compressed_shared layers: sliding, compressed sparse with its indexer, heavily compressed; hyper-connections,
V4's experts with hash routing), and the hybrids of
linear and softmax layers: qwen3_next (gated_deltanet layers beside gated softmax ones),
kimi_linear (kda layers beside mla ones without positions, DeepSeek's experts), bailing_hybrid (Ling-3:
kda layers with full-rank gates and the bounded decay beside mla ones with a head-wise output gate, DeepSeek's
experts with Ling's SwiGLU clip; its multi-token-prediction layers skipped), glm5_next (GLM-5.3-Flash's text
model: kda layers with the bounded decay beside NoPE mla ones choosing keys with the K-pool indexer on x and the
query latent, mHC streams closed by their mean, DeepSeek's experts with every SwiGLU clamped), qwen3_5_text
(Qwen3.5's text model: Qwen3-Next's layers with the linear projections apart) and
qwen3_5_moe_text (the same with Qwen3-Next's experts in every layer), and nemotron_h (NemotronH:
single-mixer layers, Mamba-2 as the mamba2 variant, attention without positions and relu² MLPs, each
its own residual: ModelConfig.block_kinds), and olmo_hybrid (OLMo-Hybrid: gated_deltanet layers with
negative eigenvalues, pre-norm, beside OLMo 2's softmax layers, norms after: ModelConfig.linear_norm), granite_swa (Granite-SWA: sinks, full and sliding layers in
any order, a RoPE base per layer with NoPE layers, Granite's multipliers), mimo_v2_flash (MiMo-V2-Flash:
value heads narrower than query/key heads with a value scale, sliding layers with twice the kv heads and sinks,
partial RoPE per layer type, DeepSeek-routed experts without shared ones; its multi-token-prediction layers skipped),
laguna (Laguna: a softplus output gate, query heads per layer, QK-norm, partial RoPE per type, sigmoid-routed
experts with a shared expert), and muse_spark (Muse Spark's text model, read from under its wrapper's text_config
with the vision and audio towers left out: fixed QK-norm, NoPE layers, a per-head output norm and gate, residual
gates, input-scaled and weightless norms, pooled normed experts), zaya (ZAYA1: CCA attention, a router network
whose state is carried from layer to layer, a skip expert, residuals rescaled with learned scales and biases),
and inkling2 (Inkling-2's text model, alone as inkling2_text or under its wrapper, the vision tower left out:
block attention residuals, per-token sinks, taps and relative bias, log-position scaling, convolutions on every
sublayer's output, softcapped experts).

FAMILIES (attn.registry) holds them: the built-ins (load._builtins, one line
per family), the entry points of group `attn.hf_families` of installed
packages, and FAMILIES.register(record) for the current process only (worker
processes do not see it). attn.testing.check_family runs the family contract
on a record.

from_hf(source, variant=None, num_kv_heads=None, latent_dim=None) reads a
transformers object or a local directory as save_pretrained writes it
(config.json + model.safetensors, or a sharded index; read with safetensors'
numpy API: no torch, no transformers, never pickle) and returns a Loaded for
every family: .model (a DecoderLM, or an Encoder for BERT), .config, .family
and .errors (each layer's conversion error); it unpacks as (model, config).
Everything a family cannot express is refused by name before any weight is
read. variant= and num_kv_heads= convert every layer through attn.convert (a
lossy conversion warns with its error: LossyConversionWarning; fewer kv heads
are mean-pooled, Ainslie et al. 2023); convert_model converts a loaded model.

to_hf(model) builds the transformers model with the same weights and outputs;
a model from from_hf remembers its family (model.hf_family), and
to_hf(model, cfg, model_type) still works. to_hf_state(model) gives the
config and state dict as numpy without torch, and from_hf takes that pair
back. from_hf(to_hf(m)) gives m's parameters back exactly.

Padding: attn's models take right padding as lengths (B,), which is Hugging
Face's attention_mask with its ones first (lengths_from_attention_mask): keys
past the length are masked, as HF masks them, so outputs agree at every
position, padded ones included. Left padding is refused: HF numbers positions
from the first pad token, which attn's models cannot express.
"""

from attn.conversion import LossyConversionWarning
from attn.nn.hf.base import Family, Weights, require
from attn.nn.hf.files import lengths_from_attention_mask, read_config, read_shapes, read_weights
from attn.nn.hf.load import (FAMILIES, REFUSED, Loaded, build, convert_model, family_for, from_hf, model_config,
                             to_hf, to_hf_state)
from attn.nn.hf.rope import ROPE_TYPES, rope_from_hf, rope_to_hf

__all__ = [
    "FAMILIES", "Family", "Loaded", "LossyConversionWarning", "REFUSED", "ROPE_TYPES", "Weights", "build",
    "convert_model", "family_for", "from_hf", "lengths_from_attention_mask", "model_config", "read_config",
    "read_shapes", "read_weights", "require", "rope_from_hf", "rope_to_hf", "to_hf", "to_hf_state",
]
