"""XLA_FLAGS for the test session and its child processes (imports no jax: tests/conftest.py
calls it before jax is imported)."""

import os
import re

# LLVM's code generation at level 1 with its costliest passes off: about a fifth less compile
# time than XLA's default, the same values on the suite's bit-exact checks (an episode sampled in
# a batch of 3 or of 6, pinned initial weights). Level 0 compiles faster still but rounds
# differently with the batch's shape, which those checks see.
QUICK_CODEGEN = ["--xla_backend_optimization_level=1", "--xla_llvm_disable_expensive_passes=true"]
_DEVICES = re.compile(r"--xla_force_host_platform_device_count=\S*")


def xla_flags(devices: int | None, base: str | None = None) -> str:
  """`base` (default: this process's XLA_FLAGS) with `devices` simulated CPU devices in place of
  any count it set (None: no count, XLA's one device), and LLVM's quick optimisation level
  unless `base` chose one. Every other flag (an ISA cap such as `--xla_cpu_max_isa=AVX2`) is
  kept, so child processes compile as the session does."""
  flags = _DEVICES.sub("", os.environ.get("XLA_FLAGS", "") if base is None else base).split()
  if not any(f.startswith("--xla_backend_optimization_level") for f in flags):
    flags += QUICK_CODEGEN
  if devices is not None:
    flags.append(f"--xla_force_host_platform_device_count={devices}")
  return " ".join(flags)
