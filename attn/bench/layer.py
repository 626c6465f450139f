"""attn bench: time every variant against flax, jax and torch attention, as ratios.

For each shape and each variant: forward and forward+backward (gradients for
the parameters and the input) wall times, the median of --repeats runs after
warm-up, all candidates of a shape timed round-robin so that load on a shared
machine hits them alike. FLOPs are analytic: variant.flops(cfg, T, S) · B for
the forward pass (a multiply-add is 2; softmax and masking are not counted; a
causal mask still counts the full T×S, as the kernel computes it), and 3× that
for forward+backward (each matmul's backward is two matmuls of its size).
GFLOP/s are divided by the rate of a 2048³ matmul in the same dtype, measured
in the same run, to give "% mm". Peak memory is XLA's buffer assignment for the
compiled forward+backward call: arguments + outputs + temporaries - aliased
bytes (compiled.memory_analysis()), not the process's resident set.

The long family (`--shapes long`: B=1, T = 1024, 4096, 16384, with and
without a causal mask) times attention cores behind the same projections:
attn's fused layer with the blocked kernel (the "fused" row) and with the
einsum kernel, jax.nn.dot_product_attention, and torch's
F.scaled_dot_product_attention; candidates whose XLA buffers would exceed half
the available memory are skipped with that reason (--variants does not apply
to the family). Causal long shapes also time the blocked core alone ("core",
no projections) against the same core with a sliding window of LONG_WINDOW
keys ("core_window", whose FLOPs count only the pairs inside the window);
those up to T = 4096 without a mask time the core alone too ("core_full"). The
candidates live in attn.bench.peers.

The linear family (`--shapes linear`: B=1, T = 1024, 2048, 4096, 8192, 16384, causal, the long
family's D=512, H=8, K=V=64) times each fixed-state head (gated_deltanet, kda, mamba2, linear, gla, or
those --variants names), its chunked form at its default chunk, against the fused layer with the
blocked softmax kernel, causal ("fused"), and reports the T from which each head is faster
forward+backward, and from which its XLA buffers are smaller (linear_crossover). Its FLOPs are
the heads' closed forms (attn.count). A fixed-state head in any other shape runs causal (no
dense mask), and is skipped at a shape without a causal mask.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

import attn
from attn import kernel, process
from attn.kernel import onednn
from attn.bench import peers as peers_lib
from attn.count import selectors
from attn.config import ConfigError, HeadConfig, invalid

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
PEERS = ("flax", "jax_dpa", "torch", "torch_sdpa", "torch_sdpa_flash",
         "torch_sdpa_cudnn")  # rows that other rows are divided by
PEER_LABELS = {"flax": "flax.nnx.MultiHeadAttention",
               "jax_dpa": "jax.nn.dot_product_attention",
               "torch": "torch.nn.MultiheadAttention",
               "torch_sdpa": "torch F.scaled_dot_product_attention",
               "torch_sdpa_flash": "torch SDPA, flash backend",
               "torch_sdpa_cudnn": "torch SDPA, cuDNN backend",
               "einsum": "fused, einsum kernel",
               "core": "blocked core alone, causal",
               "core_full": "blocked core alone, no mask",
               "core_window": "blocked core alone, causal window 256",
               "core_moba": "core with MoBA 512×4 (2048 keys), causal",
               "core_indexer": "core with the indexer, top 2048, causal",
               "core_nsa": "core with NSA (32/16, 16×64, window 512), causal",
               "selector_moba": "MoBA's choice of blocks alone (no gradient: f+b = fwd)",
               "selector_indexer": "the indexer's scores and top-k alone (no gradient: f+b = fwd)",
               "fused_onednn": 'fused, impl="onednn"',
               "core_onednn": 'blocked core alone, causal, impl="onednn"',
               "core_full_onednn": 'blocked core alone, no mask, impl="onednn"',
               "core_window_onednn": 'blocked core alone, causal window 256, impl="onednn"'}
RATIO_LABELS = {"flax": "× flax", "jax_dpa": "× jax dpa", "torch": "× torch",
                "torch_sdpa": "× torch SDPA", "torch_sdpa_flash": "× SDPA flash",
                "torch_sdpa_cudnn": "× SDPA cuDNN"}


@dataclasses.dataclass(frozen=True)
class Shape:
  """One benchmarked layer: batch, length, width, heads, head widths and a causal mask or none."""

  B: int
  T: int
  D: int
  H: int
  K: int
  causal: bool = False
  long: bool = False  # attention cores behind the fused projections (module docstring)
  linear: bool = False  # the fixed-state heads against the blocked softmax kernel (module docstring)

  @property
  def cfg(self) -> HeadConfig:
    return HeadConfig(d_model=self.D, num_heads=self.H, d_k=self.K, d_v=self.K)


SHAPES = {
    "reference": Shape(B=8, T=256, D=512, H=8, K=64),
    "causal": Shape(B=8, T=256, D=512, H=8, K=64, causal=True),
    "small": Shape(B=32, T=64, D=64, H=4, K=16),  # the experiment runner's default model
}
LONG_LENGTHS = (1024, 4096, 16384)
LONG_WINDOW = 256  # the sliding window of the long family's core_window row
# The key selections the long causal shapes time as cores (attn.variants.selection, nsa): ~2048 keys a
# query, the earlier measurement's MoBA and indexer, and NSA at the paper's sizes. Goal (issue 42):
# a selection's core at most SELECTION_GOAL × full causal at T = 16384.
SELECTIONS = {"moba": {"block": 512, "top_k": 4}, "indexer": {"heads": 4, "head_dim": 32, "top_k": 2048},
              "nsa": {"compress_block": 32, "compress_stride": 16, "select_block": 64, "select_count": 16,
                      "window": 512}}
SELECTION_GOAL = 0.2
# Selections whose choice of keys runs apart from their attention (NSA's choice is inside its branches):
# the bench also times the choice alone, which the goal reports beside the core, not in it.
SELECTORS_ALONE = ("moba", "indexer")
for _T in LONG_LENGTHS:
  for _causal in (False, True):
    SHAPES[f"long-{_T}{'-causal' if _causal else ''}"] = Shape(
        B=1, T=_T, D=512, H=8, K=64, causal=_causal, long=True)
LINEAR_LENGTHS = (1024, 2048, 4096, 8192, 16384)
for _T in LINEAR_LENGTHS:
  SHAPES[f"linear-{_T}"] = Shape(B=1, T=_T, D=512, H=8, K=64, causal=True, linear=True)
GROUPS = {"long": tuple(n for n in SHAPES if n.startswith("long-")),
          "linear": tuple(n for n in SHAPES if n.startswith("linear-"))}
# issue 44's accelerator goal: T = 4096, causal, 16 heads of 128 (run in bfloat16 on a GPU).
SHAPES["wide-4096-causal"] = Shape(B=1, T=4096, D=2048, H=16, K=128, causal=True, long=True)
DEFAULT_SHAPES = ("reference", "causal", "small")
QUICK_SHAPES = ("reference", "small")
SWEEP_CONFIG = "builtin"
# The runner's model and task for `--sweep` without a CONFIG: d_model 64, 2 layers, h = 1,
# per_head, 8-pair MQAR (the first trial of configs/quick.toml), so the measurement does not
# depend on the current directory.
SWEEP_TOML = """
[meta]
name = "bench: sweep throughput"
[task]
name = "mqar"
vocab_size = 64
seq_len = 32
num_pairs = 8
[model]
d_model = 64
num_layers = 2
num_heads = 1
d_ff = 128
tie_embeddings = false
variant = "per_head"
[train]
steps = 300
batch_size = 64
warmup_steps = 30
weight_decay = 0.0
eval_every = 50
[sweep]
derive = ["fixed_width"]
"""
NOISY_SPREAD = 0.25  # (max - min) / median of the matmul's times above which a table is flagged


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--shapes", default=None,
                      help=f"comma-separated, from {','.join([*SHAPES, *GROUPS])} (long: every "
                           f"long-*; linear: every linear-*, each fixed-state head's chunked form "
                           f"against the blocked softmax kernel, causal, and the T from which it "
                           f"wins; default: {','.join(DEFAULT_SHAPES)}; --quick: "
                           f"{','.join(QUICK_SHAPES)})")
  parser.add_argument("--variants", default=None,
                      help="comma-separated variant names (default: every registered variant)")
  parser.add_argument("--repeats", type=int, default=None,
                      help="timed runs per candidate; the median is reported (default 20, --quick 5)")
  parser.add_argument("--dtype", default="float32", help=f"one of {sorted(DTYPES)}")
  parser.add_argument("--out", default=None, help="also write the results as JSON to this file")
  parser.add_argument("--quick", action="store_true",
                      help="fewer shapes and repeats: a smoke run, not a measurement")
  parser.add_argument("--no-peers", action="store_true", help="skip flax, jax and torch")
  parser.add_argument("--impls", default=None,
                      help="also time the fused layer with each of these attention cores "
                           "(comma-separated from attn.kernel.IMPLS; rows fused[impl], \"auto\"'s "
                           "pick named), and torch SDPA pinned to its flash and cuDNN backends")
  parser.add_argument("--sweep", metavar="CONFIG", nargs="?", const=SWEEP_CONFIG, default=None,
                      help="also measure sweep throughput, trials per minute, sequential vs "
                           "seeds under vmap, on the first trial of CONFIG (default: a built-in "
                           "copy of the quick sweep's h=1 per_head trial)")
  parser.add_argument("--decode", action="store_true",
                      help="instead: per-token KV-cache decode time and cache bytes per variant "
                           "at contexts 256, 1024, 4096 (attn.bench.decode)")
  parser.add_argument("--steps", action="store_true",
                      help="instead: the default sweep's models, step time against stored ratios to "
                           "the matmul rate, in both trial orders, met or MISSED (attn.bench.steps)")
  parser.add_argument("--account", action="store_true",
                      help="instead: every dot of the fused layer (reference shape) and the blocked core "
                           "(T=4096), its library, time and rate, per XLA flag set (attn.bench.account)")
  parser.add_argument("--flag-sets", default=None,
                      help="with --account: comma-separated, from attn.bench.flags.FLAG_SETS (default: all)")
  parser.add_argument("--record", action="store_true",
                      help="with --steps: store this run's ratios as the reference (attn/bench/step_ratios.json)")
  parser.add_argument("--sweep-seeds", type=int, default=4, help="seeds trained for --sweep")
  parser.add_argument("--sweep-rounds", type=int, default=1,
                      help="for --sweep: rounds of sequential and vmap, alternated (order flipped each "
                           "round); medians reported")
  parser.add_argument("--sweep-steps", type=int, default=None,
                      help="training steps per trial for --sweep (default: the config's; --quick 20)")


def _names(text: str | None, known, field: str, default, groups=None) -> list[str]:
  groups = groups or {}
  if text is None:
    return list(default)
  names = []
  for n in (n.strip() for n in text.split(",") if n.strip()):
    if n not in known and n not in groups:
      raise invalid(field, n, f"comma-separated names from {sorted([*known, *groups])}")
    names.extend(groups.get(n, (n,)))
  if not names:
    raise invalid(field, text, "at least one name")
  return list(dict.fromkeys(names))


def cpu_kind() -> tuple[str, str]:
  """(model name, kind): the kind adds the family and the widest vector ISA from /proc/cpuinfo.

  Cloud guests name both a Zen 3 and a Zen 5 "AMD EPYC"; their step times differ by more than the
  stored ratios' tolerance, so stored ratios are kept per kind ("AMD EPYC, family 25, AVX2").
  """
  model, fields = platform.processor() or platform.machine(), {}
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if not line.strip():
          break  # the first processor is enough
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
  except OSError:
    pass
  model = fields.get("model name", model)
  flags = set(fields.get("flags", "").split())
  isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else None
  kind = ", ".join(x for x in (model, fields.get("cpu family") and f"family {fields['cpu family']}", isa) if x)
  return model, kind


def machine_info() -> dict[str, Any]:
  """CPU model and kind, cores, device and library versions, for the JSON and the header."""
  model, kind = cpu_kind()
  dev = jax.devices()[0]
  versions = {"python": platform.python_version(), "jax": jax.__version__}
  for lib in ("jaxlib", "flax", "numpy", "torch"):
    try:
      versions[lib] = __import__(lib).__version__
    except ImportError:
      versions[lib] = None
  return {"cpu": model, "cpu_kind": kind, "cores": os.cpu_count(), "threads": _threads(),
          "platform": platform.platform(), "device": f"{dev.platform}: {dev.device_kind}",
          "load_average": _load_average(),
          "versions": versions, "xla_flags": os.environ.get("XLA_FLAGS", ""),
          "host_malloc": process.in_force(), "backend": jax.default_backend(),
          "auto_order": list(kernel.AUTO.get(jax.default_backend(), kernel.AUTO["cpu"])),
          "onednn": onednn.why_not() or "available"}  # impl="onednn", or why it does not run here


def _threads() -> int:
  return peers_lib.threads()


def _load_average() -> list[float] | None:
  """1, 5 and 15 minute load averages: how busy the machine was."""
  try:
    return [round(x, 2) for x in os.getloadavg()]
  except OSError:
    return None


def _timer(fn: Callable[[], Any]) -> Callable[[], tuple[float, float]]:
  """Wraps a call that blocks until done into one returning (wall, process CPU) seconds."""
  def timed():
    c, t = time.process_time(), time.perf_counter()
    fn()
    return time.perf_counter() - t, time.process_time() - c
  return timed


def _variant_case(variant, shape: Shape, dtype, mask) -> dict[str, Any]:
  if variant.init_state is not None:  # a fixed-state head: causal by construction, no dense mask
    return peers_lib.variant_case(variant, shape.cfg, shape.B, shape.T, dtype, None, is_causal=True)
  return peers_lib.variant_case(variant, shape.cfg, shape.B, shape.T, dtype, mask)


def _linear_cases(shape: Shape, dtype, variants: list[str]) -> tuple[dict[str, Any], dict[str, str]]:
  """The fused layer with the blocked kernel, causal, and each fixed-state head among `variants`."""
  cases = {"fused": peers_lib.fused_case(shape.cfg, shape.B, shape.T, dtype, impl="blocked",
                                         is_causal=True)}
  skipped = {}
  for v in variants:
    variant = attn.get_variant(v)
    if variant.init_state is None:
      continue
    try:
      variant.check(shape.cfg)
    except ConfigError as e:
      skipped[v] = str(e)
      continue
    cases[v] = _variant_case(variant, shape, dtype, None)
  return cases, skipped


def _long_cases(shape: Shape, dtype, dtype_name: str,
                peers: bool) -> tuple[dict[str, Any], dict[str, str]]:
  """The fused layer with the blocked kernel, and the other cores behind the same projections."""
  cfg, B, T, causal = shape.cfg, shape.B, shape.T, shape.causal
  avail = peers_lib.available_bytes()
  budget = None if avail is None else avail // 2
  cases, skipped = {}, {}
  cases["fused"] = peers_lib.fused_case(cfg, B, T, dtype, impl="blocked", is_causal=causal)
  others = {"einsum": "einsum"} | ({"jax_dpa": "xla"} if peers else {})
  for name, impl in others.items():
    c = peers_lib.fused_case(cfg, B, T, dtype, impl=impl, is_causal=causal, max_bytes=budget)
    if "skip" in c:
      skipped[name] = c["skip"]
    else:
      cases[name] = c
  why = onednn.why_not(dtype)
  impls = {"": "blocked"} | ({"_onednn": "onednn"} if why is None else {})
  if why is not None:
    skipped["fused_onednn"] = f'impl="onednn" does not run here: {why}'
  for tag, impl in impls.items():
    if tag:  # the blocked core with its block matmuls on oneDNN (attn.kernel.onednn.bmm)
      cases["fused" + tag] = peers_lib.fused_case(cfg, B, T, dtype, impl=impl, is_causal=causal)
    if causal:
      cases["core" + tag] = peers_lib.core_case(cfg, B, T, dtype, is_causal=True, impl=impl)
      cases["core_window" + tag] = peers_lib.core_case(cfg, B, T, dtype, is_causal=True,
                                                       window=LONG_WINDOW, impl=impl)
      if not tag:
        for sel, o in SELECTIONS.items():
          cases[f"core_{sel}"] = peers_lib.selection_core_case(cfg.replace(extra={sel: o}), B, T, dtype)
          if sel in SELECTORS_ALONE:
            cases[f"selector_{sel}"] = peers_lib.selector_case(cfg.replace(extra={sel: o}), B, T, dtype)
    elif T <= 4096:  # the core alone without a mask, for causal ÷ full of the core (bench_targets.py)
      cases["core_full" + tag] = peers_lib.core_case(cfg, B, T, dtype, is_causal=False, impl=impl)
  if peers:
    torch_case = peers_lib.torch_sdpa_case(cfg, B, T, dtype_name, causal)
    if torch_case is not None:
      cases["torch_sdpa"] = torch_case
  return cases, skipped


def _round_robin(groups: list[dict[str, Callable[[], Any]]], repeats: int,
                 pause_s: float = 0.2) -> dict[str, dict[str, float]]:
  """Times each call once per round, group after group; medians and spread per call.

  Every call is warmed up twice first. A group is one framework: torch's and
  XLA's thread pools each spin for a while after a call, so switching between
  them call by call would make each wait on the other's threads; groups
  switch once per round, after a pause.
  """
  timers = [{k: _timer(f) for k, f in g.items()} for g in groups]
  for g in timers:
    for t in g.values():
      t()
      t()
    time.sleep(pause_s)
  samples = {k: [] for g in groups for k in g}
  for _ in range(repeats):
    for g in timers:
      for k, t in g.items():
        samples[k].append(t())
      if len(timers) > 1:
        time.sleep(pause_s)
  out = {}
  for k, s in samples.items():
    wall = [w for w, _ in s]
    out[k] = {"median_s": statistics.median(wall), "min_s": min(wall), "max_s": max(wall),
              "cpu_median_s": statistics.median([c for _, c in s])}
  return out


def core_flops_of(shape: Shape) -> dict[str, int]:
  """Forward FLOPs of the core rows: every T×S pair for "core", the pairs inside the window for "core_window"."""
  cfg, T = shape.cfg, shape.T
  per_pair = 2 * cfg.num_heads * (cfg.d_k + cfg.d_v) * shape.B
  pairs = sum(min(LONG_WINDOW, t + 1) for t in range(T))
  out = {"core": per_pair * T * T, "core_full": per_pair * T * T, "core_window": per_pair * pairs}
  for sel, o in SELECTIONS.items():  # the pairs it attends, plus its selector's own work
    on = cfg.replace(extra={sel: o})
    out[f"core_{sel}"] = shape.B * (2 * cfg.num_heads * (cfg.d_k + cfg.d_v) * selectors.pairs(on, T)
                                    + selectors.selector_flops(on, T))
    if sel in SELECTORS_ALONE:
      out[f"selector_{sel}"] = shape.B * selectors.selector_flops(on, T)
  return out


def _impl_cases(shape: Shape, dtype, dtype_name: str, impls: list[str],
                peers: bool) -> tuple[dict[str, Any], dict[str, str], dict[str, str]]:
  """The fused layer with each named core (is_causal, not a dense mask), "auto"'s pick, and torch
  SDPA pinned to its flash and cuDNN backends: (cases, skipped with the reason, picks)."""
  cases, skipped, picks = {}, {}, {}
  for impl in impls:
    name = f"fused[{impl}]"
    try:
      kernel.check_impl(impl, jnp.dtype(dtype))
      with kernel.record_picks() as seen:
        cases[name] = peers_lib.fused_case(shape.cfg, shape.B, shape.T, dtype, impl=impl,
                                           is_causal=shape.causal)
      picks[name] = ",".join(seen)
    except ConfigError as e:
      skipped[name] = f"refused: {e}"
    except Exception as e:  # a kernel failing to compile here: said, and the other rows still run
      skipped[name] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
  if peers:
    for backend in ("flash", "cudnn"):
      c = peers_lib.torch_sdpa_case(shape.cfg, shape.B, shape.T, dtype_name, shape.causal, backend)
      if c is None:
        skipped[f"torch_sdpa_{backend}"] = "torch is not installed, or K != V or G != H"
      elif "skip" in c:
        skipped[f"torch_sdpa_{backend}"] = c["skip"]
      else:
        cases[f"torch_sdpa_{backend}"] = c
  return cases, skipped, picks


def bench_shape(name: str, shape: Shape, variants: list[str], dtype_name: str, repeats: int,
                peers: bool, matmul_n: int = 2048, log=print,
                impls: list[str] | None = None) -> dict[str, Any]:
  """Times the variants and peers at one shape; rows carry times, rates and ratios."""
  dtype = DTYPES[dtype_name]
  mask = attn.causal_mask(shape.T) if shape.causal else None
  cases, skipped, picks = {}, {}, {}
  if shape.long:
    cases, skipped = _long_cases(shape, dtype, dtype_name, peers)
  if shape.linear:
    cases, skipped = _linear_cases(shape, dtype, variants)
  if impls:
    more, why, picks = _impl_cases(shape, dtype, dtype_name, impls, peers)
    cases.update(more)
    skipped.update(why)
  for v in [] if shape.long or shape.linear else variants:
    variant = attn.get_variant(v)
    try:
      variant.check(shape.cfg)
    except ConfigError as e:
      skipped[v] = str(e)
      continue
    if variant.init_state is not None and not shape.causal:
      skipped[v] = "a fixed-state head is causal only: it runs at the causal shapes"
      continue
    cases[v] = _variant_case(variant, shape, dtype, mask)
  if "fused" in cases and not (shape.long or shape.linear):
    # The fused layer again with impl="onednn" (attn.kernel.onednn: the core's products on oneDNN's sgemm).
    why = onednn.why_not(dtype)
    if why is None:
      cases["fused_onednn"] = peers_lib.fused_case(shape.cfg, shape.B, shape.T, dtype,
                                                   impl="onednn", mask=mask)
    else:
      skipped["fused_onednn"] = f'impl="onednn" does not run here: {why}'
  if peers and not (shape.long or shape.linear):
    cfg = shape.cfg
    cases["jax_dpa"] = peers_lib.fused_case(cfg, shape.B, shape.T, dtype, impl="xla", mask=mask)
    cases["flax"] = peers_lib.flax_case(cfg, shape.B, shape.T, dtype, mask)
    torch_case = peers_lib.torch_mha_case(cfg, shape.B, shape.T, dtype_name, shape.causal)
    if torch_case is not None:
      cases["torch"] = torch_case
  groups = [{}, {}]  # jax, torch
  for k, f in peers_lib.matmul_cases(dtype, dtype_name, matmul_n).items():
    groups[k == "torch"][f"mm:{k}"] = f
  for k, c in cases.items():
    groups[k.startswith("torch")].update({f"{k}:fwd": c["fwd"], f"{k}:fb": c["fb"]})
  groups = [g for g in groups if g]
  log(f"[{name}] timing {sum(map(len, groups))} calls x {repeats} rounds ...")
  times = _round_robin(groups, repeats)

  mm_flops = 2 * matmul_n ** 3
  matmul = {k[3:]: {"gflops": mm_flops / t["median_s"] / 1e9,
                    "spread": (t["max_s"] - t["min_s"]) / t["median_s"]}
            for k, t in times.items() if k.startswith("mm:")}
  rate = matmul["jnp"]["gflops"]
  fwd_flops = attn.get_variant("fused").flops(shape.cfg, shape.T, shape.T) * shape.B
  rows = []
  core_flops = core_flops_of(shape)
  for k, c in cases.items():
    flops = (attn.get_variant(k).flops(shape.cfg, shape.T, shape.T) * shape.B
             if k in attn.VARIANTS else core_flops.get(k.removesuffix("_onednn"), fwd_flops))
    row = {"name": k, "kind": "peer" if k in PEERS else "variant", "fwd_flops": flops,
           "peak_bytes": c["peak_bytes"], **({"ran": picks[k]} if k in picks else {})}
    for part, mult in (("fwd", 1), ("fb", 3)):
      t = times[f"{k}:{part}"]
      gflops = mult * flops / t["median_s"] / 1e9
      row[part] = {"ms": 1e3 * t["median_s"], "min_ms": 1e3 * t["min_s"],
                   "cpu_ms": 1e3 * t["cpu_median_s"], "gflops": gflops,
                   "pct_matmul": 100 * gflops / rate}
    rows.append(row)
  by_name = {r["name"]: r for r in rows}
  for r in rows:
    r["ratios"] = {p: {part: r[part]["ms"] / by_name[p][part]["ms"] for part in ("fwd", "fb")}
                   for p in PEERS if p in by_name}
  return {"shape": dataclasses.asdict(shape), "dtype": dtype_name, "repeats": repeats,
          "matmul": matmul, "rows": rows, "skipped": skipped, "picks": picks}


def linear_crossover(results: dict[str, Any]) -> dict[str, dict[str, int | None]]:
  """Per fixed-state head of the linear family: the least T from which it beats the blocked
  softmax layer ("fused") at every longer T measured, forward+backward wall time ("time"), process
  CPU time ("cpu": what load on a shared machine changes least) and XLA's buffers ("memory"); None
  where it does not win at the longest T."""
  by_T = {}
  for r in results.values():
    if r["shape"].get("linear"):
      by_T[r["shape"]["T"]] = {row["name"]: row for row in r["rows"]}
  heads = {n for rows in by_T.values() for n in rows if n != "fused"}
  out = {}
  for head in sorted(heads):
    wins = {"time": lambda h, f: h["fb"]["ms"] < f["fb"]["ms"],
            "cpu": lambda h, f: h["fb"]["cpu_ms"] < f["fb"]["cpu_ms"],
            "memory": lambda h, f: (h["peak_bytes"] or 0) < (f["peak_bytes"] or 0)}
    out[head] = {}
    for what, win in wins.items():
      since = None
      for T in sorted(by_T, reverse=True):
        rows = by_T[T]
        if head not in rows or "fused" not in rows or not win(rows[head], rows["fused"]):
          break
        since = T
      out[head][what] = since
  return out


def linear_markdown(results: dict[str, Any]) -> str:
  """The linear family in one table: forward+backward ms and peak MB per T, and where each head wins."""
  by_T = {r["shape"]["T"]: {row["name"]: row for row in r["rows"]}
          for r in results.values() if r["shape"].get("linear")}
  if not by_T:
    return ""
  Ts = sorted(by_T)
  names = list(dict.fromkeys(n for T in Ts for n in by_T[T]))
  cross = linear_crossover(results)
  cell = lambda row: "–" if row is None else f"{row['fb']['ms']:.0f} / {row['fb']['cpu_ms']:.0f} / {_mb(row['peak_bytes'])}"
  since = lambda T: "never" if T is None else f"T ≥ {T}"
  lines = ["Linear heads against the blocked softmax kernel (causal), forward+backward: wall ms / "
           "process CPU ms / peak MB (XLA's buffers), and the T from which each head is faster "
           "(wall; CPU) and smaller at every longer T measured.", "",
           "| layer | " + " | ".join(f"T={T}" for T in Ts) + " | faster from (wall; CPU) | smaller from |",
           "|---|" + "---:|" * (len(Ts) + 2)]
  for n in names:
    label = "blocked softmax (fused, causal)" if n == "fused" else n
    wins = cross.get(n)
    tail = (" | – | – |" if wins is None
            else f" | {since(wins['time'])}; {since(wins['cpu'])} | {since(wins['memory'])} |")
    lines.append(f"| {label} | " + " | ".join(cell(by_T[T].get(n)) for T in Ts) + tail)
  return "\n".join(lines)


def _mb(n):
  return "–" if n is None else f"{n / 2**20:.0f}"


def _ratio(r, peer):
  x = r["ratios"].get(peer)
  return "–" if x is None else f"{x['fwd']:.2f} / {x['fb']:.2f}"


def markdown(name: str, result: dict[str, Any]) -> str:
  """One shape's table: times, GFLOP/s, % of the matmul rate, ratios to the peers, memory."""
  s = result["shape"]
  mm = result["matmul"]
  mm_text = ", ".join(f"{k} {v['gflops']:.0f} GFLOP/s (spread {100 * v['spread']:.0f}%)"
                      for k, v in mm.items())
  names = {r["name"] for r in result["rows"]}
  peers = [p for p in PEERS if p in names]
  ratio_heads = "".join(f" {RATIO_LABELS[p]}{' (fwd / f+b)' if i == 0 else ''} |"
                        for i, p in enumerate(peers))
  lines = [
      f"### {name}: B={s['B']} T=S={s['T']} D={s['D']} H={s['H']} K=V={s['K']}"
      f"{' causal' if s['causal'] else ''}, {result['dtype']}, median of {result['repeats']}",
      "", f"Matmul rate in this run: {mm_text}.", "",
      "| layer | fwd ms | fwd % mm | fwd+bwd ms | fwd+bwd GFLOP/s | fwd+bwd % mm |"
      f"{ratio_heads} peak MB |",
      "|---|---:|---:|---:|---:|---:|" + "---:|" * (len(peers) + 1)]
  for r in result["rows"]:
    label = PEER_LABELS.get(r["name"], r["name"]) + (f" ({r['ran']})" if r.get("ran") else "")
    ratios = "".join(f" {_ratio(r, p)} |" for p in peers)
    lines.append(
        f"| {label} | {r['fwd']['ms']:.1f} | {r['fwd']['pct_matmul']:.0f}% | {r['fb']['ms']:.1f} "
        f"| {r['fb']['gflops']:.0f} | {r['fb']['pct_matmul']:.0f}% |{ratios} "
        f"{_mb(r['peak_bytes'])} |")
  for v, why in result["skipped"].items():
    lines.append(f"\n{v}: skipped, {why}")
  spread = max(v["spread"] for v in mm.values())
  if spread > NOISY_SPREAD:
    lines.append(f"\nWARNING: the machine was busy: the matmul's time varied by {100 * spread:.0f}% "
                 "of its median over the rounds, so ratios are rough; re-run on a quiet machine "
                 "(the JSON also holds min and process-CPU times).")
  return "\n".join(lines)


def causal_ratios(results: dict[str, Any]) -> dict[int, float]:
  """The fused layer's forward+backward time with a causal mask over without, per long T."""
  out = {}
  for T in LONG_LENGTHS:
    pair = [results.get(f"long-{T}{suffix}") for suffix in ("", "-causal")]
    if all(pair):
      fb = [{r["name"]: r for r in p["rows"]}["fused"]["fb"]["ms"] for p in pair]
      out[T] = fb[1] / fb[0]
  return out


def window_ratios(results: dict[str, Any]) -> dict[int, float]:
  """The blocked core's forward+backward time with a causal window of LONG_WINDOW over full causal, per T."""
  out = {}
  for T in LONG_LENGTHS:
    r = results.get(f"long-{T}-causal")
    if r:
      rows = {row["name"]: row for row in r["rows"]}
      out[T] = rows["core_window"]["fb"]["ms"] / rows["core"]["fb"]["ms"]
  return out


def selection_ratios(results: dict[str, Any]) -> dict[int, dict[str, dict[str, float]]]:
  """Each key selection's core over the full causal blocked core, per long causal T: forward and
  forward+backward time and peak memory."""
  out = {}
  for T in LONG_LENGTHS:
    r = results.get(f"long-{T}-causal")
    if r:
      rows = {row["name"]: row for row in r["rows"]}
      full = rows["core"]
      out[T] = {sel: {"fwd": rows[f"core_{sel}"]["fwd"]["ms"] / full["fwd"]["ms"],
                      "fb": rows[f"core_{sel}"]["fb"]["ms"] / full["fb"]["ms"],
                      "cpu_fb": rows[f"core_{sel}"]["fb"]["cpu_ms"] / full["fb"]["cpu_ms"],
                      "peak": (rows[f"core_{sel}"]["peak_bytes"] or 0) / (full["peak_bytes"] or 1),
                      **_less_selector(rows, sel, full)}
                for sel in SELECTIONS if f"core_{sel}" in rows}
  return out


def _less_selector(rows: dict[str, Any], sel: str, full: dict[str, Any]) -> dict[str, float]:
  """The selector's forward ÷ the full core's forward+backward, and the core's forward+backward less it
  (the attention over the chosen keys, the goal's "core"), where the bench timed the selector alone."""
  alone = rows.get(f"selector_{sel}")
  if alone is None:
    return {}
  return {"selector_fb": alone["fwd"]["ms"] / full["fb"]["ms"],
          "fb_less_selector": (rows[f"core_{sel}"]["fb"]["ms"] - alone["fwd"]["ms"]) / full["fb"]["ms"]}


def sweep_throughput(config_path: str, seeds: int, steps: int | None, rounds: int = 1) -> dict[str, Any]:
  """Trials per minute of the config's first trial over `seeds` seeds: one by one, and under vmap.

  Both go through the runner's train_group, compile included (the runner
  compiles once per shape, so a sweep pays it once per group), with the
  persistent compilation cache the runner turns on. With rounds > 1 the two
  alternate, the order flipped each round (sequential, vmap, vmap, sequential,
  ...) so that a change of load hits both; the figures are medians over rounds.
  """
  from attn.experiments.running import config as config_lib
  from attn.experiments.training import train
  for field, value in (("--sweep-seeds", seeds), ("--sweep-steps", steps), ("--sweep-rounds", rounds)):
    if value is not None and (isinstance(value, bool) or value < 1):
      raise invalid(field, value, "a positive integer")
  if config_path == SWEEP_CONFIG:
    trial = config_lib.loads(SWEEP_TOML, "builtin").trials[0]
  else:
    trial = config_lib.load(config_path).trials[0]
  configs = []
  for s in range(seeds):
    c = json.loads(json.dumps(trial.config))
    c["train"]["seed"] = s
    if steps is not None:
      c["train"]["steps"] = steps
    configs.append(c)
  cache = train.enable_compilation_cache()
  label = {k: v for k, v in trial.label.items() if k != "train.seed"}
  out = {"config": config_path, "trial": label, "seeds": seeds,
         "steps": configs[0]["train"]["steps"], "compilation_cache": cache, "rounds": []}
  modes = (("sequential", False), ("vmap", True))
  for r in range(rounds):
    this = {}
    for mode, vmap in modes if r % 2 == 0 else modes[::-1]:
      t0, c0 = time.perf_counter(), time.process_time()
      summaries = train.train_group(configs, on_row=lambda i, row: None, vmap=vmap)
      wall, cpu = time.perf_counter() - t0, time.process_time() - c0
      per_group = len(summaries) if vmap else 1  # under vmap every summary holds the group's times
      this[mode] = {"wall_s": wall, "cpu_s": cpu,  # cpu: user + sys of this process's threads
                    "compile_s": float(sum(s_.get("compile_s", 0.0) for s_ in summaries) / per_group),
                    "train_s": float(sum(s_.get("train_s", 0.0) for s_ in summaries) / per_group),
                    "status": sorted({s_["status"] for s_ in summaries}),
                    "loadavg": list(os.getloadavg())}
    out["rounds"].append(this)
  for mode, _ in modes:
    med = lambda key: statistics.median(r_[mode][key] for r_ in out["rounds"])
    wall, train_s = med("wall_s"), med("train_s")
    out[mode] = {"wall_s": wall, "cpu_s": med("cpu_s"), "trials_per_minute": 60 * seeds / wall,
                 "compile_s": med("compile_s"),
                 "train_s": train_s, "steady_trials_per_minute": 60 * seeds / max(train_s, 1e-9),
                 "walls_s": [r_[mode]["wall_s"] for r_ in out["rounds"]],
                 "cpus_s": [r_[mode]["cpu_s"] for r_ in out["rounds"]],
                 "status": sorted({x for r_ in out["rounds"] for x in r_[mode]["status"]})}
  out["vmap_speedup"] = out["sequential"]["wall_s"] / out["vmap"]["wall_s"]
  return out


def sweep_markdown(r: dict[str, Any]) -> str:
  rows = "\n".join(f"| {m} | {r[m]['wall_s']:.1f} | {r[m].get('cpu_s', float('nan')):.1f} | {r[m]['compile_s']:.1f} "
                   f"| {r[m]['trials_per_minute']:.1f} | {r[m]['steady_trials_per_minute']:.1f} |"
                   for m in ("sequential", "vmap"))
  walls = "; ".join(f"{m}: " + ", ".join(f"{w:.1f}" for w in r[m].get("walls_s", [])) for m in ("sequential", "vmap"))
  return (f"### sweep throughput: {r['config']} [{', '.join(f'{k}={v}' for k, v in r['trial'].items())}], "
          f"{r['seeds']} seeds x {r['steps']} steps, median of {len(r.get('rounds', [])) or 1} "
          f"alternated rounds (wall s per round, in order: {walls})\n\n"
          f"| mode | wall s | CPU s (user+sys) | compile s | trials / minute | without compile |\n"
          f"|---|---:|---:|---:|---:|---:|\n{rows}\n\n"
          f"Seeds under vmap: {r['vmap_speedup']:.2f}x the sequential throughput (wall).")


def run(args: argparse.Namespace) -> int:
  dtype = args.dtype
  if dtype not in DTYPES:
    raise invalid("--dtype", dtype, f"one of {sorted(DTYPES)}")
  shapes = _names(args.shapes, SHAPES, "--shapes", QUICK_SHAPES if args.quick else DEFAULT_SHAPES,
                  GROUPS)
  variants = _names(args.variants, attn.VARIANTS, "--variants", attn.VARIANTS)
  repeats = args.repeats if args.repeats is not None else (5 if args.quick else 20)
  impls = None if args.impls is None else _names(args.impls, kernel.IMPLS, "--impls", ())
  # An accelerator runs 2048³ in tens of microseconds, too short to time against the call's overhead.
  matmul_n = 2048 if jax.default_backend() == "cpu" else 8192
  if isinstance(repeats, bool) or repeats < 1:
    raise invalid("--repeats", repeats, "a positive integer")
  if args.account:  # the children's XLA_FLAGS extend this one: checked before JAX starts and reads it
    from attn.bench import flags as flags_lib
    flags_lib.check_xla_flags(os.environ.get("XLA_FLAGS", ""))
  info = machine_info()
  log = lambda text: print(text, file=sys.stderr, flush=True)
  if args.decode:
    return _run_decode(args, variants, repeats, info, log)
  if args.steps:
    return _run_steps(args, info, log)
  if args.account:
    return _run_account(args, repeats, info, log)
  print(f"# attn bench\n\n{info.get('cpu_kind', info['cpu'])}, {info['cores']} cores ({info['threads']} usable: XLA "
        f"and torch threads), {info['device']}; "
        + ", ".join(f"{k} {v}" for k, v in info["versions"].items() if v)
        + f"; load average at start {info['load_average']}; impl=\"onednn\": {info['onednn']}; "
        f"jax backend {info['backend']}, \"auto\" tries {', '.join(info['auto_order'])}\n")
  print("Times are medians (ms). % mm: analytic GFLOP/s over this run's matmul rate. "
        "× peer: this layer's time over the peer's (below 1 is faster). "
        "fwd+bwd FLOPs = 3 × forward.\n")
  results = {}
  for name in shapes:
    results[name] = bench_shape(name, SHAPES[name], variants, dtype, repeats,
                                not args.no_peers, log=log, impls=impls, matmul_n=matmul_n)
    print(markdown(name, results[name]) + "\n", flush=True)
  report = {"machine": info, "dtype": dtype, "repeats": repeats, "quick": args.quick,
            "shapes": results, "causal_ratio": causal_ratios(results),
            "window_ratio": window_ratios(results), "selection_ratio": selection_ratios(results),
            "linear_crossover": linear_crossover(results)}
  if "long-16384-causal" in shapes:  # issue 51's goals: each selection in its layout (attn.bench.selection)
    from attn.bench import selection as bench_selection
    report["selection_goals"] = bench_selection.goals(16384, log=log)
    print(bench_selection.goals_markdown(report["selection_goals"]) + "\n", flush=True)
  if report["causal_ratio"]:
    print("Long sequences, fused layer, forward+backward time causal ÷ non-causal: "
          + ", ".join(f"T={T} {x:.2f}" for T, x in report["causal_ratio"].items()) + "\n")
  if report["window_ratio"]:
    print(f"Long sequences, blocked core alone, forward+backward time with a causal window of "
          f"{LONG_WINDOW} ÷ full causal: "
          + ", ".join(f"T={T} {x:.3f}" for T, x in report["window_ratio"].items()) + "\n")
  for T, sel in report["selection_ratio"].items():
    print(f"Long sequences, T={T}: each key selection's core ÷ the full causal blocked core "
          f"(forward / forward+backward time, forward+backward process CPU time, peak memory; goal at "
          f"T=16384: forward+backward ≤ {SELECTION_GOAL}×): "
          + "; ".join(f"{n} {x['fwd']:.2f} / {x['fb']:.2f}, CPU {x['cpu_fb']:.2f}, peak {x['peak']:.2f}"
                      + ("" if "selector_fb" not in x else
                         f", of which the selector {x['selector_fb']:.2f}, the attention {x['fb_less_selector']:.2f}")
                      + ("" if T != 16384 else (" (goal met)" if x.get("fb_less_selector", x["fb"]) <= SELECTION_GOAL
                                                else " (goal not met)"))
                      for n, x in sel.items()) + "\n")
  if report["linear_crossover"]:
    print(linear_markdown(results) + "\n")
  if args.sweep:
    log("[sweep] training ...")
    steps = args.sweep_steps if args.sweep_steps is not None else (20 if args.quick else None)
    report["sweep"] = sweep_throughput(args.sweep, args.sweep_seeds, steps, args.sweep_rounds)
    print("\n" + sweep_markdown(report["sweep"]))
  if args.out:
    with open(args.out, "w") as f:
      json.dump(report, f, indent=1)
    log(f"wrote {args.out}")
  return 0


def _run_decode(args: argparse.Namespace, variants: list[str], repeats: int, info, log) -> int:
  from attn.bench import decode as bench_decode
  contexts = (64, 256) if args.quick else bench_decode.CONTEXTS
  print(f"# attn bench --decode\n\n{info.get('cpu_kind', info['cpu'])}, {info['cores']} cores, {info['device']}; "
        f"load average at start {info['load_average']}\n\nOne attention layer, D=512, H=8, "
        "d_k=d_v=64 (mla: d_c=256), B=1, float32, one token decoded at position L against a "
        "cache of L+1 slots (attn.bench.decode). Medians of ms per decoded token.\n")
  r = bench_decode.run_decode(variants, repeats, contexts, torch_peer=not args.no_peers,
                              round_robin=_round_robin, log=log)
  print(bench_decode.markdown(r))
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"machine": info, "repeats": repeats, "decode": r}, f, indent=1)
    log(f"wrote {args.out}")
  return 0


def _run_steps(args: argparse.Namespace, info, log) -> int:
  from attn.bench import steps as bench_steps
  n = 20 + bench_steps.SKIP if args.quick else 100
  print(f"# attn bench --steps\n\n{info.get('cpu_kind', info['cpu'])}, {info['cores']} cores; load average at start "
        f"{info['load_average']}; XLA_FLAGS={info['xla_flags']!r}\n")
  result = bench_steps.measure(n, log=log)
  stored = bench_steps.load_stored(info["cpu_kind"])
  found = bench_steps.checks(result, stored)
  print(bench_steps.markdown(result, found, stored))
  if args.record:
    bench_steps.record(result, info)
    log(f"recorded {bench_steps.STORED}")
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"machine": info, "steps": result, "checks": found}, f, indent=1)
    log(f"wrote {args.out}")
  return 0 if all(met for *_, met in found) else 1


def _run_account(args: argparse.Namespace, repeats: int, info, log) -> int:
  from attn.bench import account
  from attn.bench import flags as flags_lib
  names = _names(args.flag_sets, flags_lib.FLAG_SETS, "--flag-sets", flags_lib.FLAG_SETS)
  for name in names:
    flags_lib.with_flag_set(name)  # every flag set and the XLA_FLAGS it adds to checked before any child runs
  print(f"# attn bench --account\n\n{info.get('cpu_kind', info['cpu'])}, {info['cores']} cores; "
        + ", ".join(f"{k} {v}" for k, v in info["versions"].items() if v)
        + f"; load average at start {info['load_average']}; {repeats} repeats\n")
  ref = SHAPES["reference"]
  shape = {"B": ref.B, "T": ref.T, "D": ref.D, "H": ref.H, "K": ref.K, "T_long": 4096, "window": LONG_WINDOW}
  results = account.run_flag_sets(names, repeats, shape, log=log)
  print(account.markdown(results))
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"machine": info, "account": results}, f, indent=1)
    log(f"wrote {args.out}")
  return 0
