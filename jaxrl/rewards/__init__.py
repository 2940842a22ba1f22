"""Reward functions for verifiable tasks, looked up by name (see `registry`)."""

# Imported for its side effect: registering the built-in rewards.
from jaxrl.rewards import (
  code,  # noqa: F401
  exact_match,  # noqa: F401
)
from jaxrl.rewards import math as _math  # noqa: F401
from jaxrl.rewards.registry import (
  RewardError,
  RewardFn,
  UnknownRewardError,
  compute_rewards,
  get,
  names,
  register,
)

__all__ = [
  "RewardError",
  "RewardFn",
  "UnknownRewardError",
  "compute_rewards",
  "get",
  "names",
  "register",
]
