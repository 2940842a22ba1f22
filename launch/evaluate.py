"""Evaluate a run's checkpoint on its held-out set: python -m launch.evaluate.

  python -m launch.evaluate --config=configs/grpo_arith.py [--phase=latest|rl|sft] [--out=FILE]

Reads only the params of the newest `phase` checkpoint of `config.workdir` (no optimizer state,
no critic, no teacher), builds the run's sampler and reports what the run logs at an
evaluation: greedy held-out accuracy, the task's breakdown, and with `eval.num_samples` the
sampled accuracy. Prints one JSON line; `--out` also writes it to a file.
"""

import json
import sys
from pathlib import Path

from absl import app, flags, logging
from ml_collections import config_flags

from launch.export import PHASES, ExportError, checked_config, parse_flags, restore_run


def evaluate(config, *, phase: str = "latest") -> dict:
  """{"phase", "step", "eval/...": float} for `config.workdir`'s newest `phase` checkpoint."""
  # Imported here so that --help and flag errors do not pay for importing jax.
  from jaxrl.mesh import use_mesh
  from jaxrl.rl.evaluation import Evaluator
  from jaxrl.rl.experience import build_sampler

  run, phase, step, params = restore_run(checked_config(config, phase), phase)
  with use_mesh(run.mesh, run.rules):
    metrics = Evaluator(run, build_sampler(run))(params)
  return {"phase": phase, "step": step, **metrics}


def _define_flags() -> None:
  config_flags.DEFINE_config_file(
    "config", None, "The run's configs/*.py file, optionally with :variant.", lock_config=True
  )
  flags.DEFINE_enum(
    "phase", "latest", PHASES, "Checkpoint to evaluate: latest = newest RL, else newest SFT."
  )
  flags.DEFINE_string("out", None, "Also write the JSON line to this file.")
  flags.mark_flags_as_required(["config"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)  # orbax logs every restore at INFO
  from jaxrl.config import ConfigError

  FLAGS = flags.FLAGS
  try:
    result = evaluate(FLAGS.config, phase=FLAGS.phase)
  except ConfigError as e:
    sys.exit(f"error in config: {e}")
  except ExportError as e:
    sys.exit(f"error: {e}")
  line = json.dumps(result)
  if FLAGS.out:
    Path(FLAGS.out).write_text(line + "\n")
  print(line)


if __name__ == "__main__":
  _define_flags()
  app.run(main, flags_parser=parse_flags)
