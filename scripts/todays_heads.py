"""Regenerates experiments/todays_heads_by_the_numbers/ (table, results.json, plot) from attn/count/hf_configs.

  PYTHONPATH=. python scripts/todays_heads.py

Every number is attn's count (attn.count.hf, the same as `attn count --hf NAME`);
the published totals below are quoted with their source. A stored config whose
family attn cannot read yet is listed as pending with the reader's message.
What each design saves is measured by counting the same config twice: with
the design, and with it undone (kv heads = query heads; every layer full
attention with RoPE; latent attention as per_head heads of the same widths).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from attn.count import hf as count_hf
from attn.config import ConfigError

OUT = os.path.join("experiments", "todays_heads_by_the_numbers")
LONG, SHORT = 131072, 8192
# name -> (published total, published active or None, where it is published: the number as quoted there). A total
# matches when it rounds to the published figure at the precision quoted ("8.03B": within 0.005B).
PUBLISHED = {
    "llama-3.1-8b": ("8.03B", None, "Hugging Face model page of meta-llama/Llama-3.1-8B (safetensors): \"8.03B params\""),
    "gemma-3-1b": ("999885952", None, "keras-hub gemma3_presets.py (keras-team/keras-hub), gemma3_1b: \"params\": 999885952"),
    "gemma-3-27b": ("27.016B", None, "Gemma 3 technical report (arXiv 2503.19786) Table 1: 27B = 1,416M "
                    "embedding + 25,600M non-embedding (+ 417M vision encoder, not in the text model)"),
    "smollm3-3b": ("3.08B", None, "Hugging Face model page of HuggingFaceTB/SmolLM3-3B (safetensors): \"3.08B params\""),
    "phi-4-mini": ("3.8B", None, "Phi-4-mini-instruct model card: \"3.8B parameters\""),
    "gpt-oss-20b": ("20.91B", "3.61B", "gpt-oss model card (arXiv 2508.10925) Table 1: 20.91B total, 3.61B active"),
    "gpt-oss-120b": ("116.83B", "5.13B", "gpt-oss model card (arXiv 2508.10925) Table 1: 116.83B total, 5.13B active"),
    "olmo-2-7b": ("7.3B", None, "Hugging Face model page of allenai/OLMo-2-1124-7B (safetensors): \"7.3B params\""),
    "deepseek-v3": ("671B", "37B", "DeepSeek-V3 technical report (arXiv 2412.19437): \"671B total parameters with 37B "
                    "activated for each token\" (the checkpoint's 685B adds the 14B multi-token-prediction module)"),
}


def parse(figure: str) -> tuple[float, float]:
  """A published figure ("8.03B", "999885952") as (value, half a unit of its last quoted digit)."""
  scale = 1e9 if figure.endswith("B") else 1
  digits = figure.rstrip("B")
  decimals = len(digits.split(".")[1]) if "." in digits else 0
  return float(digits) * scale, 0.5 * 10 ** -decimals * scale


def undo(hf: dict, gqa: bool, schedule: bool) -> dict:
  """The config with GQA undone (kv heads = query heads) and/or its layer schedule (all full, RoPE)."""
  hf = dict(hf)
  if gqa:
    hf["num_key_value_heads"] = hf["num_attention_heads"]
  if schedule:
    n = hf["num_hidden_layers"]
    hf["layer_types"] = ["full_attention"] * n
    hf.pop("no_rope_layers", None)
    hf.pop("sliding_window_pattern", None)
    hf["sliding_window"] = None
    hf["use_sliding_window"] = False
  return hf


def attention_params(report: dict) -> int:
  return sum(v for k, v in report["breakdown"].items() if k.startswith("attention"))


# Latent attention undone: the same heads (d_k, d_v, H) as per_head, caching every head's key and value.
NO_LATENT = {"variant": "per_head", "latent_dim": None, "q_latent_dim": None, "latent_norm_eps": None}


def measure(name: str, hf: dict, where: str) -> dict:
  report = count_hf.hf_report(hf, where, (SHORT, LONG), "bfloat16")
  latent = NO_LATENT if report["variant"] == "mla" else None
  mha = count_hf.hf_report(undo(hf, True, True), where, (LONG,), "bfloat16", changes=latent)
  gqa_full = count_hf.hf_report(undo(hf, False, True), where, (LONG,), "bfloat16")
  pub_total, pub_active, source = PUBLISHED[name]
  (total, tol), active = parse(pub_total), parse(pub_active)[0] if pub_active else None
  active_note = None
  if pub_active is not None:  # OpenAI and DeepSeek count the token-embedding lookup as inactive
    embed = report["breakdown"]["token_embeddings"]
    active_note = report["active_per_token"] - embed
  return {
      "name": name, "model_type": hf["model_type"], "variant": report["variant"], "total": report["total"],
      "active": report["active_per_token"],
      "active_without_embedding_lookup": active_note, "attention": attention_params(report),
      "attention_share": report["attention_share"],
      "score_weights": sum(r["score_weights_per_layer"] * r["layers"] for r in report["layer_types"]),
      "layer_types": [{k: r[k] for k in ("type", "layers", "window", "kv_bytes_per_token_per_layer")}
                      | {"kv_bytes_at": r["kv_bytes_at"]} for r in report["layer_types"]],
      "kv_bytes_at": report["kv_bytes_at"], "notes": report["notes"],
      "published_total": pub_total, "published_active": pub_active, "source": source,
      "matches": abs(report["total"] - total) <= tol,
      "active_matches": None if active is None else abs(active_note - active) <= parse(pub_active)[1],
      "kv_long_mha_full": mha["kv_bytes_at"][str(LONG)], "kv_long_gqa_full": gqa_full["kv_bytes_at"][str(LONG)],
      "attention_mha": attention_params(mha)}


def _gib(b: float) -> str:
  return f"{b / 2**30:,.2f}"


def _b(n: float) -> str:
  return f"{n / 1e9:,.3f}B"


def table(rows: list[dict]) -> str:
  lines = ["| model | total (attn) | published total | match | active/token (attn) | published active | attention "
           "params | attention share | W_Q·W_Kᵀ weights | KV at 8k, GiB (by type) | KV at 128k, GiB (by type) |",
           "|---|---:|---:|---|---:|---:|---:|---:|---:|---|---|"]
  for r in rows:
    by = lambda L: ", ".join(f"{t['type']}×{t['layers']}: {_gib(t['kv_bytes_at'][str(L)])}"  # noqa: E731
                             for t in r["layer_types"])
    active = _b(r["active"]) + (f" ({_b(r['active_without_embedding_lookup'])} without the embedding lookup)"
                                if r["active_without_embedding_lookup"] is not None else "")
    lines.append(f"| {r['name']} | {r['total']:,} | {r['published_total']} | {'yes' if r['matches'] else '**no**'}"
                 f" | {active} | {r['published_active'] or 'n/a'}"
                 f"{'' if r['active_matches'] is None else ' (match)' if r['active_matches'] else ' (**no**)'} | "
                 f"{r['attention']:,} | {r['attention_share']:.1%} | {r['score_weights']:,} | "
                 f"{_gib(r['kv_bytes_at'][str(SHORT)])} ({by(SHORT)}) | {_gib(r['kv_bytes_at'][str(LONG)])} ({by(LONG)}) |")
  return "\n".join(lines)


def savings(rows: list[dict]) -> str:
  lines = ["| model | design | KV at 128k, MHA all-full (GiB) | with its kv heads (GiB) | with its schedule too (GiB) "
           "| saved ×  | attention params (vs MHA) | bytes saved per attention param |",
           "|---|---|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    kinds = sorted({t["type"] for t in r["layer_types"]})
    gqa = r["kv_long_gqa_full"] < r["kv_long_mha_full"] and r["variant"] != "mla"
    design = ", ".join(filter(None, [
        f"GQA {r['kv_long_mha_full'] // max(r['kv_long_gqa_full'], 1)}:1" if gqa else "",
        "local/global" if any(t["window"] and t["window"] < LONG for t in r["layer_types"]) else "",
        "NoPE" if any("nope" in k for k in kinds) else "", "sinks" if r["model_type"] == "gpt_oss" else "",
        "latent (MLA)" if r["variant"] == "mla" else ""])) or "none (MHA)"
    saved = r["kv_long_mha_full"] - r["kv_bytes_at"][str(LONG)]
    lines.append(f"| {r['name']} | {design} | {_gib(r['kv_long_mha_full'])} | {_gib(r['kv_long_gqa_full'])} | "
                 f"{_gib(r['kv_bytes_at'][str(LONG)])} | {r['kv_long_mha_full'] / r['kv_bytes_at'][str(LONG)]:,.1f} | "
                 f"{r['attention']:,} ({r['attention'] / r['attention_mha']:.2f}×) | {saved / r['attention']:,.0f} |")
  return "\n".join(lines)


LABEL_LEFT = {"phi-4-mini"}  # 16 GiB at 128k, as llama-3.1-8b


def plot(rows: list[dict], path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(9, 5.5))
  for r in rows:
    x, y = r["attention"] / 1e9, r["kv_bytes_at"][str(LONG)] / 2**30
    x0, y0 = r["attention_mha"] / 1e9, r["kv_long_mha_full"] / 2**30
    ax.annotate("", (x, y), (x0, y0), arrowprops={"arrowstyle": "->", "color": "0.6"})
    ax.scatter([x0], [y0], marker="o", facecolors="none", edgecolors="0.5", s=40)
    ax.scatter([x], [y], s=50)
    left = r["name"] in LABEL_LEFT  # beside a neighbour at the same height: its label on the other side
    ax.annotate(r["name"], (x, y), textcoords="offset points", xytext=(-6 if left else 6, -4), fontsize=9,
                ha="right" if left else "left")
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.set_xlabel("attention parameters (billions, all layers)")
  ax.set_ylabel(f"KV cache per sequence at {LONG:,} tokens (GiB, bf16)")
  ax.set_title("KV cache at 128k: as built (dots) vs. the same model with MHA in every layer\n"
               "(open circles, with its MHA attention parameters; arrows: what GQA, local/global windows\n"
               "and DeepSeek-V3's latent attention save)", fontsize=10)
  ax.grid(True, which="both", alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main() -> int:
  rows, pending = [], {}
  for name, path in count_hf.stored_configs().items():
    hf, where = count_hf.read_hf_config(name)
    try:
      rows.append(measure(name, hf, os.path.relpath(where)))
    except ConfigError as e:
      pending[name] = str(e)
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
  os.makedirs(OUT, exist_ok=True)
  with open(os.path.join(OUT, "results.json"), "w") as f:
    json.dump({"commit": commit, "rows": rows, "pending": pending}, f, indent=2)
  plot(rows, os.path.join(OUT, "kv_vs_attention.png"))
  text = (f"<!-- generated by scripts/todays_heads.py at attn {commit} -->\n" + table(rows) + "\n\n" + savings(rows)
          + "\n\n" + "\n".join(f"- {r['name']}: {r['source']}." for r in rows)
          + "".join(f"\n- {n}: not counted, {m} ({PUBLISHED[n][2]})." for n, m in pending.items())
          + "\n<!-- /generated -->")
  readme = os.path.join(OUT, "README.md")
  old = open(readme).read() if os.path.exists(readme) else "<!-- generated -->\n<!-- /generated -->\n"
  new = re.sub(r"<!-- generated.*?<!-- /generated -->", lambda _: text, old, flags=re.S)
  with open(readme, "w") as f:
    f.write(new)
  print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
