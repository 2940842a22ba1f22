"""Unbiased pass@k (Chen et al., 2021) against hand-computed values and the binomial formula."""

import math

import numpy as np
import pytest

from jaxrl.rl.evaluation import pass_at_k, pass_at_ks


@pytest.mark.parametrize(
  "n, c, k, expected",
  [
    (5, 2, 1, 0.4),  # c / n
    (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    (10, 3, 5, 1 - 21 / 252),  # 1 - C(7,5)/C(10,5)
    (4, 0, 4, 0.0),
    (4, 4, 1, 1.0),
    (6, 3, 4, 1.0),  # fewer wrong samples than k: some drawn k always holds a right one
  ],
)
def test_by_hand(n, c, k, expected):
  assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_equals_the_binomial_formula():
  for n in range(1, 13):
    for c in range(n + 1):
      for k in range(1, n + 1):
        exact = 1 - math.comb(n - c, k) / math.comb(n, k)
        assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12), (n, c, k)


def test_means_over_problems_at_powers_of_two_and_n():
  correct = np.array([[1, 0, 0, 0, 0, 1], [0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]], bool)
  got = pass_at_ks(correct)
  assert sorted(got) == [1, 2, 4, 6]
  assert got[1] == pytest.approx((2 / 6 + 0 + 1) / 3)
  assert got[6] == pytest.approx((1 + 0 + 1) / 3)


@pytest.mark.parametrize("n, c, k", [(4, 5, 1), (4, 1, 0), (4, 1, 5), (4, -1, 1)])
def test_bad_counts_are_named(n, c, k):
  with pytest.raises(ValueError, match=r"pass@k needs 0 <= c <= n and 1 <= k <= n"):
    pass_at_k(n, c, k)
