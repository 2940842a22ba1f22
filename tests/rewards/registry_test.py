"""Tests for the reward registry, exact_match, and compute_rewards' error handling."""

import math

import numpy as np
import pytest

from jaxrl import rewards

_RECORDS = [
  {"prompt": "1+2=", "answer": "3"},
  {"prompt": "9-4=", "answer": "5"},
  {"prompt": "7*6=", "answer": "42"},
]


@pytest.fixture
def clean_registry(monkeypatch):
  """A private copy of the registry so test registrations do not leak."""
  from jaxrl.registry import REWARDS

  REWARDS.names()  # the built-ins registered before the copy
  monkeypatch.setattr(REWARDS, "_fns", dict(REWARDS._fns))
  monkeypatch.setattr(REWARDS, "_traits", dict(REWARDS._traits))


@pytest.mark.parametrize(
  "completion, answer, expected",
  [
    ("3", "3", 1.0),
    (" 3\n", "3", 1.0),
    ("-12", "-12", 1.0),
    ("12", "-12", 0.0),
    ("03", "3", 0.0),
    ("3.0", "3", 0.0),
    ("3 4", "3", 0.0),
    ("", "3", 0.0),
  ],
)
def test_exact_match(completion, answer, expected):
  fn = rewards.get("exact_match")
  assert fn(completion, {"prompt": "x=", "answer": answer}) == expected


def test_builtins_registered():
  assert "exact_match" in rewards.names()
  assert rewards.get("exact_match") is rewards.exact_match.exact_match


def test_unknown_name_lists_valid_names():
  with pytest.raises(KeyError) as info:
    rewards.get("exact_mtch")
  message = str(info.value)
  assert "exact_mtch" in message and "exact_match" in message
  # Config code may catch ValueError for any bad value.
  with pytest.raises(ValueError, match=r"unknown reward .*; valid: \[.*exact_match"):
    rewards.get("nope")


def test_register(clean_registry):
  before = set(rewards.names())

  @rewards.register("length")
  def length(completion, record):
    return len(completion)

  assert rewards.get("length") is length
  assert rewards.names() == tuple(sorted(before | {"length"}))
  with pytest.raises(ValueError, match="already registered"):
    rewards.register("length")(lambda c, r: 0.0)


def test_compute_rewards_exact_match():
  values, failures = rewards.compute_rewards(
    rewards.get("exact_match"), ["3", "4", " 42 "], _RECORDS, on_error="raise"
  )
  assert values.dtype == np.float32 and values.shape == (3,)
  np.testing.assert_array_equal(values, [1.0, 0.0, 1.0])
  assert failures == 0


def _flaky(completion, record):
  if completion == "boom":
    raise ZeroDivisionError("kaboom")
  if completion == "nan":
    return math.nan
  if completion == "inf":
    return np.float32("inf")
  if completion == "none":
    return None
  if completion == "str":
    return "1.0"
  if completion == "array":
    return np.ones(2)
  return np.float64(0.5)


def test_on_error_raise_names_the_sample():
  with pytest.raises(rewards.RewardError) as info:
    rewards.compute_rewards(_flaky, ["ok", "ok", "boom"], _RECORDS, on_error="raise")
  message = str(info.value)
  assert "sample 2" in message and "'7*6='" in message and "kaboom" in message
  assert "ZeroDivisionError" in message
  assert isinstance(info.value.__cause__, ZeroDivisionError)


@pytest.mark.parametrize("bad", ["nan", "inf", "none", "str", "array"])
def test_bad_return_values_are_failures(bad):
  with pytest.raises(rewards.RewardError, match="sample 1"):
    rewards.compute_rewards(_flaky, ["ok", bad, "ok"], _RECORDS, on_error="raise")
  values, failures = rewards.compute_rewards(_flaky, ["ok", bad, "ok"], _RECORDS, on_error="zero")
  np.testing.assert_array_equal(values, [0.5, 0.0, 0.5])
  assert failures == 1


def test_failures_are_counted_by_kind():
  def slow(completion, record):
    if completion == "slow":
      raise TimeoutError("the verifier gave up")
    return _flaky(completion, record)

  kinds = {}
  completions = ["ok", "boom", "nan", "slow", "none", "boom"]
  _, failures = rewards.compute_rewards(
    slow, completions, _RECORDS * 2, on_error="zero", kinds=kinds
  )
  assert failures == 5 and kinds == {"exception": 2, "invalid": 2, "timeout": 1}


def test_on_error_zero_counts_failures():
  values, failures = rewards.compute_rewards(
    _flaky, ["boom", "ok", "boom"], _RECORDS, on_error="zero"
  )
  np.testing.assert_array_equal(values, [0.0, 0.5, 0.0])
  assert values.dtype == np.float32
  assert failures == 2


def test_missing_answer_is_a_failure():
  fn = rewards.get("exact_match")
  with pytest.raises(rewards.RewardError, match="KeyError"):
    rewards.compute_rewards(fn, ["3"], [{"prompt": "1+2="}], on_error="raise")


def test_compute_rewards_bad_arguments():
  fn = rewards.get("exact_match")
  with pytest.raises(ValueError, match="'raise', 'zero'"):
    rewards.compute_rewards(fn, ["3"], _RECORDS[:1], on_error="ignore")
  with pytest.raises(ValueError, match="2 completions but 3 records"):
    rewards.compute_rewards(fn, ["3", "5"], _RECORDS, on_error="zero")
  values, failures = rewards.compute_rewards(fn, [], [], on_error="raise")
  assert values.shape == (0,) and values.dtype == np.float32 and failures == 0
