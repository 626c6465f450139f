"""`attn eval --hf PATH --text FILE_OR_DIR`: held-out loss of a pretrained model, before and after conversion.

  attn eval --hf ./gpt2 --text notes.txt                        # the checkpoint as it is
  attn eval --hf ./gpt2 --text src/ --glob '**/*.py' --num-kv-heads 4   # and mean-pooled to 4 kv heads
  attn eval --hf ./gpt2 --text '' --variant merged              # the Python stdlib, merged W_Q·W_Kᵀ

PATH is a local Hugging Face directory as save_pretrained writes it (config.json,
model.safetensors and the tokenizer's files) of any family attn.nn.hf.FAMILIES
holds (GPT-2, BERT, the Llama-like decoders, plugins'); its weights are read with numpy,
without torch. The text is tokenised with that tokenizer and the held-out split
of the corpus is scored (attn.experiments.data.hf_text), by the objective the
model was trained with (attn.experiments.reading.losses.OBJECTIVES):

  next_token      a causal LM: mean next-token cross-entropy in nats over every
                  predicted token; perplexity exp(loss)
  masked_lm       a BertForMaskedLM: 15% of the real tokens (a fixed seed,
                  MLM_SEED) replaced by [MASK] and predicted; perplexity exp(loss)
  sentence_pairs  a BertModel without an MLM head, i.e. a sentence encoder such
                  as all-MiniLM-L6-v2: each window of --seq-len tokens is cut
                  in halves, [CLS] half [SEP] each, mean-pooled and normalised as
                  sentence-transformers does; the loss is the in-batch ranking
                  loss of each first half against the batch's second halves
                  (attn.analysis.sentence.ranking_loss, cosines × 20), so it
                  depends on --batch-size: ln(batch size) is chance. Pairs
                  are shuffled (PAIR_SEED) so a batch's negatives come from
                  anywhere in the split, not from one document. The
                  accuracy column is top-1 retrieval of the own second half.

With --variant or --num-kv-heads the same weights are converted
(attn.nn.hf.convert_model: exact variants, or key/value heads mean-pooled as
Ainslie et al. 2023 do before uptraining) and scored again on the same tokens;
the table gives each conversion's relative error (the largest over layers). The work:
attn.experiments.reading.checkpoint_eval.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--hf", metavar="PATH", required=True,
                      help="a local Hugging Face directory (config.json, model.safetensors, tokenizer) of a family "
                      "attn.nn.hf.FAMILIES holds (GPT-2, BERT with or without its MLM head, the Llama-like "
                      "decoders, plugins')")
  parser.add_argument("--text", metavar="FILE_OR_DIR", required=True,
                      help="text to score: a file, a directory, or '' for the Python standard library")
  parser.add_argument("--glob", default=None,
                      help="files of a directory to read (default '**/*'; '**/*.py' for the stdlib)")
  parser.add_argument("--variant", default="per_head", help="also score the model converted to this variant")
  parser.add_argument("--num-kv-heads", type=int, default=None, metavar="G",
                      help="also score it with G key/value heads (mean-pooled)")
  parser.add_argument("--max-tokens", type=int, default=4096, metavar="N", help="tokens to score: predicted ones (sentence pairs: the windows' tokens)")
  parser.add_argument("--seq-len", type=int, default=256, metavar="L",
                      help="window length (capped at the model's positions)")
  parser.add_argument("--batch-size", type=int, default=8)


def run(args: argparse.Namespace) -> int:
  from attn.experiments.reading import checkpoint_eval
  result = checkpoint_eval.evaluate_checkpoint(args.hf, args.text, args.variant, args.num_kv_heads, args.max_tokens,
                                               args.seq_len, args.batch_size, args.glob)
  print(checkpoint_eval.markdown(result))
  return 0
