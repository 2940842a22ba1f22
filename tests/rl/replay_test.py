"""rl.replay: which groups are stored, replayed and evicted, and the prompts none of it skips."""

import json
import types

import jax
import numpy as np
import pytest
from fixtures import smoke_config

from jaxrl import rewards
from jaxrl.metrics import read_jsonl
from jaxrl.rl.loop import Trainer
from jaxrl.rl.replay import ReplayBuffer
from jaxrl.rollout.types import Rollout

pytestmark = pytest.mark.integration

G, P = 2, 4


def _cfg(ratio=0.5, max_age=2, capacity=0):
  return types.SimpleNamespace(ratio=ratio, max_age=max_age, capacity=capacity)


def _rollout(groups: int, version: int, tag: float) -> Rollout:
  """`groups` groups of G rows, 3 tokens each, drawn by `version`; log-probs tagged."""
  b, n = groups * G, 3
  return Rollout(
    prompt_tokens=np.zeros((b, 2), np.int32),
    prompt_mask=np.ones((b, 2), bool),
    tokens=np.arange(b * n, dtype=np.int32).reshape(b, n),
    mask=np.ones((b, n), bool),
    logprobs=np.full((b, n), tag, np.float32) - np.arange(b, dtype=np.float32)[:, None] / 7,
    versions=np.full((b, n), version, np.int32),
    lengths=np.full((b,), n, np.int32),
    truncated=np.zeros((b,), bool),
    finish_reason=np.zeros((b,), np.int32),
  )


def _stream():
  counter = iter(range(10_000))
  return lambda: [{"id": next(counter)} for _ in range(P)]


def test_a_step_samples_fewer_fresh_groups_once_enough_are_stored_and_skips_no_prompt():
  buf, draw = ReplayBuffer(_cfg(ratio=0.5), group_size=G, num_prompts=P), _stream()
  seen, fresh_counts = [], []
  for step in range(6):
    records, n = buf.fresh_records(step, [], draw)
    fresh_counts.append(len(records))
    assert len(records) + n == P  # the batch keeps P groups
    seen += [r["id"] for r in records]
    if n:
      buf.take(step, n)
    # Every group informative: rewards differ within each.
    buf.add(step, _rollout(len(records), step, -1.0), np.tile([0.0, 1.0], len(records)))
  assert fresh_counts == [4, 2, 2, 2, 2, 2]  # floor(0.5 * 4) = 2 replayed from step 1 on
  assert seen == list(range(len(seen)))  # in stream order, none skipped
  # Batches are drawn only when the queue is short: at steps 0, 1, 3 and 5; 2 prompts wait.
  assert len(seen) == 14 and len(buf.pending) == 2


def test_only_informative_groups_are_stored_and_each_is_replayed_once_newest_first():
  buf = ReplayBuffer(_cfg(ratio=0.5, max_age=5), group_size=G, num_prompts=P)
  rewards = np.array([1, 1, 0, 1, 0, 0, 1, 0], np.float32)  # groups: tied, mixed, tied, mixed
  buf.add(0, _rollout(4, 0, -1.0), rewards)
  assert len(buf.groups) == 2
  buf.add(1, _rollout(4, 1, -2.0), rewards)
  rollout, r, stats = buf.take(2, 2)
  assert np.all(rollout.versions == 1)  # the newest two: step 1's
  np.testing.assert_array_equal(r, [0, 1, 1, 0])
  np.testing.assert_array_equal(rollout.logprobs[:2], _rollout(4, 1, -2.0).logprobs[2:4])
  assert stats == {"replay/age_mean": 1.0, "replay/age_max": 1.0}
  assert len(buf.groups) == 2 and all(g[1] == 0 for g in buf.groups)  # taken ones are gone


def test_groups_older_than_max_age_are_evicted_and_capacity_holds():
  buf = ReplayBuffer(_cfg(ratio=0.5, max_age=2, capacity=3), group_size=G, num_prompts=P)
  for step in range(3):
    buf.add(step, _rollout(2, step, 0.0), np.tile([0.0, 1.0], 2))
  assert [g[0] for g in buf.groups] == [1, 2, 2]  # newest 3 of 6
  # At step 4 only versions >= 2 are young enough: step 1's group goes, two are left.
  records, n = buf.fresh_records(4, [], _stream())
  assert [g[1] for g in buf.groups] == [2, 2] and n == 2 and len(records) == 2
  buf2 = ReplayBuffer(_cfg(ratio=0.5, max_age=2), group_size=G, num_prompts=P)
  buf2.add(0, _rollout(2, 0, 0.0), np.tile([0.0, 1.0], 2))
  buf2.add(1, _rollout(1, 1, 0.0), np.tile([0.0, 1.0], 1))
  records, n = buf2.fresh_records(3, [], _stream())  # version 0 is 3 old: evicted
  assert n == 0 and len(records) == P and [g[1] for g in buf2.groups] == [1]


def test_the_buffer_survives_json_bit_for_bit():
  buf = ReplayBuffer(_cfg(), group_size=G, num_prompts=P)
  buf.add(0, _rollout(3, 0, -1.2345678), np.array([0, 1, 0.5, 1, 1, 0], np.float32))
  buf.fresh_records(1, [], _stream())
  back = ReplayBuffer(_cfg(), group_size=G, num_prompts=P)
  back.load_state_dict(json.loads(json.dumps(buf.state_dict())))
  assert back.pending == buf.pending
  assert len(back.groups) == len(buf.groups)
  for (s, o, r, w), (s2, o2, r2, w2) in zip(buf.groups, back.groups, strict=True):
    assert (s, o) == (s2, o2)
    np.testing.assert_array_equal(w, w2)
    for a, b in zip(r, r2, strict=True):
      if a is None:  # an optional field (captured routes) absent before is absent after
        assert b is None
        continue
      assert a.dtype == b.dtype
      np.testing.assert_array_equal(a, b)


def test_bad_state_and_ratios_are_refused():
  with pytest.raises(ValueError, match="nothing fresh"):
    ReplayBuffer(_cfg(ratio=1.0), group_size=G, num_prompts=P)
  buf = ReplayBuffer(_cfg(), group_size=3, num_prompts=P)
  good = ReplayBuffer(_cfg(), group_size=G, num_prompts=P)
  good.add(0, _rollout(1, 0, 0.0), np.array([0, 1], np.float32))
  with pytest.raises(ValueError, match="groups of 2 samples; this run's rl.group_size is 3"):
    buf.load_state_dict(good.state_dict())
  with pytest.raises(ValueError, match="malformed"):
    buf.load_state_dict({"groups": [{"step": 0}], "pending": []})


@rewards.register("length_parity_for_replay_test")
def _length_parity(completion, record):
  del record
  return float(len(completion) % 2)  # differs within most groups: they are stored


def _config(workdir, steps=5):
  return smoke_config(
    workdir,
    sft={"steps": 4},
    eval={"every": 0, "num_examples": 8},
    checkpoint={"every": 2},
    reward={"name": "length_parity_for_replay_test"},
    rl={"steps": steps, "prompts_per_step": 4, "group_size": 4, "replay": {"ratio": 0.5}},
  )


@pytest.mark.e2e
def test_replayed_groups_train_with_the_log_probs_and_versions_that_drew_them(tmp_path):
  c = _config(tmp_path)
  trainer = Trainer(c, log=lambda *_: None)
  fresh, trained = {}, []
  sample, update = trainer.experience.sample, trainer.learner.update

  def spy_sample(step, rnd, params, records, **kw):
    out = sample(step, rnd, params, records, **kw)
    r = out[0]
    for row in range(r.tokens.shape[0]):  # every fresh row, keyed by prompt and completion
      key = (step, r.prompt_tokens[row].tobytes() + r.tokens[row].tobytes())
      fresh[key] = (r.logprobs[row], r.versions[row])
    return out

  def spy_update(state, batch, step):
    trained.append((step, jax.device_get(batch)))
    return update(state, batch, step)

  trainer.experience.sample, trainer.learner.update = spy_sample, spy_update
  trainer.run()
  trainer.close()
  p_len, replayed = c.rl.max_prompt_len, []
  for step, batch in trained:
    assert batch.tokens.shape[0] == 4 * 4  # P groups of G, fresh and replayed
    versions = batch.versions[:, p_len:]
    for row in range(batch.tokens.shape[0]):
      v = int(versions[row, 0])
      if v == step:
        continue
      assert 0 < step - v <= 2  # replayed, never older than rl.replay.max_age
      key = (v, batch.tokens[row, :p_len].tobytes() + batch.tokens[row, p_len:].tobytes())
      assert key in fresh, f"replayed row {row} at step {step} was not sampled at step {v}"
      logprobs, drawn_by = fresh[key]
      np.testing.assert_array_equal(batch.old_logprobs[row, p_len:], logprobs)
      np.testing.assert_array_equal(versions[row], drawn_by)
      replayed.append(step)
  # floor(0.5 * 4) = 2 groups of 4 rows replayed at every step once the buffer holds 2.
  assert replayed and set(replayed) <= {1, 2, 3, 4}
  assert all(replayed.count(s) == 8 for s in set(replayed))


@pytest.mark.e2e
def test_a_resumed_run_replays_the_groups_stored_before_its_checkpoint(tmp_path):
  def rl_lines(wd):
    rows = [r for r in read_jsonl(wd / "metrics.jsonl") if r["phase"] == "rl"]
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]

  full = Trainer(_config(tmp_path / "full", steps=4), log=lambda *_: None)
  full.run()
  full_params = jax.device_get(full.state.policy.params)
  full.close()
  part = Trainer(_config(tmp_path / "part", steps=4), log=lambda *_: None)
  part.run(until=2)
  part.close()
  resumed = Trainer(_config(tmp_path / "part", steps=4), log=lambda *_: None)
  resumed.run()
  resumed_params = jax.device_get(resumed.state.policy.params)
  resumed.close()
  lines = rl_lines(tmp_path / "part")
  assert lines == rl_lines(tmp_path / "full")
  assert lines[2]["replay/replayed_groups"] == 2  # stored before the checkpoint
  for a, b in zip(jax.tree.leaves(full_params), jax.tree.leaves(resumed_params), strict=True):
    np.testing.assert_array_equal(a, b)
