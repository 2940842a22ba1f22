"""Training streams: a synthetic task's (record i drawn from default_rng([seed, i])) and a fixed
prompt pool's (rl.prompt_pool), epoch after epoch."""

from __future__ import annotations

import functools
from collections.abc import Callable

import grain
import numpy as np

from jaxrl import distributed

# Record indices: 2**40 is "infinite" for training.
INDEX_SPACE = 2**40


def indexed_batches(
  sample: Callable[[np.random.Generator], dict], *, seed: int, batch_size: int
) -> grain.IterDataset:
  """Batches (lists) of `batch_size` records; record i (counting across batches) is
  `sample(np.random.default_rng([seed, i]))`, so it depends only on (seed, i).

  `iter(ds).get_state()` is grain's `{"next_index": k}` (JSON-ready), k counting batches
  already returned; `set_state` on a fresh iterator of the same seed and batch_size resumes.
  """
  if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
    raise ValueError(f"seed must be a non-negative int, got {seed!r}")
  if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
    raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")

  def make_record(i: int) -> dict:
    return sample(np.random.default_rng([seed, int(i)]))

  return record_batches(make_record, batch_size=batch_size)


def record_batches(
  make_record: Callable[[int], dict], *, batch_size: int, index_space: int = INDEX_SPACE
) -> grain.IterDataset:
  """Batches (lists) of `batch_size` records: batch k holds `make_record(i)` for i in
  [k * batch_size, (k + 1) * batch_size). `iter(ds).get_state()` is grain's `{"next_index": k}`.

  In a multi-process run (jaxrl.distributed) each process makes only its share of every
  batch's records (`distributed.share`: contiguous, in process order) and receives the others'
  (every process drives the same engine program over all of a step's prompts), so record
  reading, parsing and generation are split across the processes.
  """

  def read_batch(k: int) -> list[dict]:
    first = int(k) * batch_size
    read = lambda rows: [make_record(first + j) for j in rows]  # noqa: E731
    parts = distributed.gather_shares(read, batch_size)
    return [record for part in parts for record in part]

  dataset = grain.MapDataset.range(index_space // batch_size).map(read_batch)
  # Records are made in memory in pure Python: prefetch threads would only fight over the GIL
  # (grain's default is 16 threads eagerly filling a 500-batch buffer).
  return dataset.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))


def draw_pool(task, n: int, *, seed: int) -> list[dict]:
  """The first `n` distinct prompts (by record["prompt"]) of `task`'s training stream for `seed`,
  in stream order. A ValueError if the stream holds fewer: a file-backed task is read for one
  epoch, a synthetic one for up to 100 * n records."""
  if isinstance(n, bool) or not isinstance(n, int) or n < 1:
    raise ValueError(f"a prompt pool needs n >= 1 prompts, got {n!r}")
  size = task.num_records("train") if hasattr(task, "num_records") else None
  limit = size if size is not None else 100 * n
  pool, seen, read = [], set(), 0
  for batch in task.train_dataset(seed=seed, batch_size=min(n, limit)):
    for record in batch:
      if read == limit or len(pool) == n:
        break
      read += 1
      if record["prompt"] not in seen:
        seen.add(record["prompt"])
        pool.append(record)
    if read == limit or len(pool) == n:
      break
  if len(pool) < n:
    where = f"the {size} training records" if size is not None else f"{limit} draws"
    raise ValueError(f"a pool of {n} distinct prompts was asked for, but {where} hold {len(pool)}")
  return pool


def pooled_batches(records: list[dict], *, seed: int, batch_size: int) -> grain.IterDataset:
  """Batches (lists) of `batch_size` records from a fixed pool, epoch after epoch: record i
  (counting across batches) is `records[perm_e[i % n]]`, e = i // n, perm_e drawn by
  `default_rng([seed, INDEX_SPACE, e])` (apart from the synthetic streams' record seeds), so it
  depends only on (seed, i). State and resume as `indexed_batches`."""
  if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
    raise ValueError(f"seed must be a non-negative int, got {seed!r}")
  if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
    raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
  n = len(records)
  if n == 0:
    raise ValueError("a prompt pool needs at least one record")

  @functools.lru_cache(maxsize=2)  # consecutive indices share an epoch's permutation
  def permutation(epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, INDEX_SPACE, epoch]).permutation(n)

  def make_record(i: int) -> dict:
    i = int(i)
    return dict(records[permutation(i // n)[i % n]])  # a copy: callers may annotate records

  return record_batches(make_record, batch_size=batch_size)


def distinct_held_out(
  draw: Callable[[np.random.Generator], dict], n: int, seed: int, *, max_attempts: int
) -> list[dict]:
  """`n` held-out records with distinct prompts, `draw(rng)` giving one at a time from
  default_rng([seed, INDEX_SPACE]) (an index no training record uses), so they are fixed by
  `seed`. Raises when fewer than `n` distinct ones turn up in 100 n + `max_attempts` draws."""
  if isinstance(n, bool) or not isinstance(n, int) or n < 0:
    raise ValueError(f"n must be a non-negative int, got {n!r}")
  rng = np.random.default_rng([seed, INDEX_SPACE])
  seen, records = set(), []
  for _ in range(100 * n + max_attempts):
    if len(records) == n:
      break
    r = draw(rng)
    if r["prompt"] not in seen:
      seen.add(r["prompt"])
      records.append(r)
  if len(records) < n:
    raise ValueError(f"asked for n={n} held-out problems, found {len(records)} distinct ones")
  return records
