"""The long-tailed chain task: scratchpads, the final-number reward, the term-count law, splits."""

import numpy as np
import pytest

from jaxrl.data.chain import ChainSumTask, final_number, scratchpad
from jaxrl.rewards import registry


def test_scratchpad_and_record():
  assert scratchpad([3, 5, 2, 8]) == "8,10,18"
  assert scratchpad([0, 0]) == "0"
  r = ChainSumTask().record([9, 9, 9])
  assert r == {"prompt": "9+9+9=", "answer": "27", "terms": [9, 9, 9]}
  assert ChainSumTask().sft_completion(r) == "18,27"


def test_final_number_reward():
  reward = registry.get("final_number")
  rec = {"answer": "18"}
  assert final_number("8,10,18") == "18" and final_number("no digits") is None
  assert reward("8,10,18", rec) == 1.0
  assert reward(" 18 ", rec) == 1.0  # the scratchpad is not required
  assert reward("8,10,17", rec) == 0.0
  assert reward("18,1", rec) == 0.0  # the LAST number counts
  assert reward("", rec) == 0.0


def test_term_counts_follow_the_power_law():
  task = ChainSumTask(min_terms=2, max_terms=6, tail=2.0)
  k = np.arange(2, 7)
  np.testing.assert_allclose(task.term_probs, k**-2.0 / np.sum(k**-2.0))
  rng = np.random.default_rng(0)
  counts = np.bincount([len(task.sample(rng)["terms"]) for _ in range(6000)], minlength=7)[2:]
  # Held-out rejection barely changes the law (10% of problems, by hash).
  np.testing.assert_allclose(counts / counts.sum(), task.term_probs, atol=0.02)
  # Long-tailed completions: the longest is many times the median.
  lengths = [len(task.sft_completion(task.sample(rng))) for _ in range(2000)]
  assert max(lengths) >= 4 * np.median(lengths)


def test_splits_are_disjoint_and_streams_deterministic():
  task = ChainSumTask()
  held = task.held_out(50, seed=1)
  assert len({r["prompt"] for r in held}) == 50 and held == task.held_out(50, seed=1)
  assert all(task.is_held_out(r["terms"]) for r in held)
  a = next(iter(task.train_dataset(seed=3, batch_size=64)))
  b = next(iter(task.train_dataset(seed=3, batch_size=64)))
  assert a == b and not any(task.is_held_out(r["terms"]) for r in a)
  for r in a:
    assert r["answer"] == str(sum(r["terms"])) and r["prompt"].endswith("=")


@pytest.mark.parametrize(
  "kw, match",
  [
    ({"min_terms": 1}, "min_terms must be an int >= 2"),
    ({"min_terms": 5, "max_terms": 3}, "max_terms=3 must be >= min_terms=5"),
    ({"tail": -1.0}, "tail must be a float >= 0"),
    ({"held_out_fraction": 0.0}, r"held_out_fraction must be in \(0, 1\)"),
  ],
)
def test_bad_settings_name_the_field(kw, match):
  with pytest.raises(ValueError, match=match):
    ChainSumTask(**kw)
