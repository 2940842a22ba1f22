"""Partial rollouts: more groups in flight than a step trains on; the long tail waits for later.

A synchronous rollout phase lasts as long as its longest sequence, and on a long-tailed task
most slots sit idle while the last few finish. With rl.partial (APRIL, "Active Partial
Rollouts in Reinforcement Learning"; CoPRIS, "Concurrency-Controlled Partial Rollout with
Importance Sampling") each step keeps ceil(over_provision * prompts_per_step) groups in
flight, ends its rollout phase as soon as prompts_per_step of them are complete, and carries
the rest to the next step:

  step s:  [resume carried sequences] + [start fresh groups up to the in-flight target]
           -> the engine runs until prompts_per_step groups are complete
           -> those groups (oldest first) are the step's batch; the unfinished sequences keep
              their tokens, behaviour log-probs, per-token policy versions and PRNG keys
  step s+1: each carried sequence is re-prefilled (prompt + its tokens so far) under the new
           weights and decodes on from its next token (jaxrl.rollout.driver.Resume).

Every token keeps the log-prob and version of the policy that drew it (and, with
rl.rollout.routes, the MoE experts it was routed to when first fed), so the loss's ratio is
taken against each token's own behaviour policy (a cross-stage importance ratio), and
rl.offpolicy's corrections (TIS, MIS, M2PO, decoupled PPO...) apply across the stages. A group
holding a token more than `max_age` versions older than the weights that would continue it is
restarted from its prompt, so no batch is ever staler than that; under a stale or split
placement (rl.placement) those weights are themselves up to max_staleness versions behind the
learner, so a trained token is at most max_staleness + max_age versions old (verl's fully-async
mode: partial rollouts on a sampler that runs ahead). The carried groups, the records drawn
but not started and the id counter are checkpointed with the step (`state_dict`), so a resumed
run carries the same sequences.
"""

from __future__ import annotations

import base64
import dataclasses
import math
from collections.abc import Callable

import numpy as np

from jaxrl.rollout.collect import GroupSampler
from jaxrl.rollout.driver import Completion, Request, Resume
from jaxrl.rollout.types import Rollout


@dataclasses.dataclass
class Member:
  """One sample of a group: its completion so far and, once it ended, why."""

  tokens: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  versions: list[int] = dataclasses.field(default_factory=list)
  key: list[int] = dataclasses.field(default_factory=list)  # [2] uint32 key data once started
  reason: str | None = None  # the finish reason; None while in flight
  # Captured MoE routes of every fed position (Completion.routes, [positions, L, k]), kept as
  # the narrowest integer array that holds them (int8 up to 127 experts): a Python list would
  # cost ~36 bytes per expert id, and a long sequence of a deep model carries L * k per token.
  routes: np.ndarray | None = None

  def update(self, c: Completion) -> None:
    self.tokens, self.logprobs = c.tokens.tolist(), c.logprobs.tolist()
    self.versions, self.key = c.versions.tolist(), c.key.tolist()
    self.routes = None if c.routes is None else _narrow(c.routes)
    self.reason = None if c.finish_reason == "abort" else c.finish_reason

  def route_array(self) -> np.ndarray | None:
    return None if self.routes is None else self.routes.astype(np.int32)

  def to_json(self) -> dict:
    """JSON-ready fields; routes as {"dtype", "shape", "b64"} of their bytes (little-endian),
    about a quarter of the size of nested lists of ints."""
    out = dict(vars(self))
    if self.routes is not None:
      r = np.ascontiguousarray(self.routes, self.routes.dtype.newbyteorder("<"))
      out["routes"] = {
        "dtype": r.dtype.name,
        "shape": list(r.shape),
        "b64": base64.b64encode(r.tobytes()).decode("ascii"),
      }
    return out

  @classmethod
  def from_json(cls, d: dict) -> Member:
    d = dict(d)
    routes = d.get("routes")
    if isinstance(routes, dict):
      dtype = np.dtype(routes["dtype"]).newbyteorder("<")
      flat = np.frombuffer(base64.b64decode(routes["b64"]), dtype)
      d["routes"] = flat.reshape(routes["shape"]).astype(dtype.newbyteorder("="))
    elif routes is not None:  # nested lists (checkpoints written before the compact form)
      d["routes"] = _narrow(np.asarray(routes, np.int32))
    return cls(**d)


def _narrow(routes: np.ndarray) -> np.ndarray:
  """Expert ids (-1 = none) in int8 when they fit, else int16."""
  routes = np.asarray(routes)
  fits = routes.size == 0 or int(routes.max()) <= np.iinfo(np.int8).max
  return routes.astype(np.int8 if fits else np.int16)


@dataclasses.dataclass
class Group:
  """A prompt and its G samples, from its first step in flight until a batch takes it."""

  uid: int  # unique in the run: its requests are uid * G + j
  record: dict
  members: list[Member]

  @property
  def complete(self) -> bool:
    return all(m.reason is not None for m in self.members)

  @property
  def started(self) -> bool:
    return any(m.tokens for m in self.members)

  def oldest_version(self) -> int | None:
    versions = [v for m in self.members for v in m.versions]
    return min(versions) if versions else None


class PartialRollouts:
  """The in-flight groups of a run and the step that advances them (`collect`)."""

  def __init__(self, sampler: GroupSampler, encode: Callable, *, rl):
    self.sampler, self.encode = sampler, encode
    self.group_size, self.num_groups = rl.group_size, rl.prompts_per_step
    self.max_new_tokens = rl.max_new_tokens
    self.in_flight = math.ceil(rl.partial.over_provision * rl.prompts_per_step)
    self.max_age = rl.partial.max_age
    self.groups: list[Group] = []  # oldest first
    self.pending: list[dict] = []  # records drawn from the data stream, not started yet
    self.next_uid = 0

  # ------------------------------------------------------------------------------ one step

  def collect(
    self, params, records, draw: Callable, *, version: int, seed: int
  ) -> tuple[Rollout, list[dict], dict, dict]:
    """Advance the groups in flight with `params` (policy `version`) until
    prompts_per_step of them are complete, and take those. `records` (this step's draw from the
    data stream) join the records waiting to start; `draw()` gives more when they run out.

    Returns (the batch's Rollout, prompt-major, its records, the engine's counters, stats).
    """
    self.pending.extend(records)
    g = self.group_size
    restarted = 0
    for group in self.groups:
      oldest = group.oldest_version()
      if oldest is not None and version - oldest > self.max_age:
        group.members = [Member() for _ in range(g)]  # too stale: from its prompt again
        restarted += 1
    while len(self.groups) < self.in_flight:
      if not self.pending:
        self.pending.extend(draw())
      record = self.pending.pop(0)
      self.groups.append(Group(self.next_uid, record, [Member() for _ in range(g)]))
      self.next_uid += 1
    requests, resumed = self._requests()
    by_uid = {group.uid: group for group in self.groups}
    left = {group.uid: sum(m.reason is None for m in group.members) for group in self.groups}
    complete = [sum(n == 0 for n in left.values())]
    seen = [0]

    def enough(progress) -> bool:
      for c in progress.finished[seen[0] :]:
        uid = c.request_id // g
        left[uid] -= 1
        complete[0] += left[uid] == 0
      seen[0] = len(progress.finished)
      return complete[0] >= self.num_groups

    result = self.sampler.driver.run(
      params, requests, policy_version=version, seed=seed, stop_when=enough
    )
    for c in result.finished + result.partial:
      by_uid[c.request_id // g].members[c.request_id % g].update(c)
    done = [group for group in self.groups if group.complete][: self.num_groups]
    taken = {group.uid for group in done}
    self.groups = [group for group in self.groups if group.uid not in taken]
    rollout = self.sampler.pack([self._completion(group, j) for group in done for j in range(g)])
    mask = rollout.mask
    stale = np.where(mask, version - rollout.versions, 0)  # behind the sampler's weights
    carried = [m for group in self.groups for m in group.members if m.reason is None and m.tokens]
    stats = {
      "partial/in_flight_groups": float(len(self.groups)),
      "partial/carried_sequences": float(len(carried)),
      "partial/carried_tokens": float(sum(len(m.tokens) for m in carried)),
      "partial/resumed_sequences": float(resumed),
      "partial/restarted_groups": float(restarted),
      "partial/pending_records": float(len(self.pending)),
      "partial/staleness_mean": float(stale.sum() / max(mask.sum(), 1)),
      "partial/staleness_max": float(stale.max(initial=0)),
      "partial/stale_token_frac": float((stale > 0).sum() / max(mask.sum(), 1)),
    }
    return rollout, [group.record for group in done], dict(result.stats), stats

  def _requests(self) -> tuple[list[Request], int]:
    """This step's requests: a not-started group's G samples together (one prefill), each
    unfinished sample of a started group alone, resumed from its tokens so far."""
    s, g = self.sampler, self.group_size
    prompts = self.encode([group.record for group in self.groups])
    requests, resumed = [], 0
    for group, prompt in zip(self.groups, prompts, strict=True):
      common = dict(sampling=s.sampling, max_new_tokens=s.max_new_tokens, stop_token_ids=s.stop_ids)
      if not group.started:
        requests += [Request(prompt, group.uid * g + j, group.uid, **common) for j in range(g)]
        continue
      for j, m in enumerate(group.members):
        if m.reason is None:
          resume = Resume(m.tokens, m.logprobs, m.versions, m.key, m.route_array())
          requests.append(Request(prompt, group.uid * g + j, resume=resume, **common))
          resumed += 1
    return requests, resumed

  def _completion(self, group: Group, j: int) -> Completion:
    m = group.members[j]
    return Completion(
      request_id=group.uid * self.group_size + j,
      group_id=group.uid,
      prompt_tokens=np.asarray(self.encode([group.record])[0], np.int32),
      tokens=np.asarray(m.tokens, np.int32),
      logprobs=np.asarray(m.logprobs, np.float32),
      finish_reason=m.reason,
      policy_version=max(m.versions),
      versions=np.asarray(m.versions, np.int32),
      key=np.asarray(m.key, np.uint32),
      routes=m.route_array(),
    )

  # ---------------------------------------------------------------------------- checkpoints

  def state_dict(self) -> dict:
    """The carried groups, the records waiting to start and the id counter, as JSON-ready
    Python values: float32 log-probs are written as the doubles they widen to, so a restore
    gives them back bit for bit."""
    return {
      "next_uid": self.next_uid,
      "pending": list(self.pending),
      "groups": [
        {
          "uid": group.uid,
          "record": group.record,
          "members": [m.to_json() for m in group.members],
        }
        for group in self.groups
      ],
    }

  def load_state_dict(self, state: dict) -> None:
    try:
      self.next_uid = int(state["next_uid"])
      self.pending = list(state["pending"])
      self.groups = [
        Group(int(g["uid"]), g["record"], [Member.from_json(m) for m in g["members"]])
        for g in state["groups"]
      ]
    except (KeyError, TypeError, ValueError) as e:
      raise ValueError(f"checkpoint's partial-rollout state is malformed: {e!r}") from e
    for group in self.groups:
      if len(group.members) != self.group_size:
        raise ValueError(
          f"checkpoint's partial-rollout group {group.uid} has {len(group.members)} samples; "
          f"this run's rl.group_size is {self.group_size}"
        )
