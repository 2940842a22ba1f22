"""Train with a config file: python -m launch.train --config=configs/grpo_arith.py[:smoke]."""

import os
import re
import sys

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
  "config", None, "Path to a configs/*.py file, optionally with :variant.", lock_config=True
)
flags.mark_flags_as_required(["config"])


def _parse_flags(argv):
  """absl parsing, with config_flags' errors (unknown or mistyped field) as one clear line. An
  override of a field `Config` does not have fails first, naming it and the closest valid ones
  (config_flags itself says only "'foo'")."""
  from jaxrl.config import unknown_field_message

  for arg in argv[1:]:
    m = re.match(r"--(?:no)?config\.([\w.]+)", arg)
    if m and (msg := unknown_field_message(m.group(1))):
      sys.exit(f"error in command-line flags: {msg}")
    m = re.match(r"--config=([^:]*)", arg)
    if m and not os.path.isfile(m.group(1)):
      sys.exit(
        f"error in command-line flags: --config={m.group(1)!r} is not a file; expected "
        "configs/NAME.py, optionally with :variant"
      )
  try:
    return flags.FLAGS(argv)
  except (flags.Error, AttributeError, KeyError, TypeError, ValueError) as e:
    msg = " ".join(str(e).replace("\\n", " ").split())
    # An exception inside the config file arrives with its whole traceback: keep its last line.
    if "Traceback (most recent call last)" in msg:
      head = msg.split(": Error whilst parsing", 1)[0]
      last = re.findall(r"\b(\w+(?:Error|Exception): .*?)(?= File \"|$)", msg)
      msg = f"{head}: {last[-1]}" if last else msg
    sys.exit(f"error in command-line flags: {msg}")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  # Imported here so that --help and flag errors do not pay for importing jax.
  from jaxrl import distributed

  try:  # a multi-process run: every worker runs this command, the environment tells them apart.
    distributed.initialize_from_env()  # before anything else can start jax's backends
  except ValueError as e:
    sys.exit(f"error in environment: {e}")
  from jaxrl.checkpoint import CheckpointError
  from jaxrl.config import ConfigError, validate
  from jaxrl.data.jsonl import RecordError
  from jaxrl.guard import NonFiniteError
  from jaxrl.models.hf import CheckpointFileError
  from jaxrl.orbax_noise import silenced
  from jaxrl.preemption import Preempted
  from jaxrl.rewards import RewardError
  from jaxrl.rl.loop import Trainer
  from jaxrl.tokenizer import ChatTemplateError, TokenizerFileError

  # A bad file or a failing reward ends the run on its own message, not a traceback.
  input_errors = (
    RecordError,
    TokenizerFileError,
    ChatTemplateError,
    CheckpointFileError,
    CheckpointError,
  )
  # An unreadable checkpoint is logged in one line and fallen back from: not also reported
  # by each of its failed reads.
  with silenced():
    try:
      trainer = Trainer(validate(_CONFIG.value))
    except ConfigError as e:
      sys.exit(f"error in config: {e}")
    except input_errors as e:
      sys.exit(f"error in input: {e}")
    try:
      trainer.run()
    except (ConfigError, NonFiniteError, RewardError, *input_errors) as e:
      sys.exit(f"error: {e}")  # after `finally` has finished the in-flight checkpoint writes
    except Preempted as e:
      print(f"[jaxrl] {e}", file=sys.stderr)
      sys.exit(143)  # 128 + SIGTERM: not finished; the same command resumes
    finally:
      trainer.close()


if __name__ == "__main__":
  app.run(main, flags_parser=_parse_flags)
