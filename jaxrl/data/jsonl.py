"""Prompt/answer records from a local JSONL or Parquet file (GSM8K by default), served by grain."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from typing import Any, Literal

import grain
import numpy as np

from jaxrl.data.stream import record_batches

Record = dict[str, Any]
Split = Literal["train", "held_out"]

_ANSWER_FORMATS = ("gsm8k", "raw")
_NUM_BUCKETS = 10_000
# Record `i` of the infinite training stream is epoch i // n, position i % n; 2**40 is "infinite".
_TRAIN_INDEX_SPACE = 2**40


class RecordError(ValueError):
  """A dataset record that is malformed; the message names the file, line and field."""


def final_answer(solution: str) -> str | None:
  """GSM8K's final answer: the text after the last "####", stripped ("72", "1,000"), or None."""
  if "####" not in solution:
    return None
  answer = solution.rsplit("####", 1)[1].strip()
  return answer or None


def _read_rows(path: str) -> list[tuple[int, Any]]:
  """(1-based line or row number, decoded value) for each record of a JSONL / Parquet file."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f"dataset file {path!r} does not exist")
  if path.endswith(".parquet"):
    try:
      import pyarrow.parquet as pq
    except ImportError:
      raise ImportError(
        f"reading {path!r} needs pyarrow, which is not installed; `pip install pyarrow` or "
        "convert the file to JSONL"
      ) from None
    return list(enumerate(pq.read_table(path).to_pylist(), start=1))
  rows = []
  with open(path, "rb") as f:
    for line_no, raw in enumerate(f, start=1):
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise RecordError(
          f"{path}:{line_no}: not UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1}); "
          "JSONL files must be UTF-8 encoded"
        ) from None
      if not line.strip():
        continue  # a trailing newline or blank separator is not a record
      try:
        rows.append((line_no, json.loads(line)))
      except json.JSONDecodeError as e:
        raise RecordError(f"{path}:{line_no}: not valid JSON ({e.msg})") from None
  return rows


def _bucket(prompt: str) -> int:
  """Stable hash bucket of a prompt; blake2b, not hash(), so it survives PYTHONHASHSEED."""
  digest = hashlib.blake2b(prompt.encode("utf-8"), digest_size=8).digest()
  return int.from_bytes(digest, "big") % _NUM_BUCKETS


@dataclasses.dataclass(frozen=True)
class JsonlTask:
  """Prompts with verifiable final answers, read from a local file; GSM8K's layout by default.

  Each line of a JSONL file (or row of a Parquet file, which needs pyarrow) is an object with a
  prompt field and an answer field. It becomes the record
  `{"prompt": <prompt field>, "answer": <final answer>, "solution": <answer field>, ...}`
  plus every other field of the line, unchanged. With `answer_format="gsm8k"` the final answer is
  the text after the last "####" of the answer field ("... #### 72" -> "72"); with "raw" it is
  the whole answer field, stripped. Every record is checked when the task is built; a bad one
  raises `RecordError` naming the file, the line and the field.

  The held-out split is either `held_out_path` (a second file in the same format) or, without
  one, the records whose prompt hashes into `held_out_fraction` of the buckets (as in
  `ArithmeticTask`: the split depends only on the prompt text, so duplicates of a prompt land on
  the same side). With neither, there is no held-out split and `held_out` raises.

  Same API as `ArithmeticTask`: `train_dataset(seed=, batch_size=)`, `held_out(n, seed=)`,
  `sft_completion(record)`; the RL loop can take either task. The reward for GSM8K-style
  records is `jaxrl.rewards.get("gsm8k")` (or "math_verify").

  Attributes:
    path: the training file (.jsonl, or .parquet).
    held_out_path: an optional evaluation file; when set, `held_out_fraction` must be 0.
    held_out_fraction: fraction of `path`'s prompts held out by hash, in [0, 1).
    prompt_field: the field holding the prompt ("question" for GSM8K).
    answer_field: the field holding the answer ("answer" for GSM8K).
    answer_format: "gsm8k" (final answer after "####") or "raw" (the field itself).
  """

  path: str
  held_out_path: str | None = None
  held_out_fraction: float = 0.0
  prompt_field: str = "question"
  answer_field: str = "answer"
  answer_format: str = "gsm8k"

  def __post_init__(self):
    object.__setattr__(self, "path", os.fspath(self.path))
    if self.held_out_path is not None:
      object.__setattr__(self, "held_out_path", os.fspath(self.held_out_path))
    if (
      isinstance(self.held_out_fraction, bool)
      or not isinstance(self.held_out_fraction, int | float)
      or not 0.0 <= self.held_out_fraction < 1.0
    ):
      raise ValueError(f"held_out_fraction must be in [0, 1), got {self.held_out_fraction!r}")
    if self.held_out_path is not None and self.held_out_fraction:
      raise ValueError(
        "set either held_out_path or held_out_fraction, not both: got held_out_path="
        f"{self.held_out_path!r} and held_out_fraction={self.held_out_fraction}"
      )
    for name in ("prompt_field", "answer_field"):
      if not isinstance(getattr(self, name), str) or not getattr(self, name):
        raise ValueError(f"{name} must be a non-empty str, got {getattr(self, name)!r}")
    if self.answer_format not in _ANSWER_FORMATS:
      raise ValueError(
        f"answer_format must be one of {_ANSWER_FORMATS}, got {self.answer_format!r}"
      )
    # Read and check every record now, not mid-run; not a field, so eq / hash / repr skip it.
    object.__setattr__(self, "_split_records", self._load_splits())

  # ----------------------------------------------------------------------------------- records

  def _record(self, path: str, line_no: int, row: Any) -> Record:
    where = f"{path}:{line_no}"
    if not isinstance(row, dict):
      raise RecordError(f"{where}: a record must be a JSON object, got {type(row).__name__}")
    for name in (self.prompt_field, self.answer_field):
      if name not in row:
        raise RecordError(f"{where}: missing field {name!r} (fields present: {sorted(row)})")
    prompt, solution = row[self.prompt_field], row[self.answer_field]
    if not isinstance(prompt, str) or not prompt.strip():
      raise RecordError(f"{where}: field {self.prompt_field!r} must be a non-empty string")
    if isinstance(solution, int | float) and not isinstance(solution, bool):
      solution = str(solution)  # "answer": 72 is a fine raw answer
    if not isinstance(solution, str) or not solution.strip():
      raise RecordError(f"{where}: field {self.answer_field!r} must be a non-empty string")
    if self.answer_format == "gsm8k":
      answer = final_answer(solution)
      if answer is None:
        raise RecordError(
          f"{where}: field {self.answer_field!r} must end with '#### <final answer>' "
          f"(answer_format='gsm8k'), got {solution[-60:]!r}"
        )
    else:
      answer = solution.strip()
    extra = {k: v for k, v in row.items() if k not in (self.prompt_field, self.answer_field)}
    return {**extra, "prompt": prompt, "answer": answer, "solution": solution}

  def _load(self, path: str) -> list[Record]:
    records = [self._record(path, line_no, row) for line_no, row in _read_rows(path)]
    if not records:
      raise RecordError(f"{path}: the file holds no records")
    return records

  def _load_splits(self) -> tuple[tuple[Record, ...], tuple[Record, ...]]:
    records = self._load(self.path)
    if self.held_out_path is not None:
      return tuple(records), tuple(self._load(self.held_out_path))
    limit = self.held_out_fraction * _NUM_BUCKETS
    train = tuple(r for r in records if _bucket(r["prompt"]) >= limit)
    held_out = tuple(r for r in records if _bucket(r["prompt"]) < limit)
    if not train:
      raise ValueError(
        f"held_out_fraction={self.held_out_fraction} leaves no training record in {self.path}"
      )
    return train, held_out

  def records(self, split: Split = "train") -> tuple[Record, ...]:
    """Every record of `split`, in file order."""
    if split not in ("train", "held_out"):
      raise ValueError(f"split must be 'train' or 'held_out', got {split!r}")
    return self._split_records[0 if split == "train" else 1]

  def sft_task(self, sft) -> JsonlTask:
    """The warm-start's data: the same records (config.sft's arithmetic data-mix fields do not
    apply to a file of problems)."""
    return self

  def sft_completion(self, record: Record) -> str:
    """The reference solution (the answer field, e.g. GSM8K's worked steps ending "#### 72")."""
    return record["solution"]

  def held_out(self, n: int, seed: int = 0) -> list[Record]:
    """`n` distinct held-out records, a deterministic sample (without replacement) for `seed`."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
      raise ValueError(f"n must be a non-negative int, got {n!r}")
    records = self.records("held_out")
    if n > len(records):
      source = self.held_out_path or f"{self.path} with held_out_fraction={self.held_out_fraction}"
      raise ValueError(f"asked for n={n} held-out records but {source} has only {len(records)}")
    # The trailing tag keeps this stream apart from the training shuffles default_rng([seed, e]).
    idx = np.random.default_rng([seed, _TRAIN_INDEX_SPACE]).permutation(len(records))[:n]
    return [records[i] for i in idx]

  def train_dataset(self, *, seed: int, batch_size: int) -> grain.IterDataset:
    """An infinite, checkpointable stream of training batches, reshuffled every epoch.

    Each element is a LIST of `batch_size` record dicts. Record `i` (counting across batches)
    is `records("train")[perm_e[i % n]]` with `e = i // n` and `perm_e` the permutation drawn
    by `np.random.default_rng([seed, e])`, so it depends only on `(seed, i)`.

    `iter(ds).get_state()` is grain's `{"next_index": k}` (k = batches returned), JSON-ready;
    resume with `it.set_state(state)` on a fresh iterator from a task over the same file(s),
    built with the same `seed` and `batch_size`.
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
      raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
      raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    records = self.records("train")
    n = len(records)

    @functools.lru_cache(maxsize=2)  # consecutive indices share an epoch's permutation
    def permutation(epoch: int) -> np.ndarray:
      return np.random.default_rng([seed, epoch]).permutation(n)

    def make_record(i: int) -> Record:
      i = int(i)
      return dict(records[permutation(i // n)[i % n]])  # a copy: callers may annotate records

    return record_batches(make_record, batch_size=batch_size, index_space=_TRAIN_INDEX_SPACE)
