"""Where the suite's time goes: XLA compiles, lowering and tracing per test (a pytest plugin
registered by tests/conftest.py, active when JAXRL_TEST_COMPILE_REPORT names a file).

  JAXRL_TEST_COMPILE_REPORT=/tmp/cr bash launch/test.sh --fast
  python tests/compile_report.py /tmp/cr            # per tier, the costliest modules and tests

Each pytest process (every xdist worker) appends one JSON line per test to FILE.<pid>: its tier,
its wall time (setup, call and teardown; a module fixture's job counts to the test that set it
up) and the seconds JAX reported for backend compiles (`/jax/core/compile/backend_compile_
duration`, with their count), for lowering to StableHLO and for tracing to a jaxpr, in that
process. Child processes (the CLI's runs, notebooks, multi-process jobs, libtpu's compiles) are
outside it: their tests show wall time only. Compiles that hit the persistent compilation cache
are not compiles. With both workers busy, a compile's wall time includes waiting for a core.
"""

from __future__ import annotations

import collections
import json
import os
import sys

import pytest

ENV = "JAXRL_TEST_COMPILE_REPORT"
_EVENTS = {
  "/jax/core/compile/backend_compile_duration": "compile_s",
  "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
  "/jax/core/compile/jaxpr_trace_duration": "trace_s",
}
_FIELDS = ("wall_s", "compile_s", "compiles", "lower_s", "trace_s")
_tests: dict[str, dict] = collections.defaultdict(lambda: dict.fromkeys(_FIELDS, 0.0))


def _base(nodeid: str) -> str:
  """The test's id without the "@group" that pytest-xdist's loadgroup appends."""
  return nodeid.rsplit("@", 1)[0]


def _current() -> str:
  return _base(os.environ.get("PYTEST_CURRENT_TEST", "(outside a test)").rsplit(" (", 1)[0])


def _listener(event: str, duration: float, **_) -> None:
  field = _EVENTS.get(event)
  if field is not None:
    row = _tests[_current()]
    row[field] += duration
    row["compiles"] += field == "compile_s"


_runs_tests = False  # this process runs the tests (a pytest-xdist controller only hears of them)


def pytest_configure(config):
  global _runs_tests
  _runs_tests = hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", 0)
  if os.environ.get(ENV) and _runs_tests:  # after tests/conftest.py has set up jax's environment
    import jax.monitoring

    jax.monitoring.register_event_duration_secs_listener(_listener)


def pytest_runtest_logreport(report):
  if os.environ.get(ENV) and _runs_tests:
    _tests[_base(report.nodeid)]["wall_s"] += report.duration


@pytest.hookimpl(trylast=True)  # after tests/conftest.py has marked every test with its tier
def pytest_collection_modifyitems(config, items):
  if os.environ.get(ENV):
    tiers = ("e2e", "integration", "unit")
    config._jaxrl_tiers = {
      _base(item.nodeid): next(t for t in tiers if item.get_closest_marker(t)) for item in items
    }


def pytest_sessionfinish(session):
  path = os.environ.get(ENV)
  if not path or not _tests:
    return
  tiers = getattr(session.config, "_jaxrl_tiers", {})
  with open(f"{path}.{os.getpid()}", "a") as f:
    for test, row in _tests.items():
      f.write(json.dumps({"test": test, "tier": tiers.get(test, "?"), **row}) + "\n")


def summarize(path: str, top: int = 15) -> str:
  """Totals per tier, then the `top` modules and tests by wall time, from every FILE.<pid>."""
  folder, stem = os.path.split(os.path.abspath(path))
  rows = collections.defaultdict(lambda: dict.fromkeys(_FIELDS, 0.0))
  tier_of = {}
  for name in sorted(os.listdir(folder)):
    if name.startswith(stem + "."):
      with open(os.path.join(folder, name)) as f:
        for line in f:
          r = json.loads(line)
          test = r["test"]
          for k in _FIELDS:
            rows[test][k] += r[k]
          if r["tier"] != "?":
            tier_of[test] = r["tier"]
  if not rows:
    return f"no {path}.<pid> files: run the tests with {ENV}={path}"

  def table(title, groups):
    out = [f"{title:<72} {'wall s':>8} {'compile s':>10} {'compiles':>9} {'lower s':>8}"]
    for name, g in groups:
      out.append(
        f"{name[-72:]:<72} {g['wall_s']:8.1f} {g['compile_s']:10.1f} {int(g['compiles']):9d} "
        f"{g['lower_s']:8.1f}"
      )
    return out

  def total(names):
    g = dict.fromkeys(_FIELDS, 0.0)
    for n in names:
      for k in _FIELDS:
        g[k] += rows[n][k]
    return g

  by_tier = collections.defaultdict(list)
  by_module = collections.defaultdict(list)
  for test in rows:
    by_tier[tier_of.get(test, "(setup outside a test)")].append(test)
    by_module[test.split("::")[0]].append(test)
  lines = table("tier (tests)", [(f"{t} ({len(n)})", total(n)) for t, n in sorted(by_tier.items())])
  modules = sorted(((m, total(n)) for m, n in by_module.items()), key=lambda x: -x[1]["wall_s"])
  lines += [""] + table("module", modules[:top])
  tests = sorted(rows.items(), key=lambda x: -x[1]["wall_s"])
  lines += [""] + table("test", tests[:top])
  return "\n".join(lines)


if __name__ == "__main__":
  if len(sys.argv) != 2:
    sys.exit(f"usage: python {sys.argv[0]} FILE  (the tests ran with {ENV}=FILE)")
  print(summarize(sys.argv[1]))
