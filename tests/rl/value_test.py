"""GAE and the clipped value loss: hand values, a numpy reference, and invariants."""

import numpy as np
import pytest

from jaxrl.rl.value import gae, terminal_rewards, value_loss


def _gae_numpy(rewards, values, mask, gamma, lam):
  b, t = rewards.shape
  adv = np.zeros((b, t))
  for i in range(b):
    cols = [j for j in range(t) if mask[i, j]]
    nxt_v, nxt_a = 0.0, 0.0
    for j in reversed(cols):
      delta = rewards[i, j] + gamma * nxt_v - values[i, j]
      nxt_a = delta + gamma * lam * nxt_a
      nxt_v = values[i, j]
      adv[i, j] = nxt_a
  return adv, (adv + values) * mask


def test_gae_hand_values():
  r = np.array([[0.0, 0.0, 1.0]])
  v = np.array([[0.5, 0.6, 0.7]])
  m = np.ones((1, 3))
  adv, ret = gae(r, v, m, gamma=1.0, lam=1.0)  # Monte Carlo: A_t = R - V_t
  np.testing.assert_allclose(adv, [[0.5, 0.4, 0.3]], atol=1e-6)
  np.testing.assert_allclose(ret, [[1.0, 1.0, 1.0]], atol=1e-6)
  adv, _ = gae(r, v, m, gamma=1.0, lam=0.0)  # one-step TD errors
  np.testing.assert_allclose(adv, [[0.1, 0.1, 0.3]], atol=1e-6)
  adv, _ = gae(r, v, m, gamma=0.5, lam=0.5)
  # delta = [0.3 - 0.5, 0.35 - 0.6, 1 - 0.7] = [-0.2, -0.25, 0.3]; A2 = 0.3,
  # A1 = -0.25 + 0.25 * 0.3 = -0.175, A0 = -0.2 + 0.25 * -0.175 = -0.24375
  np.testing.assert_allclose(adv, [[-0.24375, -0.175, 0.3]], atol=1e-6)


def test_gae_matches_numpy_with_ragged_masks():
  rng = np.random.default_rng(0)
  b, t = 5, 11
  r, v = rng.normal(size=(b, t)), rng.normal(size=(b, t))
  m = np.zeros((b, t))
  for i, (start, n) in enumerate([(3, 8), (5, 2), (0, 11), (4, 0), (7, 1)]):
    m[i, start : start + n] = 1
  m[2, 6] = 0  # a hole in the middle is skipped, not a zero-reward step
  for gamma, lam in [(1.0, 0.95), (0.9, 0.8), (1.0, 1.0)]:
    adv, ret = gae(r, v, m, gamma=gamma, lam=lam)
    ref_adv, ref_ret = _gae_numpy(r, v, m, gamma, lam)
    np.testing.assert_allclose(adv, ref_adv, atol=1e-5)
    np.testing.assert_allclose(ret, ref_ret, atol=1e-5)


def test_gae_ignores_prompt_and_padding_columns():
  r = np.array([[0.0, 0.0, 0.0, 1.0]])
  v = np.array([[9.0, 0.2, 0.4, 0.6]])  # column 0 is prompt: its value must not matter
  m = np.array([[0.0, 1.0, 1.0, 1.0]])
  shifted, _ = gae(r[:, 1:], v[:, 1:], m[:, 1:], gamma=0.9, lam=0.7)
  full, _ = gae(r, v, m, gamma=0.9, lam=0.7)
  np.testing.assert_allclose(full[:, 1:], shifted, atol=1e-6)
  assert full[0, 0] == 0.0


def test_terminal_rewards_on_last_loss_token():
  m = np.array([[0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]], np.float32)
  out = np.asarray(terminal_rewards(np.array([2.0, -1.0, 5.0]), m))
  np.testing.assert_array_equal(out, [[0, 0, 2, 0], [0, 0, 0, -1], [0, 0, 0, 0]])


def test_value_loss_clipping():
  v = np.array([[1.0, 0.0, 0.5]])
  old = np.array([[0.0, 0.0, 0.4]])
  ret = np.array([[0.0, 1.0, 1.0]])
  m = np.ones((1, 3))
  loss, clipped = value_loss(v, old, ret, m, clip=0.2)
  # token 0: err 1, clipped value 0.2 -> err 0.04, max 1 -> 0.5; not clipped-active
  # token 1: v == old, both errors 1 -> 0.5; token 2: within the clip, both errors 0.25 -> 0.125
  np.testing.assert_allclose(loss, [[0.5, 0.5, 0.125]], atol=1e-6)
  assert not np.any(clipped)
  # Moving the wrong way beyond the clip: the clipped branch is the larger one.
  loss, clipped = value_loss(
    np.array([[0.9]]), np.array([[0.0]]), np.array([[1.0]]), np.ones((1, 1))
  )
  np.testing.assert_allclose(loss, [[0.5 * 0.8**2]], atol=1e-6)
  assert clipped[0, 0]
  plain, _ = value_loss(v, old, ret, m, clip=None)
  np.testing.assert_allclose(plain, 0.5 * (v - ret) ** 2, atol=1e-6)
  with pytest.raises(ValueError, match="clip"):
    value_loss(v, old, ret, m, clip=0.0)


def test_gae_rejects_bad_coefficients():
  with pytest.raises(ValueError, match="gamma"):
    gae(np.zeros((1, 2)), np.zeros((1, 2)), np.ones((1, 2)), gamma=1.5)
