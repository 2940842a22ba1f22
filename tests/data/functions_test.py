"""The function-writing task: records by hand, canonical bodies, a split that never mixes, and
every canonical answer passing its own tests in the sandbox."""

import numpy as np
import pytest

from jaxrl import rewards
from jaxrl.data.functions import FunctionTask, expression


@pytest.mark.parametrize(
  "coefs, body",
  [
    ((0, 3, 2), "3*x+2"),
    ((0, -1, 0), "-x"),
    ((0, 1, -4), "x-4"),
    ((0, 0, 7), "7"),
    ((0, 0, 0), "0"),
    ((1, 0, -4), "x*x-4"),
    ((-2, 1, 0), "-2*x*x+x"),
  ],
)
def test_canonical_bodies(coefs, body):
  assert expression(*coefs) == body


def test_a_record_by_hand():
  r = FunctionTask().record(0, 3, 2)
  assert r["prompt"] == "f(0)=2,f(1)=5,f(2)=8\ndef f(x):return "
  assert r["answer"] == "3*x+2" and r["code_prefix"] == "def f(x):return "
  assert r["tests"] == ["f(3)==11", "f(5)==17", "f(-2)==-4", "f(10)==32"]


def test_splits_are_disjoint_and_deterministic():
  task = FunctionTask(max_coef=20)
  held = task.held_out(100, seed=0)
  assert held == task.held_out(100, seed=0)
  held_prompts = {r["prompt"] for r in held}
  assert len(held_prompts) == 100
  rng = np.random.default_rng(0)
  train = {task.sample(rng)["prompt"] for _ in range(2000)}
  assert not train & held_prompts
  assert all(-20 <= c <= 20 for r in held for c in r["coefs"])
  assert all(r["coefs"][0] == 0 for r in held)  # max_degree=1: linear


def test_quadratics_and_their_answers_pass_their_own_tests():
  task = FunctionTask(max_coef=5, max_degree=2)
  records = task.held_out(16, seed=1)
  assert any(r["coefs"][0] != 0 for r in records)
  answers = [task.sft_completion(r) for r in records]
  scores, failures = rewards.compute_rewards(
    rewards.get("code_tests"), answers, records, on_error="raise"
  )
  assert failures == 0 and scores.tolist() == [1.0] * 16


@pytest.mark.parametrize(
  "kwargs, message",
  [
    ({"max_coef": 0}, r"max_coef must be in 1\.\.99, got 0"),
    ({"max_degree": 3}, r"max_degree must be 1 or 2, got 3"),
    ({"held_out_fraction": 1.0}, r"held_out_fraction must be in \(0, 1\), got 1\.0"),
  ],
)
def test_bad_settings_are_named(kwargs, message):
  with pytest.raises(ValueError, match=message):
    FunctionTask(**kwargs)


def test_too_many_held_out_problems_is_named():
  with pytest.raises(ValueError, match=r"asked for n=100 held-out problems, found"):
    FunctionTask(max_coef=3).held_out(100)
