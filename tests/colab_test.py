"""Every notebook in colab/ runs top to bottom on CPU, from the repository root, with the
kernel of this environment (the setup cell finds jaxrl importable and installs nothing), and
shows what it is for."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from xla_env import xla_flags

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "colab").glob("*.ipynb"))


def _text(cell) -> str:
  out = []
  for o in cell.outputs:
    out.append(o.get("text", "") + o.get("data", {}).get("text/plain", ""))
  return "".join(out)


def _check_quickstart(cells):
  assert any("image/png" in o.get("data", {}) for o in cells["curves"].outputs)  # the curves
  assert "accuracy_after_rl" in _text(cells["train"])


def _check_hf_checkpoint_sampling(cells):
  lines = [x for x in _text(cells["sample"]).splitlines() if x[:2] in ("0 ", "1 ")]
  assert len(lines) == 8  # 2 prompts x 4 samples
  assert "'prefill_prompts': 2" in _text(cells["sample"])  # one prefill per group


def _check_custom_reward(cells):
  assert "[1.0, 0.5, 0.0, 0.0]" in _text(cells["reward"])
  assert "(6, " in _text(cells["curves"])  # every RL step logged its reward


CHECKS = {
  "quickstart": _check_quickstart,
  "hf_checkpoint_sampling": _check_hf_checkpoint_sampling,
  "custom_reward": _check_custom_reward,
}


def test_every_notebook_has_its_check():
  assert sorted(p.stem for p in NOTEBOOKS) == sorted(CHECKS)


@pytest.mark.e2e
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, monkeypatch):
  nb = nbformat.read(path, as_version=4)
  # The kernel starts fresh: one CPU device, not the 8 simulated ones of the test session.
  monkeypatch.setenv("XLA_FLAGS", xla_flags(None))
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  client = NotebookClient(
    nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
  )
  client.execute()
  errors = [
    o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"
  ]
  assert not errors
  CHECKS[path.stem]({c.id: c for c in nb.cells})
