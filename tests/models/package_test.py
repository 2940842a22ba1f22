"""The model package's import structure: no cycles, and no module reaching into another's
private names (a lazy import inside a function counts as an import)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).parent.parent.parent / "jaxrl" / "models"


def _imports() -> dict[str, list[tuple[str, str]]]:
  """{module: [(imported jaxrl.models module, name), ...]} over every import statement."""
  out = {}
  for path in sorted(PACKAGE.glob("*.py")):
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxrl.models."):
        found += [(node.module.rsplit(".", 1)[1], alias.name) for alias in node.names]
    out[path.stem] = found
  return out


def test_no_module_imports_another_modules_private_names():
  private = [(m, src, name) for m, found in _imports().items() for src, name in found]
  assert [p for p in private if p[2].startswith("_")] == []


def test_the_model_package_has_no_import_cycles():
  graph = {m: {src for src, _ in found} for m, found in _imports().items()}
  assert graph["layers"] and "moe" not in graph["layers"]  # the cycle this test was written for
  state: dict[str, str] = {}

  def visit(m, stack):
    if state.get(m) == "open":
      raise AssertionError(f"import cycle: {' -> '.join([*stack, m])}")
    if state.get(m) == "done":
      return
    state[m] = "open"
    for dep in sorted(graph.get(m, ())):
      visit(dep, [*stack, m])
    state[m] = "done"

  for m in sorted(graph):
    visit(m, [])


def test_one_gqa_attention_serves_the_dense_and_paged_paths():
  import importlib

  from jaxrl.kernels import attention
  from jaxrl.models import layers

  # The module, not the function of the same name that jaxrl.kernels re-exports.
  paged_attention = importlib.import_module("jaxrl.kernels.paged_attention")

  assert layers.dot_attention is attention.dot_attention
  assert layers.softcap is attention.softcap
  for gone in ("masked_gqa", "headmajor_gqa"):  # the copies the one function replaced
    assert not hasattr(paged_attention, gone)
  paged_source = Path(paged_attention.__file__).read_text()
  assert "einsum" not in paged_source.split("def paged_attention_reference", 1)[1]
