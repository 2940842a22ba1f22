"""Evaluate a run's checkpoint, or a model as a config builds it, on the held-out set.

  python -m launch.evaluate --config=configs/grpo_arith.py [--phase=latest|rl|sft|init]
      [--samples=N] [--table] [--out=FILE]

Reads only the params of the newest `phase` checkpoint of `config.workdir` (no optimizer state,
no critic, no teacher); `--phase=init` evaluates the model the config builds, without a
checkpoint: an HF checkpoint directory (`--config.model.path=DIR`) or a preset's initial draw.
Reports what the run logs at an evaluation: greedy held-out accuracy, the task's breakdown, and
with `--samples=N` (or `eval.num_samples`) N samples per problem at the RL temperature: sampled
accuracy and unbiased pass@k for k = 1, 2, 4, ..., N. Prints one JSON line (`--table`: also a
table); `--out` writes the JSON to a file.
"""

import json
import sys
from pathlib import Path

from absl import app, flags, logging
from ml_collections import config_flags

from launch.export import PHASES, ExportError, checked_config, parse_flags, restore_run


def evaluate(config, *, phase: str = "latest", samples: int | None = None) -> dict:
  """{"phase", "step", "eval/...": float} for `config.workdir`'s newest `phase` checkpoint
  (phase="init": the model as built, step 0); `samples` overrides eval.num_samples."""
  # Imported here so that --help and flag errors do not pay for importing jax.
  from jaxrl.mesh import use_mesh
  from jaxrl.rl.evaluation import Evaluator
  from jaxrl.rl.experience import build_sampler
  from jaxrl.rl.run import Run

  if samples is not None:
    config = config.copy_and_resolve_references()
    with config.unlocked():
      config.eval.num_samples = samples
  if phase == "init":
    run = Run.build(checked_config(config, "latest"), writes=False)
    step, params = 0, run.init_params
  else:
    run, phase, step, params = restore_run(checked_config(config, phase), phase)
  with use_mesh(run.mesh, run.rules):
    metrics = Evaluator(run, build_sampler(run))(params)
  return {"phase": phase, "step": step, **metrics}


def _define_flags() -> None:
  config_flags.DEFINE_config_file(
    "config", None, "The run's configs/*.py file, optionally with :variant.", lock_config=True
  )
  flags.DEFINE_enum(
    "phase",
    "latest",
    (*PHASES, "init"),
    "Checkpoint to evaluate: latest = newest RL, else newest SFT; init = the model the config "
    "builds (an HF directory via --config.model.path), no checkpoint.",
  )
  flags.DEFINE_integer(
    "samples", None, "Samples per problem for sampled accuracy and pass@k.", lower_bound=0
  )
  flags.DEFINE_bool("table", False, "Also print the metrics as a table.")
  flags.DEFINE_string("out", None, "Also write the JSON line to this file.")
  flags.mark_flags_as_required(["config"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)  # orbax logs every restore at INFO
  from jaxrl.config import ConfigError

  FLAGS = flags.FLAGS
  try:
    result = evaluate(FLAGS.config, phase=FLAGS.phase, samples=FLAGS.samples)
  except ConfigError as e:
    sys.exit(f"error in config: {e}")
  except ExportError as e:
    sys.exit(f"error: {e}")
  line = json.dumps(result)
  if FLAGS.out:
    Path(FLAGS.out).write_text(line + "\n")
  print(line)
  if FLAGS.table:
    print(table(result))


def table(result: dict) -> str:
  """The metrics as a two-column Markdown table."""
  rows = ["| metric | value |", "|---|---|"]
  for k, v in result.items():
    rows.append(f"| {k} | {v:.4f} |" if isinstance(v, float) else f"| {k} | {v} |")
  return "\n".join(rows)


if __name__ == "__main__":
  _define_flags()
  app.run(main, flags_parser=parse_flags)
