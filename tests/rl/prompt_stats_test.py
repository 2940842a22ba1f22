"""Per-prompt statistics (Beta posterior with forgetting, tied-visit runs) and the pre-rollout
filters (GRESO, difficulty window): hand-computed values, determinism, budget, JSON resume."""

import json
import types

import numpy as np
import pytest

from jaxrl.rl.prompt_stats import PromptFilter, PromptStats


def _cfg(**kw):
  base = dict(
    method="greso",
    greso_p_explore=0.5,
    greso_p_min=0.05,
    greso_p_step=0.1,
    greso_target_tied=0.25,
    window_low=0.2,
    window_high=0.8,
    max_draws=3,
  )
  return types.SimpleNamespace(**{**base, **kw})


def _recs(*prompts):
  return [{"prompt": p} for p in prompts]


def test_beta_posterior_with_forgetting_and_tied_runs_by_hand():
  s = PromptStats(decay=0.5, history=2)
  s.update(0, _recs("a", "b"), [[1, 1, 0, 0], [1, 1, 1, 1]])
  a, b = s.get("a"), s.get("b")
  assert (a["alpha"], a["beta"], a["zero_var"]) == (3.0, 3.0, 0)
  assert (b["alpha"], b["beta"], b["zero_var"]) == (5.0, 1.0, 1)
  s.update(3, _recs("a", "b"), [[1, 0, 0, 0], [1, 1, 1, 1]])
  # alpha = 1 + 0.5 * (3 - 1) + 1 = 3, beta = 1 + 0.5 * (3 - 1) + 3 = 5
  assert (s.get("a")["alpha"], s.get("a")["beta"]) == (3.0, 5.0)
  assert s.get("b")["zero_var"] == 2 and s.get("b")["last_seen"] == 3
  assert s.get("a")["rewards"] == [0.5, 0.25] and s.get("a")["visits"] == 2
  assert s.success_mean("a") == pytest.approx(3 / 8)
  s.update(4, _recs("b"), [[1, 0, 1, 1]])  # variance again: the run resets
  assert s.get("b")["zero_var"] == 0 and len(s.get("b")["rewards"]) == 2
  # Rewards outside [0, 1] count clipped.
  s.update(5, _recs("c"), [[2.0, -1.0]])
  assert (s.get("c")["alpha"], s.get("c")["beta"]) == (2.0, 2.0)
  with pytest.raises(ValueError, match=r"rewards must be \[1, G\]"):
    s.update(6, _recs("c"), [1.0, 0.0])


def test_groups_of_different_sizes_update_like_their_own_rows():
  # rl.allocation gives each prompt its own group size: each group counts on its own.
  ragged, rows = PromptStats(decay=0.5, history=2), PromptStats(decay=0.5, history=2)
  groups = [np.array([1.0, 0.0]), np.array([1.0, 1.0, 1.0, 1.0, 1.0, 1.0]), np.array([0.0, 0.5, 1])]
  ragged.update(2, _recs("a", "b", "c"), groups)
  for name, g in zip("abc", groups, strict=True):
    rows.update(2, _recs(name), [g])
  assert ragged.state_dict() == rows.state_dict()
  assert (ragged.get("b")["alpha"], ragged.get("b")["beta"], ragged.get("b")["zero_var"]) == (
    7.0,
    1.0,
    1,
  )
  assert ragged.get("c")["rewards"] == [0.5]
  with pytest.raises(ValueError, match="non-empty 1-D groups"):
    ragged.update(3, _recs("a", "b"), [np.array([1.0]), np.array([])])
  f = PromptFilter(_cfg(), ragged, seed=0, num_prompts=3)
  f.after_step(groups)  # 1 of 3 tied > 0.25: skip more
  assert f.p_explore == pytest.approx(0.4)


def test_greso_keep_probability_is_p_explore_to_the_tied_run():
  s = PromptStats(decay=1.0, history=4)
  for step in range(3):
    s.update(step, _recs("easy"), [[1, 1, 1, 1]])
  s.update(0, _recs("mixed"), [[1, 0, 1, 0]])
  f = PromptFilter(_cfg(), s, seed=0, num_prompts=2)
  assert f.keep_prob("easy") == 0.5**3 and f.keep_prob("mixed") == 1.0
  assert f.keep_prob("never seen") == 1.0
  # Over many steps the empirical keep rate of "easy" matches 1 - (1 - p_e**z).
  one = PromptFilter(_cfg(max_draws=1), s, seed=1, num_prompts=1)
  kept = 0
  for step in range(4000):
    chosen, stats = one.select(step, _recs("easy"), None)
    kept += stats["prompts/skipped"] == 0
    assert chosen == _recs("easy")  # skipped, it still fills the batch (no more draws)
  assert kept / 4000 == pytest.approx(0.125, abs=0.02)


def test_selection_is_deterministic_and_never_exceeds_its_budget():
  s = PromptStats(decay=1.0, history=4)
  pool = [f"p{i}" for i in range(40)]
  for _ in range(4):
    s.update(0, _recs(*pool[:30]), np.ones((30, 4)))  # p0..p29: 4 tied visits each

  def run(seed, max_draws):
    batches = iter([_recs(*pool[i : i + 8]) for i in range(8, 40, 8)])
    f = PromptFilter(_cfg(greso_p_explore=0.3, max_draws=max_draws), s, seed=seed, num_prompts=8)
    return f.select(5, _recs(*pool[:8]), lambda: next(batches))

  chosen, st = run(0, 5)
  assert (chosen, st) == run(0, 5)  # deterministic given the seed
  # Keep probability 0.3**4 for the tied prompts: the unseen p30..p39 fill the step.
  assert st["prompts/draws"] == 5 and st["prompts/drawn"] == 40 and st["prompts/filler"] == 0
  assert len(chosen) == 8 and sum(int(r["prompt"][1:]) >= 30 for r in chosen) >= 7
  # With a budget of 3 draws nothing unseen is reached: the earliest skipped ones fill in.
  chosen, st = run(0, 3)
  assert st["prompts/draws"] == 3 and st["prompts/drawn"] == 24 and len(chosen) == 8
  kept = 8 - st["prompts/filler"]
  assert st["prompts/filler"] >= 7 and st["prompts/skipped"] == 24 - kept


def test_difficulty_window():
  s = PromptStats(decay=1.0, history=4)
  s.update(0, _recs("solved", "hard", "mid"), [[1] * 8, [0] * 8, [1, 0] * 4])
  f = PromptFilter(_cfg(method="difficulty_window"), s, seed=0, num_prompts=1)
  assert f.keep_prob("solved") == 0.0  # 9 / 10 > 0.8
  assert f.keep_prob("hard") == 0.0  # 1 / 10 < 0.2
  assert f.keep_prob("mid") == 1.0 and f.keep_prob("new") == 1.0
  chosen, st = f.select(1, _recs("solved", "hard", "mid"), None)
  assert chosen == _recs("mid") and st["prompts/skipped"] == 2


def test_greso_p_explore_steers_to_the_target_tied_share():
  f = PromptFilter(_cfg(), PromptStats(decay=1.0, history=1), seed=0, num_prompts=1)
  f.after_step(np.array([[1, 1], [0, 0], [1, 0]]))  # 2/3 tied > 0.25: skip more
  assert f.p_explore == pytest.approx(0.4)
  f.after_step(np.array([[1, 0], [0, 1]]))  # none tied: explore more
  assert f.p_explore == pytest.approx(0.5)
  for _ in range(20):
    f.after_step(np.ones((4, 2)))
  assert f.p_explore == pytest.approx(0.05)  # held at p_min


def test_state_round_trips_through_json_exactly():
  s = PromptStats(decay=0.9, history=3)
  rng = np.random.default_rng(0)
  for step in range(5):
    s.update(step, _recs(*[f"q{i}" for i in range(6)]), rng.random((6, 4)))
  f = PromptFilter(_cfg(), s, seed=3, num_prompts=4)
  f.after_step(np.ones((4, 2)))
  state = f.state_dict()
  g = PromptFilter(_cfg(), PromptStats(decay=0.9, history=3), seed=3, num_prompts=4)
  g.load_state_dict(json.loads(json.dumps(state)))
  assert g.state_dict() == state and g.p_explore == f.p_explore
  recs = _recs(*[f"q{i}" for i in range(6)])
  assert g.select(9, recs, None) == f.select(9, recs, None)
  with pytest.raises(ValueError, match="malformed"):
    g.load_state_dict({"stats": {}})


def test_thompson_keeps_the_prompts_of_largest_sampled_variance():
  s = PromptStats(decay=1.0, history=1)
  # Posteriors: "solved" Beta(41, 1), "mid" Beta(21, 21); unseen prompts Beta(1, 1).
  for _ in range(5):
    s.update(0, _recs("solved", "mid"), [[1] * 8, [1, 0] * 4])
  f = PromptFilter(_cfg(method="thompson", max_draws=2), s, seed=4, num_prompts=1)
  picks = []
  for step in range(300):
    chosen, st = f.select(step, _recs("solved", "mid"), lambda: _recs("new"))
    assert st["prompts/draws"] == 2 and st["prompts/drawn"] == 3 and len(chosen) == 1
    picks.append(chosen[0]["prompt"])
  assert picks == [f.select(t, _recs("solved", "mid"), lambda: _recs("new"))[0][0]["prompt"]
                   for t in range(300)]  # fmt: skip
  # p(1 - p) <= 0.25 is near its top for "mid" (p ~ 0.5), often lower for an unseen prompt
  # (p uniform), and ~0.02 for "solved": "mid" wins most, "solved" almost never.
  assert picks.count("mid") > 150 and picks.count("solved") < 10
