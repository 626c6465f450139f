"""The plots and report.md of attn.experiments.reading.pretrained_heads, from its results dict only."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from attn.experiments.reading.plots import _pyplot

PLOTS = ("parity.png", "head_js.png", "sink_mass.png", "spectra.png", "effective_rank.png",
         "importance.png", "pruning.png", "kv_cache.png", "kv_layers.png")


def _heatmap(ax, m, title, fmt="{:.2f}", vmin=None, vmax=None, cmap="viridis", xlabel="head", ylabel="layer",
             yticks=None, annotate=True):
  m = np.asarray(m, float)
  im = ax.imshow(m, cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto")
  ax.set_xticks(range(m.shape[1]))
  ax.set_yticks(range(m.shape[0]))
  ax.set_yticklabels(yticks if yticks is not None else range(m.shape[0]))
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  ax.set_title(title, fontsize=10)
  lo, hi = im.get_clim()
  for (i, j), v in np.ndenumerate(m if annotate else np.zeros((0, 0))):
    ax.text(j, i, fmt.format(v), ha="center", va="center", fontsize=6.5,
            color="white" if v < lo + 0.6 * (hi - lo) else "black")
  return im


def parity(plt, out, path):
  p = out["parity"]
  n, d = np.array(p["per_sentence"]).T
  fig, ax = plt.subplots(figsize=(6, 3.6))
  ax.scatter(n, d, s=10)
  ax.set_ylim(0, 1.15 * d.max())
  ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
  ax.set_xlabel("sentence length (tokens, with [CLS] and [SEP])")
  ax.set_ylabel("max |attn − transformers|\nover the sentence's hidden states")
  ax.set_title(f"parity on {p['sentences']} padded sentences, float32: max {p['max_abs_diff_real_tokens']:.2g}",
               fontsize=10)
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def head_js(plt, out, path):
  layers = out["heads"]
  fig, axes = plt.subplots(2, 3, figsize=(14, 9.5))
  for l, (ax, a) in enumerate(zip(axes.ravel(), layers)):
    im = _heatmap(ax, a["head_js"], f"layer {l}: mean {a['diversity']:.3f} nats\nclosest pair {a['min_pair_js']:.3f}, "
                  f"farthest {a['max_pair_js']:.3f}", vmin=0, vmax=np.log(2), xlabel="head g", ylabel="head h",
                  annotate=False)
  fig.subplots_adjust(hspace=0.45, wspace=0.3)
  fig.colorbar(im, ax=axes, shrink=0.6, label="Jensen–Shannon divergence (nats; 0 = copies, log 2 = disjoint)")
  fig.suptitle("Head diversity: JS divergence between the attention rows of heads h and g, held-out sentences")
  fig.savefig(path, dpi=100, bbox_inches="tight")
  plt.close(fig)


def sink_mass(plt, out, path):
  layers = out["heads"]
  fig, axes = plt.subplots(1, 2, figsize=(13, 3.8))
  for ax, key, name in zip(axes, ("cls_mass", "sep_mass"), ("[CLS] (key 0)", "[SEP] (key length − 1)")):
    im = _heatmap(ax, [a[key] for a in layers], f"attention mass on {name}", vmin=0, vmax=1)
  fig.colorbar(im, ax=axes, shrink=0.8, label="mean weight over real query tokens")
  fig.savefig(path, dpi=110, bbox_inches="tight")
  plt.close(fig)


def spectra(plt, out, path):
  r = out["rank"]
  K = r["d_k"]
  fig, axes = plt.subplots(2, len(r["layers"]), figsize=(16, 6), sharey="row")
  colors = plt.cm.tab20(np.linspace(0, 1, 12, endpoint=False))
  for l, layer in enumerate(r["layers"]):
    for row, name in enumerate(("qk", "ov")):
      ax = axes[row, l]
      for h, sv in enumerate(layer[name]["singular_values"]):
        sv = np.asarray(sv)[:K]
        ax.semilogy(np.arange(1, K + 1), sv / sv[0], color=colors[h % 12], lw=1,
                    label=f"head {h}" if (row, l) == (0, 0) else None)
      ax.set_xticks([1, 8, 16, 24, 32])
      ax.set_title(f"layer {l}: W_{name.upper()}", fontsize=10)
      ax.set_xlabel("index i")
      ax.grid(alpha=0.3)
  low = min(min(np.asarray(sv)[:K][-1] / sv[0] for sv in layer[name]["singular_values"])
            for layer in r["layers"] for name in ("qk", "ov"))
  for ax in axes.ravel():
    ax.set_ylim(0.8 * low, 1.2)
  axes[0, 0].set_ylabel("σ_i / σ_1 of W_QK,h")
  axes[1, 0].set_ylabel("σ_i / σ_1 of W_OV,h")
  fig.legend(loc="center right", fontsize=8)
  fig.suptitle(f"Singular values of each head's D×D circuit (D = {out['model']['d_model']}): "
               f"rank ≤ d_k = {K}, one line per head")
  fig.tight_layout(rect=(0, 0, 0.93, 1))
  fig.savefig(path, dpi=100)
  plt.close(fig)


def effective_rank(plt, out, path):
  r = out["rank"]
  fig, axes = plt.subplots(1, 2, figsize=(13, 3.8))
  for ax, name in zip(axes, ("qk", "ov")):
    m = [layer[name]["effective_rank"] for layer in r["layers"]]
    im = _heatmap(ax, m, f"effective rank of W_{name.upper()},h (mean {np.mean(m):.1f} of d_k = {r['d_k']})",
                  fmt="{:.1f}", vmin=0, vmax=r["d_k"])
  fig.colorbar(im, ax=axes, shrink=0.8, label="effective rank (≤ d_k)")
  fig.savefig(path, dpi=110, bbox_inches="tight")
  plt.close(fig)


def importance(plt, out, path):
  imp = out["importance"]
  fig, axes = plt.subplots(1, 2, figsize=(13, 3.8))
  _heatmap(axes[0], np.asarray(imp["raw"]) * 1e3, "raw: mean drop in cosine when the head alone is off (×10⁻³)",
           fmt="{:.1f}")
  im = _heatmap(axes[1], imp["normalized"], "normalised per layer (ℓ2 over heads; Michel et al.)",
                vmin=0, vmax=1)
  fig.colorbar(im, ax=axes, shrink=0.8)
  fig.savefig(path, dpi=110, bbox_inches="tight")
  plt.close(fig)


def pruning(plt, out, path):
  curves = (("pruning", "Michel order (normalised per layer)", "C0"), ("pruning_raw", "raw-importance order", "C1"))
  fig, axes = plt.subplots(1, 3, figsize=(16, 4.4))
  for key, name, color in curves:
    p = out[key]
    k = np.asarray(p["heads_off"])
    axes[0].plot(k, p["spearman"], "o-", ms=3, color=color, label=f"{name}: {p['prunable_heads']} heads")
    axes[0].axvline(p["prunable_heads"], color=color, ls=":", lw=1)
    axes[1].plot(k, p["auc"], "o-", ms=3, color=color, label=f"{name}: {p['auc_prunable_heads']} heads")
    axes[2].plot(k, p["cos_mean"], "o-", ms=3, color=color, label=f"{name}, mean")
    axes[2].plot(k, p["cos_min"], "v--", ms=3, color=color, lw=0.8, label=f"{name}, min")
  p = out["pruning"]
  axes[0].axhline(1 - p["tolerance"], color="k", ls="--", lw=1, label=f"1 − {p['tolerance']}")
  axes[1].axhline(p["auc"][0] - p["tolerance"], color="k", ls="--", lw=1, label=f"unpruned − {p['tolerance']}")
  titles = ("Spearman: pruned vs unpruned pair cosines", "AUC: adjacent pairs above random pairs",
            "cosine to the unpruned embedding")
  N = len(out["pruning"]["order"])
  for ax, title, metric in zip(axes, titles, (("spearman",), ("auc",), ("cos_mean", "cos_min"))):
    low = min(min(out[key][m]) for key, _, _ in curves for m in metric)
    ax.set_ylim(max(0.0, np.floor(20 * low - 1) / 20), 1.005)
    ax.set_xticks(range(0, N + 1, max(1, N // 9)))
    ax.set_xlabel("heads gated off (least important first)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7.5, loc="lower left")
  fig.suptitle(f"Pruning {out['model_dir']}: {len(out['pruning']['order'])} heads, held-out sentence pairs",
               fontsize=11)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _label(r):
  return {"mha": f"MHA ({r['n']} kv heads)", "gqa": f"GQA G={r['n']}", "mla": f"mla d_c={r['n']}"}[r["setting"]]


def kv_cache(plt, out, path):
  kv = out["kv"]
  fig, axes = plt.subplots(1, 2, figsize=(14, 4.8), gridspec_kw={"width_ratios": [3, 2]})
  near = [r for r in kv if r["cos_mean"] >= 0.9]  # the zoomed panel: settings near the original
  for i, ax in enumerate(axes):
    for kind, marker in (("mha", "*"), ("gqa", "o"), ("mla", "s")):
      rows = [r for r in kv if r["setting"] == kind]
      ax.plot([r["cache_bytes"] for r in rows], [r["cos_mean"] for r in rows], marker + "-", ms=7,
              label={"mha": "original", "gqa": "mean-pooled kv heads", "mla": "latent (SVD)"}[kind])
    shown = kv if i == 0 else near
    for r in shown:
      if i == 0 and r in near and r["setting"] == "mla":
        continue  # labelled in the zoomed panel
      ax.annotate(_label(r).split(" (")[0], (r["cache_bytes"], r["cos_mean"]), fontsize=7.5,
                  xytext=(5, -11), textcoords="offset points")
    ax.axhline(0.99, color="k", ls="--", lw=1, label="cosine 0.99")
    ax.set_xscale("log", base=2)
    ticks = sorted({r["cache_bytes"] for r in shown})
    ax.set_xticks(ticks)
    ax.set_xticklabels([str(t) for t in ticks], rotation=45, fontsize=8)
    ax.minorticks_off()
    ax.set_xlabel(f"KV-cache bytes per token, all {out['model']['num_layers']} layers (bfloat16)")
    ax.grid(alpha=0.3)
  axes[0].set_ylim(min(0, min(r["cos_mean"] for r in kv)), 1.02)
  axes[0].set_ylabel("mean cosine to the original embedding")
  axes[0].legend(fontsize=8, loc="lower right")
  axes[0].set_title("every layer converted (held-out sentences)", fontsize=10)
  axes[1].set_xlim(0.85 * min(r["cache_bytes"] for r in near), 1.3 * max(r["cache_bytes"] for r in near))
  axes[1].set_ylim(np.floor(100 * min(r["cos_mean"] for r in near)) / 100 - 0.01, 1.005)
  axes[1].set_title("zoom: the settings with mean cosine ≥ 0.9", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def kv_layers(plt, out, path):
  kv = [r for r in out["kv"] if r["setting"] != "mha"]
  names = [_label(r) for r in kv]
  fig, axes = plt.subplots(1, 2, figsize=(13, 5))
  _heatmap(axes[0], [r["weight_error"] for r in kv], "relative weight error (attn.convert)",
           vmin=0, vmax=1, xlabel="layer", ylabel="", yticks=names)
  _heatmap(axes[1], [[1 - c for c in r["layer_cos"]] for r in kv],
           "1 − mean cosine to the original embedding, this layer alone converted", fmt="{:.3f}",
           vmin=0, xlabel="layer", ylabel="", yticks=names, cmap="magma")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def write_all(out: dict[str, Any], out_dir: str) -> list[str]:
  """Every PNG of PLOTS into out_dir; none without matplotlib."""
  plt = _pyplot()
  if plt is None:
    return []
  for name in PLOTS:
    globals()[name.removesuffix(".png")](plt, out, os.path.join(out_dir, name))
  return list(PLOTS)


def report_markdown(out: dict[str, Any]) -> str:
  """report.md: every number the write-up quotes, by section."""
  m, d, p = out["model"], out["data"], out["parity"]
  lines = [f"# Pretrained heads: {out['model_dir']}", "",
           f"{m['num_layers']} layers, D = {m['d_model']}, {m['num_heads']} heads of d_k = {m['d_k']}. "
           f"Machine: {out['machine']['cpu']}; Python {out['machine']['python']}, jax {out['machine']['jax']}. "
           f"Seconds: {out['seconds']}.", "",
           f"Sentences: {d['sentences']} from pydoc_data.topics ({d['heldout_sentences']} held-out in "
           f"{d['heldout_topics']} topics, {d['importance_sentences']} for importance in {d['importance_topics']} "
           f"topics); sizes {out['sizes']}; mean pair-sentence length {d['mean_tokens_pairs']:.1f} tokens.", "",
           "## Parity", "",
           f"{p['sentences']} padded sentences against transformers {p['transformers']} BertModel, float32: max |Δ| "
           f"of the final hidden states {p['max_abs_diff_real_tokens']:.3g} over real tokens, "
           f"{p['max_abs_diff_all_positions']:.3g} over every position (padding included)."]
  if "sentence_transformers" in p:
    s = p["sentence_transformers"]
    lines += ["", f"Pooled embedding against sentence-transformers {s['version']} encode(): max |Δ| "
              f"{s['max_abs_diff_embedding']:.3g}."]
  lines += ["", "## Heads", "", "| layer | diversity (nats) | closest pair | farthest pair | mean [CLS] mass | "
            "mean [SEP] mass | max [CLS] | max [SEP] | slice share W_Q / W_K / W_V |", "|---" * 9 + "|"]
  for l, a in enumerate(out["heads"]):
    ss = " / ".join(f"{np.mean(a['slice_share'][n]):.3f}" for n in "qkv")
    lines.append(f"| {l} | {a['diversity']:.3f} | {a['min_pair_js']:.3f} | {a['max_pair_js']:.3f} | "
                 f"{np.mean(a['cls_mass']):.3f} | {np.mean(a['sep_mass']):.3f} | {max(a['cls_mass']):.3f} | "
                 f"{max(a['sep_mass']):.3f} | {ss} |")
  r = out["rank"]
  lines += ["", "## Rank", "", f"d_k = {r['d_k']}; merged W_h: {r['merged_per_head']} weights per head against "
            f"{r['factored_per_head']} for W_Q,h and W_K,h; score weights per layer {r['score_weights']}.", "",
            "| layer | W_QK eff. rank (min–max) | W_QK numerical rank | W_QK top-8 energy | W_OV eff. rank (min–max) "
            "| W_OV numerical rank |", "|---" * 6 + "|"]
  for l, a in enumerate(r["layers"]):
    qk, ov = a["qk"], a["ov"]
    lines.append(f"| {l} | {np.mean(qk['effective_rank']):.1f} ({min(qk['effective_rank']):.1f}–"
                 f"{max(qk['effective_rank']):.1f}) | {min(qk['rank'])}–{max(qk['rank'])} | "
                 f"{np.mean(qk['top8_energy']):.2f} | {np.mean(ov['effective_rank']):.1f} "
                 f"({min(ov['effective_rank']):.1f}–{max(ov['effective_rank']):.1f}) | {min(ov['rank'])}–{max(ov['rank'])} |")
  imp, pr = out["importance"], out["pruning"]
  raw = np.asarray(imp["raw"])
  lines += ["", "## Importance and pruning", "",
            f"Leave-one-out drop in cosine: largest mean {raw.max():.4f} (layer {np.unravel_index(raw.argmax(), raw.shape)[0]}, "
            f"head {np.unravel_index(raw.argmax(), raw.shape)[1]}), smallest {raw.min():.2g}, median {np.median(raw):.2g}; "
            f"largest single-sentence drop {imp['max_drop']:.4f}. Gradient score |∂L/∂ξ| at ξ = 1: max "
            f"{imp['gradient_max_abs']:.2g} (zero up to round-off).", "",
            f"Pruning: {pr['prunable_heads']} of {m['num_layers'] * m['num_heads']} heads "
            f"({pr['prunable_fraction']:.3f}) go before the pair-ranking Spearman falls more than {pr['tolerance']} "
            f"(Michel order); {out['pruning_raw']['prunable_heads']} in raw-importance order. By the AUC of adjacent "
            f"over random pairs (within {pr['tolerance']} of the unpruned {pr['auc'][0]:.4f}, on the evaluated grid): "
            f"{pr['auc_prunable_heads']} (Michel order), {out['pruning_raw']['auc_prunable_heads']} (raw order).", "",
            "Michel order:", "",
            "| heads off | Spearman | AUC adjacent > random | mean cosine | min cosine |", "|---" * 5 + "|"]
  for i, k in enumerate(pr["heads_off"]):
    lines.append(f"| {k} | {pr['spearman'][i]:.4f} | {pr['auc'][i]:.4f} | {pr['cos_mean'][i]:.4f} | "
                 f"{pr['cos_min'][i]:.4f} |")
  rr = out["pruning_raw"]
  lines += ["", "Raw-importance order:", "", "| heads off | Spearman | AUC adjacent > random | mean cosine | min cosine |",
            "|---" * 5 + "|"]
  for i, k in enumerate(rr["heads_off"]):
    lines.append(f"| {k} | {rr['spearman'][i]:.4f} | {rr['auc'][i]:.4f} | {rr['cos_mean'][i]:.4f} | "
                 f"{rr['cos_min'][i]:.4f} |")
  lines += ["", "## Fewer kv heads, or a latent", "",
            f"| setting | KV bytes/token (bf16, {m['num_layers']} layers) | weight error per layer | cosine, one layer converted "
            "| mean cosine, all layers | min cosine | Spearman | AUC |", "|---" * 8 + "|"]
  for row in out["kv"]:
    lines.append(f"| {_label(row)} | {row['cache_bytes']} | {' '.join(f'{e:.3f}' for e in row['weight_error'])} | "
                 f"{' '.join(f'{c:.4f}' for c in row['layer_cos'])} | {row['cos_mean']:.4f} | {row['cos_min']:.4f} | "
                 f"{row['spearman']:.4f} | {row['auc']:.4f} |")
  if "kv_check" in out:
    lines += ["", f"Round trip against the real converted Encoders, max |Δ| of embeddings: {out['kv_check']}."]
  return "\n".join(lines) + "\n"
