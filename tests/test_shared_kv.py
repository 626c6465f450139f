"""configs/shared_kv.toml: every arm issue 43 names is in it, each within 1% of the parameter budget, and
the KV cache and attention parameters the write-up compares are `attn count`'s, by hand here."""

import functools
import os
import tomllib

from attn import count
from attn.experiments.reading import report
from attn.experiments.running import config as config_lib
from attn.nn.config import ModelConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "shared_kv.toml")
D, L, H, K = 64, 4, 8, 8  # the config's d_model, layers, heads and head width (d_k = d_v)


@functools.cache
def _arms():
  """case -> (its trial at seed 0, ModelConfig, parameters); the config's seeds. One seed is loaded:
  resolving a text trial lists the corpus (~0.3 s a trial here), and seeds change no model."""
  sweep = config_lib.load(CONFIG, ["sweep.seeds=[0]"])
  assert sweep.vmap_seeds and len(sweep.trials) == 10
  with open(CONFIG, "rb") as f:
    seeds = tomllib.load(f)["sweep"]["seeds"]
  out = {}
  for t in sweep.trials:
    if t.label["case"] not in out:
      m = ModelConfig(**t.config["model"])
      out[t.label["case"]] = (t, m, count.model_param_count(m, "decoder_lm"))
  return seeds, out


def test_every_arm_is_within_one_percent_of_the_budget():
  seeds, arms = _arms()
  assert seeds == [0, 1, 2]
  budget = 237248
  with open(CONFIG, encoding="utf-8") as f:
    assert f"param_budget = {budget}" in f.read()
  for case, (_, m, params) in arms.items():
    assert abs(params / budget - 1) < 0.01, (case, params)
    assert (m.d_model, m.num_layers, m.num_heads, m.d_k, m.d_v) == (D, L, H, K, K), case
  d_ff = {case: m.d_ff for case, (_, m, _) in arms.items()}
  assert d_ff["MHA"] == 256  # the budget is per_head MHA's at d_ff = 256; the others spend what they save on d_ff
  assert all(d_ff[c] > 256 for c in arms if c != "MHA")


def test_the_arms_are_the_issues_layouts():
  _, arms = _arms()
  shape = {c: (m.variant, m.num_kv_heads, m.kv_source, m.value_norm_eps, m.latent_dim if m.variant == "mla" else None,
               (m.o_groups, m.o_rank) if m.variant == "grouped_lowrank" else None) for c, (_, m, _) in arms.items()}
  assert shape == {
      "MHA": ("per_head", 8, None, None, None, None),
      "GQA G=2": ("per_head", 2, None, None, None, None),
      "MQA": ("per_head", 1, None, None, None, None),
      "mla d_c=16": ("mla", 8, None, None, 16, None),
      "k_eq_v": ("k_eq_v", 8, None, None, None, None),
      "k_eq_v + v-norm": ("k_eq_v", 8, None, 1e-6, None, None),
      "share 2 layers": ("per_head", 8, (0, 0, 2, 2), None, None, None),
      "share 4 layers": ("per_head", 8, (0, 0, 0, 0), None, None, None),
      "grouped_lowrank r=16": ("grouped_lowrank", 8, None, None, None, (2, 16)),
      "grouped_lowrank r=8": ("grouped_lowrank", 8, None, None, None, (2, 8)),
  }


def test_cache_bytes_and_attention_parameters_by_hand():
  """float32 bytes per token over the 4 layers, and the 4 layers' attention parameters."""
  _, arms = _arms()
  cache = {c: report.kv_cache_bytes({"config": t.config}) for c, (t, _, _) in arms.items()}
  for c, (_, m, _) in arms.items():
    assert cache[c] == count.model_kv_cache_bytes_per_token(m, "decoder_lm", "float32")  # attn count's
  kv = 2 * H * K  # per_head MHA: a key and a value of K per kv head
  assert cache == {"MHA": L * kv * 4, "GQA G=2": L * 2 * 2 * K * 4, "MQA": L * 2 * K * 4, "mla d_c=16": L * 16 * 4,
                   "k_eq_v": L * H * K * 4, "k_eq_v + v-norm": L * H * K * 4,
                   "share 2 layers": 2 * kv * 4, "share 4 layers": 1 * kv * 4,
                   "grouped_lowrank r=16": L * kv * 4, "grouped_lowrank r=8": L * kv * 4}
  attn = {c: count.model_param_breakdown(m, "decoder_lm")["attention"] for c, (_, m, _) in arms.items()}
  key_side = 2 * (D * H * K + H * K)  # w_k, w_v and their biases
  mha = 4 * D * H * K + 3 * H * K + D  # w_q, w_k, w_v, w_o; b_q, b_k, b_v, b_o
  assert attn["MHA"] == L * mha
  assert attn["share 2 layers"] == L * mha - 2 * key_side  # the 2 sharing layers hold no key-side weights
  assert attn["share 4 layers"] == L * mha - 3 * key_side
  assert attn["k_eq_v"] == attn["k_eq_v + v-norm"] == L * (3 * D * H * K + 2 * H * K + D)  # w_q, w_kv, w_o
  for r in (16, 8):  # per_head's queries, keys, values; w_oa (2, 4·K, r), w_ob (2·r, D), b_o
    assert attn[f"grouped_lowrank r={r}"] == L * (3 * D * H * K + 3 * H * K + H * K * r + 2 * r * D + D)
  assert attn["GQA G=2"] == L * (2 * D * H * K + 2 * D * 2 * K + H * K + 2 * 2 * K + D)
