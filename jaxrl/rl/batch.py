"""TrainBatch: everything a train step needs, aligned to token columns, each with its mask."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl import distributed


class TrainBatch(NamedTuple):
  """All fields are [B, T] with T = prompt bucket + max new tokens; column j of a per-token field
  refers to predicting tokens[:, j] from tokens[:, :j]."""

  tokens: jax.Array  # int32
  valid: jax.Array  # bool: real tokens (prompt and completion), for positions and attention
  loss_mask: jax.Array  # float32: 1 on completion tokens (incl. EOS) that the loss covers
  advantages: jax.Array  # float32, per token (sequence advantages are broadcast)
  old_logprobs: jax.Array  # float32 behaviour log-probs (the sampler's)
  ref_logprobs: jax.Array  # float32 reference-policy log-probs (zeros when beta = 0)
  versions: jax.Array  # int32 policy version that produced each completion token (-1 elsewhere)
  # Optional (None: absent; a None field is an empty pytree node, so splitting still works):
  prox_logprobs: jax.Array | None = None  # float32 learner log-probs at the start of the update
  learner_version: jax.Array | None = None  # int32 [B]: the version the learner holds (for lag)
  values: jax.Array | None = None  # float32 critic values V(s_t) at rollout time (PPO, gae)
  returns: jax.Array | None = None  # float32 GAE returns, the critic's regression targets
  routes: jax.Array | None = None  # int8/16 [B, T, L, k] the sampler's MoE experts (-1: none)

  def lag(self) -> jax.Array:
    """[B, T] float32 versions each loss token is behind the learner (0 without learner_version)."""
    if self.learner_version is None:
      return jnp.zeros(self.loss_mask.shape, jnp.float32)
    lag = jnp.asarray(self.learner_version)[:, None] - jnp.asarray(self.versions)
    return jnp.where(jnp.asarray(self.loss_mask) > 0, jnp.maximum(lag, 0), 0).astype(jnp.float32)

  @property
  def size(self) -> int:
    return self.tokens.shape[0]


def rollout_columns(rollout, row_weight=None) -> dict[str, np.ndarray]:
  """The TrainBatch's token columns of a Rollout, on the host: tokens, valid, the completion
  mask (`mask`, unweighted), `loss_mask` (times the per-row `row_weight` [B], if given), the
  behaviour log-probs and the per-token versions (-1 off the loss tokens). Each completion
  token keeps the policy version that sampled it (`Rollout.versions`), so a sequence continued
  across updates carries its own staleness per token. A rollout with captured MoE routes adds
  `routes` [B, T, L, k]. A multi-turn rollout's observation tokens are `valid` but off the mask.
  """
  prompt_tokens, rollout_mask = np.asarray(rollout.prompt_tokens), np.asarray(rollout.mask)
  b, p = prompt_tokens.shape
  # The loss covers the policy's own tokens; a multi-turn rollout's observation tokens are only
  # valid (attended), like the prompt.
  model = rollout.model_tokens() if hasattr(rollout, "model_tokens") else rollout_mask
  mask = np.concatenate([np.zeros((b, p), bool), model], axis=1).astype(np.float32)
  versions = np.concatenate([np.full((b, p), -1, np.int32), np.asarray(rollout.versions)], axis=1)
  weight = np.ones(b, np.float32) if row_weight is None else np.asarray(row_weight, np.float32)
  routes = getattr(rollout, "routes", None)
  return {
    **({} if routes is None else {"routes": np.asarray(routes)}),
    "tokens": np.concatenate([prompt_tokens, np.asarray(rollout.tokens)], axis=1).astype(np.int32),
    "valid": np.concatenate([np.asarray(rollout.prompt_mask), rollout_mask], axis=1),
    "mask": mask,
    "loss_mask": mask * weight[:, None],
    "old_logprobs": np.concatenate(
      [np.zeros((b, p), np.float32), np.asarray(rollout.logprobs, np.float32)], axis=1
    ),
    "versions": np.where(mask > 0, versions, -1).astype(np.int32),
  }


def from_rollout(rollout, advantages, *, ref_logprobs=None) -> TrainBatch:
  """A TrainBatch of a Rollout's columns (`rollout_columns`) with per-sequence advantages [B]
  broadcast over each row's loss tokens, and the reference log-probs masked the same way."""
  cols = {k: jnp.asarray(v) for k, v in rollout_columns(rollout).items()}
  loss_mask = cols["loss_mask"]
  adv = jnp.asarray(advantages, jnp.float32)[:, None] * loss_mask
  ref = jnp.zeros_like(loss_mask) if ref_logprobs is None else ref_logprobs * loss_mask
  return TrainBatch(
    cols["tokens"], cols["valid"], loss_mask, adv, cols["old_logprobs"], ref, cols["versions"]
  )


def supervised(
  prompt_tokens, prompt_mask, completions, *, max_new_tokens: int, pad_id: int
) -> TrainBatch:
  """A batch for supervised fine-tuning: loss on the completion tokens (lists ending with EOS)."""
  b = len(completions)
  comp = np.full((b, max_new_tokens), pad_id, np.int32)
  cmask = np.zeros((b, max_new_tokens), bool)
  for i, c in enumerate(completions):
    if len(c) > max_new_tokens:
      raise ValueError(f"completion {i} has {len(c)} tokens > max_new_tokens={max_new_tokens}")
    comp[i, : len(c)] = c
    cmask[i, : len(c)] = True
  tokens = np.concatenate([np.asarray(prompt_tokens), comp], axis=1)
  valid = np.concatenate([np.asarray(prompt_mask), cmask], axis=1)
  loss_mask = np.concatenate([np.zeros_like(prompt_mask), cmask], axis=1).astype(np.float32)
  zeros = np.zeros(tokens.shape, np.float32)
  versions = np.full(tokens.shape, -1, np.int32)
  return TrainBatch(tokens, valid, loss_mask, zeros, zeros, zeros, versions)


def put_like(x, like) -> jax.Array:
  """Host array `x` on the devices of array `like`, replicated (e.g. row indices for a batch on
  the mesh): an explicit transfer, so jitted code that mixes them moves nothing implicitly."""
  sharding = getattr(like, "sharding", None)
  if isinstance(sharding, NamedSharding):
    return distributed.put(x, NamedSharding(sharding.mesh, PartitionSpec()))
  return jax.device_put(x)


@jax.jit
def _live_rows(loss_mask, advantages):
  return jnp.any((loss_mask > 0) & (advantages != 0), axis=1)


@jax.jit
def take_rows(batch, rows) -> TrainBatch:
  """Rows `rows` (a device int array) of every field of a batch pytree."""
  return jax.tree.map(lambda x: jnp.take(x, rows, axis=0), batch)


@jax.jit
def _zero_after(batch: TrainBatch, live):
  live = live.astype(jnp.float32)[:, None]
  return batch._replace(loss_mask=batch.loss_mask * live, advantages=batch.advantages * live)


def gradient_rows(batch: TrainBatch) -> np.ndarray:
  """[B] bool on the host: the rows with a loss token whose advantage is non-zero.

  With a loss that is the advantage times a factor on every token (each policy loss of
  jaxrl.rl.losses, no KL term in the loss, no entropy bonus, no off-policy correction), the other
  rows' loss terms and gradients are exactly zero: a group whose rewards all tie adds nothing to
  the update but compute. Computed where the batch is; one explicit fetch of B booleans
  (gathered from every process of a multi-process run).
  """
  return distributed.to_host(_live_rows(batch.loss_mask, batch.advantages))


def compact_rows(
  batch: TrainBatch, keep: np.ndarray, *, multiple: int = 1, min_rows: int = 1
) -> TrainBatch | None:
  """The rows `keep` [B] bool first, then rows of the others with their loss masks zeroed, to a
  power-of-two count of at least `min_rows` that is a multiple of `multiple` (so the train step
  compiles once per count, a few counts at most, and the rows split evenly over devices and
  micro-batches); None if that is not fewer than B.

  The padding rows are real rows (finite log-probs) that the loss never reads. Their shapes
  stay [*, T], so the train step's programs differ only in the row count. The rows are
  gathered where the batch is (device arrays in, device arrays out: no implicit transfer).
  """
  keep = np.asarray(keep, bool)
  n, k = keep.size, int(keep.sum())
  if multiple < 1:
    raise ValueError(f"multiple must be >= 1, got {multiple}")
  size = 1 << max(max(k, min_rows) - 1, 0).bit_length()
  size = max(size, multiple)
  size = -(-size // multiple) * multiple
  if size >= n:
    return None
  rows = np.concatenate([np.flatnonzero(keep), np.flatnonzero(~keep)[: size - k]]).astype(np.int32)
  out = take_rows(batch, put_like(rows, batch.tokens))
  return _zero_after(out, put_like(np.arange(size) < k, batch.tokens))
