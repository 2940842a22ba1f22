"""Resume safety: an unreadable newest checkpoint falls back to the one before it and the run
still repeats an uninterrupted one; SIGTERM checkpoints the step in flight and stops; resume=False
refuses a workdir that holds another run; batches that cannot split over the mesh fail first."""

import dataclasses
import os
import shutil
import signal
import time

import jax
import numpy as np
import pytest
from helpers import rl_metric_lines
from loop_test import _config

from jaxrl.config import ConfigError
from jaxrl.preemption import Preempted
from jaxrl.rl.loop import Trainer

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  """(RL metric rows, final params) of the run every interrupted one must repeat."""
  workdir = tmp_path_factory.mktemp("full")
  full = Trainer(_config(workdir), log=lambda *_: None)
  full.run()
  params = jax.device_get(full.state.policy.params)
  full.close()
  return rl_metric_lines(workdir), params


def _assert_repeats(uninterrupted, workdir, params):
  lines, full_params = uninterrupted
  assert rl_metric_lines(workdir) == lines
  for a, b in zip(jax.tree.leaves(full_params), jax.tree.leaves(params), strict=True):
    np.testing.assert_array_equal(a, b)


@pytest.mark.e2e
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_unreadable_latest_checkpoint_falls_back_and_repeats_the_run(tmp_path, uninterrupted):
  part = Trainer(_config(tmp_path / "part"), log=lambda *_: None)
  part.run(until=3)  # checkpoint.every=2: RL checkpoints at 2 and 3 (forced)
  part.close()
  ckpts = tmp_path / "part" / "checkpoints"
  assert sorted(p.name for p in (ckpts / "rl").iterdir()) == ["2", "3"]
  # Step 3's arrays are lost (a preempted copy, a full disk): not restorable.
  for name in os.listdir(ckpts / "rl" / "3" / "state"):
    if (ckpts / "rl" / "3" / "state" / name).is_dir():
      shutil.rmtree(ckpts / "rl" / "3" / "state" / name)
  logged = []
  resumed = Trainer(_config(tmp_path / "part"), log=logged.append)
  resumed.run()
  resumed_params = jax.device_get(resumed.state.policy.params)
  resumed.close()
  assert any("checkpoint 3 cannot be read" in line for line in logged)
  assert any("resumed RL from step 2" in line for line in logged)
  assert (ckpts / "rl.unreadable" / "3").is_dir()
  # Steps 3 and 4 trained again from step 2's state: the same run, every metric row once.
  _assert_repeats(uninterrupted, tmp_path / "part", resumed_params)
  time.sleep(0.5)  # stray tensorstore completions of the failed read land here


def test_resume_false_refuses_a_used_workdir(tmp_path):
  cfg = _config(tmp_path)
  (tmp_path / "checkpoints" / "sft" / "10").mkdir(parents=True)
  (tmp_path / "metrics.jsonl").write_text("{}\n")
  cfg = dataclasses.replace(cfg, resume=False)
  pattern = r"config.resume=False but config.workdir=.* holds a run \(checkpoints/sft/10, metrics"
  with pytest.raises(ConfigError, match=pattern):
    Trainer(cfg, log=lambda *_: None)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "metrics.jsonl"]


@pytest.mark.parametrize(
  "section, field, value, message",
  [
    ("sft", "batch_size", 12, r"config\.sft\.batch_size = 12 rows is invalid; allowed: a multiple"),
    ("rl", "prompts_per_step", 3, r"config\.rl\.prompts_per_step \* rl\.group_size / rl\.num_mini"),
  ],
)
def test_a_batch_that_does_not_split_over_the_mesh_is_a_config_error(
  tmp_path, section, field, value, message
):
  # 8 test devices, the batch over all of them: 12 demonstrations or 3 prompts x 4 samples do
  # not split. Before, JAX's IndivisibleError named no field, in RL after the whole warm-start.
  cfg = _config(tmp_path, devices=0)
  part = dataclasses.replace(getattr(cfg, section), **{field: value})
  with pytest.raises(ConfigError, match=message + r".* of 8, the devices each batch is split"):
    Trainer(dataclasses.replace(cfg, **{section: part}), log=lambda *_: None)
  assert not (tmp_path / "checkpoints").exists()


@pytest.mark.e2e
def test_sigterm_checkpoints_the_step_in_flight_and_the_run_resumes(tmp_path, uninterrupted):
  # SIGTERM during SFT step 3 (checkpoint.every=2: not a save step of its own).
  first = Trainer(_config(tmp_path / "part"), log=lambda *_: None)
  step_fn, calls = first.sft.step_fn, []

  def sft_step(state, batch):
    calls.append(1)
    if len(calls) == 3:
      os.kill(os.getpid(), signal.SIGTERM)
    return step_fn(state, batch)

  first.sft.step_fn = sft_step
  handler = signal.getsignal(signal.SIGTERM)
  with pytest.raises(Preempted, match=r"after SFT step 3, checkpointed in .*sft") as e:
    first.run()
  first.close()
  assert e.value.step == 3 and first.sft.ckpt.all_steps()[-1] == 3
  assert signal.getsignal(signal.SIGTERM) is handler  # the run's handler was taken down

  # Resumed: SIGTERM during RL step 1 (no checkpoint of its own either).
  logged = []
  second = Trainer(_config(tmp_path / "part"), log=logged.append)
  batch_fn = second.experience.batch

  def batch(step, rolled, **kw):
    if step == 0:
      os.kill(os.getpid(), signal.SIGTERM)
    return batch_fn(step, rolled, **kw)

  second.experience.batch = batch
  with pytest.raises(Preempted, match=r"after RL step 1, checkpointed in .*rl"):
    second.run()
  second.close()
  assert any("resumed SFT from step 3" in line for line in logged)
  assert second.rl_ckpt.all_steps() == [1]

  third = Trainer(_config(tmp_path / "part"), log=logged.append)
  third.run()
  params = jax.device_get(third.state.policy.params)
  third.close()
  assert any("resumed RL from step 1" in line for line in logged)
  _assert_repeats(uninterrupted, tmp_path / "part", params)
