"""Export a run's trained params as an HF checkpoint directory: python -m launch.export."""

import json
import math
import shutil
import sys
from pathlib import Path

from absl import app, flags, logging
from ml_collections import config_flags

PHASES = ("latest", "rl", "sft")
# What an HF tokenizer directory needs to be usable beside the weights (copied when present).
TOKENIZER_FILES = (
  "tokenizer.json",
  "tokenizer_config.json",
  "special_tokens_map.json",
  "chat_template.jinja",
  "generation_config.json",
)


class ExportError(ValueError):
  """A bad --out, or a workdir without the requested checkpoint; the message says which."""


def checked_config(config, phase: str):
  """The validated Config of `config` (the run's ConfigDict), after checking `phase`."""
  from jaxrl.config import validate

  if phase not in PHASES:
    raise ExportError(f"phase={phase!r} is invalid; allowed: {', '.join(PHASES)}")
  return validate(config)


def restore_run(cfg, phase: str):
  """(run, phase, step, params): the run's model, tokenizer and mesh (`jaxrl.rl.run.Run`), and
  the params alone read from its newest `phase` checkpoint; no engine, optimizer, teacher or
  critic is built. Errors name the workdir or the mismatch (ExportError)."""
  # Imported here so that --help and flag errors do not pay for importing jax.
  from jaxrl.checkpoint import CheckpointError
  from jaxrl.rl.run import Run, restore_params

  # Checked before building the run, whose task may write data into a mistyped workdir.
  if not (Path(cfg.workdir) / "checkpoints").is_dir():
    raise ExportError(
      f"no checkpoint in workdir {cfg.workdir!r}: it has no checkpoints/ directory "
      "(checkpointed phases: none)"
    )
  run = Run.build(cfg, writes=False)  # a read-only workdir exports too
  try:
    phase, step, params = restore_params(run, phase)
  except FileNotFoundError as e:
    raise ExportError(str(e)) from e
  except CheckpointError as e:
    raise ExportError(f"{e}\n--config must describe the run that wrote the checkpoint") from e
  return run, phase, step, params


def export(config, out, *, phase: str = "latest") -> str:
  """Writes the params of `config.workdir`'s newest `phase` checkpoint ('rl', 'sft', or 'latest':
  RL if any, else SFT) to `out` as an HF checkpoint (config.json + safetensors, LoRA merged), plus
  the run's HF tokenizer files; returns a one-line summary. `config` is the run's ConfigDict.
  """
  from jaxrl.models.hf import export_hf_checkpoint

  cfg = checked_config(config, phase)
  out = Path(out)
  if out.exists() and not out.is_dir():
    raise ExportError(f"--out={str(out)!r} exists and is not a directory")
  # Exporting over the checkpoint or tokenizer the run started from would destroy it.
  for field in ("path", "tokenizer"):
    source = getattr(cfg.model, field)
    if source and source != "byte" and out.resolve() == Path(source).resolve():
      raise ExportError(f"--out={str(out)!r} is config.model.{field}; choose another directory")
  workdir = Path(cfg.workdir)
  run, phase, step, params = restore_run(cfg, phase)
  export_hf_checkpoint(run.model_cfg, params, out)
  copied = _copy_tokenizer_files(run.tokenizer, out)
  model_type = json.loads((out / "config.json").read_text())["model_type"]
  if copied:
    tok = f"tokenizer files from {run.tokenizer.path}: {', '.join(copied)}"
  else:
    tok = "byte tokenizer: no tokenizer files written (ids: pad 0, bos 1, eos 2, byte b -> b + 3)"
  return (
    f"[jaxrl] exported {phase} step {step} of {workdir} ({_num_params(out):,} params, "
    f"{model_type}) to {out}; {tok}"
  )


def _copy_tokenizer_files(tokenizer, out: Path) -> list[str]:
  """Copies the HF tokenizer's files into `out`; the byte tokenizer has none (returns [])."""
  src = getattr(tokenizer, "path", None)
  if src is None:
    return []
  copied = []
  for name in TOKENIZER_FILES:
    if (Path(src) / name).is_file():
      shutil.copyfile(Path(src) / name, out / name)
      copied.append(name)
  return copied


def _num_params(out: Path) -> int:
  """Parameters in the written safetensors (a tied head is stored, and counted, once)."""
  from safetensors import safe_open

  total = 0
  for file in sorted(out.glob("model*.safetensors")):
    with safe_open(file, framework="numpy") as f:
      total += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())  # noqa: SIM118
  return total


def _define_flags() -> None:
  # Defined at launch only, so that tests can import `export` beside launch.train's --config.
  config_flags.DEFINE_config_file(
    "config", None, "The run's configs/*.py file, optionally with :variant.", lock_config=True
  )
  flags.DEFINE_string("out", None, "Directory for the HF checkpoint (created; weights replaced).")
  flags.DEFINE_enum(
    "phase", "latest", PHASES, "Checkpoint to export: latest = newest RL, else newest SFT."
  )
  flags.mark_flags_as_required(["config", "out"])


def parse_flags(argv):
  """absl parsing, with config_flags' errors (unknown or mistyped field) as one clear line."""
  try:
    return flags.FLAGS(argv)
  except (flags.Error, AttributeError, KeyError, TypeError, ValueError) as e:
    msg = " ".join(str(e).replace("\\n", " ").split())
    sys.exit(f"error in command-line flags: {msg}")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)  # orbax logs every restore at INFO
  from jaxrl.config import ConfigError

  FLAGS = flags.FLAGS
  try:
    line = export(FLAGS.config, FLAGS.out, phase=FLAGS.phase)
  except ConfigError as e:
    sys.exit(f"error in config: {e}")
  except ExportError as e:
    sys.exit(f"error: {e}")
  print(line)


if __name__ == "__main__":
  _define_flags()
  app.run(main, flags_parser=parse_flags)
