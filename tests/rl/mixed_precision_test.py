"""A run with bfloat16 compute over float32 master weights: the learner, its optimizer state and
its checkpoints stay float32; the sampler, evaluation and the KL reference read one bfloat16 copy
of the matrices made once per step, through the engine's one set of programs."""

import json

import jax
import jax.numpy as jnp
import pytest
from fixtures import smoke_config
from flax import nnx
from helpers import rl_metric_lines

from jaxrl.rl.loop import Trainer

pytestmark = pytest.mark.e2e


def _matrices(params):
  return [v.get_value() for _, v in nnx.to_flat_state(params) if v.get_value().ndim >= 2]


def test_bfloat16_compute_run_keeps_float32_masters_and_samples_one_cast_per_step(tmp_path):
  steps = 3
  cfg = smoke_config(
    tmp_path,
    model={"dtype": "bfloat16", "param_dtype": "float32"},
    sft={"steps": 4},
    rl={"steps": steps, "kl": {"beta": 0.05}},
    eval={"every": 2, "num_examples": 8},
  )
  trainer = Trainer(cfg, log=lambda *_: None)
  engine = trainer.sampler.engine
  generate = engine.generate_steps
  seen = []

  def spy(params, *args):
    seen.append({x.dtype for x in _matrices(params)})
    return generate(params, *args)

  engine.generate_steps = spy
  try:
    trainer.run()
    learner = trainer.state.policy.params
    assert {x.dtype for x in jax.tree.leaves(learner)} == {jnp.dtype(jnp.float32)}
    assert {x.dtype for x in jax.tree.leaves(trainer.state.policy.opt_state)} <= {
      jnp.dtype(jnp.float32),
      jnp.dtype(jnp.int32),
    }
    # Every decode call (SFT's and RL's evaluations, the RL rounds) read bfloat16 matrices, so
    # the engine compiled its decode step once.
    assert seen and all(dtypes == {jnp.dtype(jnp.bfloat16)} for dtypes in seen), seen
    assert engine.generate_compiles == 1
    assert {x.dtype for x in _matrices(trainer.ref_params)} == {jnp.dtype(jnp.bfloat16)}
    assert trainer.cast._cache_size() == 2  # the view (every step) and the reference's copy
    rows = rl_metric_lines(tmp_path)
    matrices_mb = sum(x.size for x in _matrices(learner)) * 2 / 2**20
    # One cast per policy version the rounds read, made when step s publishes version s + 1
    # (the last version no batch reads: not cast); the evaluations' and the reference's casts
    # come between steps.
    assert [r["sync/casts"] for r in rows] == [1.0] * (steps - 1) + [0.0]
    assert all(r["sync/cast_mb"] == pytest.approx(matrices_mb) for r in rows)
    assert len(rows) == steps
    # The estimate printed before the first step, beside the measured peak.
    saved = json.loads((tmp_path / "summary.json").read_text())["memory"]
    assert saved["total"] == trainer.ctx.memory.total > 0
    assert saved["parts"]["sampler copy"] == pytest.approx(matrices_mb * 2**20)
    assert saved["peak_rss_bytes"] > saved["total"]
  finally:
    trainer.close()
