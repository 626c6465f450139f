"""BERT (BertModel, BertForMaskedLM) as an attn Encoder: embedding LayerNorm, token types, post-norm,
pooler, and the masked-LM head when the checkpoint holds it.

Its Linear weights are (out, in), y = x Wᵀ + b; its "gelu" is the erf form
(attn's "gelu_exact"). Whether the Encoder has a pooler and an MLM head is read
from the tensors (from_names); to_hf writes a BertForMaskedLM when it has the
MLM head, else a BertModel with or without its pooler.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from attn.config import invalid
from attn.nn.hf.base import Family, Weights, activation, activation_out, divisible, get, heads_of_width
from attn.nn.config import ModelConfig

_QKV = (("q", "query"), ("k", "key"), ("v", "value"))


def config_in(hf: dict[str, Any]) -> ModelConfig:
  """The Encoder of a BERT config.json (pooler and MLM head follow from the tensors)."""
  D, H = get(hf, "hidden_size"), get(hf, "num_attention_heads")
  divisible(D, H, "config.num_attention_heads")
  return ModelConfig(
      vocab_size=get(hf, "vocab_size"), d_model=D, num_layers=get(hf, "num_hidden_layers"), num_heads=H,
      d_ff=get(hf, "intermediate_size"), variant="per_head", max_len=get(hf, "max_position_embeddings"),
      num_segments=hf.get("type_vocab_size", 2), embed_norm=True, norm="post", final_norm=False,
      activation=activation(hf, "hidden_act", "gelu"), pooler=True, norm_eps=float(hf.get("layer_norm_eps", 1e-12)))


def from_names(cfg: ModelConfig, names: frozenset[str]) -> ModelConfig:
  return cfg.replace(pooler=any(k.startswith("pooler.") for k in names),
                     mlm_head=any(k.startswith("cls.predictions.") for k in names))


def weights_in(w: Weights, cfg: ModelConfig) -> dict[str, Any]:
  D, H = cfg.d_model, cfg.num_heads
  blocks = {}
  for l in range(cfg.num_layers):
    p = f"encoder.layer.{l}"
    heads = {f"w_{n}": w(f"{p}.attention.self.{full}.weight").T.reshape(D, H, -1) for n, full in _QKV}
    heads |= {f"b_{n}": w(f"{p}.attention.self.{full}.bias").reshape(H, -1) for n, full in _QKV}
    heads |= {"w_o": w(f"{p}.attention.output.dense.weight").T.reshape(H, -1, D),
              "b_o": w(f"{p}.attention.output.dense.bias")}
    blocks[l] = {"attn": {"params": heads}, "attn_norm": w.norm(f"{p}.attention.output.LayerNorm"),
                 "mlp": {"up": w.linear(f"{p}.intermediate.dense"), "down": w.linear(f"{p}.output.dense")},
                 "mlp_norm": w.norm(f"{p}.output.LayerNorm")}
  e = "embeddings"
  embed = {"token": w(f"{e}.word_embeddings.weight"), "position": w(f"{e}.position_embeddings.weight"),
           "norm": w.norm(f"{e}.LayerNorm")}
  if cfg.num_segments:
    embed["segment"] = w(f"{e}.token_type_embeddings.weight")
  out = {"embed": embed, "blocks": blocks}
  if cfg.pooler:
    out["pooler"] = w.linear("pooler.dense")
  if cfg.mlm_head:  # BertForMaskedLM: its decoder is the word embeddings, its bias predictions.bias
    c = "cls.predictions"
    out["mlm"] = {"transform": w.linear(f"{c}.transform.dense"), "norm": w.norm(f"{c}.transform.LayerNorm"),
                  "bias": w(f"{c}.bias", (cfg.vocab_size,))}
    for tied in (f"{c}.decoder.weight", f"{c}.decoder.bias"):
      if tied in w:
        w(tied)
  return out


def weights_out(pure: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
  D = cfg.d_model
  pre = "bert." if cfg.mlm_head else ""
  ln = lambda n, t: {f"{n}.weight": t["scale"], f"{n}.bias": t["bias"]}
  lin = lambda n, t: {f"{n}.weight": np.asarray(t["kernel"]).T, f"{n}.bias": t["bias"]}
  e = f"{pre}embeddings"
  sd = {f"{e}.word_embeddings.weight": pure["embed"]["token"],
        f"{e}.position_embeddings.weight": pure["embed"]["position"], **ln(f"{e}.LayerNorm", pure["embed"]["norm"])}
  if cfg.num_segments:
    sd[f"{e}.token_type_embeddings.weight"] = pure["embed"]["segment"]
  for l, block in pure["blocks"].items():
    p, b = block["attn"]["params"], f"{pre}encoder.layer.{l}"
    for n, full in _QKV:
      sd |= {f"{b}.attention.self.{full}.weight": np.asarray(p[f"w_{n}"]).reshape(D, D).T,
             f"{b}.attention.self.{full}.bias": np.asarray(p[f"b_{n}"]).ravel()}
    sd |= {f"{b}.attention.output.dense.weight": np.asarray(p["w_o"]).reshape(D, D).T,
           f"{b}.attention.output.dense.bias": p["b_o"], **ln(f"{b}.attention.output.LayerNorm", block["attn_norm"]),
           **lin(f"{b}.intermediate.dense", block["mlp"]["up"]), **lin(f"{b}.output.dense", block["mlp"]["down"]),
           **ln(f"{b}.output.LayerNorm", block["mlp_norm"])}
  if cfg.pooler:
    sd |= lin("pooler.dense", pure["pooler"])
  if cfg.mlm_head:
    c = "cls.predictions"
    sd |= {**lin(f"{c}.transform.dense", pure["mlm"]["transform"]), **ln(f"{c}.transform.LayerNorm", pure["mlm"]["norm"]),
           f"{c}.bias": pure["mlm"]["bias"], f"{c}.decoder.weight": pure["embed"]["token"],
           f"{c}.decoder.bias": pure["mlm"]["bias"]}
  return sd


def config_out(cfg: ModelConfig) -> dict[str, Any]:
  return dict(architectures=["BertForMaskedLM" if cfg.mlm_head else "BertModel"], vocab_size=cfg.vocab_size,
              hidden_size=cfg.d_model, num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
              intermediate_size=cfg.d_ff, hidden_act=activation_out(cfg, ("gelu", "gelu_new", "relu", "silu")),
              max_position_embeddings=cfg.max_len, type_vocab_size=cfg.num_segments, layer_norm_eps=cfg.norm_eps,
              hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0)


def check_out(cfg: ModelConfig) -> None:
  heads_of_width(cfg, "BERT")
  if cfg.mlm_head and cfg.pooler:
    raise invalid("pooler", True, "False with mlm_head: BertForMaskedLM has no pooler")


BERT = Family(
    name="bert", model_types=("bert",), architectures=("BertModel", "BertForMaskedLM"), model="encoder",
    config_in=config_in, weights_in=weights_in, weights_out=weights_out, config_out=config_out,
    grouped=False, prefix="bert.", ignored=("cls.seq_relationship.",),
    refusals={"position_embedding_type": (("absolute",), "attn has learned absolute positions only"),
              "is_decoder": ((False,), "a causal BERT is not supported"),
              "add_cross_attention": ((False,), "cross-attention BERT is not supported")},
    fixed={"positional": "learned", "norm": "post", "final_norm": False, "use_bias": True, "layernorm": True,
           "embed_norm": True, "norm_type": "layernorm", "mlp": "plain", "tie_embeddings": True},
    mapped=frozenset({"num_segments", "pooler", "mlm_head"}), from_names=from_names, check_out=check_out,
    model_kwargs=lambda cfg: {} if cfg.mlm_head else {"add_pooling_layer": cfg.pooler})
