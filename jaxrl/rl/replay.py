"""Rollout replay: part of each step's batch is groups sampled at recent steps, not fresh.

Rollout generation is most of an RL step's cost; rollout replay (from "Improving Data
Efficiency for LLM Reinforcement Fine-tuning Through Difficulty-targeted Online Data Selection
and Rollout Replay") keeps recent rollouts in a buffer and mixes them into each batch, so fewer
fresh ones are generated per step. Here, with rl.replay.ratio = f and P = prompts_per_step:

  - every fresh group whose rewards are not all tied (a tied group has zero advantage, and
    replaying it would train on nothing) is stored with its tokens, behaviour log-probs,
    per-token policy versions and rewards; the buffer keeps the newest `capacity` of them;
  - once the buffer holds n = floor(f * P) groups no older than max_age versions that have not
    been replayed yet, a step samples P - n fresh groups and takes the n newest of those (each
    group is replayed once): the batch keeps its P * G rows, the sampler has two shapes;
  - replayed tokens keep the log-prob and version that drew them, so the loss's ratio is taken
    against their own behaviour policy and rl.offpolicy's corrections (TIS, MIS, M2PO...) and
    the lag they read see the true staleness; groups older than max_age are evicted.

Prompts the step does not sample fresh stay queued for the next one (none is skipped). The
buffer and the queued prompts are checkpointed (`state_dict`), so a resumed run replays the same
groups.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import numpy as np

from jaxrl.rl.allocation import informative_groups
from jaxrl.rollout.types import Rollout, rollout_from_json, rollout_to_json


class ReplayBuffer:
  """Recent informative groups, and the prompts waiting for a fresh rollout."""

  def __init__(self, cfg, *, group_size: int, num_prompts: int):
    self.group_size, self.num_prompts = group_size, num_prompts
    self.num_replay = math.floor(cfg.ratio * num_prompts)
    if self.num_replay >= num_prompts:
      raise ValueError(
        f"rl.replay.ratio={cfg.ratio} replays all {num_prompts} groups of a step: nothing "
        "fresh would refill the buffer; allowed: ratio * prompts_per_step < prompts_per_step"
      )
    self.max_age = cfg.max_age
    self.capacity = cfg.capacity or self.num_replay * (cfg.max_age + 1)
    # Oldest first: (step stored, oldest token version, rollout rows [G], rewards [G]).
    self.groups: list[tuple[int, int, Rollout, np.ndarray]] = []
    self.pending: list[dict] = []  # prompts drawn from the stream, not sampled yet

  # ------------------------------------------------------------------------------ one step

  def _eligible(self, step: int) -> list[int]:
    return [i for i, g in enumerate(self.groups) if step - g[1] <= self.max_age]

  def fresh_records(self, step: int, records, draw: Callable) -> tuple[list[dict], int]:
    """(the prompts to sample fresh at `step`, how many groups will be replayed): P - n
    prompts, queued ones first, when n groups can be replayed; P otherwise."""
    self.groups = [self.groups[i] for i in self._eligible(step)]  # evict the too old
    n = self.num_replay if len(self.groups) >= self.num_replay else 0
    need = self.num_prompts - n
    self.pending.extend(records)
    while len(self.pending) < need:
      self.pending.extend(draw())
    fresh, self.pending = self.pending[:need], self.pending[need:]
    return fresh, n

  def take(self, step: int, n: int) -> tuple[Rollout, np.ndarray, dict]:
    """The n newest stored groups (removed: each is replayed once), as prompt-major rows, with
    their rewards and stats."""
    chosen, self.groups = self.groups[-n:], self.groups[:-n]
    rollout = jax.tree.map(lambda *xs: np.concatenate(xs), *[g[2] for g in chosen])
    rewards = np.concatenate([g[3] for g in chosen])
    ages = [step - g[1] for g in chosen]
    stats = {"replay/age_mean": float(np.mean(ages)), "replay/age_max": float(max(ages))}
    return rollout, rewards, stats

  def add(self, step: int, rollout: Rollout, rewards: np.ndarray) -> None:
    """Store the informative groups of a fresh rollout (prompt-major rows)."""
    g = self.group_size
    keep = informative_groups(np.asarray(rewards).reshape(-1, g))
    for i in np.flatnonzero(keep):
      rows = slice(i * g, (i + 1) * g)
      group = jax.tree.map(lambda x, rows=rows: np.asarray(x)[rows], rollout)
      oldest = int(np.asarray(group.versions)[group.model_tokens()].min(initial=step))
      self.groups.append((step, oldest, group, np.asarray(rewards)[rows]))
    self.groups = self.groups[-self.capacity :]

  # ---------------------------------------------------------------------------- checkpoints

  def state_dict(self) -> dict:
    """The stored groups and the queued prompts as JSON-ready values (float32 log-probs and
    rewards round-trip bit for bit through the doubles they widen to)."""
    groups = [
      {"step": s, "oldest": o, "rollout": rollout_to_json(r), "rewards": w.tolist()}
      for s, o, r, w in self.groups
    ]
    return {"groups": groups, "pending": list(self.pending)}

  def load_state_dict(self, state: dict) -> None:
    try:
      self.pending = list(state["pending"])
      self.groups = [
        (
          int(d["step"]),
          int(d["oldest"]),
          rollout_from_json(d["rollout"]),
          np.asarray(d["rewards"], np.float32),
        )
        for d in state["groups"]
      ]
    except (KeyError, TypeError, ValueError) as e:
      raise ValueError(f"checkpoint's replay buffer is malformed: {e!r}") from e
    for _, _, rollout, _ in self.groups:
      if rollout.tokens.shape[0] != self.group_size:
        raise ValueError(
          f"checkpoint's replay buffer holds groups of {rollout.tokens.shape[0]} samples; this "
          f"run's rl.group_size is {self.group_size}"
        )
