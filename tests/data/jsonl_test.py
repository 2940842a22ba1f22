"""JSONL task: record parsing and validation, splits, deterministic shuffles and exact resume."""

import collections
import json
import os

import numpy as np
import pytest
from helpers import as_processes, gsm8k_rows

from jaxrl import distributed
from jaxrl.data import jsonl
from jaxrl.data.jsonl import JsonlTask, RecordError, final_answer

GSM8K_LINES = [
  {
    "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as "
    "many clips in May. How many clips did Natalia sell altogether in April and May?",
    "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72",
  },
  {
    "question": "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of "
    "babysitting. How much did she earn?",
    "answer": "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\n"
    "Working 50 minutes, she earned 0.2 x 50 = $<<0.2*50=10>>10.\n#### 10",
  },
  {"question": "A big number?", "answer": "It is large.\n#### 1,000", "source": "hand"},
]


def _write(path, rows):
  with open(path, "w") as f:
    for row in rows:
      f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
  return str(path)


def _take(it, n):
  it = iter(it)
  return [next(it) for _ in range(n)]


def test_final_answer():
  assert final_answer("steps\n#### 72") == "72"
  assert final_answer("#### 1 then #### 2 ") == "2"
  assert final_answer("no marker") is None
  assert final_answer("steps ####  ") is None


def test_gsm8k_records(tmp_path):
  path = _write(tmp_path / "gsm8k.jsonl", [GSM8K_LINES[0], "", GSM8K_LINES[1], GSM8K_LINES[2]])
  records = JsonlTask(path).records()
  assert [r["answer"] for r in records] == ["72", "10", "1,000"]
  assert records[0] == {
    "prompt": GSM8K_LINES[0]["question"],
    "answer": "72",
    "solution": GSM8K_LINES[0]["answer"],
  }
  assert records[2]["source"] == "hand"  # other fields travel with the record
  assert JsonlTask(path).sft_completion(records[1]) == GSM8K_LINES[1]["answer"]


def test_custom_fields_and_raw_answers(tmp_path):
  rows = [
    {"problem": "1+1?", "solution": 2},
    {"problem": "Capital of France?", "solution": "Paris"},
  ]
  task = JsonlTask(
    _write(tmp_path / "x.jsonl", rows),
    prompt_field="problem",
    answer_field="solution",
    answer_format="raw",
  )
  assert [(r["prompt"], r["answer"]) for r in task.records()] == [
    ("1+1?", "2"),
    ("Capital of France?", "Paris"),
  ]


@pytest.mark.parametrize(
  "bad_line, message",
  [
    ('{"question": "q?", "answer": "x\\n#### 3"', r"bad.jsonl:3: not valid JSON"),
    ("[1, 2]", r"bad.jsonl:3: a record must be a JSON object, got list"),
    (
      '{"answer": "#### 3"}',
      r"bad.jsonl:3: missing field 'question' \(fields present: \['answer'\]",
    ),
    ('{"question": "q?"}', r"bad.jsonl:3: missing field 'answer'"),
    ('{"question": " ", "answer": "#### 3"}', r"bad.jsonl:3: field 'question' must be a non-empty"),
    ('{"question": 5, "answer": "#### 3"}', r"bad.jsonl:3: field 'question' must be a non-empty"),
    ('{"question": "q?", "answer": null}', r"bad.jsonl:3: field 'answer' must be a non-empty"),
    ('{"question": "q?", "answer": "it is 3"}', r"bad.jsonl:3: field 'answer' must end with '####"),
    ('{"question": "q?", "answer": "3 ####"}', r"bad.jsonl:3: field 'answer' must end with '####"),
  ],
)
def test_bad_records_name_line_and_field(tmp_path, bad_line, message):
  path = _write(tmp_path / "bad.jsonl", [GSM8K_LINES[0], GSM8K_LINES[1], bad_line])
  with pytest.raises(RecordError, match=message):
    JsonlTask(path)


def test_a_line_that_is_not_utf8_is_named(tmp_path):
  path = _write(tmp_path / "latin1.jsonl", [GSM8K_LINES[0]])
  with open(path, "ab") as f:
    f.write('{"question": "caf\u00e9?", "answer": "#### 3"}\n'.encode("latin-1"))
  with pytest.raises(RecordError, match=r"latin1.jsonl:2: not UTF-8 \(byte 0xe9 at column 18\)"):
    JsonlTask(path)


def test_bad_files_and_arguments(tmp_path):
  with pytest.raises(FileNotFoundError, match="missing.jsonl' does not exist"):
    JsonlTask(str(tmp_path / "missing.jsonl"))
  with pytest.raises(RecordError, match="holds no records"):
    JsonlTask(_write(tmp_path / "empty.jsonl", ["", "  "]))
  good = _write(tmp_path / "good.jsonl", GSM8K_LINES)
  with pytest.raises(ValueError, match=r"held_out_fraction must be in \[0, 1\)"):
    JsonlTask(good, held_out_fraction=1.0)
  with pytest.raises(ValueError, match="set either held_out_path or held_out_fraction"):
    JsonlTask(good, held_out_path=good, held_out_fraction=0.1)
  with pytest.raises(ValueError, match="answer_format must be one of"):
    JsonlTask(good, answer_format="boxed")
  with pytest.raises(ValueError, match="prompt_field must be a non-empty str"):
    JsonlTask(good, prompt_field="")
  with pytest.raises(ValueError, match=r"n=1 held-out records but .* has only 0"):
    JsonlTask(good).held_out(1)
  with pytest.raises(ValueError, match="batch_size must be a positive int"):
    JsonlTask(good).train_dataset(seed=0, batch_size=0)


def test_hash_split_is_disjoint_stable_and_monotone(tmp_path):
  rows = gsm8k_rows(400)
  rows += rows[:50]  # duplicated prompts must land on the same side
  path = _write(tmp_path / "data.jsonl", rows)
  task = JsonlTask(path, held_out_fraction=0.2)
  train = {r["prompt"] for r in task.records("train")}
  held = {r["prompt"] for r in task.records("held_out")}
  assert not train & held
  assert train | held == {r["question"] for r in rows}
  assert 40 <= len(held) <= 120  # ~20% of 400 distinct prompts
  bigger = {r["prompt"] for r in JsonlTask(path, held_out_fraction=0.4).records("held_out")}
  assert held < bigger  # raising the fraction only adds prompts to the held-out set
  assert held == {r["prompt"] for r in JsonlTask(path, held_out_fraction=0.2).records("held_out")}
  # The training stream never yields a held-out prompt.
  streamed = [r for b in _take(task.train_dataset(seed=0, batch_size=32), 30) for r in b]
  assert not {r["prompt"] for r in streamed} & held


def test_held_out_file_split(tmp_path):
  train = _write(tmp_path / "train.jsonl", gsm8k_rows(30))
  test = _write(tmp_path / "test.jsonl", gsm8k_rows(12, prefix="test"))
  task = JsonlTask(train, held_out_path=test)
  assert len(task.records("train")) == 30
  sample = task.held_out(5, seed=1)
  assert len({r["prompt"] for r in sample}) == 5
  assert all(r["prompt"].startswith("test") for r in sample)
  assert sample == task.held_out(5, seed=1) and sample != task.held_out(5, seed=2)
  assert sorted(r["prompt"] for r in task.held_out(12)) == sorted(f"test {i}?" for i in range(12))
  with pytest.raises(ValueError, match=r"n=13 held-out records but .*test.jsonl has only 12"):
    task.held_out(13)


def test_epochs_cover_every_record_once_and_reshuffle(tmp_path):
  task = JsonlTask(_write(tmp_path / "d.jsonl", gsm8k_rows(10)))
  records = [r for b in _take(task.train_dataset(seed=3, batch_size=5), 6) for r in b]
  epochs = [[r["prompt"] for r in records[i : i + 10]] for i in (0, 10, 20)]
  for epoch in epochs:
    assert collections.Counter(epoch) == collections.Counter(f"q {i}?" for i in range(10))
  assert epochs[0] != epochs[1]  # a new permutation every epoch
  assert epochs[0] != [f"q {i}?" for i in range(10)]  # and not file order


def test_deterministic_by_seed(tmp_path):
  task = JsonlTask(_write(tmp_path / "d.jsonl", gsm8k_rows(50)))
  a = _take(task.train_dataset(seed=7, batch_size=4), 20)
  assert a == _take(task.train_dataset(seed=7, batch_size=4), 20)
  assert a != _take(task.train_dataset(seed=8, batch_size=4), 20)
  # Record i depends only on (seed, i): batch size only regroups the same stream.
  flat = [r for b in a for r in b]
  assert flat == [r for b in _take(task.train_dataset(seed=7, batch_size=8), 10) for r in b]


def test_resume_is_exact(tmp_path):
  path = _write(tmp_path / "d.jsonl", gsm8k_rows(13))
  task = JsonlTask(path)
  it = iter(task.train_dataset(seed=11, batch_size=4))
  _take(it, 5)
  state = json.loads(json.dumps(it.get_state()))  # must survive a JSON checkpoint
  expected = _take(it, 6)  # crosses epoch boundaries (13 records, 4 per batch)

  fresh = iter(JsonlTask(path).train_dataset(seed=11, batch_size=4))  # a new process's task
  fresh.set_state(state)
  assert _take(fresh, 6) == expected
  assert fresh.get_state() == it.get_state()
  it.set_state(state)
  assert _take(it, 6) == expected


def test_yielded_records_are_copies(tmp_path):
  task = JsonlTask(_write(tmp_path / "d.jsonl", gsm8k_rows(3)))
  batch = next(iter(task.train_dataset(seed=0, batch_size=3)))
  batch[0]["reward"] = 1.0
  assert all("reward" not in r for r in task.records())


@pytest.mark.parametrize("count", [2, 3, 5, 64])
def test_processes_index_their_share_of_the_bytes_to_the_same_records(tmp_path, monkeypatch, count):
  # Blank lines, multi-byte characters, no final newline: share boundaries fall mid-line, on a
  # line's first byte, inside a multi-byte character and past the end of short files.
  rows = [GSM8K_LINES[0], "", {"question": "caf\u00e9 \u00e0 \u20ac?", "answer": "#### 3"}]
  rows += ["   ", *gsm8k_rows(7), GSM8K_LINES[2]]
  path = _write(tmp_path / "d.jsonl", rows)
  with open(path, "rb+") as f:
    f.truncate(f.seek(0, 2) - 1)  # drop the final newline
  one = JsonlTask(path, held_out_fraction=0.3)
  scans, original = [], jsonl._scan

  def scan(p, span, check):
    scans.append((span, original(p, span, check)))
    return scans[-1][1]

  monkeypatch.setattr(jsonl, "_scan", scan)
  as_processes(monkeypatch, count)
  many = JsonlTask(path, held_out_fraction=0.3)
  size = os.path.getsize(path)
  assert [span for span, _ in scans] == [distributed.share(size, p, count) for p in range(count)]
  # Each share numbers the lines that start in it: together, every one of the 12 lines once.
  assert sum(found["owned"] for _, found in scans) == 12
  assert [o for _, found in scans for o in found["offsets"]] == list(one._split("train")[0].offsets)
  for split in ("train", "held_out"):
    assert many.records(split) == one.records(split)
    mine, theirs = many._split(split), one._split(split)
    np.testing.assert_array_equal(mine[0].line_nos, theirs[0].line_nos)
    np.testing.assert_array_equal(mine[0].offsets, theirs[0].offsets)
  assert list(one._split("train")[0].line_nos) == [1, 3, 5, 6, 7, 8, 9, 10, 11, 12]
  stream = lambda t: _take(t.train_dataset(seed=2, batch_size=3), 5)  # noqa: E731
  assert stream(many) == stream(one)
  assert many.held_out(2, seed=1) == one.held_out(2, seed=1)


@pytest.mark.parametrize("count", [1, 2, 4])
@pytest.mark.parametrize("bad", [0, 5, 9])
def test_the_first_bad_line_is_named_whichever_process_read_it(tmp_path, monkeypatch, count, bad):
  rows = gsm8k_rows(10)
  rows[bad] = '{"question": "q?"}'
  if bad < 9:
    rows[9] = "[1]"  # a later bad line: the first in the file is the one reported
  as_processes(monkeypatch, count)
  with pytest.raises(RecordError, match=rf"d.jsonl:{bad + 1}: missing field 'answer'"):
    JsonlTask(_write(tmp_path / "d.jsonl", rows))


def test_records_are_read_when_needed_and_a_changed_file_is_refused(tmp_path, monkeypatch):
  path = _write(tmp_path / "d.jsonl", gsm8k_rows(40))
  task = JsonlTask(path)
  read, original = [], jsonl._Rows.read
  monkeypatch.setattr(jsonl._Rows, "read", lambda self, js: read.extend(js) or original(self, js))
  batches = _take(task.train_dataset(seed=0, batch_size=4), 3)
  assert len(read) == 12 and len(set(read)) == 12  # the 12 records asked for, no more
  assert [r["prompt"] for b in batches for r in b] == [
    f"q {int(i)}?" for i in np.random.default_rng([0, 0]).permutation(40)[:12]
  ]
  assert len(task.held_out(0)) == 0 and len(read) == 12
  with open(path, "a") as f:
    f.write(json.dumps(gsm8k_rows(1, prefix="new")[0]) + "\n")
  with pytest.raises(
    RecordError,
    match=r"d.jsonl changed since the task indexed it \(size 1940 -> 1989 bytes.*restart the run",
  ):
    next(iter(task.train_dataset(seed=0, batch_size=4)))


def test_processes_that_see_different_files_are_refused(tmp_path, monkeypatch):
  path = _write(tmp_path / "d.jsonl", gsm8k_rows(10))
  scan = jsonl._scan
  sizes = iter([0, 7])  # the second process's copy is 7 bytes longer
  monkeypatch.setattr(
    jsonl,
    "_scan",
    lambda p, span, check: (f := scan(p, span, check)) | {"size": f["size"] + next(sizes)},
  )
  as_processes(monkeypatch, 2)
  size = os.path.getsize(path)
  with pytest.raises(
    RecordError,
    match=rf"d.jsonl is not the same file in every process \(sizes \[{size}, {size + 7}\]\)",
  ):
    JsonlTask(path)
