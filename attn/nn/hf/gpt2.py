"""GPT-2 (GPT2LMHeadModel, GPT2Model) as an attn DecoderLM: learned positions, pre-norm, tied output.

Its Conv1D weights are (in, out), y = x W + b, and c_attn packs [q | k | v]
column blocks, head h in columns h·K..(h+1)·K of each. Its "gelu_new" is jax's
tanh gelu (attn's "gelu"). It has no grouped heads: to_hf repeats a model's
key/value heads to H.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from attn.nn.hf.base import Family, Weights, activation, activation_out, divisible, get, heads_of_width
from attn.nn.config import ModelConfig


def config_in(hf: dict[str, Any]) -> ModelConfig:
  """The DecoderLM of a GPT-2 config.json."""
  D, H = get(hf, "n_embd", "hidden_size"), get(hf, "n_head", "num_attention_heads")
  divisible(D, H, "config.n_head")
  return ModelConfig(
      vocab_size=get(hf, "vocab_size"), d_model=D, num_layers=get(hf, "n_layer", "num_hidden_layers"),
      num_heads=H, d_ff=hf.get("n_inner") or 4 * D, variant="per_head",
      max_len=get(hf, "n_positions", "max_position_embeddings"), norm="pre", final_norm=True,
      activation=activation(hf, "activation_function", "gelu_new"), tie_embeddings=True,
      norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)))


def weights_in(w: Weights, cfg: ModelConfig) -> dict[str, Any]:
  D, H = cfg.d_model, cfg.num_heads
  blocks = {}
  for l in range(cfg.num_layers):
    p = f"h.{l}"
    w_q, w_k, w_v = np.split(w(f"{p}.attn.c_attn.weight"), 3, axis=1)
    b_q, b_k, b_v = np.split(w(f"{p}.attn.c_attn.bias"), 3)
    heads = {"w_q": w_q.reshape(D, H, -1), "w_k": w_k.reshape(D, H, -1), "w_v": w_v.reshape(D, H, -1),
             "w_o": w(f"{p}.attn.c_proj.weight").reshape(H, -1, D), "b_q": b_q.reshape(H, -1),
             "b_k": b_k.reshape(H, -1), "b_v": b_v.reshape(H, -1), "b_o": w(f"{p}.attn.c_proj.bias")}
    blocks[l] = {"attn": {"params": heads}, "attn_norm": w.norm(f"{p}.ln_1"), "mlp_norm": w.norm(f"{p}.ln_2"),
                 "mlp": {"up": {"kernel": w(f"{p}.mlp.c_fc.weight"), "bias": w(f"{p}.mlp.c_fc.bias")},
                         "down": {"kernel": w(f"{p}.mlp.c_proj.weight"), "bias": w(f"{p}.mlp.c_proj.bias")}}}
  return {"embed": {"token": w("wte.weight"), "position": w("wpe.weight")}, "blocks": blocks,
          "final_norm": w.norm("ln_f")}


def weights_out(pure: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
  D = cfg.d_model
  norm = lambda name, t: {f"{name}.weight": t["scale"], f"{name}.bias": t["bias"]}
  sd = {"transformer.wte.weight": pure["embed"]["token"], "transformer.wpe.weight": pure["embed"]["position"],
        "lm_head.weight": pure["embed"]["token"], **norm("transformer.ln_f", pure["final_norm"])}
  for l, block in pure["blocks"].items():
    p, h = block["attn"]["params"], f"transformer.h.{l}"
    sd |= {f"{h}.attn.c_attn.weight": np.concatenate([np.asarray(p[n]).reshape(D, D) for n in ("w_q", "w_k", "w_v")], 1),
           f"{h}.attn.c_attn.bias": np.concatenate([np.asarray(p[n]).ravel() for n in ("b_q", "b_k", "b_v")]),
           f"{h}.attn.c_proj.weight": np.asarray(p["w_o"]).reshape(D, D), f"{h}.attn.c_proj.bias": p["b_o"],
           **norm(f"{h}.ln_1", block["attn_norm"]), **norm(f"{h}.ln_2", block["mlp_norm"]),
           f"{h}.mlp.c_fc.weight": block["mlp"]["up"]["kernel"], f"{h}.mlp.c_fc.bias": block["mlp"]["up"]["bias"],
           f"{h}.mlp.c_proj.weight": block["mlp"]["down"]["kernel"],
           f"{h}.mlp.c_proj.bias": block["mlp"]["down"]["bias"]}
  return sd


def config_out(cfg: ModelConfig) -> dict[str, Any]:
  return dict(architectures=["GPT2LMHeadModel"], vocab_size=cfg.vocab_size, n_positions=cfg.max_len,
              n_embd=cfg.d_model, n_layer=cfg.num_layers, n_head=cfg.num_heads, n_inner=cfg.d_ff,
              activation_function=activation_out(cfg, ("gelu_new", "gelu", "relu", "silu")),
              layer_norm_epsilon=cfg.norm_eps, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
              tie_word_embeddings=True, bos_token_id=None, eos_token_id=None)


GPT2 = Family(
    name="gpt2", model_types=("gpt2",), architectures=("GPT2LMHeadModel", "GPT2Model"),
    config_in=config_in, weights_in=weights_in, weights_out=weights_out, config_out=config_out,
    grouped=False, prefix="transformer.", ignored=("lm_head.",),
    refusals={"scale_attn_weights": ((True,), "attn scales scores by 1/sqrt(d_k)"),
              "scale_attn_by_inverse_layer_idx": ((False,), "attn has no per-layer score scale"),
              "add_cross_attention": ((False,), "cross-attention GPT-2 is not supported"),
              "tie_word_embeddings": ((True,), "attn's DecoderLM with biases ties its output to wte")},
    fixed={"positional": "learned", "norm": "pre", "final_norm": True, "use_bias": True, "layernorm": True,
           "tie_embeddings": True, "num_segments": 0},
    check_out=lambda cfg: heads_of_width(cfg, "GPT-2"))
