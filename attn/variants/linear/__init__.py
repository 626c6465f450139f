"""Heads with a fixed-size state: what the linear heads of today's hybrids share.

  core    the recurrence S_t = α_t·S_{t−1} + k_t·δ_tᵀ, o_t = S_tᵀ·q_t (delta rule or plain; decay
          none, per head or per key channel), chunked for training and recurrent for decoding
  parts   their refusals, the short causal convolution, the norms, padding

The variants built on them are one file each, as every variant: gated_deltanet (Qwen3-Next),
kda (Kimi Linear), mamba2 (Mamba-2's SSD), linear (causal linear attention) and gla (Gated Linear
Attention). Each maps HeadConfig the same way (attn.variants.gated_deltanet's docstring): num_heads the value heads,
each owning a d_k × d_v state, num_kv_heads the query/key heads, conv_width and chunk
HeadConfig fields; each decodes with a state instead of a KV cache (Variant.init_state, step).
"""
