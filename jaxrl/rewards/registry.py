"""Reward functions by name, and a batch evaluator that isolates a failing reward."""

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxrl.registry import REWARDS, UnknownNameError

# fn(completion, record) -> reward. `record` is the task's dataset record (prompt, answer, ...).
RewardFn = Callable[[str, dict[str, Any]], float]

_ON_ERROR = ("raise", "zero")
UnknownRewardError = UnknownNameError  # a failed lookup (KeyError) and a bad config (ValueError)


class RewardError(RuntimeError):
  """A reward function raised or returned something other than a finite number."""


class _WorkerError(Exception):
  """What a reward worker reported (the exception's type and message, or a timeout)."""

  def __str__(self) -> str:
    return self.args[0]


def register(name: str) -> Callable[[RewardFn], RewardFn]:
  """Decorator that registers a reward function under `name` (in jaxrl.registry.REWARDS)."""
  return REWARDS.register(name)


def names() -> tuple[str, ...]:
  """The registered reward names, sorted."""
  return tuple(REWARDS.names())


def get(name: str) -> RewardFn:
  """The reward function registered as `name`."""
  return REWARDS.get(name)


_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _checked_value(value: Any, max_abs: float | None) -> float:
  # numbers.Real covers int/float/bool and numpy scalars; arrays and None are rejected.
  if not isinstance(value, numbers.Real):
    raise TypeError(f"reward must be a real number, got {type(value).__name__}: {value!r}")
  value = float(value)
  if not math.isfinite(value):
    raise ValueError(f"reward must be finite, got {value}")
  limit = _FLOAT32_MAX if max_abs is None else max_abs
  if abs(value) > limit:
    raise ValueError(f"reward {value!r} is beyond the accepted range [-{limit:g}, {limit:g}]")
  return value


def compute_rewards(
  fn: RewardFn,
  completions: Sequence[str],
  records: Sequence[dict[str, Any]],
  *,
  on_error: str,
  sample_ids: Sequence[int] | None = None,
  max_abs: float | None = None,
  pool=None,
  kinds: dict[str, int] | None = None,
) -> tuple[np.ndarray, int]:
  """Applies `fn` to each (completion, record) pair.

  Args:
    fn: the reward function.
    completions: decoded completions, one per sample.
    records: the task record of each sample (same length as `completions`).
    on_error: what to do when `fn` raises or returns a non-number, a non-finite value or one
      beyond `max_abs`:
      "raise" raises `RewardError` naming the sample; "zero" scores that sample 0.0 and counts
      it, so one malformed completion cannot kill a long run (log the count as a metric).
    sample_ids: how an error names each sample (default: its index here), for callers that
      score a batch's samples in pieces.
    max_abs: the largest |reward| accepted (None: the largest float32, as rewards are stored
      in float32: 1e39 would become inf); config.reward.max_abs keeps it far lower so that
      advantages and losses cannot overflow downstream.
    pool: a `jaxrl.rewards.pool.RewardPool` to score in (worker processes, each sample under
      a time limit; a timeout is an error like any other); None scores here: through
      `fn.score_batch(completions, records)` when `fn` has one (a list of ("ok", value) or
      ("error", message), e.g. the sandboxed code rewards), else one call per sample.

    kinds: a dict the failures are counted into by kind (with on_error="zero"): "timeout"
      (the reward ran out of time), "invalid" (it returned a non-number, a non-finite value
      or one beyond max_abs), "exception" (it raised, or its worker died).

  Returns:
    `(rewards, num_failures)`: float32 rewards of shape [len(completions)] and the number of
    samples that failed (always 0 with on_error="raise").
  """
  if on_error not in _ON_ERROR:
    raise ValueError(f"on_error must be one of {_ON_ERROR}, got {on_error!r}")
  if len(completions) != len(records):
    raise ValueError(
      f"got {len(completions)} completions but {len(records)} records; they must pair up"
    )
  rewards = np.zeros(len(completions), np.float32)
  failures = 0
  if pool is not None:
    scored = pool.score(completions, records)
  elif hasattr(fn, "score_batch"):  # a reward that scores a batch at once (code: in parallel)
    scored = fn.score_batch(completions, records)
  else:
    scored = None
  for i, (completion, record) in enumerate(zip(completions, records, strict=True)):
    kind = "exception"
    try:
      try:
        if scored is None:
          value = fn(completion, record)
        elif scored[i][0] == "ok":
          value = scored[i][1]
        else:
          raise _WorkerError(scored[i][1])
      except Exception as e:
        if isinstance(e, TimeoutError) or str(e).startswith("TimeoutError"):
          kind = "timeout"
        raise
      kind = "invalid"
      rewards[i] = _checked_value(value, max_abs)
    except Exception as e:
      if on_error == "raise":
        prompt = record.get("prompt") if isinstance(record, dict) else None
        fn_name = getattr(fn, "__name__", repr(fn))
        sample = i if sample_ids is None else sample_ids[i]
        detail = str(e) if isinstance(e, _WorkerError) else f"{type(e).__name__}: {e}"
        raise RewardError(
          f"reward {fn_name} failed on sample {sample} (prompt {prompt!r}, completion "
          f"{completion!r}): {detail}"
        ) from e
      failures += 1
      if kinds is not None:
        kinds[kind] = kinds.get(kind, 0) + 1
  return rewards, failures
