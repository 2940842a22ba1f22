"""The distillation teacher in the RL loop: loaded onto the student's mesh, scoring rollouts,
and the supervised-prefix window (fixed, or moved by ADWIN probes) applied to each update."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.config import DistillConfig
from jaxrl.rl.distill import (
  AdaptiveWindow,
  DistillBatch,
  DistillLoss,
  prefix_alignment,
  prefix_window,
  teacher_scores,
)


class Teacher:
  """config.distill made concrete: the teacher model and its jitted scorer, the student's
  DistillLoss, and the window controller.

  `score(batch)` turns the loop's TrainBatch into a DistillBatch (teacher log-probs of the
  sampled tokens and its top-k); `window(step, params, batch)` narrows the batch's loss mask to
  each row's supervised prefix, first running ADWIN's alignment probe on probe steps.
  """

  def __init__(self, d: DistillConfig, model, student_cfg, student_graphdef, *, sampling,
               aggregation: str, max_new_tokens: int):  # fmt: skip
    """`model` = (ModelConfig, graphdef, params on the student's mesh) of the teacher
    (jaxrl.rl.components.build_teacher makes it from config.distill.teacher)."""
    self.cfg = d
    self.model_cfg, graphdef, self.params = model
    self.graphdef = graphdef
    temperature = sampling.logprob_temperature
    vocab = student_cfg.vocab_size
    self._score = jax.jit(
      lambda p, t, v: teacher_scores(
        graphdef, p, t, v, top_k=d.top_k, temperature=temperature, vocab_size=vocab
      )
    )
    self.loss = DistillLoss(
      student_graphdef,
      loss=d.loss,
      alpha=d.alpha,
      temperature=temperature,
      aggregation=aggregation,
      max_tokens=max_new_tokens,
    )
    self.controller = None
    if d.adaptive:
      self.controller = AdaptiveWindow(
        d.window,
        max_window=max_new_tokens,
        probe_every=d.probe_every,
        low=d.align_low,
        high=d.align_high,
      )
      self._probe = jax.jit(lambda p, b, w: prefix_alignment(self.loss, p, b, w))

  def score(self, batch, sharded) -> tuple[DistillBatch, dict[str, jax.Array]]:
    """(DistillBatch, stats as device scalars): the teacher's scores of the rollout in one
    jitted forward. `sharded` = (tokens, valid) already placed on the mesh."""
    t_logp, top_ids, top_logp = self._score(self.params, *sharded)
    mask = batch.loss_mask
    stats = _score_stats(t_logp, batch.old_logprobs, mask)
    out = DistillBatch(
      batch.tokens, batch.valid, mask, batch.old_logprobs, t_logp * mask, top_ids, top_logp
    )
    return out, stats

  def window(self, step: int, params, batch, shard) -> tuple[object, dict[str, float]]:
    """The batch with only each row's supervised prefix in the loss. With ADWIN, on probe steps
    the prefix and full-rollout gradients are compared first (at `params`, before this step's
    updates) and the controller moves the window. `shard` places a batch on the mesh."""
    stats = {}
    size = self.cfg.window or None
    if self.controller is not None:
      ctl = self.controller
      if ctl.is_probe(step):
        align = self._probe(params, shard(batch), jnp.int32(ctl.window))
        stats["distill/alignment"] = float(align)
        ctl.update(align)
      size = ctl.window
    if size is not None:
      batch = batch._replace(loss_mask=prefix_window(batch.loss_mask, size))
      stats["distill/window"] = float(size)
    return batch, stats

  def state_dict(self) -> dict:
    return {} if self.controller is None else {"window": self.controller.window}

  def load_state_dict(self, state: dict) -> None:
    # A checkpoint written without ADWIN (or before distillation was enabled) keeps the
    # configured starting window.
    if self.controller is not None and state:
      self.controller.load_state_dict(state)


@jax.jit
def _score_stats(t_logp, old_logprobs, mask) -> dict:
  """The teacher's mean log-prob of the sampled tokens and the k1 estimate of
  KL(student || teacher) over the loss tokens, in one program (no op-by-op collectives)."""
  n = jnp.maximum(jnp.sum(mask), 1.0)
  return {
    "distill/teacher_logprob": jnp.sum(t_logp * mask) / n,
    "distill/reverse_kl_rollout": jnp.sum((old_logprobs - t_logp) * mask) / n,
  }
