"""experiments/walkthrough.ipynb runs top to bottom in a real Jupyter kernel (the notebook extra)."""

import os
import re

import pytest

nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
import nbformat  # noqa: E402  (nbclient's own dependency)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "experiments", "walkthrough.ipynb")


def _text(nb) -> str:
  return "\n".join(o.get("text", "") + str(o.get("data", {}).get("text/plain", ""))
                   for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))


def test_committed_outputs_hold_no_temp_paths_and_every_cell_ran():
  nb = nbformat.read(NOTEBOOK, as_version=4)
  code = [c for c in nb.cells if c.cell_type == "code"]
  assert all(c.get("execution_count") for c in code) and all(c.get("outputs") for c in code)
  assert not re.search(r"/tmp/|/var/folders/|/home/|/root/|walkthrough-\w", _text(nb))
  assert not any(o.get("output_type") == "error" for c in code for o in c.outputs)


@pytest.mark.slow  # trains four small models: about a minute
def test_walkthrough_executes_with_a_real_kernel(monkeypatch):
  monkeypatch.delenv("XLA_FLAGS", raising=False)  # the kernel runs as a user's would, not at the tests' -O0
  nb = nbformat.read(NOTEBOOK, as_version=4)
  client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                   resources={"metadata": {"path": os.path.join(ROOT, "experiments")}})
  client.execute()  # raises CellExecutionError on any cell's error
  text = _text(nb)
  for claim in ("per_head vs fused: max relative difference", "two_stage vs its collapse",
                "split_input vs per_head", "merged W_h vs W_Q,h·W_K,hᵀ", "held-out accuracy"):
    assert claim in text
  diffs = [float(v) for v in re.findall(r"max relative difference ([0-9.e+-]+[0-9])", text)]
  assert len(diffs) == 5 and max(diffs[:4]) < 1e-5 and diffs[4] > 0.01  # four identities; one head differs
  assert sum(c.cell_type == "code" and any("image/png" in o.get("data", {}) for o in c.outputs)
             for c in nb.cells) == 2
