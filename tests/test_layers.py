"""attn's packages in layers: no import, at module level or inside a function, runs from a lower
layer to a higher one (import cycles are listed by ../shared/tools/import_cycles.py)."""

import ast
import functools
import os

ATTN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "attn")

# Bottom up. A module may import its own layer and those below it. count sits above nn because it
# counts nn's models (ModelConfig); analysis below nn because the sentence models use its pooling.
LAYERS = [
    ("config", "process"),
    ("registry",),
    ("kernel",),
    ("variants", "api"),
    ("conversion",),
    ("analysis",),
    ("nn",),
    ("count",),
    ("testing",),
    ("experiments", "bench"),
    ("demo", "eval_cli"),
    ("cli", "__main__"),
]
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}


@functools.lru_cache(maxsize=None)
def _import_nodes(path: str) -> tuple[ast.Import | ast.ImportFrom, ...]:
  """Every import statement of the file, functions included: parsed once for all the tests here."""
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read())
  return tuple(n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)))


def _imports(path: str):
  """(line, top-level attn part) of every attn import in the file, functions included."""
  for node in _import_nodes(path):
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
      if rel in OLD_COMMAND_PATHS:  # re-exports of attn/cli/'s commands, kept for imports: below
        continue
      here = rel.split(os.sep)[0].removesuffix(".py")
      for line, name in _imports(path):
        if name in RANK and RANK[name] > RANK[here]:
          upward.append(f"attn/{rel}:{line} imports attn.{name}")
  assert upward == []


# The commands' old paths: each only re-exports its command from attn/cli/ (and library names it used to hold).
OLD_COMMAND_PATHS = {"count/cli.py", "experiments/cli.py", "experiments/reproduce_cli.py", "eval_cli.py"}


def test_no_library_module_imports_a_command():
  """Commands (attn/cli/, one module each) import the library; the library never imports a command."""
  reverse = []
  for root, _, files in os.walk(ATTN):
    for f in files:
      path = os.path.join(root, f)
      rel = os.path.relpath(path, ATTN)
      if not f.endswith(".py") or rel.split(os.sep)[0] in ("cli", "__main__.py") or rel in OLD_COMMAND_PATHS \
          or rel == "__init__.py":
        continue
      for node in _import_nodes(path):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("attn"):
          names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
          names = [a.name for a in node.names]
        else:
          continue
        if any(n == "attn.cli" or n.startswith("attn.cli.") or n.split(".")[-1] == "cli" for n in names):
          reverse.append(f"attn/{os.path.relpath(path, ATTN)}:{node.lineno}")
  assert reverse == []


def test_the_old_command_paths_only_re_export():
  """Each old path imports its command from attn/cli/ and library names, and defines nothing itself."""
  for rel in OLD_COMMAND_PATHS:
    tree = ast.parse(open(os.path.join(ATTN, rel), encoding="utf-8").read())
    body = [n for n in tree.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    assert body and all(isinstance(n, ast.ImportFrom) for n in body), rel
    assert any(n.module.startswith("attn.cli.") for n in body), rel


def test_every_command_is_one_thin_module_of_attn_cli():
  """COMMANDS names attn/cli/NAME.py for each command, one naming scheme; each about 100 lines at most (count's
  flags, one per HeadConfig field, and its examples take it to 120)."""
  from attn import cli
  for name, (module, _) in cli.COMMANDS.items():
    assert module == f"attn.cli.{name}", name
    with open(os.path.join(ATTN, "cli", name + ".py"), encoding="utf-8") as f:
      assert len(f.read().splitlines()) <= 125, name


# Faces imported from inside their own package, fixed on another branch of issue 50: each must still
# be one (the test fails once it is fixed, so that its line here goes too).
FACE_PENDING = {"attn/kernel/compressed.py": "attn.kernel"}  # the kernel's table (issue 50, attn/kernel/)


def _targets(path: str, module: str):
  """(line, the attn module or package an import binds) for every import in the file, functions included;
  `from pkg import sub` names the submodule sub where it is one."""
  base = module.rsplit(".", 1)[0] if not path.endswith("__init__.py") else module
  for node in _import_nodes(path):
    if isinstance(node, ast.Import):
      yield from ((node.lineno, a.name) for a in node.names)
    elif isinstance(node, ast.ImportFrom):
      mod = node.module or ""
      if node.level:
        parts = base.split(".")
        mod = ".".join(parts[: len(parts) - node.level + 1] + ([mod] if mod else []))
      for a in node.names:
        sub = f"{mod}.{a.name}"
        is_module = os.path.isfile(os.path.join(os.path.dirname(ATTN), *sub.split(".")) + ".py") or \
            os.path.isdir(os.path.join(os.path.dirname(ATTN), *sub.split(".")))
        yield node.lineno, sub if is_module else mod


def test_no_module_imports_the_face_of_a_package_it_is_inside():
  """`from attn.count import layer_table` inside attn/count/ (or `from attn import count`) runs up
  through the package's __init__; import the module that defines the name. attn's own face is the
  public API, defined lazily (PEP 562): a command imports it as a user's script does."""
  found = {}
  for root, _, files in os.walk(ATTN):
    for f in files:
      if not f.endswith(".py"):
        continue
      path = os.path.join(root, f)
      rel = os.path.relpath(path, os.path.dirname(ATTN))
      module = rel[:-3].replace(os.sep, ".").removesuffix(".__init__")
      for line, target in _targets(path, module):
        if target != "attn" and module.startswith(target + ".") and \
            os.path.isfile(os.path.join(os.path.dirname(ATTN), *target.split("."), "__init__.py")):
          found.setdefault(rel, []).append((line, target))
  assert {rel: hits[0][1] for rel, hits in found.items()} == FACE_PENDING, found
