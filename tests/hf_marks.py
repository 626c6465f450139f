"""The `hf` mark: which tests use the hf extra (transformers, safetensors, tokenizers,
huggingface_hub, sentence-transformers), found in their code, so that .ci/run's hf-floor tier runs
those tests and not every test of a file that merely names transformers.

A test uses the extra when its code (not its docstring), the code of a fixture it requests, or the
code of a function it calls from its own module or from a helper module under tests/ (followed
through calls, to any depth) imports one of those packages, names one, or passes a module path
inside one as a string (`pytest.importorskip("transformers.models.x")`), or when its module holds
one of those packages at module level (a file that imports transformers at its top), or when it
lives in a checkpoint file (test_hf*.py, test_count_hf.py). Found in bytecode, so it sees what runs
and not what a comment says.
"""

import os
import types

import pytest

HF = frozenset({"transformers", "safetensors", "tokenizers", "huggingface_hub",
                "sentence_transformers"})
_TESTS = os.path.dirname(os.path.abspath(__file__))


def _hf_name(s: str) -> bool:
  return s.split(".")[0] in HF


def _local(obj) -> bool:
  """Whether obj (a function or module) was defined under tests/."""
  path = getattr(obj, "__file__", None) or getattr(getattr(obj, "__code__", None), "co_filename", "")
  return bool(path) and os.path.abspath(path).startswith(_TESTS + os.sep)


def _code_uses(code: types.CodeType, glb: dict, seen: set, doc=None) -> bool:
  if code in seen:
    return False
  seen.add(code)
  for c in code.co_consts:
    if isinstance(c, str) and c is not doc and _hf_name(c):
      return True
    if isinstance(c, types.CodeType) and _code_uses(c, glb, seen):
      return True
  for n in code.co_names:
    if _hf_name(n):  # an import (IMPORT_NAME holds the dotted path) or a global name
      return True
    v = glb.get(n)
    if isinstance(v, types.ModuleType):
      if _hf_name(v.__name__):
        return True
      if _local(v) and any(_uses(getattr(v, m, None), seen) for m in code.co_names):
        return True
    elif _uses(v, seen):
      return True
  return False


def _uses(fn, seen: set) -> bool:
  """Whether fn (a function defined under tests/, or anything else: False) uses the extra."""
  fn = getattr(fn, "__wrapped__", fn)
  if not isinstance(fn, types.FunctionType) or not _local(fn):
    return False
  return _code_uses(fn.__code__, fn.__globals__, seen, doc=fn.__doc__)


def _module_holds_hf(module) -> bool:
  return any(isinstance(v, types.ModuleType) and _hf_name(v.__name__)
             for v in vars(module).values())


def uses_hf(item) -> bool:
  """Whether a collected test item uses the hf extra (module docstring above)."""
  fn = getattr(item, "function", None)
  if fn is None:
    return False
  if item.module.__name__.startswith(("test_hf", "test_count_hf")) or _module_holds_hf(item.module):
    return True
  seen: set = set()
  if _uses(fn, seen):
    return True
  info = getattr(item, "_fixtureinfo", None)
  for defs in (info.name2fixturedefs.values() if info else ()):
    if any(_uses(d.func, seen) for d in defs):
      return True
  return False


@pytest.hookimpl(tryfirst=True)  # before -m deselects by it
def pytest_collection_modifyitems(config, items):
  for item in items:
    if uses_hf(item):
      item.add_marker(pytest.mark.hf)
