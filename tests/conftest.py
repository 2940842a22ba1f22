"""Test session setup: 8 simulated CPU devices (set before jax is imported) and float32 matmuls."""

import gc
import os
import tempfile

from xla_env import xla_flags

# (Other flags in XLA_FLAGS, such as an ISA cap, are kept: tests/xla_env.py.)
os.environ["XLA_FLAGS"] = xla_flags(devices=8)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# A persistent XLA compilation cache shared by the session's workers and every child process
# they start (set in the environment before jax is imported, so children inherit it): many
# tests build the same tiny models and trainers, and child runs (notebooks, the CLI, the
# multi-process workers, a run and its resumption) compile the programs the suite compiled, and
# on this CPU compiling is most of the suite's time. Entries are keyed on the program, the
# backend and the jax/XLA versions, so a hit is the very executable a fresh compile would give.
# JAXRL_TEST_XLA_CACHE=DIR puts it in DIR (an empty one: a cold start), =0 turns it off.
_cache = os.environ.get("JAXRL_TEST_XLA_CACHE") or os.path.join(
  tempfile.gettempdir(), f"jaxrl-test-xla-cache-{os.getuid()}"
)
if _cache != "0":
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.2"

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_addoption(parser, pluginmanager):
  # tests/crash_report.py: a crashed xdist worker's faulting stack is printed.
  import crash_report

  pluginmanager.register(crash_report, "jaxrl_crash_report")
  # tests/compile_report.py: compile, lowering and tracing seconds per test, on request.
  import compile_report

  pluginmanager.register(compile_report, "jaxrl_compile_report")
  # tests/fixtures.py: the shared smoke-config builder and tiny model.
  import fixtures

  pluginmanager.register(fixtures, "jaxrl_fixtures")


# XLA:CPU maps every executable it compiles or loads into the process (a few memory maps per
# object file), and an executable lives as long as the jitted function that compiled it: the
# suite's long-lived objects (test modules' cached engines and models, jitted helpers called at
# many shapes) keep thousands alive. The ~200 tests of tests/rollout and two kernel modules add
# ~13,000 maps to a process, and each worker of a whole-suite run passes 21,000 by two thirds of
# the suite. At the kernel's limit (vm.max_map_count, 65530 by default) the next compile or
# cache load aborts the process ("LLVM ERROR: Unable to allocate section memory!"): repeating
# those modules in one process aborted it in its seventh round, at ~60,000 maps, in
# `deserialize_executable`; the likely cause of the CI crash of 2026-12-06 ("worker 'gw1'
# crashed" late in the suite). After each test module, a process past a third of the limit drops
# JAX's in-memory caches, which frees every executable no live object holds; a later module
# reloads what it needs from the persistent cache above.
def _map_limit() -> int:
  try:
    with open("/proc/sys/vm/max_map_count") as f:
      return int(f.read())
  except (OSError, ValueError):
    return 65530


def _map_count() -> int:
  try:
    with open("/proc/self/maps", "rb") as f:
      return sum(1 for _ in f)
  except OSError:  # not Linux: no such limit to stay under
    return 0


_MAP_BUDGET = _map_limit() // 3


@pytest.fixture(autouse=True, scope="module")
def _release_executables():
  yield
  if _map_count() > _MAP_BUDGET:
    jax.clear_caches()
    gc.collect()


# The tiers (tests/README.md): a test marked `e2e` (whole jobs: config smokes, training runs,
# notebooks, the CLI's runs, multi-process runs, fault injection, installs, TPU compiles) is of
# that tier, even in a module marked `integration` (builds and steps an engine, a learner, a
# model); a test of neither mark is a unit test. The end-to-end tier runs first and the unit
# tier last, so that no long job ends the run on one worker while the other idles (though two
# heavy jobs side by side oversubscribe the two cores: tests/README.md). Tests that share a
# module-scoped fixture defined in their module (one expensive job asserted by several tests)
# carry one xdist_group (`--dist loadgroup`, launch/test.sh): the job runs once, on one worker.
TIERS = ("e2e", "integration", "unit")


def tier_of(item) -> str:
  return next((t for t in TIERS[:2] if item.get_closest_marker(t)), "unit")


def _shares_a_module_fixture(item) -> bool:
  module = getattr(item, "module", None)
  for defs in item._fixtureinfo.name2fixturedefs.values():
    fixture = defs[-1]
    if fixture.scope in ("module", "class") and module is not None:
      if getattr(fixture.func, "__module__", None) == module.__name__:
        return True
  return False


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
  for item in items:
    if tier_of(item) == "unit":
      item.add_marker(pytest.mark.unit)
    if _shares_a_module_fixture(item) and not item.get_closest_marker("xdist_group"):
      item.add_marker(pytest.mark.xdist_group(item.module.__name__))
  items.sort(key=lambda item: TIERS.index(tier_of(item)))


class _XdistGroups:
  """pytest-xdist's `--dist loadgroup` sends the tests of one `xdist_group` to one worker by
  suffixing their node ids with "@group" (`item._nodeid`); pytest 9 keeps a node's id in `_id`,
  so that suffix never reaches the scheduler and a group's tests were spread over both workers
  (each running the group's job). This sets it where pytest 9 reads it."""

  @pytest.hookimpl(trylast=True)  # after the groups are marked
  def pytest_collection_modifyitems(self, config, items):
    if not getattr(config.option, "loadgroup", False):  # set on the workers of a loadgroup run
      return
    from _pytest.nodeid import coerce_node_id

    for item in items:
      marks = item.iter_markers("xdist_group")
      names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in marks})
      suffix = "@" + "_".join(names)
      if names and not item.nodeid.endswith(suffix):
        item._id = coerce_node_id(item.nodeid + suffix)


def pytest_configure(config):
  config.pluginmanager.register(_XdistGroups(), "jaxrl_xdist_groups")
