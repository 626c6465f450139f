"""`attn analyze DIR [--trial ID ...] [--batches N]` or `attn analyze --hf PATH --text FILE_OR_DIR --out DIR`:
inside the heads of each trained trial, or of a pretrained model.

The work (what is written where, on which batches): attn.experiments.reading.analyze.
"""

from __future__ import annotations

import argparse
import os


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("dir", metavar="DIR", nargs="?", default=None,
                      help="a sweep directory written by `attn sweep` (or use --hf)")
  parser.add_argument("--trial", metavar="ID", action="append", default=[], dest="trials",
                      help="analyse only this trial (repeatable; default: every finished trial)")
  parser.add_argument("--batches", metavar="N", type=int, default=None,
                      help="held-out (and training) batches per trial (default: the trial's eval_batches)")
  parser.add_argument("--no-plots", action="store_true", help="write analysis.json only")
  hf = parser.add_argument_group("a pretrained model instead of a sweep (needs the hf extra)")
  hf.add_argument("--hf", metavar="PATH", help="a local Hugging Face directory with its tokenizer, of a family "
                  "attn.nn.hf.FAMILIES holds")
  hf.add_argument("--text", metavar="FILE_OR_DIR", help="text to analyse on ('' for the Python stdlib)")
  hf.add_argument("--glob", default=None, help="files of a --text directory (default '**/*')")
  hf.add_argument("--out", metavar="DIR", help="where analysis.json and the PNGs go")
  hf.add_argument("--seq-len", type=int, default=128, metavar="L", help="window length in tokens")
  hf.add_argument("--batch-size", type=int, default=8)


def run(args: argparse.Namespace) -> int:
  from attn.config import invalid
  from attn.experiments.reading import analyze
  if args.hf is not None or args.dir is None:
    if args.dir is not None or args.trials:
      raise invalid("DIR", args.dir or args.trials, "no sweep directory or --trial with --hf")
    for name in ("hf", "text", "out"):
      if getattr(args, name) is None:
        raise invalid("--" + name, None, "a value: `attn analyze DIR` for a sweep, or "
                      "`attn analyze --hf PATH --text FILE_OR_DIR --out DIR` for a pretrained model")
    out = analyze.analyze_hf(args.hf, args.text, args.out, args.batches or analyze.HF_BATCHES,
                             plots=not args.no_plots, glob=args.glob, seq_len=args.seq_len, batch_size=args.batch_size)
    s = out["summary"]
    print(f"analysed {args.hf} in {out['seconds']:.1f} s: held-out loss {out['eval']['loss']:.4f}, prunable "
          f"{s['prunable_fraction']:.2f}, W_QK eff. rank {analyze.qk_rank(out)} (d_k={out['d_k']}); "
          f"wrote {os.path.join(args.out, analyze.ANALYSIS)} and {len(out.get('plots', []))} PNGs")
    return 0
  done = analyze.analyze_sweep(args.dir, args.trials or None, args.batches, plots=not args.no_plots)
  print(f"analysed {len(done)} trials of {args.dir}: trials/ID/{analyze.ANALYSIS} and PNGs")
  return 0
