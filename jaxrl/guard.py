"""Non-finite guard: count the optimizer updates the train step skipped, stop a run that keeps
producing them, and never write a checkpoint from a non-finite state.

The train step (`jaxrl.rl.train_step`) already skips an update whose loss, gradient or update is
not finite, leaving params and optimizer state as they were, and reports it as `opt/nonfinite`.
`NonFiniteGuard` folds those flags on the device (no host sync per update): the total, the
current run of consecutive skips and the longest such run since the last check. `check()`
fetches them, at the points where the caller fetches its metrics anyway, and raises
`NonFiniteError` once a run of `limit` consecutive skipped updates has happened.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl import distributed


class NonFiniteError(RuntimeError):
  """Training produced non-finite numbers too many updates in a row; the run stopped."""


@jax.jit
def _fold(counts: jax.Array, flag: jax.Array) -> jax.Array:
  total, streak, worst = counts[0], counts[1], counts[2]
  bad = flag > 0
  streak = jnp.where(bad, streak + 1, 0)
  return jnp.stack([total + bad.astype(counts.dtype), streak, jnp.maximum(worst, streak)])


@jax.jit
def tree_finite(tree) -> jax.Array:
  """A boolean scalar: every element of every leaf of `tree` is finite. Traceable (the train
  step's guard calls it inside jit); integer leaves are always finite."""
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


def all_finite(tree) -> bool:
  """Whether every element of every floating-point leaf of `tree` is finite (on the host: the
  checkpointer's check; leaves without a dtype are skipped)."""
  inexact = lambda x: hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)
  return bool(tree_finite([x for x in jax.tree.leaves(tree) if inexact(x)]))


class NonFiniteGuard:
  """Counts skipped updates of one phase; raises after `limit` in a row.

  `update(flag)` takes a step's `opt/nonfinite` (a device scalar, 1 = skipped) and stays on the
  device. `check(step)` fetches the counts and returns the total skipped so far, or raises
  `NonFiniteError` naming the phase, the step and what to change. A resumed run carries the
  total on (`resume`); the run of consecutive skips starts again at zero.
  """

  def __init__(self, limit: int, phase: str, hint: str = ""):
    if limit < 1:
      raise ValueError(f"limit must be >= 1, got {limit}")
    self.limit, self.phase, self.hint = limit, phase, hint
    self._counts = np.zeros((3,), np.int32)  # on the host until the first flag arrives

  def resume(self, total: int) -> None:
    """Continue from a checkpoint's count of skipped updates."""
    self._counts = np.asarray([int(total), 0, 0], np.int32)

  def update(self, flag) -> None:
    flag = jnp.asarray(flag, jnp.float32)
    if isinstance(self._counts, np.ndarray):  # placed where the flags live, once, explicitly
      self._counts = distributed.put(self._counts, flag.sharding)
    self._counts = _fold(self._counts, flag)

  def check(self, step: int) -> int:
    """The number of updates skipped so far; raises once `limit` were skipped in a row."""
    total, streak, worst = (int(v) for v in jax.device_get(self._counts))
    if worst >= self.limit:
      raise NonFiniteError(
        f"{self.phase} stopped at step {step}: {worst} consecutive optimizer updates had a "
        f"non-finite loss, gradient or update ({total} skipped in all, params and optimizer "
        f"state left unchanged by each; guard.max_nonfinite_updates={self.limit}). The "
        f"checkpoints on disk hold only finite states. {self.hint}".rstrip()
      )
    return total
