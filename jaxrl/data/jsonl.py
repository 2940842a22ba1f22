"""Prompt/answer records from a local JSONL or Parquet file (GSM8K by default), served by grain.

A JSONL file is never held in memory: the task keeps where each record starts (a byte offset and
its line number) and reads a record when it is needed. In a multi-process run (jaxrl.distributed)
each process checks only the lines that start in its share of the file's bytes, and makes only
its share of every batch, so every line is read by one process, not all of them. A Parquet file
(pyarrow) is read the same way by row group, the unit Parquet stores: each process checks its
share of the row groups, and a record is read with its group."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Literal

import grain
import numpy as np

from jaxrl import distributed
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


def _decode(raw: bytes) -> Any:
  """One JSONL line's value, or None for a blank line; a RecordError (without the file and line,
  which the caller adds) for bytes that are not UTF-8 or not JSON."""
  try:
    line = raw.decode("utf-8")
  except UnicodeDecodeError as e:
    raise RecordError(
      f"not UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1}); "
      "JSONL files must be UTF-8 encoded"
    ) from None
  if not line.strip():
    return None  # a trailing newline or blank separator is not a record
  try:
    return json.loads(line)
  except json.JSONDecodeError as e:
    raise RecordError(f"not valid JSON ({e.msg})") from None


def _stamp(stat: os.stat_result) -> tuple[int, int]:
  return stat.st_size, stat.st_mtime_ns


def _scan(path: str, span: range, check: Callable[[Any], Any]) -> dict:
  """The lines of a JSONL file that START in bytes [span.start, span.stop) (a line belongs to the
  share its first byte is in, so the processes' shares partition the lines): how many there are,
  each non-blank one's byte offset, local line index and `check(value)`, and the first bad line
  (local index, message). Reading stops at the first bad line: only the first one in the file is
  reported, and the lines before it are all this share needs to number it."""
  offsets, local, checked, owned, error = [], [], [], 0, None
  with open(path, "rb") as f:
    pos = span.start
    if pos > 0:  # skip the rest of a line that started in the previous share
      f.seek(pos - 1)
      pos += len(f.readline()) - 1
    while pos < span.stop:
      raw = f.readline()
      if not raw:
        break
      k, owned, start = owned, owned + 1, pos
      pos += len(raw)
      try:
        value = _decode(raw)
        if value is not None:
          checked.append(check(value))
          offsets.append(start)
          local.append(k)
      except RecordError as e:
        error = (k, str(e))
        break
  found = {"owned": owned, "offsets": offsets, "local": local, "checked": checked}
  return found | {"error": error, "size": os.path.getsize(path)}


def _parquet(path: str):
  """`pyarrow.parquet.ParquetFile(path)`; clear errors without pyarrow or for a bad file."""
  try:
    import pyarrow.parquet as pq
  except ImportError:
    raise ImportError(
      f"reading {path!r} needs pyarrow, which is not installed; `pip install pyarrow` or "
      "convert the file to JSONL"
    ) from None
  try:
    return pq.ParquetFile(path)
  except Exception as e:  # pyarrow's ArrowInvalid / OSError for a file that is not Parquet
    raise RecordError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e})") from None


def _group_starts(file) -> np.ndarray:
  """Row index where each row group starts, and the row count last: [0, n0, n0 + n1, ..., n]."""
  meta = file.metadata
  sizes = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
  return np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).astype(np.int64)


# Rows converted to Python at a time when a file is checked (a row group may hold ~1M rows).
SCAN_BATCH_ROWS = 4096


def _scan_parquet(path: str, groups: range, check: Callable[[Any], Any]) -> dict:
  """Row groups `groups` of a Parquet file, read a batch of rows at a time: `check(row)` of each
  row and the first bad row (its index in the file, message). Reading stops at the first bad
  row, as `_scan` does."""
  file = _parquet(path)
  starts, checked, error = _group_starts(file), [], None
  for g in groups:
    i = int(starts[g])
    for batch in file.iter_batches(SCAN_BATCH_ROWS, row_groups=[g]):
      for row in batch.to_pylist():
        try:
          checked.append(check(row))
        except RecordError as e:
          error = (i, str(e))
          break
        i += 1
      if error is not None:
        break
    if error is not None:
      break
  return {"checked": checked, "error": error, "size": os.path.getsize(path)}


@dataclasses.dataclass(frozen=True, eq=False)
class _Rows:
  """Where the records of one file are. JSONL: the byte offset and 1-based line number of every
  non-blank line. Parquet: the rows' row groups (`groups`, from `_group_starts`); line numbers
  are row numbers. Records are read when asked for (the last few Parquet row groups read are
  kept as Arrow tables; only the rows asked for become Python values). `held[j]`: record j
  hashed into the held-out split."""

  path: str
  line_nos: np.ndarray
  held: np.ndarray
  stamp: tuple[int, int]
  offsets: np.ndarray | None = None
  groups: np.ndarray | None = None
  cache: OrderedDict = dataclasses.field(default_factory=OrderedDict, compare=False, repr=False)
  lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

  CACHED_GROUPS = 4

  @classmethod
  def index(cls, path: str, check: Callable[[Any], bool]) -> _Rows:
    """Index `path`, calling `check(value) -> held_out?` on every record (it raises RecordError
    for a bad one, which is re-raised naming the file and line). Every process calls this
    together: each checks the lines in its share of the bytes (of a Parquet file: its share of
    the row groups) and they exchange what they found."""
    if os.path.isdir(path):
      raise IsADirectoryError(
        f"dataset file {path!r} is a directory; allowed: a .jsonl or .parquet file"
      )
    if not os.path.isfile(path):
      raise FileNotFoundError(f"dataset file {path!r} does not exist")
    stamp = _stamp(os.stat(path))
    if path.endswith(".parquet"):
      groups = _group_starts(_parquet(path))
      n, num_groups = int(groups[-1]), len(groups) - 1
      parts = distributed.gather_shares(lambda gs: _scan_parquet(path, gs, check), num_groups)
    else:
      parts = distributed.gather_shares(lambda span: _scan(path, span, check), stamp[0])
    if len({part["size"] for part in parts}) > 1:
      raise RecordError(
        f"{path} is not the same file in every process (sizes {[p['size'] for p in parts]}): "
        "every host must see the same dataset file"
      )
    if path.endswith(".parquet"):
      for part in parts:
        if part["error"] is not None:
          j, message = part["error"]
          raise RecordError(f"{path}:{j + 1}: {message}")
      held = np.asarray([x for part in parts for x in part["checked"]], bool).reshape(-1)
      return cls(path, np.arange(1, n + 1), held, stamp, groups=groups)
    first = 0  # lines owned by the shares before this one
    for part in parts:
      if part["error"] is not None:
        k, message = part["error"]
        raise RecordError(f"{path}:{first + k + 1}: {message}")
      part["line_nos"] = [first + k + 1 for k in part["local"]]
      first += part["owned"]
    join = lambda key, dtype: np.asarray(  # noqa: E731
      [x for part in parts for x in part[key]], dtype
    ).reshape(-1)
    return cls(path, join("line_nos", np.int64), join("checked", bool), stamp,
               offsets=join("offsets", np.int64))  # fmt: skip

  def __len__(self) -> int:
    return len(self.line_nos)

  def _unchanged(self, now: tuple[int, int]) -> None:
    if now != self.stamp:
      raise RecordError(
        f"{self.path} changed since the task indexed it (size {self.stamp[0]} -> {now[0]} "
        f"bytes, modification time {self.stamp[1]} -> {now[1]} ns); a run's dataset file must "
        "not change under it: restart the run to read the new file"
      )

  def _group(self, g: int):
    """Row group `g` as a `pyarrow.Table`, from the cache or the file."""
    with self.lock:
      if g in self.cache:
        self.cache.move_to_end(g)
        return self.cache[g]
      table = self.cache[g] = _parquet(self.path).read_row_group(g)
      while len(self.cache) > self.CACHED_GROUPS:
        self.cache.popitem(last=False)
      return table

  def read(self, js) -> list[tuple[int, Any]]:
    """(line number, decoded value) of records `js`, read from the file now."""
    if self.groups is not None:
      self._unchanged(_stamp(os.stat(self.path)))  # a cached group too is refused, as JSONL's
      out = []
      for j in js:
        g = int(np.searchsorted(self.groups, j, side="right")) - 1
        row = self._group(g).slice(int(j) - int(self.groups[g]), 1).to_pylist()[0]
        out.append((int(self.line_nos[j]), row))
      return out
    out = []
    with open(self.path, "rb") as f:
      self._unchanged(_stamp(os.fstat(f.fileno())))
      for j in js:
        f.seek(int(self.offsets[j]))
        out.append((int(self.line_nos[j]), _decode(f.readline())))
    return out


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
  raises `RecordError` naming the file, the line and the field (the first bad line in the file,
  in every process; a Parquet row's "line" is its row number). Records are then read from the
  file when a batch needs them: the task holds each record's byte offset (of a Parquet file, its
  row group; the last `_Rows.CACHED_GROUPS` groups read are kept), not the record; a file changed
  under a run is refused.

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
    # Index and check every record now, not mid-run; not fields, so eq / hash / repr skip them.
    object.__setattr__(self, "_files", self._index_files())

  # ----------------------------------------------------------------------------------- records

  def _record(self, row: Any) -> Record:
    """The record of one decoded line; a RecordError naming the field (the caller adds where)."""
    if not isinstance(row, dict):
      raise RecordError(f"a record must be a JSON object, got {type(row).__name__}")
    for name in (self.prompt_field, self.answer_field):
      if name not in row:
        raise RecordError(f"missing field {name!r} (fields present: {sorted(row)})")
    prompt, solution = row[self.prompt_field], row[self.answer_field]
    if not isinstance(prompt, str) or not prompt.strip():
      raise RecordError(f"field {self.prompt_field!r} must be a non-empty string")
    if isinstance(solution, int | float) and not isinstance(solution, bool):
      solution = str(solution)  # "answer": 72 is a fine raw answer
    if not isinstance(solution, str) or not solution.strip():
      raise RecordError(f"field {self.answer_field!r} must be a non-empty string")
    if self.answer_format == "gsm8k":
      answer = final_answer(solution)
      if answer is None:
        raise RecordError(
          f"field {self.answer_field!r} must end with '#### <final answer>' "
          f"(answer_format='gsm8k'), got {solution[-60:]!r}"
        )
    else:
      answer = solution.strip()
    extra = {k: v for k, v in row.items() if k not in (self.prompt_field, self.answer_field)}
    return {**extra, "prompt": prompt, "answer": answer, "solution": solution}

  def _index(self, path: str, *, by_hash: bool) -> _Rows:
    limit = self.held_out_fraction * _NUM_BUCKETS

    def check(row) -> bool:  # every record is checked; its bucket splits it only `by_hash`
      prompt = self._record(row)["prompt"]
      return by_hash and _bucket(prompt) < limit

    rows = _Rows.index(path, check)
    if not len(rows):
      raise RecordError(f"{path}: the file holds no records")
    return rows

  def _index_files(self) -> dict[Split, tuple[_Rows, np.ndarray]]:
    """Each split's file and the positions of its records in it."""
    rows = self._index(self.path, by_hash=self.held_out_path is None)
    if self.held_out_path is not None:
      held = self._index(self.held_out_path, by_hash=False)
      return {"train": (rows, np.arange(len(rows))), "held_out": (held, np.arange(len(held)))}
    train = np.flatnonzero(~rows.held)
    if not len(train):
      raise ValueError(
        f"held_out_fraction={self.held_out_fraction} leaves no training record in {self.path}"
      )
    return {"train": (rows, train), "held_out": (rows, np.flatnonzero(rows.held))}

  def _split(self, split: Split) -> tuple[_Rows, np.ndarray]:
    if split not in ("train", "held_out"):
      raise ValueError(f"split must be 'train' or 'held_out', got {split!r}")
    return self._files[split]

  def _read(self, rows: _Rows, positions) -> list[Record]:
    out = []
    for line_no, row in rows.read(positions):
      try:
        out.append(self._record(row))
      except RecordError as e:  # checked when indexed: only an edited file gets here
        raise RecordError(f"{rows.path}:{line_no}: {e}") from None
    return out

  def _gather(self, split: Split, picks: np.ndarray) -> list[Record]:
    """Records `picks` (indices into `split`), each process reading its share of them."""
    rows, positions = self._split(split)
    parts = distributed.gather_shares(
      lambda share: self._read(rows, positions[picks[share.start : share.stop]]), len(picks)
    )
    return [record for part in parts for record in part]

  def num_records(self, split: Split = "train") -> int:
    """How many records `split` holds (nothing is read)."""
    return len(self._split(split)[1])

  def records(self, split: Split = "train") -> tuple[Record, ...]:
    """Every record of `split`, in file order, read now (in a multi-process run every process
    must call this together: each reads its share)."""
    return tuple(self._gather(split, np.arange(self.num_records(split))))

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
    size = self.num_records("held_out")
    if n > size:
      source = self.held_out_path or f"{self.path} with held_out_fraction={self.held_out_fraction}"
      raise ValueError(f"asked for n={n} held-out records but {source} has only {size}")
    # The trailing tag keeps this stream apart from the training shuffles default_rng([seed, e]).
    return self._gather(
      "held_out", np.random.default_rng([seed, _TRAIN_INDEX_SPACE]).permutation(size)[:n]
    )

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
    rows, positions = self._split("train")
    n = len(positions)

    @functools.lru_cache(maxsize=2)  # consecutive indices share an epoch's permutation
    def permutation(epoch: int) -> np.ndarray:
      return np.random.default_rng([seed, epoch]).permutation(n)

    def make_record(i: int) -> Record:
      i = int(i)
      return self._read(rows, [positions[permutation(i // n)[i % n]]])[0]

    return record_batches(make_record, batch_size=batch_size, index_space=_TRAIN_INDEX_SPACE)
