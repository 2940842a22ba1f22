"""Training streams: the fixed prompt pool (rl.prompt_pool) drawn from a task's stream, and its
epochs, each a reshuffle of the whole pool; checkpointable like the endless streams."""

import itertools
import json

import pytest

from jaxrl.data.arithmetic import ArithmeticTask
from jaxrl.data.jsonl import JsonlTask
from jaxrl.data.stream import draw_pool, pooled_batches


def _prompts(batches):
  return [[r["prompt"] for r in b] for b in batches]


def test_the_pool_is_the_streams_first_distinct_prompts_in_order():
  task = ArithmeticTask(max_digits=1, ops=("+",), held_out_fraction=0.1)  # 100 problems: repeats
  pool = draw_pool(task, 30, seed=3)
  stream = itertools.chain.from_iterable(task.train_dataset(seed=3, batch_size=7))
  expect, seen = [], set()
  for r in stream:
    if r["prompt"] not in seen:
      seen.add(r["prompt"])
      expect.append(r)
    if len(expect) == 30:
      break
  assert pool == expect
  assert len({r["prompt"] for r in pool}) == 30
  assert draw_pool(task, 30, seed=4) != pool  # the run's seed picks the pool


def test_every_epoch_is_a_reshuffle_of_the_whole_pool():
  pool = [{"prompt": f"p{i}", "answer": str(i)} for i in range(12)]
  it = iter(pooled_batches(pool, seed=0, batch_size=4))
  epochs = [sum(_prompts(next(it) for _ in range(3)), []) for _ in range(3)]
  for e in epochs:
    assert sorted(e) == sorted(r["prompt"] for r in pool)
  assert len({tuple(e) for e in epochs}) == 3  # each epoch its own order
  # Batches straddle epochs when the pool is not a multiple of the batch.
  it = iter(pooled_batches(pool, seed=0, batch_size=5))
  flat = sum(_prompts(next(it) for _ in range(6)), [])
  assert flat[:12] == epochs[0] and flat[12:24] == epochs[1]


def test_pooled_stream_resumes_from_its_state_and_depends_only_on_seed():
  pool = [{"prompt": f"p{i}"} for i in range(10)]
  full = iter(pooled_batches(pool, seed=5, batch_size=3))
  expect = _prompts(next(full) for _ in range(8))
  part = iter(pooled_batches(pool, seed=5, batch_size=3))
  head = _prompts(next(part) for _ in range(3))
  state = json.loads(json.dumps(part.get_state()))  # checkpoints store it as JSON
  resumed = iter(pooled_batches(pool, seed=5, batch_size=3))
  resumed.set_state(state)
  assert head + _prompts(next(resumed) for _ in range(5)) == expect
  other = iter(pooled_batches(pool, seed=6, batch_size=3))
  assert _prompts(next(other) for _ in range(8)) != expect
  # Records are copies: annotating one does not touch the pool.
  next(iter(pooled_batches(pool, seed=5, batch_size=3)))[0]["x"] = 1
  assert all("x" not in r for r in pool)


def test_a_pool_larger_than_the_data_is_an_error(tmp_path):
  path = tmp_path / "d.jsonl"
  path.write_text(
    "".join(json.dumps({"question": f"q{i % 4}", "answer": f"#### {i}"}) + "\n" for i in range(6))
  )
  task = JsonlTask(str(path), held_out_fraction=0.0)
  assert sorted(r["prompt"] for r in draw_pool(task, 4, seed=0)) == ["q0", "q1", "q2", "q3"]
  with pytest.raises(ValueError, match="pool of 5 distinct prompts.*6 training records hold 4"):
    draw_pool(task, 5, seed=0)
  small = ArithmeticTask(max_digits=1, ops=("+",), held_out_fraction=0.1)
  with pytest.raises(ValueError, match=r"pool of 200 distinct prompts.*20000 draws hold \d+"):
    draw_pool(small, 200, seed=0)
  with pytest.raises(ValueError, match="n >= 1"):
    draw_pool(small, 0, seed=0)
  with pytest.raises(ValueError, match="at least one record"):
    pooled_batches([], seed=0, batch_size=2)
