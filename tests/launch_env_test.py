"""launch/env.sh: launch/train.sh's layer is jaxrl and its runtime dependencies, launch/test.sh's
adds the [test] extra (torch first); either script run after the other installs nothing it
already has, and a change to the packaging files installs again. Here the venv's python is a
stub that logs the pip commands it is given."""

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _repo(tmp_path: Path) -> Path:
  """The packaging files and launch/env.sh, with a venv whose python only logs its arguments."""
  repo = tmp_path / "repo"
  (repo / "launch").mkdir(parents=True)
  for name in ("setup.cfg", "pyproject.toml", "launch/env.sh"):
    shutil.copy(ROOT / name, repo / name)
  python = repo / ".venv" / "bin" / "python"
  python.parent.mkdir(parents=True)
  python.write_text('#!/bin/sh\necho "$*" >> "$(dirname "$0")/../pip.log"\n')
  python.chmod(0o755)
  return repo


def _source(repo: Path, layer: str) -> list[str]:
  """The pip commands `source launch/env.sh <layer>` ran, the repo's path written ROOT."""
  log = repo / ".venv" / "pip.log"
  log.unlink(missing_ok=True)
  subprocess.run(["bash", "-c", f'source "{repo}/launch/env.sh" {layer}'], check=True)
  return log.read_text().replace(str(repo), "ROOT").splitlines() if log.exists() else []


RUNTIME = ["-m pip install -q --upgrade pip", "-m pip install -q -e ROOT"]
TEST = [
  "-m pip install -q --upgrade pip",
  "-m pip install -q torch==2.13.0",
  "-m pip install -q -e ROOT[test]",
]


def test_train_then_test_installs_each_layer_once(tmp_path):
  repo = _repo(tmp_path)
  assert _source(repo, "runtime") == RUNTIME  # no torch, transformers, ruff or pytest
  assert _source(repo, "runtime") == []
  assert _source(repo, "test") == TEST
  assert _source(repo, "test") == _source(repo, "runtime") == []
  # A changed setup.cfg: each layer installs again, when its script runs.
  with open(repo / "setup.cfg", "a") as f:
    f.write("\n# changed\n")
  assert _source(repo, "runtime") == RUNTIME
  assert _source(repo, "test") == TEST


def test_test_then_train_installs_nothing_more(tmp_path):
  repo = _repo(tmp_path)
  assert _source(repo, "test") == TEST
  assert _source(repo, "runtime") == _source(repo, "") == []
