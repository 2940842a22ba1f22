"""DAPO overlong shaping: hand values of the soft punishment and truncation masking."""

import numpy as np
import pytest

from jaxrl.rl.shaping import overlong_penalty, truncation_keep


def test_soft_overlong_punishment_hand_values():
  # L_max = 10, L_cache = 4: free up to 6, then -1/4 per token, -1 at 10 and beyond.
  got = overlong_penalty([1, 6, 7, 8, 10, 12], max_len=10, buffer=4)
  np.testing.assert_allclose(got, [0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
  got = overlong_penalty([7, 10], max_len=10, buffer=4, penalty=0.5)
  np.testing.assert_allclose(got, [-0.125, -0.5])
  assert got.dtype == np.float32


def test_zero_buffer_is_off_and_bad_buffer_is_an_error():
  np.testing.assert_array_equal(overlong_penalty([3, 10], max_len=10, buffer=0), [0.0, 0.0])
  with pytest.raises(ValueError, match=r"overlong buffer must be in \[0, max_len=10\], got 11"):
    overlong_penalty([3], max_len=10, buffer=11)


def test_truncated_completions_are_masked():
  np.testing.assert_array_equal(truncation_keep([True, False, True]), [0.0, 1.0, 0.0])
