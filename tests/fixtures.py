"""The suite's shared fixtures (a plugin registered by tests/conftest.py): the smoke-sized run
config every trainer test starts from, and the tiny model with its weights drawn once.

`smoke_config(workdir, rl={"steps": 2}, ...)` is the default job's `:smoke` variant
(configs/grpo_arith.py) on the tiny model (prime sizes, so a transposed weight shows) and one
of the session's 8 devices, with no progress bar and no TensorBoard, written to `workdir`. A
test of sharding or placement asks for all 8 (`mesh={"devices": 0}`); on one device a run's
programs compile and run about twice as fast on a CPU. each keyword names a config section and
is merged into it key by key (nested sections too), or replaces a top-level value. `config=`
starts from another file of configs/ instead. The builder is also a plain function, for code
outside pytest (tests/multihost_worker.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def smoke_configdict(workdir, config: str = "grpo_arith", **sections):
  """configs/<config>.py's `:smoke` ConfigDict for a test run in `workdir`, `sections` merged in
  (before validation: for tests that edit it further or check what validation says)."""
  from jaxrl.config import config_module

  c = config_module(ROOT / "configs" / f"{config}.py").get_config("smoke")
  c.workdir = str(workdir)
  c.log.progress = False
  c.log.tensorboard = False
  c.model.preset = "tiny"
  c.mesh.devices = 1
  for name, value in sections.items():
    if isinstance(value, dict) and name in c and hasattr(c[name], "update"):
      c[name].update(value)  # merged key by key, nested sections too
    else:
      c[name] = value
  return c


def smoke_config(workdir, config: str = "grpo_arith", **sections):
  """`smoke_configdict(...)` validated: the run's Config."""
  from jaxrl.config import validate

  return validate(smoke_configdict(workdir, config, **sections))


@pytest.fixture(name="smoke_config", scope="session")
def _smoke_config_fixture():
  """The builder `smoke_config(workdir, config="grpo_arith", **sections) -> Config`."""
  return smoke_config


@pytest.fixture(name="tiny_model", scope="session")
def _tiny_model_fixture():
  """(cfg, graphdef, params): `ModelConfig.tiny()` with numpy-drawn weights, built once per
  worker. Read-only: a test that changes params makes its own copy."""
  from helpers import tiny_model

  return tiny_model()
