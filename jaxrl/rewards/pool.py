"""Rewards in worker processes, each sample under a time limit: a reward function that hangs,
spins or crashes the interpreter costs its sample, never the run.

`RewardPool(fn, workers, timeout_s)` keeps `workers` processes (the forkserver start method:
started from a fresh interpreter, not forked from the multi-threaded JAX process). Each sample
runs in a worker's main thread under an interval timer (SIGALRM), so pure-Python work is
interrupted at `timeout_s` with a `TimeoutError`. Work that never returns to the interpreter (a C
extension in a loop) is caught by the parent: once a batch has run past its hard deadline
(`timeout_s` per sample a worker has to score, plus a grace period), the pool is killed, every
sample not yet scored counts as timed out, and a fresh pool starts for the next batch.

The function travels to the workers by reference (module and name, as pickle sends functions),
so it must be importable: a reward registered in a module of its own, not a lambda or a
function defined inside another.
"""

from __future__ import annotations

import concurrent.futures as cf
import math
import multiprocessing
import pickle
import signal
import time
from collections.abc import Sequence
from typing import Any

# A worker's own start-up (imports) is not the reward's time: the hard deadline allows this.
_GRACE_S = 30.0


class _Timeout(Exception):
  pass


def _alarm(signum, frame):
  raise _Timeout


def _warm(fn) -> None:
  """Unpickling `fn` imported its module here; the pause spreads these over the workers."""
  time.sleep(0.05)


def _score(fn, completion: str, record: dict, timeout_s: float) -> tuple[str, Any]:
  """("ok", value) or ("error", message), in a worker; SIGALRM ends it at `timeout_s`."""
  signal.signal(signal.SIGALRM, _alarm)
  signal.setitimer(signal.ITIMER_REAL, timeout_s)
  try:
    return "ok", fn(completion, record)
  except _Timeout:
    return "error", f"TimeoutError: the reward took longer than reward.timeout_s={timeout_s:g}s"
  except BaseException as e:  # noqa: BLE001 - reported to the parent, which decides
    return "error", f"{type(e).__name__}: {e}"
  finally:
    signal.setitimer(signal.ITIMER_REAL, 0)


class RewardPool:
  """Worker processes that score `(completion, record)` pairs with `fn`, `timeout_s` each."""

  def __init__(self, fn, *, workers: int, timeout_s: float, grace_s: float = _GRACE_S):
    if workers < 1 or not timeout_s > 0:
      raise ValueError(f"need workers >= 1 and timeout_s > 0, got {workers}, {timeout_s}")
    try:
      pickle.dumps(fn)
    except Exception as e:
      name = getattr(fn, "__qualname__", repr(fn))
      raise ValueError(
        f"reward function {name} cannot be sent to worker processes ({e}); with "
        "reward.timeout_s > 0 it must be importable by module and name (not a lambda or a "
        "nested function), or set reward.timeout_s=0 to score in the training process"
      ) from e
    self.fn, self.workers, self.timeout_s, self.grace_s = fn, workers, timeout_s, grace_s
    self._executor = None
    self.restarts = 0  # pools killed for a sample past its hard deadline

  def _pool(self) -> cf.ProcessPoolExecutor:
    """The workers, started and with the reward's module imported before any deadline runs:
    start-up is not the reward's time."""
    if self._executor is None:
      context = multiprocessing.get_context("forkserver")
      ex = cf.ProcessPoolExecutor(self.workers, mp_context=context)
      list(ex.map(_warm, [self.fn] * self.workers))
      self._executor = ex
    return self._executor

  def score(self, completions: Sequence[str], records: Sequence[dict]) -> list[tuple[str, Any]]:
    """One ("ok", value) or ("error", message) per sample, in order."""
    pool = self._pool()
    futures = [
      pool.submit(_score, self.fn, c, r, self.timeout_s)
      for c, r in zip(completions, records, strict=True)
    ]
    rounds = math.ceil(len(futures) / self.workers)
    deadline = time.monotonic() + rounds * self.timeout_s + self.grace_s
    out, stuck = [], False
    for f in futures:
      try:
        out.append(f.result(timeout=max(deadline - time.monotonic(), 0.0)))
      except cf.TimeoutError:
        stuck = True
        why = f"reward.timeout_s={self.timeout_s:g}s; the worker was killed"
        out.append(("error", f"TimeoutError: no result by the batch's hard deadline ({why})"))
      except cf.process.BrokenProcessPool as e:
        stuck = True
        out.append(("error", f"the reward worker process died ({e})"))
    if stuck:
      self._kill()
    return out

  def _kill(self) -> None:
    """Terminate the workers (a stuck one ignores anything gentler); the next batch starts a
    fresh pool."""
    ex, self._executor = self._executor, None
    self.restarts += 1
    for p in list(getattr(ex, "_processes", {}).values()):
      p.kill()
    ex.shutdown(wait=False, cancel_futures=True)

  def close(self) -> None:
    if self._executor is not None:
      self._executor.shutdown(wait=True, cancel_futures=True)
      self._executor = None
