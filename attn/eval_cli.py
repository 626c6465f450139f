"""`attn eval --hf PATH --text FILE_OR_DIR`: held-out loss of a pretrained model, before and after conversion.

  attn eval --hf ./gpt2 --text notes.txt                        # the checkpoint as it is
  attn eval --hf ./gpt2 --text src/ --glob '**/*.py' --num-kv-heads 4   # and mean-pooled to 4 kv heads
  attn eval --hf ./gpt2 --text '' --variant merged              # the Python stdlib, merged W_Q·W_Kᵀ

PATH is a local Hugging Face directory as save_pretrained writes it (config.json,
model.safetensors and the tokenizer's files) of a causal LM (gpt2, llama,
mistral, qwen2, qwen3, gemma2) or a BertForMaskedLM; its weights are read with
numpy, without torch. The text is tokenised with that tokenizer and the
held-out split of the corpus is scored (attn.experiments.data.hf_text): mean
next-token cross-entropy in nats over every predicted token, and perplexity
exp(loss). BERT: the masked-LM loss, 15% of the real tokens (a fixed seed,
MLM_SEED) replaced by [MASK] and predicted; perplexity is exp of that. With --variant or --num-kv-heads the same weights are converted
(attn.nn.hf.convert_model: exact variants, or key/value heads mean-pooled as
Ainslie et al. 2023 do before uptraining) and scored again on the same tokens;
the table gives each conversion's relative error (the largest over layers).
"""

from __future__ import annotations

import argparse
import functools
import math
import time
import warnings
from typing import Any

import numpy as np

from attn.config import invalid
from attn.convert import LossyConversionWarning


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--hf", metavar="PATH", required=True,
                      help="a local Hugging Face directory (config.json, model.safetensors, tokenizer): gpt2, llama, "
                      "mistral, qwen2, qwen3, gemma2, or a BertForMaskedLM")
  parser.add_argument("--text", metavar="FILE_OR_DIR", required=True,
                      help="text to score: a file, a directory, or '' for the Python standard library")
  parser.add_argument("--glob", default=None,
                      help="files of a directory to read (default '**/*'; '**/*.py' for the stdlib)")
  parser.add_argument("--variant", default="per_head", help="also score the model converted to this variant")
  parser.add_argument("--num-kv-heads", type=int, default=None, metavar="G",
                      help="also score it with G key/value heads (mean-pooled)")
  parser.add_argument("--max-tokens", type=int, default=4096, metavar="N", help="predicted tokens to score")
  parser.add_argument("--seq-len", type=int, default=256, metavar="L",
                      help="window length (capped at the model's positions)")
  parser.add_argument("--batch-size", type=int, default=8)


MLM_SEED, MLM_RATE = 0, 0.15


def check_checkpoint(path: str, command: str = "attn eval", bert: bool = True) -> dict[str, Any]:
  """config.json of a supported checkpoint with its tokenizer; anything else refused before loading
  weights (a BERT without its MLM head is refused when the weights are read, by run)."""
  from attn.nn import hf
  from attn.experiments.data import hf_text
  config = hf.read_config(path)
  hf.model_config(config)  # the model_type and unsupported settings, by name
  if config.get("model_type") == "bert" and not bert:
    raise invalid("config.model_type", "bert", f"a causal LM ({', '.join(sorted(set(hf.SUPPORTED) - {'bert'}))}):"
                  f" {command} reads a decoder")
  tok = hf_text.load_tokenizer(path)
  if config.get("model_type") == "bert" and tok.token_to_id("[MASK]") is None:
    raise invalid("tokenizer", "no [MASK] token", "a BERT tokenizer with [MASK]: the masked-LM loss masks tokens")
  return config


def max_positions(config: dict[str, Any], seq_len: int) -> int:
  """seq_len capped at the checkpoint's positions."""
  return min(seq_len, config.get("n_positions") or config.get("max_position_embeddings") or seq_len)


def mlm_batches(data: dict[str, np.ndarray], mask_id: int, seed: int = MLM_SEED,
                rate: float = MLM_RATE) -> dict[str, np.ndarray]:
  """Masked-LM batches of next-token windows: `rate` of the real tokens (weight > 0), drawn with
  `seed`, replaced by mask_id; targets the originals, weights 1 where masked; lengths per row."""
  tokens, real = data["tokens"], data["weights"] > 0
  chosen = real & (np.random.default_rng(seed).random(tokens.shape) < rate)
  return {"tokens": np.where(chosen, mask_id, tokens).astype(np.int32), "targets": tokens.astype(np.int32),
          "weights": chosen.astype(np.float32), "lengths": real.sum(-1).astype(np.int32)}


@functools.lru_cache(maxsize=None)
def _loss_fn(graphdef, masked: bool = False):
  import jax
  import jax.numpy as jnp
  import optax
  from flax import nnx

  @jax.jit
  def batch_loss(state, batch):
    model = nnx.merge(graphdef, state)
    if masked:  # an Encoder with its MLM head; padding (length 0 rows too) kept out by where()
      logits = model.mlm_logits(model(batch["tokens"], lengths_B=batch["lengths"])).astype(jnp.float32)
    else:
      logits = model(batch["tokens"]).astype(jnp.float32)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    return jnp.where(batch["weights"] > 0, nll * batch["weights"], 0.0).sum()

  return batch_loss


def evaluate(model, data: dict[str, np.ndarray]) -> float:
  """Mean cross-entropy (nats) over batches (nb, B, T) with weights: next-token of a DecoderLM,
  masked-LM of an Encoder (data from mlm_batches)."""
  from flax import nnx
  graphdef, state = nnx.split(model)
  fn = _loss_fn(graphdef, "lengths" in data)
  total = sum(float(fn(state, {k: v[j] for k, v in data.items()})) for j in range(data["tokens"].shape[0]))
  return total / float(data["weights"].sum())


def _row(name: str, cfg, error: float | None, loss: float, seconds: float) -> str:
  err = "–" if error is None else f"{error:.4f}"
  return (f"| {name} | {cfg.variant} | {cfg.head.num_kv_heads} | {err} | {loss:.4f} | "
          f"{math.exp(loss):.2f} | {seconds:.1f} |")


def run(args: argparse.Namespace) -> int:
  from attn.experiments.data import hf_text
  for name in ("max_tokens", "batch_size", "seq_len"):
    value = getattr(args, name)
    if value < 1:
      raise invalid("--" + name.replace("_", "-"), value, "an integer >= 1")
  config = check_checkpoint(args.hf)
  from attn.nn import hf
  hf.model_config(config, args.variant, args.num_kv_heads)  # a bad variant or G, before any weights
  seq_len = max_positions(config, args.seq_len)
  data, info = hf_text.text_batches(args.hf, args.text, seq_len, args.batch_size, args.max_tokens,
                                    config["vocab_size"], args.glob)
  t0 = time.perf_counter()
  model, cfg = hf.from_hf(args.hf)
  family = config["model_type"]
  if family == "bert":
    if not cfg.mlm_head:
      raise invalid("--hf", args.hf, "a BertForMaskedLM checkpoint (cls.predictions.*): a BertModel has no "
                    "head to score text with")
    data = mlm_batches(data, hf_text.load_tokenizer(args.hf).token_to_id("[MASK]"))
    family = f"bert (masked LM, {MLM_RATE:.0%} masked, seed {MLM_SEED})"
    info["tokens"] = int(data["weights"].sum())
  loss = evaluate(model, data)
  rows = [_row("original", cfg, None, loss, time.perf_counter() - t0)]
  if args.variant != "per_head" or args.num_kv_heads not in (None, cfg.num_heads):
    t0 = time.perf_counter()
    with warnings.catch_warnings():  # the table gives the error
      warnings.simplefilter("ignore", LossyConversionWarning)
      converted, ccfg, errors = hf.convert_model(model, cfg, args.variant, args.num_kv_heads)
    rows.append(_row("converted", ccfg, max(errors), evaluate(converted, data), time.perf_counter() - t0))
  print(f"{args.hf}: {family}, {cfg.num_layers} layers, {cfg.num_heads} heads, d_model {cfg.d_model}, "
        f"vocab {cfg.vocab_size}")
  print(f"text: {info['root']} ({info['glob']}), held-out split: {info['documents']} document(s), "
        f"{info['held_out_bytes']:,} of {info['bytes']:,} bytes; scored {info['tokens']:,} predicted tokens "
        f"in {info['windows']} windows of {seq_len}")
  print()
  print("| model | variant | kv heads | relative error | loss (nats/token) | perplexity | seconds |")
  print("|---|---|---:|---:|---:|---:|---:|")
  print("\n".join(rows))
  return 0
