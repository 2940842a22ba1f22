"""The rollout driver: a request queue fed through an Engine's slots in continuous batching.

    driver = Driver(engine, steps_per_call=8)
    result = driver.run(params, requests, policy_version=3, seed=0, stop_when=None)
    result.finished / result.partial: Completions (numpy prompt tokens, completion tokens,
    behaviour log-probs, finish reason, policy version); result.unstarted: requests never begun.

Loop: admit queued requests (a group whole) while slots and pages last; prefill the admitted
prompts of one length bucket and one sample count per prompt in ONE call (`prefill_batch`: a
group's samples share its prompt's prefill; in calls of at most the engine's
`prefill_batch_prompts`) and place all their samples with one `insert_batch` (a prompt longer
than a prefill chunk is prefilled chunk by chunk, `prefill_prompt` + `bulk_insert`); dispatch
`generate_steps` for `steps_per_call` steps; while the device runs them, process the previous
call's results on the host (append tokens, check stop strings, retire finished sequences, free
their pages); refill; repeat until every request is done or `stop_when(progress)` holds, which
aborts the rest and returns it as partial sequences whose tokens and log-probs are intact.
A partial sequence is resumed later (under the same or newer weights) by a request carrying it
as `Request.resume`: its prompt and partial completion are prefilled together and decoding goes
on from its next token, drawn from the same key stream, so with unchanged weights it ends as the
uninterrupted sequence would (partial rollouts: APRIL; CoPRIS).

`batching="static"` is the baseline continuous batching is measured against: requests are taken
in batches of at most `max_concurrent_decodes` samples, and a batch is admitted only once every
sequence of the previous one has finished. Sampling keys depend only on (seed, request_id), so
both modes produce the same tokens and log-probs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from jaxrl.rollout.engine import Engine, request_keys
from jaxrl.rollout.sampling import SamplingParams

BATCHING_MODES = ("continuous", "static")


@dataclasses.dataclass(frozen=True)
class Resume:
  """What a sequence produced before it was aborted: its completion tokens so far, their
  behaviour log-probs and the policy version that drew each, and its PRNG key data [2] (uint32):
  the sampling state, so the resumed sequence draws token i with fold_in(key, i) as before.
  `routes` (captured MoE routes, `Completion.routes`) are the experts of every position the
  sampler fed so far: they are kept, and the re-prefill's routes of those positions dropped, so a
  position's route is always the one recorded when it was first fed, as its log-prob is."""

  tokens: Sequence[int]
  logprobs: Sequence[float]
  versions: Sequence[int]
  key: Sequence[int]
  routes: np.ndarray | None = None  # [P + n - 1, L, k]

  def __post_init__(self):
    n = len(self.tokens)
    if len(self.logprobs) != n or len(self.versions) != n:
      raise ValueError(
        f"a resumed sequence needs one log-prob and one version per token: {n} tokens, "
        f"{len(self.logprobs)} log-probs, {len(self.versions)} versions"
      )
    if len(self.key) != 2:
      raise ValueError(f"a resumed sequence's key is [2] uint32 key data, got {list(self.key)}")


@dataclasses.dataclass(frozen=True)
class Request:
  """One sequence to sample. Requests sharing a `group_id` (a GRPO group) must share the prompt,
  max_new_tokens and stop conditions; they are prefilled once and decoded side by side.

  `request_id` (unique in a run) seeds the sequence's RNG: with the run seed it fixes every draw.
  EOS (the driver's `eos_id`) is always a stop token. `resume` continues a partial sequence
  (its own key, its tokens so far; `max_new_tokens` counts them): it is decoded alone, not with
  its group's other members (their prompts now differ).
  """

  prompt: Sequence[int]
  request_id: int
  group_id: int | None = None
  sampling: SamplingParams = SamplingParams()
  max_new_tokens: int = 64
  stop_token_ids: tuple[int, ...] = ()
  stop_strings: tuple[str, ...] = ()
  resume: Resume | None = None
  # A group prefilled for more samples than it asks for now (in-step allocation): `draws` first
  # tokens are drawn at its prefill (sample j with the key of request id request_id -
  # sample_index + j), and this request is sample `sample_index` of them. With Driver.run(
  # keep=store) the prefill is kept, and a later run's requests of the same group_id are
  # inserted from it: the prompt's KV is computed once per step.
  draws: int | None = None
  sample_index: int = 0

  @property
  def done_tokens(self) -> int:
    """Completion tokens produced before this request (by an earlier, aborted run)."""
    return 0 if self.resume is None else len(self.resume.tokens)

  @property
  def prefill_tokens(self) -> list[int]:
    """What the engine prefills: the prompt, and a resumed sequence's tokens so far."""
    return list(self.prompt) + ([] if self.resume is None else list(self.resume.tokens))


@dataclasses.dataclass
class Completion:
  """A finished (or aborted) sequence, as numpy arrays."""

  request_id: int
  group_id: int | None
  prompt_tokens: np.ndarray  # [P] int32
  tokens: np.ndarray  # [N] int32 completion, the stop token included
  logprobs: np.ndarray  # [N] float32 behaviour log-probs of `tokens`
  finish_reason: str  # one of jaxrl.rollout.types.FINISH_REASONS
  policy_version: int  # the version of the run that ended it
  versions: np.ndarray  # [N] int32 the policy version that drew each token
  key: np.ndarray  # [2] uint32 its PRNG key data (resume it with `Request.resume`)
  # [P + N - 1, L, k] int32 with an engine that captures routes: the experts of every position
  # the sampler fed (the prompt, then each completion token but the last, never fed); else None.
  routes: np.ndarray | None = None
  model_mask: np.ndarray | None = None  # [N] bool, multi-turn: False on observation tokens


@dataclasses.dataclass
class Progress:
  """What `stop_when` sees after each batch of results."""

  finished: list[Completion]
  num_complete_groups: int  # groups (or ungrouped requests) whose every member finished
  num_live: int


@dataclasses.dataclass
class RunResult:
  finished: list[Completion]
  partial: list[Completion]  # in flight when `stop_when` held: finish_reason "abort"
  unstarted: list[Request]  # still queued when `stop_when` held
  stats: dict


def complete_groups(n: int) -> Callable[[Progress], bool]:
  """A `stop_when`: stop once `n` groups have all their samples finished."""
  return lambda progress: progress.num_complete_groups >= n


@dataclasses.dataclass
class _Live:
  request: Request
  unit: int
  slot: int | None = None
  tokens: list = dataclasses.field(default_factory=list)
  logprobs: list = dataclasses.field(default_factory=list)
  versions: list = dataclasses.field(default_factory=list)
  key: np.ndarray | None = None
  routes: list | None = None  # [L, k] per fed position (captured routes only)

  def __post_init__(self):
    if self.request.resume is not None:
      self.tokens = list(self.request.resume.tokens)
      self.logprobs = list(self.request.resume.logprobs)
      self.versions = list(self.request.resume.versions)


class Driver:
  """Runs request lists through one Engine; keeps its decode state between runs.

  steps_per_call: decode steps per `generate_steps` call (one compile; more steps mean fewer
    host round trips, at the cost of up to that many steps of latency before a slot refills).
  eos_id: always a stop token (default: the engine tokenizer's eos_id, if any).
  tokenizer: decodes completions for stop strings (default: the engine's).
  batching: "continuous" (default) refills a slot as soon as its sequence finishes; "static"
    admits a new batch only when the previous one has wholly finished (a benchmark baseline).
  """

  def __init__(
    self,
    engine: Engine,
    *,
    steps_per_call: int = 8,
    eos_id=None,
    tokenizer=None,
    batching: str = "continuous",
  ):
    if steps_per_call <= 0:
      raise ValueError(f"steps_per_call must be positive, got {steps_per_call}")
    if batching not in BATCHING_MODES:
      raise ValueError(f"batching must be one of {BATCHING_MODES}, got {batching!r}")
    self.batching = batching
    self.engine = engine
    self.steps_per_call = steps_per_call
    self.tokenizer = tokenizer if tokenizer is not None else engine.get_tokenizer()
    if eos_id is None and self.tokenizer is not None:
      eos_id = getattr(self.tokenizer, "eos_id", None)
    self.eos_id = eos_id
    self._state = None

  def run(
    self,
    params,
    requests: Sequence[Request],
    *,
    policy_version: int = 0,
    seed: int = 0,
    stop_when: Callable[[Progress], bool] | None = None,
    on_finished: Callable[[list[Completion]], Sequence[Request] | None] | None = None,
    keep: dict | None = None,
  ) -> RunResult:
    """Sample every request (or until `stop_when(progress)` holds); see the module docstring.

    `on_finished(completions)` is handed the sequences that finished since its last call, each
    time the host has read a decode call's results and the next call is already running: host
    work on them (detokenising, scoring) overlaps that device call. Every finished sequence is
    handed over once, the last ones before `run` returns. Requests it returns join the queue
    (ungrouped, fresh ids): a multi-turn rollout starts a sequence's next turn as soon as its
    environment has answered, while the other sequences decode (`jaxrl.rollout.multiturn`).

    `keep` (a dict the caller owns for the runs of one step) holds the batched prefills of
    groups whose requests set `draws`: a group found in it is not prefilled again, its samples
    are inserted from the kept prefill (its KV cache and the first tokens drawn for every one of
    its `draws` samples). The caller drops the dict when the step is over."""
    eng = self.engine
    units = self._units(requests)
    if self._state is None:
      self._state = eng.init_decode_state()
    eng.recalibrate_kv()  # fp8 pages: this run's first prefill sets their scales (no-op else)
    queue = list(range(len(units)))
    unit_left = [len(u) for u in units]
    live: dict[int, _Live] = {}  # slot -> sequence
    owners = np.full(eng.max_concurrent_decodes, -1, np.int64)  # slot -> request_id
    finished: list[Completion] = []
    stats = {
      "prefill_calls": 0,
      "prefill_prompts": 0,  # each group's prompt once: prefill_calls <= this
      "generate_calls": 0,
      "decode_steps": 0,
      "queued_waits": 0,
      "batches": 0,  # static batches started (continuous: 0)
      "reused_prompts": 0,  # groups inserted from a prefill kept by an earlier run (keep=)
      "compiles": 0,  # engine programs compiled during this run (new shapes)
    }
    programs_before = eng.program_count
    done_units = [0]
    reported = [0]  # finished sequences handed to on_finished so far
    ids = {r.request_id for u in units for r in u}

    def report() -> bool:
      """Hand the new finished sequences to on_finished; queue what it returns (any?)."""
      if on_finished is None or len(finished) <= reported[0]:
        return False
      more = on_finished(finished[reported[0] :]) or ()
      reported[0] = len(finished)
      for r in more:
        if r.group_id is not None or r.resume is not None or r.request_id in ids:
          raise ValueError(
            f"on_finished returned request {r.request_id}: fed requests are ungrouped, not "
            "resumed, with ids not used before in the run"
          )
        ids.add(r.request_id)
        units.extend(self._units([r]))
        unit_left.append(1)
        queue.append(len(units) - 1)
      return bool(more)

    def finish(seq: _Live, reason: str):
      if seq.slot is not None:
        eng.free_resource(seq.slot)
        live.pop(seq.slot)
        owners[seq.slot] = -1
      finished.append(self._completion(seq, reason, policy_version))
      unit_left[seq.unit] -= 1
      done_units[0] += unit_left[seq.unit] == 0

    def admit() -> int:
      """Admit queued units; how many."""
      if self.batching == "continuous":
        return fill(budget=None)
      # A batch whose every sequence finished at its first token leaves nothing live: start the
      # next one at once. An empty engine always admits the head unit (`_units` checked it fits).
      admitted = 0
      while queue and not live:
        stats["batches"] += 1
        admitted += fill(budget=eng.max_concurrent_decodes)
      return admitted

    def fill(budget) -> int:
      """Admit queued units while slots and pages last (and, static, `budget` samples); how
      many."""
      admitted = []
      slots_left, pages_left = eng.max_concurrent_decodes - len(live), eng.allocator.num_free
      while queue:
        group = units[queue[0]]
        req = group[0]
        if budget is not None and len(group) > budget:
          break
        need = eng.pages_needed(
          len(req.prefill_tokens), req.max_new_tokens - req.done_tokens, len(group)
        )
        if slots_left < len(group) or need > pages_left:
          stats["queued_waits"] += 1
          break
        admitted.append(queue.pop(0))
        slots_left, pages_left = slots_left - len(group), pages_left - need
        if budget is not None:
          budget -= len(group)
      if not admitted:
        return 0
      # Whole prompts of one length bucket share one prefill call and one insert; prompts past
      # a prefill chunk are prefilled chunk by chunk, one unit at a time; groups kept from an
      # earlier run of the step are inserted from their prefill, one insert per kept batch.
      buckets: dict[int, list[int]] = {}
      reused: dict[int, list[int]] = {}
      for u in admitted:
        n = len(units[u][0].prefill_tokens)
        gid = units[u][0].group_id
        if keep is not None and gid is not None and gid in keep:
          reused.setdefault(id(keep[gid][0]), []).append(u)
        elif n <= eng.prefill_chunk_size:
          # One call per length bucket and samples per prompt (a fresh group's G draws, a
          # resumed sequence's one), in calls of at most the engine's prefill_batch_prompts.
          per_prompt = units[u][0].draws or len(units[u])
          buckets.setdefault((eng.prefill_bucket(n), per_prompt), []).append(u)
        else:
          buckets.setdefault(-u - 1, []).append(u)  # a bucket of its own
      for batch_units in reused.values():
        batch, first, _ = keep[units[batch_units[0]][0].group_id]
        members = [
          (u, r, keep[r.group_id][2] + r.sample_index) for u in batch_units for r in units[u]
        ]
        stats["reused_prompts"] += len(batch_units)
        place(batch, first, members, batched=True)
      calls = []
      cap = eng.prefill_batch_prompts
      for key, batch_units in buckets.items():
        if isinstance(key, tuple) and cap is not None:
          calls += [(key, batch_units[i : i + cap]) for i in range(0, len(batch_units), cap)]
        else:
          calls.append((key, batch_units))
      for key, batch_units in calls:
        batched = isinstance(key, tuple)
        groups = [units[u] for u in batch_units]
        reqs = [r for g in groups for r in g]
        # The samples each prompt draws at its prefill: its requests, or `draws` of them (a
        # batched prefill only; a prompt prefilled in chunks is not kept).
        spare = [batched and bool(g[0].draws) for g in groups]
        drawn = [
          [g[0].request_id - g[0].sample_index + j for j in range(g[0].draws)]
          if sp
          else [r.request_id for r in g]
          for g, sp in zip(groups, spare, strict=True)
        ]
        keys = np.array(request_keys(seed, [rid for ids in drawn for rid in ids]))
        # Per drawn sample: its sampling parameters and key-stream index; a resumed request's
        # own key (spare draws are fresh samples of the group's first request's kind).
        samplers, index, row = [], [], 0
        for g, sp in zip(groups, spare, strict=True):
          for r in [g[0]] * g[0].draws if sp else g:
            if r.resume is not None:
              keys[row] = np.asarray(r.resume.key, np.uint32)
            samplers.append(r.sampling)
            index.append(r.done_tokens)
            row += 1
        if batched:
          batch, first = eng.prefill_batch(
            params,
            [g[0].prefill_tokens for g in groups],
            num_samples=[len(ids) for ids in drawn],
            sampler=samplers,
            rng=keys,
            max_new_tokens=[g[0].max_new_tokens - g[0].done_tokens for g in groups],
            stop_token_ids=[self._stop_ids(g[0]) for g in groups],
            first_index=index,
          )
        else:
          req = groups[0][0]
          batch, first = eng.prefill_prompt(
            params,
            req.prefill_tokens,
            sampler=[r.sampling for r in reqs],
            rng=keys,
            num_samples=len(reqs),
            max_new_tokens=req.max_new_tokens - req.done_tokens,
            stop_token_ids=self._stop_ids(req),
            first_index=index,
          )
        stats["prefill_calls"] += 1
        stats["prefill_prompts"] += len(groups)
        first = first.convert_to_numpy()
        offsets = np.cumsum([0] + [len(ids) for ids in drawn])
        members = []
        for k, (u, g) in enumerate(zip(batch_units, groups, strict=True)):
          if spare[k] and keep is not None:
            keep[g[0].group_id] = (batch, first, int(offsets[k]))
          for j, r in enumerate(g):
            row = offsets[k] + (r.sample_index if spare[k] else j)
            members.append((u, r, int(row)))
        place(batch, first, members, batched=batched)
      return len(admitted)

    def place(batch, first, members, *, batched: bool):
      """Start each (unit, request, sample row of the prefill) from its first token: retire it
      at once if that token ends it, else give it a slot; one insert for them all."""
      slots, samples = [], []
      routes = None if batch.routes is None else np.asarray(batch.routes)
      for u, r, j in members:
        seq = _Live(r, u, key=np.asarray(batch.keys[j]))  # a resumed one's own key
        if routes is not None:
          seq.routes = self._prefill_routes(r, routes[batch.group[j]] if batched else routes)
        d = first.get_result_at_slot(j)
        seq.tokens.append(int(d.tokens[0]))
        seq.logprobs.append(float(d.log_prob[0]))
        seq.versions.append(policy_version)
        reason = self._host_finish(seq, bool(first.done[j]))
        if reason:
          finish(seq, reason)
          continue
        seq.slot = free_slots_now().pop(0)
        slots.append(seq.slot)
        samples.append(j)
        live[seq.slot] = seq
        owners[seq.slot] = r.request_id
      if not slots:
        return
      if batched:
        self._state = eng.insert_batch(batch, self._state, slots, samples)
      else:
        self._state = eng.bulk_insert(batch, self._state, slots, samples)

    def free_slots_now() -> list[int]:
      return [s for s in range(eng.max_concurrent_decodes) if s not in live]

    def process(result, owner_ids):
      data = result.convert_to_numpy()
      # Every column once for all slots ([steps, B] each), then python per produced token.
      d = data.all_slots()
      tokens, logp = d.tokens[..., 0].tolist(), d.log_prob[..., 0].tolist()
      valid, done = d.valid[..., 0], data.done
      for slot, seq in list(live.items()):
        if seq.request.request_id != owner_ids[slot]:
          continue  # retired since this call was dispatched: its late tokens are dropped
        for i in np.flatnonzero(valid[:, slot]):
          if seq.routes is not None:
            seq.routes.append(d.routes[i, slot])  # of the token fed at this step
          seq.tokens.append(tokens[i][slot])
          seq.logprobs.append(logp[i][slot])
          seq.versions.append(policy_version)
          reason = self._host_finish(seq, bool(done[i, slot]))
          if reason:
            finish(seq, reason)
            break

    pending = None
    aborted = False
    while True:  # until nothing is live, queued or fed by on_finished
      admitted = admit()
      if stop_when is not None and stop_when(Progress(finished, done_units[0], len(live))):
        aborted = True
        break
      if not live and pending is None:
        if queue and not admitted:  # cannot happen: `_units` checked every unit fits
          raise RuntimeError("requests are queued but none can be admitted")
        # Sequences retired at their first token (max_new_tokens=1, or a first token that stops)
        # leave the slots empty with units still queued, and may feed more: admit again.
        if report() or queue:
          continue
        break
      dispatched = None
      if live:
        self._state, res = eng.generate_steps(params, self._state, self.steps_per_call)
        res.copy_to_host_async()
        stats["generate_calls"] += 1
        stats["decode_steps"] += self.steps_per_call
        dispatched = (res, owners.copy())
      if pending is not None:
        process(*pending)  # overlaps the call just dispatched
        report()  # so does the caller's host work
      pending = dispatched
    if pending is not None:
      process(*pending)  # already computed: keep its tokens
    if on_finished is not None and len(finished) > reported[0]:
      on_finished(finished[reported[0] :])  # aborted: what it returns is not run
    partial = []
    for seq in list(live.values()):
      eng.free_resource(seq.slot)
      live.pop(seq.slot)
      partial.append(self._completion(seq, "abort", policy_version))
    unstarted = [r for u in queue for r in units[u]] if aborted else []
    stats["compiles"] = eng.program_count - programs_before
    return RunResult(finished, partial, unstarted, stats)

  def _units(self, requests: Sequence[Request]) -> list[list[Request]]:
    """Group requests by group_id (first-appearance order) and check each fits the engine."""
    eng = self.engine
    units: dict = {}
    ids = set()
    for i, r in enumerate(requests):
      if r.request_id in ids:
        raise ValueError(f"request_id {r.request_id} appears twice; ids must be unique in a run")
      ids.add(r.request_id)
      if r.resume is not None and r.group_id is not None and r.resume.tokens:
        raise ValueError(
          f"request {r.request_id} resumes a partial sequence but has group_id {r.group_id}: "
          "a resumed sequence is prefilled alone (group_id=None)"
        )
      if r.done_tokens >= r.max_new_tokens:
        raise ValueError(
          f"request {r.request_id} resumes {r.done_tokens} tokens, not fewer than its "
          f"max_new_tokens={r.max_new_tokens}: nothing is left to generate"
        )
      key = ("group", r.group_id) if r.group_id is not None else ("single", i)
      units.setdefault(key, []).append(r)
    out = list(units.values())
    for group in out:
      r0 = group[0]
      for r in group[1:]:
        same = (list(r.prompt), r.max_new_tokens, r.stop_token_ids, r.stop_strings) == (
          list(r0.prompt),
          r0.max_new_tokens,
          r0.stop_token_ids,
          r0.stop_strings,
        )
        if not same:
          raise ValueError(
            f"requests {r0.request_id} and {r.request_id} share group_id {r.group_id} but differ "
            "in prompt, max_new_tokens or stop conditions"
          )
      if r0.draws is not None:
        base = r0.request_id - r0.sample_index
        for r in group:
          if (r.draws, r.request_id - r.sample_index) != (r0.draws, base) or not (
            0 <= r.sample_index < r.draws and r.group_id is not None and r.resume is None
          ):
            raise ValueError(
              f"request {r.request_id}: a group drawing spare samples (draws) needs a group_id, "
              "no resume, the same draws in every request, 0 <= sample_index < draws and "
              "request ids base + sample_index"
            )
      n_prefill, n_new = len(r0.prefill_tokens), r0.max_new_tokens - r0.done_tokens
      eng.check_prompt(n_prefill, n_new)
      if len(group) > eng.max_concurrent_decodes:
        raise ValueError(
          f"group {r0.group_id} has {len(group)} samples, more than the engine's "
          f"max_concurrent_decodes={eng.max_concurrent_decodes}"
        )
      need = eng.pages_needed(n_prefill, n_new, len(group))
      if need > eng.num_pages:
        raise ValueError(
          f"request {r0.request_id} (group of {len(group)}) needs {need} KV pages; the engine "
          f"has num_pages={eng.num_pages}"
        )
      if r0.stop_strings and self.tokenizer is None:
        raise ValueError(f"request {r0.request_id} has stop_strings but no tokenizer was given")
    return out

  @staticmethod
  def _prefill_routes(req: Request, routes: np.ndarray) -> list:
    """A sequence's routes once prefilled, from its prefill's [T, L, k]: every prefilled
    position's; for a resumed one with recorded routes, those, and the prefill's for the one
    position it feeds for the first time (its last token so far)."""
    n = len(req.prefill_tokens)
    recorded = None if req.resume is None else req.resume.routes
    if recorded is None:
      return list(routes[:n])
    if len(recorded) != n - 1:
      raise ValueError(
        f"request {req.request_id} resumes with routes for {len(recorded)} positions; its "
        f"prompt and {len(req.resume.tokens)} tokens so far need {n - 1}"
      )
    return list(recorded) + [routes[n - 1]]

  def _stop_ids(self, req: Request) -> tuple[int, ...]:
    ids = tuple(req.stop_token_ids)
    return ids + (self.eos_id,) if self.eos_id is not None else ids

  def _host_finish(self, seq: _Live, device_done: bool) -> str | None:
    """Finish reason after the token just appended, or None to continue."""
    req = seq.request
    if seq.tokens[-1] in self._stop_ids(req):
      return "stop"
    if req.stop_strings:
      # Only the tail can hold a new match: a stop string spans at most 4 bytes per character.
      tail = 4 * max(len(s) for s in req.stop_strings) + 4
      text = self.tokenizer.decode(seq.tokens[-tail:])
      if any(s in text for s in req.stop_strings):
        return "stop_string"
    if len(seq.tokens) >= req.max_new_tokens:
      return "length"
    if device_done:
      raise RuntimeError(f"device finished request {req.request_id} for no reason the host sees")
    return None

  @staticmethod
  def _completion(seq: _Live, reason: str, version: int) -> Completion:
    return Completion(
      request_id=seq.request.request_id,
      group_id=seq.request.group_id,
      prompt_tokens=np.asarray(seq.request.prompt, np.int32),
      tokens=np.asarray(seq.tokens, np.int32),
      logprobs=np.asarray(seq.logprobs, np.float32),
      finish_reason=reason,
      policy_version=version,
      versions=np.asarray(seq.versions, np.int32),
      key=np.asarray(seq.key, np.uint32),
      routes=None if seq.routes is None else np.asarray(seq.routes, np.int32),
    )
