"""Per-prompt statistics across steps, and the pre-rollout filters that read them.

`PromptStats` keeps, for every prompt the run has sampled (keyed by its text): a Beta(alpha,
beta) posterior over its success rate with exponential forgetting (VADE, "Variance-Aware
Dynamic Sampling via Online Sample-Level Difficulty Estimation"), the number of consecutive
visits whose group rewards all tied (GRESO), the step it was last seen, the visit count and its
recent group-mean rewards. It is checkpointed with the RL step.

`PromptFilter.select` runs before a step's rollout and decides which drawn prompts are sampled:
  greso              skip a prompt whose last z visits all tied with probability 1 - p_e**z
                     (GRESO, "Act Only When It Pays: Efficient
                     Reinforcement Learning for LLM Reasoning via Selective Rollouts");
                     p_e moves by `p_step` after each step toward the
                     target share of tied groups, within [p_min, 1]
  difficulty_window  skip a seen prompt whose posterior mean success is outside [low, high]
  thompson           draw max_draws batches, sample each prompt's success p ~ Beta(alpha,
                     beta) (unseen: Beta(1, 1)) and keep the prompts_per_step with the largest
                     p (1 - p), the expected reward variance of a group (VADE's Thompson
                     sampler; the draws not kept are spent)
Prompts never seen are always kept. Draws are deterministic given (seed, step). The filter
draws at most `max_draws` prompt batches per step; if fewer than prompts_per_step prompts were
kept by then, the earliest skipped ones fill the batch (the step keeps its shape, and the
budget is never exceeded). DAPO's dynamic sampling (after the rollout) stays available beside it.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

FILTERS = ("none", "greso", "difficulty_window", "thompson")


class PromptStats:
  """Statistics of every prompt seen, keyed by prompt text; JSON-ready (`state_dict`)."""

  def __init__(self, *, decay: float, history: int):
    self.decay, self.history = decay, history
    self.entries: dict[str, dict] = {}

  def get(self, prompt: str) -> dict | None:
    return self.entries.get(prompt)

  def update(self, step: int, records, rewards) -> None:
    """Fold one step's groups in: `rewards` [num_groups, G] of `records` [num_groups], or one
    1-D array per record when group sizes vary (rl.allocation). A reward counts as a success in
    proportion to where it lies in [0, 1] (clipped)."""
    groups = [np.asarray(r, np.float64) for r in rewards]
    if len(groups) != len(records) or any(r.ndim != 1 or r.size == 0 for r in groups):
      shapes = [r.shape for r in groups]
      raise ValueError(
        f"rewards must be [{len(records)}, G] or {len(records)} non-empty 1-D groups, got {shapes}"
      )
    for record, r in zip(records, groups, strict=True):
      e = self.entries.setdefault(
        record["prompt"],
        {"alpha": 1.0, "beta": 1.0, "zero_var": 0, "last_seen": -1, "visits": 0, "rewards": []},
      )
      wins = float(np.clip(r, 0.0, 1.0).sum())
      # Forget old evidence (toward the uniform prior), then add this visit's outcomes.
      e["alpha"] = 1.0 + self.decay * (e["alpha"] - 1.0) + wins
      e["beta"] = 1.0 + self.decay * (e["beta"] - 1.0) + (r.size - wins)
      e["zero_var"] = e["zero_var"] + 1 if np.all(r == r[0]) else 0
      e["last_seen"] = int(step)
      e["visits"] += 1
      e["rewards"] = (e["rewards"] + [float(r.mean())])[-self.history :]

  def success_mean(self, prompt: str) -> float | None:
    e = self.entries.get(prompt)
    return None if e is None else e["alpha"] / (e["alpha"] + e["beta"])

  def state_dict(self) -> dict:
    return {"entries": self.entries}

  def load_state_dict(self, state: dict) -> None:
    try:
      self.entries = {str(k): dict(v) for k, v in state["entries"].items()}
    except (KeyError, AttributeError, TypeError) as e:
      raise ValueError(f"checkpoint's prompt statistics are malformed: {e!r}") from e


class PromptFilter:
  """Pre-rollout selection of a step's prompts from `PromptStats` (see the module docstring)."""

  def __init__(self, cfg, stats: PromptStats, *, seed: int, num_prompts: int):
    if cfg.method not in FILTERS:
      raise ValueError(f"prompt filter must be one of {FILTERS}, got {cfg.method!r}")
    self.cfg, self.stats, self.seed, self.num_prompts = cfg, stats, seed, num_prompts
    self.p_explore = cfg.greso_p_explore

  def keep_prob(self, prompt: str) -> float:
    """The probability that `prompt` is sampled this step."""
    e = self.stats.get(prompt)
    if e is None or self.cfg.method == "none":
      return 1.0
    if self.cfg.method == "greso":
      return float(self.p_explore ** e["zero_var"])
    mean = e["alpha"] / (e["alpha"] + e["beta"])
    return float(self.cfg.window_low <= mean <= self.cfg.window_high)

  def select(self, step: int, records: list, draw: Callable | None) -> tuple[list, dict]:
    """(the step's prompts_per_step records, stats): `records` first, then up to max_draws - 1
    more batches from `draw()` while too few are kept."""
    rng = np.random.default_rng([self.seed, step, 0x5E1EC7])
    if self.cfg.method == "thompson":
      return self._thompson(rng, records, draw)
    kept, skipped, draws, seen = [], [], 1, 0
    batch = list(records)
    while True:
      for r in batch:
        seen += 1
        (kept if rng.random() < self.keep_prob(r["prompt"]) else skipped).append(r)
      if len(kept) >= self.num_prompts or draw is None or draws >= self.cfg.max_draws:
        break
      batch = list(draw())
      draws += 1
    filler = max(self.num_prompts - len(kept), 0)
    chosen = kept[: self.num_prompts] + skipped[:filler]
    return chosen, {
      "prompts/drawn": float(seen),
      "prompts/skipped": float(len(skipped)),
      "prompts/filler": float(filler),
      "prompts/draws": float(draws),
      "prompts/p_explore": float(self.p_explore),
    }

  def _thompson(self, rng, records, draw) -> tuple[list, dict]:
    pool, draws = list(records), 1
    while draw is not None and draws < self.cfg.max_draws:
      pool += list(draw())
      draws += 1
    ab = []
    for r in pool:
      e = self.stats.get(r["prompt"])
      ab.append((1.0, 1.0) if e is None else (e["alpha"], e["beta"]))
    a, b = np.asarray(ab).T
    p = rng.beta(a, b)
    order = np.argsort(-(p * (1.0 - p)), kind="stable")[: self.num_prompts]
    chosen = [pool[i] for i in sorted(order)]  # in draw order
    return chosen, {
      "prompts/drawn": float(len(pool)),
      "prompts/skipped": float(len(pool) - len(chosen)),
      "prompts/filler": 0.0,
      "prompts/draws": float(draws),
      "prompts/p_explore": float(self.p_explore),
    }

  def after_step(self, rewards) -> None:
    """GRESO's adaptive exploration: move p_e toward the target share of tied groups (`rewards`:
    the step's groups, [num_groups, G] or 1-D arrays of any sizes)."""
    if self.cfg.method != "greso":
      return
    tied = float(np.mean([np.ptp(np.asarray(r)) == 0 for r in rewards]))
    step = self.cfg.greso_p_step
    if tied > self.cfg.greso_target_tied:
      self.p_explore = max(self.cfg.greso_p_min, self.p_explore - step)
    else:
      self.p_explore = min(1.0, self.p_explore + step)

  def state_dict(self) -> dict:
    return {"p_explore": self.p_explore, "stats": self.stats.state_dict()}

  def load_state_dict(self, state: dict) -> None:
    try:
      self.p_explore = float(state["p_explore"])
      self.stats.load_state_dict(state["stats"])
    except (KeyError, TypeError) as e:
      raise ValueError(f"checkpoint's prompt-filter state is malformed: {e!r}") from e
