"""Partial rollouts: complete groups only, bounded staleness, synchronous at over_provision 1,
and a buffer that survives a checkpoint (JSON) bit for bit."""

import functools
import json
import types

import jax
import numpy as np
import pytest
from helpers import tiny_model

from jaxrl.models.transformer import token_logprobs
from jaxrl.rl.partial import Member, PartialRollouts
from jaxrl.rollout.collect import GroupSampler
from jaxrl.rollout.sampling import SamplingParams
from jaxrl.rollout.types import FINISH_REASONS

pytestmark = pytest.mark.integration

P, N, PAD, EOS, G = 6, 12, 0, 2, 2
ABORT = FINISH_REASONS.index("abort")


@functools.cache
def _sampler(slots: int = 6) -> GroupSampler:
  cfg, graphdef, _ = tiny_model(1)
  return GroupSampler(
    cfg,
    graphdef,
    prompt_len=P,
    max_new_tokens=N,
    eos_ids=(EOS,),
    pad_id=PAD,
    sampling=SamplingParams(temperature=1.0),
    max_concurrent_decodes=slots,
    page_size=4,
    steps_per_call=3,
    resumable=True,
  )


def _rl(over_provision=2.0, max_age=4, prompts=2):
  partial = types.SimpleNamespace(over_provision=over_provision, max_age=max_age)
  return types.SimpleNamespace(
    group_size=G, prompts_per_step=prompts, max_new_tokens=N, partial=partial
  )


def _encode(records):
  return [[1] + [10 + (r["i"] * 7 + k) % 200 for k in range(1 + r["i"] % (P - 1))] for r in records]


class _Stream:
  """Records {"i": 0}, {"i": 1}, ... in batches of two, like the task's data stream."""

  def __init__(self):
    self.i = 0

  def __call__(self):
    out = [{"i": self.i}, {"i": self.i + 1}]
    self.i += 2
    return out


def _params(step):
  """The learner's params at `step`: moved a little every step, as by an optimizer."""
  _, _, params = tiny_model(1)
  return jax.tree.map(lambda x: x * (1.0 + 0.02 * step), params)


def _run(pr, steps, start=0, stream=None):
  stream = stream or _Stream()
  out = []
  for step in range(start, start + steps):
    out.append(pr.collect(_params(step), stream(), stream, version=step, seed=100 + step))
  return out


def test_batches_hold_complete_groups_no_staler_than_max_age():
  for max_age in (0, 1):
    pr = PartialRollouts(_sampler(), _encode, rl=_rl(max_age=max_age))
    carried = restarted = 0
    for step, (rollout, records, _, stats) in enumerate(_run(pr, 6)):
      assert rollout.tokens.shape == (2 * G, N) and len(records) == 2
      # Every row finished (none aborted), and the two rows of a group share its prompt.
      assert ABORT not in rollout.finish_reason
      np.testing.assert_array_equal(rollout.prompt_tokens[::2], rollout.prompt_tokens[1::2])
      stale = np.where(rollout.mask, step - rollout.versions, 0)
      assert stale.max() <= max_age and (rollout.versions[rollout.mask] <= step).all()
      assert stats["partial/staleness_max"] == stale.max()
      carried += stats["partial/carried_sequences"]
      restarted += stats["partial/restarted_groups"]
    assert carried > 0  # sequences really were carried across steps
    if max_age == 0:
      assert restarted > 0  # ...and, with no staleness allowed, restarted


def test_finished_rows_only_and_each_token_from_its_own_version():
  pr = PartialRollouts(_sampler(), _encode, rl=_rl(max_age=3))
  _, graphdef, _ = tiny_model(1)
  multi = 0
  for rollout, *_ in _run(pr, 5):
    assert ABORT not in rollout.finish_reason
    for row in range(rollout.tokens.shape[0]):
      n = int(rollout.lengths[row])
      versions = rollout.versions[row, :n]
      multi += len(set(versions.tolist())) > 1
      # The behaviour log-prob of each token is that of the params of its version.
      seq = np.concatenate([rollout.prompt_tokens[row], rollout.tokens[row]])[None]
      valid = np.concatenate([rollout.prompt_mask[row], rollout.mask[row]])[None]
      for v in set(versions.tolist()):
        ref = token_logprobs(graphdef, _params(v), seq, valid, temperature=1.0)
        ref = np.asarray(ref)[0, P : P + n]
        at = versions == v
        np.testing.assert_allclose(rollout.logprobs[row, :n][at], ref[at], atol=1e-5, rtol=0)
  assert multi > 0  # some row's tokens came from two policy versions


def test_over_provision_one_is_the_synchronous_sampler():
  sampler = _sampler()
  pr = PartialRollouts(sampler, _encode, rl=_rl(over_provision=1.0))
  stream = _Stream()
  records = stream()
  rollout, got_records, _, stats = pr.collect(_params(0), records, stream, version=0, seed=7)
  sync, _ = sampler(_params(0), _encode(records), group_size=G, seed=7, version=0)
  assert got_records == records and stats["partial/carried_sequences"] == 0
  for name in ("prompt_tokens", "tokens", "mask", "versions", "lengths", "finish_reason"):
    np.testing.assert_array_equal(getattr(rollout, name), getattr(sync, name))
  np.testing.assert_array_equal(rollout.logprobs, sync.logprobs)
  assert not pr.groups


def test_state_dict_survives_json_bit_for_bit():
  stream = _Stream()
  pr = PartialRollouts(_sampler(), _encode, rl=_rl())
  step = 0
  while not any(m.reason is None and m.tokens for g in pr.groups for m in g.members):
    _run(pr, 1, step, stream)  # until sequences are carried mid-way
    step += 1
    assert step < 8
  state = pr.state_dict()
  restored = PartialRollouts(_sampler(), _encode, rl=_rl())
  restored.load_state_dict(json.loads(json.dumps(state)))
  assert restored.state_dict() == state
  for a, b in zip(pr.groups, restored.groups, strict=True):
    for ma, mb in zip(a.members, b.members, strict=True):
      np.testing.assert_array_equal(
        np.asarray(ma.logprobs, np.float32).view(np.uint32),
        np.asarray(mb.logprobs, np.float32).view(np.uint32),
      )
  twin = _Stream()
  twin.i = stream.i
  (a, ra, _, sa), (b, rb, _, sb) = _run(pr, 1, step, stream)[0], _run(restored, 1, step, twin)[0]
  assert sa["partial/resumed_sequences"] > 0
  assert ra == rb and sa == sb
  for name in a._fields:
    np.testing.assert_array_equal(getattr(a, name), getattr(b, name))


def test_a_checkpoint_of_another_group_size_is_refused():
  pr = PartialRollouts(_sampler(), _encode, rl=_rl())
  _run(pr, 1)
  state = pr.state_dict()
  other = _rl()
  other.group_size = 3
  with pytest.raises(ValueError, match="rl.group_size is 3"):
    PartialRollouts(_sampler(), _encode, rl=other).load_state_dict(state)
  with pytest.raises(ValueError, match="malformed"):
    PartialRollouts(_sampler(), _encode, rl=_rl()).load_state_dict({"groups": []})


@pytest.mark.parametrize("experts", [8, 300])
def test_member_routes_round_trip_json_compactly(experts):
  # Routes [positions, L, k] (-1 = not fed) are kept in the narrowest int dtype and written as
  # base64 bytes: the same array comes back, at a fraction of a nested list's JSON size.
  rng = np.random.default_rng(0)
  routes = rng.integers(-1, experts, size=(37, 4, 2)).astype(np.int32)
  fields = dict(tokens=[5, 6], logprobs=[-0.5, -1.25], versions=[0, 1], key=[1, 2])
  # Nested lists (how checkpoints before the compact form stored them) load, narrowed.
  m = Member.from_json({**fields, "routes": routes.tolist()})
  narrow = np.int8 if experts <= 127 else np.int16
  assert m.routes.dtype == narrow
  text = json.dumps(m.to_json())
  back = Member.from_json(json.loads(text))
  assert back.routes.dtype == narrow and back.route_array().dtype == np.int32
  np.testing.assert_array_equal(back.route_array(), routes)
  assert (back.tokens, back.logprobs, back.key) == (m.tokens, m.logprobs, m.key)
  assert len(text) < 0.7 * len(json.dumps(routes.tolist()))
  with pytest.raises(ValueError):  # 1 byte where 3 int8s were promised
    Member.from_json({**fields, "routes": {"dtype": "int8", "shape": [3], "b64": "AA=="}})
