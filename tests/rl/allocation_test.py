"""Dynamic-sampling pieces: which groups are informative and how the batch is filled."""

import numpy as np
import pytest

from jaxrl.rl.allocation import fill_groups, informative_groups


def test_informative_groups_are_those_whose_rewards_differ():
  r = np.array([[1, 1, 1], [0, 1, 0], [0, 0, 0], [0.1, 0.1, 0.1 + 1e-9]])
  np.testing.assert_array_equal(informative_groups(r), [False, True, False, True])
  with pytest.raises(ValueError, match=r"rewards must be \[num_groups, G\]"):
    informative_groups(np.zeros(4))


def test_fill_takes_informative_groups_first_in_order():
  informative = np.array([False, True, False, True, True, False])
  idx, filler = fill_groups(informative, 2)
  np.testing.assert_array_equal(idx, [1, 3])
  assert not filler.any()


def test_fill_pads_with_the_earliest_dropped_groups_when_short():
  informative = np.array([False, True, False, False])
  idx, filler = fill_groups(informative, 3)
  np.testing.assert_array_equal(idx, [1, 0, 2])
  np.testing.assert_array_equal(filler, [False, True, True])
  with pytest.raises(ValueError, match="need 5 groups, only 4 were sampled"):
    fill_groups(informative, 5)
