"""Rewards in worker processes: the same scores as in-process, and a reward that hangs, spins in
C or kills its process costs its sample (per reward.on_error), never the run."""

import os
import signal
import time

import numpy as np
import pytest

from jaxrl import rewards
from jaxrl.rewards.pool import RewardPool

RECORDS = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(6)]


def by_completion(completion, record):
  """Module-level (importable by name): what the workers can run."""
  if completion == "spin":
    while True:  # pure Python: the worker's own timer interrupts it
      pass
  if completion == "stuck":
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])  # as C code that never yields
    while True:
      pass
  if completion == "die":
    os._exit(3)
  if completion == "boom":
    raise RuntimeError("verifier crashed")
  return float(completion == record["answer"])


def test_workers_score_like_the_training_process():
  completions = ["1", "x", "3", "4", "nope", "6"]
  here, _ = rewards.compute_rewards(by_completion, completions, RECORDS, on_error="raise")
  pool = RewardPool(by_completion, workers=2, timeout_s=5.0)
  try:
    there, failures = rewards.compute_rewards(
      by_completion, completions, RECORDS, on_error="raise", pool=pool
    )
  finally:
    pool.close()
  np.testing.assert_array_equal(there, here)
  np.testing.assert_array_equal(there, [1, 0, 1, 1, 0, 1])
  assert failures == 0


def test_a_spinning_reward_times_out_and_costs_only_its_sample():
  pool = RewardPool(by_completion, workers=2, timeout_s=0.5)
  try:
    t0 = time.monotonic()
    kinds = {}
    values, failures = rewards.compute_rewards(
      by_completion,
      ["1", "spin", "3", "boom"],
      RECORDS[:4],
      on_error="zero",
      pool=pool,
      kinds=kinds,
    )
    assert time.monotonic() - t0 < 20  # the timer, not the hard deadline, ended it
    np.testing.assert_array_equal(values, [1, 0, 1, 0])
    assert failures == 2 and pool.restarts == 0
    assert kinds == {"timeout": 1, "exception": 1}  # counted apart
    pattern = r"sample 1 .*TimeoutError: the reward took longer than reward.timeout_s=0.5s"
    with pytest.raises(rewards.RewardError, match=pattern):
      rewards.compute_rewards(
        by_completion, ["1", "spin"], RECORDS[:2], on_error="raise", pool=pool
      )
  finally:
    pool.close()


def test_a_reward_stuck_past_the_timer_or_killing_its_worker_is_contained():
  pool = RewardPool(by_completion, workers=2, timeout_s=0.5, grace_s=2.0)
  try:
    values, failures = rewards.compute_rewards(
      by_completion, ["1", "stuck", "3"], RECORDS[:3], on_error="zero", pool=pool
    )
    assert failures >= 1 and values[1] == 0 and pool.restarts == 1  # killed at the deadline
    values, failures = rewards.compute_rewards(
      by_completion, ["die", "2"], RECORDS[:2], on_error="zero", pool=pool
    )
    assert failures >= 1 and values[0] == 0 and pool.restarts == 2
    # A fresh pool serves the next batch.
    values, failures = rewards.compute_rewards(
      by_completion, ["1", "2", "3"], RECORDS[:3], on_error="raise", pool=pool
    )
    np.testing.assert_array_equal(values, [1, 1, 1])
  finally:
    pool.close()


def test_a_function_the_workers_cannot_import_is_refused_up_front():
  with pytest.raises(ValueError, match=r"cannot be sent to worker processes .* reward.timeout_s=0"):
    RewardPool(lambda c, r: 1.0, workers=1, timeout_s=1.0)
