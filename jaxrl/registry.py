"""Named registries: advantage estimators, policy losses, off-policy and IS corrections, rewards.

One style for every extension point: `@REGISTRY.register(name, **traits)` on a function, then
`REGISTRY.get(name)`, `REGISTRY.names(**traits)` and `REGISTRY.traits(name)`. The registries live
here, at the bottom of the package, so that the config layer can check a name without importing
the modules that implement them: each registry knows the module that registers its built-in
entries and imports it on first lookup. An unknown name is an error listing the valid ones.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


class UnknownNameError(KeyError, ValueError):
  """An unknown registry name: a failed lookup (KeyError) and, from a config, a bad value."""

  def __str__(self) -> str:
    return str(self.args[0])  # KeyError's own __str__ would quote the message


class Registry:
  """name -> (function, traits). `builtins` is the module that registers the built-in entries."""

  def __init__(self, kind: str, *, builtins: str | None = None):
    self.kind = kind
    self._builtins = builtins
    self._fns: dict[str, Callable] = {}
    self._traits: dict[str, dict[str, Any]] = {}

  def register(self, name: str, **traits: Any) -> Callable[[Callable], Callable]:
    """Decorator registering `fn` as `name`, with traits the caller can filter on (e.g.
    needs_critic=True for an advantage estimator that reads a value model)."""
    if not isinstance(name, str) or not name:
      raise ValueError(f"{self.kind} name must be a non-empty str, got {name!r}")

    def deco(fn: Callable) -> Callable:
      if name in self._fns:
        raise ValueError(f"{self.kind} {name!r} is already registered (by {self._fns[name]!r})")
      self._fns[name] = fn
      self._traits[name] = dict(traits)
      return fn

    return deco

  def _load(self) -> None:
    if self._builtins is not None:
      module, self._builtins = self._builtins, None  # first: the module registers into us
      try:
        importlib.import_module(module)
      except BaseException:
        self._builtins = module
        raise

  def get(self, name: str) -> Callable:
    self._load()
    if name not in self._fns:
      raise UnknownNameError(f"unknown {self.kind} {name!r}; valid: {self.names()}")
    return self._fns[name]

  def traits(self, name: str) -> dict[str, Any]:
    self.get(name)
    return dict(self._traits[name])

  def names(self, **traits: Any) -> list[str]:
    """Sorted names, of the entries whose traits equal every given one (a missing trait is
    False)."""
    self._load()
    return sorted(
      n for n in self._fns if all(self._traits[n].get(k, False) == v for k, v in traits.items())
    )

  def __contains__(self, name: str) -> bool:
    self._load()
    return name in self._fns


ADVANTAGES = Registry("advantage estimator", builtins="jaxrl.rl.advantages")
POLICY_LOSSES = Registry("policy loss", builtins="jaxrl.rl.losses")
OFFPOLICY = Registry("off-policy correction", builtins="jaxrl.rl.offpolicy")
IS_CORRECTIONS = Registry("importance-sampling correction", builtins="jaxrl.rl.offpolicy")
REWARDS = Registry("reward", builtins="jaxrl.rewards")
