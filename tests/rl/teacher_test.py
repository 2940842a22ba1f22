"""The distillation teacher in the RL loop: its scores, the student distils, ADWIN windows."""

import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from fixtures import smoke_configdict
from helpers import numpy_model

from jaxrl.models.config import ModelConfig
from jaxrl.models.transformer import token_logprobs
from jaxrl.rl.distill import DistillBatch, teacher_scores

pytestmark = pytest.mark.integration


def _distill_config(workdir, rl=None, **distill):
  from jaxrl.config import validate

  c = smoke_configdict(
    workdir,
    sft={"steps": 10},
    rl={"steps": 4, "group_size": 1, "prompts_per_step": 16, "optim": {"learning_rate": 3e-3}},
    eval={"every": 2, "num_examples": 16},
    checkpoint={"every": 2},
    distill=dict(enabled=True, teacher=dict(preset="tiny", seed=7), **distill),
  )
  c.rl.update(rl or {})  # on top of the rl defaults above, nested sections key by key
  return validate(c)


def _rl_lines(wd):
  import json

  lines = [json.loads(x) for x in (wd / "metrics.jsonl").read_text().splitlines()]
  rl = [r for r in lines if r["phase"] == "rl"]
  return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rl]


@pytest.mark.e2e
def test_loop_scores_with_the_teacher_and_distils_towards_it(tmp_path):
  """The teacher's scores in the batch are its own forward's, and training on them shrinks
  KL(student || teacher) on the student's own samples."""
  from jaxrl.rl.loop import Trainer

  trainer = Trainer(_distill_config(tmp_path, rl={"steps": 10}), log=lambda *_: None)
  trainer.run_sft()
  trainer.state = trainer.learner.init(trainer.sft_params)
  it = iter(trainer.ctx.task.train_dataset(seed=0, batch_size=16))
  batch, stats = trainer.experience.collect(0, trainer.state.policy.params, next(it))
  assert isinstance(batch, DistillBatch)
  teacher = trainer.teacher
  expect = np.asarray(token_logprobs(teacher.graphdef, teacher.params, batch.tokens, batch.valid))
  mask = np.asarray(batch.loss_mask)
  np.testing.assert_allclose(np.asarray(batch.teacher_logprobs), expect * mask, atol=1e-5)
  # The sampled token's teacher log-prob is at most the teacher's best one.
  top1 = np.asarray(batch.teacher_topk_logprobs)[..., 0]
  assert np.all((top1 >= expect - 1e-5)[mask > 0])
  k1 = np.sum((np.asarray(batch.old_logprobs) - expect) * mask) / mask.sum()
  np.testing.assert_allclose(stats["distill/reverse_kl_rollout"], k1, rtol=1e-4)

  trainer.run_rl()
  trainer.close()
  kl = [r["distill/reverse_kl_rollout"] for r in _rl_lines(tmp_path)]
  assert np.mean(kl[-3:]) < 0.7 * np.mean(kl[:3]), kl


@pytest.mark.e2e
def test_adaptive_window_probes_moves_and_resumes(tmp_path):
  """ADWIN in the loop: every probe_every steps the alignment probe runs before the update and
  the window follows the controller's rule; the training batch supervises only the prefix;
  a resumed run restores the window and repeats an uninterrupted one."""
  from jaxrl.rl.loop import Trainer

  # low = high - tiny: any alignment below 0.9 doubles, above halves (a visible move each probe).
  adwin = dict(window=2, adaptive=True, probe_every=2, align_low=0.9, align_high=0.9001)
  full = Trainer(_distill_config(tmp_path / "full", **adwin), log=lambda *_: None)
  full.run()
  # The prefix mask of an update: at most `window` loss tokens per row, the first ones.
  records = next(iter(full.ctx.task.train_dataset(seed=0, batch_size=16)))
  batch, _ = full.experience.collect(1, full.state.policy.params, records)
  # Step 1: no probe, the current window.
  windowed, stats = full.teacher.window(1, full.state.policy.params, batch, full.ctx.shard)
  window_now = full.teacher.controller.window
  full.close()
  full_mask, m = np.asarray(batch.loss_mask), np.asarray(windowed.loss_mask)
  np.testing.assert_array_equal(m, full_mask * (np.cumsum(full_mask, axis=1) <= window_now))
  assert stats == {"distill/window": float(window_now)}

  lines = _rl_lines(tmp_path / "full")
  window = 2
  for step, r in enumerate(lines):
    if step % 2 == 0:
      a = r["distill/alignment"]
      assert -1.0 <= a <= 1.0
      window = min(window * 2, 6) if a < 0.9 else (max(window // 2, 1) if a > 0.9001 else window)
    else:
      assert "distill/alignment" not in r
    assert r["distill/window"] == window
  assert window == window_now

  # Resume from step 3 (sharing the warm-start checkpoint: only RL is repeated).
  shutil.copytree(tmp_path / "full/checkpoints/sft", tmp_path / "part/checkpoints/sft")
  part = Trainer(_distill_config(tmp_path / "part", **adwin), log=lambda *_: None)
  part.run(until=3)
  part.close()
  resumed = Trainer(_distill_config(tmp_path / "part", **adwin), log=lambda *_: None)
  resumed.run()
  resumed.close()
  assert _rl_lines(tmp_path / "part") == lines


def test_hf_teacher_with_a_padded_vocab_and_bad_teachers(tmp_path, monkeypatch):
  from jaxrl.config import ConfigError, TeacherConfig
  from jaxrl.mesh import get_rules, make_mesh
  from jaxrl.models.hf import export_hf_checkpoint
  from jaxrl.rl import components
  from jaxrl.rl.components import build_teacher

  student = ModelConfig.tiny(vocab_size=259)
  mesh, rules = make_mesh(1, -1, 1), get_rules("fsdp_tp")
  big = ModelConfig.tiny(vocab_size=263)  # an HF-style padded vocabulary
  _, params = numpy_model(big, seed=2)
  export_hf_checkpoint(big, params, tmp_path / "big")
  cfg, graphdef, t_params = build_teacher(
    TeacherConfig(path=str(tmp_path / "big")), student, mesh, rules
  )
  assert cfg.vocab_size == 263
  toks = jnp.asarray(np.random.default_rng(0).integers(0, 259, (2, 6)), jnp.int32)
  valid = jnp.ones((2, 6), bool)
  logp, ids, top = teacher_scores(graphdef, t_params, toks, valid, top_k=4, vocab_size=259)
  assert int(ids.max()) < 259
  # Renormalised over the student's 259 ids: the log-probs of all of them sum to 1.
  full = teacher_scores(graphdef, t_params, toks, valid, top_k=259, vocab_size=259)[2]
  np.testing.assert_allclose(np.exp(np.asarray(full)[:, 1:]).sum(-1), 1.0, rtol=1e-5)
  assert logp.shape == (2, 6) and top.shape == (2, 6, 4)

  small = ModelConfig.tiny(vocab_size=200)
  _, params = numpy_model(small, seed=2)
  export_hf_checkpoint(small, params, tmp_path / "small")

  def no_weights(*_, **__):
    raise AssertionError("weights read before the teacher's vocabulary was checked")

  monkeypatch.setattr(components, "load_hf_checkpoint", no_weights)  # config.json decides
  with pytest.raises(ConfigError, match=r"vocab_size=200, smaller than the student's 259"):
    build_teacher(TeacherConfig(path=str(tmp_path / "small")), student, mesh, rules)
  with pytest.raises(ConfigError, match=r"config\.distill\.teacher\.path=.*\(no config\.json\)"):
    build_teacher(TeacherConfig(path=str(tmp_path)), student, mesh, rules)
  with pytest.raises(ConfigError, match=r"config\.distill\.teacher\.preset"):
    build_teacher(TeacherConfig(preset="nope"), student, mesh, rules)
