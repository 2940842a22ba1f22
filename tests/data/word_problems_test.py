"""Synthetic word problems: GSM8K format, arithmetic that checks out, determinism, JSONL output."""

import json
import math
import re

import pytest

from jaxrl.data import word_problems
from jaxrl.data.jsonl import JsonlTask, final_answer
from jaxrl.rewards import get

_STEP_RE = re.compile(r"(\d+)([*+/-])(\d+) = \$?(\d+)")
_CEIL_RE = re.compile(r"(\d+)/(\d+), rounded up, = (\d+)")
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def _check(problem):
  assert set(problem) == {"question", "answer"}
  assert problem["question"].endswith("?")
  *steps, last = problem["answer"].split("\n")
  assert re.fullmatch(r"#### \d+", last), last
  results = []
  for step in steps:
    if m := _CEIL_RE.search(step):
      a, b, c = map(int, m.groups())
      assert math.ceil(a / b) == c, step
      results.append(c)
    elif m := _STEP_RE.search(step):
      a, op, b, c = m.groups()
      a, b, c = int(a), int(b), int(c)
      assert (a / b if op == "/" else _OPS[op](a, b)) == c, step
      results.append(c)
    else:
      raise AssertionError(f"step without a checkable equation: {step!r}")
  assert results[-1] == int(final_answer(problem["answer"])) >= 0  # the last step is the answer


def test_problems_are_well_formed_and_correct():
  problems = word_problems.generate(300, seed=3)
  for p in problems:
    _check(p)
  # Every template shows up, and the stream is not degenerate.
  kinds = {p["question"].split(" ", 2)[1] for p in problems}
  assert len(kinds) >= 4
  assert len({p["question"] for p in problems}) > 290


def test_deterministic_by_seed_and_index():
  a = word_problems.generate(20, seed=5)
  assert a == word_problems.generate(20, seed=5)
  assert a[7] == word_problems.problem(5, 7)
  assert a[:10] == word_problems.generate(10, seed=5)  # a prefix does not depend on n
  assert a != word_problems.generate(20, seed=6)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_bad_arguments(bad):
  with pytest.raises(ValueError, match="n must be a non-negative int"):
    word_problems.generate(bad)
  with pytest.raises(ValueError, match="seed must be a non-negative int"):
    word_problems.generate(3, seed=bad)


def test_write_jsonl_round_trips_through_jsonl_task_and_reward(tmp_path):
  path = word_problems.write_jsonl(tmp_path / "wp.jsonl", 25, seed=2)
  with open(path) as f:
    lines = [json.loads(line) for line in f]
  assert lines == word_problems.generate(25, seed=2)
  assert not (tmp_path / "wp.jsonl.tmp").exists()
  task = JsonlTask(path)
  reward = get("gsm8k")
  for record, problem in zip(task.records(), lines, strict=True):
    assert record["prompt"] == problem["question"]
    # The reference solution earns full reward; an off-by-one answer earns none.
    assert reward(task.sft_completion(record), record) == 1.0
    assert reward(f"#### {int(record['answer']) + 1}", record) == 0.0
