"""Driver tests: queueing under a small page budget, groups, stop tokens and strings, abort,
learner log-prob parity and compile counts."""

import functools

import jax
import numpy as np
import pytest
from helpers import greedy_completions, tiny_model, token_logprobs

from jaxrl.rollout.driver import Driver, Request, Resume, complete_groups
from jaxrl.rollout.engine import Engine
from jaxrl.rollout.sampling import SamplingParams
from jaxrl.tokenizer import ByteTokenizer

pytestmark = pytest.mark.integration

S = 40
GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9)
TOK = ByteTokenizer()


@functools.cache
def _engine() -> Engine:
  cfg, graphdef, _ = tiny_model()
  # 16 pages of 4 tokens: room for about two sequences of 20 + 10 at once, with 3 slots.
  return Engine(
    cfg,
    graphdef,
    max_concurrent_decodes=3,
    num_pages=16,
    page_size=4,
    max_prefill_length=20,
    prefill_chunk_size=8,
    max_target_length=S,
    tokenizer=TOK,
  )


def _prompt(i):
  return TOK.encode(f"q{i}: {i * 7 % 13}+{i}=", add_bos=True)[: 3 + 2 * i]


def _requests(n_groups=2, g=3, n_single=4, max_new=10):
  reqs, rid = [], 0
  for k in range(n_groups):
    for _ in range(g):
      reqs.append(
        Request(_prompt(k + 4), rid, group_id=k, sampling=SAMPLED, max_new_tokens=max_new)
      )
      rid += 1
  for k in range(n_single):
    reqs.append(Request(_prompt(k), rid, sampling=GREEDY, max_new_tokens=max_new))
    rid += 1
  return reqs


@functools.cache
def _resumable_engine() -> Engine:
  """Room to re-prefill a prompt with its partial completion (up to S - 1 tokens), in chunks of
  8: short resumes share a batched prefill, long ones go chunk by chunk."""
  return _new_resumable_engine(max_concurrent_decodes=3, num_pages=24, prefill_chunk_size=8)


def _new_resumable_engine(**kw) -> Engine:
  cfg, graphdef, _ = tiny_model()
  return Engine(
    cfg, graphdef, page_size=4, max_prefill_length=S - 1, max_target_length=S, tokenizer=TOK, **kw
  )


def _learner_logprobs(prompt, completion, temperature, params=None):
  _, graphdef, default = tiny_model()
  params = default if params is None else params
  seq = list(prompt) + list(completion)
  tokens = np.zeros((1, S), np.int32)
  tokens[0, : len(seq)] = seq
  logp = token_logprobs(
    graphdef, params, tokens, np.arange(S)[None] < len(seq), temperature=temperature
  )
  return np.asarray(logp)[0, len(prompt) : len(seq)]


def _greedy_reference(prompt, n):
  _, graphdef, params = tiny_model()
  return greedy_completions(graphdef, params, [prompt], n, S)[0][0].tolist()


def _check_logprobs(c, sampling):
  assert len(c.tokens) == len(c.logprobs) > 0
  learner = _learner_logprobs(c.prompt_tokens, c.tokens, sampling.logprob_temperature)
  np.testing.assert_allclose(c.logprobs, learner, atol=1e-5, rtol=0)


def test_more_requests_than_pages_are_queued_and_all_finish():
  eng, (_, _, params) = _engine(), tiny_model()
  # No EOS, so every sequence runs to max_new_tokens and the page budget really binds.
  driver = Driver(eng, steps_per_call=4, eos_id=None, tokenizer=TOK)
  reqs = _requests()
  res = driver.run(params, reqs, policy_version=7, seed=1)
  assert not res.partial and not res.unstarted
  assert sorted(c.request_id for c in res.finished) == [r.request_id for r in reqs]
  assert res.stats["queued_waits"] > 0  # admission really waited for pages / slots
  assert res.stats["prefill_prompts"] == 2 + 4  # each prompt once: one per group, per single
  # Prompts admitted together share a call (one per length bucket); three slots, so some do.
  assert res.stats["prefill_calls"] < res.stats["prefill_prompts"]
  assert eng.allocator.num_free == eng.num_pages and not eng.slot_pages
  by_id = {r.request_id: r for r in reqs}
  for c in res.finished:
    r = by_id[c.request_id]
    assert c.policy_version == 7 and c.finish_reason == "length" and len(c.tokens) == 10
    np.testing.assert_array_equal(c.prompt_tokens, r.prompt)
    _check_logprobs(c, r.sampling)
    if r.group_id is None:
      np.testing.assert_array_equal(c.tokens, _greedy_reference(r.prompt, 10))
  # Same seed, same rollouts; the decode step compiled once through all insertions.
  again = driver.run(params, reqs, policy_version=7, seed=1)
  first_run = {c.request_id: c.tokens for c in res.finished}
  for c in again.finished:
    np.testing.assert_array_equal(c.tokens, first_run[c.request_id])
  assert eng.generate_compiles == 1
  assert again.stats["compiles"] == 0  # every program's shapes repeat the first run's


def test_stop_token_and_stop_string():
  eng, (_, _, params) = _engine(), tiny_model()
  prompt = _prompt(3)
  greedy = _greedy_reference(prompt, 10)
  # EOS = the 5th greedy token (first occurrence): the sequence stops there, EOS included.
  eos = greedy[4]
  cut = greedy.index(eos) + 1
  res = Driver(eng, steps_per_call=4, eos_id=eos).run(
    params, [Request(prompt, 0, sampling=GREEDY, max_new_tokens=10)]
  )
  (c,) = res.finished
  assert c.finish_reason == "stop"
  np.testing.assert_array_equal(c.tokens, greedy[:cut])
  # A stop string spanning greedy tokens 3..4 (as text): stop at the token that completes it.
  stop = TOK.decode(greedy[2:4], skip_special=False)
  req = Request(prompt, 1, sampling=GREEDY, max_new_tokens=10, stop_strings=(stop,))
  (c,) = Driver(eng, steps_per_call=4, eos_id=None).run(params, [req]).finished
  assert c.finish_reason == "stop_string"
  n = next(i + 1 for i in range(10) if stop in TOK.decode(greedy[: i + 1], skip_special=False))
  np.testing.assert_array_equal(c.tokens, greedy[:n])
  assert eng.allocator.num_free == eng.num_pages


@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_sequences_ending_at_their_first_token_never_block_the_queue(batching):
  # max_new_tokens=1: each sequence ends at its prefill, so no slot ever holds one; the requests
  # (groups and singles) outnumber the 3 slots, and the driver admits until the queue is empty.
  eng, (_, _, params) = _engine(), tiny_model()
  reqs = _requests(n_groups=2, g=3, n_single=4, max_new=1)
  res = Driver(eng, steps_per_call=4, eos_id=None, batching=batching).run(params, reqs, seed=1)
  assert not res.partial and not res.unstarted
  assert sorted(c.request_id for c in res.finished) == [r.request_id for r in reqs]
  assert all(len(c.tokens) == 1 and c.finish_reason == "length" for c in res.finished)
  assert res.stats["generate_calls"] == 0 and res.stats["prefill_prompts"] == 2 + 4
  assert eng.allocator.num_free == eng.num_pages and not eng.slot_pages
  by_id = {r.request_id: r for r in reqs}
  for c in res.finished:
    if by_id[c.request_id].group_id is None:
      assert c.tokens.tolist() == _greedy_reference(by_id[c.request_id].prompt, 1)


def test_abort_returns_partial_sequences_intact():
  eng, (_, _, params) = _engine(), tiny_model()
  driver = Driver(eng, steps_per_call=4, eos_id=None)
  reqs = _requests(n_groups=3, g=2, n_single=2, max_new=25)
  res = driver.run(params, reqs, policy_version=2, seed=5, stop_when=complete_groups(1))
  assert len(res.finished) >= 1 and res.partial and res.unstarted
  seen = [c.request_id for c in res.finished + res.partial] + [r.request_id for r in res.unstarted]
  assert sorted(seen) == [r.request_id for r in reqs]
  by_id = {r.request_id: r for r in reqs}
  for c in res.partial:
    assert c.finish_reason == "abort" and 0 < len(c.tokens) < 25 and c.policy_version == 2
    _check_logprobs(c, by_id[c.request_id].sampling)
  assert eng.allocator.num_free == eng.num_pages and not eng.slot_pages
  # The engine is reusable after an abort: the aborted slots were stopped on the device.
  rerun = driver.run(params, res.unstarted, seed=5)
  assert len(rerun.finished) == len(res.unstarted)
  assert eng.generate_compiles == 1


def _resume(c, r):
  """The request that resumes partial completion `c` of request `r` (decoded alone)."""
  return Request(
    r.prompt,
    r.request_id,
    sampling=r.sampling,
    max_new_tokens=r.max_new_tokens,
    resume=Resume(c.tokens.tolist(), c.logprobs.tolist(), c.versions.tolist(), c.key.tolist()),
  )


def _staged(params_by_stage, stops=(1, 3, None)):
  """Sample the requests in stages: each stage aborts after `stops[i]` loop turns and the next
  resumes its partial sequences (and starts its unstarted requests) with the next params, as
  policy version 2 + i. Returns (requests, completions by id, partial lengths at each stage)."""
  eng = _resumable_engine()
  driver = Driver(eng, steps_per_call=4, eos_id=None)
  reqs = _requests(n_groups=3, g=2, n_single=2, max_new=25)
  reqs = reqs[6:] + reqs[:6]  # the singles first: short prompts, resumed in one batched call
  by_id = {r.request_id: r for r in reqs}
  todo, done, cuts = reqs, {}, []
  for i, (params, stop) in enumerate(zip(params_by_stage, stops, strict=True)):
    turns = iter(range(1000))
    res = driver.run(
      params,
      todo,
      policy_version=2 + i,
      seed=5,
      stop_when=None if stop is None else lambda _, s=stop, t=turns: next(t) == s,
    )
    done.update({c.request_id: c for c in res.finished})
    cuts.append({c.request_id: len(c.tokens) for c in res.partial})
    todo = [_resume(c, by_id[c.request_id]) for c in res.partial] + res.unstarted
    assert eng.allocator.num_free == eng.num_pages and not eng.slot_pages
  assert not todo and sorted(done) == sorted(by_id)
  return reqs, done, cuts


def test_resumed_partial_matches_the_uninterrupted_sequence():
  eng, (_, _, params) = _resumable_engine(), tiny_model()
  reqs, done, cuts = _staged([params] * 3)
  whole = Driver(eng, steps_per_call=4, eos_id=None).run(params, reqs, policy_version=2, seed=5)
  whole = {c.request_id: c for c in whole.finished}
  prompt = {r.request_id: len(r.prompt) for r in reqs}
  resumed = [prompt[rid] + k for cut in cuts for rid, k in cut.items()]
  # Some resumes re-prefill in chunks (past 8 tokens), some in one batched call.
  assert max(resumed) > 8 and min(resumed) <= 8 and sum(len(c) for c in cuts) >= 4
  for rid, c in done.items():
    np.testing.assert_array_equal(c.tokens, whole[rid].tokens)
    # A resumed token's logits come from a prefill, the uninterrupted one's from a decode step.
    np.testing.assert_allclose(c.logprobs, whole[rid].logprobs, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(c.key, whole[rid].key)
  assert eng.generate_compiles == 1


def test_fixed_prefill_batches_compile_nothing_new_for_other_counts_of_resumes():
  """Partial rollouts resume sequences in every count. With prefill_batch_prompts the driver
  splits each (length bucket, samples per prompt) batch into calls of that many prompts: after
  one staged run, runs with other counts of groups, singles and resumes compile no new
  program, and the tokens are those of an engine that pads each call to its own count."""
  _, _, params = tiny_model()
  engines = [
    _new_resumable_engine(
      max_concurrent_decodes=8, num_pages=96, prefill_chunk_size=16, prefill_batch_prompts=p
    )
    for p in (2, None)
  ]
  runs = []
  for eng in engines:
    driver = Driver(eng, steps_per_call=2, eos_id=None)
    out, compiles = [], []
    for n_groups, n_single, cut in ((3, 3, 2), (1, 4, 1), (2, 1, 3), (3, 2, 2)):
      reqs = _requests(n_groups=n_groups, g=2, n_single=n_single, max_new=12)
      by_id = {r.request_id: r for r in reqs}
      turns = iter(range(1000))
      stop = lambda _, t=turns, k=cut: next(t) == k  # noqa: E731
      first = driver.run(params, reqs, seed=n_groups, stop_when=stop)
      todo = [_resume(c, by_id[c.request_id]) for c in first.partial] + first.unstarted
      rest = driver.run(params, todo, seed=n_groups)
      assert first.partial and len(first.finished) + len(rest.finished) == len(reqs)
      out.append({c.request_id: c.tokens for c in first.finished + rest.finished})
      compiles.append(first.stats["compiles"] + rest.stats["compiles"])
    runs.append((out, compiles))
  (fixed, fixed_compiles), (free, free_compiles) = runs
  assert fixed_compiles[0] > 0 and fixed_compiles[1:] == [0, 0, 0], fixed_compiles
  assert sum(free_compiles[1:]) > 0, free_compiles  # counts the first run had not seen
  for a, b in zip(fixed, free, strict=True):
    assert a.keys() == b.keys()
    for rid in a:
      np.testing.assert_array_equal(a[rid], b[rid], err_msg=str(rid))


def test_resume_under_new_weights_tags_each_token_with_its_version():
  _, _, params = tiny_model()
  stages = [
    params,
    jax.tree.map(lambda x: x * 1.05, params),
    jax.tree.map(lambda x: x * 0.95, params),
  ]
  reqs, done, cuts = _staged(stages)
  temp = {r.request_id: r.sampling.logprob_temperature for r in reqs}
  checked = 0
  for rid, c in done.items():
    # Where each stage ended this sequence: the tokens before the first cut are version 2, ...
    bounds = [0] + [cut[rid] for cut in cuts if rid in cut] + [len(c.tokens)]
    first_stage = next((i for i, cut in enumerate(cuts) if rid in cut), None)
    if first_stage is None:
      np.testing.assert_array_equal(c.versions, c.policy_version)
      continue
    for j, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
      stage = first_stage + j
      np.testing.assert_array_equal(c.versions[a:b], 2 + stage)
      # Each token's behaviour log-prob is that of the weights that drew it.
      ref = _learner_logprobs(c.prompt_tokens, c.tokens, temp[rid], params=stages[stage])
      np.testing.assert_allclose(c.logprobs[a:b], ref[a:b], atol=1e-5, rtol=0)
      checked += b - a
  assert checked > 0
  assert len({int(v) for c in done.values() for v in c.versions}) == 3


def test_bad_resumes_fail_before_any_work():
  eng, (_, _, params) = _resumable_engine(), tiny_model()
  driver = Driver(eng)
  r = Resume([7, 8], [-1.0, -2.0], [0, 0], [1, 2])
  with pytest.raises(ValueError, match="prefilled alone"):
    driver.run(params, [Request([5] * 4, 0, group_id=0, max_new_tokens=8, resume=r)])
  with pytest.raises(ValueError, match="nothing is left to generate"):
    driver.run(params, [Request([5] * 4, 0, max_new_tokens=2, resume=r)])
  with pytest.raises(ValueError, match="one log-prob and one version per token"):
    Resume([7, 8], [-1.0], [0, 0], [1, 2])


def test_bad_requests_fail_before_any_work():
  eng, (_, _, params) = _engine(), tiny_model()
  driver = Driver(eng)
  calls = eng.stats["prefill_calls"]
  too_long = [
    Request([5] * 4, 0, max_new_tokens=8),
    Request(list(range(3, 24)), 1, max_new_tokens=8),
  ]
  with pytest.raises(
    ValueError, match="21 tokens, longer than the engine's max_prefill_length of 20"
  ):
    driver.run(params, too_long)
  big_group = [Request([5, 6], i, group_id=0, max_new_tokens=8) for i in range(4)]
  with pytest.raises(
    ValueError, match="4 samples, more than the engine's max_concurrent_decodes=3"
  ):
    driver.run(params, big_group)
  mixed = [Request([5, 6], 0, group_id=0), Request([5, 7], 1, group_id=0)]
  with pytest.raises(
    ValueError, match="max_new_tokens=64 exceeds the engine's max_target_length of 40"
  ):
    driver.run(params, [Request([5, 6], 0)])
  with pytest.raises(ValueError, match="share group_id 0 but differ"):
    driver.run(params, mixed)
  with pytest.raises(ValueError, match="appears twice"):
    driver.run(params, [Request([5], 0), Request([6], 0)])
  assert eng.stats["prefill_calls"] == calls


def test_static_batching_matches_continuous_and_waits_for_whole_batches(monkeypatch):
  eng, (_, _, params) = _engine(), tiny_model()
  # Long-tailed lengths (per-request max_new_tokens, no EOS), groups and sampled singles.
  reqs, rid = [], 0
  for k, n in enumerate([2, 12, 3, 5, 1, 9, 4]):
    for _ in range(2 if k in (1, 4) else 1):
      group = k if k in (1, 4) else None
      reqs.append(Request(_prompt(k), rid, group_id=group, sampling=SAMPLED, max_new_tokens=n))
      rid += 1
  # Record, at every bulk_insert, the decode calls so far and the slots already occupied.
  log, calls = [], [0]
  bulk_insert, insert_batch, generate_steps = eng.bulk_insert, eng.insert_batch, eng.generate_steps

  def logged_insert(prefix, state, slots, sample_ids=None):
    log.append((calls[0], set(eng.slot_pages), len(slots)))
    return bulk_insert(prefix, state, slots, sample_ids)

  def logged_batch(batch, state, slots, sample_ids):
    log.append((calls[0], set(eng.slot_pages), len(slots)))
    return insert_batch(batch, state, slots, sample_ids)

  def counted_generate(*args):
    calls[0] += 1
    return generate_steps(*args)

  monkeypatch.setattr(eng, "bulk_insert", logged_insert)
  monkeypatch.setattr(eng, "insert_batch", logged_batch)
  monkeypatch.setattr(eng, "generate_steps", counted_generate)

  runs = {}
  for mode in ("continuous", "static"):
    log.clear()
    res = Driver(eng, steps_per_call=2, eos_id=None, batching=mode).run(params, reqs, seed=3)
    assert not res.partial and not res.unstarted
    runs[mode] = ({c.request_id: c for c in res.finished}, list(log), res.stats)
  cont, stat = runs["continuous"][0], runs["static"][0]
  assert sorted(cont) == sorted(stat) == [r.request_id for r in reqs]
  for r in reqs:
    a, b = cont[r.request_id], stat[r.request_id]
    assert len(a.tokens) == r.max_new_tokens and a.finish_reason == b.finish_reason == "length"
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
  # Static: inserts come in bursts between decode calls; each burst starts on an empty engine
  # and holds at most max_concurrent_decodes samples.
  bursts = {}
  for call, occupied, g in runs["static"][1]:
    bursts.setdefault(call, []).append((occupied, g))
  for burst in bursts.values():
    assert not burst[0][0]
    assert sum(g for _, g in burst) <= eng.max_concurrent_decodes
  assert runs["static"][2]["batches"] >= len(bursts) > 1
  # Continuous refills a slot while others are still decoding; static never does.
  assert any(occupied for _, occupied, _ in runs["continuous"][1])
  assert runs["continuous"][2]["batches"] == 0
  assert runs["static"][2]["decode_steps"] > runs["continuous"][2]["decode_steps"]
  with pytest.raises(ValueError, match="batching must be one of"):
    Driver(eng, batching="dynamic")


def test_on_finished_sees_each_sequence_once_while_others_still_decode():
  eng, (_, _, params) = _engine(), tiny_model()
  driver = Driver(eng, steps_per_call=4, eos_id=None, tokenizer=TOK)
  # Three slots for 10 requests of different lengths: they finish in waves.
  reqs = [
    Request(_prompt(k % 4), k, sampling=GREEDY, max_new_tokens=2 + 3 * (k % 4)) for k in range(10)
  ]
  calls = []

  def on_finished(done):
    calls.append(([c.request_id for c in done], eng.slot_pages.copy()))

  res = driver.run(params, reqs, seed=3, on_finished=on_finished)
  seen = [rid for ids, _ in calls for rid in ids]
  assert sorted(seen) == sorted(c.request_id for c in res.finished) == list(range(10))
  assert len(calls) > 2  # handed over in waves, not once at the end
  assert any(live for _, live in calls[:-1])  # ... while other sequences were still decoding
  again = driver.run(params, reqs, seed=3)  # the callback changes nothing sampled
  first = {c.request_id: c.tokens for c in res.finished}
  for c in again.finished:
    np.testing.assert_array_equal(c.tokens, first[c.request_id])


def test_a_kept_prefill_serves_a_groups_later_samples_without_prefilling_again():
  eng, (_, _, params) = _engine(), tiny_model()
  driver = Driver(eng, steps_per_call=4, eos_id=None, tokenizer=TOK)

  def group_requests(k, samples, draws):
    return [
      Request(
        _prompt(k + 1),  # at most a prefill chunk: a batched prefill, which is what is kept
        100 * k + j,
        group_id=k,
        sampling=SAMPLED,
        max_new_tokens=6,
        draws=draws,
        sample_index=j,
      )
      for j in samples
    ]

  keep = {}
  first = driver.run(
    params, group_requests(0, [0, 1], 3) + group_requests(1, [0], 3), seed=5, keep=keep
  )
  assert set(keep) == {0, 1} and first.stats["prefill_prompts"] == 2
  later = driver.run(
    params, group_requests(0, [2], 3) + group_requests(1, [1, 2], 3), seed=5, keep=keep
  )
  assert later.stats["prefill_calls"] == 0 and later.stats["reused_prompts"] == 2
  # The same draws as one run asking for every sample at once, prefilled as usual.
  whole = driver.run(
    params, group_requests(0, range(3), 3) + group_requests(1, range(3), 3), seed=5
  )
  want = {c.request_id: c for c in whole.finished}
  got = first.finished + later.finished
  assert sorted(c.request_id for c in got) == sorted(want)
  for c in got:
    np.testing.assert_array_equal(c.tokens, want[c.request_id].tokens)
    np.testing.assert_allclose(c.logprobs, want[c.request_id].logprobs, atol=1e-5)
    _check_logprobs(c, SAMPLED)
  assert eng.allocator.num_free == eng.num_pages  # every page back
  with pytest.raises(ValueError, match="draws"):
    driver.run(params, [Request(_prompt(1), 7, sampling=GREEDY, draws=2, sample_index=3)])
