"""Expert parallelism (mesh.expert): experts split over the 'expert' mesh axis, tokens sent to
their experts' devices by all-to-all. On 8 simulated devices the dispatch, its gradients and a
whole MoE model's forward equal the unsharded ones, however unbalanced the routing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import numpy_model

from configs import grpo_arith
from jaxrl import mesh as meshlib
from jaxrl.config import ConfigError, validate
from jaxrl.models import ModelConfig
from jaxrl.models.moe import expert_parallel_size, moe_dispatch, moe_dispatch_ep, route
from jaxrl.models.transformer import apply, positions_from_mask
from jaxrl.rl.loop import Trainer
from jaxrl.rollout.driver import Driver, Request
from jaxrl.rollout.engine import Engine
from jaxrl.rollout.sampling import SamplingParams

pytestmark = pytest.mark.integration

RULES = meshlib.get_rules("fsdp_tp")
P = jax.sharding.PartitionSpec


def _inputs(seed, b=3, t=5, d=12, f=10, e=8, k=2, skew=False):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((b, t, d)).astype(np.float32)
  logits = rng.standard_normal((b, t, e)).astype(np.float32)
  if skew:  # every token's top 2 on the first device's experts (0 and 1): maximal imbalance
    logits[..., :2] += 20.0
  weights, experts = route(jnp.asarray(logits), k, True)
  gate, up = (0.3 * rng.standard_normal((e, d, f)).astype(np.float32) for _ in range(2))
  down = 0.3 * rng.standard_normal((e, f, d)).astype(np.float32)
  return jnp.asarray(x), weights, experts, jnp.asarray(gate), jnp.asarray(up), jnp.asarray(down)


def test_an_expert_axis_only_where_asked_and_the_rules_use_it():
  plain = meshlib.make_mesh(fsdp=-1)
  assert plain.axis_names == meshlib.MESH_AXES and expert_parallel_size(plain) == 1
  mesh = meshlib.make_mesh(data=1, fsdp=2, expert=4)
  assert dict(mesh.shape) == {"data": 1, "fsdp": 2, "expert": 4, "tensor": 1}
  assert expert_parallel_size(mesh) == 4
  spec = lambda axes, shape, m: meshlib.logical_to_spec(axes, RULES, shape=shape, mesh=m)  # noqa: E731
  # Experts over expert x fsdp where that divides, else expert alone; the batch over all three.
  moe = ("experts", "embed", "mlp")
  assert spec(moe, (8, 12, 10), mesh) == P(("expert", "fsdp"), None, "tensor")
  assert spec(moe, (4, 12, 10), mesh) == P("expert", "fsdp", "tensor")
  assert spec(("batch", "length"), (16, 3), mesh) == P(("data", "fsdp", "expert"), None)
  assert spec(("batch", "length"), (2, 3), mesh) == P(("data", "fsdp"), None)
  # Without the axis the table reads as before.
  assert spec(moe, (8, 12, 10), plain) == P("fsdp", None, "tensor")
  assert spec(("batch",), (16,), plain) == P(("data", "fsdp"))
  with pytest.raises(ValueError, match="mesh.expert=0"):
    meshlib.make_mesh(expert=0)


@pytest.mark.parametrize("skew", [False, True], ids=["balanced", "all_on_one_device"])
def test_expert_parallel_dispatch_and_gradients_equal_the_unsharded_ones(skew):
  args = _inputs(0, skew=skew)
  mesh = meshlib.make_mesh(data=1, fsdp=2, expert=4)

  def loss(fn, *a):
    return jnp.sum(jnp.sin(fn(*a)))

  want = jax.jit(moe_dispatch)(*args)
  want_g = jax.jit(jax.grad(lambda *a: loss(moe_dispatch, *a), argnums=(0, 1, 3, 4, 5)))(*args)
  with meshlib.use_mesh(mesh, RULES):
    got = jax.jit(moe_dispatch_ep)(*args)
    got_g = jax.jit(jax.grad(lambda *a: loss(moe_dispatch_ep, *a), argnums=(0, 1, 3, 4, 5)))(*args)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)
  for a, b in zip(got_g, want_g, strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)


def test_a_moe_model_on_an_expert_parallel_mesh_gives_the_unsharded_logits():
  cfg = ModelConfig.tiny().replace(num_experts=8, experts_per_token=2, moe_mlp_dim=22)
  graphdef, params = numpy_model(cfg, seed=1)
  tokens = jax.random.randint(jax.random.key(0), (4, 7), 3, cfg.vocab_size)
  valid = jnp.ones((4, 7), bool).at[1, :3].set(False)
  pos = positions_from_mask(valid)
  forward = jax.jit(apply, static_argnums=0)
  want, _ = forward(graphdef, params, tokens, pos, valid)
  mesh = meshlib.make_mesh(data=1, fsdp=2, expert=4)
  sharded = meshlib.shard_params(params, mesh, RULES)
  gate = sharded["layers"][0]["mlp"]["gate"][...]
  assert gate.sharding.spec[0] == ("expert", "fsdp")  # each device holds one expert
  with meshlib.use_mesh(mesh, RULES):
    got, _ = forward(graphdef, sharded, tokens, pos, valid)
    program = str(jax.make_jaxpr(apply, static_argnums=0)(graphdef, sharded, tokens, pos, valid))
  assert program.count("all_to_all") == 3 * cfg.num_layers  # there and back, and the expert ids
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
  "preset, expert, message",
  [
    ("tiny", 2, r"config\.mesh\.expert=2 is invalid; allowed: 1 for a dense model"),
    ("tiny_moe", 2, r"config\.mesh\.expert=2 is invalid; allowed: a divisor of the model's 5"),
  ],
)
def test_an_expert_axis_the_model_cannot_use_is_a_config_error(
  tmp_path, monkeypatch, preset, expert, message
):
  from jaxrl.rl import components

  def no_weights(*_, **__):
    raise AssertionError("weights drawn before the model's config was checked")

  # The model's config is checked before any weight is drawn (or read from a checkpoint).
  monkeypatch.setattr(components, "make_model", no_weights)
  c = grpo_arith.get_config("smoke")
  c.workdir, c.model.preset, c.mesh.expert = str(tmp_path), preset, expert
  with pytest.raises(ConfigError, match=message):
    Trainer(validate(c), log=lambda *_: None)


def test_the_engine_decodes_the_same_tokens_on_an_expert_parallel_mesh():

  cfg = ModelConfig.tiny().replace(num_experts=8, experts_per_token=2, moe_mlp_dim=22)
  graphdef, params = numpy_model(cfg, seed=2)
  mesh = meshlib.make_mesh(data=1, fsdp=2, expert=4)
  reqs = [
    Request([1, 5, 9, 17][: 2 + i], i, sampling=SamplingParams(temperature=0.0), max_new_tokens=6)
    for i in range(3)
  ]

  def run(mesh):
    eng = Engine(
      cfg, graphdef, max_concurrent_decodes=3, num_pages=12, page_size=4, max_prefill_length=8,
      max_target_length=16, mesh=mesh, rules=RULES,
    )  # fmt: skip
    p = params if mesh is None else meshlib.shard_params(params, mesh, RULES)
    if mesh is None:
      return Driver(eng, steps_per_call=2, eos_id=None).run(p, reqs).finished
    with meshlib.use_mesh(mesh, RULES):  # as the RL phase runs it: experts dispatched by EP
      return Driver(eng, steps_per_call=2, eos_id=None).run(p, reqs).finished

  want = {c.request_id: c for c in run(None)}
  got = {c.request_id: c for c in run(mesh)}
  for rid, c in want.items():
    np.testing.assert_array_equal(got[rid].tokens, c.tokens)
    np.testing.assert_allclose(got[rid].logprobs, c.logprobs, atol=1e-5, rtol=0)
