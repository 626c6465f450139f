"""Flax NNX shell: MultiHeadAttention over any variant, transformer blocks and small models."""

from attn.nn.attention import MultiHeadAttention
from attn.nn.config import ModelConfig
from attn.nn.models import (DecoderLM, Embeddings, Encoder, EncoderDecoder, SequenceClassifier,
                            TransformerBlock, MODELS)

__all__ = [
    "DecoderLM", "Embeddings", "Encoder", "EncoderDecoder", "ModelConfig", "MultiHeadAttention",
    "SequenceClassifier", "TransformerBlock", "MODELS",
]
