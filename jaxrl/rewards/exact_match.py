"""Exact-match rewards: 1 when the completion (or its final number) is the record's answer."""

from typing import Any

from jaxrl.data.chain import final_number
from jaxrl.rewards import registry


@registry.register("exact_match")
def exact_match(completion: str, record: dict[str, Any]) -> float:
  """1.0 iff `completion`, stripped of surrounding whitespace, equals `record["answer"]`."""
  return 1.0 if completion.strip() == record["answer"] else 0.0


@registry.register("final_number")
def final_number_match(completion: str, record: dict[str, Any]) -> float:
  """1.0 iff the last run of digits in `completion` is `record["answer"]`: a scratchpad may
  come before it ("8,10,18" answers 3+5+2+8=)."""
  return 1.0 if final_number(completion) == record["answer"] else 0.0
