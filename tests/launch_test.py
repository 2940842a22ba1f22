"""The CLI: config flags override fields; unknown, mistyped or out-of-range ones fail clearly."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import CHILD_TIMEOUT_S, child_env, run_child, wait_children

pytestmark = pytest.mark.integration

ROOT = Path(__file__).parent.parent


def _train(*flags):
  return run_child(
    [sys.executable, "-m", "launch.train", "--config=configs/grpo_arith.py:smoke", *flags],
    cwd=ROOT,
  )


@pytest.mark.parametrize(
  "flag, message",
  [
    ("--config.rl.betta=0.0", "betta"),
    ("--config.rl.kl.beta=abc", "beta"),
    ("--config.rl.group_size=1", "config.rl.group_size=1 is invalid"),
    ("--config.sft.batch_size=0", "config.sft.batch_size=0 is out of range"),
    ("--config.rl.max_prompt_len=60", "max_seq_len"),
    ("--config.reward.on_error=ignore", "config.reward.on_error='ignore' is invalid"),
    (
      "--config.task.prompt_template={question}",
      "config.task.prompt_template='{question}' does not fit a record with fields",
    ),
  ],
)
def test_bad_flags_fail_with_a_message_naming_the_field(flag, message, tmp_path):
  out = _train(flag, f"--config.workdir={tmp_path}")
  assert out.returncode != 0
  assert message in out.stderr, out.stderr[-2000:]
  # Nothing was trained, so nothing was checkpointed.
  assert not list(tmp_path.glob("checkpoints/*/[0-9]*"))


CONFIGS = sorted((ROOT / "configs").glob("*.py"))


def _other_value(value):
  """A value of the field's own type that differs from `value`, as a flag string and parsed."""
  if isinstance(value, bool):
    return ("false" if value else "true"), not value
  if isinstance(value, int):
    return str(value + 1), value + 1
  if isinstance(value, float):
    return repr(value + 0.5), value + 0.5
  return value + "x", value + "x"


def _parse(path, *overrides):
  """The ConfigDict `launch.train` would get for `--config=path` and these overrides (parsed as
  it parses them: config_flags, a locked config)."""
  from absl import flags
  from ml_collections import config_flags

  argv = [sys.argv[0], f"--config={path}", *overrides]
  holder = config_flags.DEFINE_config_file(
    "config", flag_values=flags.FlagValues(), lock_config=True, sys_argv=argv
  )
  holder._flagvalues(argv)  # noqa: SLF001 - the FlagValues the holder was defined on
  return holder.value


# config_flags loads config files with the deprecated load_module(), once per override here.
@pytest.mark.filterwarnings("ignore:the load_module\\(\\) method is deprecated:DeprecationWarning")
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_every_field_can_be_set_from_the_command_line(path):
  """`--config.a.b=v` works for every field of `Config`, whatever the config file's dict holds
  (the README's `--config.model.lora_rank=16` on grpo_gsm8k used to fail with "'lora_rank'")."""
  from jaxrl.config import field_paths

  leaves = [p for p, section in field_paths().items() if not section]
  base = _parse(path)
  failed = []
  for leaf in leaves:
    value = base
    for key in leaf.split("."):
      value = value[key]
    text, want = _other_value(value)
    try:
      got = _parse(path, f"--config.{leaf}={text}")
      for key in leaf.split("."):
        got = got[key]
      if got != want:
        failed.append(f"{leaf}: {got!r} != {want!r}")
    except Exception as e:  # noqa: BLE001 - report every field that fails, not the first
      failed.append(f"{leaf}: {type(e).__name__}: {e}")
  assert len(leaves) > 100 and not failed, failed[:10]


def test_an_unknown_flag_names_the_field_and_the_closest_ones(tmp_path):
  out = _train("--config.sft.carelessrate=0.5", f"--config.workdir={tmp_path}")
  assert out.returncode != 0
  assert (
    "error in command-line flags: unknown field config.sft.carelessrate; did you mean "
    "config.sft.careless_rate?" in out.stderr
  ), out.stderr[-2000:]
  assert not tmp_path.exists() or not any(tmp_path.iterdir())


@pytest.mark.e2e
def test_a_diverging_run_exits_nonzero_with_the_guard_message(tmp_path):
  # Before the non-finite guard this trained NaN params to the end and exited 0.
  out = _train(
    f"--config.workdir={tmp_path}",
    "--config.sft.learning_rate=1e5",
    "--config.sft.warmup_steps=0",
    "--config.guard.max_nonfinite_updates=2",
    "--config.log.progress=false",
  )
  assert out.returncode != 0
  assert "error: SFT stopped at step" in out.stderr, out.stderr[-2000:]
  assert "Lower sft.learning_rate" in out.stderr
  assert "Traceback" not in out.stderr  # one clear message, no stack or clean-up noise


@pytest.mark.e2e
def test_sigterm_exits_143_after_checkpointing(tmp_path):
  import signal
  import time

  proc = subprocess.Popen(
    [
      sys.executable,
      "-m",
      "launch.train",
      "--config=configs/grpo_arith.py:smoke",
      f"--config.workdir={tmp_path}",
      "--config.log.progress=false",
    ],
    cwd=ROOT,
    env=child_env(),
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )
  deadline = time.monotonic() + CHILD_TIMEOUT_S
  while not list(tmp_path.glob("checkpoints/sft/[0-9]*")):
    # the warm-start is under way once its first checkpoint is committed
    assert proc.poll() is None, proc.communicate()[0][-2000:]
    if time.monotonic() > deadline:
      wait_children([proc], timeout=0)  # aborts it and fails with its stack
    time.sleep(0.2)
  proc.send_signal(signal.SIGTERM)
  (err,) = wait_children([proc])
  assert proc.returncode == 143, err[-2000:]
  m = re.search(r"stopped on SIGTERM after (SFT|RL) step (\d+), checkpointed in (\S+);", err)
  assert m, err[-2000:]
  assert (Path(m.group(3).rstrip(",")) / m.group(2)).is_dir()
  assert "Traceback" not in err
