"""Every config in configs/ loads, validates and runs its `smoke` variant end to end."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxrl.config import config_module, validate
from jaxrl.rewards import sandbox
from jaxrl.rl import components
from jaxrl.rl.loop import Trainer

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.py"))


def _load(path: Path):
  return config_module(path)


def test_there_are_configs():
  assert any(p.stem == "grpo_arith" for p in CONFIGS)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_full_config_validates_and_documents_itself(path):
  mod = _load(path)
  doc = mod.__doc__ or ""
  assert "launch" in doc.lower() and "expected" in doc.lower(), (
    "docstring: command, runtime, result"
  )
  validate(mod.get_config(None))
  for variant in getattr(mod, "VARIANTS", ()):  # every variant a config names is valid
    validate(mod.get_config(variant))
  with pytest.raises(ValueError, match="smoke"):
    mod.get_config("smok")


@pytest.mark.e2e
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_smoke_variant_runs_and_learns(path, tmp_path):
  cfg = _load(path).get_config("smoke")
  cfg.workdir = str(tmp_path)
  cfg.mesh.devices = 1  # the one CPU device a user's `launch/train.sh ...:smoke` runs on
  cfg.log.progress = False
  trainer = Trainer(validate(cfg), log=lambda *_: None)
  init = jax.device_get(trainer.ctx.init_params)
  init = [np.array(x) for x in jax.tree.leaves(init)]  # copied: the SFT step donates its state
  summary = trainer.run()
  final = jax.device_get(trainer.state.policy.params)
  trainer.close()

  lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  sft = [r["sft/loss"] for r in lines if r["phase"] == "sft" and "sft/loss" in r]
  rl = [r for r in lines if r["phase"] == "rl"]
  if cfg.task.name == "arithmetic":
    assert sft[-1] < 0.6 * sft[0], sft  # the warm-start learns
    assert summary["accuracy_after_sft"] > summary["accuracy_init"]  # ... and it shows held out
  else:
    # GSM8K-style smoke runs use a tiny random model on long byte sequences: it can only learn
    # the text's statistics in a few dozen steps, not the answers.
    assert sft[-1] < 0.8 * sft[0], sft
  # RL ran every step on finite numbers and moved every parameter. (That it moves reward the
  # right way is shown by tests/rl/loop_test.py on a reward a smoke-sized model can reach.)
  assert [r["step"] for r in rl] == list(range(1, len(rl) + 1)) and len(rl) == cfg.rl.steps
  assert all(np.isfinite(v) for r in rl for k, v in r.items() if isinstance(v, float))
  changed = [not np.array_equal(a, b) for a, b in zip(init, jax.tree.leaves(final), strict=True)]
  assert all(changed)
  assert (tmp_path / "curves.png").exists() and (tmp_path / "summary.json").exists()
  saved = json.loads((tmp_path / "summary.json").read_text())
  if cfg.reward.name.startswith("code_"):  # the isolation the programs got here, on record
    assert saved["sandbox_isolation"] == sandbox.isolation(
      components.sandbox_limits(cfg.reward.sandbox)
    )
  else:
    assert "sandbox_isolation" not in saved
