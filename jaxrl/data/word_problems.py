"""Synthetic GSM8K-format word problems (multi-step, "#### n" answers), seeded, no download."""

import json
import os
from collections.abc import Callable

import numpy as np

Problem = dict[str, str]

_NAMES = ("Natalia", "Weng", "Betty", "Julie", "James", "Maria", "Tom", "Aisha", "Kenji", "Olga")
_ITEMS = ("clips", "apples", "stickers", "marbles", "cookies", "books", "pencils", "shells")


def _sold_half(rng: np.random.Generator) -> Problem:
  name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
  first = 2 * int(rng.integers(5, 60))
  second = first // 2
  total = first + second
  return {
    "question": f"{name} sold {first} {item} in April, and then sold half as many {item} in "
    f"May. How many {item} did {name} sell altogether in April and May?",
    "answer": f"{name} sold {first}/2 = {second} {item} in May.\n"
    f"{name} sold {first}+{second} = {total} {item} altogether in April and May.\n#### {total}",
  }


def _hourly_wage(rng: np.random.Generator) -> Problem:
  name = rng.choice(_NAMES)
  rate = int(rng.integers(6, 31))
  hours = int(rng.integers(2, 9))
  extra = int(rng.integers(1, 20))
  earned = rate * hours
  total = earned + extra
  return {
    "question": f"{name} earns ${rate} an hour for babysitting. This week {name} babysat for "
    f"{hours} hours and also got a ${extra} tip. How much money did {name} make this week?",
    "answer": f"For babysitting {name} earned {rate}*{hours} = ${earned}.\n"
    f"With the tip that is {earned}+{extra} = ${total}.\n#### {total}",
  }


def _boxes(rng: np.random.Generator) -> Problem:
  name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
  boxes = int(rng.integers(2, 13))
  per_box = int(rng.integers(3, 25))
  given = int(rng.integers(1, boxes * per_box))
  have = boxes * per_box
  left = have - given
  return {
    "question": f"{name} buys {boxes} boxes of {item} with {per_box} {item} in each box. "
    f"{name} gives {given} {item} to friends. How many {item} does {name} have left?",
    "answer": f"{name} buys {boxes}*{per_box} = {have} {item}.\n"
    f"After giving some away, {name} has {have}-{given} = {left} {item} left.\n#### {left}",
  }


def _saving(rng: np.random.Generator) -> Problem:
  name = rng.choice(_NAMES)
  price = 10 * int(rng.integers(5, 40))
  saved = int(rng.integers(0, price // 2))
  weekly = int(rng.integers(5, 30))
  remaining = price - saved
  weeks = -(-remaining // weekly)  # ceiling: a partial week still has to be waited out
  return {
    "question": f"{name} wants a bike that costs ${price}. {name} has already saved ${saved} "
    f"and saves ${weekly} every week. How many weeks will it take {name} to have enough money?",
    "answer": f"{name} still needs {price}-{saved} = ${remaining}.\n"
    f"At ${weekly} a week that takes {remaining}/{weekly}, rounded up, = {weeks} weeks.\n"
    f"#### {weeks}",
  }


def _shared_cost(rng: np.random.Generator) -> Problem:
  name = rng.choice(_NAMES)
  people = int(rng.integers(2, 7))
  share = int(rng.integers(3, 40))
  pizzas = int(rng.integers(1, 6))
  pizza_price = int(rng.integers(8, 21))
  drinks = people * share - pizzas * pizza_price
  if drinks <= 0:  # keep the story consistent: the drinks cannot cost a negative amount
    share += -(-(1 - drinks) // people)
    drinks = people * share - pizzas * pizza_price
  total = people * share
  return {
    "question": f"{name} and {people - 1} friends split a bill evenly, each paying ${share}. "
    f"They bought {pizzas} pizzas at ${pizza_price} each, and drinks for the rest. How many "
    "dollars did the drinks cost?",
    "answer": f"The bill was {people}*{share} = ${total}.\n"
    f"The pizzas cost {pizzas}*{pizza_price} = ${pizzas * pizza_price}.\n"
    f"The drinks cost {total}-{pizzas * pizza_price} = ${drinks}.\n#### {drinks}",
  }


TEMPLATES: tuple[Callable[[np.random.Generator], Problem], ...] = (
  _sold_half,
  _hourly_wage,
  _boxes,
  _saving,
  _shared_cost,
)


def problem(seed: int, index: int) -> Problem:
  """Problem `index` of stream `seed`: {"question": str, "answer": "<steps>\\n#### <n>"}.

  It depends only on `(seed, index)`; the template is drawn uniformly from `TEMPLATES`.
  """
  rng = np.random.default_rng([seed, index])
  return TEMPLATES[int(rng.integers(len(TEMPLATES)))](rng)


def generate(n: int, seed: int = 0) -> list[Problem]:
  """`n` problems in GSM8K's record format (fields "question" and "answer")."""
  if isinstance(n, bool) or not isinstance(n, int) or n < 0:
    raise ValueError(f"n must be a non-negative int, got {n!r}")
  if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
    raise ValueError(f"seed must be a non-negative int, got {seed!r}")
  return [problem(seed, i) for i in range(n)]


def write_jsonl(path: str | os.PathLike, n: int, seed: int = 0) -> str:
  """Writes `generate(n, seed)` to `path`, one JSON object a line; returns the path.

  The file is written to a temporary name and renamed, so a crash leaves no half file.
  """
  path = os.fspath(path)
  records = generate(n, seed)
  tmp = f"{path}.tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    for record in records:
      f.write(json.dumps(record, ensure_ascii=False) + "\n")
  os.replace(tmp, path)
  return path
