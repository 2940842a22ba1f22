"""rl.placement: which policy version samples which batch, colocated and on split sub-meshes."""

import collections

import jax
import numpy as np
import pytest
from fixtures import smoke_config

from jaxrl.mesh import split_devices
from jaxrl.metrics import read_jsonl
from jaxrl.rl import placement
from jaxrl.rl.loop import Trainer

pytestmark = pytest.mark.integration


def _config(workdir, steps=5, **rl):
  return smoke_config(
    workdir,
    mesh={"devices": 0},  # all 8 test devices: the split placement takes a share of them
    sft={"steps": 4},
    rl={"steps": steps, "prompts_per_step": 4, "group_size": 4, **rl},
    eval={"every": 0, "num_examples": 8},
    checkpoint={"every": 2},
  )


def _devices(tree) -> set:
  return {d for x in jax.tree.leaves(tree) for d in x.sharding.device_set}


def _spied_run(cfg):
  """Run `cfg` and record, per batch: the params the sampler read, the learner's params of
  every published version (host copies), and what each update trained on."""
  trainer = Trainer(cfg, log=lambda *_: None)
  published, sampled, trained = {}, [], []
  pipeline, experience, learner = trainer.pipeline, trainer.experience, trainer.learner
  publish, rollouts, update = pipeline.publish, experience.rollouts, learner.update

  def spy_publish(version, params):
    published[version] = jax.device_get(params)
    return publish(version, params)

  def spy_rollouts(step, params, records, next_records=None, *, version=None):
    sampled.append((step, version, jax.device_get(params), _devices(params)))
    return rollouts(step, params, records, next_records, version=version)

  def spy_update(state, batch, step):
    mask = np.asarray(batch.loss_mask) > 0
    trained.append((step, np.asarray(batch.versions)[mask]))
    return update(state, batch, step)

  pipeline.publish, experience.rollouts, learner.update = spy_publish, spy_rollouts, spy_update
  trainer.run()
  trainer.close()
  rows = [r for r in read_jsonl(trainer.workdir / "metrics.jsonl") if r["phase"] == "rl"]
  return trainer, published, sampled, trained, rows


def _assert_bounded(cfg, published, sampled, trained):
  k = cfg.rl.placement.max_staleness
  assert [s for s, _ in trained] == list(range(cfg.rl.steps))
  for step, versions in trained:  # every consumed batch: exactly the configured lag, never more
    assert versions.size and np.all(versions == max(0, step - k))
    assert np.all(step - versions <= k)
  assert sorted(s for s, *_ in sampled) == list(range(cfg.rl.steps))
  for step, version, params, _ in sampled:  # and it was sampled by that version's weights
    assert version == max(0, step - k)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(published[version]), strict=True):
      np.testing.assert_array_equal(a, b)


@pytest.mark.e2e
def test_colocated_staleness_samples_batch_s_with_version_s_minus_k(tmp_path):
  cfg = _config(tmp_path, placement={"max_staleness": 2})
  trainer, published, sampled, trained, rows = _spied_run(cfg)
  _assert_bounded(cfg, published, sampled, trained)
  assert [r["async/staleness_max"] for r in rows] == [0, 1, 2, 2, 2]
  assert all(r["time/push_s"] >= 0 for r in rows)
  assert trainer.summary["staleness_histogram"].keys() == {"0", "1", "2"}


@pytest.mark.e2e
def test_split_placement_on_8_devices_never_exceeds_max_staleness(tmp_path):
  assert len(jax.devices()) == 8
  cfg = _config(tmp_path, steps=6, placement={"kind": "split", "max_staleness": 1})
  trainer, published, sampled, trained, rows = _spied_run(cfg)
  _assert_bounded(cfg, published, sampled, trained)
  learner_devices, sampler_devices = split_devices(jax.devices(), 0.5)
  assert _devices(trainer.state.policy.params) == set(learner_devices)
  for *_, devices in sampled:  # the rounds read weights pushed to the sampler's own devices
    assert devices == set(sampler_devices)
  assert [r["async/staleness_max"] for r in rows] == [0, 1, 1, 1, 1, 1]
  for r in rows:
    assert r["time/push_s"] > 0
  for r in rows[1:]:
    assert 0 <= r["time/learner_busy_frac"] <= 1
    assert 0 <= r["time/sampler_busy_frac"] <= 1


class _CountedPuts:
  """`jax` for jaxrl.rl.placement, counting its `device_put`s (the pushes)."""

  def __init__(self):
    self.count = 0

  def __getattr__(self, name):
    return getattr(jax, name)

  def device_put(self, *args, **kw):
    self.count += 1
    return jax.device_put(*args, **kw)


@pytest.mark.e2e
def test_split_pushes_only_the_versions_a_batch_reads(tmp_path, monkeypatch):
  cfg = _config(tmp_path, steps=6, placement={"kind": "split", "max_staleness": 1})
  puts = _CountedPuts()
  monkeypatch.setattr(placement, "jax", puts)
  trainer = Trainer(cfg, log=lambda *_: None)
  trainer.run()
  trainer.close()
  assert puts.count == 5  # versions 0-4 for batches 0-5; not 5 and 6, which no batch reads


@pytest.mark.e2e
def test_split_sampler_failure_is_raised_not_hung(tmp_path, monkeypatch):
  cfg = _config(tmp_path, steps=4, placement={"kind": "split", "max_staleness": 1})
  trainer = Trainer(cfg, log=lambda *_: None)
  rollouts = trainer.experience.rollouts

  def failing(step, *args, **kw):
    if step == 2:
      raise OSError("disk on fire")
    return rollouts(step, *args, **kw)

  monkeypatch.setattr(trainer.experience, "rollouts", failing)
  with pytest.raises(RuntimeError, match="sampler thread failed.*disk on fire"):
    trainer.run()
  trainer.close()


@pytest.mark.e2e
def test_a_checkpoint_without_the_batches_sampled_ahead_is_refused(tmp_path):
  Trainer(_config(tmp_path, steps=2), log=lambda *_: None).run()
  stale = Trainer(_config(tmp_path, steps=4, placement={"max_staleness": 2}), log=print)
  with pytest.raises(ValueError, match="written without rl.placement.max_staleness"):
    stale.run()
  stale.close()


@pytest.mark.e2e
def test_a_checkpoint_of_another_staleness_is_refused(tmp_path):
  Trainer(_config(tmp_path, steps=2, placement={"max_staleness": 1}), log=print).run()
  other = Trainer(_config(tmp_path, steps=4, placement={"max_staleness": 3}), log=print)
  with pytest.raises(ValueError, match="max_staleness=1; this run has 3"):
    other.run()
  other.close()


def test_split_devices():
  devs = list(range(8))
  assert split_devices(devs, 0.5) == ([0, 1, 2, 3], [4, 5, 6, 7])
  assert split_devices(devs, 0.25) == ([0, 1, 2, 3, 4, 5], [6, 7])
  assert split_devices(devs, 0.01) == (devs[:7], [7])  # at least one each side
  assert split_devices(devs, 1.0) == ([0], devs[1:])
  with pytest.raises(ValueError, match="at least 2 devices"):
    split_devices([0], 0.5)


def test_split_devices_of_several_processes_gives_each_side_a_share_of_every_process():
  dev = collections.namedtuple("Dev", "process_index id")
  devs = [dev(p, i) for p in range(2) for i in range(4)]  # 2 processes, 4 devices each
  learner, sampler = split_devices(devs, 0.25)
  assert [(d.process_index, d.id) for d in learner] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1),
                                                        (1, 2)]  # fmt: skip
  assert [(d.process_index, d.id) for d in sampler] == [(0, 3), (1, 3)]
  with pytest.raises(ValueError) as e:
    split_devices([dev(0, 0), dev(0, 1), dev(1, 0)], 0.5)
  assert str(e.value) == (
    "rl.placement.kind='split' with several processes needs the same number of devices, at "
    "least 2, on every process (one per side on each); there are process 0: 2, process 1: 1"
  )


@pytest.mark.e2e
def test_partial_rollouts_on_a_split_sampler_bound_every_token_by_k_plus_max_age(tmp_path):
  # verl's fully-async mode: the sampler one version behind carries unfinished sequences over.
  k, max_age = 1, 1
  cfg = _config(
    tmp_path,
    steps=6,
    placement={"kind": "split", "max_staleness": k},
    partial={"enabled": True, "over_provision": 2.0, "max_age": max_age},
    rollout={"steps_per_call": 2},
  )
  trainer, published, sampled, trained, rows = _spied_run(cfg)
  assert [s for s, _ in trained] == list(range(6))
  for step, versions in trained:
    assert versions.size and np.all(step - versions <= k + max_age)
    # No token is newer than the version the batch's sampler read (groups that completed in
    # an earlier phase beyond its quota wait whole, so older is possible).
    assert versions.max() <= max(0, step - k)
  assert any(np.any(step - versions > k) for step, versions in trained)  # carried over
  for step, version, params, _ in sampled:  # each batch sampled by that version's weights
    assert version == max(0, step - k)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(published[version]), strict=True):
      np.testing.assert_array_equal(a, b)
  assert max(r["async/staleness_max"] for r in rows) <= k + max_age
  assert any(r["partial/resumed_sequences"] > 0 for r in rows)
