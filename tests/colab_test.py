"""Every notebook in colab/ runs top to bottom on CPU, from the repository root, with the
kernel of this environment (the setup cell finds jaxrl importable and installs nothing)."""

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "colab").glob("*.ipynb"))


def test_there_are_notebooks():
  assert any(p.name == "quickstart.ipynb" for p in NOTEBOOKS)


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, tmp_path, monkeypatch):
  nb = nbformat.read(path, as_version=4)
  # The kernel starts fresh: one CPU device, not the 8 simulated ones of the test session.
  monkeypatch.setenv("XLA_FLAGS", "")
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  client = NotebookClient(
    nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
  )
  client.execute()
  errors = [
    o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"
  ]
  assert not errors
  last = nb.cells[-1].outputs
  assert any("image/png" in o.get("data", {}) for o in last)  # the curves were drawn
  assert os.path.exists("/tmp/jaxrl_colab/summary.json")
