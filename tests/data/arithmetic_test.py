"""Tests for the synthetic arithmetic task: correctness, the held-out split, and resumable data."""

import json
import re

import numpy as np
import pytest

from jaxrl.data.arithmetic import ArithmeticTask, careless

_PROMPT_RE = re.compile(r"(\d+)([+*-])(\d+)=")


def _check_record(record):
  """Asserts that `record` is well formed and its answer is the true value of its prompt."""
  assert set(record) == {"prompt", "answer", "a", "b", "op"}
  match = _PROMPT_RE.fullmatch(record["prompt"])
  assert match, record
  assert (int(match[1]), match[2], int(match[3])) == (record["a"], record["op"], record["b"])
  assert type(record["a"]) is int and type(record["b"]) is int
  # The regex admits only digits and one operator, so eval is a safe independent reference.
  assert record["answer"] == str(eval(record["prompt"][:-1]))


def _key(record):
  return record["a"], record["op"], record["b"]


def _take(it, n):
  it = iter(it)
  return [next(it) for _ in range(n)]


def _train_records(task, n, seed=0, batch_size=50):
  batches = _take(task.train_dataset(seed=seed, batch_size=batch_size), n // batch_size)
  return [r for b in batches for r in b]


@pytest.mark.parametrize(
  "task",
  [
    ArithmeticTask(),
    ArithmeticTask(max_digits=4, ops=("+", "-", "*")),
    ArithmeticTask(max_digits=9, ops=("*",)),
    ArithmeticTask(max_digits=3, ops=("-",), allow_negative=True),
  ],
)
def test_answers_are_correct(task):
  rng = np.random.default_rng(0)
  for split in ("train", "held_out"):
    for _ in range(300):
      record = task.sample(rng, split=split)
      _check_record(record)
      assert task.sft_completion(record) == record["answer"]
      assert task.is_held_out(*_key(record)) == (split == "held_out")


def test_record_format():
  assert ArithmeticTask().record(12, "+", 34) == {
    "prompt": "12+34=",
    "answer": "46",
    "a": 12,
    "b": 34,
    "op": "+",
  }
  assert ArithmeticTask(allow_negative=True).record(3, "-", 15)["answer"] == "-12"


def test_train_and_held_out_are_disjoint():
  task = ArithmeticTask(max_digits=2, ops=("+", "-", "*"))
  train = _train_records(task, 3000)
  held_out = task.held_out(1000)
  for record in train + held_out:
    _check_record(record)
  assert not {_key(r) for r in train} & {_key(r) for r in held_out}
  assert not any(task.is_held_out(*_key(r)) for r in train)
  assert all(task.is_held_out(*_key(r)) for r in held_out)


def test_held_out_fraction_of_problem_space():
  task = ArithmeticTask(held_out_fraction=0.2)
  flags = [task.is_held_out(a, "+", b) for a in range(100) for b in range(100)]
  assert 0.18 < np.mean(flags) < 0.22


def test_split_is_stable_across_configs_and_nested_in_fraction():
  small, big = ArithmeticTask(max_digits=1), ArithmeticTask(max_digits=5, ops=("+", "-", "*"))
  wider = ArithmeticTask(held_out_fraction=0.3)
  for a in range(10):
    for b in range(10):
      assert small.is_held_out(a, "+", b) == big.is_held_out(a, "+", b)
      if small.is_held_out(a, "-", b):
        assert wider.is_held_out(a, "-", b)


@pytest.mark.parametrize("max_digits", [2, 3])  # exact enumeration and rejection sampling
def test_held_out_deterministic_and_distinct(max_digits):
  task = ArithmeticTask(max_digits=max_digits, ops=("+", "-", "*"))
  first = task.held_out(200, seed=3)
  assert len(first) == 200
  assert len({r["prompt"] for r in first}) == 200
  assert first == task.held_out(200, seed=3)
  assert first != task.held_out(200, seed=4)
  assert task.held_out(0) == []
  for record in first:
    _check_record(record)
    assert task.is_held_out(*_key(record))


def test_held_out_can_take_every_held_out_problem():
  task = ArithmeticTask(max_digits=1, ops=("+",), held_out_fraction=0.3)
  expected = {(a, "+", b) for a in range(10) for b in range(10) if task.is_held_out(a, "+", b)}
  assert {_key(r) for r in task.held_out(len(expected))} == expected
  with pytest.raises(ValueError, match=f"only {len(expected)} distinct"):
    task.held_out(len(expected) + 1)


def test_digit_count_coverage():
  task = ArithmeticTask(max_digits=3, ops=("+",), operand_dist="by_digits")
  rng = np.random.default_rng(1)
  records = [task.sample(rng) for _ in range(3000)]
  for field in ("a", "b"):
    digits = np.array([len(str(r[field])) for r in records])
    for d in (1, 2, 3):
      assert 0.28 < np.mean(digits == d) < 0.39, (field, d)
  # Zero counts as a one-digit number, so it must show up.
  assert any(r["a"] == 0 for r in records)


def test_uniform_operands_cover_the_range_evenly():
  task = ArithmeticTask(max_digits=2, ops=("+",))
  assert task.operand_dist == "uniform"
  rng = np.random.default_rng(3)
  a = np.array([task.sample(rng)["a"] for _ in range(4000)])
  counts = np.bincount(a // 10, minlength=10)  # ten bins of ten values each
  assert counts.min() > 0.8 * 400 and counts.max() < 1.2 * 400, counts
  # The held-out set follows the same distribution: about 10% one-digit first operands.
  held = task.held_out(500)
  assert 0.04 < np.mean([r["a"] < 10 for r in held]) < 0.18


def test_bad_operand_dist():
  with pytest.raises(ValueError, match="operand_dist"):
    ArithmeticTask(operand_dist="zipf")


def test_subtraction_sign():
  rng = np.random.default_rng(2)
  task = ArithmeticTask(max_digits=2, ops=("-",))
  records = [task.sample(rng) for _ in range(500)]
  assert all(r["a"] >= r["b"] and int(r["answer"]) >= 0 for r in records)

  task = ArithmeticTask(max_digits=2, ops=("-",), allow_negative=True)
  records = [task.sample(rng) for _ in range(500)]
  negative = [r for r in records if r["answer"].startswith("-")]
  assert 0.3 * len(records) < len(negative) < 0.7 * len(records)
  for record in negative:
    _check_record(record)


@pytest.mark.parametrize(
  "kwargs, field",
  [
    ({"max_digits": 0}, "max_digits"),
    ({"max_digits": 10}, "max_digits"),
    ({"max_digits": 2.0}, "max_digits"),
    ({"ops": ()}, "ops"),
    ({"ops": ("+", "/")}, "ops"),
    ({"ops": "+-"}, "ops"),
    ({"ops": ("+", "+")}, "ops"),
    ({"held_out_fraction": 0.0}, "held_out_fraction"),
    ({"held_out_fraction": 1.0}, "held_out_fraction"),
    ({"allow_negative": 1}, "allow_negative"),
  ],
)
def test_bad_config(kwargs, field):
  with pytest.raises(ValueError, match=field):
    ArithmeticTask(**kwargs)


def test_ops_list_becomes_tuple():
  assert ArithmeticTask(ops=["*", "+"]).ops == ("*", "+")


def test_bad_arguments():
  task = ArithmeticTask()
  with pytest.raises(ValueError, match="batch_size"):
    task.train_dataset(seed=0, batch_size=0)
  with pytest.raises(ValueError, match="seed"):
    task.train_dataset(seed=-1, batch_size=4)
  with pytest.raises(ValueError, match="split"):
    task.sample(np.random.default_rng(0), split="test")
  with pytest.raises(ValueError, match="empty"):
    ArithmeticTask(max_digits=1, ops=("+",), held_out_fraction=0.999).sample(
      np.random.default_rng(0)
    )


def test_train_dataset_batches():
  task = ArithmeticTask()
  batches = _take(task.train_dataset(seed=7, batch_size=5), 3)
  assert [len(b) for b in batches] == [5, 5, 5]
  for batch in batches:
    assert isinstance(batch, list)
    for record in batch:
      _check_record(record)
  assert batches == _take(task.train_dataset(seed=7, batch_size=5), 3)
  assert batches != _take(task.train_dataset(seed=8, batch_size=5), 3)
  # Record i depends only on (seed, i), not on how records are grouped into batches.
  regrouped = [r for b in _take(task.train_dataset(seed=7, batch_size=3), 5) for r in b]
  assert regrouped == [r for b in batches for r in b]


def test_iterator_state_save_restore():
  task = ArithmeticTask(max_digits=3, ops=("+", "-", "*"))
  it = iter(task.train_dataset(seed=11, batch_size=4))
  _take(it, 5)
  state = json.loads(json.dumps(it.get_state()))  # must survive a JSON checkpoint
  expected = _take(it, 6)

  fresh = iter(task.train_dataset(seed=11, batch_size=4))
  fresh.set_state(state)
  assert _take(fresh, 6) == expected
  assert fresh.get_state() == it.get_state()

  # Restoring also rewinds an iterator that has run ahead.
  it.set_state(state)
  assert _take(it, 6) == expected


# ------------------------------------------------------------------------ the careless teacher


@pytest.mark.parametrize(
  "problem, written",
  [
    ((27, "+", 15), "32"),  # the units' carry forgotten
    ((57, "+", 68), "115"),  # the leftmost column writes its whole sum: 5 + 6 = 11
    ((99, "+", 99), "188"),
    ((9, "+", 9), "18"),  # one column: nothing to forget
    ((12, "+", 34), "46"),
    ((42, "-", 15), "33"),  # smaller digit from the larger: |2 - 5| = 3
    ((52, "-", 48), "16"),
    ((90, "-", 9), "99"),
    ((50, "-", 50), "0"),  # leading zeros dropped
    ((75, "-", 32), "43"),
  ],
)
def test_careless_answers_by_hand(problem, written):
  assert careless(*problem) == written


def _needs_carry(a, op, b):
  """Column arithmetic, independently: does a column carry (or borrow) into the next one? Out
  of the leftmost column there is nothing to forget: it is written whole."""
  columns = max(len(str(a)), len(str(b)))
  carry = 0
  for _ in range(columns - 1):
    x, y = a % 10, b % 10
    carry = int(x + y + carry >= 10) if op == "+" else int(x - y - carry < 0)
    if carry:
      return True
    a, b = a // 10, b // 10
  return False


def test_careless_differs_from_the_truth_exactly_when_a_carry_is_needed():
  for op in "+-":
    for a in range(100):
      for b in range(100):
        if op == "-" and a < b:
          continue
        truth = str(a + b if op == "+" else a - b)
        assert (careless(a, op, b) != truth) == _needs_carry(a, op, b), (a, op, b)


def test_careless_leaves_products_and_negatives_alone():
  assert careless(12, "*", 34) is None
  assert careless(3, "-", 15) is None
  assert careless(-3, "+", 5) is None


def test_careless_rate_changes_demonstrations_only():
  base, noisy = ArithmeticTask(), ArithmeticTask(careless_rate=0.6)
  clean_recs, noisy_recs = _train_records(base, 4000), _train_records(noisy, 4000)
  # The same problems, in the same order; only the demonstrations differ.
  assert [_key(r) for r in clean_recs] == [_key(r) for r in noisy_recs]
  assert all(r["answer"] == n["answer"] for r, n in zip(clean_recs, noisy_recs, strict=True))
  assert all("demo" not in r for r in clean_recs)
  carry = [r for r in noisy_recs if _needs_carry(*_key(r))]
  written = [noisy.sft_completion(r) for r in carry]
  wrong = sum(w != r["answer"] for w, r in zip(written, carry, strict=True))
  assert all(w in (r["answer"], careless(*_key(r))) for w, r in zip(written, carry, strict=True))
  # Binomial(n, 0.6): five standard deviations either side.
  n = len(carry)
  assert abs(wrong - 0.6 * n) < 5 * (0.24 * n) ** 0.5, (wrong, n)
  no_carry = [r for r in noisy_recs if not _needs_carry(*_key(r))]
  assert all(noisy.sft_completion(r) == r["answer"] for r in no_carry)


def test_careless_rate_never_touches_held_out_records():
  task = ArithmeticTask(max_digits=3, careless_rate=1.0)
  rng = np.random.default_rng(0)
  for _ in range(200):
    record = task.sample(rng, split="held_out")
    assert task.sft_completion(record) == record["answer"] and "demo" not in record
  assert all("demo" not in r for r in task.held_out(50))


@pytest.mark.parametrize("rate", [-0.1, 1.5, True, "0.5"])
def test_bad_careless_rate(rate):
  with pytest.raises(ValueError, match="careless_rate"):
    ArithmeticTask(careless_rate=rate)


def test_eval_breakdown_by_hand():
  task = ArithmeticTask()
  records = [task.record(*p) for p in [(27, "+", 15), (42, "-", 15), (12, "+", 34), (9, "+", 9)]]
  # 27+15: the careless 32; 42-15: right; 12+34: wrong (no carry needed); 9+9: right.
  completions = ["32", " 27\n", "47", "18"]
  assert task.eval_breakdown(records, completions) == {
    "carry_accuracy": 0.5,
    "careless_answers": 0.5,
    "no_carry_accuracy": 0.5,
  }
  # Products have no careless answer: they count as problems without a carry.
  assert task.eval_breakdown([task.record(12, "*", 34)], ["408"]) == {"no_carry_accuracy": 1.0}
