"""The walk of `layer_type_table`'s argument through `attn count --hf`: its stops and its climbs back up.

  PYTHONPATH=. python scripts/count_walk.py            # this tree
  PYTHONPATH=/path/to/other/tree python scripts/count_walk.py --list   # another tree, every step shown

What it measures (issue 50: "following layer_type_table's argument through the code"):
one `attn count --hf DIR --format json` call (attn.cli.main, in this process) on a
tiny Gemma 3 config.json written to a temporary directory (6 layers: 5 sliding, 1
full; d_model 16), traced with sys.setprofile.

  followed  layer_type_table's argument: every attn.nn.config.ModelConfig the report
            (attn.count.hf.hf_report, from its call to its return) passes around (a
            `replace` makes a new one; all are followed). The walk is counting's: it
            leaves out what the command does before hf_report (argument parsing,
            imports building presets) and the reading of config.json into a
            ModelConfig (hf.config_for_count: the family's reader and the config's own
            validation, attn.nn's walk, not counting's).
  stop      a function of attn that receives a ModelConfig as one of its arguments
            (self included: ModelConfig's own methods are stops; a dataclass's generated
            __init__ counts as its class's, in its class's module). Each function counts
            once, at its first call: the stops in that order are the walk, what a
            reader following the config through the code visits.
  climb     a step of the walk from a stop in module A to the next stop in module B
            where B sits higher in attn's layering than A: B imports A, directly or
            through other attn modules (the static import graph, imports inside
            functions included, as /work/shared/tools/import_cycles.py reads it;
            `from pkg import sub` ties to the submodule). A step into a module that
            neither imports A nor is imported by it is sideways, not a climb.

Prints "stops N, climbs M" (and with --list each stop, its module and "^" where it climbs).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import json
import os
import sys
import tempfile

TINY_GEMMA3 = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "attention_bias": False,
    "head_dim": 4, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 16, "intermediate_size": 32,
    "max_position_embeddings": 128, "num_attention_heads": 4, "num_hidden_layers": 6, "num_key_value_heads": 1,
    "query_pre_attn_scalar": 4, "rms_norm_eps": 1e-6, "rope_local_base_freq": 10000, "rope_scaling": None,
    "rope_theta": 1000000, "sliding_window": 8, "sliding_window_pattern": 6, "vocab_size": 64,
}


def _modules(root: str) -> dict[str, str]:
  out = {}
  for d, _, files in os.walk(root):
    for f in files:
      if f.endswith(".py"):
        p = os.path.join(d, f)
        name = os.path.relpath(p, os.path.dirname(root))[:-3].replace(os.sep, ".")
        out[name[: -len(".__init__")] if name.endswith(".__init__") else name] = p
  return out


def import_graph(root: str) -> dict[str, set[str]]:
  """Module -> the attn modules it imports (anywhere in its file), as import_cycles.py reads them."""
  mods = _modules(root)
  graph: dict[str, set[str]] = {m: set() for m in mods}
  for name, path in mods.items():
    base = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
      if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom):
        mod = node.module or ""
        if node.level:
          parts = base.split(".")
          mod = ".".join(parts[: len(parts) - (node.level - 1)] + ([mod] if mod else []))
        targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod for a in node.names]
      else:
        continue
      for t in targets:
        while t and t not in mods:
          t = t.rsplit(".", 1)[0] if "." in t else ""
        if t and t != name:
          graph[name].add(t)
  return graph


def below(graph: dict[str, set[str]]) -> dict[str, set[str]]:
  """Module -> every attn module it imports, directly or through others."""
  out: dict[str, set[str]] = {}
  for start in graph:
    seen, todo = set(), list(graph[start])
    while todo:
      m = todo.pop()
      if m not in seen:
        seen.add(m)
        todo.extend(graph.get(m, ()))
    out[start] = seen
  return out


def walk(argv: list[str]) -> list[tuple[str, str]]:
  """(module, qualified name) of each stop, in order of first call, for attn.cli.main(argv)."""
  from attn import cli
  from attn.nn.config import ModelConfig
  from attn.count import hf
  stops: dict[tuple[str, str], None] = {}
  inside = [0, 0]  # the depths of hf_report's and of config_for_count's frames on the stack

  def profile(frame, event, arg):
    for i, f in enumerate((hf.hf_report, hf.config_for_count)):
      if frame.f_code is f.__code__ and event in ("call", "return"):
        inside[i] += 1 if event == "call" else -1
    if event != "call" or not inside[0] or inside[1]:
      return
    module = frame.f_globals.get("__name__", "")
    if not module.startswith("attn"):
      return
    code = frame.f_code
    n = code.co_argcount + code.co_kwonlyargcount
    local = frame.f_locals
    if any(isinstance(local.get(a), ModelConfig) for a in code.co_varnames[:n]):
      name = code.co_qualname
      if "__create_fn__" in name and n:  # a dataclass's generated method: its class's module and name
        cls = type(local.get(code.co_varnames[0]))
        module, name = cls.__module__, f"{cls.__qualname__}.{code.co_name}"
      stops.setdefault((module, name), None)

  out = io.StringIO()
  sys.setprofile(profile)
  try:
    with contextlib.redirect_stdout(out):
      rc = cli.main(argv)
  finally:
    sys.setprofile(None)
  if rc != 0:
    raise SystemExit(f"attn {' '.join(argv)} exited {rc}")
  json.loads(out.getvalue())  # the command printed its report
  return list(stops)


def measure(listing: bool = False) -> tuple[int, int]:
  import attn
  root = os.path.dirname(os.path.abspath(attn.__file__))
  under = below(import_graph(root))
  with tempfile.TemporaryDirectory() as d:
    with open(os.path.join(d, "config.json"), "w", encoding="utf-8") as f:
      json.dump(TINY_GEMMA3, f)
    stops = walk(["count", "--hf", d, "--format", "json"])
  climbs = 0
  for i, (module, name) in enumerate(stops):
    up = i > 0 and stops[i - 1][0] in under.get(module, ())
    climbs += up
    if listing:
      print(f"{'^' if up else ' '} {module}.{name}")
  return len(stops), climbs


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--list", action="store_true", help="print each stop; ^ marks a climb back up")
  args = parser.parse_args()
  n, climbs = measure(args.list)
  print(f"stops {n}, climbs {climbs}  (attn from {os.path.dirname(sys.modules['attn'].__file__)})")


if __name__ == "__main__":
  main()
