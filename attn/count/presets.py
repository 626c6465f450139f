"""Named whole-model presets with the parameter counts their papers publish.

Each preset is an attn.nn.ModelConfig plus the Flax model kind it builds, so
the same name gives a count (attn.count.model_param_count) and a model
(`preset.build(rngs)`; `nnx.eval_shape` builds it without allocating).

Vaswani et al. 2017, Table 3: post-norm encoder-decoder, sinusoidal positions,
one token table shared by source, target and the pre-softmax projection
(§3.4). The paper's vocabulary is "about 37000" shared BPE tokens, but with
V = 37000 the base model has 63.1M parameters, not 65M. Every params entry of
rows base, A, B and C rounds to the paper's number exactly when V lies in
[40932, 41160]; we use V = 41000. The "big" row (213M) cannot be matched
together with them: it needs V in [35296, 36272] (ours: 218M). See
`vocab_range` and tests/test_count.py, which recompute these intervals.
"""

from __future__ import annotations

import dataclasses
import math

from flax import nnx

from attn.count.model import model_param_count
from attn.config import invalid
from attn.nn.config import ModelConfig
from attn.nn.models import MODELS
VASWANI_VOCAB = 41_000  # see the module docstring: the paper's "about 37000" gives 63M for base


@dataclasses.dataclass(frozen=True)
class Preset:
  """A whole model and the count its source publishes (exact, or rounded to millions)."""

  name: str
  kind: str
  config: ModelConfig
  published: int
  in_millions: bool
  source: str
  label: str = ""

  @property
  def count(self) -> int:
    return model_param_count(self.config, self.kind)

  def matches(self) -> bool:
    """Our count equals the published one (rounded to millions where the paper rounds)."""
    return (round(self.count / 1e6) if self.in_millions else self.count) == self.published

  def build(self, rngs: nnx.Rngs) -> nnx.Module:
    """The Flax model of this preset (wrap in nnx.eval_shape to get shapes only)."""
    return MODELS[self.kind](self.config, rngs=rngs)


def vaswani(**changes) -> ModelConfig:
  """The base Transformer of Vaswani et al. 2017 (N=6, d_model=512, d_ff=2048, h=8)."""
  base = ModelConfig(
      vocab_size=VASWANI_VOCAB, d_model=512, num_layers=6, num_decoder_layers=6, num_heads=8,
      d_ff=2048, d_k=64, d_v=64, positional="sinusoidal", norm="post", final_norm=False,
      activation="relu", tie_embeddings=True, share_src_tgt_embeddings=True)
  return base.replace(**changes)


_PAPER = "Vaswani et al. 2017, Table 3"
# (name, row label, changes from base, params column ×10⁶)
TABLE3_ROWS = [
    ("vaswani-base", "base", {}, 65),
    ("vaswani-A-h1", "(A) h=1, d_k=d_v=512", dict(num_heads=1, d_k=512, d_v=512), 65),
    ("vaswani-A-h4", "(A) h=4, d_k=d_v=128", dict(num_heads=4, d_k=128, d_v=128), 65),
    ("vaswani-A-h16", "(A) h=16, d_k=d_v=32", dict(num_heads=16, d_k=32, d_v=32), 65),
    ("vaswani-A-h32", "(A) h=32, d_k=d_v=16", dict(num_heads=32, d_k=16, d_v=16), 65),
    ("vaswani-B-dk16", "(B) d_k=16", dict(d_k=16), 58),
    ("vaswani-B-dk32", "(B) d_k=32", dict(d_k=32), 60),
    ("vaswani-C-N2", "(C) N=2", dict(num_layers=2, num_decoder_layers=2), 36),
    ("vaswani-C-N4", "(C) N=4", dict(num_layers=4, num_decoder_layers=4), 50),
    ("vaswani-C-N8", "(C) N=8", dict(num_layers=8, num_decoder_layers=8), 80),
    ("vaswani-C-d256", "(C) d_model=256, d_k=d_v=32", dict(d_model=256, d_k=32, d_v=32), 28),
    ("vaswani-C-d1024", "(C) d_model=1024, d_k=d_v=128", dict(d_model=1024, d_k=128, d_v=128), 168),
    ("vaswani-C-ff1024", "(C) d_ff=1024", dict(d_ff=1024), 53),
    ("vaswani-C-ff4096", "(C) d_ff=4096", dict(d_ff=4096), 90),
    ("vaswani-big", "big", dict(d_model=1024, d_ff=4096, num_heads=16), 213),
]
TABLE3 = [Preset(name, "encoder_decoder", vaswani(**changes), paper, True, _PAPER, label)
          for name, label, changes, paper in TABLE3_ROWS]


def bert(d_model: int, num_layers: int, num_heads: int) -> ModelConfig:
  """BERT (Devlin et al. 2019): post-norm, token + position + segment embeddings, LN, pooler."""
  return ModelConfig(vocab_size=30522, d_model=d_model, num_layers=num_layers,
                     num_heads=num_heads, d_ff=4 * d_model, max_len=512, num_segments=2,
                     embed_norm=True, norm="post", final_norm=False, pooler=True)


def gpt2(d_model: int, num_layers: int, num_heads: int) -> ModelConfig:
  """GPT-2 (Radford et al. 2019): pre-norm, final LN, learned positions, tied embeddings."""
  return ModelConfig(vocab_size=50257, d_model=d_model, num_layers=num_layers,
                     num_heads=num_heads, d_ff=4 * d_model, max_len=1024, norm="pre",
                     final_norm=True, tie_embeddings=True)


_HF = "Hugging Face checkpoint, parameters counted once"
PRESETS: dict[str, Preset] = {p.name: p for p in [
    *TABLE3,
    Preset("bert-base", "encoder", bert(768, 12, 12), 109_482_240, False, _HF),
    Preset("bert-large", "encoder", bert(1024, 24, 16), 335_141_888, False, _HF),
    Preset("gpt2", "decoder_lm", gpt2(768, 12, 12), 124_439_808, False, _HF),
    Preset("gpt2-medium", "decoder_lm", gpt2(1024, 24, 16), 354_823_168, False, _HF),
    Preset("gpt2-large", "decoder_lm", gpt2(1280, 36, 20), 774_030_080, False, _HF),
    Preset("gpt2-xl", "decoder_lm", gpt2(1600, 48, 25), 1_557_611_200, False, _HF),
]}
# Names that print a table of several presets rather than one model.
GROUPS = {"vaswani-table3": [p.name for p in TABLE3],
          "bert-gpt2": ["bert-base", "bert-large", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"]}


def get_preset(name: str) -> Preset:
  """The preset `name`; an unknown name lists the known ones."""
  if name not in PRESETS:
    raise invalid("preset", name, f"one of {sorted(PRESETS) + sorted(GROUPS)}")
  return PRESETS[name]


def vocab_range(preset: Preset) -> tuple[int, int]:
  """Vocabulary sizes [lo, hi] for which the count rounds to the published millions.

  The count is affine in vocab_size (slope: the token tables and untied
  outputs), so the interval follows from two evaluations.
  """
  if not preset.in_millions:
    raise invalid("preset", preset.name, "one whose source rounds to millions (Table 3)")
  at = lambda v: model_param_count(preset.config.replace(vocab_size=v), preset.kind)
  c0, slope = at(1) - (at(2) - at(1)), at(2) - at(1)
  # round(c / 1e6) == p  <=>  (p - 0.5)·10⁶ < c < (p + 0.5)·10⁶ (ties left out).
  lo = math.floor(((preset.published - 0.5) * 1e6 - c0) / slope) + 1
  hi = math.ceil(((preset.published + 0.5) * 1e6 - c0) / slope) - 1
  return lo, hi
