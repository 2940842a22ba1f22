"""Test session setup: 8 simulated CPU devices (set before jax is imported) and float32 matmuls."""

import os
import tempfile

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

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
  # tests/crash_rerun.py: a crashed xdist worker's fault is printed and its test run once more.
  import crash_rerun

  pluginmanager.register(crash_rerun, "jaxrl_crash_rerun")
