"""XLA_FLAGS for the test session and its child processes (imports no jax: tests/conftest.py
calls it before jax is imported)."""

import os
import re

_DEVICES = re.compile(r"--xla_force_host_platform_device_count=\S*")


def xla_flags(devices: int | None, base: str | None = None) -> str:
  """`base` (default: this process's XLA_FLAGS) with `devices` simulated CPU devices in place of
  any count it set (None: no count, XLA's one device). Every other flag (an ISA cap such as
  `--xla_cpu_max_isa=AVX2`) is kept, so child processes compile as the session does.

  The suite compiles with XLA's default code generation, as users' runs do. LLVM at level 1
  without its expensive passes compiled a fifth faster, but on XLA's AVX2 path it moved a
  gradient that must vanish (an identical teacher's distillation loss) from below 1e-5 to
  1.3e-5; level 0 (a third faster) rounded an episode differently with its batch's shape."""
  flags = _DEVICES.sub("", os.environ.get("XLA_FLAGS", "") if base is None else base).split()
  if devices is not None:
    flags.append(f"--xla_force_host_platform_device_count={devices}")
  return " ".join(flags)
