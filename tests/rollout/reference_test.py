"""Sampler tests: behaviour vs learner logprobs, greedy vs a no-cache reference, row invariance."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from families import (
  FAMILIES,
  REF_LEN,
  family_model,
  family_prompts,
  greedy_reference,
  learner_logprobs,
)
from helpers import apply, tiny_model, token_logprobs

from jaxrl.rollout.collect import left_pad
from jaxrl.rollout.reference import make_sampler, row_keys
from jaxrl.rollout.sampling import SamplingParams

pytestmark = pytest.mark.integration

P, N, PAD = 8, 8, 0  # prompt bucket, max new tokens, pad id
# Different lengths, so rows carry different amounts of left padding (none for the full one).
PROMPTS = [[5, 9, 17], [40, 41, 42, 43, 44, 45, 46, 47], [100], [200, 7, 33, 3, 90]]
TOP_K, TOP_P = 40, 0.9
NO_EOS = -1


@functools.cache
def _sampler(temperature: float, eos_id: int):
  cfg, graphdef, _ = tiny_model()
  filters = dict(top_k=TOP_K, top_p=TOP_P) if temperature else {}
  sampling = SamplingParams(temperature=temperature, **filters)
  return make_sampler(
    graphdef, cfg, prompt_len=P, max_new_tokens=N, eos_id=eos_id, pad_id=PAD, sampling=sampling
  )


def _logits_of_one(seq, length):
  """Plain full forward (no cache) over one sequence [1, S] whose real tokens sit at [0, length):
  logits [S, V]. The filler columns after them are masked keys and in the causal future, so rows
  < length are those of the unpadded sequence; one shape keeps this to a single compile."""
  _, graphdef, params = tiny_model()
  s = seq.shape[1]
  logits, _ = apply(graphdef, params, seq, np.arange(s)[None], np.arange(s)[None] < length)
  return np.asarray(logits[0])


def _greedy_reference(prompt, eos_id):
  """Argmax decoding of one prompt (batch of 1, no padding before it, no KV cache): the
  completion and the smallest top-1 vs top-2 logit gap seen along the way."""
  buf = np.zeros((1, P + N), np.int32)
  buf[0, : len(prompt)] = prompt
  length, out, gap = len(prompt), [], np.inf
  for _ in range(N):
    logits = _logits_of_one(buf, length)[length - 1]
    top2 = np.sort(logits)[-2:]
    gap = min(gap, top2[1] - top2[0])
    out.append(int(np.argmax(logits)))
    if out[-1] == eos_id:
      break
    buf[0, length] = out[-1]
    length += 1
  return out, gap


@functools.cache
def _greedy_case():
  """EOS id chosen as a token the model emits greedily mid-way through one row and never in
  another, so one batch has rows that stop at EOS and rows that run to N tokens."""
  refs = [_greedy_reference(p, NO_EOS)[0] for p in PROMPTS]
  for r, ref in enumerate(refs):
    for j in range(1, N - 2):
      t = ref[j]
      if t not in ref[:j] and any(t not in other for other in refs):
        refs = [_greedy_reference(p, t) for p in PROMPTS]
        return r, t, [x[0] for x in refs], min(x[1] for x in refs)
  raise AssertionError(f"no usable EOS token in the greedy outputs {refs}")


def _batch(prompts, seed, ids):
  tokens, mask = left_pad(prompts, P, PAD)
  return jnp.asarray(tokens), jnp.asarray(mask), row_keys(jax.random.key(seed), ids)


def _check_rollout(r, prompt_tokens, prompt_mask, eos_id):
  """Invariants of every Rollout: mask is a prefix ending at the first EOS, pad and zero logprob
  after it, lengths and truncated agree with the tokens."""
  tokens, mask, logp = np.asarray(r.tokens), np.asarray(r.mask), np.asarray(r.logprobs)
  lengths, truncated = np.asarray(r.lengths), np.asarray(r.truncated)
  np.testing.assert_array_equal(np.asarray(r.prompt_tokens), prompt_tokens)
  np.testing.assert_array_equal(np.asarray(r.prompt_mask), prompt_mask)
  assert tokens.shape == mask.shape == logp.shape == (len(prompt_tokens), N)
  assert tokens.dtype == np.int32 and logp.dtype == np.float32
  for b in range(len(tokens)):
    n = int(lengths[b])
    np.testing.assert_array_equal(mask[b], np.arange(N) < n)
    assert np.all(tokens[b, n:] == PAD) and np.all(logp[b, n:] == 0.0)
    assert np.all(np.isfinite(logp[b, :n])) and np.all(logp[b, :n] <= 0.0)
    eos_at = np.flatnonzero(tokens[b, :n] == eos_id)
    if truncated[b]:
      assert n == N and eos_at.size == 0
    else:
      assert eos_at.tolist() == [n - 1]


def _learner_logprobs(r, temperature):
  """token_logprobs over concat(prompt, completion) on the completion columns."""
  _, graphdef, params = tiny_model()
  full = jnp.concatenate([r.prompt_tokens, r.tokens], axis=1)
  valid = jnp.concatenate([r.prompt_mask, r.mask], axis=1)
  return np.asarray(token_logprobs(graphdef, params, full, valid, temperature=temperature))[:, P:]


def _assert_sampler_learner_agree(r, temperature):
  mask = np.asarray(r.mask)
  gap = np.abs(_learner_logprobs(r, temperature) - np.asarray(r.logprobs))[mask]
  assert gap.max() <= 1e-5, gap.max()


def test_greedy_matches_no_cache_reference_and_stops_at_eos():
  stop_row, eos, refs, gap = _greedy_case()
  assert gap > 1e-3, "argmax too close to a tie to compare two code paths"
  _, _, params = tiny_model()
  tokens, mask, keys = _batch(PROMPTS, 0, range(4))
  r = _sampler(0.0, eos)(params, tokens, mask, keys)
  _check_rollout(r, tokens, mask, eos)
  for b, ref in enumerate(refs):
    np.testing.assert_array_equal(np.asarray(r.tokens[b, : len(ref)]), ref, err_msg=f"row {b}")
    assert int(r.lengths[b]) == len(ref)
    assert bool(r.truncated[b]) == (ref[-1] != eos)
  assert not r.truncated[stop_row] and int(r.lengths[stop_row]) < N
  assert np.any(np.asarray(r.truncated))
  # Greedy decoding reports logprobs under the untempered policy.
  _assert_sampler_learner_agree(r, 1.0)


def test_greedy_rows_follow_their_prompts_when_permuted():
  _, eos, refs, _ = _greedy_case()
  _, _, params = tiny_model()
  perm = [2, 0, 3, 1]
  tokens, mask, keys = _batch([PROMPTS[i] for i in perm], 0, range(4))
  r = _sampler(0.0, eos)(params, tokens, mask, keys)
  _check_rollout(r, tokens, mask, eos)
  for b, i in enumerate(perm):
    ref = refs[i]
    np.testing.assert_array_equal(np.asarray(r.tokens[b, : len(ref)]), ref, err_msg=f"row {b}")
    assert int(r.lengths[b]) == len(ref)


def test_decoding_stops_early_when_every_row_hit_eos():
  stop_row, eos, refs, _ = _greedy_case()
  _, _, params = tiny_model()
  tokens, mask, keys = _batch([PROMPTS[stop_row]] * 4, 0, range(4))
  r = _sampler(0.0, eos)(params, tokens, mask, keys)
  _check_rollout(r, tokens, mask, eos)
  expect = np.full(N, PAD)
  expect[: len(refs[stop_row])] = refs[stop_row]
  np.testing.assert_array_equal(np.asarray(r.tokens), np.tile(expect, (4, 1)))
  assert not np.any(np.asarray(r.truncated))


def _nucleus_rank(logits, token, temperature):
  """(rank of token, probability mass of the top-k tokens ranked above it, renormalised)."""
  z = np.asarray(logits, np.float64) / temperature
  order = np.argsort(-z)
  rank = int(np.flatnonzero(order == token)[0])
  probs = np.exp(z[order[:TOP_K]] - z.max())
  return rank, probs[:rank].sum() / probs.sum()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behaviour_logprobs_equal_learner_logprobs(temperature):
  _, _, params = tiny_model()
  tokens, mask, keys = _batch(PROMPTS, 7, [10, 11, 12, 13])
  r = _sampler(temperature, 2)(params, tokens, mask, keys)
  _check_rollout(r, tokens, mask, 2)
  _assert_sampler_learner_agree(r, temperature)
  # Each draw lies in the top-k / top-p set of the learner's tempered distribution.
  out, prompt_lens = np.asarray(r.tokens), np.asarray(mask).sum(1)
  for b in range(len(PROMPTS)):
    n, seq = int(r.lengths[b]), np.zeros((1, P + N), np.int32)
    seq[0, : prompt_lens[b] + n] = np.concatenate([PROMPTS[b], out[b, :n]])
    logits = _logits_of_one(seq, prompt_lens[b] + n)
    for j in range(n):
      rank, before = _nucleus_rank(logits[prompt_lens[b] + j - 1], out[b, j], temperature)
      assert rank < TOP_K and before < TOP_P + 1e-5, (b, j, rank, before)


def test_sampling_is_independent_of_batch_composition():
  _, _, params = tiny_model()
  sample = _sampler(0.7, 2)
  tokens, mask, keys = _batch(PROMPTS, 3, [10, 11, 12, 13])
  full = sample(params, tokens, mask, keys)
  rows = [2, 0]
  sub_tokens, sub_mask, sub_keys = _batch([PROMPTS[i] for i in rows], 3, [12, 10])
  sub = sample(params, sub_tokens, sub_mask, sub_keys)
  _check_rollout(sub, sub_tokens, sub_mask, 2)
  np.testing.assert_array_equal(np.asarray(sub.tokens), np.asarray(full.tokens)[rows])
  np.testing.assert_array_equal(np.asarray(sub.mask), np.asarray(full.mask)[rows])
  np.testing.assert_allclose(np.asarray(sub.logprobs), np.asarray(full.logprobs)[rows], atol=1e-5)

  # Same prompt: the same id gives the same completion, another id (almost surely) another one.
  tokens, mask, keys = _batch([PROMPTS[0]] * 3 + [PROMPTS[1]], 3, [10, 10, 99, 11])
  dup = np.asarray(sample(params, tokens, mask, keys).tokens)
  np.testing.assert_array_equal(dup[0], np.asarray(full.tokens)[0])
  np.testing.assert_array_equal(dup[1], dup[0])
  assert np.any(dup[2] != dup[0])
  np.testing.assert_array_equal(dup[3], np.asarray(full.tokens)[1])


def test_new_prompts_keys_and_params_do_not_recompile():
  _, _, params = tiny_model()
  sample = _sampler(1.0, 2)
  rng = np.random.default_rng(0)
  seen = set()
  for step in range(3):
    prompts = [rng.integers(3, 259, size=rng.integers(1, P + 1)).tolist() for _ in range(4)]
    tokens, mask, keys = _batch(prompts, 100 + step, range(4 * step, 4 * step + 4))
    step_params = jax.tree.map(lambda x, s=step: x * (1.0 + 0.01 * s), params)
    r = sample(step_params, tokens, mask, keys)
    _check_rollout(r, tokens, mask, 2)
    seen.add(np.asarray(r.tokens).tobytes())
  assert len(seen) == 3
  assert sample._cache_size() == 1


def test_make_sampler_rejects_sequences_past_max_seq_len():
  cfg, graphdef, _ = tiny_model()
  kw = dict(eos_id=2, pad_id=PAD, sampling=SamplingParams())
  with pytest.raises(ValueError, match="max_seq_len"):
    make_sampler(graphdef, cfg, prompt_len=cfg.max_seq_len - 10, max_new_tokens=11, **kw)
  make_sampler(graphdef, cfg, prompt_len=cfg.max_seq_len - 10, max_new_tokens=10, **kw)  # fits
  for p, n in [(0, 4), (4, 0)]:
    with pytest.raises(ValueError, match="must be positive"):
      make_sampler(graphdef, cfg, prompt_len=p, max_new_tokens=n, **kw)


def test_left_pad():
  tokens, mask = left_pad([[5, 6, 7], [], [8]], 4, PAD)
  np.testing.assert_array_equal(tokens, [[0, 5, 6, 7], [0, 0, 0, 0], [0, 0, 0, 8]])
  np.testing.assert_array_equal(mask, [[0, 1, 1, 1], [0, 0, 0, 0], [0, 0, 0, 1]])
  assert tokens.dtype == np.int32 and mask.dtype == bool
  with pytest.raises(ValueError, match="prompt 1 has 5 tokens"):
    left_pad([[5], [1, 2, 3, 4, 5]], 4, PAD)


# MHA differs from GQA only inside attention, which the sampler shares with the learner (the
# cache test covers it); the engine's paged attention is checked with it too.
@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "llama_mha"])
def test_greedy_and_logprobs_match_no_cache_and_learner_per_family(family):
  cfg, graphdef, params = family_model(family)
  # Gemma's window is 5: the 8-token prompt crosses it in prefill, the others while decoding.
  fam_prompts = family_prompts(family, [3, 8, 1, 6])
  tokens, mask, keys = _batch(fam_prompts, 5, range(4))
  greedy = SamplingParams(temperature=0.0)
  kw = dict(prompt_len=P, max_new_tokens=N, eos_id=NO_EOS, pad_id=PAD, sampling=greedy)
  r = make_sampler(graphdef, cfg, **kw)(params, tokens, mask, keys)
  _check_rollout(r, tokens, mask, NO_EOS)
  ref, gap = greedy_reference(family, fam_prompts, N)
  assert gap > 1e-3, "argmax too close to a tie to compare two code paths"
  np.testing.assert_array_equal(np.asarray(r.tokens), ref)
  # The learner's view: the left-padded batch, prompt and completion in one row (padded further
  # on the left to the shared reference width).
  pad = REF_LEN - P - N
  full = np.pad(np.concatenate([r.prompt_tokens, r.tokens], axis=1), ((0, 0), (pad, 0)))
  valid = np.pad(np.concatenate([r.prompt_mask, r.mask], axis=1), ((0, 0), (pad, 0)))
  learner = learner_logprobs(family, full, valid)[:, pad + P :]
  np.testing.assert_allclose(np.asarray(r.logprobs), learner, atol=1e-5, rtol=0)
