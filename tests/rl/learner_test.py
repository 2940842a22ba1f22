"""The learner's update moves nothing between host and device implicitly, and export restores
params without an optimizer, an engine or a teacher."""

import dataclasses
import json

import jax
import numpy as np
import pytest
from fixtures import smoke_config

import configs.grpo_arith as grpo_arith
from jaxrl.rl.loop import Trainer

pytestmark = pytest.mark.integration


def _config(workdir, **rl):
  return smoke_config(
    workdir,
    mesh={"devices": 0},  # sharded over all 8 test devices: what could move implicitly, would
    sft={"steps": 2},
    rl={"steps": 2, "prompts_per_step": 4, "group_size": 4, **rl},
    eval={"every": 0, "num_examples": 8, "num_samples": 0},
  )


@pytest.mark.parametrize(
  "rl",
  [
    {},  # the default: zero-advantage rows left out of the step (a shape decided on the host)
    {
      "num_minibatches": 2,
      "ppo_epochs": 2,
      "offpolicy": {"method": "decoupled", "is_correction": "tis"},
    },
    {"advantage": "gae", "group_size": 1, "prompts_per_step": 16, "critic": {"warmup_steps": 0}},
  ],
  ids=["skip_rows", "minibatches_prox_tis", "critic"],
)
def test_update_runs_under_a_disallowing_transfer_guard(tmp_path, rl):
  """The hot path of an RL step (epochs, mini-batches, pi_prox, row compaction, the critic's and
  the policy's steps) runs with implicit host<->device transfers disallowed: every array it
  touches is already on the device, and what it must read on the host it fetches explicitly."""
  trainer = Trainer(_config(tmp_path, **rl), log=lambda *_: None)
  try:
    state = trainer.learner.init(trainer.ctx.init_params)
    records = next(
      iter(trainer.ctx.task.train_dataset(seed=0, batch_size=trainer.cfg.rl.prompts_per_step))
    )
    critic = None if state.critic is None else state.critic.params
    batch, _ = trainer.experience.collect(0, state.policy.params, records, critic_params=critic)
    before = int(state.policy.step)
    for step in range(2):  # the second time with every program compiled
      with jax.transfer_guard("disallow"):
        state, metrics = trainer.learner.update(state, batch, step)
    metrics = jax.device_get(metrics)  # the loop's one fetch of a step's metrics
    assert int(state.policy.step) == before + 2 * trainer.learner.updates_per_step
    assert all(np.isfinite(v) for v in metrics.values()), metrics
  finally:
    trainer.close()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """One tiny SFT + RL run: its config, its final params on the host, its RL metrics."""
  workdir = tmp_path_factory.mktemp("trained")
  trainer = Trainer(_config(workdir), log=lambda *_: None)
  trainer.run()
  final = jax.device_get(trainer.state.policy.params)
  trainer.close()
  lines = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
  c = grpo_arith.get_config("smoke")  # what a user passes: the run's config file and flags
  c.workdir, c.model.preset = str(workdir), "tiny"
  c.sft.steps, c.rl.steps = 2, 2
  c.rl.prompts_per_step, c.rl.group_size = 4, 4
  c.eval.every, c.eval.num_examples, c.eval.num_samples = 0, 8, 0
  return c, final, [r for r in lines if r["phase"] == "rl"]


def _forbid(monkeypatch, *targets):
  def forbidden(*_, **__):
    raise AssertionError("must not be built here")

  for obj, name in targets:
    monkeypatch.setattr(obj, name, forbidden)


@pytest.mark.e2e
def test_export_builds_no_optimizer_engine_or_teacher(trained, tmp_path, monkeypatch):
  """A params-only restore: exporting a run's checkpoint constructs none of the training or
  sampling machinery (each constructor raises if called)."""
  import optax

  from jaxrl.models.hf import load_hf_checkpoint
  from jaxrl.rl import teacher
  from jaxrl.rollout import engine
  from launch.export import export

  c, final, _ = trained
  _forbid(monkeypatch, (optax, "adamw"), (engine.Engine, "__init__"), (teacher.Teacher, "__init__"))
  line = export(c, tmp_path / "out")
  assert "exported rl step 2" in line
  _, _, params = load_hf_checkpoint(tmp_path / "out")
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(final), strict=True):
    np.testing.assert_array_equal(np.asarray(a), b)


@pytest.mark.e2e
def test_evaluation_builds_no_optimizer_or_teacher_and_repeats_the_runs_eval(trained, monkeypatch):
  """launch.evaluate restores the params alone and builds only the sampler it decodes with; its
  held-out accuracy is the one the run logged after its last step (same params, same seeds)."""
  import optax

  from jaxrl.rl import teacher
  from jaxrl.rollout import engine
  from launch.evaluate import evaluate

  c, _, rl_lines = trained
  _forbid(monkeypatch, (optax, "adamw"), (teacher.Teacher, "__init__"))
  built = []
  init = engine.Engine.__init__

  def counted(self, *args, **kwargs):
    built.append(self)
    init(self, *args, **kwargs)

  monkeypatch.setattr(engine.Engine, "__init__", counted)
  result = evaluate(c)
  assert (result["phase"], result["step"]) == ("rl", 2) and len(built) == 1
  logged = rl_lines[-1]
  for key in ("eval/accuracy", "eval/response_length", "eval/carry_accuracy"):
    assert result[key] == logged[key], key


@pytest.mark.e2e
def test_evaluation_of_the_initial_model_reports_pass_at_k(trained):
  """--phase=init evaluates the model as built (no checkpoint read); --samples=N adds sampled
  accuracy and pass@1..N, pass@1 being the sampled accuracy of a pass/fail reward."""
  from launch.evaluate import evaluate, table

  c, _, _ = trained
  result = evaluate(c, phase="init", samples=4)
  assert (result["phase"], result["step"]) == ("init", 0)
  passes = [result[f"eval/pass@{k}"] for k in (1, 2, 4)]
  assert passes[0] == pytest.approx(result["eval/sampled_accuracy"])
  assert passes == sorted(passes) and 0.0 <= passes[0] and passes[-1] <= 1.0
  assert "| eval/pass@4 |" in table(result)


def test_rl_metrics_sum_engine_counters_over_dynamic_sampling_rounds(tmp_path):
  """rollout/* counters cover every sampling round of a step, not the last one only."""
  from jaxrl import rewards

  @rewards.register("constant_for_rounds_test")
  def constant(completion, record):
    return 1.0

  cfg = _config(tmp_path, dynamic_sampling={"enabled": True, "max_rounds": 3})
  cfg = dataclasses.replace(
    cfg, reward=dataclasses.replace(cfg.reward, name="constant_for_rounds_test")
  )
  trainer = Trainer(cfg, log=lambda *_: None)
  try:
    state = trainer.learner.init(trainer.ctx.init_params)
    it = iter(trainer.ctx.task.train_dataset(seed=0, batch_size=4))
    _, stats = trainer.experience.collect(0, state.policy.params, next(it), lambda: next(it))
    assert stats["rl/sampling_rounds"] == 3.0  # every group ties: the cap is reached
    # One prefill per group in each of the 3 rounds.
    assert stats["rollout/prefill_prompts"] == 3 * cfg.rl.prompts_per_step
  finally:
    trainer.close()
