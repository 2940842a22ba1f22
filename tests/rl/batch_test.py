"""TrainBatch construction: from_rollout and supervised column layout, masks and errors."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.rl.batch import TrainBatch, compact_rows, from_rollout, gradient_rows, supervised
from jaxrl.rollout.types import LENGTH, STOP, Rollout

F, T_ = False, True


def _rollout(versions=((7, 7, 7, -1), (7, 7, 7, 7))):
  # B = 2, P = 3 (left-padded prompts), N = 4 (EOS = 2, pad = 0 after it).
  return Rollout(
    prompt_tokens=jnp.array([[0, 5, 6], [7, 8, 9]], jnp.int32),
    prompt_mask=jnp.array([[F, T_, T_], [T_, T_, T_]]),
    tokens=jnp.array([[11, 12, 2, 0], [13, 14, 15, 16]], jnp.int32),
    mask=jnp.array([[T_, T_, T_, F], [T_, T_, T_, T_]]),
    logprobs=jnp.array([[-0.5, -1.0, -1.5, 0.0], [-0.1, -0.2, -0.3, -0.4]], jnp.float32),
    versions=jnp.array(versions, jnp.int32),
    lengths=jnp.array([3, 4], jnp.int32),
    truncated=jnp.array([F, T_]),
    finish_reason=jnp.array([STOP, LENGTH], jnp.int32),
  )


def test_from_rollout_layout():
  batch = from_rollout(_rollout(), np.array([1.5, -0.5]))
  assert isinstance(batch, TrainBatch) and batch.size == 2
  np.testing.assert_array_equal(batch.tokens, [[0, 5, 6, 11, 12, 2, 0], [7, 8, 9, 13, 14, 15, 16]])
  np.testing.assert_array_equal(
    batch.valid, [[F, T_, T_, T_, T_, T_, F], [T_, T_, T_, T_, T_, T_, T_]]
  )
  # The loss covers completion tokens only (EOS included, padding after it excluded).
  np.testing.assert_array_equal(batch.loss_mask, [[0, 0, 0, 1, 1, 1, 0], [0, 0, 0, 1, 1, 1, 1]])
  assert batch.loss_mask.dtype == jnp.float32
  np.testing.assert_array_equal(
    batch.advantages, [[0, 0, 0, 1.5, 1.5, 1.5, 0], [0, 0, 0, -0.5, -0.5, -0.5, -0.5]]
  )
  old = np.array([[0, 0, 0, -0.5, -1.0, -1.5, 0], [0, 0, 0, -0.1, -0.2, -0.3, -0.4]], np.float32)
  np.testing.assert_array_equal(batch.old_logprobs, old)
  assert batch.ref_logprobs.shape == (2, 7) and np.all(np.asarray(batch.ref_logprobs) == 0)
  np.testing.assert_array_equal(
    batch.versions, [[-1, -1, -1, 7, 7, 7, -1], [-1, -1, -1, 7, 7, 7, 7]]
  )
  assert batch.versions.dtype == jnp.int32
  for x in (batch.advantages, batch.old_logprobs, batch.ref_logprobs):
    assert x.dtype == jnp.float32


def test_from_rollout_masks_reference_logprobs():
  ref = jnp.full((2, 7), -2.0, jnp.float32)
  batch = from_rollout(_rollout(), np.zeros(2), ref_logprobs=ref)
  np.testing.assert_array_equal(batch.ref_logprobs, -2.0 * np.asarray(batch.loss_mask))


def test_from_rollout_keeps_per_token_versions():
  # Row 1 was continued across an update: its first two tokens are from version 3, the rest 4.
  # A version on a masked-out column (row 0's padding) must not leak into the batch.
  batch = from_rollout(_rollout(versions=((4, 4, 4, 9), (3, 3, 4, 4))), np.zeros(2))
  np.testing.assert_array_equal(
    batch.versions, [[-1, -1, -1, 4, 4, 4, -1], [-1, -1, -1, 3, 3, 4, 4]]
  )
  lag = batch._replace(learner_version=jnp.array([5, 5], jnp.int32)).lag()
  np.testing.assert_array_equal(lag, [[0, 0, 0, 1, 1, 1, 0], [0, 0, 0, 2, 2, 1, 1]])


def test_supervised_layout():
  batch = supervised(
    np.array([[0, 5, 6], [7, 8, 9]], np.int32),
    np.array([[F, T_, T_], [T_, T_, T_]]),
    [[10, 11, 2], [12, 2]],
    max_new_tokens=4,
    pad_id=0,
  )
  assert batch.size == 2
  np.testing.assert_array_equal(batch.tokens, [[0, 5, 6, 10, 11, 2, 0], [7, 8, 9, 12, 2, 0, 0]])
  np.testing.assert_array_equal(
    batch.valid, [[F, T_, T_, T_, T_, T_, F], [T_, T_, T_, T_, T_, F, F]]
  )
  np.testing.assert_array_equal(batch.loss_mask, [[0, 0, 0, 1, 1, 1, 0], [0, 0, 0, 1, 1, 0, 0]])
  assert batch.tokens.dtype == np.int32 and batch.loss_mask.dtype == np.float32
  for x in (batch.advantages, batch.old_logprobs, batch.ref_logprobs):
    assert x.shape == (2, 7) and x.dtype == np.float32 and np.all(x == 0)
  np.testing.assert_array_equal(batch.versions, np.full((2, 7), -1))


def test_supervised_exact_fit_and_too_long_completion():
  prompt, pmask = np.array([[1, 2]], np.int32), np.array([[T_, T_]])
  kw = dict(max_new_tokens=3, pad_id=0)
  batch = supervised(prompt, pmask, [[3, 4, 2]], **kw)
  np.testing.assert_array_equal(batch.loss_mask, [[0, 0, 1, 1, 1]])
  with pytest.raises(ValueError, match=r"completion 1 has 4 tokens > max_new_tokens=3"):
    supervised(prompt.repeat(2, 0), pmask.repeat(2, 0), [[3], [3, 4, 5, 2]], **kw)


def _rows_batch(b=6, t=3):
  # Row i's tokens are all i, so a compacted batch shows which rows it took.
  tokens = jnp.repeat(jnp.arange(b, dtype=jnp.int32)[:, None], t, axis=1)
  mask = jnp.ones((b, t), jnp.float32).at[:, 0].set(0.0)  # column 0 is the prompt
  adv = jnp.array([0.0, 0.5, 0.0, 0.0, -1.0, 0.0], jnp.float32)[:, None] * mask
  zeros = jnp.zeros((b, t), jnp.float32)
  return TrainBatch(tokens, mask > 0, mask, adv, zeros, zeros, jnp.zeros((b, t), jnp.int32))


def test_gradient_rows_reads_advantages_on_loss_tokens_only():
  batch = _rows_batch()
  np.testing.assert_array_equal(gradient_rows(batch), [F, T_, F, F, T_, F])
  # An advantage on a prompt column (loss mask 0) does not make a row live.
  batch = batch._replace(advantages=batch.advantages.at[0, 0].set(2.0))
  np.testing.assert_array_equal(gradient_rows(batch), [F, T_, F, F, T_, F])


def test_compact_rows_keeps_live_rows_then_masked_padding():
  batch = _rows_batch()
  small = compact_rows(batch, gradient_rows(batch))
  assert small.size == 2
  np.testing.assert_array_equal(small.tokens[:, 0], [1, 4])
  # multiple=4: the 2 live rows, then 2 padding rows (the first dead ones) that the loss skips.
  small = compact_rows(batch, gradient_rows(batch), multiple=4)
  np.testing.assert_array_equal(small.tokens[:, 0], [1, 4, 0, 2])
  np.testing.assert_array_equal(small.loss_mask.sum(1), [2, 2, 0, 0])
  np.testing.assert_array_equal(small.advantages[:, 1], [0.5, -1.0, 0.0, 0.0])
  # 3 live rows pad to 4; none live still gives `multiple` rows (the optimizer must still step).
  keep = np.array([T_, T_, T_, F, F, F])
  np.testing.assert_array_equal(compact_rows(batch, keep).tokens[:, 0], [0, 1, 2, 3])
  assert compact_rows(batch, np.zeros(6, bool), multiple=2).size == 2
  assert compact_rows(batch, gradient_rows(batch), min_rows=3).size == 4
  # Not fewer rows than the batch: nothing to gain.
  assert compact_rows(batch, np.array([T_, T_, T_, T_, T_, F])) is None
  assert compact_rows(batch, gradient_rows(batch), multiple=6) is None
  with pytest.raises(ValueError, match="multiple must be >= 1"):
    compact_rows(batch, keep, multiple=0)
