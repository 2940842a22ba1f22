"""Captured MoE routes (routing replay, R3): the engine records the experts of every position it
feeds, the driver keeps them per sequence (across partial-rollout resumes), the rollout aligns
them with the learner's tokens; they equal the learner's own routing under the same weights."""

import functools

import jax
import numpy as np
import pytest
from helpers import numpy_model

from jaxrl.models import ModelConfig
from jaxrl.models.transformer import apply_with_routing, positions_from_mask
from jaxrl.rl.batch import rollout_columns
from jaxrl.rollout.collect import GroupSampler
from jaxrl.rollout.driver import Driver, Request, Resume
from jaxrl.rollout.engine import Engine
from jaxrl.rollout.sampling import SamplingParams

pytestmark = pytest.mark.integration

S = 40
SAMPLED = SamplingParams(temperature=1.0)
_routing = jax.jit(apply_with_routing, static_argnums=0)


@functools.cache
def _model():
  cfg = ModelConfig.tiny().replace(num_experts=5, experts_per_token=2, moe_mlp_dim=22)
  return (cfg, *numpy_model(cfg, seed=3))


@functools.cache
def _engine() -> Engine:
  cfg, graphdef, _ = _model()
  return Engine(
    cfg,
    graphdef,
    max_concurrent_decodes=4,
    num_pages=40,
    page_size=4,
    max_prefill_length=S - 1,
    prefill_chunk_size=8,  # prompts past 8 tokens (and long resumes) prefill in chunks
    max_target_length=S,
    capture_routes=True,
  )


def _learner_routes(params, seq):
  """The learner's own top-k experts at every position of `seq`: [len, L, k]."""
  _, graphdef, _ = _model()
  tokens = np.zeros((1, S), np.int32)
  tokens[0, : len(seq)] = seq
  valid = np.arange(S)[None] < len(seq)
  _, _, routing = _routing(graphdef, params, tokens, positions_from_mask(valid), valid)
  return np.moveaxis(np.asarray(routing["experts"]), 0, 2)[0, : len(seq)]


def _requests():
  prompts = [[1, 5, 9, 17], list(range(20, 31)), [1, 100, 7]]  # the second: two chunks
  reqs, rid = [], 0
  for k, p in enumerate(prompts):
    for _ in range(2):
      reqs.append(Request(p, rid, group_id=k, sampling=SAMPLED, max_new_tokens=12))
      rid += 1
  return reqs


def _check(c, params):
  seq = list(c.prompt_tokens) + list(c.tokens)
  assert c.routes.shape == (len(seq) - 1, 2, 2) and c.routes.dtype == np.int32
  np.testing.assert_array_equal(c.routes, _learner_routes(params, seq)[: len(seq) - 1])


def test_captured_routes_equal_the_learners_own_routing():
  _, _, params = _model()
  res = Driver(_engine(), steps_per_call=3, eos_id=2).run(params, _requests(), seed=1)
  assert len(res.finished) == 6
  for c in res.finished:
    _check(c, params)


def test_a_resumed_sequence_keeps_the_routes_recorded_before_the_cut():
  cfg, graphdef, params = _model()
  eng = _engine()
  driver = Driver(eng, steps_per_call=3, eos_id=None)
  reqs = {r.request_id: r for r in _requests()}
  turns = iter(range(100))
  first = driver.run(params, list(reqs.values()), seed=1, stop_when=lambda _: next(turns) == 2)
  assert first.partial
  # Stage 2 runs under other weights: its fresh positions route as those weights do, the
  # positions fed before the cut keep stage 1's routes.
  _, params2 = numpy_model(cfg, seed=4)
  resumed = [
    Request(
      reqs[c.request_id].prompt,
      c.request_id,
      sampling=SAMPLED,
      max_new_tokens=12,
      resume=Resume(c.tokens, c.logprobs, c.versions, c.key, c.routes),
    )
    for c in first.partial
  ]
  second = driver.run(params2, resumed + first.unstarted, seed=1)
  by_id = {c.request_id: c for c in second.finished}
  for c in first.partial:
    done = by_id[c.request_id]
    cut = len(c.routes)  # positions fed in stage 1
    np.testing.assert_array_equal(done.routes[:cut], c.routes)
    seq = list(done.prompt_tokens) + list(done.tokens)
    np.testing.assert_array_equal(done.routes[:cut], _learner_routes(params, seq)[:cut])
    np.testing.assert_array_equal(
      done.routes[cut:], _learner_routes(params2, seq)[cut : len(seq) - 1]
    )
  with pytest.raises(ValueError, match="routes for 1 positions"):
    c = first.partial[0]
    bad = Resume(c.tokens, c.logprobs, c.versions, c.key, c.routes[:1])
    driver.run(params, [Request(reqs[c.request_id].prompt, 99, max_new_tokens=12, resume=bad)])


def test_rollout_routes_line_up_with_the_learners_tokens():
  cfg, graphdef, params = _model()
  sampler = GroupSampler(
    cfg,
    graphdef,
    prompt_len=12,
    max_new_tokens=8,
    eos_ids=(2,),
    pad_id=0,
    sampling=SAMPLED,
    max_concurrent_decodes=6,
    page_size=4,
    steps_per_call=3,
    capture_routes=True,
  )
  rollout, _ = sampler(params, [[1, 5, 9], [1, 7, 8, 9, 10, 11]], group_size=3, seed=2)
  assert rollout.routes.shape == (6, 20, 2, 2) and rollout.routes.dtype == np.int8
  cols = rollout_columns(rollout)
  tokens, valid = cols["tokens"], cols["valid"]
  _, _, routing = _routing(graphdef, params, tokens, positions_from_mask(valid), valid)
  own = np.moveaxis(np.asarray(routing["experts"]), 0, 2)
  fed = valid.copy()
  last = valid.shape[1] - 1 - np.argmax(valid[:, ::-1], axis=1)  # each row's last token
  fed[np.arange(6), last] = False
  np.testing.assert_array_equal(rollout.routes[fed], own[fed])
  assert np.all(rollout.routes[~fed] == -1)


def test_capture_routes_needs_an_moe_model():
  cfg, graphdef = ModelConfig.tiny(), None
  with pytest.raises(ValueError, match="needs an MoE model"):
    Engine(cfg, graphdef, max_concurrent_decodes=1, num_pages=4, max_prefill_length=4,
           max_target_length=16, capture_routes=True)  # fmt: skip
