"""Exact-match reward: 1 when the completion is the record's answer, else 0."""

from typing import Any

from jaxrl.rewards import registry


@registry.register("exact_match")
def exact_match(completion: str, record: dict[str, Any]) -> float:
  """1.0 iff `completion`, stripped of surrounding whitespace, equals `record["answer"]`."""
  return 1.0 if completion.strip() == record["answer"] else 0.0
