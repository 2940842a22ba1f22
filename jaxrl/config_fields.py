"""What every config section is built from: the field spec, the error type and the check."""

from __future__ import annotations

import dataclasses


class ConfigError(ValueError):
  """A config value is missing, unknown, of the wrong type or out of range."""


def check(cond: bool, field: str, value, allowed: str) -> None:
  if not cond:
    raise ConfigError(f"config.{field}={value!r} is invalid; allowed: {allowed}")


# How a per-token loss becomes one number (jaxrl.rl.losses.aggregate implements each).
LOSS_AGGREGATIONS = (
  "token-mean",
  "seq-mean-token-mean",
  "seq-mean-token-sum",
  "seq-mean-token-sum-norm",
)


def option(default, *, lo=None, hi=None, lo_open=False, choices=None, registry=None, help=""):
  """A config field with its bounds, fixed choices or registry of valid names, and help."""
  meta = {"lo": lo, "hi": hi, "lo_open": lo_open, "choices": choices, "help": help}
  meta["registry"] = registry
  if isinstance(default, list | dict):
    return dataclasses.field(default_factory=lambda: default, metadata=meta)
  return dataclasses.field(default=default, metadata=meta)
