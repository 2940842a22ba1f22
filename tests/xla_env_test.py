"""tests/xla_env.py: the XLA_FLAGS the session and its children compile with."""

from xla_env import QUICK_CODEGEN, xla_flags


def test_children_keep_the_sessions_flags_with_their_own_device_count():
  session = "--xla_cpu_max_isa=AVX2 --xla_force_host_platform_device_count=8"
  assert xla_flags(None, session).split() == ["--xla_cpu_max_isa=AVX2", *QUICK_CODEGEN]
  assert xla_flags(2, session).split() == [
    "--xla_cpu_max_isa=AVX2",
    *QUICK_CODEGEN,
    "--xla_force_host_platform_device_count=2",
  ]


def test_a_chosen_optimisation_level_is_kept():
  chosen = "--xla_backend_optimization_level=3"
  assert xla_flags(None, chosen) == chosen
  assert xla_flags(8, "").split() == [*QUICK_CODEGEN, "--xla_force_host_platform_device_count=8"]
