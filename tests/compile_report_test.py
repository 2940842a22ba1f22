"""tests/compile_report.py: compile seconds land on the running test, and the summary adds up."""

import json

import compile_report


def test_events_land_on_the_running_test_and_the_summary_adds_them_up(tmp_path, monkeypatch):
  monkeypatch.setattr(
    compile_report, "_tests", type(compile_report._tests)(compile_report._tests.default_factory)
  )
  monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/a_test.py::test_x@grp (call)")
  compile_report._listener("/jax/core/compile/backend_compile_duration", 1.5)
  compile_report._listener("/jax/core/compile/backend_compile_duration", 0.5)
  compile_report._listener("/jax/core/compile/jaxpr_to_mlir_module_duration", 0.25)
  compile_report._listener("/jax/some/other/event", 9.0)  # not counted
  row = compile_report._tests["tests/a_test.py::test_x"]
  assert (row["compile_s"], row["compiles"], row["lower_s"], row["trace_s"]) == (2.0, 2, 0.25, 0)

  # Two workers' files: tiers summed over their tests, modules over theirs.
  rows = [
    {"test": "tests/a_test.py::test_x", "tier": "unit", "wall_s": 3.0, "compile_s": 2.0,
     "compiles": 2, "lower_s": 0.25, "trace_s": 0.0},
    {"test": "tests/a_test.py::test_y", "tier": "unit", "wall_s": 1.0, "compile_s": 0.5,
     "compiles": 1, "lower_s": 0.0, "trace_s": 0.0},
  ]  # fmt: skip
  other = {"test": "tests/b_test.py::test_z", "tier": "e2e", "wall_s": 10.0, "compile_s": 4.0,
           "compiles": 7, "lower_s": 1.0, "trace_s": 0.5}  # fmt: skip
  (tmp_path / "cr.11").write_text("".join(json.dumps(r) + "\n" for r in rows))
  (tmp_path / "cr.12").write_text(json.dumps(other) + "\n")
  text = compile_report.summarize(str(tmp_path / "cr")).splitlines()
  unit = next(line for line in text if line.startswith("unit (2)"))
  assert unit.split()[2:] == ["4.0", "2.5", "3", "0.2"]
  e2e = next(line for line in text if line.startswith("e2e (1)"))
  assert e2e.split()[2:] == ["10.0", "4.0", "7", "1.0"]
  module = next(line for line in text if line.startswith("tests/a_test.py "))
  assert module.split()[1:] == ["4.0", "2.5", "3", "0.2"]
  assert "no " in compile_report.summarize(str(tmp_path / "none"))
