"""Group rollouts for RL through the engine: prompts x G samples -> one fixed-shape `Rollout`.

The RL loop asks for `G` samples of each prompt; the driver prefills each prompt once (prompts of
one length bucket in one call) and decodes its samples side by side in the engine's slots
(continuous batching, or static admission), and the finished sequences come back here in
request order, padded into fixed-shape `Rollout` arrays (prompts left-padded to P, completions
right-padded to N) for `batch.from_rollout`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxrl.mesh import Rules
from jaxrl.models.config import ModelConfig
from jaxrl.rollout.driver import Completion, Driver, Request
from jaxrl.rollout.engine import Engine
from jaxrl.rollout.kv_cache import pages_for
from jaxrl.rollout.sampling import SamplingParams
from jaxrl.rollout.types import FINISH_REASONS, Rollout


def left_pad(seqs: list[list[int]], length: int, pad_id: int, *, what: str = "prompt"):
  """Left-pad token lists to `length`: (tokens [B, length] int32, mask [B, length] bool)."""
  tokens = np.full((len(seqs), length), pad_id, np.int32)
  mask = np.zeros((len(seqs), length), bool)
  for i, s in enumerate(seqs):
    if len(s) > length:
      raise ValueError(
        f"{what} {i} has {len(s)} tokens, longer than the prompt bucket of {length} "
        f"(raise rl.max_prompt_len, within the model's max_seq_len)"
      )
    if s:
      tokens[i, length - len(s) :] = s
      mask[i, length - len(s) :] = True
  return tokens, mask


def to_rollout(
  completions: Sequence[Completion], *, prompt_len: int, max_new_tokens: int, pad_id: int,
  num_experts: int = 32767,
) -> Rollout:  # fmt: skip
  """Pack completions (in the order given) into numpy `Rollout` arrays (`num_experts` sizes the
  integer type of captured routes, if any)."""
  prompt_tokens, prompt_mask = left_pad(
    [list(c.prompt_tokens) for c in completions], prompt_len, pad_id
  )
  b, n = len(completions), max_new_tokens
  tokens = np.full((b, n), pad_id, np.int32)
  mask = np.zeros((b, n), bool)
  logprobs = np.zeros((b, n), np.float32)
  versions = np.full((b, n), -1, np.int32)
  for i, c in enumerate(completions):
    k = len(c.tokens)
    if k > n:
      raise ValueError(f"completion {c.request_id} has {k} tokens > max_new_tokens={n}")
    tokens[i, :k], mask[i, :k], logprobs[i, :k] = c.tokens, True, c.logprobs
    versions[i, :k] = c.versions
  lengths = mask.sum(axis=1).astype(np.int32)
  reason = np.array([FINISH_REASONS.index(c.finish_reason) for c in completions], np.int32)
  routes = None
  if b and completions[0].routes is not None:
    routes = pack_routes(completions, prompt_len, n, num_experts)
  model_mask = None
  if b and completions[0].model_mask is not None:  # multi-turn: observations are not the policy's
    model_mask = np.zeros((b, n), bool)
    for i, c in enumerate(completions):
      model_mask[i, : len(c.tokens)] = c.model_mask
  # Truncated = stopped by the length budget (or aborted), not by a stop token or string.
  truncated = np.array([c.finish_reason in ("length", "abort") for c in completions], bool)
  return Rollout(
    prompt_tokens=prompt_tokens,
    prompt_mask=prompt_mask,
    tokens=tokens,
    mask=mask,
    logprobs=logprobs,
    versions=versions,
    lengths=lengths,
    truncated=truncated,
    finish_reason=reason.reshape(b),
    routes=routes,
    model_mask=model_mask,
  )


def pack_routes(
  completions: Sequence[Completion], prompt_len: int, max_new_tokens: int, num_experts: int
) -> np.ndarray:
  """Completions' captured routes ([P_i + N_i - 1, L, k] each) as [B, prompt_len +
  max_new_tokens, L, k], aligned with the left-padded prompt and the completion; -1 elsewhere.
  Expert ids of up to 128 experts fit int8 (int16 beyond): a rollout's routes take L * k bytes
  per token, not L * k int32s."""
  shape = completions[0].routes.shape[1:]
  dtype = np.int8 if num_experts <= 128 else np.int16
  out = np.full((len(completions), prompt_len + max_new_tokens, *shape), -1, dtype)
  for i, c in enumerate(completions):
    if c.routes is None or c.routes.shape[1:] != shape:
      raise ValueError(f"completion {c.request_id} has no routes of shape [*, {shape}]")
    p = len(c.prompt_tokens)
    fed = len(c.routes)
    if fed != p + len(c.tokens) - 1:
      raise ValueError(
        f"completion {c.request_id}: {fed} routes for {p} prompt and {len(c.tokens)} completion "
        "tokens (one per fed position expected)"
      )
    out[i, prompt_len - p : prompt_len - p + fed] = c.routes
  return out


class GroupSampler:
  """`sample(params, prompts, group_size, seed, version) -> (Rollout, stats)` over one Engine.

  Sized for one RL step: `max_concurrent_decodes` slots (default: every sample of the step at
  once) and a page budget that holds them all; with fewer slots or pages the driver queues
  groups and refills slots as sequences finish. Request ids are `prompt index * G + sample`, and
  the driver seeds each request from (seed, request id): the samples do not depend on slot
  placement, on `max_concurrent_decodes` or on the page budget. `resumable` sizes the engine's
  prefill for partial sequences resumed with their completion so far (jaxrl.rl.partial);
  `capture_routes` (MoE) has each rollout carry the experts the sampler routed every position to
  (`Rollout.routes`), for routing replay in the learner. `env_factory` makes every sample a
  multi-turn episode (`jaxrl.rollout.multiturn`): up to `max_turns` turns of `turn_tokens`
  (default max_new_tokens) each, the episode's tokens after the prompt at most max_new_tokens,
  its row's `Rollout.model_mask` False on the environment's observations; `env_workers` > 0
  steps a batch of environments on that many threads (tools that run processes).
  """

  def __init__(
    self,
    cfg: ModelConfig,
    graphdef,
    *,
    prompt_len: int,
    max_new_tokens: int,
    eos_ids: Sequence[int],
    pad_id: int,
    sampling: SamplingParams,
    max_concurrent_decodes: int,
    num_pages: int | None = None,
    page_size: int = 16,
    steps_per_call: int = 8,
    batching: str = "continuous",
    tokenizer=None,
    mesh=None,
    rules: Rules | str = "fsdp_tp",
    resumable: bool = False,
    capture_routes: bool = False,
    kv_dtype: str = "auto",
    prefill_batch_prompts: int | None = None,
    env_factory=None,
    max_turns: int = 1,
    turn_tokens: int | None = None,
    env_workers: int = 0,
  ):
    self.prompt_len, self.max_new_tokens, self.pad_id = prompt_len, max_new_tokens, pad_id
    self.env_factory, self.max_turns = env_factory, max_turns
    self.turn_tokens = turn_tokens or max_new_tokens
    self.executor = None
    if env_workers > 0:  # the environments of a batch of finished turns step concurrently
      from concurrent.futures import ThreadPoolExecutor

      self.executor = ThreadPoolExecutor(env_workers, thread_name_prefix="jaxrl-env")
    self.tokenizer = tokenizer
    if env_factory is not None and tokenizer is None:
      raise ValueError("a multi-turn GroupSampler (env_factory) needs the tokenizer")
    resumable = resumable or env_factory is not None  # a later turn prefills the episode so far
    self.sampling = sampling
    eos_ids = tuple(int(e) for e in eos_ids)
    self.stop_ids = eos_ids[1:]  # the driver always stops on its eos_id
    if num_pages is None:
      num_pages = max_concurrent_decodes * pages_for(prompt_len + max_new_tokens, page_size)
    self.engine = Engine(
      cfg,
      graphdef,
      max_concurrent_decodes=max_concurrent_decodes,
      num_pages=num_pages,
      page_size=page_size,
      # A resumed partial sequence prefills its prompt and its completion so far.
      max_prefill_length=prompt_len + max_new_tokens - 1 if resumable else prompt_len,
      max_target_length=prompt_len + max_new_tokens,
      tokenizer=tokenizer,
      mesh=mesh,
      rules=rules,
      capture_routes=capture_routes,
      kv_dtype=kv_dtype,
      prefill_batch_prompts=prefill_batch_prompts,
    )
    self.driver = Driver(
      self.engine, steps_per_call=steps_per_call, eos_id=eos_ids[0], batching=batching
    )

  def __call__(
    self,
    params,
    prompts: Sequence[Sequence[int]],
    *,
    group_size: int,
    seed: int,
    version: int = 0,
    sampling: SamplingParams | None = None,
    on_finished=None,
  ) -> tuple[Rollout, dict]:
    """Sample `group_size` completions of every prompt; rows are prompt-major, as the v0
    sampler's `[r for r in records for _ in range(G)]` layout (a completion's request id is
    its row). `on_finished` sees completions as they finish (`Driver.run`)."""
    samples = [range(group_size)] * len(prompts)
    by_id, stats = self.sample_indices(
      params,
      prompts,
      samples,
      stride=group_size,
      seed=seed,
      version=version,
      sampling=sampling,
      on_finished=on_finished,
    )
    return self.pack([by_id[i, j] for i in range(len(prompts)) for j in samples[i]]), stats

  def sample_indices(
    self,
    params,
    prompts: Sequence[Sequence[int]],
    samples: Sequence[Sequence[int]],
    *,
    stride: int,
    seed: int,
    version: int = 0,
    sampling: SamplingParams | None = None,
    on_finished=None,
    keep: dict | None = None,
  ) -> tuple[dict[tuple[int, int], Completion], dict]:
    """Sample number j of prompt i for every j in samples[i] (in-step allocation asks for more
    samples of some prompts in later rounds). The request id is i * stride + j (every j <
    stride), so a sample is the same draw whichever others are asked for; the samples of one
    prompt asked for together share one prefill. With `keep` (a dict held for the rounds of one
    step) each prompt is prefilled once, drawing the first tokens of all `stride` samples, and
    later rounds insert their samples from that prefill (`Driver.run(keep=...)`).
    Returns ({(i, j): Completion}, stats). With an `env_factory` each sample is a multi-turn
    episode (`jaxrl.rollout.multiturn`; episode i * stride + j, one environment each; a
    prompt's episodes share the prefill of their first turn) whose Completion holds the whole
    trajectory after the prompt, `model_mask` False on observations."""
    sampling = sampling or self.sampling
    if self.env_factory is not None:
      return self._episodes(
        params, prompts, samples, stride, seed, version, sampling, on_finished, keep
      )
    requests = []
    for i, (p, js) in enumerate(zip(prompts, samples, strict=True)):
      for j in js:
        if not 0 <= j < stride:
          raise ValueError(f"sample {j} of prompt {i} is outside [0, stride={stride})")
        requests.append(
          Request(
            prompt=list(p),
            request_id=i * stride + j,
            group_id=i,
            sampling=sampling,
            max_new_tokens=self.max_new_tokens,
            stop_token_ids=self.stop_ids,
            draws=None if keep is None else stride,
            sample_index=j if keep is not None else 0,
          )
        )
    result = self.driver.run(
      params, requests, policy_version=version, seed=seed, on_finished=on_finished, keep=keep
    )
    by_id = {divmod(c.request_id, stride): c for c in result.finished}
    return by_id, dict(result.stats)

  def _episodes(self, params, prompts, samples, stride, seed, version, sampling, on_finished, keep):
    from jaxrl.rollout.multiturn import run_episodes

    if keep is not None:
      raise ValueError("multi-turn rollouts do not keep prefills across rounds (keep=)")
    pairs = [(i, j) for i, js in enumerate(samples) for j in js]
    if any(not 0 <= j < stride for _, j in pairs):
      raise ValueError(f"a sample index is outside [0, stride={stride})")
    stats = {}
    trajs = run_episodes(
      self.driver,
      params,
      [list(prompts[i]) for i, _ in pairs],
      [self.env_factory() for _ in pairs],
      tokenizer=self.tokenizer,
      max_turns=self.max_turns,
      max_new_tokens=self.turn_tokens,
      max_total_tokens=self.max_new_tokens,
      sampling=sampling,
      seed=seed,
      policy_version=version,
      episode_ids=[i * stride + j for i, j in pairs],
      group_ids=[i for i, _ in pairs],  # a prompt's episodes: its prompt prefilled once
      stop_token_ids=self.stop_ids,
      stats=stats,
      executor=self.executor,
    )
    by_id = {}
    for (i, j), t in zip(pairs, trajs, strict=True):
      done = t.finish_reason == "done"
      by_id[i, j] = Completion(
        request_id=i * stride + j,
        group_id=i,
        prompt_tokens=t.prompt_tokens,
        tokens=t.tokens,
        logprobs=t.logprobs,
        finish_reason="stop" if done else "length",
        policy_version=version,
        versions=t.versions,
        key=np.zeros(2, np.uint32),
        model_mask=t.loss_mask,
      )
    if on_finished is not None:
      on_finished([by_id[p] for p in pairs])
    return by_id, stats

  def pack(self, completions: Sequence[Completion]) -> Rollout:
    """Completions (in the order given) as this sampler's fixed-shape `Rollout`."""
    return to_rollout(
      completions,
      prompt_len=self.prompt_len,
      max_new_tokens=self.max_new_tokens,
      pad_id=self.pad_id,
      num_experts=self.engine.cfg.num_experts,
    )
