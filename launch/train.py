"""Train with a config file: python -m launch.train --config=configs/grpo_arith.py[:smoke]."""

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
  "config", None, "Path to a configs/*.py file.", lock_config=True
)
flags.mark_flags_as_required(["config"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  # Imported here so that --help and flag errors do not pay for importing jax.
  from jaxrl.config import validate
  from jaxrl.rl.loop import Trainer

  cfg = validate(_CONFIG.value)
  trainer = Trainer(cfg)
  try:
    trainer.run()
  finally:
    trainer.close()


if __name__ == "__main__":
  app.run(main)
