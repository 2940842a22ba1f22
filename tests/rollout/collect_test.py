"""GroupSampler: engine group rollouts packed as the v0 sampler's Rollout, slot-count invariant."""

import jax
import numpy as np
import pytest
from helpers import tiny_model

from jaxrl.mesh import make_mesh, shard_params
from jaxrl.rollout.collect import GroupSampler, left_pad
from jaxrl.rollout.reference import make_sampler, row_keys
from jaxrl.rollout.sampling import SamplingParams
from jaxrl.rollout.types import FINISH_REASONS, LENGTH

pytestmark = pytest.mark.integration

P, N, PAD, EOS = 8, 6, 0, 2
PROMPTS = [[1, 5, 9, 17], [1, 40, 41, 42, 43, 44, 45, 46], [1, 100]]


def _group_sampler(slots, sampling, mesh=None):
  cfg, graphdef, _ = tiny_model(1)
  return GroupSampler(
    cfg,
    graphdef,
    prompt_len=P,
    max_new_tokens=N,
    eos_ids=(EOS,),
    pad_id=PAD,
    sampling=sampling,
    max_concurrent_decodes=slots,
    page_size=4,
    steps_per_call=3,
    mesh=mesh,
  )


def test_greedy_group_rollout_equals_the_v0_sampler():
  cfg, graphdef, params = tiny_model(1)
  g = 2
  sampler = _group_sampler(6, SamplingParams(temperature=0.0))
  out, stats = sampler(params, PROMPTS, group_size=g, seed=0, version=5)
  assert stats["prefill_prompts"] == len(PROMPTS)  # one prefill per group
  assert stats["prefill_calls"] == 1  # every prompt in one length bucket: one call for all
  v0 = make_sampler(
    graphdef,
    cfg,
    prompt_len=P,
    max_new_tokens=N,
    eos_id=EOS,
    pad_id=PAD,
    sampling=SamplingParams(temperature=0.0),
  )
  toks, mask = left_pad([p for p in PROMPTS for _ in range(g)], P, PAD)
  ref = jax.device_get(v0(params, toks, mask, row_keys(jax.random.key(0), np.arange(6)), 5))
  np.testing.assert_array_equal(out.prompt_tokens, ref.prompt_tokens)
  np.testing.assert_array_equal(out.prompt_mask, ref.prompt_mask)
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  np.testing.assert_array_equal(out.mask, ref.mask)
  np.testing.assert_array_equal(out.lengths, ref.lengths)
  np.testing.assert_array_equal(out.truncated, ref.truncated)
  np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-5)
  # Both stamp every sampled token with the version and say why each row ended.
  np.testing.assert_array_equal(out.versions, np.where(out.mask, 5, -1))
  np.testing.assert_array_equal(out.versions, ref.versions)
  np.testing.assert_array_equal(out.finish_reason, ref.finish_reason)
  assert {FINISH_REASONS[r] for r in out.finish_reason} <= {"stop", "length"}
  np.testing.assert_array_equal(out.finish_reason == LENGTH, out.truncated)


def test_sampled_rollout_does_not_depend_on_slot_count():
  _, _, params = tiny_model(1)
  sampling = SamplingParams(temperature=1.0)
  wide, _ = _group_sampler(12, sampling)(params, PROMPTS, group_size=4, seed=7)
  narrow, stats = _group_sampler(5, sampling)(params, PROMPTS, group_size=4, seed=7)
  assert stats["queued_waits"] > 0  # 12 samples through 5 slots: groups waited for slots
  for name in wide._fields:
    a, b = getattr(wide, name), getattr(narrow, name)
    if name == "logprobs":
      # Wide prefills the 3 prompts in one call, narrow one per call: the first tokens'
      # log-probs come out of a 4-row and a 1-row LM-head matmul, which XLA's CPU dot rounds
      # differently (last bits); every token, and every later log-prob, is the same.
      np.testing.assert_allclose(a, b, atol=2e-6, rtol=0, err_msg=name)
      np.testing.assert_array_equal(a[:, 1:], b[:, 1:], err_msg=name)
    else:
      np.testing.assert_array_equal(a, b, err_msg=name)
  other, _ = _group_sampler(12, sampling)(params, PROMPTS, group_size=4, seed=8)
  assert not np.array_equal(other.tokens, wide.tokens)  # the seed matters
  # Rows of a group differ (independent samples), and each row is EOS-terminated or truncated.
  assert not np.array_equal(wide.tokens[0], wide.tokens[1])
  ends_in_eos = wide.tokens[np.arange(12), np.maximum(wide.lengths - 1, 0)] == EOS
  np.testing.assert_array_equal(ends_in_eos, ~wide.truncated)


def test_mesh_placed_params_compile_once_per_shape_across_rounds():
  """Params sharded as the RL loop places them (fsdp x tensor over the 8 test devices): the
  decode state is born on the mesh with the shardings every call returns, so three rounds add
  no program after the first, and they sample exactly what the engine off the mesh does."""
  _, _, params = tiny_model(1)
  mesh = make_mesh(fsdp=4, tensor=2)
  sharded = shard_params(params, mesh, "fsdp_tp")
  sampling = SamplingParams(temperature=1.0)
  # 5 slots for 9 samples: groups queue, so freed slots are refilled mid-run.
  ref, _ = _group_sampler(5, sampling)(params, PROMPTS, group_size=3, seed=3)
  sampler = _group_sampler(5, sampling, mesh=mesh)
  eng = sampler.engine
  sizes = []
  for _ in range(3):
    out, stats = sampler(sharded, PROMPTS, group_size=3, seed=3)
    assert stats["queued_waits"] > 0
    for name in ("prompt_tokens", "tokens", "mask", "lengths", "truncated"):
      np.testing.assert_array_equal(getattr(out, name), getattr(ref, name), err_msg=name)
    np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-5, rtol=0)
    sizes.append((eng._prefill_jit._cache_size(), eng._insert_jit._cache_size()))
  assert eng.generate_compiles == 1
  assert sizes == [sizes[0]] * 3, sizes
  cfg = eng.cfg
  for st in (sampler.driver._state, eng.init_decode_state()):
    for x in st.k_pages + st.v_pages:  # [K, P, page_size, H], K split over tensor
      assert x.sharding.mesh == mesh
      assert x.sharding.shard_shape(x.shape) == (cfg.num_kv_heads // 2, *x.shape[1:])
    for x in jax.tree.leaves(st[2:]):  # per-slot vectors: replicated on the mesh
      assert x.sharding.mesh == mesh and x.sharding.is_fully_replicated
