"""Sampling tests: top-k / top-p against a numpy reference, draw statistics, behaviour logprobs."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.rollout.sampling import (
  RowSampling,
  SamplingParams,
  filter_logits,
  filter_logits_rows,
  sample_rows,
  sample_tokens,
)

_NEG_INF = float(jnp.finfo(jnp.float32).min)

# Chi-square critical values at significance 1e-4, by degrees of freedom (from tables). A correct
# sampler fails one check with probability 1e-4 per seed; a wrong distribution (untempered,
# unfiltered, filtered but not renormalised) gives a statistic in the hundreds at 20k draws.
_CHI2_CRIT = {1: 15.137, 2: 18.421, 3: 21.108, 4: 23.513}


def _log_softmax64(x):
  x = np.asarray(x, np.float64)
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _ref_keep(logits, top_k: int, top_p: float):
  """Which entries survive top-k then top-p (on the renormalised top-k set), in float64.

  Also asserts that no cumulative mass sits within 1e-4 of top_p, so that the expected set does
  not hinge on float32 rounding (the test data is fixed; a failure here means pick other data).
  """
  x = np.asarray(logits, np.float64)
  keep = np.ones(x.shape, bool)
  for b in range(x.shape[0]):
    order = np.argsort(-x[b], kind="stable")
    if 0 < top_k < x.shape[1]:
      keep[b, order[top_k:]] = False
    if top_p < 1.0:
      kept = order[keep[b, order]]  # surviving ids, most probable first
      probs = np.exp(x[b, kept] - x[b, kept].max())
      cum = np.cumsum(probs / probs.sum())
      assert np.min(np.abs(cum[:-1] - top_p)) > 1e-4, "test data too close to the top_p edge"
      n = min(int(np.searchsorted(cum, top_p)) + 1, len(kept))  # smallest prefix reaching p
      keep[b, kept[n:]] = False
  return keep


@pytest.mark.parametrize(
  "top_k, top_p",
  [(0, 1.0), (1, 1.0), (5, 1.0), (36, 1.0), (37, 1.0), (0, 0.9), (0, 0.5), (0, 1e-6), (10, 0.8)],
)
def test_filter_logits_matches_numpy_reference(top_k, top_p):
  logits = (2.0 * np.random.default_rng(1).normal(size=(64, 37))).astype(np.float32)
  out = np.asarray(filter_logits(jnp.asarray(logits), top_k, top_p))
  keep = out != _NEG_INF
  np.testing.assert_array_equal(keep, _ref_keep(logits, top_k, top_p))
  np.testing.assert_array_equal(out[keep], logits[keep])  # survivors are untouched
  if top_k:
    assert np.all(keep.sum(-1) <= top_k)
  assert np.all(keep.sum(-1) >= 1)


@pytest.mark.parametrize(
  "top_k, top_p, expected",
  [
    (0, 0.3, [0]),  # the top token alone already exceeds p
    (0, 1e-9, [0]),  # always at least one token
    (0, 0.79, [0, 1]),
    (0, 0.81, [0, 1, 2]),
    (2, 1.0, [0, 1]),
    (2, 0.99, [0, 1]),
    # Top-p runs on the renormalised top-3 set (0.526, 0.316, 0.158): 0.842 reaches 0.83 after
    # two tokens. On the raw probabilities (0.5, 0.8, 0.95) it would take three.
    (3, 0.83, [0, 1]),
  ],
)
def test_filter_logits_by_hand(top_k, top_p, expected):
  logits = np.log(np.array([[0.15, 0.5, 0.05, 0.3]], np.float32))  # order by prob: 1, 3, 0, 2
  rank_to_id = np.array([1, 3, 0, 2])
  out = np.asarray(filter_logits(jnp.asarray(logits), top_k, top_p))
  assert sorted(np.flatnonzero(out[0] != _NEG_INF)) == sorted(rank_to_id[expected])


def test_greedy_is_argmax_with_untempered_logprob():
  logits = np.random.default_rng(1).normal(size=(64, 37)).astype(np.float32)
  keys = jax.random.split(jax.random.key(0), 64)
  # Filters are ignored by greedy decoding; the reported logprob is under softmax(logits).
  params = SamplingParams(temperature=0.0, top_k=3, top_p=0.5)
  tokens, logp = sample_tokens(jnp.asarray(logits), keys, params)
  np.testing.assert_array_equal(np.asarray(tokens), logits.argmax(-1))
  expect = _log_softmax64(logits)[np.arange(64), logits.argmax(-1)]
  np.testing.assert_allclose(np.asarray(logp), expect, atol=1e-5, rtol=0)


def test_top_k_1_always_draws_the_argmax():
  logits = np.random.default_rng(2).normal(size=(64, 37)).astype(np.float32)
  keys = jax.random.split(jax.random.key(1), 64)
  tokens, _ = sample_tokens(jnp.asarray(logits), keys, SamplingParams(temperature=1.3, top_k=1))
  np.testing.assert_array_equal(np.asarray(tokens), logits.argmax(-1))


@pytest.mark.parametrize(
  "params",
  [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=5, top_p=0.9),
    SamplingParams(temperature=1.5, top_p=0.6),
  ],
)
def test_logprob_is_full_tempered_distribution(params):
  logits = (2.0 * np.random.default_rng(3).normal(size=(64, 37))).astype(np.float32)
  keys = jax.random.split(jax.random.key(2), 64)
  tokens, logp = sample_tokens(jnp.asarray(logits), keys, params)
  tokens = np.asarray(tokens)
  expect = _log_softmax64(logits / params.temperature)[np.arange(64), tokens]
  np.testing.assert_allclose(np.asarray(logp), expect, atol=1e-5, rtol=0)
  # Every draw comes from the filtered set, computed on the tempered logits.
  keep = _ref_keep(logits / params.temperature, params.top_k, params.top_p)
  assert np.all(keep[np.arange(64), tokens])


_PROBS = np.array([0.4, 0.25, 0.2, 0.1, 0.05])


@pytest.mark.parametrize(
  "params",
  [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.5),
    SamplingParams(temperature=1.0, top_k=3),
    SamplingParams(temperature=1.0, top_p=0.6),
    SamplingParams(temperature=2.0, top_k=4, top_p=0.8),
  ],
)
def test_draws_follow_the_filtered_tempered_distribution(params):
  n = 20_000
  logits = jnp.broadcast_to(jnp.log(jnp.asarray(_PROBS, jnp.float32)), (n, 5))
  keys = jax.random.split(jax.random.key(42), n)
  tokens, _ = sample_tokens(logits, keys, params)
  counts = np.bincount(np.asarray(tokens), minlength=5)

  tempered = np.exp(_log_softmax64(np.log(_PROBS) / params.temperature))
  keep = _ref_keep(np.log(_PROBS)[None] / params.temperature, params.top_k, params.top_p)[0]
  expected = np.where(keep, tempered, 0.0) / tempered[keep].sum()
  assert np.all(counts[~keep] == 0), counts
  chi2 = np.sum((counts[keep] - n * expected[keep]) ** 2 / (n * expected[keep]))
  assert chi2 < _CHI2_CRIT[int(keep.sum()) - 1], (chi2, counts, n * expected)


def test_each_row_depends_only_on_its_own_key_and_logits():
  logits = np.random.default_rng(4).normal(size=(64, 37)).astype(np.float32)
  keys = jax.random.split(jax.random.key(3), 64)
  params = SamplingParams(temperature=1.0, top_k=20)
  full, full_lp = sample_tokens(jnp.asarray(logits), keys, params)
  rows = np.random.default_rng(5).permutation(64)  # every row moves to another position
  sub, sub_lp = sample_tokens(jnp.asarray(logits[rows]), keys[rows], params)
  np.testing.assert_array_equal(np.asarray(sub), np.asarray(full)[rows])
  np.testing.assert_allclose(np.asarray(sub_lp), np.asarray(full_lp)[rows], atol=1e-6)
  # Same logits, different keys: the draws are not all the same (keys are really used).
  again, _ = sample_tokens(jnp.asarray(logits), jax.random.split(jax.random.key(4), 64), params)
  assert np.any(np.asarray(again) != np.asarray(full))


@pytest.mark.parametrize(
  "kw, field",
  [
    (dict(temperature=-0.1), "temperature"),
    (dict(top_k=-1), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(min_p=-0.1), "min_p"),
    (dict(min_p=1.5), "min_p"),
  ],
)
def test_bad_sampling_params_name_field(kw, field):
  with pytest.raises(ValueError, match=field):
    SamplingParams(**kw)


def test_logprob_temperature():
  assert SamplingParams(temperature=0.0).logprob_temperature == 1.0
  assert SamplingParams(temperature=0.7).logprob_temperature == 0.7


@pytest.mark.parametrize(
  "min_p, expected", [(0.35, [0, 1]), (0.7, [0]), (0.2, [0, 1, 2]), (0.0, [0, 1, 2, 3])]
)
def test_min_p_by_hand(min_p, expected):
  # Keep p >= min_p * p_max: with p_max = 0.5 the floor is min_p / 2.
  logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]], np.float32))
  out = np.asarray(filter_logits(jnp.asarray(logits), 0, 1.0, min_p))
  assert list(np.flatnonzero(out[0] != _NEG_INF)) == expected


_MIXED = [
  SamplingParams(temperature=1.0),
  SamplingParams(temperature=0.7, top_k=5, top_p=0.9),
  SamplingParams(temperature=1.5, top_p=0.6, min_p=0.05),
  SamplingParams(temperature=1.0, top_k=10, min_p=0.2),
  SamplingParams(temperature=0.0, top_k=3),
]


def test_per_row_filters_equal_the_scalar_filter_row_by_row():
  logits = (2.0 * np.random.default_rng(6).normal(size=(40, 37))).astype(np.float32)
  params = [_MIXED[i % len(_MIXED)] for i in range(40)]
  out = np.asarray(filter_logits_rows(jnp.asarray(logits), RowSampling.stack(params)))
  for i, p in enumerate(params):
    ref = np.asarray(filter_logits(jnp.asarray(logits[i : i + 1]), p.top_k, p.top_p, p.min_p))
    np.testing.assert_array_equal(out[i], ref[0])


def test_sample_rows_equals_sample_tokens_per_row():
  logits = (2.0 * np.random.default_rng(7).normal(size=(40, 37))).astype(np.float32)
  keys = jax.random.split(jax.random.key(8), 40)
  params = [_MIXED[i % len(_MIXED)] for i in range(40)]
  tokens, logp = sample_rows(jnp.asarray(logits), keys, RowSampling.stack(params))
  for i, p in enumerate(params):
    t, lp = sample_tokens(jnp.asarray(logits[i : i + 1]), keys[i : i + 1], p)
    assert int(tokens[i]) == int(t[0]), (i, p)
    np.testing.assert_allclose(float(logp[i]), float(lp[0]), atol=1e-6)
  greedy = [i for i, p in enumerate(params) if p.temperature == 0]
  np.testing.assert_array_equal(np.asarray(tokens)[greedy], logits[greedy].argmax(-1))


@pytest.mark.parametrize(
  "params",
  [
    # No row filters: the filter step (and its full-vocabulary sort) is skipped.
    [SamplingParams(temperature=1.0), SamplingParams(temperature=0.5), SamplingParams(0.0)],
    # One filtering row makes the whole batch take the filter path; the others are unchanged.
    [SamplingParams(temperature=1.0), SamplingParams(temperature=0.5, top_p=0.5), SamplingParams()],
  ],
)
def test_sample_rows_with_and_without_filtering_rows_equals_sample_tokens(params):
  logits = (2.0 * np.random.default_rng(9).normal(size=(len(params), 37))).astype(np.float32)
  keys = jax.random.split(jax.random.key(10), len(params))
  tokens, logp = jax.jit(sample_rows)(jnp.asarray(logits), keys, RowSampling.stack(params))
  for i, p in enumerate(params):
    t, lp = sample_tokens(jnp.asarray(logits[i : i + 1]), keys[i : i + 1], p)
    assert int(tokens[i]) == int(t[0]), (i, p)
    np.testing.assert_allclose(float(logp[i]), float(lp[0]), atol=1e-6)


def test_request_keys_are_each_ids_fold_in_with_one_program_per_power_of_two(monkeypatch):
  from jaxrl.rollout import engine_types

  # A copy of the function, jitted: a cache of its own, counted from empty (jax shares one
  # cache between jits of the same function object).
  raw = engine_types._request_keys.__wrapped__
  fresh = jax.jit(types.FunctionType(raw.__code__, raw.__globals__, raw.__name__))
  monkeypatch.setattr(engine_types, "_request_keys", fresh)
  base = jax.random.key(5)
  for n in (1, 3, 8, 9, 16, 17, 31):
    ids = np.arange(n) * 7 + 3
    want = [np.asarray(jax.random.key_data(jax.random.fold_in(base, int(i)))) for i in ids]
    got = engine_types.request_keys(5, ids)
    assert got.shape == (n, 2) and got.dtype == np.uint32
    np.testing.assert_array_equal(got, np.stack(want))
    np.testing.assert_array_equal(engine_types.request_key(5, int(ids[-1])), want[-1])
  assert engine_types.request_keys(5, []).shape == (0, 2)
  # counts 1-8 share the program of 8, 9-16 that of 16, 17-31 that of 32
  assert fresh._cache_size() == 3
  with pytest.raises(ValueError, match="request_id"):
    engine_types.request_keys(5, [2**31])
