"""The training stream of a synthetic task: record i drawn from default_rng([seed, i])."""

from __future__ import annotations

from collections.abc import Callable

import grain
import numpy as np

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

  dataset = grain.MapDataset.range(INDEX_SPACE).map(make_record).batch(batch_size, batch_fn=list)
  # Generation is pure Python and in memory: prefetch threads would only fight over the GIL
  # (grain's default is 16 threads eagerly filling a 500-batch buffer).
  return dataset.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
