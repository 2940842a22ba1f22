"""Rewards in worker processes: the same scores as in-process, and a reward that hangs, spins in
C or kills its process costs its sample (per reward.on_error), never the run nor the samples
beside it."""

import os
import signal
import time
import types

import numpy as np
import pytest

from jaxrl import rewards
from jaxrl.rewards.pool import RewardPool

RECORDS = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(6)]


def by_completion(completion, record):
  """Module-level (importable by name): what the workers can run."""
  if "log" in record:  # one line per call: what ran, and how often
    with open(record["log"], "a") as f:
      f.write(completion + "\n")
  if completion == "spin":
    while True:  # pure Python: the worker's own timer interrupts it
      pass
  if completion == "stuck":
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])  # as C code that never yields
    time.sleep(3600)
  if completion == "die":
    os._exit(3)
  if completion == "killed":
    os.kill(os.getpid(), signal.SIGKILL)
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
    assert time.monotonic() - t0 < 20
    np.testing.assert_array_equal(values, [1, 0, 1, 0])
    assert failures == 2 and pool.restarts == 0  # the timer ended it: no worker was killed
    assert kinds == {"timeout": 1, "exception": 1}  # counted apart
    pattern = r"sample 1 .*TimeoutError: the reward took longer than reward.timeout_s=0.5s"
    with pytest.raises(rewards.RewardError, match=pattern):
      rewards.compute_rewards(
        by_completion, ["1", "spin"], RECORDS[:2], on_error="raise", pool=pool
      )
  finally:
    pool.close()


@pytest.mark.parametrize(
  "workers, crash, how", [(1, "die", "exit code 3"), (2, "killed", "killed by SIGKILL")]
)
def test_a_stuck_or_crashing_sample_costs_only_itself(tmp_path, workers, crash, how):
  # One worker: every later sample waits behind the stuck one and the crash. Two: the stuck one
  # holds a worker while the crash takes the other, and the last samples wait for a replacement.
  # Each ordinary sample still gets its own score, and no sample runs twice.
  log = tmp_path / "calls"
  completions = ["1", "stuck", "3", crash, "5", "6"]
  records = [{**r, "log": str(log)} for r in RECORDS]
  pool = RewardPool(by_completion, workers=workers, timeout_s=0.5, grace_s=1.0)
  try:
    scored = pool.score(completions, records)
    assert pool.restarts == 2  # the stuck worker killed, the crashed one replaced
    assert sorted(log.read_text().split()) == sorted(completions)
    for i in (0, 2, 4, 5):
      assert scored[i] == ("ok", 1.0)
    assert scored[1] == (
      "error",
      "TimeoutError: the reward ran past reward.timeout_s=0.5s without returning to the "
      "interpreter; its worker was killed at 1.5s",
    )
    assert scored[3] == ("error", f"the reward worker process died scoring this sample ({how})")
    kinds = {}
    values, failures = rewards.compute_rewards(
      by_completion,
      completions,
      records,
      on_error="zero",
      pool=types.SimpleNamespace(score=lambda c, r: scored),  # the results above
      kinds=kinds,
    )
    np.testing.assert_array_equal(values, [1, 0, 1, 0, 1, 1])
    assert failures == 2 and kinds == {"timeout": 1, "exception": 1}
    # The replacements serve the next batch.
    assert pool.score(["1", "2"], RECORDS[:2]) == [("ok", 1.0), ("ok", 1.0)]
    assert pool.restarts == 2
  finally:
    pool.close()


def test_a_function_the_workers_cannot_import_is_refused_up_front():
  with pytest.raises(ValueError, match=r"cannot be sent to worker processes .* reward.timeout_s=0"):
    RewardPool(lambda c, r: 1.0, workers=1, timeout_s=1.0)
