"""Test session setup: 8 simulated CPU devices (set before jax is imported) and float32 matmuls."""

import gc
import os
import tempfile

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# A persistent XLA compilation cache shared by the session's workers: many tests build the same
# tiny models and trainers and so compile identical programs, and on this CPU compiling is most
# of the suite's time. Entries are keyed on the program, the backend and the jax/XLA versions,
# so a hit is the very executable a fresh compile would give. JAXRL_TEST_XLA_CACHE=0 turns it off.
_cache = os.environ.get("JAXRL_TEST_XLA_CACHE") or os.path.join(
  tempfile.gettempdir(), f"jaxrl-test-xla-cache-{os.getuid()}"
)
if _cache != "0":
  jax.config.update("jax_compilation_cache_dir", _cache)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)


def pytest_addoption(parser, pluginmanager):
  # tests/crash_report.py: a crashed xdist worker's faulting stack is printed.
  import crash_report

  pluginmanager.register(crash_report, "jaxrl_crash_report")


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
