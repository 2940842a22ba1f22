"""Non-finite guard: skipped updates counted and bounded, checkpoints only from finite states,
rewards beyond their range handled per reward.on_error, a diverging run stopped with a message."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from loop_test import _config

from jaxrl import rewards
from jaxrl.checkpoint import Checkpointer
from jaxrl.config import ConfigError, validate
from jaxrl.guard import NonFiniteError, NonFiniteGuard, all_finite
from jaxrl.rl.loop import Trainer
from jaxrl.rl.run import abstract

pytestmark = pytest.mark.integration


def test_guard_counts_runs_of_skipped_updates():
  guard = NonFiniteGuard(3, "RL", hint="Do X.")
  for flag in [0, 1, 1, 0, 1, 1, 0]:  # runs of 2: never 3 in a row
    guard.update(jnp.float32(flag))
  assert guard.check(7) == 4
  for flag in [1, 1, 1, 0]:  # a run of 3, ended before the check: still seen
    guard.update(jnp.float32(flag))
  with pytest.raises(NonFiniteError) as e:
    guard.check(11)
  msg = str(e.value)
  assert "RL stopped at step 11: 3 consecutive" in msg and "7 skipped in all" in msg
  assert "guard.max_nonfinite_updates=3" in msg and msg.endswith("Do X.")
  # A resumed run carries the total on; its run of consecutive skips starts at zero.
  guard = NonFiniteGuard(2, "SFT")
  guard.resume(5)
  guard.update(1.0)
  assert guard.check(1) == 6
  with pytest.raises(ValueError, match="limit must be >= 1"):
    NonFiniteGuard(0, "RL")
  with pytest.raises(ConfigError, match="guard.max_nonfinite_updates"):
    validate({"guard": {"max_nonfinite_updates": 0}})


def test_all_finite_reads_floating_leaves_only():
  tree = {"w": jnp.ones((2, 3)), "step": jnp.int32(4), "key": jax.random.key(0), "n": 3}
  assert all_finite(tree)
  assert not all_finite({**tree, "w": tree["w"].at[1, 2].set(jnp.inf)})
  assert not all_finite({**tree, "b": jnp.array([jnp.nan], jnp.bfloat16)})
  assert all_finite({"step": jnp.int32(1)})


def test_checkpoint_of_a_nonfinite_state_is_never_written(tmp_path):
  ck = Checkpointer(tmp_path, max_to_keep=2)
  good = {"w": jnp.arange(4.0)}
  assert ck.save(1, good, {"phase": "x"})
  with pytest.raises(NonFiniteError, match="not writing checkpoint 2 .* NaN or inf"):
    ck.save(2, {"w": good["w"].at[0].set(jnp.nan)}, {"phase": "x"}, force=True)
  assert ck.all_steps() == [1]
  restored, _ = ck.restore(None, good)
  np.testing.assert_array_equal(restored["w"], good["w"])
  ck.close()
  assert sorted(p.name for p in tmp_path.iterdir()) == ["1"]  # no half-written step


def _big(completion, record):
  return {"a": 1e39, "b": 2e6, "c": -5.0}[completion]


def test_rewards_beyond_the_range_are_errors():
  recs = [{"prompt": "p"}] * 3
  # Without a range: anything float32 cannot hold (1e39 would be stored as inf).
  with pytest.raises(rewards.RewardError, match="1e\\+39 is beyond the accepted range"):
    rewards.compute_rewards(_big, ["c", "b", "a"], recs, on_error="raise")
  values, failures = rewards.compute_rewards(_big, ["c", "b", "a"], recs, on_error="zero")
  np.testing.assert_array_equal(values, [-5.0, 2e6, 0.0])
  assert failures == 1
  # config.reward.max_abs (1e6 by default) is far tighter.
  values, failures = rewards.compute_rewards(
    _big, ["c", "b", "a"], recs, on_error="zero", max_abs=1e6
  )
  np.testing.assert_array_equal(values, [-5.0, 0.0, 0.0])
  assert failures == 2
  with pytest.raises(rewards.RewardError, match="sample 1 .*2000000.0 is beyond .*1e\\+06"):
    rewards.compute_rewards(_big, ["c", "b"], recs[:2], on_error="raise", max_abs=1e6)
  with pytest.raises(ConfigError, match="reward.max_abs"):
    validate({"reward": {"max_abs": 0.0}})


@pytest.mark.e2e
def test_diverging_warm_start_stops_with_its_last_finite_checkpoint(tmp_path):
  # sft.learning_rate=1e5 with no warmup: the params blow up after the first update, every
  # later loss is NaN. Before the guard the run went on to the end and exited 0.
  cfg = _config(tmp_path)
  cfg = dataclasses.replace(
    cfg,
    sft=dataclasses.replace(cfg.sft, learning_rate=1e5, warmup_steps=0, steps=40),
    guard=dataclasses.replace(cfg.guard, max_nonfinite_updates=3),
  )
  trainer = Trainer(cfg, log=lambda *_: None)
  with pytest.raises(NonFiniteError, match=r"SFT stopped at step \d+: 3 consecutive .*"):
    trainer.run()
  trainer.close()
  ck = Checkpointer(tmp_path / "checkpoints" / "sft")
  steps = ck.all_steps()
  assert steps and steps[-1] < 40
  target = {"train": {"params": abstract(trainer.ctx.init_params)}}
  assert all_finite(ck.restore_subtree(steps[-1], target))
  ck.close()
  assert not (tmp_path / "checkpoints" / "rl").exists() or not list(
    (tmp_path / "checkpoints" / "rl").glob("[0-9]*")
  )


@pytest.mark.e2e
def test_one_nonfinite_rl_step_is_skipped_and_the_run_goes_on(tmp_path):
  logged = []
  trainer = Trainer(_config(tmp_path), log=logged.append)
  batch_fn, sft_step = trainer.experience.batch, trainer.sft.step_fn
  seen, sft_calls = {}, []

  def poisoned_sft(state, batch):
    sft_calls.append(1)
    if len(sft_calls) in (3, 7):  # two NaN weights: skipped, the first one told
      batch = batch._replace(loss_mask=batch.loss_mask.at[0, 0].set(jnp.nan))
    return sft_step(state, batch)

  def poisoned(step, rolled, **kw):
    batch, m = batch_fn(step, rolled, **kw)
    if step == 1:  # one NaN advantage: before the guard, every param became NaN here
      seen["before"] = jax.device_get(trainer.state.policy.params)
      batch = batch._replace(advantages=batch.advantages.at[0].set(jnp.nan))
    if step == 2:  # a finite advantage (the tiny model's rewards may all tie): a real update
      seen["after"] = jax.device_get(trainer.state.policy.params)
      batch = batch._replace(advantages=batch.advantages.at[0].set(batch.loss_mask[0]))
    return batch, m

  trainer.experience.batch, trainer.sft.step_fn = poisoned, poisoned_sft
  summary = trainer.run()
  final = jax.device_get(trainer.state.policy.params)
  trainer.close()
  lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  flags = [r["opt/nonfinite"] for r in lines if r["phase"] == "rl"]
  assert flags == [0.0, 1.0, 0.0, 0.0]
  assert summary["rl_nonfinite_updates"] == 1 and summary["sft_nonfinite_updates"] == 2
  # One line per phase, the first time: SFT counts its skips every checkpoint.every=2 steps.
  told = [line for line in logged if "skipped" in line]
  assert told == [
    "[jaxrl] SFT steps 3-4: an optimizer update was skipped (non-finite loss, gradient or "
    "update; params and optimizer state kept), 1 skipped so far; later ones are only counted "
    "(opt/nonfinite), and guard.max_nonfinite_updates=10 in a row stop the run",
    "[jaxrl] RL step 2: the optimizer update was skipped (non-finite loss, gradient or update; "
    "params and optimizer state kept), 1 skipped so far; later ones are only counted "
    "(opt/nonfinite), and guard.max_nonfinite_updates=10 in a row stop the run",
  ]
  for a, b in zip(jax.tree.leaves(seen["before"]), jax.tree.leaves(seen["after"]), strict=True):
    np.testing.assert_array_equal(a, b)  # step 1 left the policy as it was
  assert all_finite(final)
  after, final = jax.tree.leaves(seen["after"]), jax.tree.leaves(final)
  moved = [np.max(np.abs(a - b)) for a, b in zip(after, final, strict=True)]
  assert max(moved) > 0  # and the steps after it trained
