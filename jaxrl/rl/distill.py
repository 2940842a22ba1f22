"""On-policy distillation: the student samples, a teacher scores, per-token KL losses, ADWIN window.

The teacher runs outside the train step (like the reference model), on the same mesh, and its
scores travel in the batch: the log-prob of every sampled token and its top-k next-token
distribution. Two per-token objectives (Agarwal et al. 2024, "On-Policy Distillation of Language
Models", GKD, arXiv 2306.13649):
- reverse KL, KL(pi_s || pi_t), estimated on the student's own samples: its score-function
  gradient is sg(log pi_s(y_t) - log pi_t(y_t)) * grad log pi_s(y_t) (mode seeking);
- forward KL on the teacher's top-k, sum_k p_t(k) (log p_t(k) - log pi_s(k)), teacher renormalised
  over its top-k (mass covering; exact when k = V).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.models.transformer import apply, positions_from_mask
from jaxrl.rl.losses import aggregate

DISTILL_LOSSES = ("reverse_kl", "forward_kl_topk", "mixed")


class DistillBatch(NamedTuple):
  """[B, T] token columns as in `TrainBatch`; K = teacher top-k."""

  tokens: jax.Array  # int32
  valid: jax.Array  # bool
  loss_mask: jax.Array  # float32: completion tokens the loss covers (after any prefix window)
  old_logprobs: jax.Array  # float32 student (behaviour) log-probs of the sampled tokens
  teacher_logprobs: jax.Array  # float32 teacher log-probs of the sampled tokens
  teacher_topk_ids: jax.Array  # [B, T, K] int32 teacher's most likely next tokens
  teacher_topk_logprobs: jax.Array  # [B, T, K] float32 their teacher log-probs

  @property
  def size(self) -> int:
    return self.tokens.shape[0]


def _logp_all(graphdef, params, tokens, valid, temperature: float, vocab_size=None):
  """log softmax of the predictive distribution for every column: [B, T, V] (column 0 unused).
  vocab_size keeps the first V logits (a teacher whose checkpoint pads its vocabulary)."""
  logits, _ = apply(graphdef, params, tokens, positions_from_mask(valid), valid)
  if vocab_size is not None:
    logits = logits[..., :vocab_size]
  logp = jax.nn.log_softmax(logits[:, :-1] / temperature, axis=-1)
  return jnp.pad(logp, ((0, 0), (1, 0), (0, 0)))


def teacher_scores(
  graphdef, params, tokens, valid, *, top_k: int, temperature: float = 1.0, vocab_size=None
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Teacher log-probs of the sampled tokens [B, T] and its top-k ids / log-probs [B, T, K],
  over the first `vocab_size` ids (the student's vocabulary; None: all)."""
  logp = _logp_all(graphdef, params, tokens, valid, temperature, vocab_size)
  sampled = jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]
  # Column j predicts tokens[:, j]: it is scored by the distribution computed at j - 1, which
  # `_logp_all` already shifted into column j.
  top_logp, top_ids = jax.lax.top_k(logp, top_k)
  return sampled, top_ids.astype(jnp.int32), top_logp


def reverse_kl_sampled(logp, teacher_logp) -> jax.Array:
  """Per-token surrogate whose gradient estimates grad KL(pi_s || pi_t) on student samples.

  loss = sg(logp - teacher_logp) * logp. Returns (surrogate, k1 estimate = logp - teacher_logp).
  """
  k1 = logp - teacher_logp
  return jax.lax.stop_gradient(k1) * logp, k1


def forward_kl_topk(logp_all, topk_ids, topk_logp) -> jax.Array:
  """sum_k p_t(k) (log p_t(k) - log pi_s(k)) with p_t renormalised over its top-k. [B, T]."""
  t_logp = topk_logp - jax.nn.logsumexp(topk_logp, axis=-1, keepdims=True)
  s_logp = jnp.take_along_axis(logp_all, topk_ids, axis=-1)
  return jnp.sum(jnp.exp(t_logp) * (t_logp - s_logp), axis=-1)


def prefix_window(loss_mask, window: int | None) -> jax.Array:
  """Keep only the first `window` loss tokens of each row (ADWIN's supervised prefix); None keeps
  every token."""
  if window is None:
    return loss_mask
  m = jnp.asarray(loss_mask, jnp.float32)
  rank = jnp.cumsum(m, axis=-1)  # 1 for the first loss token, 2 for the second, ...
  return m * (rank <= window)


@dataclasses.dataclass(frozen=True)
class DistillLoss:
  """The train-step loss for on-policy distillation (see module docstring).

  loss = "reverse_kl" | "forward_kl_topk" | "mixed" (alpha * reverse + (1 - alpha) * forward).
  """

  graphdef: object
  loss: str = "reverse_kl"
  alpha: float = 0.5
  temperature: float = 1.0
  aggregation: str = "token-mean"
  max_tokens: int | None = None

  def __post_init__(self):
    if self.loss not in DISTILL_LOSSES:
      raise ValueError(f"distill loss {self.loss!r} is unknown; allowed: {list(DISTILL_LOSSES)}")
    if not 0.0 <= self.alpha <= 1.0:
      raise ValueError(f"distill alpha={self.alpha} must be in [0, 1]")

  def denominator(self, batch) -> jax.Array:
    mask = batch.loss_mask
    return aggregate(jnp.zeros_like(mask), mask, self.aggregation, max_tokens=self.max_tokens)[1]

  def __call__(self, params, batch):
    logp_all = _logp_all(self.graphdef, params, batch.tokens, batch.valid, self.temperature)
    logp = jnp.take_along_axis(logp_all, batch.tokens[..., None], axis=-1)[..., 0]
    mask = batch.loss_mask
    n = jnp.sum(mask)
    rev, k1 = reverse_kl_sampled(logp, batch.teacher_logprobs)
    fwd = forward_kl_topk(logp_all, batch.teacher_topk_ids, batch.teacher_topk_logprobs)
    if self.loss == "reverse_kl":
      per_token = rev
    elif self.loss == "forward_kl_topk":
      per_token = fwd
    else:
      per_token = self.alpha * rev + (1.0 - self.alpha) * fwd
    total, denom = aggregate(per_token, mask, self.aggregation, max_tokens=self.max_tokens)
    metrics = {
      "distill/loss": (total, denom),
      "distill/reverse_kl": (jnp.sum(jnp.where(mask > 0, k1, 0.0)), n),
      "distill/forward_kl_topk": (jnp.sum(jnp.where(mask > 0, fwd, 0.0)), n),
      "distill/logprob_gap": (jnp.sum(jnp.abs(logp - batch.old_logprobs) * mask), n),
    }
    return total, metrics


def grad_alignment(g_prefix, g_full) -> jax.Array:
  """Cosine similarity of two gradient pytrees (ADWIN's prefix-vs-full probe), float32."""
  a = jnp.concatenate([x.astype(jnp.float32).ravel() for x in jax.tree.leaves(g_prefix)])
  b = jnp.concatenate([x.astype(jnp.float32).ravel() for x in jax.tree.leaves(g_full)])
  return jnp.vdot(a, b) / jnp.maximum(jnp.linalg.norm(a) * jnp.linalg.norm(b), 1e-30)


def prefix_alignment(loss: DistillLoss, params, batch: DistillBatch, window) -> jax.Array:
  """ADWIN's probe: the cosine between the gradient of `loss` on each row's first `window`
  loss tokens and on the whole rollout (batch.loss_mask), each normalised by its own
  denominator. `window` may be traced, so one compiled probe serves every window."""

  def grad_on(mask):
    b = batch._replace(loss_mask=mask)
    return jax.grad(lambda p: loss(p, b)[0] / jnp.maximum(loss.denominator(b), 1.0))(params)

  return grad_alignment(grad_on(prefix_window(batch.loss_mask, window)), grad_on(batch.loss_mask))


@dataclasses.dataclass
class AdaptiveWindow:
  """ADWIN's adaptive supervision horizon for on-policy distillation, as a host-side controller.

  Training steps supervise only the first `window` completion tokens; every `probe_every` steps
  a full-rollout probe measures how well the prefix gradient points along the full-rollout
  gradient (`grad_alignment`). The abstract gives the mechanism, not the rule, so the rule here
  is ours: alignment below `low` doubles the window (the prefix no longer carries the update
  direction), above `high` halves it (cheaper prefixes suffice), within [min_window,
  max_window]. `state_dict`/`load_state_dict` make it part of a checkpoint.
  """

  window: int
  min_window: int = 1
  max_window: int = 1 << 30
  probe_every: int = 10
  low: float = 0.8
  high: float = 0.95

  def __post_init__(self):
    if not 1 <= self.min_window <= self.window <= self.max_window:
      raise ValueError(
        f"adaptive window needs 1 <= min_window ({self.min_window}) <= window ({self.window}) "
        f"<= max_window ({self.max_window})"
      )
    if self.probe_every < 1:
      raise ValueError(f"adaptive window probe_every={self.probe_every} must be >= 1")
    if not -1.0 <= self.low < self.high <= 1.0:
      raise ValueError(f"adaptive window needs -1 <= low < high <= 1, got {self.low}, {self.high}")

  def is_probe(self, step: int) -> bool:
    return step % self.probe_every == 0

  def update(self, alignment: float) -> int:
    alignment = float(np.asarray(alignment))
    if alignment < self.low:
      self.window = min(self.window * 2, self.max_window)
    elif alignment > self.high:
      self.window = max(self.window // 2, self.min_window)
    return self.window

  def state_dict(self) -> dict:
    return {"window": self.window}

  def load_state_dict(self, state: dict) -> None:
    self.window = int(state["window"])
