"""A small code task: write a Python function from its input/output examples, checked by
running it against tests on unseen inputs in the sandbox (jaxrl.rewards.code).

The prompt shows f at x = 0, 1, 2 and opens the function; the completion is its body:

    f(0)=2,f(1)=5,f(2)=8
    def f(x):return 3*x+2

f is a polynomial `c*x*x + a*x + b` with integer coefficients (c = 0 unless `max_degree` is
2); the tests call it at inputs the prompt does not show (3, 5, -2, 10), so a lookup table of
the examples fails and any expression equal to f passes. Small enough for the byte-level model
to learn on a CPU; it exercises the whole code-reward path: a sandboxed process per completion.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Literal

import grain
import numpy as np

from jaxrl.data.stream import distinct_held_out, indexed_batches

Record = dict[str, Any]
Split = Literal["train", "held_out"]

_NUM_BUCKETS = 10_000
_MAX_ATTEMPTS = 10_000
SHOWN_INPUTS = (0, 1, 2)
TEST_INPUTS = (3, 5, -2, 10)
CODE_PREFIX = "def f(x):return "


def _bucket(coefs) -> int:
  """Stable hash bucket of a problem (blake2b, not hash(): it survives PYTHONHASHSEED)."""
  digest = hashlib.blake2b(repr(tuple(coefs)).encode(), digest_size=8).digest()
  return int.from_bytes(digest, "big") % _NUM_BUCKETS


def _term(coef: int, var: str, first: bool) -> str:
  """One signed term: (3, "x") -> "+3*x", (-1, "x") -> "-x", (2, "") -> "+2"."""
  if coef == 0:
    return ""
  sign = "-" if coef < 0 else ("" if first else "+")
  magnitude = abs(coef)
  if not var:
    return f"{sign}{magnitude}"
  return f"{sign}{var}" if magnitude == 1 else f"{sign}{magnitude}*{var}"


def expression(c: int, a: int, b: int) -> str:
  """The canonical body for c*x*x + a*x + b: "3*x+2", "-x", "x*x-4", "0"."""
  out = ""
  for coef, var in ((c, "x*x"), (a, "x"), (b, "")):
    out += _term(coef, var, first=not out)
  return out or "0"


@dataclasses.dataclass(frozen=True)
class FunctionTask:
  """Integer polynomials of degree <= `max_degree` with coefficients in [-max_coef, max_coef].

  A record is `{"prompt": "f(0)=2,f(1)=5,f(2)=8\\ndef f(x):return ", "answer": "3*x+2",
  "code_prefix": "def f(x):return ", "tests": ["f(3)==11", ...], "coefs": [0, 3, 2]}`: the
  program run is `code_prefix + completion` followed by the tests (each a Python expression
  that must be True). The held-out split depends only on the coefficients.
  """

  max_coef: int = 9
  max_degree: int = 1
  held_out_fraction: float = 0.1

  def __post_init__(self):
    if isinstance(self.max_coef, bool) or not isinstance(self.max_coef, int):
      raise ValueError(f"max_coef must be an int in 1..99, got {self.max_coef!r}")
    if not 1 <= self.max_coef <= 99:
      raise ValueError(f"max_coef must be in 1..99, got {self.max_coef}")
    if self.max_degree not in (1, 2):
      raise ValueError(f"max_degree must be 1 or 2, got {self.max_degree!r}")
    if not 0.0 < self.held_out_fraction < 1.0:
      raise ValueError(f"held_out_fraction must be in (0, 1), got {self.held_out_fraction!r}")

  def record(self, c: int, a: int, b: int) -> Record:
    c, a, b = int(c), int(a), int(b)

    def f(x: int) -> int:
      return c * x * x + a * x + b

    shown = ",".join(f"f({x})={f(x)}" for x in SHOWN_INPUTS)
    return {
      "prompt": f"{shown}\n{CODE_PREFIX}",
      "answer": expression(c, a, b),
      "code_prefix": CODE_PREFIX,
      "tests": [f"f({x})=={f(x)}" for x in TEST_INPUTS],
      "coefs": [c, a, b],
    }

  def is_held_out(self, coefs) -> bool:
    return _bucket(coefs) < self.held_out_fraction * _NUM_BUCKETS

  def sft_task(self, sft) -> FunctionTask:
    """The warm-start's problems are the RL problems."""
    del sft
    return self

  def sft_completion(self, record: Record) -> str:
    return record["answer"]

  def sample(self, rng: np.random.Generator, *, split: Split = "train") -> Record:
    if split not in ("train", "held_out"):
      raise ValueError(f"split must be 'train' or 'held_out', got {split!r}")
    want = split == "held_out"
    k = self.max_coef
    for _ in range(_MAX_ATTEMPTS):
      c = int(rng.integers(-k, k + 1)) if self.max_degree == 2 else 0
      a, b = (int(v) for v in rng.integers(-k, k + 1, size=2))
      if self.is_held_out((c, a, b)) == want:
        return self.record(c, a, b)
    raise ValueError(f"no {split!r} problem found in {_MAX_ATTEMPTS} draws")

  def held_out(self, n: int, seed: int = 0) -> list[Record]:
    """`n` distinct held-out problems, fixed by `seed`."""
    draw = lambda rng: self.sample(rng, split="held_out")
    return distinct_held_out(draw, n, seed, max_attempts=_MAX_ATTEMPTS)

  def train_dataset(self, *, seed: int, batch_size: int) -> grain.IterDataset:
    """Batches of `batch_size` records; record i is drawn from default_rng([seed, i])."""
    return indexed_batches(
      lambda rng: self.sample(rng, split="train"), seed=seed, batch_size=batch_size
    )
