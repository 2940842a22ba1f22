"""The CLI: config flags override fields; unknown, mistyped or out-of-range ones fail clearly."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


def _train(*flags):
  return subprocess.run(
    [sys.executable, "-m", "launch.train", "--config=configs/grpo_arith.py:smoke", *flags],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
  )


@pytest.mark.parametrize(
  "flag, message",
  [
    ("--config.rl.betta=0.0", "betta"),
    ("--config.rl.beta=abc", "beta"),
    ("--config.rl.group_size=1", "config.rl.group_size=1 is invalid"),
    ("--config.sft.batch_size=0", "config.sft.batch_size=0 is out of range"),
    ("--config.rl.max_prompt_len=60", "max_seq_len"),
    ("--config.reward.on_error=ignore", "config.reward.on_error='ignore' is invalid"),
  ],
)
def test_bad_flags_fail_with_a_message_naming_the_field(flag, message, tmp_path):
  out = _train(flag, f"--config.workdir={tmp_path}")
  assert out.returncode != 0
  assert message in out.stderr, out.stderr[-2000:]
  # Nothing was trained, so nothing was checkpointed.
  assert not list(tmp_path.glob("checkpoints/*/[0-9]*"))
