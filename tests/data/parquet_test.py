"""Parquet datasets: checked by row group in each process's share, read by row group on demand."""

import itertools
import sys

import numpy as np
import pyarrow as pa  # a test extra (setup.cfg); the error without it is tested below
import pyarrow.parquet as pq
import pytest
from helpers import as_processes, gsm8k_rows

from jaxrl import distributed
from jaxrl.data import jsonl
from jaxrl.data.jsonl import JsonlTask, RecordError


def _write(path, rows, group=3):
  pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=group)
  return str(path)


def _count_groups(monkeypatch) -> list:
  """Every row group read from a Parquet file, in order (whole, or in batches of rows)."""
  groups, read, batches = [], pq.ParquetFile.read_row_group, pq.ParquetFile.iter_batches

  def read_row_group(self, g, *args, **kwargs):
    groups.append(g)
    return read(self, g, *args, **kwargs)

  def iter_batches(self, *args, row_groups, **kwargs):
    groups.extend(row_groups)
    return batches(self, *args, row_groups=row_groups, **kwargs)

  monkeypatch.setattr(pq.ParquetFile, "read_row_group", read_row_group)
  monkeypatch.setattr(pq.ParquetFile, "iter_batches", iter_batches)
  return groups


def test_without_pyarrow_the_error_says_what_to_do(tmp_path, monkeypatch):
  path = _write(tmp_path / "d.parquet", gsm8k_rows(2))
  monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # `import pyarrow.parquet` fails
  with pytest.raises(ImportError, match=r"d.parquet' needs pyarrow.*convert the file to JSONL"):
    JsonlTask(path)


def test_a_file_that_is_not_parquet_is_named(tmp_path):
  (tmp_path / "d.parquet").write_bytes(b"PAR1 but not really")
  with pytest.raises(RecordError, match=r"d.parquet: not a readable Parquet file \("):
    JsonlTask(str(tmp_path / "d.parquet"))


@pytest.mark.parametrize("count", [1, 2, 3, 5, 64])
def test_processes_check_their_share_of_the_row_groups(tmp_path, monkeypatch, count):
  rows = gsm8k_rows(11)  # 4 row groups of 3: [0-2] [3-5] [6-8] [9-10]
  path = _write(tmp_path / "d.parquet", rows)
  one = JsonlTask(path, held_out_fraction=0.3)
  scans, original = [], jsonl._scan_parquet
  groups = _count_groups(monkeypatch)

  def scan(p, span, check):  # the groups each share's scan reads
    before = len(groups)
    found = original(p, span, check)
    scans.append((span, groups[before:]))
    return found

  as_processes(monkeypatch, count)
  monkeypatch.setattr(jsonl, "_scan_parquet", scan)
  many = JsonlTask(path, held_out_fraction=0.3)
  # Each process reads exactly its share of the 4 groups: between them every group once.
  assert [span for span, _ in scans] == [distributed.share(4, p, count) for p in range(count)]
  assert [read for _, read in scans] == [list(distributed.share(4, p, count)) for p in range(count)]
  for split in ("train", "held_out"):
    assert many.records(split) == one.records(split)
    np.testing.assert_array_equal(many._split(split)[1], one._split(split)[1])
  assert sorted(r["prompt"] for s in ("train", "held_out") for r in one.records(s)) == sorted(
    r["question"] for r in rows
  )
  take = lambda t: list(itertools.islice(t.train_dataset(seed=2, batch_size=3), 5))  # noqa: E731
  assert take(many) == take(one)
  assert many.held_out(2, seed=1) == one.held_out(2, seed=1)


@pytest.mark.parametrize("count", [1, 2, 4])
@pytest.mark.parametrize("bad", [0, 4, 9])
@pytest.mark.parametrize("scan_rows", [jsonl.SCAN_BATCH_ROWS, 2])  # groups of 3 cross batches
def test_the_first_bad_row_is_named_whichever_process_read_it(
  tmp_path, monkeypatch, count, bad, scan_rows
):
  monkeypatch.setattr(jsonl, "SCAN_BATCH_ROWS", scan_rows)
  rows = gsm8k_rows(10)
  rows[bad] = {"question": "q?", "answer": "no final answer"}
  if bad < 9:
    rows[9] = {"question": "", "answer": "#### 1"}  # a later bad row: the first is reported
  path = _write(tmp_path / "d.parquet", rows)
  as_processes(monkeypatch, count)
  with pytest.raises(RecordError, match=rf"d.parquet:{bad + 1}: field 'answer' must end with"):
    JsonlTask(path)


def test_records_are_read_by_row_group_and_a_changed_file_is_refused(tmp_path, monkeypatch):
  path = _write(tmp_path / "d.parquet", gsm8k_rows(40), group=4)  # 10 groups of 4
  task = JsonlTask(path)
  groups = _count_groups(monkeypatch)
  batch = next(iter(task.train_dataset(seed=0, batch_size=2)))
  picks = np.random.default_rng([0, 0]).permutation(40)[:2]
  assert [r["prompt"] for r in batch] == [f"q {i}?" for i in picks]
  assert groups == [int(i) // 4 for i in picks]  # one group read per record, no more
  rows = task._split("train")[0]
  assert list(rows.cache) == groups and rows.CACHED_GROUPS == 4
  assert all(isinstance(t, pa.Table) for t in rows.cache.values())  # rows become Python on read
  again = next(iter(task.train_dataset(seed=0, batch_size=2)))
  assert again == batch and len(groups) == 2  # served from the cache
  for i in range(10):  # reading more groups keeps only the last CACHED_GROUPS of them
    rows.read([4 * i])
  assert list(rows.cache) == [6, 7, 8, 9]
  _write(tmp_path / "d.parquet", gsm8k_rows(41), group=4)
  with pytest.raises(RecordError, match=r"d.parquet changed since the task indexed it .*restart"):
    next(iter(task.train_dataset(seed=0, batch_size=2)))
