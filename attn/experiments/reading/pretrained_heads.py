"""Inside the heads of a pretrained BERT sentence encoder (all-MiniLM-L6-v2): parity, heads, rank, pruning, kv.

run(model_dir, out_dir) measures, on English sentences of Python's own
documentation (attn.experiments.data.sentences; the held-out and importance
sentences come from disjoint topics):

  parity      attn's Encoder (attn.nn.hf.from_hf) against transformers'
              BertModel on padded batches: max |Δ| of the final hidden states
              over real tokens and over every position; the pooled embedding
              against sentence-transformers' own encode() when it is installed
  heads       per layer, on the held-out sentences: the Jensen–Shannon
              diversity of the 12 heads (attention_stats), the attention mass
              on [CLS] (key 0) and on [SEP] (key length − 1) per head
              (analysis.sentence.key_mass), entropy; and how much of each
              head's W_Q, W_K, W_V sits in its own D/H slice of the input
              (analysis.sentence.slice_share: 1 if the input were split)
  rank        the singular values of every head's W_QK,h and W_OV,h
              (analysis.circuit_factors + spectrum_of_product), effective and
              numerical rank against d_k, and what a merged D×D W_h costs
  importance  per head, E_x[1 − cos(e_{−h}(x), e(x))]: the drop in cosine
              similarity of the mean-pooled embedding when head h alone is
              gated off, normalised per layer as Michel et al. do
              (analysis.head_importance). Their first-order score, |∂L/∂ξ| at
              ξ = 1, is measured too and is zero up to round-off: this loss is
              at its minimum at ξ = 1, so its gradient carries no ranking
  pruning     heads gated off least important first (Michel's normalised
              order, and raw importance alone); at each point the
              Spearman correlation between the pruned and the unpruned model's
              cosine similarities of the held-out sentence pairs, the mean
              cosine of the embeddings to the unpruned ones and the AUC of
              adjacent over random pairs. Evaluated every PRUNE_EVERY heads,
              then at every head up to the first point below 1 − TOLERANCE;
              auc_prunable_heads reads the AUC the same way (on that grid)
  kv          mean-pooled kv heads (G) and a latent (mla, d_c) in every layer
              and in one layer at a time: per-layer weight error (attn.convert's
              return_error), embedding cosine to the original, pair-ranking
              Spearman, KV-cache bytes per token. A converted layer is read
              back to per_head with H kv heads (repeat_kv_heads and
              mla -> per_head are exact), so one compiled model serves every
              setting; the real G-head and mla Encoders are checked against it
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
import time
import warnings
from typing import Any

import jax
import numpy as np

from attn import count
from attn.analysis import attention_stats, circuit_factors, head_importance, spectrum_of_product
from attn.analysis.importance import pruning_gates, pruning_order, prunable_fraction
from attn.analysis.sentence import cosine, key_mass, roc_auc, slice_share, spearman
from attn.config import invalid
from attn.conversion import LossyConversionWarning, convert
from attn.experiments.data import sentences as sentences_lib
from attn.nn import hf
from attn.nn.sentence import SentenceEncoder

RESULTS = "results.json"
TOLERANCE = 0.01  # the pair-ranking Spearman may fall this far below the unpruned model's 1.0
KEEP = 0.99  # the embedding cosine a smaller cache must keep
PRUNE_EVERY = 4
KV_HEADS = (6, 4, 3, 2, 1)
LATENT_DIMS = (64, 128, 192, 256, 320, 352, 384)
CACHE_DTYPE = "bfloat16"


@dataclasses.dataclass(frozen=True)
class Sizes:
  """How many sentences each measurement reads; `runlocal` shrinks them for tests."""
  pairs: int = 128          # adjacent pairs (and as many random ones) over 2·pairs held-out sentences
  importance: int = 128     # importance-split sentences for head importance
  probe: int = 128          # held-out sentences for attention statistics, parity and per-layer drift
  max_tokens: int = 64      # longer sentences are dropped, not truncated
  batch_size: int = 64


def runlocal() -> Sizes:
  return Sizes(pairs=8, importance=8, probe=8, max_tokens=32, batch_size=8)


def sentence_data(tokenizer, sizes: Sizes, seed: int = 0) -> dict[str, Any]:
  """Held-out pairs, importance and probe sentences with their batches (sentences_lib's rules)."""
  every = sentences_lib.fits(tokenizer, sentences_lib.pydoc_sentences(), sizes.max_tokens)
  split = sentences_lib.by_split(every, ("heldout", "importance"))
  pairs = sentences_lib.pairs(split["heldout"], sizes.pairs, seed)
  importance = [s for _, s in sentences_lib.sample(split["importance"], sizes.importance, seed)]
  probe = pairs["texts"][:sizes.probe]
  ids = {name: sentences_lib.encode(tokenizer, texts)
         for name, texts in (("pairs", pairs["texts"]), ("importance", importance), ("probe", probe))}
  return {"pairs": pairs, "importance": importance, "probe": probe,
          "batches": {n: sentences_lib.batches(i, sizes.batch_size, 8) for n, i in ids.items()},
          "probe_batch": sentences_lib.batches(ids["probe"], len(probe), 8)[0],
          "about": {"sentences": len(every), "heldout_sentences": len(split["heldout"]),
                    "importance_sentences": len(split["importance"]),
                    "heldout_topics": len({t for t, _ in split["heldout"]}),
                    "importance_topics": len({t for t, _ in split["importance"]}),
                    "mean_tokens_pairs": float(np.mean([len(i) for i in ids["pairs"]]))}}


def pair_scores(e_ND: np.ndarray, pairs: dict[str, Any]) -> np.ndarray:
  """Cosine of each pair, adjacent pairs first, then random ones."""
  both = np.concatenate([pairs["adjacent"], pairs["random"]])
  return cosine(e_ND[both[:, 0]], e_ND[both[:, 1]])


def ranking(e_ND: np.ndarray, base_scores: np.ndarray, base_ND: np.ndarray, pairs: dict[str, Any]) -> dict:
  """Spearman of the pair cosines against the unpruned model's, mean/min embedding cosine, AUC."""
  scores = pair_scores(e_ND, pairs)
  n = len(pairs["adjacent"])
  cos = cosine(e_ND, base_ND)
  return {"spearman": spearman(scores, base_scores), "cos_mean": float(cos.mean()),
          "cos_min": float(cos.min()), "auc": roc_auc(scores[:n], scores[n:])}


# ---- the measurements

def parity(model_dir: str, enc: SentenceEncoder, batches: list[dict], texts: list[str],
           e_ND: np.ndarray) -> dict[str, Any]:
  """Max |Δ| against transformers' BertModel (float32), and the pooled embedding against sentence-transformers."""
  torch, transformers = hf.require("torch"), hf.require("transformers")
  ref = transformers.BertModel.from_pretrained(model_dir).eval()
  real, every, per_sentence = 0.0, 0.0, []
  for b in batches:
    mask_BT = (np.arange(b["tokens"].shape[1]) < b["lengths"][:, None])
    with torch.no_grad():
      want = ref(input_ids=torch.from_numpy(b["tokens"].astype(np.int64)),
                 attention_mask=torch.from_numpy(mask_BT.astype(np.int64))).last_hidden_state.numpy()
    diff_BTD = np.abs(enc.hidden(b) - want)
    real = max(real, float(np.where(mask_BT[..., None], diff_BTD, 0).max()))
    every = max(every, float(diff_BTD.max()))
    per_sentence += [(int(n), float(np.where(mask_BT[i, :, None], diff_BTD[i], 0).max()))
                     for i, n in enumerate(b["lengths"])]
  out = {"sentences": len(texts), "max_abs_diff_real_tokens": real, "max_abs_diff_all_positions": every,
         "per_sentence": per_sentence, "transformers": transformers.__version__}
  if not os.path.isfile(os.path.join(model_dir, "modules.json")):  # not a sentence-transformers directory
    return out
  try:
    from sentence_transformers import SentenceTransformer
  except ImportError:
    return out
  st = SentenceTransformer(model_dir, device="cpu")
  want = st.encode(texts, batch_size=64, convert_to_numpy=True)
  out["sentence_transformers"] = {"version": sys.modules["sentence_transformers"].__version__,
                                  "max_abs_diff_embedding": float(np.abs(want - e_ND).max())}
  return out


def heads(enc: SentenceEncoder, batch: dict[str, np.ndarray]) -> list[dict[str, Any]]:
  """Per layer: diversity, head_js, entropy, [CLS] and [SEP] mass per head, slice shares of W_Q, W_K, W_V."""
  lengths = batch["lengths"]
  T = batch["tokens"].shape[1]
  real_BT = np.arange(T)[None] < lengths[:, None]
  mask_B1TS = (real_BT[:, None, :, None] & real_BT[:, None, None, :])
  cls_BS = np.zeros_like(real_BT)
  cls_BS[:, 0] = True
  sep_BS = np.arange(T)[None] == (lengths[:, None] - 1)
  out = []
  for l, w_BHTS in enumerate(enc.weights(batch)):
    s = attention_stats(w_BHTS, mask_B1TS)
    js = np.asarray(s["head_js"])
    off = js[~np.eye(js.shape[0], dtype=bool)]
    p = enc.attention(l)
    out.append({"diversity": float(s["diversity"]), "head_js": js.tolist(), "min_pair_js": float(off.min()),
                "max_pair_js": float(off.max()), "entropy": np.asarray(s["entropy"]).tolist(),
                "max_entropy": float(s["max_entropy"]),
                "cls_mass": np.asarray(key_mass(w_BHTS, cls_BS, real_BT)).tolist(),
                "first_mass": np.asarray(s["first_mass"]).tolist(),
                "sep_mass": np.asarray(key_mass(w_BHTS, sep_BS, real_BT)).tolist(),
                "slice_share": {n: slice_share(p[f"w_{n}"]).tolist() for n in "qkv"}})
  return out


def ranks(enc: SentenceEncoder) -> dict[str, Any]:
  """Per layer and head: W_QK and W_OV singular values (first d_k), effective and numerical rank."""
  head = enc.cfg.head
  layers = []
  for l in range(enc.L):
    factors = circuit_factors("per_head", enc.attention(l), head)
    row = {}
    for name in ("qk", "ov"):
      s = spectrum_of_product(*factors[name])
      sv = np.asarray(s["singular_values"])[:, :max(head.d_k, head.d_v)]
      row[name] = {"singular_values": sv.tolist(), "effective_rank": np.asarray(s["effective_rank"]).tolist(),
                   "rank": np.asarray(s["rank"]).tolist(),
                   "top8_energy": ((sv[:, :8] ** 2).sum(1) / (sv ** 2).sum(1)).tolist()}
    layers.append(row)
  D, K = head.d_model, head.d_k
  return {"layers": layers, "d_k": K, "merged_per_head": D * D, "factored_per_head": 2 * D * K,
          "score_weights": {v: count.score_weight_count(v, head) for v in ("per_head", "merged")}}


def importance(enc: SentenceEncoder, batches: list[dict], base_ND: np.ndarray) -> dict[str, Any]:
  """Leave-one-out drops in cosine (N,L,H) -> Michel-normalised importance; the gradient score beside it."""
  drops = np.zeros((base_ND.shape[0], enc.L, enc.H))
  for l in range(enc.L):
    for h in range(enc.H):
      gates = np.ones((enc.L, enc.H), np.float32)
      gates[l, h] = 0.0
      drops[:, l, h] = 1.0 - cosine(enc.embed(batches, gates), base_ND)
  imp = head_importance(drops)
  grads = enc.cosine_gate_gradients(batches, base_ND)
  return {"raw": imp["raw"].tolist(), "normalized": imp["normalized"].tolist(),
          "max_drop": float(drops.max()), "gradient_max_abs": float(np.abs(grads).max()),
          "gradient_importance": head_importance(grads)["raw"].tolist()}


def pruning(enc: SentenceEncoder, batches: list[dict], pairs: dict[str, Any], base_ND: np.ndarray,
            imp: dict[str, Any], normalized: bool = True) -> dict[str, Any]:
  """The pruning curve on the held-out pairs, coarse then every head up to the first drop (module doc).

  normalized: heads ordered by Michel et al.'s per-layer normalised importance
  (ties by raw); False: by raw importance alone, comparable across layers here
  since every layer's score is the same drop in the same embedding.
  """
  raw = np.asarray(imp["raw"])
  order = pruning_order({"raw": raw, "normalized": np.asarray(imp["normalized"]) if normalized else raw})
  N = enc.L * enc.H
  base_scores = pair_scores(base_ND, pairs)
  points: dict[int, dict] = {}

  def at(steps):
    for k, gates in zip(steps, pruning_gates(order, steps, enc.L, enc.H)):
      if k not in points:
        points[k] = ranking(enc.embed(batches, gates), base_scores, base_ND, pairs)

  at(sorted(set(range(0, N + 1, PRUNE_EVERY)) | {N}))
  coarse = sorted(points)
  below = [k for k in coarse if points[k]["spearman"] < 1.0 - TOLERANCE]
  if below:
    first = below[0]
    at(list(range(coarse[coarse.index(first) - 1] + 1, first)))
  steps = sorted(points)
  rho = [points[k]["spearman"] for k in steps]
  frac = prunable_fraction(steps, rho, N, TOLERANCE)
  auc_frac = prunable_fraction(steps, [points[k]["auc"] for k in steps], N, TOLERANCE)
  return {"order_by": "normalized" if normalized else "raw", "order": order.tolist(), "heads_off": steps,
          **{m: [points[k][m] for k in steps] for m in ("spearman", "cos_mean", "cos_min", "auc")},
          "tolerance": TOLERANCE, "prunable_heads": int(round(frac * N)), "prunable_fraction": frac,
          "auc_prunable_heads": int(round(auc_frac * N))}


def _round_trip(p: dict, head, setting: tuple[str, int]) -> tuple[dict, float]:
  """A layer converted to the setting and read back to per_head with H kv heads, and the weight error."""
  kind, n = setting
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", LossyConversionWarning)
    if kind == "gqa":
      small = dataclasses.replace(head, num_kv_heads=n)
      q, err = convert(p, "per_head", "per_head", head, dst_cfg=small, return_error=True)
      return convert(q, "per_head", "per_head", small, dst_cfg=head), err
    latent = dataclasses.replace(head, latent_dim=n)
    q, err = convert(p, "per_head", "mla", latent, return_error=True)
    return convert(q, "mla", "per_head", latent), err


def cache_bytes(head, setting: tuple[str, int], layers: int) -> int:
  kind, n = setting
  if kind == "gqa":
    return layers * count.kv_cache_bytes_per_token("per_head", dataclasses.replace(head, num_kv_heads=n),
                                                   CACHE_DTYPE)
  return layers * count.kv_cache_bytes_per_token("mla", dataclasses.replace(head, latent_dim=n), CACHE_DTYPE)


def kv_settings(enc: SentenceEncoder, pair_batches: list[dict], probe_batches: list[dict],
                pairs: dict[str, Any], base_ND: np.ndarray) -> list[dict[str, Any]]:
  """Per setting: per-layer weight error and drift (one layer converted), all layers converted."""
  head = enc.cfg.head
  base_scores = pair_scores(base_ND, pairs)
  probe_base = base_ND[:max(int(b["index"].max()) for b in probe_batches) + 1]
  settings = [("mha", head.num_heads)] + [("gqa", g) for g in KV_HEADS] + [("mla", c) for c in LATENT_DIMS]
  rows = []
  for setting in settings:
    if setting[0] == "mha":
      rows.append({"setting": "mha", "n": head.num_heads, "cache_bytes": cache_bytes(head, ("gqa", head.num_heads), enc.L),
                   "weight_error": [0.0] * enc.L, "layer_cos": [1.0] * enc.L,
                   **ranking(base_ND, base_scores, base_ND, pairs)})
      continue
    layers, errors = {}, []
    for l in range(enc.L):
      layers[l], err = _round_trip(enc.attention(l), head, setting)
      errors.append(float(err))
    exact = max(errors) < 1e-5
    layer_cos = [1.0] * enc.L if exact else [
        float(cosine(enc.embed(probe_batches, params=enc.with_attention({l: layers[l]})), probe_base).mean())
        for l in range(enc.L)]
    e_ND = enc.embed(pair_batches, params=enc.with_attention(layers))
    rows.append({"setting": setting[0], "n": setting[1], "cache_bytes": cache_bytes(head, setting, enc.L),
                 "weight_error": errors, "layer_cos": layer_cos, **ranking(e_ND, base_scores, base_ND, pairs)})
  return rows


def check_real_models(model_dir: str, enc: SentenceEncoder, batches: list[dict], G: int, d_c: int) -> dict:
  """Max |Δ| of embeddings between the round trip and the real G-kv-head and mla Encoders."""
  head = enc.cfg.head
  out = {}
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", LossyConversionWarning)
    gqa = hf.from_hf(model_dir, num_kv_heads=G).model
    model, cfg = hf.from_hf(model_dir)
    mla, _, _ = hf.convert_model(model, cfg.replace(latent_dim=d_c), "mla")
  for name, real, setting in (("gqa", gqa, ("gqa", G)), ("mla", mla, ("mla", d_c))):
    trip = enc.with_attention({l: _round_trip(enc.attention(l), head, setting)[0] for l in range(enc.L)})
    diff = np.abs(SentenceEncoder(real).embed(batches) - enc.embed(batches, params=trip)).max()
    out[f"{name}_{setting[1]}"] = float(diff)
  return out


def machine() -> dict[str, Any]:
  return {"python": sys.version.split()[0], "platform": platform.platform(), "jax": jax.__version__,
          "cpu": _cpu_model()}


def _cpu_model() -> str:
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    return f"{names[0]} ({len(names)} logical CPUs)" if names else platform.processor()
  except OSError:
    return platform.processor()


def run(model_dir: str, out_dir: str, sizes: Sizes = Sizes(), seed: int = 0, plots: bool = True,
        check: bool = True, about: dict[str, Any] | None = None) -> dict[str, Any]:
  """Every measurement of the module docstring; writes out_dir/results.json, report.md and the PNGs.

  about (the command, the commit) is stored as it is in results.json.
  """
  if not os.path.isdir(model_dir):
    raise invalid("model_dir", model_dir, "a save_pretrained BERT directory (config.json, model.safetensors)")
  start = time.perf_counter()
  seconds = {}

  def lap(name):
    seconds[name] = round(time.perf_counter() - start - sum(seconds.values()), 1)

  tokenizer = sentences_lib.load_tokenizer(model_dir)
  data = sentence_data(tokenizer, sizes, seed)
  model, cfg = hf.from_hf(model_dir)
  enc = SentenceEncoder(model)
  b = data["batches"]
  base = enc.embed(b["pairs"])
  probe_base = base[:sizes.probe]
  lap("load")
  out: dict[str, Any] = {"model_dir": os.path.basename(os.path.normpath(model_dir)), "sizes": dataclasses.asdict(sizes),
                         "seed": seed, "model": {"d_model": cfg.d_model, "num_layers": cfg.num_layers,
                                                 "num_heads": cfg.num_heads, "d_k": cfg.head.d_k},
                         "data": data["about"], "machine": machine(), "about": about or {}}
  out["parity"] = parity(model_dir, enc, b["probe"], data["probe"], probe_base)
  lap("parity")
  out["heads"] = heads(enc, data["probe_batch"])
  out["rank"] = ranks(enc)
  lap("heads_rank")
  base_importance = enc.embed(b["importance"])
  out["importance"] = importance(enc, b["importance"], base_importance)
  lap("importance")
  out["pruning"] = pruning(enc, b["pairs"], data["pairs"], base, out["importance"])
  out["pruning_raw"] = pruning(enc, b["pairs"], data["pairs"], base, out["importance"], normalized=False)
  lap("pruning")
  out["kv"] = kv_settings(enc, b["pairs"], b["probe"], data["pairs"], base)
  if check:
    out["kv_check"] = check_real_models(model_dir, enc, b["probe"], 4, 128)
  lap("kv")
  out["seconds"] = seconds
  os.makedirs(out_dir, exist_ok=True)
  if plots:
    from attn.experiments.reading import pretrained_plots
    pretrained_plots.write_all(out, out_dir)
  lap("plots")
  out["seconds"]["total"] = round(time.perf_counter() - start, 1)
  with open(os.path.join(out_dir, RESULTS), "w", encoding="utf-8") as f:
    json.dump(out, f, indent=1)
  with open(os.path.join(out_dir, "report.md"), "w", encoding="utf-8") as f:
    f.write(report(out))
  return out


def smallest_cache(kv: list[dict[str, Any]], keep: float = KEEP) -> dict[str, Any] | None:
  """The setting with the fewest cache bytes whose mean embedding cosine is >= keep."""
  ok = [r for r in kv if r["cos_mean"] >= keep]
  return min(ok, key=lambda r: (r["cache_bytes"], -r["cos_mean"])) if ok else None


def report(out: dict[str, Any]) -> str:
  from attn.experiments.reading.pretrained_plots import report_markdown
  return report_markdown(out)
