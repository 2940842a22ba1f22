"""tests/xla_env.py: the XLA_FLAGS the session and its children compile with."""

from xla_env import xla_flags


def test_children_keep_the_sessions_flags_with_their_own_device_count():
  session = "--xla_cpu_max_isa=AVX2 --xla_force_host_platform_device_count=8"
  assert xla_flags(None, session) == "--xla_cpu_max_isa=AVX2"
  assert xla_flags(2, session) == (
    "--xla_cpu_max_isa=AVX2 --xla_force_host_platform_device_count=2"
  )
  assert xla_flags(8, "") == "--xla_force_host_platform_device_count=8"
