"""A long-tailed verifiable task: sums of a heavy-tailed number of digits, with a scratchpad.

"3+5+2+8=" is answered with the running sums "8,10,18": a completion's length grows with the
number of terms, and the number of terms follows a power law (P(k) ~ k**-tail on
[min_terms, max_terms]), so most completions are a few tokens long and a few are many times
longer. It is where a synchronous rollout phase waits on its longest sequences and partial
rollouts have something to win (jaxrl.rl.partial), at a size a CPU trains in minutes.

The reward is `final_number` (jaxrl.rewards.exact_match): the completion's last integer must
be the sum; the scratchpad is what the warm-start demonstrates, not what the reward demands.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from typing import Any, Literal

import grain
import numpy as np

from jaxrl.data.stream import distinct_held_out, indexed_batches

Record = dict[str, Any]
Split = Literal["train", "held_out"]

_NUM_BUCKETS = 10_000
_MAX_ATTEMPTS = 10_000
_DIGITS = re.compile(r"\d+")


def _bucket(terms) -> int:
  """Stable hash bucket of a problem (blake2b, not hash(): it survives PYTHONHASHSEED)."""
  digest = hashlib.blake2b("+".join(map(str, terms)).encode(), digest_size=8).digest()
  return int.from_bytes(digest, "big") % _NUM_BUCKETS


def scratchpad(terms) -> str:
  """The running sums after each addition: [3, 5, 2, 8] -> "8,10,18"."""
  sums = np.cumsum(terms)[1:]
  return ",".join(str(int(s)) for s in sums)


@dataclasses.dataclass(frozen=True)
class ChainSumTask:
  """Sums of k single digits, k drawn with P(k) proportional to k**-tail on [min_terms,
  max_terms]. A record is `{"prompt": "3+5+2=", "answer": "10", "terms": [3, 5, 2]}`; the
  warm-start's demonstration is the scratchpad "8,10" (`sft_completion`).

  The held-out split depends only on the problem (a stable hash of its terms) and
  `held_out_fraction`, as in ArithmeticTask.
  """

  min_terms: int = 2
  max_terms: int = 10
  tail: float = 2.0
  held_out_fraction: float = 0.1

  def __post_init__(self):
    for name in ("min_terms", "max_terms"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < 2:
        raise ValueError(f"{name} must be an int >= 2, got {v!r}")
    if self.max_terms < self.min_terms:
      raise ValueError(f"max_terms={self.max_terms} must be >= min_terms={self.min_terms}")
    if not isinstance(self.tail, int | float) or self.tail < 0:
      raise ValueError(f"tail must be a float >= 0 (0 = uniform over k), got {self.tail!r}")
    if not 0.0 < self.held_out_fraction < 1.0:
      raise ValueError(f"held_out_fraction must be in (0, 1), got {self.held_out_fraction!r}")

  @property
  def term_probs(self) -> np.ndarray:
    """P(k) for k = min_terms .. max_terms."""
    k = np.arange(self.min_terms, self.max_terms + 1, dtype=np.float64)
    p = k**-self.tail
    return p / p.sum()

  def record(self, terms) -> Record:
    terms = [int(t) for t in terms]
    return {"prompt": "+".join(map(str, terms)) + "=", "answer": str(sum(terms)), "terms": terms}

  def is_held_out(self, terms) -> bool:
    return _bucket(terms) < self.held_out_fraction * _NUM_BUCKETS

  def sft_task(self, sft) -> ChainSumTask:
    """The warm-start's problems are the RL problems (config.sft's arithmetic data-mix fields
    do not apply)."""
    del sft
    return self

  def sft_completion(self, record: Record) -> str:
    return scratchpad(record["terms"])

  def sample(self, rng: np.random.Generator, *, split: Split = "train") -> Record:
    if split not in ("train", "held_out"):
      raise ValueError(f"split must be 'train' or 'held_out', got {split!r}")
    want = split == "held_out"
    ks = np.arange(self.min_terms, self.max_terms + 1)
    p = self.term_probs
    for _ in range(_MAX_ATTEMPTS):
      k = int(rng.choice(ks, p=p))
      terms = rng.integers(0, 10, size=k).tolist()
      if self.is_held_out(terms) == want:
        return self.record(terms)
    raise ValueError(f"no {split!r} problem found in {_MAX_ATTEMPTS} draws")

  def eval_breakdown(self, records: list[Record], completions: list[str]) -> dict[str, float]:
    """Held-out accuracy on short chains (the shortest half of the term counts) and long ones:
    where a long tail of lengths shows in what the model gets right."""
    mid = (self.min_terms + self.max_terms) // 2
    short, long = [], []
    for record, text in zip(records, completions, strict=True):
      right = final_number(text) == record["answer"]
      (short if len(record["terms"]) <= mid else long).append(right)
    out = {}
    if short:
      out["short_chain_accuracy"] = float(np.mean(short))
    if long:
      out["long_chain_accuracy"] = float(np.mean(long))
    return out

  def held_out(self, n: int, seed: int = 0) -> list[Record]:
    """`n` distinct held-out problems drawn from the training distribution, fixed by `seed`."""
    draw = lambda rng: self.sample(rng, split="held_out")
    return distinct_held_out(draw, n, seed, max_attempts=_MAX_ATTEMPTS)

  def train_dataset(self, *, seed: int, batch_size: int) -> grain.IterDataset:
    """Batches (lists) of `batch_size` records; record i is drawn from default_rng([seed, i]),
    so the stream is checkpointable as grain's {"next_index": batches returned}."""
    return indexed_batches(
      lambda rng: self.sample(rng, split="train"), seed=seed, batch_size=batch_size
    )


def final_number(text: str) -> str | None:
  """The last run of digits in `text` ("8,10,18" -> "18"), or None."""
  found = _DIGITS.findall(text)
  return found[-1] if found else None
