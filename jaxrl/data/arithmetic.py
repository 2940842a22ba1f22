"""Synthetic verifiable arithmetic task ("12+34=" -> "46") with a fixed held-out split."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Literal

import grain
import numpy as np

from jaxrl.data.stream import INDEX_SPACE, indexed_batches

Record = dict[str, Any]
Split = Literal["train", "held_out"]

_ALLOWED_OPS = ("+", "-", "*")
_NUM_BUCKETS = 10_000
# Rejection sampling gives up after this many draws: a split whose probability under the
# sampling distribution is below ~1e-3 is effectively empty and better reported than spun on.
_MAX_ATTEMPTS = 10_000
# Up to this many digits the whole problem space (<= 3 * 10**4 operand pairs) is cheap to
# enumerate, which makes held_out() exact: it can say how many held-out problems exist and
# draw all of them without a coupon-collector wait.
_ENUMERATE_MAX_DIGITS = 2
_OPERAND_DISTS = ("uniform", "by_digits")


def _digit_range(digits: int) -> tuple[int, int]:
  """Inclusive range of the non-negative integers written with exactly `digits` digits."""
  if digits == 1:
    return 0, 9
  return 10 ** (digits - 1), 10**digits - 1


def _bucket(a: int, op: str, b: int) -> int:
  """Stable hash bucket of a problem; blake2b, not hash(), so it survives PYTHONHASHSEED."""
  digest = hashlib.blake2b(f"{a}{op}{b}".encode(), digest_size=8).digest()
  return int.from_bytes(digest, "big") % _NUM_BUCKETS


def _evaluate(a: int, op: str, b: int) -> int:
  if op == "+":
    return a + b
  if op == "-":
    return a - b
  return a * b


def careless(a: int, op: str, b: int) -> str | None:
  """The answer a careless teacher writes for `a op b` (non-negative operands): column by column
  with every carry forgotten (the leftmost column writes its whole sum) for '+', the smaller
  digit taken from the larger in every column for '-' (the classic forgotten borrow), leading
  zeros dropped. It equals the true answer exactly when no column carries (or borrows) into the
  next; None for '*' or a negative operand, whose demonstrations stay correct."""
  if op not in ("+", "-") or a < 0 or b < 0 or (op == "-" and a < b):
    return None
  da, db = str(a)[::-1], str(b)[::-1]
  width = max(len(da), len(db))
  da, db = da.ljust(width, "0"), db.ljust(width, "0")
  cols = [(int(x), int(y)) for x, y in zip(da, db, strict=True)]
  if op == "+":
    digits = [str((x + y) % 10) for x, y in cols[:-1]] + [str(sum(cols[-1]))[::-1]]
  else:
    digits = [str(abs(x - y)) for x, y in cols]
  return str(int("".join(digits)[::-1]))


@dataclasses.dataclass(frozen=True)
class ArithmeticTask:
  """Integer `a op b` problems; the model must complete the prompt with exactly the answer.

  A record is `{"prompt": "12+34=", "answer": "46", "a": 12, "b": 34, "op": "+"}` (no
  spaces; the answer may start with "-" when `allow_negative`). The target completion is the
  answer string; EOS is appended by the tokenizer / rollout loop, not here.

  The held-out split depends only on the problem `(a, op, b)` and `held_out_fraction`, never on
  `max_digits` or `ops`, so a problem held out at one difficulty is held out at every other,
  and raising `held_out_fraction` only adds problems to the held-out set.

  Attributes:
    max_digits: operands have 1..max_digits digits (1..9); this sets the difficulty.
    ops: operators to draw from, a non-empty subset of ('+', '-', '*').
    held_out_fraction: fraction of problems (by stable hash) reserved for evaluation, in (0, 1).
    allow_negative: for '-', when False the operands are swapped so the result is >= 0.
    operand_dist: "uniform" draws each operand uniformly from [0, 10**max_digits), i.e. every
      problem is equally likely and the held-out set is an i.i.d.-like sample of the training
      distribution; "by_digits" first draws the digit count uniformly (easy problems weigh more).
    careless_rate: the share of training demonstrations (`sft_completion`) of problems that need
      a carry or a borrow that are written by a careless teacher, who forgets it (`careless`):
      27+15= -> 32, 42-15= -> 33 (the smaller digit taken from the larger). Which records are
      careless is drawn with the record, so it depends only on (seed, index). Rewards and the
      held-out set always use the true answer; 0 (the default) draws nothing extra.
    tool_rate: the share of training demonstrations written with a GSM8K-style calculator call,
      "<<12*34=408>>408" (`jaxrl.rollout.multiturn.CalculatorEnv` answers such calls in RL);
      drawn after careless_rate, from the record's own stream; 0 draws nothing.
  """

  max_digits: int = 2
  ops: tuple[str, ...] = ("+", "-")
  held_out_fraction: float = 0.1
  allow_negative: bool = False
  operand_dist: str = "uniform"
  careless_rate: float = 0.0
  tool_rate: float = 0.0

  def __post_init__(self):
    if isinstance(self.max_digits, bool) or not isinstance(self.max_digits, int):
      raise ValueError(f"max_digits must be an int in 1..9, got {self.max_digits!r}")
    if not 1 <= self.max_digits <= 9:
      raise ValueError(f"max_digits must be in 1..9, got {self.max_digits}")
    if isinstance(self.ops, str) or not isinstance(self.ops, tuple | list):
      raise ValueError(f"ops must be a tuple of operators from {_ALLOWED_OPS}, got {self.ops!r}")
    if not self.ops:
      raise ValueError(f"ops must be a non-empty subset of {_ALLOWED_OPS}, got ()")
    bad = [op for op in self.ops if op not in _ALLOWED_OPS]
    if bad:
      raise ValueError(f"ops must be a subset of {_ALLOWED_OPS}, got unknown {bad}")
    if len(set(self.ops)) != len(self.ops):
      raise ValueError(f"ops must not repeat an operator, got {self.ops}")
    # A list from a config would make the frozen dataclass unhashable.
    object.__setattr__(self, "ops", tuple(self.ops))
    if not isinstance(self.held_out_fraction, int | float) or not (
      0.0 < self.held_out_fraction < 1.0
    ):
      raise ValueError(
        f"held_out_fraction must be a float in (0, 1) exclusive, got {self.held_out_fraction!r}"
      )
    if not isinstance(self.allow_negative, bool):
      raise ValueError(f"allow_negative must be a bool, got {self.allow_negative!r}")
    if self.operand_dist not in _OPERAND_DISTS:
      raise ValueError(f"operand_dist must be one of {_OPERAND_DISTS}, got {self.operand_dist!r}")
    for name in ("careless_rate", "tool_rate"):
      rate = getattr(self, name)
      if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0.0 <= rate <= 1.0:
        raise ValueError(f"{name} must be a float in [0, 1], got {rate!r}")

  # ---------------------------------------------------------------------------------- problems

  def is_held_out(self, a: int, op: str, b: int) -> bool:
    """Whether problem `a op b` (as shown in the prompt) belongs to the held-out split."""
    return _bucket(a, op, b) < self.held_out_fraction * _NUM_BUCKETS

  def record(self, a: int, op: str, b: int) -> Record:
    """The record for problem `a op b`."""
    a, b = int(a), int(b)
    return {
      "prompt": f"{a}{op}{b}=",
      "answer": str(_evaluate(a, op, b)),
      "a": a,
      "b": b,
      "op": op,
    }

  def sft_task(self, sft) -> ArithmeticTask:
    """The warm-start's data mix (config.sft): its own operand distribution and the careless
    teacher's rate; RL prompts and the held-out set keep this task's."""
    return dataclasses.replace(
      self,
      operand_dist=sft.operand_dist,
      careless_rate=sft.careless_rate,
      tool_rate=getattr(sft, "tool_rate", 0.0),
    )

  def sft_completion(self, record: Record) -> str:
    """The demonstration (without EOS) for `record`: the answer, or the careless teacher's
    answer when `sample` drew this record as careless (see `careless_rate`)."""
    return record.get("demo", record["answer"])

  def _draw_operand(self, rng: np.random.Generator) -> int:
    if self.operand_dist == "uniform":
      return int(rng.integers(0, 10**self.max_digits))
    # Digit count first, then the value: easy (short) operands weigh as much as long ones.
    lo, hi = _digit_range(int(rng.integers(1, self.max_digits + 1)))
    return int(rng.integers(lo, hi + 1))

  def _draw(self, rng: np.random.Generator) -> tuple[int, str, int]:
    op = self.ops[int(rng.integers(len(self.ops)))]
    a = self._draw_operand(rng)
    b = self._draw_operand(rng)
    if op == "-" and not self.allow_negative and a < b:
      a, b = b, a
    return a, op, b

  def sample(self, rng: np.random.Generator, *, split: Split = "train") -> Record:
    """Draws one problem of `split` (rejection sampling on the held-out predicate).

    Operands follow `operand_dist`; the operator is uniform over `ops`.
    """
    if split not in ("train", "held_out"):
      raise ValueError(f"split must be 'train' or 'held_out', got {split!r}")
    want_held_out = split == "held_out"
    for _ in range(_MAX_ATTEMPTS):
      a, op, b = self._draw(rng)
      if self.is_held_out(a, op, b) == want_held_out:
        record = self.record(a, op, b)
        # Drawn after the problem, so the problems are those of careless_rate = 0.
        if not want_held_out and self.careless_rate > 0.0 and rng.random() < self.careless_rate:
          demo = careless(a, op, b)
          if demo is not None:
            record["demo"] = demo
        if not want_held_out and self.tool_rate > 0.0 and rng.random() < self.tool_rate:
          call = f"<<{a}{op}{b}={record['answer']}>>"
          record["demo"] = call + record["answer"]  # a careless answer is the tool's to fix
        return record
    raise ValueError(
      f"no {split!r} problem found in {_MAX_ATTEMPTS} draws: held_out_fraction="
      f"{self.held_out_fraction} leaves the {split!r} split (nearly) empty for "
      f"max_digits={self.max_digits}, ops={self.ops}"
    )

  def eval_breakdown(self, records: list[Record], completions: list[str]) -> dict[str, float]:
    """Held-out accuracy split by whether a problem needs a carry (or borrow) between columns,
    and the share of those answered exactly as the careless teacher would (`careless`): the
    error a warm-start on careless demonstrations learns, and RL has to unlearn."""
    carry, plain, careless_hits = [], [], 0
    for record, text in zip(records, completions, strict=True):
      right = text.strip() == record["answer"]
      slip = careless(record["a"], record["op"], record["b"])
      if slip is not None and slip != record["answer"]:
        carry.append(right)
        careless_hits += text.strip() == slip
      else:
        plain.append(right)
    out = {}
    if carry:
      out["carry_accuracy"] = float(np.mean(carry))
      out["careless_answers"] = careless_hits / len(carry)
    if plain:
      out["no_carry_accuracy"] = float(np.mean(plain))
    return out

  # ------------------------------------------------------------------------------------ splits

  def _held_out_problems(self) -> tuple[list[tuple[int, str, int]], np.ndarray]:
    """Every distinct held-out problem and its probability under `_draw` (small spaces only)."""
    operand_p = np.full(10**self.max_digits, 10.0**-self.max_digits)
    if self.operand_dist == "by_digits":
      for digits in range(1, self.max_digits + 1):
        lo, hi = _digit_range(digits)
        operand_p[lo : hi + 1] = 1.0 / (self.max_digits * (hi - lo + 1))
    probs: dict[tuple[int, str, int], float] = {}
    for op in self.ops:
      for a in range(operand_p.size):
        for b in range(operand_p.size):
          problem = (a, op, b)
          if op == "-" and not self.allow_negative and a < b:
            problem = (b, op, a)
          if self.is_held_out(*problem):
            probs[problem] = probs.get(problem, 0.0) + operand_p[a] * operand_p[b] / len(self.ops)
    return list(probs), np.array(list(probs.values()))

  def held_out(self, n: int, seed: int = 0) -> list[Record]:
    """`n` distinct held-out records, deterministic for `seed`.

    Problems are drawn without replacement in proportion to `sample`'s distribution, so the
    evaluation set has the same difficulty mix as training.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
      raise ValueError(f"n must be a non-negative int, got {n!r}")
    # The trailing tag keeps this stream apart from the training stream default_rng([seed, i]).
    rng = np.random.default_rng([seed, INDEX_SPACE])
    if self.max_digits <= _ENUMERATE_MAX_DIGITS:
      problems, p = self._held_out_problems()
      if n > len(problems):
        raise ValueError(
          f"asked for n={n} held-out problems but only {len(problems)} distinct ones exist for "
          f"max_digits={self.max_digits}, ops={self.ops}, "
          f"held_out_fraction={self.held_out_fraction}; lower n or raise one of those"
        )
      if n == 0:
        return []
      idx = rng.choice(len(problems), size=n, replace=False, p=p / p.sum())
      return [self.record(*problems[i]) for i in idx]

    seen: set[str] = set()
    records = []
    # Big spaces hold >= ~5e5 problems per operator, so collisions are rare and this cap is
    # only reached when the held-out split is genuinely too small for n.
    for _ in range(100 * n + _MAX_ATTEMPTS):
      if len(records) == n:
        return records
      record = self.sample(rng, split="held_out")
      if record["prompt"] not in seen:
        seen.add(record["prompt"])
        records.append(record)
    if len(records) == n:
      return records
    raise ValueError(
      f"asked for n={n} held-out problems but found only {len(records)} distinct ones for "
      f"max_digits={self.max_digits}, ops={self.ops}, held_out_fraction={self.held_out_fraction}"
    )

  def train_dataset(self, *, seed: int, batch_size: int) -> grain.IterDataset:
    """An effectively infinite, checkpointable stream of training batches.

    Each element is a LIST of `batch_size` record dicts. Record `i` (counting across batches)
    is `sample(np.random.default_rng([seed, i]), split="train")`, so it depends only on
    `(seed, i)` and never on the iteration history.

    `iter(ds).get_state()` is grain's `{"next_index": k}`, a plain dict of ints (JSON-ready as
    is) where `k` counts BATCHES already returned. Resume with `it.set_state(state)` on a fresh
    iterator from a dataset built with the same `seed` and `batch_size`: with another
    batch_size the same state points at different records.
    """
    return indexed_batches(
      lambda rng: self.sample(rng, split="train"), seed=seed, batch_size=batch_size
    )
