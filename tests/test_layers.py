"""attn's packages in layers: no import, at module level or inside a function, runs from a lower
layer to a higher one (import cycles are listed by ../shared/tools/import_cycles.py)."""

import ast
import os

ATTN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "attn")

# Bottom up. A module may import its own layer and those below it. count sits above nn because it
# counts nn's models (ModelConfig); analysis below nn because the sentence models use its pooling.
LAYERS = [
    ("config", "process"),
    ("registry",),
    ("kernel",),
    ("variants", "api"),
    ("convert",),
    ("analysis",),
    ("nn",),
    ("count",),
    ("testing",),
    ("experiments", "bench"),
    ("demo", "eval_cli"),
    ("cli", "__main__"),
]
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}


def _imports(path: str):
  """(line, top-level attn part) of every attn import in the file, functions included."""
  for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
    if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "attn":
      parts = node.module.split(".")
      for name in ([parts[1]] if len(parts) > 1 else [a.name for a in node.names]):
        yield node.lineno, name
    elif isinstance(node, ast.Import):
      for a in node.names:
        if a.name.startswith("attn."):
          yield node.lineno, a.name.split(".")[1]


def test_every_part_of_the_package_has_a_layer():
  parts = {f[:-3] if f.endswith(".py") else f for f in os.listdir(ATTN)
           if (f.endswith(".py") or os.path.isfile(os.path.join(ATTN, f, "__init__.py")))
           and f != "__init__.py"}
  assert parts - set(RANK) == set(), "a new module or package at attn's root: give it a layer here"
  assert len([f for f in os.listdir(ATTN) if f.endswith(".py")]) <= 12  # the root holds at most 12 modules


def test_no_import_runs_up_the_layers():
  upward = []
  for root, _, files in os.walk(ATTN):
    for f in files:
      if not f.endswith(".py"):
        continue
      path = os.path.join(root, f)
      rel = os.path.relpath(path, ATTN)
      if rel == "__init__.py":  # the package's face imports from every layer
        continue
      here = rel.split(os.sep)[0].removesuffix(".py")
      for line, name in _imports(path):
        if name in RANK and RANK[name] > RANK[here]:
          upward.append(f"attn/{rel}:{line} imports attn.{name}")
  assert upward == []
