"""What every sampler returns: the `Rollout` arrays and the `Sampler` protocol that makes them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

import jax
import numpy as np

# Why a completion ended; `Rollout.finish_reason` holds the index into this tuple.
FINISH_REASONS = ("stop", "stop_string", "length", "abort")
STOP, STOP_STRING, LENGTH, ABORT = range(len(FINISH_REASONS))


class Rollout(NamedTuple):
  """Sampled completions, B rows, P = prompt bucket, N = max new tokens (numpy or jax arrays).

  Per-token `versions` are the policy version that sampled each token: one version per row for a
  rollout sampled at one step, several where a sequence was continued across weight updates
  (partial rollouts), so staleness is tracked per token into `TrainBatch.versions`.
  """

  prompt_tokens: jax.Array  # [B, P] int32, left-padded
  prompt_mask: jax.Array  # [B, P] bool
  tokens: jax.Array  # [B, N] int32, pad after the last token
  mask: jax.Array  # [B, N] bool, True up to and including the stop token
  logprobs: jax.Array  # [B, N] float32 behaviour log-probs (0 where mask is False)
  versions: jax.Array  # [B, N] int32 policy version of each token (-1 where mask is False)
  lengths: jax.Array  # [B] int32 completion lengths (incl. the stop token)
  truncated: jax.Array  # [B] bool: ended by the length budget or aborted, not by a stop
  finish_reason: jax.Array  # [B] int32 index into FINISH_REASONS
  # [B, P + N, L, k] experts each MoE layer chose at each position of prompt + completion when
  # the sampler captured them (routing replay), aligned with `TrainBatch.tokens`; -1 where
  # nothing was fed (padding, the last token). int8 (int16 past 127 experts). None otherwise.
  routes: jax.Array | None = None
  # [B, N] bool with multi-turn rollouts (jaxrl.rollout.multiturn): True on the tokens the policy
  # sampled, False on the environment's observation tokens between its turns (fed, attended, not
  # trained). None: every `mask` token is the policy's.
  model_mask: jax.Array | None = None

  def model_tokens(self):
    """[B, N] bool (numpy): the completion tokens the policy sampled (`mask` less observations)."""
    m = np.asarray(self.mask)
    return m if self.model_mask is None else m & np.asarray(self.model_mask)


def rollout_to_json(rollout: Rollout) -> dict:
  """A host Rollout as JSON-ready values (a checkpoint's meta): float32 values are written as
  the doubles they widen to, so `rollout_from_json` gives them back bit for bit."""
  arrays = {k: np.asarray(v) for k, v in rollout._asdict().items() if v is not None}
  return {
    "arrays": {k: v.tolist() for k, v in arrays.items()},
    "dtypes": {k: str(v.dtype) for k, v in arrays.items()},
  }


def rollout_from_json(d: dict) -> Rollout:
  return Rollout(**{k: np.asarray(v, d["dtypes"][k]) for k, v in d["arrays"].items()})


class Sampler(Protocol):
  """`sampler(params, prompts, group_size=G, seed=s, version=v) -> (Rollout, stats)`.

  Samples `group_size` completions of each prompt (token lists, unpadded) with `params` (the
  learner's own arrays, not a copy); rows are prompt-major (prompt i's samples are rows
  i * G .. i * G + G - 1). `sampling` overrides the sampler's default SamplingParams (e.g.
  greedy evaluation); `version` stamps every sampled token. The same seed gives the same
  tokens whatever the batch composition. `stats` are float rollout counters for metrics.
  """

  def __call__(
    self,
    params,
    prompts: Sequence[Sequence[int]],
    *,
    group_size: int,
    seed: int,
    version: int = 0,
    sampling=None,
  ) -> tuple[Rollout, dict]: ...
