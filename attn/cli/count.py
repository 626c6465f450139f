"""`attn count`: parameter counts (analytic, stored, effective), FLOPs and KV cache per variant.

  attn count                                  # one layer, d_model=512, h=8, d_k=d_v=64
  attn count --d-model 512 --num-heads 8 --num-kv-heads 2 --format csv
  attn count --preset bert-base               # whole model + its layer, every variant
  attn count --preset vaswani-table3          # Table 3 params column, paper vs ours
  attn count --preset bert-gpt2               # BERT and GPT-2 totals, published vs ours
  attn count --variant mla --latent-dim 128 --rope-dim 32   # MLA's cache: d_c + rope_dim
  attn count --mechanisms --seq-len 4096 --window 512  # what gates, sinks, QK-norm, windows add
  attn count --preset gpt2 --window 512 --global-every 4 --seq-len 8192  # per layer type at L
  attn count --preset gpt2 --kv-source 0,1,2,3,4,5,6,7,8,9,9,9 --seq-len 8192  # the last 3 layers share
  attn count --hf ./my-checkpoint --format json  # a checkpoint's config.json by component (no weights read)
  attn count --hf gpt-oss-20b                    # a stored published config (attn/count/hf_configs)
  attn count configs/quick.toml                  # the models a sweep's trials train, as `attn sweep` resolves them
  attn count CONFIG --case hybrid --set model.d_model=128   # one case of it, with the sweep's --set

Byte counts are in float32 unless --dtype says otherwise (count.model.DTYPE, the whole counting API's default:
what attn's models train and decode in, and what reports count in). The work: attn.count.report (the reports
and which one the flags ask for), attn.count.tables (their Markdown, CSV and JSON), and for CONFIG
attn.experiments.running.model_counts.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tomllib
from typing import Any

from attn.config import HeadConfig
from attn.count import hf as count_hf, model as count_model, presets
from attn.variants.mechanisms import MECHANISMS

# Every HeadConfig field is a flag: --d-k 64, --rope-theta 1e6, --no-use-bias (a field true by
# default), --sinks (false by default); typed by its annotation, checked by HeadConfig.
_HEAD_FIELDS = {f.name: f for f in dataclasses.fields(HeadConfig)}
_ARG_TYPES = {"int": int, "float": float, "str": str, "dict": lambda text: _toml_table(text)}
# Model settings of a preset that a flag changes: the layer schedule (attn.nn.layer_types).
_MODEL_FLAGS = {"positional": str, "global_every": int, "sliding_rope_theta": float,
                "layer_types": lambda text: tuple(t.strip() for t in text.split(",")),
                "kv_source": lambda text: tuple(int(t) for t in text.split(","))}


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("config", nargs="?", default=None, metavar="CONFIG",
                      help="a sweep config (TOML): count the model each of its trials trains, resolved as "
                      "`attn sweep` resolves it (derived d_k, d_v, d_ff and defaults included)")
  parser.add_argument("--case", action="append", default=None, metavar="NAME",
                      help="with CONFIG: only this case of its sweep.cases (repeatable)")
  parser.add_argument("--set", metavar="KEY=VALUE", action="append", default=[], dest="overrides",
                      help="with CONFIG: override a config key as `attn sweep --set` does (repeatable)")
  parser.add_argument("--preset", help="a whole model: " + ", ".join(
      sorted(presets.PRESETS) + sorted(presets.GROUPS)))
  for name, f in _HEAD_FIELDS.items():
    flag = name.replace("_", "-")
    kind = [n.strip() for n in str(f.type).split("|") if n.strip() != "None"][0]
    if name == "qk_norm":  # --qk-norm: per head; whole: over the whole projection (OLMo 2); fixed: no scale
      parser.add_argument("--qk-norm", dest=name, nargs="?", const=True, default=None, metavar="whole|fixed")
    elif name == "extra":  # an outside head mechanism's options, as [model.extra.NAME] in a config
      outside = sorted(n for n, m in MECHANISMS.items() if not m.fields)
      parser.add_argument("--extra", dest=name, type=_ARG_TYPES["dict"], default=None, metavar="TABLE",
                          help="options of outside head mechanisms as a TOML inline table, e.g. "
                          "'{NAME = {OPTION = VALUE}}' (installed: " + (", ".join(outside) or "none") + ")")
    elif kind == "bool":
      parser.add_argument(f"--no-{flag}" if f.default else f"--{flag}", dest=name,
                          action="store_const", const=not f.default, default=None)
    else:
      parser.add_argument(f"--{flag}", dest=name, type=_ARG_TYPES[kind], default=None)
  parser.add_argument("--no-bias", dest="use_bias", action="store_const", const=False,
                      help="layers without biases (--no-use-bias)")
  for name, kind in _MODEL_FLAGS.items():
    parser.add_argument("--" + name.replace("_", "-"), dest=name, type=kind, default=None,
                        help="with --preset: the model's " + name + (" (comma-separated, one per layer)"
                                                                     if name in ("layer_types", "kv_source") else ""))
  parser.add_argument("--hf", metavar="DIR", default=None,
                      help="a Hugging Face checkpoint directory (config.json only is enough) or a stored "
                      "published config (" + ", ".join(count_hf.stored_configs()) + "): parameters by "
                      "component, active per token, KV cache per layer type at 8k, 128k and --seq-len "
                      "(those within the model's max_position_embeddings; past it, at that context)")
  parser.add_argument("--seq-len", type=int, default=128, help="query length T for FLOPs (L for KV caches)")
  parser.add_argument("--kv-len", type=int, default=None, help="key length S (default T)")
  parser.add_argument("--dtype", default=count_model.DTYPE, help=f"dtype of KV-cache and state bytes (default {count_model.DTYPE})")
  parser.add_argument("--variant", action="append", default=None,
                      help="only this variant (repeatable; default all)")
  parser.add_argument("--mechanisms", action="store_true",
                      help="also what each head mechanism adds: " + "; ".join(
                          m.help or m.name for m in MECHANISMS.values()))
  parser.add_argument("--format", choices=("markdown", "csv", "json"), default="markdown")


def _toml_table(text: str) -> dict[str, Any]:
  """--extra '{my_gate = {width = 3}}': a TOML inline table (HeadConfig.extra)."""
  try:
    return tomllib.loads(f"v = {text}")["v"]
  except tomllib.TOMLDecodeError as e:
    raise argparse.ArgumentTypeError(f"not a TOML inline table ({e})") from None


def run(args: argparse.Namespace) -> int:
  """Prints the table; ConfigError (unknown preset, impossible dims) exits 2 via attn.cli."""
  from attn.api import get_variant
  from attn.count import report
  req = report.Request(config=args.config, cases=tuple(args.case or ()), overrides=tuple(args.overrides),
                       preset=args.preset, hf=args.hf,
                       head={n: getattr(args, n) for n in _HEAD_FIELDS if getattr(args, n) is not None},
                       model={n: getattr(args, n) for n in _MODEL_FLAGS if getattr(args, n) is not None},
                       variants=tuple(args.variant or ()), mechanisms=args.mechanisms, seq_len=args.seq_len,
                       kv_len=args.kv_len, dtype=args.dtype, fmt=args.format)
  if req.config is not None:  # a sweep config: counted where configs are read, a layer above attn.count
    from attn.experiments.running import model_counts
    print(model_counts.count_config(req))
    return 0
  text, failed = report.count(req)
  print(text)
  for name, why in failed.items():  # the built-ins' rows stand; each failed plugin in one line
    print(f"attn count: variant {name!r} left out: {why}", file=sys.stderr)
  asked = {get_variant(v).name for v in args.variant or ()}
  return 1 if asked & set(failed) else 0
