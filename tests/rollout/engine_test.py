"""Engine tests: greedy vs a no-cache reference, learner log-probs, slot/batch invariance, group
prefix sharing, chunked prefill, page accounting and compile counts (off and on a mesh)."""

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
  right_padded,
)
from helpers import apply, tiny_model, token_logprobs

from jaxrl.mesh import make_mesh, shard_params
from jaxrl.rollout.engine import Engine, request_key
from jaxrl.rollout.kv_cache import OutOfPages
from jaxrl.rollout.sampling import SamplingParams

pytestmark = pytest.mark.integration

S = 40  # max prompt + completion
GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=1.0, top_k=40, top_p=0.95, min_p=0.01)
# Lengths straddle the page size (4) and the chunk size (8): 11 and 17 are chunked.
PROMPTS = {10: [5, 9, 17], 11: list(range(40, 51)), 12: [100], 13: [200, 7, 33, 3, 90, 1, 2, 8]}
PROMPTS[14] = [(7 * i) % 250 + 3 for i in range(17)]


@functools.cache
def _engine(slots: int = 3, chunk: int = 8, num_pages: int = 40) -> Engine:
  cfg, graphdef, _ = tiny_model()
  return Engine(
    cfg,
    graphdef,
    max_concurrent_decodes=slots,
    num_pages=num_pages,
    page_size=4,
    max_prefill_length=20,
    prefill_chunk_size=chunk,
    max_target_length=S,
  )


def _reference_greedy(prompt, n):
  """Repeated full forward (no cache) + argmax; one [1, S] shape: columns past the sequence are
  in the causal future of every row that is read."""
  _, graphdef, params = tiny_model()
  seq = list(prompt)
  for _ in range(n):
    tokens = jnp.asarray([seq + [0] * (S - len(seq))], jnp.int32)
    logits, _ = apply(graphdef, params, tokens, jnp.arange(S)[None], jnp.ones((1, S), bool))
    seq.append(int(jnp.argmax(logits[0, len(seq) - 1])))
  return seq[len(prompt) :]


def _learner_logprobs(prompt, completion, temperature=1.0):
  _, graphdef, params = tiny_model()
  seq = list(prompt) + list(completion)
  tokens = np.zeros((1, S), np.int32)
  tokens[0, : len(seq)] = seq
  valid = np.arange(S)[None] < len(seq)
  logp = token_logprobs(graphdef, params, tokens, valid, temperature=temperature)
  return np.asarray(logp)[0, len(prompt) : len(seq)]


def _run(eng, schedule, n_new, sampler, seed=0, steps=3, params=None, prompts=PROMPTS):
  """Drive the engine by hand. schedule: (request_id, slot) in insertion order; one insertion
  per `steps` decode steps, so requests join while others are mid-sequence. Returns
  {request_id: (tokens, logprobs)} and checks every page is back afterwards. Default: the tiny
  model's params and PROMPTS."""
  params = tiny_model()[2] if params is None else params
  st = eng.init_decode_state()
  out, owner = {}, {}
  todo = list(schedule)
  while todo or owner:
    if todo and todo[0][1] not in owner:  # else wait for the slot to free up
      rid, slot = todo.pop(0)
      prefix, first = eng.prefill_prompt(
        params,
        prompts[rid],
        sampler=sampler,
        rng=request_key(seed, rid)[None],
        max_new_tokens=n_new,
      )
      f = first.convert_to_numpy().get_result_at_slot(0)
      out[rid] = ([int(f.tokens[0])], [float(f.log_prob[0])])
      st = eng.insert(prefix, st, slot)
      owner[slot] = rid
    st, res = eng.generate_steps(params, st, steps)
    res = res.convert_to_numpy()
    for slot, rid in list(owner.items()):
      d = res.get_result_at_slot(slot)
      for i in np.flatnonzero(d.valid[:, 0]):
        out[rid][0].append(int(d.tokens[i, 0]))
        out[rid][1].append(float(d.log_prob[i, 0]))
        assert d.lengths[i] == len(out[rid][0])
      if res.done[:, slot].any():
        eng.free_resource(slot)
        del owner[slot]
  assert eng.allocator.num_free == eng.num_pages and not eng.slot_pages
  return {rid: (np.array(t), np.array(lp, np.float32)) for rid, (t, lp) in out.items()}


@pytest.mark.parametrize(
  "schedule",
  [
    [(10, 0), (11, 1), (12, 2), (13, 0), (14, 1)],
    [(14, 2), (13, 1), (12, 0), (11, 2), (10, 1)],
  ],
)
def test_greedy_matches_no_cache_reference_and_learner_logprobs(schedule):
  n_new = 9
  got = _run(_engine(), schedule, n_new, GREEDY)
  for rid, (tokens, logp) in got.items():
    assert len(tokens) == n_new
    np.testing.assert_array_equal(tokens, _reference_greedy(PROMPTS[rid], n_new), err_msg=rid)
    learner = _learner_logprobs(PROMPTS[rid], tokens)
    np.testing.assert_allclose(logp, learner, atol=1e-5, rtol=0, err_msg=str(rid))
  assert _engine().generate_compiles == 1


def test_a_fresh_decode_state_is_one_compiled_program_and_all_zeros():
  """init_decode_state makes the pool and every slot vector in one jitted call: a run's first
  step compiles it once, not one eager program per distinct shape."""
  cfg, graphdef, _ = tiny_model()
  eng = Engine(cfg, graphdef, max_concurrent_decodes=2, num_pages=6, page_size=4,
               max_prefill_length=8, max_target_length=12)  # fmt: skip
  compiles = []

  def count(event, duration, **_):
    if event == "/jax/core/compile/backend_compile_duration":
      compiles.append(duration)

  jax.monitoring.register_event_duration_secs_listener(count)
  try:
    first = eng.init_decode_state()
    n_first = len(compiles)
    eng.init_decode_state()
  finally:
    jax.monitoring.unregister_event_duration_listener(count)
  assert (n_first, len(compiles)) == (1, 1)
  assert all(not np.any(np.asarray(p)) for p in first.k_pages + first.v_pages)
  assert np.asarray(first.stop_ids).min() == np.asarray(first.stop_ids).max() == -1
  assert np.asarray(first.sampling.temperature).tolist() == [1.0, 1.0]


def test_sampling_independent_of_slot_batch_and_slot_count():
  n_new = 8
  a = _run(_engine(), [(10, 0), (11, 1), (12, 2), (13, 0), (14, 1)], n_new, SAMPLED, seed=3)
  # Other slots, another order, other neighbours, and an engine with 2 slots and no chunking.
  b = _run(_engine(), [(13, 2), (10, 1)], n_new, SAMPLED, seed=3, steps=2)
  c = _run(_engine(2, 32), [(14, 1), (11, 0), (10, 0)], n_new, SAMPLED, seed=3)
  for rid in (10, 13):
    np.testing.assert_array_equal(a[rid][0], b[rid][0])
  for rid in (10, 11, 14):
    np.testing.assert_array_equal(a[rid][0], c[rid][0])
  for rid, (tokens, logp) in a.items():
    learner = _learner_logprobs(PROMPTS[rid], tokens, SAMPLED.temperature)
    np.testing.assert_allclose(logp, learner, atol=1e-5, rtol=0)
  # The seed is really used: another seed draws other tokens.
  d = _run(_engine(), [(10, 0), (11, 1)], n_new, SAMPLED, seed=4)
  assert any(np.any(a[r][0] != d[r][0]) for r in (10, 11))


def test_chunked_prefill_equals_unchunked():
  _, _, params = tiny_model()
  chunked, whole = _engine(), _engine(2, 32)
  for rid in (11, 14):
    pa, ra = chunked.prefill_prompt(params, PROMPTS[rid], sampler=GREEDY, max_new_tokens=4)
    pb, rb = whole.prefill_prompt(params, PROMPTS[rid], sampler=GREEDY, max_new_tokens=4)
    n = len(PROMPTS[rid])
    assert pa.length == pb.length == n
    for (ka, va), (kb, vb) in zip(pa.cache, pb.cache, strict=True):
      np.testing.assert_allclose(np.asarray(ka)[:, :n], np.asarray(kb)[:, :n], atol=1e-5)
      np.testing.assert_allclose(np.asarray(va)[:, :n], np.asarray(vb)[:, :n], atol=1e-5)
    ra, rb = ra.convert_to_numpy(), rb.convert_to_numpy()
    assert ra.get_result_at_slot(0).tokens == rb.get_result_at_slot(0).tokens
  # A 17-token prompt takes 3 chunk calls of one shape; decoding after it was checked above.
  before = chunked.stats["prefill_calls"]
  chunked.prefill_prompt(params, PROMPTS[14], sampler=GREEDY, max_new_tokens=4)
  assert chunked.stats["prefill_calls"] - before == 3
  assert chunked.use_chunked_prefill and not whole.use_chunked_prefill


def test_group_prefill_once_and_pages_shared_by_refcount():
  _, _, params = tiny_model()
  eng = _engine(5)
  st = eng.init_decode_state()
  prompt, g, n_new = PROMPTS[14], 4, 6  # 17 tokens: 4 full pages + 1 token on a fifth
  keys = np.stack([request_key(7, 100 + j) for j in range(g)])
  before = eng.stats.copy()
  prefix, first = eng.prefill_prompt(
    params, prompt, sampler=SAMPLED, rng=keys, num_samples=g, max_new_tokens=n_new
  )
  st = eng.bulk_insert(prefix, st, [4, 0, 2, 1])
  assert eng.stats["prefill_calls"] - before["prefill_calls"] == 3  # 3 chunks, once per group
  pages = [eng.slot_pages[s] for s in (4, 0, 2, 1)]
  shared = pages[0][:4]
  assert all(p[:4] == shared for p in pages)
  assert [eng.allocator.refcount(p) for p in shared] == [g] * 4
  own = [q for p in pages for q in p[4:]]
  assert len(set(own)) == len(own) and all(eng.allocator.refcount(q) == 1 for q in own)
  # Pages: 4 shared + per sample ceil((17 + 6 - 1) / 4) - 4 = 2 own.
  used = eng.num_pages - eng.allocator.num_free
  assert used == eng.pages_needed(len(prompt), n_new, g) == 4 + g * 2
  st, res = eng.generate_steps(params, st, n_new - 1)
  res, first = res.convert_to_numpy(), first.convert_to_numpy()
  group = {}
  for j, slot in enumerate((4, 0, 2, 1)):
    d = res.get_result_at_slot(slot)
    group[j] = np.concatenate([first.get_result_at_slot(j).tokens, d.tokens[d.valid[:, 0], 0]])
    eng.free_resource(slot)
  assert eng.allocator.num_free == eng.num_pages
  # Each sample equals the same request run alone (its own prefill, its own pages).
  for j in range(g):
    eng.init_decode_state()
    alone = _run_alone(eng, prompt, keys[j], n_new)
    np.testing.assert_array_equal(group[j], alone)
  assert len({tuple(t) for t in group.values()}) > 1  # different keys, different samples


def _run_alone(eng, prompt, key, n_new):
  _, _, params = tiny_model()
  st = eng.init_decode_state()
  prefix, first = eng.prefill_prompt(
    params, prompt, sampler=SAMPLED, rng=key[None], max_new_tokens=n_new
  )
  st = eng.insert(prefix, st, 3)
  st, res = eng.generate_steps(params, st, n_new - 1)
  d = res.convert_to_numpy().get_result_at_slot(3)
  eng.free_resource(3)
  return np.concatenate([first.convert_to_numpy().get_result_at_slot(0).tokens, d.tokens[:, 0]])


def _slot_kv(eng, st, slot, length):
  """Slot `slot`'s keys and values at positions [0, length), read back through its page table."""
  pages = eng.slot_pages[slot]
  out = []
  for k, v in zip(st.k_pages, st.v_pages, strict=True):
    kv = []
    for x in (k, v):
      held = np.asarray(x)[:, pages]  # [K, pages, page_size, H]
      kv.append(np.moveaxis(held.reshape(x.shape[0], -1, x.shape[3]), 0, 1)[:length])
    out.append(np.stack(kv))
  return np.stack(out)  # [L, 2, length, K, H]


def test_multi_group_prefill_equals_per_group_prefills():
  """Three groups (G = 3, 1, 2) of whole prompts in ONE prefill call and ONE insert: the same
  first tokens, KV pages and continuations as each group prefilled and inserted alone, and
  shared prompt pages held by every sample of their group."""
  _, _, params = tiny_model()
  prompts = [PROMPTS[13], PROMPTS[10], [9, 8, 7, 6, 5]]  # 8, 3, 5 tokens: one length bucket
  counts, n_new, seed = [3, 1, 2], 5, 11
  rids = [[100 * i + j for j in range(g)] for i, g in enumerate(counts)]
  flat = [r for ids in rids for r in ids]
  eng = _engine(6)
  st = eng.init_decode_state()
  before = eng.stats["prefill_calls"]
  batch, first = eng.prefill_batch(
    params,
    prompts,
    num_samples=counts,
    sampler=[SAMPLED] * len(flat),
    rng=np.stack([request_key(seed, r) for r in flat]),
    max_new_tokens=[n_new] * 3,
    stop_token_ids=[()] * 3,
  )
  assert eng.stats["prefill_calls"] - before == 1
  slots = [5, 0, 3, 1, 4, 2]
  st = eng.insert_batch(batch, st, slots, list(range(len(flat))))
  # Prompt 0 (8 tokens = 2 full pages) shares them among its 3 samples.
  shared = eng.slot_pages[5][:2]
  assert all(eng.slot_pages[s][:2] == shared for s in (5, 0, 3))
  assert [eng.allocator.refcount(p) for p in shared] == [3, 3]
  used = eng.num_pages - eng.allocator.num_free
  need = [eng.pages_needed(len(p), n_new, g) for p, g in zip(prompts, counts, strict=True)]
  assert used == sum(need)
  members = [(i, r) for i, ids in enumerate(rids) for r in ids]
  kv = {r: _slot_kv(eng, st, s, len(prompts[i])) for s, (i, r) in zip(slots, members, strict=True)}
  st, res = eng.generate_steps(params, st, n_new - 1)
  res, first = res.convert_to_numpy(), first.convert_to_numpy()
  got = {}
  for j, (r, s) in enumerate(zip(flat, slots, strict=True)):
    f, d = first.get_result_at_slot(j), res.get_result_at_slot(s)
    got[r] = (
      np.concatenate([f.tokens[:, 0] if f.tokens.ndim > 1 else f.tokens, d.tokens[:, 0]]),
      np.concatenate([f.log_prob.reshape(-1), d.log_prob[:, 0]]),
    )
    eng.free_resource(s)
  assert eng.allocator.num_free == eng.num_pages
  # Each group alone: its own prefill_prompt and bulk_insert.
  for prompt, ids in zip(prompts, rids, strict=True):
    st = eng.init_decode_state()
    prefix, f = eng.prefill_prompt(
      params,
      prompt,
      sampler=SAMPLED,
      rng=np.stack([request_key(seed, r) for r in ids]),
      num_samples=len(ids),
      max_new_tokens=n_new,
    )
    st = eng.bulk_insert(prefix, st, list(range(len(ids))))
    alone_kv = [_slot_kv(eng, st, j, len(prompt)) for j in range(len(ids))]
    st, res = eng.generate_steps(params, st, n_new - 1)
    res, f = res.convert_to_numpy(), f.convert_to_numpy()
    for j, r in enumerate(ids):
      d = res.get_result_at_slot(j)
      tokens = np.concatenate([f.get_result_at_slot(j).tokens.reshape(-1), d.tokens[:, 0]])
      logp = np.concatenate([f.get_result_at_slot(j).log_prob.reshape(-1), d.log_prob[:, 0]])
      np.testing.assert_array_equal(got[r][0], tokens, err_msg=str(r))
      # A 1-row and a 4-row prefill matmul may round the last bits differently (XLA CPU dot).
      np.testing.assert_allclose(got[r][1], logp, atol=2e-6, rtol=0, err_msg=str(r))
      np.testing.assert_allclose(kv[r], alone_kv[j], atol=1e-6, rtol=0, err_msg=str(r))
      eng.free_resource(j)
  assert len({tuple(got[r][0]) for r in rids[0]}) > 1  # a group's samples differ


def test_multi_group_prefill_compiles_once_per_bucket():
  """prefill_batch pads the prompt count, sample count and length to buckets: batches of other
  prompts in the same buckets reuse the program, and insert_batch compiles once per slot-count
  bucket."""
  _, _, params = tiny_model()
  eng = _engine(8, 8, 64)
  sizes = []
  for shift in range(3):
    st = eng.init_decode_state()
    lengths = [5 + (i + shift) % 3 for i in range(3)]  # 5-7 tokens: the length bucket of 8
    prompts = [[(3 * shift + i + j) % 200 + 1 for j in range(n)] for i, n in enumerate(lengths)]
    batch, _ = eng.prefill_batch(
      params,
      prompts,
      num_samples=[2, 2, 2],
      sampler=[SAMPLED] * 6,
      rng=np.stack([request_key(shift, r) for r in range(6)]),
      max_new_tokens=[4] * 3,
      stop_token_ids=[(1,)] * 3,
    )
    st = eng.insert_batch(batch, st, list(range(6)), list(range(6)))
    sizes.append((eng._prefill_jit._cache_size(), eng._insert_jit._cache_size()))
  assert sizes == [sizes[0]] * 3, sizes
  with pytest.raises(ValueError, match="at most prefill_chunk_size=8"):
    eng.prefill_batch(
      params,
      [PROMPTS[11]],
      num_samples=[1],
      sampler=[SAMPLED],
      rng=request_key(0, 0)[None],
      max_new_tokens=[4],
      stop_token_ids=[()],
    )
  with pytest.raises(ValueError, match="one sampler and one"):
    eng.prefill_batch(
      params,
      [PROMPTS[10]],
      num_samples=[2],
      sampler=[SAMPLED],
      rng=request_key(0, 0)[None],
      max_new_tokens=[4],
      stop_token_ids=[()],
    )


def test_a_fixed_prefill_batch_size_is_one_program_for_every_prompt_count():
  """With prefill_batch_prompts=4, batches of 1-4 prompts whose largest group is 2 samples share one
  prefill and one insert program (padded to 4 prompts, 8 sample rows), and draw the same
  tokens as an engine that pads each batch to its own power of two; 5 prompts are refused (a
  bad value is refused by the constructor: test_out_of_pages_and_bad_requests)."""
  cfg, graphdef, params = tiny_model()
  fixed = Engine(
    cfg, graphdef, max_concurrent_decodes=8, num_pages=64, page_size=4,
    max_prefill_length=20, prefill_chunk_size=8, max_target_length=S, prefill_batch_prompts=4,
  )  # fmt: skip
  free = _engine(8, 8, 64)
  programs = []
  for k, counts in ((3, [2, 2, 1]), (1, [2]), (4, [1, 2, 2, 1]), (2, [1, 2])):
    prompts = [[(5 * k + i + j) % 200 + 1 for j in range(5 + i % 3)] for i in range(k)]
    n = sum(counts)
    kw = dict(
      num_samples=counts,
      sampler=[SAMPLED] * n,
      rng=np.stack([request_key(k, r) for r in range(n)]),
      max_new_tokens=[4] * k,
      stop_token_ids=[()] * k,
    )
    got = []
    for eng in (fixed, free):
      st = eng.init_decode_state()
      batch, first = eng.prefill_batch(params, prompts, **kw)
      st = eng.insert_batch(batch, st, list(range(n)), list(range(n)))
      st, res = eng.generate_steps(params, st, 3)
      first, res = first.convert_to_numpy(), res.convert_to_numpy()
      got.append(
        [
          np.concatenate(
            [first.get_result_at_slot(j).tokens.reshape(-1), res.get_result_at_slot(j).tokens[:, 0]]
          )
          for j in range(n)
        ]
      )
      for j in range(n):
        eng.free_resource(j)
    np.testing.assert_array_equal(np.stack(got[0]), np.stack(got[1]), err_msg=str(counts))
    programs.append((fixed._prefill_jit._cache_size(), fixed._insert_jit._cache_size()))
  assert programs == [(1, 1)] * 4, programs
  # The power-of-two engine compiled a program for each prompt count (1, 2, 4 prompts).
  assert free._prefill_jit._cache_size() >= 3
  with pytest.raises(ValueError, match="got 5 prompts; this engine's prefill_batch_prompts is 4"):
    fixed.prefill_batch(
      params,
      [PROMPTS[10]] * 5,
      num_samples=[1] * 5,
      sampler=[SAMPLED] * 5,
      rng=np.stack([request_key(0, r) for r in range(5)]),
      max_new_tokens=[4] * 5,
      stop_token_ids=[()] * 5,
    )


def test_out_of_pages_and_bad_requests():
  _, _, params = tiny_model()
  eng = _engine(3, 8, 6)  # 6 pages of 4 tokens
  st = eng.init_decode_state()
  prefix, _ = eng.prefill_prompt(params, PROMPTS[13], sampler=GREEDY, max_new_tokens=20)
  with pytest.raises(OutOfPages, match="need 7 KV pages, 6 are free"):
    eng.insert(prefix, st, 0)
  assert eng.allocator.num_free == 6 and not eng.slot_pages  # nothing half-allocated
  with pytest.raises(
    ValueError, match="21 tokens, longer than the engine's max_prefill_length of 20"
  ):
    eng.prefill_prompt(params, list(range(3, 24)), sampler=GREEDY)
  with pytest.raises(ValueError, match="max_target_length of 40"):
    eng.prefill_prompt(params, PROMPTS[13], sampler=GREEDY, max_new_tokens=33)
  cfg, graphdef, _ = tiny_model()
  for bad, message in (
    (dict(prefill_chunk_size=12), "prefill_chunk_size"),
    (dict(prefill_batch_prompts=0), "prefill_batch_prompts must be a positive int or None"),
  ):
    with pytest.raises(ValueError, match=message):
      Engine(cfg, graphdef, max_concurrent_decodes=2, num_pages=4, max_prefill_length=8, **bad)
  with pytest.raises(ValueError, match="slot 5"):
    eng.insert(prefix, st, 5)


def test_engine_api_surface():
  eng = _engine()
  assert eng.max_concurrent_decodes == 3 and eng.samples_per_slot == 1
  assert eng.max_prefill_length == 20 and eng.prefill_chunk_size == 8
  assert eng.mesh is None and eng.colocated_cpus is None and eng.get_tokenizer() is None
  _, _, params = tiny_model()
  assert eng.load_params(params) is params  # the learner's arrays, no copy
  # One step through `generate` (not the multi-step variant) on an idle state: nothing valid.
  st, res = eng.generate(params, eng.init_decode_state())
  d = res.convert_to_numpy().get_result_at_slot(1)
  assert d.tokens.shape == (1,) and not d.valid.any()


@functools.cache
def _family_engine(family) -> Engine:
  cfg, graphdef, _ = family_model(family)
  return Engine(
    cfg,
    graphdef,
    max_concurrent_decodes=3,
    num_pages=24,
    page_size=4,
    max_prefill_length=12,
    prefill_chunk_size=8,
    max_target_length=REF_LEN,
  )


@pytest.mark.parametrize("family", list(FAMILIES))
def test_paged_decoding_matches_no_cache_and_learner_per_family(family):
  _, _, params = family_model(family)
  eng, n_new = _family_engine(family), 10
  # Four requests on three slots, so the last joins while the others are mid-sequence. Every
  # sequence runs past Gemma's window of 5 over pages of 4; Gemma's 11-token prompt is also
  # prefilled in two chunks (the other families keep to one prefill shape: one compile).
  fam_prompts = family_prompts(family, [3, 8, 1, 11 if family == "gemma3" else 6])
  schedule = [(0, 0), (1, 1), (2, 2), (3, 1)]
  ref, gap = greedy_reference(family, fam_prompts, n_new)
  assert gap > 1e-3, "argmax too close to a tie to compare two code paths"
  for sampler in (GREEDY, SamplingParams(temperature=0.9, top_p=0.95)):
    got = _run(eng, schedule, n_new, sampler, seed=2, params=params, prompts=fam_prompts)
    tokens = [got[rid][0] for rid in range(4)]
    if sampler is GREEDY:
      np.testing.assert_array_equal(np.stack(tokens), ref)
    else:
      assert any(np.any(t != r) for t, r in zip(tokens, ref, strict=True))  # really sampled
    full, valid = right_padded([p + t.tolist() for p, t in zip(fam_prompts, tokens, strict=True)])
    learner = learner_logprobs(family, full, valid, sampler.logprob_temperature)
    for rid, prompt in enumerate(fam_prompts):
      want = learner[rid, len(prompt) : len(prompt) + n_new]
      np.testing.assert_allclose(got[rid][1], want, atol=1e-5, rtol=0, err_msg=str(rid))
  assert eng.generate_compiles == 1


def test_generate_steps_stops_once_no_slot_is_active():
  """A call of 10 steps whose only request needs 3 more tokens runs 3 forwards, not 10."""
  cfg, graphdef, params = tiny_model()
  eng = Engine(
    cfg, graphdef, max_concurrent_decodes=2, num_pages=20, page_size=4, max_prefill_length=8
  )
  forwards = []
  decode_step = eng._decode_step

  def counted(p, st):
    jax.debug.callback(lambda: forwards.append(1))
    return decode_step(p, st)

  eng._decode_step = counted  # traced by the first generate_steps call below
  runs = {}
  for steps in (10, 3):
    st = eng.init_decode_state()
    prefix, _ = eng.prefill_prompt(params, PROMPTS[10], sampler=GREEDY, max_new_tokens=4)
    st = eng.insert(prefix, st, 1)
    forwards.clear()
    st, res = eng.generate_steps(params, st, steps)
    res = res.convert_to_numpy()
    eng.free_resource(1)
    assert len(forwards) == 3
    d = res.get_result_at_slot(1)
    assert d.valid[:3, 0].all() and not d.valid[3:].any()
    assert not res.get_result_at_slot(0).valid.any()  # the idle slot
    runs[steps] = d.tokens[:3, 0]
  np.testing.assert_array_equal(runs[10], runs[3])
  np.testing.assert_array_equal(runs[3], _reference_greedy(PROMPTS[10], 4)[1:])


def test_chunked_prefill_compiles_once_for_all_chunks():
  """Every chunk of a long prompt has the chunk's shape and the prompt's cache: one program."""
  cfg, graphdef, params = tiny_model()
  eng = Engine(
    cfg,
    graphdef,
    max_concurrent_decodes=2,
    num_pages=40,
    page_size=4,
    max_prefill_length=20,
    prefill_chunk_size=8,
    max_target_length=S,
  )
  for prompt in (PROMPTS[14], PROMPTS[14][::-1]):  # 17 tokens: chunks at 0, 8 and 16
    eng.prefill_prompt(params, prompt, sampler=GREEDY, max_new_tokens=4)
  assert eng.stats["prefill_calls"] == 6
  assert eng._prefill_jit._cache_size() == 1


def test_mesh_placed_params_compile_once_across_runs_with_fresh_states():
  """Params sharded over the 8 test devices: every run's fresh decode state and every chunked
  prompt's empty cache are born with the shardings the jitted calls return, so a decode step
  compiles once (even when it meets a fresh state first) and prefill / insert add no program
  after the first run; the tokens are those of the same engine off the mesh."""
  cfg, graphdef, params = tiny_model()
  mesh = make_mesh(fsdp=4, tensor=2)
  sharded = shard_params(params, mesh, "fsdp_tp")
  eng = Engine(
    cfg,
    graphdef,
    max_concurrent_decodes=3,
    num_pages=40,
    page_size=4,
    max_prefill_length=20,
    prefill_chunk_size=8,
    max_target_length=S,
    mesh=mesh,
  )
  schedule, n_new = [(10, 0), (11, 1), (12, 2), (13, 0), (14, 1)], 6  # 11 and 14 are chunked
  want = _run(_engine(), schedule, n_new, SAMPLED, seed=3)
  sizes = []
  for _ in range(3):
    fresh = eng.init_decode_state()
    eng.generate_steps(sharded, fresh, 3)  # an idle step on a fresh state
    # Donated on the mesh too: the step wrote the sharded KV pool in place, no copy of it.
    assert all(x.is_deleted() for x in jax.tree.leaves((fresh.k_pages, fresh.v_pages)))
    got = _run(eng, schedule, n_new, SAMPLED, seed=3, params=sharded)
    for rid, (tokens, logp) in want.items():
      np.testing.assert_array_equal(got[rid][0], tokens, err_msg=str(rid))
      np.testing.assert_allclose(got[rid][1], logp, atol=1e-5, rtol=0, err_msg=str(rid))
    sizes.append((eng._prefill_jit._cache_size(), eng._insert_jit._cache_size()))
  assert eng.generate_compiles == 1
  assert sizes == [sizes[0]] * 3, sizes
  prefix, _ = eng.prefill_prompt(sharded, PROMPTS[14], sampler=GREEDY, max_new_tokens=4)
  for x in jax.tree.leaves(prefix.cache):  # [1, S, K, H], K split over tensor
    assert x.sharding.mesh == mesh
    assert x.sharding.shard_shape(x.shape) == (*x.shape[:2], cfg.num_kv_heads // 2, x.shape[3])
