"""Routing replay in the RL loss (rl.rollout.routes): the agreement metric by hand, replay of the
learner's own routes changing nothing, replay of other routes moving the loss but not the
reported agreement, and a MoE run with partial rollouts whose carried routes survive a resume."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fixtures import smoke_configdict
from helpers import numpy_model, rl_metric_lines
from moe_aux_test import CFG, _batch

from configs import grpo_arith
from jaxrl.config import ConfigError, validate
from jaxrl.models.transformer import apply_with_routing, positions_from_mask
from jaxrl.rl.loop import Trainer
from jaxrl.rl.objectives import PolicyLoss, route_agreement

pytestmark = pytest.mark.integration


def test_route_agreement_by_hand():
  own = np.array([[[[0, 1], [2, 3], [4, 0]]], [[[1, 0], [2, 4], [4, 0]]]])  # [L=2, B=1, T=3, k=2]
  rec = np.array([[[[1, 0], [1, 0]], [[2, 4], [3, 2]], [[-1, -1], [-1, -1]]]])  # [B, T, L, k]
  valid = np.array([[True, True, True]])
  m = route_agreement(jnp.asarray(own), jnp.asarray(rec), jnp.asarray(valid))
  # Layer 0: {0,1} vs {1,0} -> 1; {2,3} vs {2,4} -> 1/2; position 2 not recorded.
  # Layer 1: {1,0} vs {1,0} -> 1; {2,4} vs {3,2} -> 1/2.
  for key, want in (("moe/route_agree_l0", 0.75), ("moe/route_agree_l1", 0.75)):
    s, n = (float(x) for x in m[key])
    assert n == 2 and s / n == want, key
  s, n = (float(x) for x in m["moe/route_agree"])
  assert (s, n) == (3.0, 4.0)


def test_replaying_the_learners_own_routes_leaves_loss_and_gradients_unchanged():
  graphdef, params = numpy_model(CFG, 0)
  batch = _batch(0, zero_advantage=False)
  _, _, routing = apply_with_routing(
    graphdef, params, batch.tokens, positions_from_mask(batch.valid), batch.valid
  )
  own = jnp.moveaxis(routing["experts"], 0, 2).astype(jnp.int8)
  own = jnp.where(batch.valid[..., None, None], own, -1)
  plain = PolicyLoss(graphdef)
  grad = lambda loss, b: jax.jit(jax.value_and_grad(loss, has_aux=True))(params, b)  # noqa: E731
  (want, _), want_g = grad(plain, batch)
  for mode in ("record", "replay"):
    (got, metrics), got_g = grad(PolicyLoss(graphdef, routes=mode), batch._replace(routes=own))
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g), strict=True):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
    s, n = (float(x) for x in metrics["moe/route_agree"])
    assert n == float(jnp.sum(batch.valid)) * CFG.num_layers and s == n
  # Other routes: replay moves the loss (and the router still learns), record does not; the
  # agreement reported is the learner's own router against them either way.
  other = jnp.where(own >= 0, (own + 1) % CFG.num_experts, -1).astype(jnp.int8)
  (moved, metrics), g = grad(PolicyLoss(graphdef, routes="replay"), batch._replace(routes=other))
  assert abs(float(moved) - float(want)) > 1e-4
  router = [v for p, v in jax.tree_util.tree_leaves_with_path(g) if "router" in str(p)]
  assert router and all(np.abs(np.asarray(v)).max() > 0 for v in router)
  (same, metrics2), _ = grad(PolicyLoss(graphdef, routes="record"), batch._replace(routes=other))
  np.testing.assert_allclose(float(same), float(want), rtol=1e-6)
  for m in (metrics, metrics2):
    s, n = (float(x) for x in m["moe/route_agree"])
    assert 0 < s / n < 1


def _config(workdir, routes, **rl):
  c = smoke_configdict(
    workdir,
    model={"preset": "tiny_moe"},
    sft={"steps": 10},
    eval={"every": 0, "num_examples": 8},
    rl={"steps": 4, "rollout": {"routes": routes}},
    checkpoint={"every": 2},
  )
  c.rl.update(rl)  # on top of the rl defaults above, nested sections key by key
  return validate(c)


PARTIAL = {
  "partial": {"enabled": True, "over_provision": 2.0, "max_age": 2},
  "rollout": {"steps_per_call": 2, "routes": "replay"},
}


@pytest.mark.e2e
def test_a_moe_run_with_partial_rollouts_replays_routes_and_resumes_exactly(tmp_path):
  full = Trainer(_config(tmp_path / "full", "replay", **PARTIAL), log=lambda *_: None)
  assert full.sampler.engine.routes_shape == (CFG.num_layers, CFG.experts_per_token)
  full.run()
  full_params = jax.device_get(full.state.policy.params)
  full.close()
  part = Trainer(_config(tmp_path / "part", "replay", **PARTIAL), log=lambda *_: None)
  part.run(until=2)
  part.close()
  resumed = Trainer(_config(tmp_path / "part", "replay", **PARTIAL), log=lambda *_: None)
  resumed.run()
  resumed_params = jax.device_get(resumed.state.policy.params)
  resumed.close()
  lines = rl_metric_lines(tmp_path / "full")
  assert rl_metric_lines(tmp_path / "part") == lines
  for a, b in zip(jax.tree.leaves(full_params), jax.tree.leaves(resumed_params), strict=True):
    np.testing.assert_array_equal(a, b)
  assert lines[1]["partial/carried_sequences"] > 0 and lines[2]["partial/resumed_sequences"] > 0
  # Step 0 trains on rollouts of the weights it holds: the routers agree (up to the odd
  # near-tie between a decode step and the learner's full forward); later batches hold tokens
  # routed by older versions.
  assert lines[0]["moe/route_agree"] > 0.99
  for line in lines:
    assert 0.5 < line["moe/route_agree"] <= 1.0
    assert {f"moe/route_agree_l{i}" for i in range(CFG.num_layers)} <= set(line)


def test_routes_on_a_dense_model_are_a_config_error(tmp_path):
  c = grpo_arith.get_config("smoke")
  c.workdir, c.model.preset = str(tmp_path), "tiny"
  c.rl.rollout.routes = "record"
  with pytest.raises(ConfigError, match=r"config\.rl\.rollout\.routes='record' is invalid.*no MoE"):
    Trainer(validate(c), log=lambda *_: None)
