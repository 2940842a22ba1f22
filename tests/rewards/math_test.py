"""Math rewards: answer extraction precedence, number normalisation, GSM8K scoring, math-verify."""

import threading

import numpy as np
import pytest

from jaxrl import rewards
from jaxrl.rewards.math import extract_answer, normalize_answer

GSM8K_RECORD = {"prompt": "Natalia sold clips...", "answer": "72"}


@pytest.mark.parametrize(
  "completion, expected",
  [
    ("48 / 2 = 24 clips in May.\n48 + 24 = 72\n#### 72", "72"),
    ("#### 72 clips.", "72"),
    ("#### $1,200", "$1,200"),
    ("#### 12\nwait, actually\n#### 13", "13"),  # the last marker wins
    ("So $x = \\boxed{\\frac{3}{4}}$.", "\\frac{3}{4}"),
    ("\\boxed{1} first, then \\boxed{\\sqrt{2}}", "\\sqrt{2}"),
    ("The answer is 42.", "42"),
    ("the answer is: -7 apples", "-7"),
    ("I computed 5, then 17, so 23", "23"),  # no marker: the last number
    ("Costs were 1,234 and 0.5", "0.5"),
    ("#### 7 beats \\boxed{8} beats the answer is 9", "7"),  # precedence: ####, boxed, "answer is"
    ("\\boxed{8} and the answer is 9", "8"),
    ("no digits here", None),
    ("", None),
    ("\\boxed{12", "12"),  # an unclosed box (cut off) falls back to the last number
  ],
)
def test_extract_answer(completion, expected):
  assert extract_answer(completion) == expected


@pytest.mark.parametrize(
  "raw, canonical",
  [
    ("72", "72"),
    ("72.0", "72"),
    ("72.", "72"),
    ("1,000", "1000"),
    ("$1,000.00", "1000"),
    ("\\$18", "18"),
    ("-$5", "-5"),
    ("$-5", "-5"),
    ("0.50", "1/2"),
    (".5", "1/2"),
    ("\\frac{1}{2}", "1/2"),
    ("-\\dfrac{6}{4}", "-3/2"),
    ("3/6", "1/2"),
    ("50%", "50"),
    ("18 \\text{ dollars}", "18"),
    ("  Yes ", "yes"),
    ("x + 1", "x+1"),
  ],
)
def test_normalize_answer(raw, canonical):
  assert normalize_answer(raw) == canonical


@pytest.mark.parametrize("name", ["gsm8k", "math_answer"])
@pytest.mark.parametrize(
  "completion, answer, reward",
  [
    ("She sold 48 + 24 = 72 clips.\n#### 72", "72", 1.0),
    ("#### 72.00", "72", 1.0),
    ("The answer is $1,000.", "1000", 1.0),
    ("#### 1000", "1,000", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("so she earned 10 dollars", "10", 1.0),
    ("#### 71", "72", 0.0),
    ("#### 72 but no, 71", "72", 1.0),  # the #### line commits to 72
    ("the answer is 720", "72", 0.0),
    ("I don't know", "72", 0.0),
    ("", "72", 0.0),
    ("#### -3", "3", 0.0),
  ],
)
def test_gsm8k_reward(name, completion, answer, reward):
  fn = rewards.get(name)
  assert fn(completion, {"prompt": "q", "answer": answer}) == reward


def test_batch_scoring_through_registry():
  completions = ["#### 72", "#### 73", "72", "garbage"]
  records = [GSM8K_RECORD] * 3 + [{"prompt": "q"}]
  scores, failures = rewards.compute_rewards(
    rewards.get("gsm8k"), completions, records, on_error="zero"
  )
  np.testing.assert_array_equal(scores, [1.0, 0.0, 1.0, 0.0])
  assert failures == 1  # the record without an answer
  with pytest.raises(rewards.RewardError, match=r"record needs an 'answer'"):
    rewards.compute_rewards(rewards.get("gsm8k"), completions, records, on_error="raise")


def test_math_verify_reward_off_the_main_thread():
  fn = rewards.get("math_verify")
  cases = [
    ("#### 72", "72", 1.0),
    ("The answer is $\\boxed{\\frac{1}{2}}$", "0.5", 1.0),
    ("so x = \\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
    ("#### 1,000", "1000", 1.0),
    ("#### 71", "72", 0.0),
    ("no answer", "72", 0.0),
  ]
  results = []
  # math-verify's timeouts use signals (main thread only); the reward must work in a worker.
  worker = threading.Thread(
    target=lambda: results.extend(fn(c, {"answer": a}) for c, a, _ in cases)
  )
  worker.start()
  worker.join()
  assert results == [r for _, _, r in cases]


def test_math_verify_unparseable_reference_raises():
  with pytest.raises(ValueError, match=r"math-verify cannot parse the record's answer ''"):
    rewards.get("math_verify")("#### 3", {"answer": ""})


ADVERSARIAL = {
  # (completion, its score against the answer "42"): each finishes and scores what is written.
  "a megabyte of digits": ("9" * 1_000_000, 0.0),
  "a long decimal": ("0." + "3" * 1_000_000, 0.0),
  "5000 digits ending the answer": ("#### " + "4" * 5000 + "2", 0.0),
  "a fraction of huge numbers": ("\\boxed{\\frac{" + "9" * 10**5 + "}{" + "7" * 10**5 + "}}", 0.0),
  "a gigantic exponent": ("#### 1e999999999", 0.0),
  "a tower of powers": ("\\boxed{2^{10^{10^{10}}}}", 0.0),
  "a power in Python": ("the answer is 10**10**10", 0.0),
  "deeply nested boxes": ("\\boxed{" * 10**5 + "42" + "}" * 10**5, 1.0),  # the innermost
  "deeply nested fractions": ("\\frac{" * 50_000 + "42}{1}" * 50_000, 0.0),
  "a megabyte of braces": ("{" * 10**6, 0.0),
  "a megabyte of markers": ("####" * 250_000, 0.0),
  "'the answer is' a hundred thousand times": ("the answer is " * 100_000, 0.0),
  "Arabic-Indic digits": ("#### ٤٢", 0.0),
  "fullwidth digits": ("#### ４２", 0.0),
  "mathematical bold digits": ("\\boxed{𝟒𝟐}", 0.0),
  "superscript digits": ("#### ⁴²", 0.0),
  "the answer after a megabyte of text": ("a" * 10**6 + " #### 42", 1.0),
}


@pytest.mark.parametrize("name", ["gsm8k", "math_answer"])
def test_adversarial_answers_finish_with_a_defined_score(name):
  """Every answer is scored (never a reward error) and the whole catalogue finishes inside a
  watchdog far above its cost (a megabyte of digits once took minutes and then raised)."""
  fn = rewards.get(name)
  done = threading.Event()
  scores = {}

  def score_all():
    for key, (completion, _) in ADVERSARIAL.items():
      scores[key] = fn(completion, {"answer": "42"})
    done.set()

  worker = threading.Thread(target=score_all, daemon=True)
  worker.start()
  assert done.wait(60.0), f"still scoring after 60 s; finished {sorted(scores)}"
  assert scores == {key: want for key, (_, want) in ADVERSARIAL.items()}


def test_math_verify_on_adversarial_answers_ends_with_a_score_or_a_counted_timeout():
  """sympy may work without end on a crafted answer: math_verify is `unbounded`, scored in
  worker processes under reward.timeout_s, where each such answer costs only itself."""
  from jaxrl.rewards.pool import RewardPool

  fn = rewards.get("math_verify")
  picks = (
    "a tower of powers",
    "a megabyte of digits",
    "deeply nested fractions",
    "fullwidth digits",
  )
  completions = [ADVERSARIAL[k][0] for k in picks] + ["\\boxed{42}"]
  pool = RewardPool(fn, workers=2, timeout_s=2.0, grace_s=2.0)
  kinds: dict[str, int] = {}
  try:
    values, failures = rewards.compute_rewards(
      fn,
      completions,
      [{"answer": "42"}] * len(completions),
      on_error="zero",
      pool=pool,
      kinds=kinds,
    )
  finally:
    pool.close()
  assert set(values.tolist()) <= {0.0, 1.0} and values[-1] == 1.0
  assert failures == sum(kinds.values()) and set(kinds) <= {"timeout", "exception"}
