"""Tests for jaxrl.mesh on 8 simulated CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl import mesh as meshlib

FSDP_TP = meshlib.get_rules("fsdp_tp")


def test_eight_devices():
  assert jax.device_count() == 8


@pytest.mark.parametrize(
  "kwargs, shape",
  [
    (dict(), {"data": 1, "fsdp": 8, "tensor": 1}),
    (dict(fsdp=-1, tensor=2), {"data": 1, "fsdp": 4, "tensor": 2}),
    (dict(data=2, fsdp=2, tensor=-1), {"data": 2, "fsdp": 2, "tensor": 2}),
    (dict(data=-1, fsdp=1, tensor=4), {"data": 2, "fsdp": 1, "tensor": 4}),
    (dict(data=2, fsdp=4, tensor=1), {"data": 2, "fsdp": 4, "tensor": 1}),
  ],
)
def test_make_mesh_sizes(kwargs, shape):
  mesh = meshlib.make_mesh(**kwargs)
  assert mesh.axis_names == meshlib.MESH_AXES
  assert dict(mesh.shape) == shape
  assert mesh.axis_types == (AxisType.Auto,) * 3


def test_make_mesh_on_device_subset():
  mesh = meshlib.make_mesh(fsdp=-1, tensor=2, devices=jax.devices()[:4])
  assert dict(mesh.shape) == {"data": 1, "fsdp": 2, "tensor": 2}
  assert mesh.devices.size == 4


@pytest.mark.parametrize(
  "kwargs, match",
  [
    (dict(data=0), r"mesh\.data=0 .*8 devices"),
    (dict(tensor=-2), r"mesh\.tensor=-2 .*8 devices"),
    (dict(data=-1, fsdp=-1), r"mesh\.data, mesh\.fsdp.*8 devices"),
    (dict(fsdp=-1, tensor=3), r"mesh\.fsdp=-1 cannot be inferred.*3.*8 devices"),
    (dict(data=2, fsdp=2, tensor=1), r"mesh\.data=2 \* mesh\.fsdp=2 \* mesh\.tensor=1 = 4.*8"),
  ],
)
def test_make_mesh_bad_sizes(kwargs, match):
  with pytest.raises(ValueError, match=match):
    meshlib.make_mesh(**kwargs)


def test_get_rules_unknown_lists_valid_names():
  with pytest.raises(ValueError, match=r"'nope'.*fsdp_tp.*replicated"):
    meshlib.get_rules("nope")


def test_logical_to_spec_mappings():
  spec = meshlib.logical_to_spec(("embed", "mlp"), FSDP_TP)
  assert spec == P("fsdp", "tensor")
  spec = meshlib.logical_to_spec(("batch", "length", "act_embed"), FSDP_TP)
  assert spec == P(("data", "fsdp"), None, None)
  assert meshlib.logical_to_spec(("norm",), "fsdp_tp") == P(None)
  assert meshlib.logical_to_spec((None, "q_heads"), FSDP_TP) == P(None, "tensor")
  assert meshlib.logical_to_spec(("embed", "mlp"), "replicated") == P(None, None)


def test_logical_to_spec_duplicate_mesh_axis_goes_to_later_dim_none():
  fallbacks = []
  # mlp and vocab both map to tensor; the later dim must not reuse it.
  spec = meshlib.logical_to_spec(("mlp", "vocab"), FSDP_TP, fallbacks=fallbacks)
  assert spec == P("tensor", None)
  assert len(fallbacks) == 1 and "dim 1 'vocab'" in fallbacks[0] and "already used" in fallbacks[0]
  # batch takes fsdp too, so embed after it is replicated.
  assert meshlib.logical_to_spec(("batch", "embed"), FSDP_TP) == P(("data", "fsdp"), None)


def test_logical_to_spec_indivisible_falls_back_to_replicated():
  mesh = meshlib.make_mesh(data=1, fsdp=4, tensor=2)
  fallbacks = []
  spec = meshlib.logical_to_spec(
    ("embed", "mlp"), FSDP_TP, shape=(7, 12), mesh=mesh, fallbacks=fallbacks
  )
  assert spec == P(None, "tensor")
  assert fallbacks == ["dim 0 'embed' -> replicated: size 7 not divisible by fsdp=4"]
  spec = meshlib.logical_to_spec(("embed", "mlp"), FSDP_TP, shape=(8, 5), mesh=mesh)
  assert spec == P("fsdp", None)
  # No shape: no divisibility check.
  assert meshlib.logical_to_spec(("embed", "mlp"), FSDP_TP, mesh=mesh) == P("fsdp", "tensor")


def test_logical_to_spec_tries_later_rules_for_same_name():
  rules = (("batch", ("data", "fsdp")), ("batch", "data"))
  mesh = meshlib.make_mesh(data=2, fsdp=4, tensor=1)
  assert meshlib.logical_to_spec(("batch",), rules, shape=(16,), mesh=mesh) == P(("data", "fsdp"))
  fallbacks = []
  spec = meshlib.logical_to_spec(("batch",), rules, shape=(6,), mesh=mesh, fallbacks=fallbacks)
  assert spec == P("data")
  assert fallbacks == ["dim 0 'batch' -> data: size 6 not divisible by data+fsdp=8"]


def test_expert_weights_split_over_experts_or_fall_back_to_embed():
  mesh = meshlib.make_mesh(1, 4, 2)
  axes = ("experts", "embed", "mlp")  # MoE gate/up [E, D, F]
  assert meshlib.logical_to_spec(axes, FSDP_TP, shape=(8, 48, 22), mesh=mesh) == P(
    "fsdp", None, "tensor"
  )
  # 5 experts do not divide over fsdp=4: the model dim takes fsdp, as in a dense MLP.
  fallbacks = []
  spec = meshlib.logical_to_spec(axes, FSDP_TP, shape=(5, 48, 22), mesh=mesh, fallbacks=fallbacks)
  assert spec == P(None, "fsdp", "tensor")
  assert fallbacks == ["dim 0 'experts' -> replicated: size 5 not divisible by fsdp=4"]
  assert meshlib.logical_to_spec(axes, "replicated", shape=(8, 48, 22), mesh=mesh) == P(
    None, None, None
  )


def test_logical_to_spec_errors():
  with pytest.raises(ValueError, match="'nonsense'"):
    meshlib.logical_to_spec(("embed", "nonsense"), FSDP_TP)
  with pytest.raises(ValueError, match="do not match shape"):
    meshlib.logical_to_spec(("embed",), FSDP_TP, shape=(2, 3))
  mesh = meshlib.make_mesh()
  with pytest.raises(ValueError, match="'pipeline'"):
    meshlib.logical_to_spec(("experts",), (("experts", "pipeline"),), mesh=mesh)
  # 'expert' is optional: a mesh without it skips the candidate (tests/models/expert_parallel).
  assert meshlib.logical_to_spec(("experts",), (("experts", "expert"),), mesh=mesh) == P(None)


class Tiny(nnx.Module):
  """Params with and without `axes`, including odd sizes that no mesh axis divides."""

  def __init__(self):
    rng = np.random.default_rng(0)
    self.w = nnx.Param(jnp.asarray(rng.normal(size=(8, 12)), jnp.float32), axes=("embed", "mlp"))
    self.odd = nnx.Param(jnp.asarray(rng.normal(size=(7, 6)), jnp.float32), axes=("embed", "mlp"))
    self.down = nnx.Param(jnp.asarray(rng.normal(size=(12, 8)), jnp.float32), axes=("mlp", "embed"))
    self.scale = nnx.Param(jnp.ones((8,), jnp.float32), axes=("norm",))
    self.bare = nnx.Param(jnp.arange(5.0))
    self.blocks = nnx.List(
      [nnx.Dict(q=nnx.Param(jnp.ones((8, 3, 5)), axes=("embed", "q_heads", "head_dim")))]
    )


EXPECTED_SPECS = {
  "w": P("fsdp", "tensor"),
  "odd": P(None, "tensor"),
  "down": P("tensor", "fsdp"),
  "scale": P(None),
  "bare": P(),
  "blocks/0/q": P("fsdp", None, None),
}


def _by_path(tree):
  """Leaves keyed by 'a/b/c' path, with nnx Variables unwrapped."""
  is_var = lambda x: isinstance(x, nnx.Variable)
  leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_var)[0]
  return {
    meshlib.path_str(path): leaf.get_value() if is_var(leaf) else leaf for path, leaf in leaves
  }


def test_param_shardings_and_shard_params():
  mesh = meshlib.make_mesh(fsdp=4, tensor=2)
  _, params = nnx.split(Tiny())
  shardings = meshlib.param_shardings(params, mesh, FSDP_TP)
  # Same plain-pytree structure as params, so it feeds device_put / jit shardings directly.
  assert jax.tree.structure(shardings) == jax.tree.structure(params)
  assert {k: s.spec for k, s in _by_path(shardings).items()} == EXPECTED_SPECS

  sharded = meshlib.shard_params(params, mesh, FSDP_TP)
  assert isinstance(sharded, nnx.State)
  arrays = _by_path(sharded)
  for path, spec in EXPECTED_SPECS.items():
    assert arrays[path].sharding.spec == spec, path
    assert arrays[path].sharding.mesh == mesh
  np.testing.assert_array_equal(arrays["w"], _by_path(params)["w"])
  # The sharded state loads back into a module.
  model = Tiny()
  nnx.update(model, sharded)
  assert model.w.get_value().sharding.spec == P("fsdp", "tensor")


def test_param_shardings_on_abstract_state():
  mesh = meshlib.make_mesh(fsdp=4, tensor=2)
  params = nnx.state(nnx.eval_shape(Tiny))
  shardings = meshlib.param_shardings(params, mesh, FSDP_TP)
  assert {k: s.spec for k, s in _by_path(shardings).items()} == EXPECTED_SPECS


def test_param_shardings_bad_axes_names_the_param():
  class Bad(nnx.Module):
    def __init__(self):
      self.w = nnx.Param(jnp.zeros((2, 3)), axes=("embed",))

  mesh = meshlib.make_mesh()
  with pytest.raises(ValueError, match="param w"):
    meshlib.param_shardings(nnx.state(Bad()), mesh, FSDP_TP)


def test_describe_shardings():
  mesh = meshlib.make_mesh(fsdp=4, tensor=2)
  lines = meshlib.describe_shardings(nnx.state(Tiny()), mesh, "fsdp_tp")
  assert len(lines) == len(EXPECTED_SPECS)
  odd = next(line for line in lines if line.startswith("odd "))
  assert "(7, 6)" in odd and "('embed', 'mlp')" in odd and "tensor" in odd
  assert "fallback" in odd and "size 7 not divisible by fsdp=4" in odd
  w = next(line for line in lines if line.startswith("w "))
  assert "fallback" not in w


def _mlp(w, down, x):
  h = meshlib.logical_constraint(x @ w, ("batch", "act_mlp"))
  h = jax.nn.gelu(h)
  return meshlib.logical_constraint(h @ down, ("batch", "act_embed"))


def test_logical_constraint_is_noop_without_mesh():
  x = jnp.ones((4, 8))
  assert meshlib.logical_constraint(x, ("batch", "act_embed")) is x


def test_logical_constraint_under_use_mesh_matches_unsharded():
  model = Tiny()
  w, down = model.w.get_value(), model.down.get_value()
  x = jnp.asarray(np.random.default_rng(1).normal(size=(16, 8)), jnp.float32)
  expected = jax.jit(_mlp)(w, down, x)
  np.testing.assert_allclose(expected, jax.nn.gelu(x @ w) @ down, rtol=1e-6, atol=1e-6)

  mesh = meshlib.make_mesh(data=2, fsdp=2, tensor=2)
  sharded = meshlib.shard_params(nnx.state(model), mesh, FSDP_TP)
  xs = jax.device_put(x, meshlib.named_sharding(mesh, ("batch", "act_embed"), FSDP_TP))
  with meshlib.use_mesh(mesh, FSDP_TP):
    assert meshlib.active_rules() == FSDP_TP
    got = jax.jit(_mlp)(sharded["w"].get_value(), sharded["down"].get_value(), xs)
  assert meshlib.active_rules() is None
  assert got.sharding.is_equivalent_to(NamedSharding(mesh, P(("data", "fsdp"), None)), got.ndim)
  np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_logical_constraint_with_mesh_but_no_rules_raises():
  mesh = meshlib.make_mesh()
  with jax.set_mesh(mesh), pytest.raises(ValueError, match="no rules"):
    jax.jit(lambda x: meshlib.logical_constraint(x, ("batch",)))(jnp.ones((8,)))


def test_sharded_matmul_equals_unsharded():
  model = Tiny()
  mesh = meshlib.make_mesh(fsdp=4, tensor=2)
  sharded = meshlib.shard_params(nnx.state(model), mesh, FSDP_TP)
  w, down = sharded["w"].get_value(), sharded["down"].get_value()
  assert w.sharding.spec == P("fsdp", "tensor")
  got = jax.jit(lambda a, b: a @ b)(w, down)
  expected = np.asarray(model.w.get_value()) @ np.asarray(model.down.get_value())
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_logical_constraint_places_the_output():
  # A replicated input comes out batch-sharded only because of the constraint.
  mesh = meshlib.make_mesh(data=2, fsdp=4, tensor=1)
  f = jax.jit(lambda x: meshlib.logical_constraint(x * 2, ("batch", "act_embed")))
  with meshlib.use_mesh(mesh, "fsdp_tp"):
    got = f(jnp.ones((16, 3)))
    odd = f(jnp.ones((7, 3)))
  assert got.sharding.is_equivalent_to(NamedSharding(mesh, P(("data", "fsdp"), None)), 2)
  # 7 rows do not split 8 ways: the constraint falls back to replicated instead of failing.
  assert odd.sharding.is_fully_replicated
  np.testing.assert_array_equal(got, 2 * np.ones((16, 3)))


def test_path_str_joins_every_kind_of_key_with_slashes():
  from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

  path = (DictKey("layers"), SequenceKey(0), GetAttrKey("attn"), FlattenedIndexKey(2), DictKey(5))
  assert meshlib.path_str(path) == "layers/0/attn/2/5"
  assert meshlib.path_str(()) == ""


def test_traced_on_gives_a_program_its_mesh_and_rules_unless_the_caller_set_them():
  mesh = meshlib.make_mesh(data=2, fsdp=4, tensor=1)
  seen = []

  def body(x):
    seen.append(meshlib.active_rules())
    return meshlib.logical_constraint(x * 2, ("batch", "act_embed"))

  # On the mesh, replicated (as the engine's params and state are); the abstract mesh is only
  # a context: the devices are the arguments'.
  x = jax.device_put(jnp.ones((16, 3)), NamedSharding(mesh, P()))
  got = jax.jit(meshlib.traced_on(body, mesh, "fsdp_tp"))(x)
  # No context: the program traced under the mesh and rules it was built for, the constraint
  # placed its output, and nothing leaked out of the trace.
  assert seen == [meshlib.RULES["fsdp_tp"]]
  assert got.sharding.is_equivalent_to(NamedSharding(mesh, P(("data", "fsdp"), None)), 2)
  assert meshlib.active_rules() is None and jax.sharding.get_abstract_mesh().empty
  np.testing.assert_array_equal(got, 2 * np.ones((16, 3)))
  # A caller's own context is left as it is (here: other rules, which keep the batch whole).
  whole = (("batch", None), ("act_embed", None))
  with meshlib.use_mesh(mesh, whole):
    kept = jax.jit(meshlib.traced_on(body, mesh, "fsdp_tp"))(x)
  assert seen[-1] == whole and kept.sharding.is_fully_replicated
  # No mesh: the function itself.
  assert meshlib.traced_on(body, None, "fsdp_tp") is body
