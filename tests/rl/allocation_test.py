"""Allocation: DAPO's informative groups and filled batch; in-step rounds (VIGOR,
Pilot-Commit) and the variable group sizes they make."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl import rewards
from jaxrl.config import PolicyLossConfig
from jaxrl.metrics import read_jsonl
from jaxrl.rl.advantages import ESTIMATORS, group_advantages, ragged_groups
from jaxrl.rl.allocation import fill_groups, informative_groups, pilot_commit, vigor_round
from jaxrl.rl.loop import Trainer
from jaxrl.rl.losses import AGGREGATIONS
from jaxrl.rl.objectives import PolicyLoss

pytestmark = pytest.mark.integration


def test_informative_groups_are_those_whose_rewards_differ():
  r = np.array([[1, 1, 1], [0, 1, 0], [0, 0, 0], [0.1, 0.1, 0.1 + 1e-9]])
  np.testing.assert_array_equal(informative_groups(r), [False, True, False, True])
  with pytest.raises(ValueError, match=r"rewards must be \[num_groups, G\]"):
    informative_groups(np.zeros(4))


def test_fill_takes_informative_groups_first_in_order():
  informative = np.array([False, True, False, True, True, False])
  idx, filler = fill_groups(informative, 2)
  np.testing.assert_array_equal(idx, [1, 3])
  assert not filler.any()


def test_fill_pads_with_the_earliest_dropped_groups_when_short():
  informative = np.array([False, True, False, False])
  idx, filler = fill_groups(informative, 3)
  np.testing.assert_array_equal(idx, [1, 0, 2])
  np.testing.assert_array_equal(filler, [False, True, True])
  with pytest.raises(ValueError, match="need 5 groups, only 4 were sampled"):
    fill_groups(informative, 5)


# ------------------------------------------------------------------- in-step allocation


def test_vigor_gives_the_round_to_the_varying_prompts_by_variance():
  rewards = [np.array([1.0, 1.0]), np.array([0.0, 1.0]), np.array([0.0, 0.5]), np.zeros(2)]
  # variances 0, 0.25, 0.0625, 0: the varying prompts 1 then 2; 0 and 3 tie.
  extra = vigor_round(rewards, [2, 2, 2, 2], budget=4, increment=2, cap=8, last=False)
  np.testing.assert_array_equal(extra, [0, 2, 2, 0])
  # Round after round to the varying prompts, up to the cap; the tied ones get nothing before
  # the last round (what the varying ones cannot take waits for it).
  extra = vigor_round(rewards, [2, 2, 2, 2], budget=12, increment=2, cap=8, last=False)
  np.testing.assert_array_equal(extra, [0, 6, 6, 0])
  extra = vigor_round(rewards, [2, 2, 2, 2], budget=16, increment=2, cap=8, last=False)
  np.testing.assert_array_equal(extra, [0, 6, 6, 0])
  # The last round spends it all: the varying prompts to the cap first, then the tied ones.
  extra = vigor_round(rewards, [2, 2, 2, 2], budget=12, increment=2, cap=5, last=True)
  np.testing.assert_array_equal(extra, [3, 3, 3, 3])
  extra = vigor_round(rewards, [2, 6, 2, 2], budget=3, increment=2, cap=6, last=True)
  np.testing.assert_array_equal(extra, [0, 0, 3, 0])  # prompt 1 is at the cap
  # Nothing varies: the last round goes round-robin over every prompt, by index.
  extra = vigor_round([np.zeros(2)] * 3, [2, 2, 2], budget=5, increment=2, cap=8, last=True)
  np.testing.assert_array_equal(extra, [2, 2, 1])


def test_pilot_commit_gives_the_rest_to_the_prompts_that_varied():
  rewards = [np.zeros(2), np.array([0.0, 1.0]), np.ones(2), np.array([1.0, 0.5])]
  extra = pilot_commit(rewards, [2, 2, 2, 2], budget=8, cap=8)
  np.testing.assert_array_equal(extra, [0, 4, 0, 4])  # tied prompts are skipped
  # Varying prompts at the cap: the tied ones take the rest, so the budget is spent.
  extra = pilot_commit(rewards, [2, 2, 2, 2], budget=8, cap=4)
  np.testing.assert_array_equal(extra, [2, 2, 2, 2])
  extra = pilot_commit([np.zeros(2)] * 3, [2, 2, 2], budget=4, cap=8)
  np.testing.assert_array_equal(extra, [2, 1, 1])  # nothing varied: round-robin


@pytest.mark.parametrize("method", ["vigor", "pilot_commit"])
def test_allocation_spends_exactly_the_budget_within_the_caps(method):
  rng = np.random.default_rng(0)
  for trial in range(200):
    p, g = int(rng.integers(1, 9)), int(rng.integers(2, 9))
    initial, cap = int(rng.integers(2, g + 1)), g + int(rng.integers(0, g + 1))
    rounds = int(rng.integers(1, 4))
    budget, counts = p * g, np.full(p, initial)
    rewards = [rng.integers(0, 2, initial).astype(float) for _ in range(p)]
    for rnd in range(rounds if method == "vigor" else 1):
      left = budget - counts.sum()
      if method == "vigor":
        extra = vigor_round(
          rewards,
          counts,
          budget=-(-left // (rounds - rnd)),
          increment=int(rng.integers(1, 4)),
          cap=cap,
          last=rnd + 1 == rounds,
        )
      else:
        extra = pilot_commit(rewards, counts, budget=left, cap=cap)
      assert extra.min() >= 0 and extra.sum() <= left
      counts = counts + extra
      rewards = [
        np.concatenate([r, rng.integers(0, 2, e)]) for r, e in zip(rewards, extra, strict=True)
      ]
    assert counts.sum() == budget, (trial, counts)
    assert counts.max() <= cap and counts.min() >= initial


def test_ragged_groups_pad_each_group_to_the_largest():
  padded, mask, rows = ragged_groups(np.arange(1, 7, dtype=np.float32), [1, 3, 2])
  np.testing.assert_array_equal(padded, [[1, 0, 0], [2, 3, 4], [5, 6, 0]])
  np.testing.assert_array_equal(mask, [[1, 0, 0], [1, 1, 1], [1, 1, 0]])
  np.testing.assert_array_equal(rows, [0, 3, 4, 5, 6, 7])
  padded, mask, _ = ragged_groups(np.arange(6, dtype=np.float32), [3, 3])
  np.testing.assert_array_equal(padded, np.arange(6).reshape(2, 3))
  assert mask.all()
  with pytest.raises(ValueError, match="sum to 5, the batch has 6 rows"):
    ragged_groups(np.arange(6), [2, 3])


@pytest.mark.parametrize("aggregation", list(AGGREGATIONS))
@pytest.mark.parametrize("estimator", ["grpo", "rloo", "dr_grpo"])
def test_variable_group_sizes_give_the_loss_of_groups_padded_by_hand(aggregation, estimator):
  rng = np.random.default_rng(1)
  sizes, width, t = [2, 4, 3], 4, 5
  b = sum(sizes)
  rewards = rng.integers(0, 3, b).astype(np.float32) / 2
  lengths = rng.integers(1, t + 1, b)
  logp = -rng.random((b, t)).astype(np.float32)
  old = logp + 0.1 * rng.standard_normal((b, t)).astype(np.float32)
  mask = (np.arange(t)[None] < lengths[:, None]).astype(np.float32)
  fn = ESTIMATORS.get(estimator)
  adv, _ = group_advantages(fn, rewards, sizes, scale_by_std=True)

  # By hand: every group padded to 4 rows; a pad row has no loss token.
  hand_rows = [i * width + j for i, n in enumerate(sizes) for j in range(n)]
  pad = (
    lambda x, fill: np.concatenate(  # noqa: E731
      [np.full((len(sizes) * width - b, *x.shape[1:]), fill, x.dtype), x]
    )
  )
  order = np.argsort(np.concatenate([np.setdiff1d(np.arange(12), hand_rows), hand_rows]))
  p_rewards = pad(rewards, 0.0)[order].reshape(len(sizes), width)
  p_valid = np.zeros(12, bool)
  p_valid[hand_rows] = True
  hand_adv = np.asarray(fn(p_rewards, p_valid.reshape(len(sizes), width), scale_by_std=True))
  np.testing.assert_allclose(np.asarray(adv), hand_adv.reshape(-1)[hand_rows], atol=1e-6)

  loss = PolicyLoss(None, loss=PolicyLossConfig(aggregation=aggregation), max_tokens=t)

  def value(lp, ol, m, a):
    batch = types.SimpleNamespace(
      loss_mask=jnp.asarray(m),
      advantages=jnp.asarray(a)[:, None] * jnp.asarray(m),
      old_logprobs=jnp.asarray(ol),
      ref_logprobs=jnp.zeros_like(jnp.asarray(lp)),
      prox_logprobs=None,
      versions=jnp.zeros(m.shape, jnp.int32),
      learner_version=None,
      lag=lambda: jnp.zeros(m.shape, jnp.float32),
    )
    _, metrics = loss.from_logprobs(jnp.asarray(lp), jnp.zeros_like(jnp.asarray(lp)), batch)
    total, denom = metrics["rl/loss"]
    return float(total / denom)

  ragged = value(logp, old, mask, np.asarray(adv))
  hand = value(
    pad(logp, 0.0)[order], pad(old, 0.0)[order], pad(mask, 0.0)[order], hand_adv.reshape(-1)
  )
  np.testing.assert_allclose(ragged, hand, rtol=1e-6)


@rewards.register("length_parity_for_allocation_test")
def _length_parity(completion, record):
  del record
  return float(len(completion) % 2)


def _allocated_run(smoke_config, workdir, method: str, **rl):
  """A 3-step run of 4 prompts, each step's 16 samples allocated by `method` in rounds."""
  return smoke_config(
    workdir,
    sft={"steps": 4},
    eval={"every": 0, "num_examples": 8},
    reward={"name": "length_parity_for_allocation_test"},
    rl={
      "steps": 3,
      "prompts_per_step": 4,
      "group_size": 4,
      "allocation": {"method": method, "initial": 2, "increment": 2, "rounds": 2},
      **rl,
    },
  )


@pytest.mark.e2e
@pytest.mark.parametrize("method", ["vigor", "pilot_commit"])
def test_a_run_spends_each_steps_budget_in_rounds_on_variable_groups(
  tmp_path, method, smoke_config
):
  cfg = _allocated_run(smoke_config, tmp_path, method)
  trainer = Trainer(cfg, log=lambda *_: None)
  asked, trained = [], []
  sample_indices, update = trainer.experience.sampler.sample_indices, trainer.learner.update

  def spy_indices(params, prompts, samples, **kw):
    if kw["stride"] == 8:  # the rounds' (evaluation asks through it too, 1 or 2 per prompt)
      asked.append([list(js) for js in samples])
    return sample_indices(params, prompts, samples, **kw)

  def spy_update(state, batch, step):
    trained.append(jax.device_get(batch))
    return update(state, batch, step)

  trainer.experience.sampler.sample_indices = spy_indices
  trainer.learner.update = spy_update
  trainer.run()
  trainer.close()
  rows = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if r["phase"] == "rl"]
  rounds = [int(r["alloc/rounds"]) for r in rows]
  assert len(trained) == 3 and sum(rounds) == len(asked)
  for step, row in enumerate(rows):
    mine = asked[sum(rounds[:step]) : sum(rounds[: step + 1])]
    per_prompt = [sum((m[i] for m in mine), []) for i in range(4)]
    # Every sample asked for once, numbered from 0; the budget spent exactly, caps kept.
    assert all(js == list(range(len(js))) for js in per_prompt)
    sizes = [len(js) for js in per_prompt]
    assert sum(sizes) == 4 * 4 and min(sizes) >= 2 and max(sizes) <= 8
    assert row["alloc/group_size_min"] == min(sizes) and row["alloc/group_size_max"] == max(sizes)
    assert trained[step].tokens.shape[0] == 16  # the learner's shape never changes
    # Each prompt prefilled once per step: later rounds insert from its kept prefill.
    assert row["rollout/prefill_prompts"] == 4
    assert row["rollout/reused_prompts"] == sum(
      len([m for m in mine[1:] if m[i]]) for i in range(4)
    )
  assert any(r["alloc/group_size_min"] != r["alloc/group_size_max"] for r in rows)


@pytest.mark.e2e
def test_a_prompt_filter_composes_with_allocation_on_variable_groups(tmp_path, smoke_config):
  # GRESO picks the step's prompts; VIGOR sizes their groups; the stats store folds in each
  # prompt's own group, whatever its size.
  cfg = _allocated_run(smoke_config, tmp_path, "vigor", prompt_filter={"method": "greso"})
  trainer = Trainer(cfg, log=lambda *_: None)
  stats = trainer.experience.prompt_filter.stats
  folded, update = [], stats.update

  def spy_update(step, records, rewards):
    folded.append((step, [r["prompt"] for r in records], [np.array(g) for g in rewards]))
    return update(step, records, rewards)

  stats.update = spy_update
  trainer.run()
  trainer.close()
  rows = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if r["phase"] == "rl"]
  assert [f[0] for f in folded] == [0, 1, 2] and len(rows) == 3
  for (_, prompts, groups), row in zip(folded, rows, strict=True):
    sizes = [g.size for g in groups]
    assert len(prompts) == 4 and sum(sizes) == 16
    assert (min(sizes), max(sizes)) == (row["alloc/group_size_min"], row["alloc/group_size_max"])
    assert row["prompts/drawn"] >= 4
  assert any(len(set(g.size for g in f[2])) > 1 for f in folded)  # the groups did vary
  # The store holds each visit's own group mean.
  seen = {}
  for _, prompts, groups in folded:
    for p, g in zip(prompts, groups, strict=True):
      seen.setdefault(p, []).append(float(g.astype(np.float64).mean()))
  for p, means in seen.items():
    assert stats.get(p)["visits"] == len(means)
    assert stats.get(p)["rewards"] == means[-len(stats.get(p)["rewards"]) :]
