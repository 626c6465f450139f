"""The `hf` mark (tests/hf_marks.py): what it finds in a test's code and what it leaves."""

import pytest

import hf_hybrid
import hf_marks
import test_mark_hf as this


def _imports_it():
  import transformers  # noqa: F401  (never called: only its bytecode is read)


def _names_it_in_its_docstring():
  """transformers, safetensors and tokenizers named here only."""
  return 1


def _skips_by_a_module_path():
  pytest.importorskip("transformers.models.llama")


def _calls_a_helper_that_imports_it():
  return _imports_it()


def _an_inner_function_imports_it():
  def inner():
    import safetensors.numpy  # noqa: F401
  return inner


def _plain():
  return sorted([3, 1, 2])


@pytest.mark.parametrize("fn, expected", [
    (_imports_it, True), (_names_it_in_its_docstring, False), (_skips_by_a_module_path, True),
    (_calls_a_helper_that_imports_it, True), (_an_inner_function_imports_it, True),
    (_plain, False), (pytest.importorskip, False)],
    ids=lambda v: getattr(v, "__name__", str(v)))
def test_uses_reads_code_not_docstrings(fn, expected):
  assert hf_marks._uses(fn, set()) is expected


def test_a_helper_module_function_is_followed():
  """A function of a helper module under tests/ is read too: tests/hf_hybrid.py's round trip
  imports torch and calls attn, not transformers, so it is not marked; a local helper that skips
  by a transformers module path, called through that module's name, is."""
  assert not hf_marks._uses(hf_hybrid.assert_to_hf_and_back_exact, set())
  def calls_through_the_module():
    this._skips_by_a_module_path()
  assert hf_marks._code_uses(calls_through_the_module.__code__, {"this": this}, set())


def test_the_marked_tests_of_a_mixed_file():
  """test_moe compares with transformers in some tests and with numpy loops in others: only the
  first kind is marked (the rest need no run on the hf floor)."""
  import test_moe
  assert hf_marks._uses(test_moe.test_against_mixtral_sparse_moe_block, set())
  assert not hf_marks._uses(test_moe.test_dense_moe_against_a_numpy_loop, set())
