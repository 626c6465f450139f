"""attn bench --account: every dot of the fused layer and the blocked core, its library, time and rate.

For each named XLA flag set (attn.bench.flags) a child process, started with
that XLA_FLAGS, compiles the fused layer's forward and forward+backward at the
reference shape (B=8, T=S=256, D=512, H=8, float32) and the blocked core's
forward+backward at T = 4096 (full, causal, causal window 256), and reads the
compiled HLO (compiled.as_text()): every dot with its operand shapes, how many
times one call runs it (once at the top level; once per visited block pair
inside the blocked core's nested loops) and the library that runs it, from
what holds it: a `__ynn_fusion` (YNNPACK), an `__xnn_fusion` (XNNPACK), a
oneDNN custom call or fusion, or a plain dot (XLA's DotThunk: Eigen's
contraction, oneDNN's sgemm inside on this jaxlib, seen in a perf profile).
Each distinct dot is then compiled alone with the same flags and timed
(fastest of the repeats: the machine may be shared); the call's own time less
the dots' is what the elementwise passes, copies and loop overhead take. The
2048³ matmul rate is measured in the same process.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

from attn import process
from attn.bench import flags as flags_lib

_COMP = re.compile(r"^(ENTRY )?%(\S+) .*\{$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\S+?\[[^\]]*\](?:\{[^}]*\})?|\((?:[^()]|\([^()]*\))*\)|\S+) (\S+?)\((.*)$")
_SHAPE = re.compile(r"^(\w+)\[([\d,]*)\]")
MATMUL_N = 2048
BIG_BYTES = 1 << 20  # elementwise passes listed from this output size up


def _shape(text: str) -> tuple[str, tuple[int, ...]] | None:
  m = _SHAPE.match(text)
  return None if m is None else (m.group(1), tuple(int(d) for d in m.group(2).split(",") if d))


def parse(hlo: str) -> tuple[str, dict[str, list[dict[str, Any]]]]:
  """(entry name, {computation: [instruction: name, shape, op, rest]}) of compiled HLO text."""
  comps: dict[str, list[dict[str, Any]]] = {}
  entry, cur = "", None
  for line in hlo.splitlines():
    m = _COMP.match(line)
    if m:
      cur = comps.setdefault(m.group(2), [])
      entry = m.group(2) if m.group(1) else entry
      continue
    m = _INSTR.match(line) if cur is not None else None
    if m:
      rest = re.sub(r", metadata=\{.*?\}(?=, [a-z_]+=|$)", "", m.group(4))
      cur.append({"name": m.group(1), "shape": _shape(m.group(2)), "op": m.group(3), "rest": rest})
  return entry, comps


def _attr(rest: str, key: str) -> str | None:
  m = re.search(rf"{key}=%?([\w.\-]+)", rest)
  return None if m is None else m.group(1)


def _dims(rest: str, key: str) -> tuple[int, ...]:
  m = re.search(rf"{key}=\{{([\d,]*)\}}", rest)
  return () if m is None else tuple(int(d) for d in m.group(1).split(",") if d)


def library_of_fusion(rest: str) -> str | None:
  """The library a kCustom fusion hands its computation to, from its backend_config."""
  m = re.search(r'"kind":"(__\w+)"', rest)
  if m is None:
    return None
  return {"__ynn_fusion": "YNNPACK fusion", "__xnn_fusion": "XNNPACK fusion",
          "__onednn_fusion": "oneDNN fusion"}.get(m.group(1), m.group(1))


def account(hlo: str, pairs: int | None = None, depth_of_pairs: int = 2) -> dict[str, list[dict[str, Any]]]:
  """The dots and big elementwise passes of compiled HLO, with their library and count per call.

  pairs: how many times a loop nested depth_of_pairs deep runs its body in one
  call (the blocked core's visited block pairs, two deep, or its slabs, one
  deep: blocked.block_steps); counts in shallower loops are unknown (None).
  """
  entry, comps = parse(hlo)
  dots, passes = [], []

  def walk(name: str, depth: int, library: str | None) -> None:
    shapes = {i["name"]: i["shape"] for i in comps.get(name, [])}
    count = 1 if depth == 0 else (pairs if depth >= depth_of_pairs else None)
    for ins in comps.get(name, []):
      op, rest = ins["op"], ins["rest"]
      if op == "dot":
        operands = re.findall(r"%([\w.\-]+)", rest.split(")")[0])[:2]
        lhs, rhs = (shapes.get(o) for o in operands)
        dots.append({"lhs": lhs[1] if lhs else None, "rhs": rhs[1] if rhs else None,
                     "out": ins["shape"][1] if ins["shape"] else None,
                     "dims": [_dims(rest, k) for k in ("lhs_batch_dims", "lhs_contracting_dims",
                                                       "rhs_batch_dims", "rhs_contracting_dims")],
                     "library": library or "XLA dot (Eigen, oneDNN sgemm)", "count": count, "depth": depth})
      elif op == "custom-call":
        m = re.search(r'custom_call_target="([^"]+)"', rest)
        target = m.group(1) if m else "?"
        d = {"lhs": None, "rhs": None, "out": ins["shape"][1] if ins["shape"] else None, "dims": None,
             "library": f"custom call {target}", "count": count, "depth": depth}
        if target in FFI_PRODUCTS:  # impl="onednn"'s products: timed alone like the dots
          operands = re.findall(r"%([\w.\-]+)", rest.split(")")[0])[:2]
          lhs, rhs = (shapes.get(o) for o in operands)
          d.update(lhs=lhs[1] if lhs else None, rhs=rhs[1] if rhs else None, ffi=target,
                   library="oneDNN sgemm (attn FFI, XLA's threads)",
                   transb="transb = true" in ins["rest"])
        dots.append(d)
      elif op == "fusion":
        lib = library_of_fusion(rest)
        if lib:
          walk(_attr(rest, "calls"), depth, lib)
        elif ins["shape"]:
          dtype, dims = ins["shape"]
          nbytes = math.prod(dims) * (2 if dtype in ("bf16", "f16") else 4)
          if nbytes >= BIG_BYTES:
            passes.append({"name": ins["name"], "out": dims, "bytes": nbytes, "count": count,
                           "kind": _attr(rest, "kind")})
      elif op == "while":
        walk(_attr(rest, "body"), depth + 1, library)
      elif op in ("call", "conditional"):
        for callee in re.findall(r"(?:to_apply|calls|branch_computations)=\{?%([\w.\-]+)", rest):
          walk(callee, depth, library)
  walk(entry, 0, None)
  return {"dots": dots, "passes": passes}


# attn.kernel.onednn's FFI products (attn/kernel/onednn_gemm.cc): what each contracts, as an index of lhs/rhs.
FFI_PRODUCTS = {"attn_onednn_nt": ("lhs", 3), "attn_onednn_nn": ("lhs", 3), "attn_onednn_tn": ("rhs", 3),
                "attn_onednn_bmm": ("lhs", 2)}


def dot_flops(d: dict[str, Any]) -> int:
  """2 × output elements × contracted size (an FFI product: × its contracted operand's size)."""
  if d.get("ffi"):
    if d["ffi"] == "attn_onednn_tn":  # Σ over the H query heads of (S×T)·(T×D): 2·B·H·T·S·D
      return 2 * math.prod(d["lhs"]) * d["rhs"][3]
    side, axis = FFI_PRODUCTS[d["ffi"]]
    return 2 * math.prod(d["out"]) * d[side][axis]
  lhs, (_, lc, _, _) = d["lhs"], d["dims"]
  return 2 * math.prod(d["out"]) * math.prod(lhs[i] for i in lc)


def _time(f: Callable[[], Any], repeats: int) -> tuple[float, float]:
  """(fastest, median) seconds of `repeats` calls after two warm-ups."""
  f(), f()
  ts = []
  for _ in range(repeats):
    t = time.perf_counter()
    f()
    ts.append(time.perf_counter() - t)
  ts.sort()
  return ts[0], ts[len(ts) // 2]


def time_dot(d: dict[str, Any], repeats: int) -> float:
  """Fastest time of the dot (or FFI product) alone, compiled with this process's flags."""
  a = jax.random.normal(jax.random.PRNGKey(0), d["lhs"], jnp.float32)
  b = jax.random.normal(jax.random.PRNGKey(1), d["rhs"], jnp.float32)
  if d.get("ffi"):
    from attn.kernel import onednn
    G = d["out"][2] if len(d["out"]) == 4 else None
    f = jax.jit({"attn_onednn_nt": onednn.nt, "attn_onednn_nn": onednn.nn,
                 "attn_onednn_tn": lambda a, b: onednn.tn(a, b, G),
                 "attn_onednn_bmm": lambda a, b: onednn.bmm(a, b, d["transb"])}[d["ffi"]])
  else:
    lb, lc, rb, rc = d["dims"]
    f = jax.jit(lambda a, b: jax.lax.dot_general(a, b, ((lc, rc), (lb, rb))))
  return _time(lambda: jax.block_until_ready(f(a, b)), repeats)[0]


def matmul_gflops(repeats: int = 5) -> float:
  a = jax.random.normal(jax.random.PRNGKey(0), (MATMUL_N, MATMUL_N), jnp.float32)
  f = jax.jit(lambda a: a @ a)
  return 2 * MATMUL_N ** 3 / _time(lambda: jax.block_until_ready(f(a)), repeats)[0] / 1e9


def cases(shape: dict[str, int]) -> dict[str, tuple[Callable, tuple, tuple[int, int] | None]]:
  """name -> (function, arguments, (block steps, their loop depth) or None) for every call covered.

  shape: the reference shape's B, T, D, H, K and the long family's T_long and window.
  """
  import attn
  from attn.kernel import blocked
  from attn.config import HeadConfig
  from attn.variants.base import Options
  B, T, D = shape["B"], shape["T"], shape["D"]
  cfg = HeadConfig(d_model=D, num_heads=shape["H"], d_k=shape["K"], d_v=shape["K"])
  fused = attn.get_variant("fused")
  params = fused.init(jax.random.PRNGKey(0), cfg, jnp.float32)
  x = jax.random.normal(jax.random.PRNGKey(1), (B, T, D), jnp.float32)
  ct = jax.random.normal(jax.random.PRNGKey(2), x.shape, jnp.float32)
  out = {}
  for impl in ("auto", "onednn"):
    if impl == "onednn" and attn.kernel.onednn.why_not() is not None:
      continue  # not installed here: the bench's table says why
    apply = lambda p, x, impl=impl: fused.apply(p, x, None, cfg=cfg, opts=Options(impl=impl))[0]
    loss = lambda p, x, ct, apply=apply: jnp.sum(apply(p, x) * ct)
    tag = "" if impl == "auto" else ', impl="onednn"'
    out[f"fused fwd, reference{tag}"] = (apply, (params, x), None)
    out[f"fused fwd+bwd, reference{tag}"] = (jax.grad(loss, argnums=(0, 1)), (params, x, ct), None)
  T, H, K, window_size = shape["T_long"], cfg.num_heads, cfg.d_k, shape["window"]
  keys = jax.random.split(jax.random.PRNGKey(3), 4)
  q, k, v, do = (jax.random.normal(kk, (1, T, H, K), jnp.float32) for kk in keys)
  for impl in ("blocked", "onednn"):
    if impl == "onednn" and attn.kernel.onednn.why_not() is not None:
      continue
    for label, causal, window in (("full", False, None), ("causal", True, None),
                                  (f"causal window {window_size}", True, window_size)):
      core = lambda q, k, v, do, c=causal, w=window, impl=impl: jnp.sum(
          attn.kernel.attention(q, k, v, is_causal=c, window=w, impl=impl) * do)
      steps = blocked.block_steps(T, T, is_causal=causal, window=window)
      tag = "" if impl == "blocked" else ', impl="onednn"'
      out[f"blocked core fwd+bwd, T={T} {label}{tag}"] = (jax.grad(core, argnums=(0, 1, 2)),
                                                         (q, k, v, do), steps)
  return out


def child(flag_set: str, repeats: int, shape: dict[str, int]) -> dict[str, Any]:
  """The account of every case under this process's XLA_FLAGS (run with attn.bench.flags' set)."""
  rate = matmul_gflops()
  result: dict[str, Any] = {"flag_set": flag_set, "xla_flags": os.environ.get("XLA_FLAGS", ""), "cases": {}}
  timed: dict[str, float] = {}
  for name, (f, args, steps) in cases(shape).items():
    compiled = jax.jit(f).lower(*args).compile()
    found = account(compiled.as_text(), *(steps or (None,)))
    fastest, median = _time(lambda: jax.block_until_ready(compiled(*args)), repeats)
    for d in found["dots"]:
      if (d["dims"] is None and not d.get("ffi")) or d["lhs"] is None:
        continue
      key = json.dumps([d["lhs"], d["rhs"], d["dims"], d.get("ffi"), d["out"]])
      if key not in timed:
        timed[key] = time_dot(d, max(repeats, 5))
      d["s"], d["flops"] = timed[key], dot_flops(d)
    result["cases"][name] = {"call_s": fastest, "call_median_s": median, **found}
  result["matmul_gflops"] = max(rate, matmul_gflops())
  return result


def run_flag_sets(names: list[str], repeats: int, shape: dict[str, int], log=print) -> list[dict[str, Any]]:
  """One child process per flag set, each with its XLA_FLAGS; their accounts."""
  out = []
  for name in names:
    env = flags_lib.with_flag_set(name)
    log(f"[account] flag set {name}: XLA_FLAGS={env['XLA_FLAGS']!r}")
    p = subprocess.run([sys.executable, "-m", "attn.bench.account", name, str(repeats), json.dumps(shape)],
                       env=env, capture_output=True, text=True)
    if p.returncode != 0:
      raise RuntimeError(f"flag set {name}: the child failed:\n{p.stderr[-2000:]}")
    out.append(json.loads(p.stdout.strip().splitlines()[-1]))
  return out


def _shape_text(d: dict[str, Any]) -> str:
  if d.get("ffi"):
    fmt = lambda s: "(" + ",".join(map(str, s)) + ")"
    return f"{d['ffi'][len('attn_onednn_'):]} {fmt(d['lhs'])}, {fmt(d['rhs'])} → {fmt(d['out'])}"
  lb, lc, _, rc = d["dims"]
  batch = "×".join(str(d["lhs"][i]) for i in lb)
  m = "×".join(str(s) for i, s in enumerate(d["lhs"]) if i not in lb and i not in lc)
  k = "×".join(str(d["lhs"][i]) for i in lc)
  n = "×".join(str(s) for i, s in enumerate(d["rhs"]) if i not in d["dims"][2] and i not in rc)
  return f"{batch + ' × ' if batch else ''}({m}×{k} · {k}×{n})"


def markdown(results: list[dict[str, Any]]) -> str:
  """A table per flag set and case: each dot's shape, library, count, time and rate; then the rest."""
  lines = []
  for r in results:
    rate = r["matmul_gflops"]
    lines += [f"### flag set `{r['flag_set']}` (XLA_FLAGS={r['xla_flags']!r}): {MATMUL_N}³ matmul "
              f"{rate:.0f} GFLOP/s", ""]
    for name, c in r["cases"].items():
      lines += [f"**{name}**: call {1e3 * c['call_s']:.1f} ms (fastest; median {1e3 * c['call_median_s']:.1f})",
                "", "| dot | library | × per call | ms each | ms per call | GFLOP/s | % mm |",
                "|---|---|---:|---:|---:|---:|---:|"]
      total = 0.0
      for d in c["dots"]:
        if "s" not in d:
          lines.append(f"| {d['out']} | {d['library']} | {d['count']} | – | – | – | – |")
          continue
        n = d["count"] or 0
        total += n * d["s"]
        g = d["flops"] / d["s"] / 1e9
        lines.append(f"| {_shape_text(d)} | {d['library']} | {d['count'] or '?'} | {1e3 * d['s']:.2f} "
                     f"| {1e3 * n * d['s']:.1f} | {g:.0f} | {100 * g / rate:.0f}% |")
      rest = c["call_s"] - total
      lines.append(f"| all dots | | | | {1e3 * total:.1f} | | |")
      lines.append(f"| the rest: elementwise passes, copies, loops | | | | {1e3 * rest:.1f} "
                   f"({100 * rest / c['call_s']:.0f}% of the call) | | |")
      big = sorted(c["passes"], key=lambda p: -p["bytes"] * (p["count"] or 1))[:6]
      if big:
        lines += ["", "Largest elementwise passes (output MB × per call): " + "; ".join(
            f"{p['name']} {p['out']} {p['bytes'] / 2**20:.1f} MB × {p['count'] or '?'}" for p in big)]
      lines.append("")
  return "\n".join(lines)


if __name__ == "__main__":
  process.setup()  # a process of the attn command: its allocator, as `attn bench` has (attn.process)
  print(json.dumps(child(sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]))))


def report(flag_sets: str | None, repeats: int, info: dict[str, Any], out: str | None, log: Callable[[str], None]) -> int:
  """`attn bench --account`: each flag set checked first, then measured; the header, the table, the JSON
  written to `out` where given."""
  from attn.bench import flags as flags_lib
  from attn.bench.shapes import LONG_WINDOW, SHAPES, names as read_names
  names = read_names(flag_sets, flags_lib.FLAG_SETS, "--flag-sets", flags_lib.FLAG_SETS)
  for name in names:
    flags_lib.with_flag_set(name)  # every flag set and the XLA_FLAGS it adds to checked before any child runs
  print(f"# attn bench --account\n\n{info.get('cpu_kind', info['cpu'])}, {info['cores']} cores; "
        + ", ".join(f"{k} {v}" for k, v in info["versions"].items() if v)
        + f"; load average at start {info['load_average']}; {repeats} repeats\n")
  ref = SHAPES["reference"]
  shape = {"B": ref.B, "T": ref.T, "D": ref.D, "H": ref.H, "K": ref.K, "T_long": 4096, "window": LONG_WINDOW}
  results = run_flag_sets(names, repeats, shape, log=log)
  print(markdown(results))
  if out:
    with open(out, "w") as f:
      json.dump({"machine": info, "account": results}, f, indent=1)
    log(f"wrote {out}")
  return 0
