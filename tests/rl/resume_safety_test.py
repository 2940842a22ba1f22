"""Resume safety: an unreadable newest checkpoint falls back to the one before it and the run
still repeats an uninterrupted one; resume=False refuses a workdir that holds another run."""

import dataclasses
import os
import shutil
import time

import jax
import numpy as np
import pytest
from helpers import rl_metric_lines
from loop_test import _config

from jaxrl.config import ConfigError
from jaxrl.rl.loop import Trainer


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_unreadable_latest_checkpoint_falls_back_and_repeats_the_run(tmp_path):
  full = Trainer(_config(tmp_path / "full"), log=lambda *_: None)
  full.run()
  full_params = jax.device_get(full.state.policy.params)
  full.close()

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
  assert rl_metric_lines(tmp_path / "part") == rl_metric_lines(tmp_path / "full")
  for a, b in zip(jax.tree.leaves(full_params), jax.tree.leaves(resumed_params), strict=True):
    np.testing.assert_array_equal(a, b)
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
